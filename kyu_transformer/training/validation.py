"""Scores validation BLEU after each epoch and keeps the best epoch's weights: train.py's hook
(`ValidationBleu`) and the same for Keras' `fit` (`BleuCallback`)."""

import json
import os

import keras

from kyu_transformer import filenames
from kyu_transformer.decoding.bleu import score
from kyu_transformer.decoding.translator import Translator
from kyu_transformer.safety.writes import replaced_atomically, write_text


def translate_and_score(translator, sources, references, subwords):
    """Returns sacreBLEU's `score` dict of `translator`'s best outputs for `sources` against
    `references`: raw text with `subwords`, or, where `subwords` is None, lists of ids (scored
    as words: ``"5 17 9"``)."""
    if subwords is None:
        outputs = translator.translate_ids(sources).outputs
        hypotheses = [" ".join(map(str, ids)) for ids in outputs]
        references = [" ".join(map(str, ids)) for ids in references]
    else:
        hypotheses = translator.translate(sources, subwords)
    return score(hypotheses, references)


class ValidationBleu:
    """Scores greedy BLEU on the first `num_sentences` validation sentences as a training hook,
    logs it into the epoch's record, and keeps the best epoch's weights in
    `filenames.BEST_WEIGHTS`."""

    def __init__(self, sources, references, subwords, num_sentences=200, batch_size=128):
        self.sources, self.references = sources[:num_sentences], references[:num_sentences]
        self.subwords, self.batch_size = subwords, batch_size
        self.translator = None

    def __call__(self, trainer, epoch, logs):
        """Scores `trainer`'s model after `epoch` into `logs`; saves its weights when they score
        best."""
        if self.translator is None:
            self.translator = Translator(trainer.model, beam_size=1, batch_size=self.batch_size)
        result = translate_and_score(self.translator, self.sources, self.references,
                                     self.subwords)
        logs.update(kind="eval", bleu=result["bleu"], chrf=result["chrf"])
        best_path = os.path.join(trainer.logdir, filenames.BEST_RECORD)
        best = None
        if os.path.isfile(best_path):
            with open(best_path, encoding="utf-8") as handle:
                best = json.load(handle)
        print(f"epoch {epoch}: validation BLEU {result['bleu']:.2f} chrF {result['chrf']:.2f} "
              f"({len(self.sources)} sentences, greedy)", flush=True)
        if best is not None and not result["bleu"] > best["bleu"]:
            return
        with replaced_atomically(os.path.join(trainer.logdir, filenames.BEST_WEIGHTS)) as temporary:
            trainer.model.save_weights(temporary)
        best = {"bleu": result["bleu"], "chrf": result["chrf"], "epoch": epoch,
                "step": logs["step"], "signature": result["signature"]}
        write_text(best_path, json.dumps(best, indent=2) + "\n")


class BleuCallback(keras.callbacks.Callback):
    """Scores validation BLEU (sacreBLEU) at each epoch's end of Keras' `fit`, as train.py does,
    and keeps the best epoch's weights.

    The scores go into the epoch's logs as ``val_bleu`` and ``val_chrf``: `fit`'s `History`
    holds them, and a `keras.callbacks.TensorBoard` listed after this callback writes them (as
    ``epoch_bleu``, ``epoch_chrf`` of its validation run). Decodes with TensorFlow's search.

    Args:
        sources, references: the validation sentences (raw text), or lists of ids where
            `subwords` is None (scored as words: a task without a subword model).
        subwords: the model's `data.subwords.Subwords`, or None.
        restore_best_weights: at the end of `fit`, set the weights of the best epoch.
        **settings: `SearchSettings` fields (default greedy search, as train.py's).
    """

    def __init__(self, sources, references, subwords=None, restore_best_weights=True,
                 **settings):
        super().__init__()
        self.sources, self.references, self.subwords = sources, references, subwords
        self.restore_best_weights = restore_best_weights
        self.settings = {"beam_size": 1, **settings}
        self.translator, self.best_bleu, self.best_epoch, self.best_weights = None, None, None, None

    def on_train_begin(self, logs=None):
        self.best_bleu, self.best_epoch, self.best_weights = None, None, None  # this fit's

    def on_epoch_end(self, epoch, logs=None):
        if self.translator is None or self.translator.model is not self.model:
            self.translator = Translator(self.model, **self.settings)
        result = translate_and_score(self.translator, self.sources, self.references,
                                     self.subwords)
        if logs is not None:
            logs.update(val_bleu=result["bleu"], val_chrf=result["chrf"])
        if self.best_bleu is None or result["bleu"] > self.best_bleu:
            self.best_bleu, self.best_epoch = result["bleu"], epoch
            self.best_weights = self.model.get_weights()

    def on_train_end(self, logs=None):
        if self.restore_best_weights and self.best_weights is not None:
            self.model.set_weights(self.best_weights)
