"""Translates raw text from Python with any engine: `load_translator` loads a logdir (its latest,
best or named checkpoint, or an average, as eval.py chooses), a `.keras` file (export.py --format
keras), a SavedModel or a CTranslate2 model into one `TextTranslator`.

    translator = load_translator("log/small", average_last=8, beam_size=4, alpha=1.4)
    translator.translate(["Zwei Hunde spielen im Schnee."])
"""

import collections
import os

from kyu_transformer import filenames
from kyu_transformer.decoding.archive import is_archive

Hypothesis = collections.namedtuple("Hypothesis", "text score")
Hypothesis.__doc__ = "Holds a translation and its score (log-probability over GNMT's penalty)."


class TextTranslator:
    """Translates raw text with an `engine` and its `subwords` (None for a SavedModel, which
    holds its own): a `decoding.translator.Translator`, an
    `export.ctranslate2.CTranslate2Translator` or an `export.saved_model.SavedModelTranslator`.
    """

    def __init__(self, engine, subwords):
        self.engine, self.subwords = engine, subwords

    @property
    def settings(self):
        """Returns the `SearchSettings` it translates with."""
        return self.engine.settings

    def with_settings(self, **fields):
        """Returns a translator of the same model with the settings' `fields` replaced (e.g.
        ``beam_size=1``, ``sampling_topk=10``)."""
        return TextTranslator(self.engine.replaced(**fields), self.subwords)

    def translate(self, sentences, prefixes=None, n_best=None, seed=None):
        """Translates raw text as eval.py does.

        Args:
            sentences: a list of sentences, or one sentence (a string).
            prefixes: None, or one text per sentence (a string for one sentence) that its
                translations start with; empty or None for none.
            n_best: None for each sentence's best translation (a string); K for its K best
                `Hypothesis` (text, score), best first (K samples where the settings sample).
            seed: the samples' seed (default the settings'); a sentence draws the same whatever
                its batch.

        Returns:
            A list with an item per sentence (the item alone for one string).
        """
        if n_best is not None and n_best < 1:
            raise ValueError(f"`n_best` must be at least 1, got {n_best}")
        single = isinstance(sentences, str)
        if single:
            sentences, prefixes = [sentences], None if prefixes is None else [prefixes]
        texts, scores = self.engine.translate_texts(list(sentences), self.subwords, prefixes,
                                                    n_best, seed)
        if n_best is None:
            found = [hypotheses[0] for hypotheses in texts]
        else:
            found = [[Hypothesis(*pair) for pair in zip(row_texts, row_scores)]
                     for row_texts, row_scores in zip(texts, scores)]
        return found[0] if single else found

    def score(self, sentences, translations):
        """Returns the `scoring.ScoredOutput` of each raw translation of its raw source, by
        forced decoding (as eval.py --score; the Keras model's engine only)."""
        if not hasattr(self.engine, "score_ids"):
            raise ValueError(f"{type(self.engine).__name__} does not score given translations: "
                             "load the logdir or the .keras file")
        scored, _ = self.engine.score_ids(self.subwords.encode(sentences),
                                          self.subwords.encode(translations))
        return scored


def load_translator(path, ckpt=None, average_last=0, mixed_precision="auto", **fields):
    """Returns the `TextTranslator` of `path`: a training logdir, a `.keras` file, a SavedModel
    or a CTranslate2 model directory (export.py's).

    `ckpt`, `average_last` choose a logdir's weights as eval.py's flags do; `mixed_precision`
    (`no`, `bf16`, `fp16`, `auto`: chosen for this machine) is the Keras model's compute dtype
    (a SavedModel computes as exported, a CTranslate2 model in its weight type); `fields` are
    `SearchSettings` fields (``beam_size=4, alpha=1.0, ...``). A SavedModel decodes with the
    settings it was exported with.
    """
    if (ckpt or average_last) and (is_archive(path) or _export_of(path)):
        raise ValueError(f"{path}: `ckpt` and `average_last` choose a logdir's checkpoints; "
                         "an export holds its weights")
    if is_archive(path):
        return load_translation_model(path, mixed_precision)[0].translator(**fields)
    export = _export_of(path)
    if export and mixed_precision != "auto":
        raise ValueError(f"{path}: `mixed_precision` applies to a Keras model; a {export} "
                         "computes as it was exported")
    from kyu_transformer.cli.startup import start_tensorflow

    start_tensorflow()
    if export == "SavedModel":
        from kyu_transformer.export.saved_model import SavedModelTranslator

        translator = TextTranslator(SavedModelTranslator(path), None)
        return translator.with_settings(**fields) if fields else translator
    if export == "CTranslate2 model":
        from kyu_transformer.data.subwords import Subwords
        from kyu_transformer.export.ctranslate2 import CTranslate2Translator

        return TextTranslator(CTranslate2Translator(path, **fields),
                              Subwords(os.path.join(path, filenames.SUBWORDS)))
    return _of_logdir(path, ckpt, average_last, mixed_precision, fields)


def _export_of(path):
    """Returns the kind of export the folder `path` holds (``SavedModel``, ``CTranslate2
    model``), or None."""
    if os.path.isfile(os.path.join(path, filenames.SAVED_MODEL_SETTINGS)):
        return "SavedModel"
    if os.path.isfile(os.path.join(path, filenames.CTRANSLATE2_SETTINGS)):
        return "CTranslate2 model"
    return None


def _of_logdir(logdir, ckpt, average_last, mixed_precision, fields):
    """Returns the `TextTranslator` of a logdir's checkpoint(s), as eval.py loads them."""
    from kyu_transformer.decoding.translator import Translator
    from kyu_transformer.training.checkpoints import load_trained
    from kyu_transformer.training.logdir import read_trained

    hparams, subwords = read_trained(logdir)
    model, _, _ = load_trained(hparams, logdir, ckpt, average_last, mixed_precision,
                               log=lambda line: None)
    return TextTranslator(Translator(model, **fields), subwords)


def load_translation_model(path, mixed_precision="auto", log=lambda line: None):
    """Loads the `TranslationModel` of a `.keras` file under the Keras dtype policy of
    `mixed_precision` (``auto``: chosen for this machine and the hyperparameters the archive
    holds, the choice said through `log`); returns ``(model, precision)``."""
    import keras

    from kyu_transformer.decoding.archive import read_archive
    from kyu_transformer.precision import resolve_precision, set_precision

    hparams, _, _ = read_archive(path)
    precision = resolve_precision(mixed_precision, hparams, log=log)
    set_precision(precision)
    return keras.saving.load_model(path, compile=False), precision
