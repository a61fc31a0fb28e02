"""Saves a trained `Transformer` as a TensorFlow SavedModel: raw text in, n-best translations
out.

Its signatures (``serving_default``, ``ids``, ``sample``, ``prefixed``: docs/export.md) decode
exactly as
`decoding.translator.Translator`: its front end in the graph, around the search function a
`Translator` of the same settings compiles. Columns without a hypothesis (where `Translator`
leaves them out) hold an empty one scored `decoding.search.NO_HYPOTHESIS_SCORE`.
"""

import json
import os

import tensorflow as tf

from kyu_transformer import filenames
from kyu_transformer.conventions import BOS_ID, EOS_ID, PAD_ID
from kyu_transformer.decoding.search import NO_HYPOTHESIS_SCORE
from kyu_transformer.decoding.settings import SEED_LIMIT, SearchSettings
from kyu_transformer.decoding.translator import (
    Translator, decoding_order, encoder_inputs, real_hypotheses)

TEXT_SIGNATURE = "serving_default"
IDS_SIGNATURE = "ids"
SAMPLE_SIGNATURE = "sample"
PREFIX_SIGNATURE = "prefixed"
SERVE_EXTRA = 'pip install -e ".[serve]"'

# What `data.text.normalize_line` (`str.split`) folds: all `str.isspace` characters; RE2's `\s`
# misses \v, \x1c-\x1f, \x85 and the Unicode spaces.
_WHITE_SPACE = r"[\t\n\x{0b}\x{0c}\r\x{1c}-\x{1f}\x{85}\p{Z}]+"


def import_tensorflow_text():
    """Returns the tensorflow_text module, or None where it is not installed."""
    try:
        import tensorflow_text
    except ImportError:
        return None
    return tensorflow_text


def _cut_at_end(ids):
    """Cuts the rows of `ids` `(R, L)` before their first EOS and leaves padding out (ragged):
    in the graph, what `conventions.cut_at_end` does to one output in Python."""
    after_end = tf.cumsum(tf.cast(tf.equal(ids, EOS_ID), tf.int32), axis=1) > 0
    return tf.ragged.boolean_mask(ids, tf.logical_and(tf.logical_not(after_end),
                                                      tf.not_equal(ids, PAD_ID)))


class _Decoder(Translator):
    """Extends `Translator` so that its compiled search decodes any number of sentences in one
    graph."""

    def __init__(self, model, settings):
        super().__init__(model, settings)
        # One function for every signature of these settings: the SavedModel holds it once.
        self.search = self.search_function(settings.n_best, scores=True)
        self.prefixed_search = self.search_function(settings.n_best, scores=True, prefixed=True)

    def decode(self, ids, seed=None, prefix=None):
        """Decodes ragged source ids `(N, None)` int32 (without EOS) into ``(hypotheses,
        scores)``: ragged ids `(N * K, None)` (row ``n * K + k`` sentence n's k-th best, EOS and
        padding removed) and scores `(N, K)` float32; `prefix`: None, or ragged ids `(N, None)`
        each output starts with (cut to its sentence's limit)."""
        count, k = ids.nrows(out_type=tf.int32), self.settings.n_best
        lengths = tf.cast(ids.row_lengths(), tf.int32)
        sources = encoder_inputs(ids, self.maxlen1)
        limits = self.output_limits(lengths)
        if prefix is not None:
            prefix = _cut_to_limits(prefix, limits)  # (N, P), P at least 1
            order = decoding_order(lengths, tf.reduce_sum(
                tf.cast(tf.not_equal(prefix, PAD_ID), tf.int32), axis=1))
        else:
            order = decoding_order(lengths)
        width = tf.maximum(tf.reduce_max(tf.gather(limits, order)), 0)  # 0 if none is decoded
        batch = self.settings.batch_size
        seed = tf.constant(0, tf.int64) if seed is None else seed
        outputs = tf.zeros([count, k, width], tf.int32)
        # What an empty sentence keeps (it is not decoded).
        scores = tf.tile(tf.constant([[0.0] + [NO_HYPOTHESIS_SCORE] * (k - 1)]), [count, 1])

        def body(first, outputs, scores):
            rows = order[first:first + batch]
            arguments = [tf.gather(sources, rows).to_tensor(), tf.gather(limits, rows), rows,
                         seed]
            found = (self.search(*arguments) if prefix is None
                     else self.prefixed_search(*arguments, tf.gather(prefix, rows)))
            found_ids = found.ids[:, :k]
            found_ids = tf.pad(found_ids, [[0, 0], [0, 0], [0, width - tf.shape(found_ids)[2]]])
            outputs = tf.tensor_scatter_nd_update(outputs, rows[:, None], found_ids)
            scores = tf.tensor_scatter_nd_update(scores, rows[:, None],
                                                 tf.cast(found.scores[:, :k], tf.float32))
            return first + batch, outputs, scores

        _, outputs, scores = tf.while_loop(lambda first, *_: first < tf.size(order), body,
                                           (0, outputs, scores))
        return _cut_at_end(tf.reshape(outputs, [count * k, width])), scores


def _cut_to_limits(prefix, limits):
    """Returns ragged prefixes `(N, None)` as `search` takes them: `(N, P)` padded with
    `PAD_ID` (P at least 1), each cut to its sentence's limit of `limits` `(N,)`."""
    dense = prefix.to_tensor(default_value=PAD_ID)
    dense = tf.pad(dense, [[0, 0], [0, 1]], constant_values=PAD_ID)  # at least one column
    columns = tf.range(tf.shape(dense)[1])[None, :]
    return tf.where(columns < limits[:, None], dense, PAD_ID)


def normalize_text(text):
    """Folds runs of white space to one space and leaves none at the ends (as eval.py reads
    lines)."""
    folded = tf.strings.regex_replace(text, _WHITE_SPACE, " ")
    return tf.strings.regex_replace(folded, "^ | $", "")


def _in_range(tensor, name, limit, limit_name):
    """Returns `tensor` once asserted to lie in ``[0, limit)`` (the messages name it `name`)."""
    checks = [tf.debugging.assert_non_negative(tensor, message=f"{name} must be at least 0"),
              tf.debugging.assert_less(tensor, tf.constant(limit, tensor.dtype),
                                       message=f"{name} must be below {limit_name}")]
    with tf.control_dependencies(checks):
        return tf.identity(tensor)


def _ids_function(decoder):
    """Returns the ids signature's function (TensorFlow's own ops only)."""
    vocab_size, k = decoder.model.vocab_size, decoder.settings.n_best

    @tf.function(input_signature=[tf.TensorSpec((None, None), tf.int32, name="ids")],
                 autograph=False)
    def translate_ids(ids):
        # An id outside the vocabulary would fail deep in the embedding lookup.
        checked = _in_range(ids, "ids", vocab_size, f"the vocabulary size {vocab_size}")
        hypotheses, scores = decoder.decode(tf.RaggedTensor.from_tensor(checked, padding=PAD_ID))
        count = tf.shape(ids)[0]
        width = tf.cast(tf.maximum(tf.reduce_max(hypotheses.row_lengths()), 0), tf.int32)
        dense = hypotheses.to_tensor(shape=[count * k, width])  # (N*K, L), L the longest
        return {"ids": tf.reshape(dense, [count, k, width]), "scores": scores}

    return translate_ids


def _text_function(tokenizer, decoder, seeded=False, prefixed=False):
    """Returns the concrete function of a text signature, which takes ``text`` (and ``seed``
    if `seeded`, ``prefix`` if `prefixed`: the text each translation starts with, empty for
    none)."""
    k = decoder.settings.n_best

    def translate_text(text, seed=None, prefix=None):
        if seed is not None:  # as `SearchSettings` bounds a seed
            seed = _in_range(seed, "seed", SEED_LIMIT, SEED_LIMIT)
        ids = tokenizer.tokenize(normalize_text(text))
        if prefix is not None:
            check = tf.debugging.assert_equal(tf.shape(prefix), tf.shape(text),
                                              message="give one prefix per text")
            with tf.control_dependencies([check]):
                prefix = tokenizer.tokenize(normalize_text(prefix))
        hypotheses, scores = decoder.decode(ids, seed, prefix)
        # `data.subwords.Subwords.decode` skips BOS as well as padding.
        pieces = tf.ragged.boolean_mask(hypotheses, tf.not_equal(hypotheses, BOS_ID))
        n_best = tf.reshape(tokenizer.detokenize(pieces), [tf.shape(text)[0], k])
        return {"translations": n_best[:, 0], "n_best": n_best, "scores": scores}

    inputs = [tf.TensorSpec((None,), tf.string, name="text")]
    if seeded:
        inputs.append(tf.TensorSpec((), tf.int64, name="seed"))
        function = translate_text
    elif prefixed:
        inputs.append(tf.TensorSpec((None,), tf.string, name="prefix"))
        function = lambda text, prefix: translate_text(text, prefix=prefix)  # noqa: E731
    else:
        function = lambda text: translate_text(text)  # noqa: E731
    return tf.function(function, input_signature=inputs,
                       autograph=False).get_concrete_function()


def save(model, subword_path, settings, out_dir, sampling=None):
    """Writes the SavedModel of `model` to `out_dir`, decoding in its compute dtype; returns the
    signature names, sorted.

    `settings`: the `SearchSettings` of the text and ids signatures; `sampling`: those of the
    sample signature, or None. The text signatures are added where tensorflow-text is installed.
    The subword model at `subword_path` is saved as an asset (``assets/<name>``).
    """
    decoder = _Decoder(model, settings)
    module = tf.Module(name="translator")
    # Listed so that the SavedModel holds the variables the signatures read.
    module.model_variables = list(model.variables)
    module.subword_model = tf.saved_model.Asset(subword_path)
    # Signatures only: as module attributes too, each graph would be traced and saved twice.
    signatures = {IDS_SIGNATURE: _ids_function(decoder).get_concrete_function()}
    tensorflow_text = import_tensorflow_text()
    if tensorflow_text is not None:
        with open(subword_path, "rb") as handle:
            # The op keeps the model bytes as a graph attribute.
            module.tokenizer = tensorflow_text.SentencepieceTokenizer(model=handle.read())
        signatures[TEXT_SIGNATURE] = _text_function(module.tokenizer, decoder)
        signatures[PREFIX_SIGNATURE] = _text_function(module.tokenizer, decoder, prefixed=True)
        if sampling is not None:
            signatures[SAMPLE_SIGNATURE] = _text_function(module.tokenizer,
                                                          _Decoder(model, sampling), seeded=True)
    tf.saved_model.save(module, out_dir, signatures=signatures)
    return sorted(signatures)


class SavedModelTranslator:
    """Translates raw text with a SavedModel written by export.py, through its text signatures
    (tensorflow-text must be installed), as `Translator` does with the settings it was exported
    with: those of ``serving_default`` and ``prefixed``, or of ``sample`` (`replaced` chooses)."""

    def __init__(self, export_dir, settings=None, loaded=None):
        if import_tensorflow_text() is None:
            raise ImportError(f"{export_dir}: a SavedModel's text signatures need "
                              f"tensorflow-text: {SERVE_EXTRA}")
        with open(os.path.join(export_dir, filenames.SAVED_MODEL_SETTINGS),
                  encoding="utf-8") as handle:
            self.record = json.load(handle)
        self.export_dir = export_dir
        self.loaded = loaded or tf.saved_model.load(export_dir)
        self.settings = settings or self.exported_settings()[0]
        self.maxlen1, self.maxlen2 = self.record["maxlen1"], self.record["maxlen2"]

    def exported_settings(self):
        """Returns the `SearchSettings` it was exported with: the text signatures', and the
        sample signature's (or None)."""
        record = self.record
        settings = SearchSettings(**{name: record[name] for name in (
            "beam_size", "alpha", "n_best", "length_margin", "batch_size")})
        sample = record.get("sample")
        return settings, sample and settings.replace(beam_size=1, **sample)

    def replaced(self, **fields):
        """Returns this translator with the settings' `fields` replaced, which must give the
        settings of a signature: a SavedModel decodes only as it was exported."""
        wanted = self.settings.replace(**fields)
        # (a sample's seed comes with each request)
        if wanted.replace(seed=0) not in [settings and settings.replace(seed=0)
                                          for settings in self.exported_settings()]:
            raise ValueError(f"{self.export_dir} decodes as it was exported "
                             f"({self.exported_settings()[0]}); export again for {wanted}")
        return SavedModelTranslator(self.export_dir, wanted, self.loaded)

    def translate_texts(self, sentences, subwords=None, prefixes=None, n_best=None, seed=None):
        """Translates as `Engine.translate_texts` does (the subword model is the SavedModel's
        own: `subwords` is not read)."""
        settings, text = self.settings, tf.constant(list(sentences), tf.string)
        k = n_best or 1
        if k > settings.n_best:
            raise ValueError(f"n_best {k}: {self.export_dir} was exported with --n_best "
                             f"{settings.n_best}")
        if settings.sampling:
            if prefixes is not None:
                raise ValueError(f"{SAMPLE_SIGNATURE}: the signature takes no prefix")
            seed = settings.seed if seed is None else seed
            found = self.loaded.signatures[SAMPLE_SIGNATURE](
                text=text, seed=tf.constant(seed, tf.int64))
        elif prefixes is not None:
            found = self.loaded.signatures[PREFIX_SIGNATURE](
                text=text, prefix=tf.constant([p or "" for p in prefixes], tf.string))
        else:
            found = self.loaded.signatures[TEXT_SIGNATURE](text=text)
        texts = [[t.decode("utf-8") for t in row] for row in found["n_best"].numpy().tolist()]
        scores = found["scores"].numpy().tolist()
        kept = [real_hypotheses(row[:k]) for row in scores]
        return ([[row[j] for j in columns] for row, columns in zip(texts, kept)],
                [[row[j] for j in columns] for row, columns in zip(scores, kept)]
                if n_best else None)
