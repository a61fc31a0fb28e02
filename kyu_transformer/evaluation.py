"""Scoring translations with sacreBLEU, and validation BLEU during training."""

import json
import os

import sacrebleu

from kyu_transformer import filenames
from kyu_transformer.translation import Translator
from kyu_transformer.files import replaced_atomically, write_text


def score(hypotheses, references):
    """sacreBLEU BLEU (cased, 13a) and chrF of detokenized text: a dict of ``bleu``, ``chrf``,
    ``signature`` (BLEU's), ``chrf_signature`` and ``score_line`` (BLEU's own summary line)."""
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    bleu, chrf = sacrebleu.metrics.BLEU(), sacrebleu.metrics.CHRF()
    bleu_score, signature = bleu.corpus_score(hypotheses, [references]), str(bleu.get_signature())
    return {"bleu": round(bleu_score.score, 2),
            "chrf": round(chrf.corpus_score(hypotheses, [references]).score, 2),
            "signature": signature, "chrf_signature": str(chrf.get_signature()),
            "score_line": bleu_score.format(signature=signature)}


class ValidationBleu:
    """A training hook: greedy BLEU on the first `num_sentences` validation sentences, logged
    into the epoch's record; the best epoch's weights are kept in `filenames.BEST_WEIGHTS`."""

    def __init__(self, sources, references, subwords, num_sentences=200, batch_size=128):
        self.sources, self.references = sources[:num_sentences], references[:num_sentences]
        self.subwords, self.batch_size = subwords, batch_size
        self.translator = None

    def __call__(self, trainer, epoch, logs):
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
