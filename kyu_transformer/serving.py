"""A trained `Transformer` as a TensorFlow SavedModel: raw text in, n-best translations out.

`build_module` wraps the model in a `tf.Module` whose signatures decode
exactly as `decoding.Translator` does: EOS appended to each source, sources
cut to ``maxlen1``, each sentence's own output limit
``min(maxlen2, source length (EOS included, after the cut) + length_margin)``,
the same `decoding.search`, and sentences decoded in batches
of similar length. Its signatures:

- ``serving_default`` (needs tensorflow-text's ops): ``text``, a string
  tensor `(N,)` of raw sentences, to ``translations`` `(N,)` (the best
  hypothesis, detokenized), ``n_best`` `(N, K)` and ``scores`` `(N, K)`
  float32, best first;
- ``ids`` (TensorFlow's own ops only): ``ids``, int32 subword ids `(N, S)`
  padded with 0, without EOS, to ``ids`` `(N, K, L)` (EOS removed, padded
  with 0) and ``scores`` `(N, K)`.

A score is the one beam search ranks by: the hypothesis' log-probability,
EOS included, divided by GNMT's length penalty of its length (EOS included).
An empty sentence is not decoded: its one hypothesis is the empty one, scored
0, as `Translator` gives it. Every sentence has `K` columns: those without a
hypothesis (an empty sentence's others; a beam that found fewer than `K`)
hold an empty one scored `decoding.NO_HYPOTHESIS_SCORE` (-1e9), where
`Translator` leaves them out.

The subword model goes into the SavedModel as an asset
(``assets/subwords.model``), for clients of the ids signature. The text
signature's tokenizer holds the same bytes in the graph itself: the op of
tensorflow-text's `SentencepieceTokenizer` takes its model as an attribute,
not as a tensor that could be read from the asset when the SavedModel loads.

The TensorFlow-only parts of exporting (tf.Module, tf.saved_model,
tensorflow-text) live here, not in the layers.
"""

import dataclasses
import os

import tensorflow as tf

from kyu_transformer.decoding import (DEFAULT_BATCH_SIZE, NO_HYPOTHESIS_SCORE, output_limit,
                                      search, strategy_for)
from kyu_transformer.special_ids import BOS_ID, EOS_ID, PAD_ID

TEXT_SIGNATURE = "serving_default"
IDS_SIGNATURE = "ids"
SERVE_EXTRA = 'pip install -e ".[serve]"'

# What `data.normalize_line` (Python's `str.split`) folds: every character
# `str.isspace` accepts. RE2's `\s` alone misses \v, \x1c-\x1f, \x85 and the
# Unicode spaces (no-break space among them).
_WHITE_SPACE = r"[\t\n\x{0b}\x{0c}\r\x{1c}-\x{1f}\x{85}\p{Z}]+"


@dataclasses.dataclass(frozen=True)
class SearchSettings:
    """How the exported signatures decode (the flags of eval.py and export.py).

    Attributes:
      beam_size: 1 for greedy search, else beam search.
      alpha: Length-penalty exponent (beam search's ranking, and every score).
      n_best: Hypotheses returned per sentence (at most `beam_size`).
      length_margin: How many tokens an output may have beyond its source's.
      batch_size: Most sentences decoded together inside the graph.
    """

    beam_size: int = 4
    alpha: float = 0.6
    n_best: int = 1
    length_margin: int = 16
    batch_size: int = DEFAULT_BATCH_SIZE

    def __post_init__(self):
        for name, least in (("beam_size", 1), ("n_best", 1), ("length_margin", 0),
                            ("batch_size", 1)):
            if getattr(self, name) < least:
                raise ValueError(f"`{name}` must be at least {least}, got {getattr(self, name)}")
        if self.n_best > self.beam_size:
            raise ValueError(f"`n_best` ({self.n_best}) must be at most `beam_size` "
                             f"({self.beam_size}): the search keeps only `beam_size` hypotheses")


def import_tensorflow_text():
    """The tensorflow_text module, or None where it is not installed."""
    try:
        import tensorflow_text
    except ImportError:
        return None
    return tensorflow_text


class _Decoder:
    """The searches of `decoding`, run over any number of sentences inside one graph."""

    def __init__(self, model, settings):
        self.model = model
        self.settings = settings
        self.strategy = strategy_for(settings.beam_size, settings.alpha, settings.n_best)
        # One function that both signatures call: the SavedModel holds the
        # search's graph once, and loading it reads that graph once.
        self.search = tf.function(
            self._search, autograph=False,
            input_signature=[tf.TensorSpec((None, None), tf.int32),
                             tf.TensorSpec((None,), tf.int32)])

    def _search(self, source, limits):
        """``(ids (n, K, L), scores (n, K))`` of one batch of encoder inputs `(n, S)`."""
        found = search(self.model, source, limits, self.strategy)
        return found.ids, found.scores

    def encoder_inputs(self, ids):
        """``(sources, limits)``: EOS appended, cut to `maxlen1`; each output's limit.

        Args:
          ids: Ragged source ids `(N, None)`, without EOS.

        Returns:
          Ragged encoder inputs `(N, None)` and the output limits `(N,)`, as
          `Translator` makes them.
        """
        eos = tf.RaggedTensor.from_tensor(tf.fill([ids.nrows(), 1], EOS_ID))
        sources = tf.concat([ids, eos], axis=1)[:, :self.model.maxlen1]
        limits = output_limit(tf.cast(ids.row_lengths(), tf.int32), self.model.maxlen1,
                              self.model.maxlen2, self.settings.length_margin)
        return sources, limits

    def decode(self, ids):
        """Every sentence's hypotheses, decoded in batches of similar length.

        Args:
          ids: Ragged source ids `(N, None)` int32, without EOS.

        Returns:
          ``(hypotheses, scores)``: ragged output ids `(N * K, None)` (EOS and
          padding removed; row ``n * K + k`` is sentence n's k-th best) and
          scores `(N, K)` float32, best first.
        """
        count, k = ids.nrows(out_type=tf.int32), self.settings.n_best
        sources, limits = self.encoder_inputs(ids)
        order = _decoding_order(tf.cast(ids.row_lengths(), tf.int32))
        width = tf.maximum(tf.reduce_max(tf.gather(limits, order)), 0)  # 0 if none is decoded
        batch = self.settings.batch_size
        outputs = tf.zeros([count, k, width], tf.int32)
        # What an empty sentence keeps (it is not decoded): see the module's docstring.
        scores = tf.tile(tf.constant([[0.0] + [NO_HYPOTHESIS_SCORE] * (k - 1)]), [count, 1])

        def body(first, outputs, scores):
            rows = order[first:first + batch]
            found, found_scores = self.search(tf.gather(sources, rows).to_tensor(),
                                              tf.gather(limits, rows))
            found = tf.pad(found, [[0, 0], [0, 0], [0, width - tf.shape(found)[2]]])
            outputs = tf.tensor_scatter_nd_update(outputs, rows[:, None], found)
            scores = tf.tensor_scatter_nd_update(scores, rows[:, None],
                                                 tf.cast(found_scores, tf.float32))
            return first + batch, outputs, scores

        _, outputs, scores = tf.while_loop(lambda first, *_: first < tf.size(order), body,
                                           (0, outputs, scores))
        return _strip(tf.reshape(outputs, [count * k, width])), scores


def _decoding_order(lengths):
    """The sentences to decode `(M,)`: the non-empty ones, shortest first.

    Sorted as `Translator` sorts them (stable, by source length), so each
    batch holds the sentences it would; empty sentences are not decoded.
    """
    nonempty = tf.cast(tf.where(lengths > 0)[:, 0], tf.int32)
    return tf.gather(nonempty, tf.argsort(tf.gather(lengths, nonempty), stable=True))


def _strip(ids):
    """Rows of `ids` `(R, L)` cut before their first EOS, padding removed (ragged)."""
    after_end = tf.cumsum(tf.cast(tf.equal(ids, EOS_ID), tf.int32), axis=1) > 0
    return tf.ragged.boolean_mask(ids, tf.logical_and(tf.logical_not(after_end),
                                                      tf.not_equal(ids, PAD_ID)))


def _dense(hypotheses, count, k):
    """Ragged hypotheses `(N * K, None)` as `(N, K, L)` padded with 0, `L` the longest."""
    width = tf.cast(tf.maximum(tf.reduce_max(hypotheses.row_lengths()), 0), tf.int32)
    return tf.reshape(hypotheses.to_tensor(shape=[count * k, width]), [count, k, width])


def normalize_text(text):
    """Runs of white space folded to one space, none at the ends (as eval.py reads lines)."""
    folded = tf.strings.regex_replace(text, _WHITE_SPACE, " ")
    return tf.strings.regex_replace(folded, "^ | $", "")


def build_module(model, subword_path, settings, with_text=True):
    """The exported module and its signatures.

    Args:
      model: A built `Transformer` with its trained weights (decoding runs in
        its own compute dtype).
      subword_path: The subword model the model was trained with; it goes
        into the SavedModel as an asset (``assets/<name>``).
      settings: A `SearchSettings`.
      with_text: Add the text signature (needs tensorflow-text).

    Returns:
      ``(module, signatures)`` for `tf.saved_model.save`.
    """
    decoder = _Decoder(model, settings)
    module = tf.Module(name="translator")
    # The variables the signatures read, listed so that the SavedModel holds them.
    module.model_variables = list(model.variables)
    module.subword_model = tf.saved_model.Asset(subword_path)
    # The functions are saved as signatures only: kept as attributes of the
    # module too, saving would trace each a second time and the SavedModel
    # would hold (and loading would read) every graph twice.
    signatures = {IDS_SIGNATURE: _ids_function(decoder).get_concrete_function()}
    if with_text:
        signatures[TEXT_SIGNATURE] = _text_function(module, decoder,
                                                    subword_path).get_concrete_function()
    return module, signatures


def _ids_function(decoder):
    """The ids signature's function (TensorFlow's own ops only)."""
    vocab_size, k = decoder.model.vocab_size, decoder.settings.n_best

    @tf.function(input_signature=[tf.TensorSpec((None, None), tf.int32, name="ids")],
                 autograph=False)
    def translate_ids(ids):
        # An id outside the vocabulary would fail deep in the embedding lookup.
        checks = [tf.debugging.assert_non_negative(ids, message="ids must be at least 0"),
                  tf.debugging.assert_less(ids, vocab_size, message="ids must be below the "
                                           f"vocabulary size {vocab_size}")]
        with tf.control_dependencies(checks):
            ragged = tf.RaggedTensor.from_tensor(ids, padding=PAD_ID)
        hypotheses, scores = decoder.decode(ragged)
        return {"ids": _dense(hypotheses, tf.shape(ids)[0], k), "scores": scores}

    return translate_ids


def _text_function(module, decoder, subword_path):
    """The text signature's function; tracks its tokenizer on `module`.

    Args:
      module: The exported module, which keeps the tokenizer (a resource).
      decoder: The `_Decoder`.
      subword_path: The subword model file.

    Returns:
      The `tf.function` of the text signature.

    Raises:
      ImportError: tensorflow-text is not installed.
    """
    k = decoder.settings.n_best
    tensorflow_text = import_tensorflow_text()
    if tensorflow_text is None:
        raise ImportError(f"the text signature needs tensorflow-text: {SERVE_EXTRA}")
    with open(subword_path, "rb") as handle:
        # The op keeps the model bytes as a graph attribute (see the module's docstring).
        module.tokenizer = tensorflow_text.SentencepieceTokenizer(model=handle.read())

    @tf.function(input_signature=[tf.TensorSpec((None,), tf.string, name="text")],
                 autograph=False)
    def translate_text(text):
        ids = module.tokenizer.tokenize(normalize_text(text))
        hypotheses, scores = decoder.decode(ids)
        # `data.Subwords.decode` skips BOS as well as padding.
        pieces = tf.ragged.boolean_mask(hypotheses, tf.not_equal(hypotheses, BOS_ID))
        n_best = tf.reshape(module.tokenizer.detokenize(pieces), [tf.shape(text)[0], k])
        return {"translations": n_best[:, 0], "n_best": n_best, "scores": scores}

    return translate_text


def save(model, subword_path, settings, out_dir, with_text=True):
    """Writes the SavedModel of `build_module`.

    Args:
      model, subword_path, settings, with_text: As for `build_module`.
      out_dir: The directory to write.

    Returns:
      The names of its signatures, sorted.
    """
    module, signatures = build_module(model, subword_path, settings, with_text)
    tf.saved_model.save(module, out_dir, signatures=signatures)
    return sorted(signatures)


def asset_name(subword_path):
    """The subword model's path inside the SavedModel directory."""
    return os.path.join("assets", os.path.basename(subword_path))
