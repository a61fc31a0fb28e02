"""Holds a trained translator as one Keras object, `TranslationModel`: the `Transformer`, its
subword model and search settings, and the hyperparameters it was trained with.

``model.save("small.keras")`` writes all of it to one file, the subword model as an asset of the
archive (`save_assets`); ``keras.saving.load_model("small.keras")`` loads it back after
``import kyu_transformer``, wherever the logdir went. Nothing here imports TensorFlow: on any
Keras backend the loaded model gives its logits and `score`s; `translate` searches with
TensorFlow's loop (`decoding.search`) and says so in one line on another backend.
"""

import dataclasses
import os

import keras

from kyu_transformer import filenames
from kyu_transformer.decoding.settings import SearchSettings, checked_max_length


@keras.saving.register_keras_serializable(package="kyu_transformer")
class TranslationModel(keras.Model):
    """Translates raw text with a `Transformer` and its subword model, as eval.py does.

    Args:
        hparams: the hyperparameters the model was trained with (a dict, as in hparams.json);
            the `Transformer` is made of them.
        settings: how to search, a `SearchSettings` or the dict of one (default its defaults).
        subwords: the model's `data.subwords.Subwords`; None only while Keras loads the archive
            (`load_assets` sets it).

    Call arguments:
        inputs: ``{"source": (N, S), "target_in": (N, T)}`` int ids, as `Transformer` takes.
        training: as `Transformer` takes it.

    Returns:
        The logits `(N, T, V)`.
    """

    def __init__(self, hparams, settings=None, subwords=None, **kwargs):
        super().__init__(**kwargs)
        from kyu_transformer.model import Transformer  # here: Keras registers this class
        # while it is itself imported (see kyu_transformer/__init__.py), before the layers exist

        self.hparams = dict(hparams)
        self.settings = (settings if isinstance(settings, SearchSettings)
                         else SearchSettings(**(settings or {})))
        self.subwords = subwords
        self.transformer = Transformer.from_hparams(self.hparams, name="transformer")
        self.transformer.build()
        self.built = True
        self._translators = {}  # the `TextTranslator` of each settings, made when first asked

    def call(self, inputs, training=None):
        return self.transformer(inputs, training=training)  # (N, T, V)

    def get_config(self):
        return {"name": self.name, "trainable": self.trainable, "hparams": dict(self.hparams),
                "settings": dataclasses.asdict(self.settings)}

    def save_assets(self, dir_path):
        """Writes the subword model into the archive's folder of this object's assets."""
        if self.subwords is None:
            raise ValueError("this TranslationModel has no subword model to save: give "
                             "`subwords` when making it")
        with open(os.path.join(dir_path, filenames.SUBWORDS), "wb") as handle:
            handle.write(self.subwords.serialized())

    def load_assets(self, dir_path):
        """Reads the subword model back (into memory: Keras removes the folder after loading)."""
        from kyu_transformer.data.subwords import Subwords

        with open(os.path.join(dir_path, filenames.SUBWORDS), "rb") as handle:
            self.subwords = Subwords.from_serialized(handle.read())

    def translator(self, **fields):
        """Returns the `TextTranslator` of this model, by its settings with `fields` replaced (one
        per settings, compiled once); needs Keras' TensorFlow backend."""
        settings = self.settings.replace(**fields)
        if settings not in self._translators:
            backend = keras.backend.backend()
            if backend != "tensorflow":
                raise RuntimeError(
                    f"translate() searches with TensorFlow's while loop and gathers, but "
                    f"KERAS_BACKEND is {backend}: load the model under KERAS_BACKEND=tensorflow "
                    "to decode (its logits and score() work on every backend)")
            from kyu_transformer.decoding.text_translator import TextTranslator
            from kyu_transformer.decoding.translator import Translator

            self._translators[settings] = TextTranslator(Translator(self.transformer, settings),
                                                         self.subwords)
        return self._translators[settings]

    def translate(self, sentences, prefixes=None, n_best=None, seed=None):
        """Translates raw text as `TextTranslator.translate` does, with this model's settings."""
        return self.translator().translate(sentences, prefixes, n_best, seed)

    def score(self, sentences, translations):
        """Returns the `scoring.ScoredOutput` of each raw translation of its raw source (as
        eval.py --score), on any Keras backend."""
        from kyu_transformer.decoding.scoring import score_outputs, sequence_log_probs

        settings, maxlen2 = self.settings, self.transformer.maxlen2
        limits = (self.transformer.maxlen1,
                  checked_max_length(settings.max_length or maxlen2, maxlen2), settings.alpha)
        scored, _ = score_outputs(
            lambda source, outputs: sequence_log_probs(self.transformer, source, outputs),
            self.subwords.encode(sentences), self.subwords.encode(translations), limits,
            settings.batch_size)
        return scored
