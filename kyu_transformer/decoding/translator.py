"""Translates for every engine: sources in, translations out, as `SearchSettings` say.

The front end (`Engine`) adds EOS and cuts sources (`encoder_inputs`), limits each output
(`Engine.output_limits`), orders sentences by length (`decoding_order`), batches them
(`Engine._batches`) and cuts outputs at EOS (`conventions.cut_at_end`); an engine (`Translator`,
`export.ctranslate2.CTranslate2Translator`) decodes one batch (`_decode`). The SavedModel runs
the TensorFlow parts of it in its graph.
"""

import collections
import functools

import numpy as np
import tensorflow as tf

from kyu_transformer.conventions import BOS_ID, EOS_ID, PAD_ID, cut_at_end
from kyu_transformer.decoding.scoring import padded_ids, score_outputs, sequence_log_probs
from kyu_transformer.decoding.search import NO_HYPOTHESIS_SCORE, output_limit, search, strategy_for
from kyu_transformer.decoding.settings import SearchSettings, checked_max_length


def encoder_inputs(ids, maxlen1):
    """Returns ragged source ids `(N, None)` as the encoder reads them: EOS added, cut to
    `maxlen1`."""
    eos = tf.RaggedTensor.from_tensor(tf.fill([ids.nrows(), 1], tf.constant(EOS_ID, ids.dtype)))
    return tf.concat([ids, eos], axis=1)[:, :maxlen1]


def decoding_order(lengths, prefix_lengths=None):
    """Returns the indices of the sentences to decode `(M,)`: those with a source or a prefix,
    shortest source first (a stable sort)."""
    decoded = lengths > 0
    if prefix_lengths is not None:
        decoded = tf.logical_or(decoded, prefix_lengths > 0)
    chosen = tf.cast(tf.where(decoded)[:, 0], tf.int32)
    return tf.gather(chosen, tf.argsort(tf.gather(lengths, chosen), stable=True))


def check_prefix_ids(prefix_ids, count):
    """Returns `prefix_ids` (None, or one list of ids per source) once checked: `count` of
    them, holding no padding, BOS or EOS (a prefix is what the output starts with)."""
    if prefix_ids is None:
        return None
    prefix_ids = [list(ids) for ids in prefix_ids]
    if len(prefix_ids) != count:
        raise ValueError(f"{count} sources but {len(prefix_ids)} prefixes: give one per source "
                         "(empty for none)")
    for index, ids in enumerate(prefix_ids):
        if any(i in (PAD_ID, BOS_ID, EOS_ID) for i in ids):
            raise ValueError(f"prefix {index}: holds padding, BOS or EOS ({ids}); a prefix is "
                             "the output's first subwords")
    return prefix_ids


def real_hypotheses(scores):
    """Returns the columns of a sentence's hypothesis `scores` that hold a hypothesis: the first,
    and those not scored as impossible (a search may find fewer than asked)."""
    return [0] + [j for j in range(1, len(scores)) if scores[j] > NO_HYPOTHESIS_SCORE / 2]


def ragged(sequences):
    """Returns lists of ids as a ragged int32 tensor `(N, None)`."""
    lengths = [len(sequence) for sequence in sequences]
    flat = np.fromiter((i for sequence in sequences for i in sequence), "int32", sum(lengths))
    return tf.RaggedTensor.from_row_lengths(flat, np.asarray(lengths, "int64"))


class Translations(collections.namedtuple(
        "Translations", "hypotheses scores ended coverages token_log_probs truncated_sources "
        "truncated_outputs truncated_prefixes")):
    """Holds what `Engine.translate_ids` gives, per source in order.

    `hypotheses`: output ids (EOS, padding removed), best first (an empty source without a
    prefix: one empty, scored 0, undecoded); `ended`: whether each ended with EOS (else it was
    cut at its limit); `truncated_sources`, `truncated_outputs`, `truncated_prefixes`: how many
    sources were cut to ``maxlen1``, best outputs at their limit, and prefixes cut to their
    sentence's limit. The other fields are None unless asked for (and for an empty source).
    """

    @property
    def outputs(self):
        """Returns each sentence's best output."""
        return [hypotheses[0] for hypotheses in self.hypotheses]


# What one `Engine.translate_ids` call asks of each batch's `_decode`.
Request = collections.namedtuple("Request", "n_best scored with_coverage with_log_probs seed")


class Engine:
    """Runs the front end every engine shares, by `settings` (default `SearchSettings()`) with
    `fields` replaced, and the model's limits `maxlen1`, `maxlen2`; each engine (a subclass)
    decodes one batch (`_decode`)."""

    coverage = log_probs = False  # what an engine can give besides outputs

    def __init__(self, maxlen1, maxlen2, settings=None, **fields):
        self.maxlen1, self.settings = maxlen1, (settings or SearchSettings()).replace(**fields)
        self.max_length = checked_max_length(self.settings.max_length or maxlen2, maxlen2)

    def output_limits(self, source_lengths):
        """Returns each sentence's most output tokens (`search.output_limit`) from the lengths
        of the sources without EOS, a numpy array or a tensor (the limits come back as the
        same)."""
        return output_limit(source_lengths, self.maxlen1, self.max_length,
                            self.settings.length_margin)

    def _batches(self, order):
        """Splits the sentence indices `order` into consecutive slices of at most
        `batch_size`: the batches of `translate_ids` and `score_ids`."""
        size = self.settings.batch_size
        return [order[first:first + size] for first in range(0, len(order), size)]

    def translate_ids(self, source_ids, n_best=None, with_coverage=False, with_log_probs=False,
                      seed=None, prefix_ids=None):
        """Translates lists of subword ids without EOS into `Translations` (batching changes no
        output).

        `n_best` hypotheses are scored (default the settings' `n_best`, unscored); `with_coverage`
        adds cross-attentions `(L, S)`, `with_log_probs` per-token log-probabilities; `seed`
        (sampling's) defaults to the settings'; `prefix_ids`: None, or each source's prefix (ids
        every output of it starts with, cut to the sentence's output limit; empty for none).
        """
        n = n_best or self.settings.n_best
        self._check_request(n, with_coverage, with_log_probs, seed)
        prefix_ids = check_prefix_ids(prefix_ids, len(source_ids))
        found = {"hypotheses": [[[]] for _ in source_ids], "scores": [[0.0] for _ in source_ids],
                 "ended": [[True] for _ in source_ids], "coverages": [None] * len(source_ids),
                 "token_log_probs": [[] if with_log_probs else None for _ in source_ids]}
        ids = ragged(source_ids)
        lengths = ids.row_lengths().numpy()
        inputs = encoder_inputs(ids, self.maxlen1)
        limits = self.output_limits(lengths).astype("int32")
        cut_prefixes = 0
        if prefix_ids is not None:
            cut_prefixes = int(sum(len(p) > limit for p, limit in zip(prefix_ids, limits)))
            prefix_ids = [p[:limit] for p, limit in zip(prefix_ids, limits.tolist())]
        prefix_lengths = None
        if prefix_ids is not None:
            prefix_lengths = tf.constant([len(p) for p in prefix_ids], tf.int64)
        order = decoding_order(tf.constant(lengths), prefix_lengths).numpy()
        request = Request(n, n_best is not None, with_coverage, with_log_probs,
                          self.settings.seed if seed is None else int(seed))
        for rows in self._batches(order):
            prefixes = None if prefix_ids is None else [prefix_ids[i] for i in rows]
            batch = self._decode(tf.gather(inputs, rows), limits[rows], rows, prefixes, request)
            self._keep(found, rows, batch)
        return Translations(
            found["hypotheses"], found["scores"] if n_best else None, found["ended"],
            found["coverages"] if with_coverage else None,
            found["token_log_probs"] if with_log_probs else None,
            self._cut_sources(lengths), sum(not found["ended"][i][0] for i in order),
            cut_prefixes)

    def _cut_sources(self, lengths):
        """Counts the sources of these lengths (without EOS) that `encoder_inputs` cuts."""
        return int(np.sum(np.asarray(lengths) + 1 > self.maxlen1))

    @staticmethod
    def _keep(found, rows, batch):
        """Puts a batch's `_decode` results into `found`, at its sentences' `rows`."""
        ids = batch["ids"]  # (n, K, L)
        outputs = [cut_at_end(row) for row in ids.reshape(-1, ids.shape[-1]).tolist()]
        ended = np.any(ids == EOS_ID, axis=2)
        k = ids.shape[1]
        for row, index in enumerate(rows):
            scores = batch["scores"][row] if batch["scores"] is not None else np.zeros(k)
            kept = real_hypotheses(scores)
            found["hypotheses"][index] = [outputs[row * k + j] for j in kept]
            found["scores"][index] = [float(scores[j]) for j in kept]
            found["ended"][index] = [bool(ended[row, j]) for j in kept]
            for name in ("coverages", "token_log_probs"):
                if batch.get(name) is not None:
                    found[name][index] = batch[name][row]

    def _check_request(self, n_best, with_coverage, with_log_probs, seed):
        """Raises ValueError naming a `translate_ids` argument this engine cannot honour."""
        settings = self.settings
        settings.replace(n_best=n_best, seed=settings.seed if seed is None else seed)
        for asked, can, name in ((with_coverage, self.coverage, "with_coverage"),
                                 (with_log_probs, self.log_probs, "with_log_probs")):
            if asked and not can:
                raise ValueError(f"`{name}` is not given by {type(self).__name__}")
            if asked and (settings.beam_size > 1 or settings.sampling or n_best > 1):
                raise ValueError(f"`{name}` needs greedy search of one hypothesis, but this "
                                 f"{type(self).__name__} has beam_size={settings.beam_size}"
                                 f"{', sampling' if settings.sampling else ''} and n_best="
                                 f"{n_best}: it is recorded for the greedy output only")

    def translate_texts(self, sentences, subwords, prefixes=None, n_best=None, seed=None):
        """Translates raw `sentences` (empty in, empty out) with `subwords`; returns
        ``(texts, scores)``: each sentence's hypotheses' texts, best first, and their scores (None
        unless `n_best` is given). `prefixes`: None, or one raw text per sentence that its
        outputs start with (empty for none); `n_best`, `seed`: as `translate_ids` takes them."""
        prefix_ids = None
        if prefixes is not None:
            prefix_ids = subwords.encode([prefix or "" for prefix in prefixes])
        found = self.translate_ids(subwords.encode(sentences), n_best=n_best, seed=seed,
                                   prefix_ids=prefix_ids)
        texts = [[subwords.decode(ids) for ids in hypotheses] for hypotheses in found.hypotheses]
        return texts, found.scores

    def translate(self, sentences, subwords, prefixes=None):
        """Returns the best translation of each raw sentence (`translate_texts`)."""
        texts, _ = self.translate_texts(sentences, subwords, prefixes)
        return [best for best, *_ in texts]

    def replaced(self, **fields):
        """Returns this engine with its settings' `fields` replaced."""
        raise NotImplementedError


class Translator(Engine):
    """Translates in batches with a trained `Transformer`, by `settings` (a `SearchSettings`,
    default its defaults) with `fields` replaced; `jit_compile` compiles with XLA."""

    coverage = True

    def __init__(self, model, settings=None, jit_compile=False, **fields):
        super().__init__(model.maxlen1, model.maxlen2, settings, **fields)
        self.model, self.jit_compile = model, jit_compile
        # One trace serves every batch (shapes and limits are dynamic). No AutoGraph: the
        # control flow is already `ops.while_loop` / `ops.cond`, so it has nothing to convert.
        self._compiled = functools.partial(tf.function, jit_compile=jit_compile, autograph=False)
        self._searches = {}
        self._log_probs = self._compiled(
            lambda source, outputs: sequence_log_probs(self.model, source, outputs),
            input_signature=[tf.TensorSpec((None, None), tf.int32)] * 2)

    def replaced(self, **fields):
        return Translator(self.model, self.settings.replace(**fields), self.jit_compile)

    def search_function(self, n_best, scores=True, prefixed=False):
        """Returns the compiled search (one per `n_best` and `prefixed`; the SavedModel calls it
        too): ``(source (N, S), limits (N,), sentences (N,), seed) -> Hypotheses``, and a last
        argument ``prefix (N, P)`` (`search`'s) if `prefixed`."""
        # Only greedy search can leave scores out.
        key = (n_best, scores or self.settings.beam_size > 1 or self.settings.sampling, prefixed)
        if key not in self._searches:
            def run(source, limits, sentences, seed, prefix=None):
                strategy = strategy_for(self.settings, n_best, key[1], seed, sentences)
                return search(self.model, source, limits, strategy, prefix)

            signature = [tf.TensorSpec((None, None), tf.int32), tf.TensorSpec((None,), tf.int32),
                         tf.TensorSpec((None,), tf.int32), tf.TensorSpec((), tf.int64)]
            if prefixed:
                signature.append(tf.TensorSpec((None, None), tf.int32))
            self._searches[key] = self._compiled(run, input_signature=signature)
        return self._searches[key]

    def _decode(self, inputs, limits, sentences, prefixes, request):
        arguments = [inputs.to_tensor(), tf.constant(limits), tf.constant(sentences, tf.int32),
                     tf.constant(request.seed, tf.int64)]
        if prefixes is not None:
            arguments.append(tf.constant(padded_ids(prefixes)))
        found = self.search_function(request.n_best, request.scored,
                                     prefixes is not None)(*arguments)
        n_best = request.n_best
        return {"ids": found.ids.numpy()[:, :n_best],
                "scores": found.scores.numpy()[:, :n_best] if found.scores is not None else None,
                "coverages": found.coverage.numpy() if request.with_coverage else None}

    def score_ids(self, source_ids, target_ids):
        """Scores the given outputs by forced decoding (`scoring.score_outputs`, with this
        translator's limits and alpha); returns ``(scored, truncated_sources)``."""
        return score_outputs(self._log_probs, source_ids, target_ids,
                             (self.maxlen1, self.max_length, self.settings.alpha),
                             self.settings.batch_size)
