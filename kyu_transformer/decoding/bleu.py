"""Scores translations with sacreBLEU (BLEU and chrF)."""

import sacrebleu


def score(hypotheses, references):
    """Scores detokenized text with sacreBLEU's BLEU (cased, 13a) and chrF; returns a dict of
    ``bleu``, ``chrf``, ``signature`` (BLEU's), ``chrf_signature`` and ``score_line`` (BLEU's own
    summary line)."""
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    bleu, chrf = sacrebleu.metrics.BLEU(), sacrebleu.metrics.CHRF()
    bleu_score, signature = bleu.corpus_score(hypotheses, [references]), str(bleu.get_signature())
    return {"bleu": round(bleu_score.score, 2),
            "chrf": round(chrf.corpus_score(hypotheses, [references]).score, 2),
            "signature": signature, "chrf_signature": str(chrf.get_signature()),
            "score_line": bleu_score.format(signature=signature)}
