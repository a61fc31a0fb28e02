"""Scores validation BLEU after each epoch and keeps the best epoch's weights."""

import json
import os

from kyu_transformer import filenames
from kyu_transformer.decoding.bleu import score
from kyu_transformer.decoding.translator import Translator
from kyu_transformer.safety.writes import replaced_atomically, write_text


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
        hypotheses = self.translator.translate(self.sources, self.subwords)
        result = score(hypotheses, self.references)
        logs.update(kind="eval", bleu=result["bleu"], chrf=result["chrf"])
        best_path = os.path.join(trainer.logdir, filenames.BEST_RECORD)
        best = None
        if os.path.isfile(best_path):
            with open(best_path, encoding="utf-8") as handle:
                best = json.load(handle)
        print(f"epoch {epoch}: validation BLEU {result['bleu']:.2f} chrF {result['chrf']:.2f} "
              f"({len(hypotheses)} sentences, greedy)", flush=True)
        if best is not None and not result["bleu"] > best["bleu"]:
            return
        with replaced_atomically(os.path.join(trainer.logdir, filenames.BEST_WEIGHTS)) as temporary:
            trainer.model.save_weights(temporary)
        best = {"bleu": result["bleu"], "chrf": result["chrf"], "epoch": epoch,
                "step": logs["step"], "signature": result["signature"]}
        write_text(best_path, json.dumps(best, indent=2) + "\n")
