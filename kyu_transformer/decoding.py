"""Greedy and beam search over batches, with a key/value cache.

The encoder runs once per batch; the decoder runs one position per step
(`Transformer.decode_step`), reading the keys/values of earlier positions from
the cache instead of recomputing the prefix. Both searches are loops of
`keras.ops.while_loop`, compiled as a whole by `Translator` (`tf.function`),
and stop as soon as every sentence is finished.

Each sentence has its own output limit (EOS included), whatever shares its
batch. Outputs are id matrices `(N, L)`, `L` the largest limit: each row the
generated ids, EOS included (none if cut at the sentence's limit), then
padding (0).
"""

import collections
import functools

import numpy as np
import tensorflow as tf
from keras import ops

from kyu_transformer.special_ids import BOS_ID, EOS_ID, PAD_ID

_NEG_INF = -1.0e9  # score of impossible hypotheses (finite: no NaN in sums)
# The score of a hypothesis that does not exist, where a fixed number of them
# must be given (the SavedModel's `n_best` columns; `Translator` leaves such
# hypotheses out). An empty source has one hypothesis, the empty one, scored 0.
NO_HYPOTHESIS_SCORE = _NEG_INF
# Sentences decoded together by default (eval.py's and export.py's default too):
# the same batches everywhere, so that every path decodes the same arithmetic.
DEFAULT_BATCH_SIZE = 128


def length_penalty(length, alpha):
    """GNMT's ``((5 + length) / 6) ** alpha`` (1 when alpha is 0)."""
    return ops.power((5.0 + ops.cast(length, "float32")) / 6.0, alpha)


def output_limit(source_length, maxlen1, max_length, length_margin):
    """A sentence's most output tokens (EOS included): `Translator`'s limit, for every path.

    Args:
      source_length: Subwords of the source, without EOS: an int, an int array,
        or an int tensor (the SavedModel computes the limits in its graph).
      maxlen1: The encoder's limit (its input is cut to it, EOS included).
      max_length: The most output tokens of any sentence (the model's `maxlen2`
        or less).
      length_margin: Tokens an output may have beyond its (cut) source.

    Returns:
      ``min(max_length, min(source_length + 1, maxlen1) + length_margin)``, of
      the type of `source_length` (numpy for Python ints and numpy arrays).
    """
    if isinstance(source_length, (int, np.integer, np.ndarray, list)):
        source_length = np.asarray(source_length)
        return np.minimum(max_length, np.minimum(source_length + 1, maxlen1) + length_margin)
    return ops.minimum(max_length, ops.minimum(source_length + 1, maxlen1) + length_margin)


def _limits(max_length, batch):
    """``(limits (N,), bound)``: each sentence's most output tokens, and the largest.

    `max_length` is one Python int for the whole batch, or an int tensor `(N,)`
    with one limit per sentence.
    """
    if isinstance(max_length, (int, np.integer)):
        if max_length < 1:
            raise ValueError(f"`max_length` must be at least 1, got {max_length}")
        return ops.full((batch,), int(max_length), "int32"), int(max_length)
    limits = ops.cast(max_length, "int32")
    return limits, ops.max(limits)


def greedy_search(model, source, max_length):
    """The most likely next token, step by step.

    Args:
      model: A `Transformer`.
      source: Source ids `(N, S)` (with EOS, padded with 0).
      max_length: Most output tokens per sentence, EOS included (at least 1):
        a Python int for all, or an int tensor `(N,)` with each sentence's own.
        A sentence that reaches its limit is finished.

    Returns:
      ``(ids (N, L), coverage (N, L, S))`` with `L` the largest limit: ids end
      with EOS then 0 (or fill the sentence's limit without EOS, then 0);
      coverage is the last block's cross-attention averaged over heads.
    """
    memory, source_mask = model.encode(source, training=False)
    batch = ops.shape(source)[0]
    limits, bound = _limits(max_length, batch)
    cache = model.init_cache(memory, source_mask)
    cache["self"] = _relaxed(cache["self"])  # it grows
    outputs = ops.zeros((batch, bound), "int32")
    coverage = ops.zeros((batch, bound, ops.shape(source)[1]), "float32")
    finished = ops.zeros((batch,), "bool")
    last = ops.full((batch,), BOS_ID, "int32")

    def unfinished(step, *_):
        return step < bound

    def body(step, last, outputs, coverage, finished, cache):
        logits, cache, attention = model.decode_step(last, step, cache)
        chosen = ops.cast(ops.argmax(logits, axis=-1), "int32")  # (N,)
        chosen = ops.where(finished, PAD_ID, chosen)  # finished sentences stay padded
        outputs = ops.slice_update(outputs, (0, step), chosen[:, None])
        coverage = ops.slice_update(coverage, (0, step, 0),
                                    ops.cast(attention, "float32")[:, None, :])
        finished = ops.logical_or(finished, ops.logical_or(ops.equal(chosen, EOS_ID),
                                                           ops.greater_equal(step + 1, limits)))
        # Once all are finished, jump to the end (the loop condition is on `step`).
        step = ops.where(ops.all(finished), bound, step + 1)
        return step, chosen, outputs, coverage, finished, cache

    _, _, outputs, coverage, _, _ = ops.while_loop(
        unfinished, body, (0, last, outputs, coverage, finished, cache))
    return outputs, coverage


# Beam search's cache layout. The `K` hypotheses of a sentence share its
# self-attention cache, which grows by `K` slots a position: slot ``l * K + j``
# holds position `l` of the hypothesis that was `j`-th when it was made. The
# cache is never reordered when hypotheses are: `history` `(N, K, l * K)` says
# which slots each alive hypothesis descends from, and moves instead (a small
# boolean tensor rather than every cached key and value). Each step, a
# hypothesis sees its history and its own newest slot: the `self_mask` that
# `DecoderBlock.step` takes.


def own_history(length, hypotheses):
    """Boolean ``(1, K, length*K)`` history of hypotheses never reordered.

    Slot ``l * K + j`` (position `l` of hypothesis `j`) is seen by hypothesis
    `j` alone.
    """
    slots = ops.arange(length * hypotheses)[None, :]  # (1, length*K)
    return ops.equal(slots % hypotheses, ops.arange(hypotheses)[:, None])[None]


def _self_mask(history, batch, k):
    """``history`` `(N, K, l*K)` with each hypothesis' newest slot: `(N, K, (l+1)*K)`."""
    own_slots = ops.broadcast_to(ops.eye(k, dtype="bool")[None], (batch, k, k))  # (N, K, K)
    return ops.concatenate([history, own_slots], axis=2)


def _relaxed(structure):
    """`structure` with its tensors' batch axis (and third, if any) unknown to the graph.

    Sentences leave the batch, and the self-attention cache and the beam
    history grow by one position a step, inside a while-loop; TensorFlow
    allows that only for loop variables whose shape the graph does not fix at
    the start.
    """
    def relax(tensor):
        if not isinstance(tensor, tf.Tensor) or len(tensor.shape) == 0:
            return tensor
        shape = tensor.shape.as_list()
        shape[0] = None
        if len(shape) > 2:
            shape[2] = None
        return tf.raw_ops.PlaceholderWithDefault(input=tensor, shape=shape)

    return tf.nest.map_structure(relax, structure)


def _gather_beams(tensor, indices):
    """Rows of `tensor` `(N, K, ...)` picked per sentence by `indices` `(N, J)`.

    ``tensor[n, indices[n, j], ...]`` `(N, J, ...)`: one gather with a batch axis.

    `ops.take_along_axis` would do it too, but its broadcasting of the index
    shapes adds some sixty graph nodes a call where this adds one; in the
    search's loop body that is a quarter of the graph that tracing builds
    and the runtime optimizes before the first translation.
    """
    return tf.gather(tensor, indices, batch_dims=1)


def _block_width(vocab):
    """A divisor of `vocab` near its square root (the blocks of `_top_k_rows`), or None."""
    root = int(np.sqrt(vocab))
    for distance in range(root // 2):
        for width in (root + distance, root - distance):
            if width > 1 and vocab % width == 0:
                return width
    return None


def _top_k_rows(values, count):
    """``(values, indices)`` of the `count` largest of each row of `values` `(R, V)`.

    The same as ``ops.top_k`` (ties aside), in two cheap stages: the rows are
    cut into blocks of about ``sqrt(V)``, the `count` blocks with the largest
    maxima are kept (they hold every one of the `count` largest values), and
    the top `count` is taken among their elements. A full-row top-k over a
    vocabulary is the slowest op of a CPU beam-search step otherwise.
    Also returns the row maxima `(R, 1)`.
    """
    vocab = values.shape[-1]
    width = _block_width(vocab)
    if width is None or vocab // width <= count:
        best, indices = ops.top_k(values, count)
        return best, indices, ops.max(values, axis=-1, keepdims=True)
    rows = ops.shape(values)[0]
    block_maxima = ops.max(ops.reshape(values, (rows, vocab // width, width)), axis=-1)  # (R, B)
    _, best_blocks = ops.top_k(block_maxima, count)  # (R, count)
    # Gathered as rows of a (R*B, W) matrix: no transpose of the whole input.
    block_rows = best_blocks + ops.arange(rows)[:, None] * (vocab // width)  # (R, count)
    candidates = tf.gather(ops.reshape(values, (-1, width)), block_rows)  # (R, count, W)
    best, flat = ops.top_k(ops.reshape(candidates, (rows, count * width)), count)
    block = _gather_beams(best_blocks, flat // width)
    indices = block * width + flat % width
    return best, indices, ops.max(block_maxima, axis=-1, keepdims=True)


def _top_extensions(logits, alive_scores, count):
    """The `count` best one-token extensions of each sentence's hypotheses.

    Each hypothesis' own best `count` tokens are picked from its logits first
    (a softmax keeps their order), so the full `(N, K, V)` log-softmax is never
    materialised and the final choice is among ``K * count`` candidates.

    Args:
      logits: `(N, K, V)`.
      alive_scores: Log-probabilities of the hypotheses so far `(N, K)`.
      count: How many extensions to keep per sentence.

    Returns:
      ``(scores (N, count), beams (N, count), tokens (N, count))``, best first.
    """
    batch, hypotheses, vocab = ops.shape(logits)[0], logits.shape[1], logits.shape[2]
    rows = ops.reshape(ops.cast(logits, "float32"), (-1, vocab))  # (N*K, V)
    best_logits, best_tokens, maxima = _top_k_rows(rows, count)  # (N*K, count), .., (N*K, 1)
    # logsumexp, reusing the row maxima the top-k has already found (one pass fewer).
    normalizer = maxima + ops.log(ops.sum(ops.exp(rows - maxima), axis=-1, keepdims=True))
    candidates = ops.reshape(best_logits - normalizer, (batch, hypotheses * count))
    candidates = candidates + ops.repeat(alive_scores, count, axis=1)  # (N, K*count)
    scores, flat = ops.top_k(candidates, count)
    beams = flat // count
    tokens = _gather_beams(ops.reshape(best_tokens, (batch, hypotheses * count)), flat)
    return scores, beams, ops.cast(tokens, "int32")


def beam_search(model, source, max_length, beam_size=4, alpha=0.6, n_best=1):
    """Beam search with GNMT length penalty; finished hypotheses kept apart.

    At each step the ``2K`` best extensions of the ``K`` alive hypotheses are
    taken: those ending in EOS compete (scored ``log p / length_penalty``) for
    the ``K`` finished slots, the others for the ``K`` alive slots, so finished
    hypotheses never starve the beam. A sentence is done when its worst
    finished score beats the best its alive hypotheses could still reach, or
    at its own length limit: there its extensions without EOS compete for the
    finished slots too, scored with the length penalty of that limit.

    Args:
      model: A `Transformer`.
      source: Source ids `(N, S)`.
      max_length: Most output tokens per sentence, EOS included (at least 1):
        a Python int for all, or an int tensor `(N,)` with each sentence's own.
      beam_size: `K`.
      alpha: Length-penalty exponent (0: plain log-probability).
      n_best: How many hypotheses to return per sentence (at most `K`).

    Returns:
      ``(ids (N, n_best, L), scores (N, n_best))`` with `L` the largest limit,
      best first. Hypotheses cut at their sentence's limit have no EOS.
    """
    if n_best > beam_size:
        raise ValueError(f"`n_best` ({n_best}) must be at most `beam_size` ({beam_size}): "
                         "the search keeps only `beam_size` hypotheses")
    k = beam_size
    memory, source_mask = model.encode(source, training=False)
    batch = ops.shape(source)[0]
    limits, bound = _limits(max_length, batch)
    # The hypotheses' ids are as wide as any limit can be, whatever the batch's
    # largest: their shapes then repeat from batch to batch (see `_ROW_GROUP`).
    width = max_length if isinstance(max_length, (int, np.integer)) else model.maxlen2
    cache = model.init_cache(memory, source_mask)
    table = cache.pop("target_table")  # shared by all sentences
    # Everything per sentence; `rows` says which sentence of `source` each row
    # is, as finished sentences leave the batch (see `_retire`).
    state = {
        "rows": ops.arange(batch),
        "limits": limits,
        "last": ops.full((batch, k), BOS_ID, "int32"),
        # Which cache slots each hypothesis descends from (see `own_history`).
        "history": ops.zeros((batch, k, 0), "bool"),
        "alive_ids": ops.zeros((batch, k, width), "int32"),
        # Only the first beam is live at the start: the others would duplicate it.
        "alive_scores": ops.tile(ops.convert_to_tensor([[0.0] + [_NEG_INF] * (k - 1)]),
                                 (batch, 1)),
        "finished_ids": ops.zeros((batch, k, width), "int32"),
        "finished_scores": ops.full((batch, k), _NEG_INF),
        "done": ops.zeros((batch,), "bool"),
        "cache": cache,
    }
    results = (ops.zeros((batch, n_best, width), "int32"), ops.full((batch, n_best), _NEG_INF))

    def unfinished(step, *_):
        return step < bound

    def body(step, state, results):
        state = _beam_step(model, table, step, state, k, alpha)
        all_done = ops.all(state["done"])
        # Finished sentences leave the batch once that removes a quarter of
        # its rows: each step costs in proportion to the rows, leaving costs
        # one copy.
        rows = ops.shape(state["done"])[0]
        worth_it = ops.logical_and(ops.logical_not(all_done),
                                   _kept_rows(state["done"]) * 4 <= rows * 3)
        state, results = ops.cond(worth_it, lambda: _retire(state, results, n_best),
                                  lambda: (state, results))
        return ops.where(all_done, bound, step + 1), state, results

    _, state, results = ops.while_loop(unfinished, body, (0, _relaxed(state), results))
    # Every sentence still here is done: at the latest, its limit came.
    ids, scores = _write_results(results, state["rows"], state["finished_ids"][:, :n_best],
                                 state["finished_scores"][:, :n_best])
    return ids[:, :, :bound], scores


def _beam_step(model, table, step, state, k, alpha):
    """One position of beam search for every sentence of `state`."""
    batch = ops.shape(state["last"])[0]
    history = _self_mask(state["history"], batch, k)  # (N, K, (step+1)*K)
    logits, cache, _ = model.decode_step(state["last"], step,
                                         {**state["cache"], "target_table": table}, history)
    cache.pop("target_table")
    top_scores, top_beams, top_tokens = _top_extensions(logits, state["alive_scores"], 2 * k)
    top_ids = ops.slice_update(_gather_beams(state["alive_ids"], top_beams), (0, 0, step),
                               top_tokens[:, :, None])  # (N, 2K, L)
    ends = ops.equal(top_tokens, EOS_ID)

    # Alive: the K best extensions that do not end here.
    alive_scores, alive_pick = ops.top_k(ops.where(ends, _NEG_INF, top_scores), k)  # (N, K)
    alive_ids = _gather_beams(top_ids, alive_pick)
    history = _gather_beams(history, _gather_beams(top_beams, alive_pick))
    last = _gather_beams(top_tokens, alive_pick)

    # Finished: the K best of those kept so far and those ending here; at a
    # sentence's limit every extension ends (its penalty is that of the limit).
    done, limits = state["done"], state["limits"]
    at_limit = ops.greater_equal(step + 1, limits)  # (N,)
    ending = ops.logical_or(ends, at_limit[:, None])
    ended_scores = ops.where(ending, top_scores / length_penalty(step + 1, alpha), _NEG_INF)
    ended_scores = ops.where(done[:, None], _NEG_INF, ended_scores)
    pool_scores = ops.concatenate([state["finished_scores"], ended_scores], axis=1)  # (N, 3K)
    pool_ids = ops.concatenate([state["finished_ids"], top_ids], axis=1)
    finished_scores, finished_pick = ops.top_k(pool_scores, k)
    finished_ids = _gather_beams(pool_ids, finished_pick)

    # Done: the best alive score can only fall; with the largest penalty
    # it may still get (at its own limit) it cannot beat the worst finished.
    best_possible = alive_scores[:, 0] / length_penalty(limits, alpha)
    worst_finished = finished_scores[:, k - 1]
    beaten = ops.logical_and(worst_finished > _NEG_INF / 2, best_possible < worst_finished)
    done = ops.logical_or(done, ops.logical_or(at_limit, beaten))
    return {"rows": state["rows"], "limits": limits, "last": last, "history": history,
            "alive_ids": alive_ids, "alive_scores": alive_scores, "finished_ids": finished_ids,
            "finished_scores": finished_scores, "done": done, "cache": cache}


# Rows leave the batch in groups: the undone sentences, topped up with done
# ones to a multiple of `_ROW_GROUP` rows. The first run of each new tensor
# shape pays the kernels' per-shape set-up; with rows counted in groups (and
# ids of a fixed width), a batch meets the shapes earlier batches met, and the
# first translation of a test set costs little more than the next ones. A done
# sentence that stays is frozen (its finished hypotheses no longer change).
_ROW_GROUP = 16


def _kept_rows(done):
    """How many rows stay when the done sentences leave: the undone, rounded up to a group."""
    undone = ops.sum(ops.cast(ops.logical_not(done), "int32"))
    return ops.minimum(ops.shape(done)[0], -(-undone // _ROW_GROUP) * _ROW_GROUP)


def _retire(state, results, n_best):
    """Writes the done sentences' best hypotheses to `results`; keeps the undone ones.

    A few done sentences may stay, to round the rows up (see `_ROW_GROUP`);
    they are written again, unchanged, when they leave.
    """
    leaving = ops.nonzero(state["done"])[0]
    results = _write_results(
        results, tf.gather(state["rows"], leaving),
        tf.gather(state["finished_ids"], leaving)[:, :n_best],
        tf.gather(state["finished_scores"], leaving)[:, :n_best])
    undone_first = ops.argsort(ops.cast(state["done"], "int32"))
    staying = undone_first[:_kept_rows(state["done"])]
    # `tf.gather`, not `ops.take`: the indices are never negative, and Keras'
    # wrapping of negative ones would add nodes for every tensor of the state.
    state = tf.nest.map_structure(lambda tensor: tf.gather(tensor, staying), state)
    return state, results


def _write_results(results, rows, ids, scores):
    """`results` ``(ids, scores)`` with `rows` set to `ids` and `scores`."""
    return (ops.scatter_update(results[0], rows[:, None], ids),
            ops.scatter_update(results[1], rows[:, None], scores))


def sequence_log_probs(model, source, outputs):
    """Model log-probability of each output `(N, L)` (EOS included, padding not)."""
    target_in = ops.concatenate(
        [ops.full((ops.shape(outputs)[0], 1), BOS_ID, "int32"), outputs[:, :-1]], axis=1)
    target_in = ops.where(ops.equal(outputs, PAD_ID), PAD_ID, target_in)
    logits = model({"source": source, "target_in": target_in}, training=False)
    log_probs = ops.log_softmax(ops.cast(logits, "float32"), axis=-1)
    picked = ops.take_along_axis(log_probs, ops.cast(outputs, "int32")[..., None], axis=-1)[..., 0]
    return ops.sum(ops.where(ops.equal(outputs, PAD_ID), 0.0, picked), axis=1)


class ScoredOutput(collections.namedtuple("ScoredOutput",
                                          "log_prob tokens score truncated")):
    """An output's log-probability, its length in tokens and its score (see `Translator`).

    `tokens` counts EOS; `truncated` says the output was cut to the
    Translator's `max_length` (then without EOS).
    """


def _strip(ids):
    """A decoded row as a list, EOS and what follows removed (padding included)."""
    output = ids.tolist()
    output = output[:output.index(EOS_ID)] if EOS_ID in output else output
    return [i for i in output if i != PAD_ID]


def _pad_ids(sequences, width=None):
    width = width or max(len(s) for s in sequences)
    padded = np.zeros((len(sequences), width), dtype="int32")
    for row, sequence in enumerate(sequences):
        padded[row, :len(sequence)] = sequence
    return padded


class Translator:
    """Batched translation of subword ids or text with a trained `Transformer`.

    Each sentence's output is limited on its own, whatever shares its batch:
    at most ``min(max_length, source length + length_margin)`` tokens, EOS
    included, the source length being the one the encoder reads (EOS
    included, after cutting to `maxlen1`).

    Args:
      model: The `Transformer`.
      beam_size: 1 for greedy search, else beam search.
      alpha: Length-penalty exponent of beam search.
      max_length: Most output tokens (at most the model's `maxlen2`, which is
        the default).
      length_margin: How many tokens an output may have beyond its source's.
      jit_compile: Compile the search with XLA.

    After each `translate_ids` or `translate`, `truncated_sources` counts the
    sources cut to `maxlen1` and `truncated_outputs` the outputs stopped at
    their limit without EOS (the best hypothesis of each, with `n_best`).

    A hypothesis' score (`translate_ids` with `n_best`) is the one beam search
    ranks by: its log-probability, EOS included, divided by GNMT's length
    penalty of its length (EOS included) with `alpha` (`length_penalty`).
    """

    def __init__(self, model, beam_size=1, alpha=0.6, max_length=None, length_margin=16,
                 jit_compile=False):
        self.model = model
        self.beam_size = int(beam_size)
        self.alpha = float(alpha)
        self.max_length = int(max_length or model.maxlen2)
        self.length_margin = int(length_margin)
        self.truncated_sources = 0
        self.truncated_outputs = 0
        _check_settings(self.beam_size, self.max_length, self.length_margin, model.maxlen2)
        # One trace serves every batch: source shape and limits are dynamic (a
        # retrace per batch shape would cost more than decoding). The searches
        # write their control flow as `ops.while_loop` / `ops.cond`, so there is
        # nothing for AutoGraph to convert, and without it tracing (the first
        # call's main cost) does not rewrite every function the search calls.
        signature = [tf.TensorSpec((None, None), tf.int32), tf.TensorSpec((None,), tf.int32)]
        compiled = functools.partial(tf.function, jit_compile=jit_compile, autograph=False)
        self._greedy = compiled(self._greedy_fn, input_signature=signature)
        self._beam = compiled(self._beam_fn, input_signature=signature)
        # All `beam_size` hypotheses and their scores; `n_best` slices them,
        # so one trace serves every `n_best`.
        self._beam_all = compiled(self._beam_all_fn, input_signature=signature)
        self._log_probs = compiled(self._log_probs_fn, input_signature=signature[:1] * 2)

    def _greedy_fn(self, source, limits):
        return greedy_search(self.model, source, limits)

    def _beam_fn(self, source, limits):
        ids, _ = beam_search(self.model, source, limits, self.beam_size, self.alpha)
        return ids[:, 0]

    def _beam_all_fn(self, source, limits):
        return beam_search(self.model, source, limits, self.beam_size, self.alpha,
                           n_best=self.beam_size)

    def _log_probs_fn(self, source, outputs):
        return sequence_log_probs(self.model, source, outputs)

    def _limits(self, source):
        """Each sentence's most output tokens `(N,)`, from its encoder input `source` `(N, S)`."""
        # The encoder input holds EOS (unless cut away): the source had one token fewer.
        lengths = np.count_nonzero(source, axis=1) - 1
        return output_limit(lengths, self.model.maxlen1, self.max_length,
                            self.length_margin).astype("int32")

    def _encoder_input(self, batch):
        """Padded source ids `(N, S)` of a batch of id lists: EOS added, cut to `maxlen1`."""
        return _pad_ids([list(ids) + [EOS_ID] for ids in batch])[:, :self.model.maxlen1]

    def _decode(self, batch, with_coverage):
        """``(ids (N, L), coverage (N, L, S) or None)`` of a batch of id lists (EOS not added)."""
        source = self._encoder_input(batch)
        limits = tf.constant(self._limits(source))
        if self.beam_size > 1:
            return self._beam(tf.constant(source), limits).numpy(), None
        ids, coverage = self._greedy(tf.constant(source), limits)
        return ids.numpy(), (coverage.numpy() if with_coverage else None)

    def _decode_n_best(self, batch, n_best):
        """``(ids (N, n_best, L), scores (N, n_best))`` of a batch of id lists, best first."""
        source = self._encoder_input(batch)
        limits = tf.constant(self._limits(source))
        if self.beam_size > 1:
            ids, scores = self._beam_all(tf.constant(source), limits)
            return ids.numpy()[:, :n_best], scores.numpy()[:, :n_best]
        # Greedy search keeps no score: the model gives it, as beam search would.
        ids = self._greedy(tf.constant(source), limits)[0].numpy()
        scores = self._normalized(self._log_probs(source, ids).numpy(),
                                  np.count_nonzero(ids, axis=1))
        return ids[:, None], scores[:, None]

    def _normalized(self, log_probs, lengths):
        """`log_probs` divided by GNMT's length penalty of `lengths` (EOS included)."""
        return np.asarray(log_probs) / np.asarray(length_penalty(lengths, self.alpha), "float64")

    def translate_ids(self, source_ids, batch_size=DEFAULT_BATCH_SIZE, with_coverage=False,
                      n_best=None):
        """Lists of output ids (EOS and padding removed), in the order given.

        Sentences are decoded in batches of similar source length; which
        sentences share a batch does not change any output. Empty sources give
        empty outputs without being decoded.

        Args:
          source_ids: Lists of subword ids, without EOS.
          batch_size: Most sentences decoded together.
          with_coverage: Also return each output's cross-attention `(L, S)`
            (greedy search only: a beam Translator refuses it).
          n_best: Return the `n_best` best hypotheses of each sentence (at most
            `beam_size`) and their scores instead of the best one.

        Returns:
          The output lists, and with `with_coverage` also the coverages (None
          for empty sources). With `n_best`, ``(hypotheses, scores)``: per
          sentence a list of `n_best` output lists, best first, and their
          scores (see the class); an empty source has one empty hypothesis,
          scored 0 (it is not decoded).
        """
        self._check_request(batch_size, with_coverage, n_best)
        if n_best:
            return self._translate_n_best(source_ids, batch_size, n_best)
        results = [[] for _ in source_ids]
        coverages = [None for _ in source_ids]
        for rows in self._batches(source_ids, batch_size):
            ids, coverage = self._decode([source_ids[i] for i in rows], with_coverage)
            for row, index in enumerate(rows):
                results[index] = self._output(ids[row])
                if with_coverage:
                    coverages[index] = coverage[row]
        return (results, coverages) if with_coverage else results

    def _translate_n_best(self, source_ids, batch_size, n_best):
        """``(hypotheses, scores)`` of `translate_ids` with `n_best`."""
        hypotheses = [[[]] for _ in source_ids]
        scores = [[0.0] for _ in source_ids]
        for rows in self._batches(source_ids, batch_size):
            ids, batch_scores = self._decode_n_best([source_ids[i] for i in rows], n_best)
            for row, index in enumerate(rows):
                hypotheses[index], scores[index] = self._hypotheses(ids[row], batch_scores[row])
        return hypotheses, scores

    def _batches(self, source_ids, batch_size):
        """Yields the indices of the non-empty sources, in batches of similar length.

        Starts the counts of truncated sources and outputs afresh.
        """
        # Sources the encoder cannot take whole are cut to its `maxlen1` (and counted).
        self.truncated_sources = sum(len(ids) + 1 > self.model.maxlen1 for ids in source_ids)
        self.truncated_outputs = 0
        order = sorted((i for i, ids in enumerate(source_ids) if ids),
                       key=lambda i: len(source_ids[i]))
        for first in range(0, len(order), batch_size):
            yield order[first:first + batch_size]

    def _check_request(self, batch_size, with_coverage, n_best):
        """Raises ValueError naming a `translate_ids` argument this Translator cannot honour."""
        if with_coverage and self.beam_size > 1:
            raise ValueError(f"`with_coverage` needs greedy search, but this Translator has "
                             f"beam_size={self.beam_size}: the beam's own attention is not "
                             "recorded; use a Translator with beam_size=1")
        if batch_size < 1:
            raise ValueError(f"`batch_size` must be at least 1, got {batch_size}")
        if n_best is None:
            return
        if not 1 <= n_best <= self.beam_size:
            raise ValueError(f"`n_best` ({n_best}) must be between 1 and `beam_size` "
                             f"({self.beam_size}): the search keeps only `beam_size` "
                             "hypotheses")
        if with_coverage:
            raise ValueError("`with_coverage` and `n_best` exclude each other: coverage is "
                             "recorded for the greedy output only")

    def _output(self, ids):
        """A decoded row as a list, EOS and padding removed; counts it if cut at its limit."""
        self.truncated_outputs += EOS_ID not in ids  # it stopped at its limit
        return _strip(ids)

    def _hypotheses(self, ids, scores):
        """``(outputs, scores)`` of one sentence's rows `(n_best, L)`; the best one is counted.

        Rows scored as impossible (fewer real hypotheses than asked) are left out.
        """
        kept = [0] + [row for row in range(1, len(ids)) if scores[row] > _NEG_INF / 2]
        outputs = [self._output(ids[0])] + [_strip(ids[row]) for row in kept[1:]]
        return outputs, [float(scores[row]) for row in kept]

    def score_ids(self, source_ids, target_ids, batch_size=DEFAULT_BATCH_SIZE):
        """The model's scores of given outputs (forced decoding), in the order given.

        A source is read as for translation (EOS added, cut to `maxlen1`); a
        target gets EOS and is cut to `max_length` tokens if longer, EOS then
        left out, as beam search scores a hypothesis cut at its limit.

        Args:
          source_ids: Lists of source subword ids, without EOS.
          target_ids: As many lists of output subword ids, without EOS.
          batch_size: Most sentences scored together.

        Returns:
          A `ScoredOutput` per sentence. `truncated_sources` counts the sources
          cut, `truncated_outputs` the targets cut.
        """
        if len(source_ids) != len(target_ids):
            raise ValueError(f"{len(source_ids)} sources but {len(target_ids)} targets")
        if batch_size < 1:
            raise ValueError(f"`batch_size` must be at least 1, got {batch_size}")
        targets = [(list(ids) + [EOS_ID])[:self.max_length] for ids in target_ids]
        self.truncated_sources = sum(len(ids) + 1 > self.model.maxlen1 for ids in source_ids)
        self.truncated_outputs = sum(len(ids) + 1 > self.max_length for ids in target_ids)
        # Sorted by length, so a batch pads little.
        log_probs = np.zeros(len(targets))
        order = sorted(range(len(targets)), key=lambda i: len(targets[i]))
        for first in range(0, len(order), batch_size):
            rows = order[first:first + batch_size]
            source = self._encoder_input([source_ids[i] for i in rows])
            outputs = _pad_ids([targets[i] for i in rows])
            log_probs[rows] = self._log_probs(source, outputs).numpy()
        lengths = np.array([len(ids) for ids in targets])
        scores = self._normalized(log_probs, lengths)
        cut = [len(ids) + 1 > self.max_length for ids in target_ids]
        return [ScoredOutput(*values) for values in
                zip(log_probs.tolist(), lengths.tolist(), scores.tolist(), cut)]

    def translate(self, sentences, subwords, batch_size=DEFAULT_BATCH_SIZE):
        """Detokenized translations of raw `sentences` (empty in, empty out)."""
        source_ids = subwords.encode(sentences)
        return [subwords.decode(ids) for ids in self.translate_ids(source_ids, batch_size)]


def _check_settings(beam_size, max_length, length_margin, maxlen2):
    """Raises ValueError naming a `Translator` setting out of range."""
    if beam_size < 1:
        raise ValueError(f"`beam_size` must be at least 1, got {beam_size}")
    if not 1 <= max_length <= maxlen2:
        raise ValueError(f"`max_length` must be in [1, {maxlen2}] (the model's maxlen2), "
                         f"got {max_length}")
    if length_margin < 0:
        raise ValueError(f"`length_margin` must be at least 0, got {length_margin}")


def recompute_greedy_search(model, source, max_length):
    """Greedy search without a cache: the whole prefix is decoded again each step.

    The baseline that the cache is measured against (and checked by): same
    outputs as `greedy_search`, cost growing with the square of the length.
    """
    memory, source_mask = model.encode(source, training=False)
    batch = ops.shape(source)[0]
    # Column 0 holds BOS; step t decodes columns 0..t and writes column t + 1.
    prefix = ops.concatenate([ops.full((batch, 1), BOS_ID, "int32"),
                              ops.zeros((batch, max_length), "int32")], axis=1)
    finished = ops.zeros((batch,), "bool")

    def unfinished(step, *_):
        return step < max_length

    def body(step, prefix, finished):
        logits = model.decode(prefix[:, :step + 1], memory, source_mask, training=False)
        chosen = ops.cast(ops.argmax(logits[:, -1], axis=-1), "int32")
        chosen = ops.where(finished, PAD_ID, chosen)
        prefix = ops.slice_update(prefix, (0, step + 1), chosen[:, None])
        finished = ops.logical_or(finished, ops.equal(chosen, EOS_ID))
        return ops.where(ops.all(finished), max_length, step + 1), prefix, finished

    _, prefix, _ = ops.while_loop(unfinished, body, (0, prefix, finished))
    return prefix[:, 1:]
