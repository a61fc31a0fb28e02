"""eval.py's n-best lists (--n_best), its scoring of given translations (--score), and its
CTranslate2 engine (--ctranslate2)."""

import json
import os

import numpy as np
import pytest

import eval as eval_program
from kyu_transformer import config, filenames
from kyu_transformer.conventions import BOS_ID, EOS_ID
from kyu_transformer.data.subwords import Subwords
from kyu_transformer.data.text import load_split
from kyu_transformer.decoding.translator import Translator
from kyu_transformer.model import Transformer
from kyu_transformer.training.checkpoints import load_model
from tests.conftest import copy_of_logdir
from tests.programs import run
from tests.test_data import MULTI30K


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def read_json_lines(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def varied(varied_tiny_logdir, tmp_path_factory):
    """The session's model with set weights, in a logdir copy, and val text around it."""
    logdir = copy_of_logdir(varied_tiny_logdir, tmp_path_factory, "eval")
    hparams = config.load(str(logdir / "hparams.json"))
    model, _ = load_model(hparams, str(logdir))
    sources, references, _ = load_split(MULTI30K, "val")
    return {"logdir": logdir, "model": model, "hparams": hparams,
            "subwords": Subwords(str(logdir / filenames.SUBWORDS)),
            "sources": sources, "references": references}


def _sources(varied):
    """60 val sentences, an empty line, and 5 joined sentences (longer than maxlen1)."""
    sources = varied["sources"]
    return sources[:60] + ["", " ".join(sources[200:205])]


# ------------------------------------------------------------------ --n_best


@pytest.mark.parametrize("argv, message", [
    (["--beam_size", "4", "--n_best", "5"],
     "--n_best (5) must be at most --beam_size (4): the search keeps only --beam_size"),
    (["--n_best", "0"], "--n_best must be at least 1, got 0"),
    (["--beam_size", "1", "--n_best", "2"], "--n_best (2) must be at most --beam_size (1)"),
    (["--sampling_topk", "10", "--beam_size", "4"],
     "--sampling_topk 10 samples one token at a time: --beam_size must be 1 with it, got 4"),
    (["--sampling_topk", "-1"], "--sampling_topk must be at least 0, got -1"),
    (["--sampling_topk", "0", "--sampling_topp", "0"],
     "--sampling_topp must be in (0, 1], got 0.0"),
    (["--sampling_topk", "0", "--sampling_temperature", "0"],
     "--sampling_temperature must be at least 1.2e-38 (float32's smallest normal number)"),
    (["--sampling_topp", "0.9"], "--sampling_topp applies to sampling: give --sampling_topk K"),
    (["--sampling_topk", "0", "--seed", "-3"], "--seed must be at least 0, got -3"),
    (["--sampling_topk", "0", "--seed", str(2**32 - 1)], "--seed must be below 4294967295"),
    (["--sampling_temperature", "0.5"], "--sampling_temperature applies to sampling: give "
                                        "--sampling_topk K"),
    (["--sampling_topk", "1", "--seed", "3"], "--seed applies to sampling"),
    (["--src", "a.de", "--score", "a.en", "--sampling_topk", "5"],
     "--score and --sampling_topk exclude each other"),
    (["--src", "-", "--n_best", "2"], "--src - translates standard input line by line; "
                                      "--n_best needs a file"),
    (["--src", "a.de", "--score", "a.en", "--n_best", "2"],
     "--score and --n_best exclude each other"),
    (["--src", "a.de", "--score", "a.en", "--ref", "b.en"],
     "--score and --ref exclude each other"),
    (["--src", "a.de", "--score", "a.en", "--ctranslate2", "ct2"],
     "--score and --ctranslate2 exclude each other"),
    (["--ctranslate2", "ct2", "--average_last", "2"],
     "--ctranslate2 and --average_last exclude each other"),
    (["--beam_size", "0"], "--beam_size must be at least 1, got 0"),
    (["--batch_size", "0"], "--batch_size must be at least 1, got 0"),
    (["--length_margin", "-1"], "--length_margin must be at least 0, got -1"),
    (["--average_last", "-2"], "--average_last must be at least 0, got -2"),
    (["--ckpt", "log/checkpoints/ckpt-8", "--average_last", "2"],
     "--ckpt (log/checkpoints/ckpt-8) and --average_last (2) exclude each other"),
])
def test_clashing_flags_are_refused_before_anything_is_loaded(capsys, argv, message):
    with pytest.raises(SystemExit):
        eval_program.parse_args(["--logdir", "no/such/logdir", *argv])
    assert message in capsys.readouterr().err


def test_translator_refuses_more_hypotheses_than_its_beam():
    model = Transformer(60, d_model=16, d_ff=32, num_blocks=1, num_heads=2, maxlen1=12,
                        maxlen2=12)
    with pytest.raises(ValueError, match=r"`n_best` \(3\) must be at most "
                                         r"`beam_size` \(2\)"):
        Translator(model, beam_size=2).translate_ids([[5, 6]], n_best=3)
    with pytest.raises(ValueError, match="`with_coverage` needs greedy search of one "
                                         "hypothesis.*beam_size=2.*n_best=2"):
        Translator(model, beam_size=2).translate_ids([[5, 6]], with_coverage=True, n_best=2)


@pytest.mark.slow
@pytest.mark.parametrize("beam_size", [1, 4])
def test_n_best_keeps_the_best_output_its_limits_and_scores(varied, beam_size):
    """The first hypothesis is the plain output; each is within its sentence's limit; the
    scores are the model's, as `score_ids` computes them for the outputs that ended."""
    model, n_best = varied["model"], min(beam_size, 3)
    source_ids = varied["subwords"].encode(_sources(varied))
    # A small margin makes outputs reach their own limits.
    translator = Translator(model, beam_size=beam_size, length_margin=2, batch_size=16)
    plain = translator.translate_ids(source_ids)
    best, cut = plain.outputs, plain.truncated_outputs
    found = translator.translate_ids(source_ids, n_best=n_best)
    hypotheses, scores = found.hypotheses, found.scores
    assert [outputs[0] for outputs in hypotheses] == best and plain.scores is None
    # Beam search reaches a limit less often: there, finished hypotheses usually win.
    assert found.truncated_outputs == cut >= (5 if beam_size == 1 else 1)
    limits = [min(model.maxlen2, min(len(ids) + 1, model.maxlen1) + 2) for ids in source_ids]
    for outputs, limit in zip(hypotheses, limits):
        assert all(len(output) <= limit for output in outputs)
    assert hypotheses[60] == [[]] and scores[60] == [0.0]  # the empty line is not decoded
    assert all(len(row) == n_best for index, row in enumerate(scores) if index != 60)
    ended = [i for i, (output, limit) in enumerate(zip(best, limits))
             if len(output) < limit and source_ids[i]]
    rescored, _ = translator.score_ids([source_ids[i] for i in ended], [best[i] for i in ended])
    np.testing.assert_allclose([scores[i][0] for i in ended],
                               [result.score for result in rescored], atol=1e-4)
    assert len(ended) >= 10


@pytest.mark.slow
def test_eval_writes_the_n_best_hypotheses_sorted_by_score(varied, tmp_path):
    logdir = varied["logdir"]
    sources = _sources(varied)
    source = write_lines(tmp_path / "nbest.de", sources)
    plain = run("eval.py", "--logdir", logdir, "--src", source, "--beam_size", 4,
                "--name", "plain")
    assert plain.returncode == 0, plain.stdout + plain.stderr
    result = run("eval.py", "--logdir", logdir, "--src", source, "--beam_size", 4,
                 "--n_best", 3)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "the 3 best hypotheses and their scores" in result.stdout
    hypotheses = (logdir / "eval" / "nbest.hyp.txt").read_text(encoding="utf-8").splitlines()
    # --n_best adds a file: the translations are those of the same run without it.
    assert hypotheses == (logdir / "eval" / "plain.hyp.txt").read_text(
        encoding="utf-8").splitlines()
    rows = read_json_lines(logdir / "eval" / "nbest.nbest.jsonl")
    assert [row["source"] for row in rows] == sources
    assert rows[60]["hypotheses"] == [{"text": "", "score": 0.0}]
    del rows[60], hypotheses[60]
    for row, hypothesis in zip(rows, hypotheses):
        scores = [entry["score"] for entry in row["hypotheses"]]
        assert len(scores) == 3 and scores == sorted(scores, reverse=True)
        assert row["hypotheses"][0]["text"] == hypothesis
    # Real alternatives, not copies (two segmentations may still spell the same text).
    distinct = [len({entry["text"] for entry in row["hypotheses"]}) for row in rows]
    assert distinct.count(3) >= 0.9 * len(rows)


@pytest.mark.slow
def test_eval_samples_with_a_seed_as_the_translator_does(varied, tmp_path):
    """--sampling_topk with --n_best: that many samples a sentence, best first, as
    `Translator` draws them; the same --seed repeats them, another draws others."""
    sources = _sources(varied)
    source = write_lines(tmp_path / "sample.de", sources)
    flags = ["--logdir", varied["logdir"], "--src", source, "--sampling_topk", 10,
             "--sampling_temperature", 0.8, "--n_best", 4, "--batch_size", 16]
    runs = {name: run("eval.py", *flags, "--seed", seed, "--name", name)
            for name, seed in (("first", 5), ("again", 5), ("other", 6))}
    for result in runs.values():
        assert result.returncode == 0, result.stdout + result.stderr
    assert "sampling top-k 10, top-p 1.0, temperature 0.8, seed 5" in runs["first"].stdout
    rows = {name: read_json_lines(varied["logdir"] / "eval" / f"{name}.nbest.jsonl")
            for name in runs}
    assert rows["first"] == rows["again"]
    assert sum(a != b for a, b in zip(rows["first"], rows["other"])) >= 0.8 * len(sources)
    found = Translator(varied["model"], sampling_topk=10, sampling_temperature=0.8,
                       batch_size=16).translate_ids(varied["subwords"].encode(sources),
                                                    n_best=4, seed=5)
    decode = varied["subwords"].decode
    assert [[entry["text"] for entry in row["hypotheses"]] for row in rows["first"]] == \
        [[decode(ids) for ids in row] for row in found.hypotheses]
    hypotheses = (varied["logdir"] / "eval" / "first.hyp.txt").read_text("utf-8").splitlines()
    assert hypotheses == [row["hypotheses"][0]["text"] for row in rows["first"]]
    for row in rows["first"][:60]:
        scores = [entry["score"] for entry in row["hypotheses"]]
        assert len(scores) == 4 and scores == sorted(scores, reverse=True)


# ------------------------------------------------------------------ --score


def _log_prob_by_hand(model, source_ids, target_ids):
    """Sum of the numpy log-softmax of the model's logits at the given target ids."""
    source = np.array([(source_ids + [EOS_ID])[:model.maxlen1]], "int32")
    target_in = np.array([[BOS_ID] + target_ids[:-1]], "int32")
    logits = np.asarray(model({"source": source, "target_in": target_in}), "float64")[0]
    log_softmax = logits - logits.max(axis=-1, keepdims=True)
    log_softmax -= np.log(np.exp(log_softmax).sum(axis=-1, keepdims=True))
    return log_softmax[np.arange(len(target_ids)), target_ids].sum()


@pytest.mark.slow
def test_eval_scores_given_translations_as_the_model_does(varied, tmp_path):
    model, subwords = varied["model"], varied["subwords"]
    sources, references = varied["sources"], varied["references"]
    # References, an empty source, an empty translation, and a translation
    # longer than maxlen2 (cut to maxlen2, without EOS).
    pairs = list(zip(sources[:30], references[:30])) + [
        ("", "A dog runs."), (sources[30], ""),
        (" ".join(sources[100:105]), " ".join(references[100:105]))]
    source = write_lines(tmp_path / "given.de", [pair[0] for pair in pairs])
    target = write_lines(tmp_path / "given.en", [pair[1] for pair in pairs])
    result = run("eval.py", "--logdir", varied["logdir"], "--src", source, "--score", target,
                 "--alpha", 1.0)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = read_json_lines(varied["logdir"] / "eval" / "given.scores.jsonl")
    assert [(row["source"], row["target"]) for row in rows] == pairs
    for (source_text, target_text), row in zip(pairs, rows):
        target_ids = subwords.encode([target_text])[0] + [EOS_ID]
        assert row["truncated"] == (len(target_ids) > model.maxlen2)
        target_ids = target_ids[:model.maxlen2]
        expected = _log_prob_by_hand(model, subwords.encode([source_text])[0], target_ids)
        assert row["log_prob"] == pytest.approx(expected, abs=1e-3)
        assert row["tokens"] == len(target_ids)
        assert row["score"] == pytest.approx(row["log_prob"] / ((5 + len(target_ids)) / 6),
                                             rel=1e-5)
    assert rows[-1]["truncated"] and rows[-1]["tokens"] == model.maxlen2
    assert rows[-2]["tokens"] == 1  # an empty translation is EOS alone
    cut = sum(row["truncated"] for row in rows)
    assert (f"note: {cut} translations were longer than {model.maxlen2} subwords"
            in result.stdout)


@pytest.mark.slow
def test_eval_refuses_a_score_file_of_another_length(varied, tmp_path):
    source = write_lines(tmp_path / "three.de", varied["sources"][:3])
    target = write_lines(tmp_path / "two.en", varied["references"][:2])
    result = run("eval.py", "--logdir", varied["logdir"], "--src", source, "--score", target)
    assert result.returncode != 0
    assert f"{target} has 2 lines but {source} has 3" in result.stderr


# ------------------------------------------------------------------ --ctranslate2


@pytest.mark.slow
@pytest.mark.cpu_exact
def test_eval_with_ctranslate2_writes_the_keras_greedy_translations(varied, tmp_path):
    """eval.py --ctranslate2 writes the translations, counts and scores of the Keras engine.

    Assumes a CPU: CTranslate2 decodes on the CPU and Keras on the GPU where one is seen,
    whose kernels round otherwise and may tip a near-tie between two tokens."""
    pytest.importorskip("ctranslate2")
    from kyu_transformer.export.ctranslate2 import convert

    logdir, sources = varied["logdir"], _sources(varied)
    model_dir = convert(varied["model"], varied["hparams"], varied["subwords"],
                        str(tmp_path / "ct2"))
    source = write_lines(tmp_path / "engines.de", sources)
    reference = write_lines(tmp_path / "engines.en", varied["references"][:len(sources)])
    # A small margin makes outputs reach their own limits, which both engines must agree on.
    common = ["--logdir", logdir, "--src", source, "--ref", reference, "--beam_size", 1,
              "--length_margin", 2]
    keras_run = run("eval.py", *common, "--name", "keras")
    assert keras_run.returncode == 0, keras_run.stdout + keras_run.stderr
    ctranslate2_run = run("eval.py", *common, "--name", "ct2", "--ctranslate2", model_dir)
    assert ctranslate2_run.returncode == 0, ctranslate2_run.stdout + ctranslate2_run.stderr
    assert f"CTranslate2 model {model_dir}" in ctranslate2_run.stdout

    keras_lines, ctranslate2_lines = (
        (logdir / "eval" / f"{name}.hyp.txt").read_text(encoding="utf-8").split("\n")
        for name in ("keras", "ct2"))
    assert len(keras_lines) == len(sources) + 1  # each line, then the final newline
    assert [i for i, (a, b) in enumerate(zip(keras_lines, ctranslate2_lines)) if a != b] == []
    assert len(set(keras_lines)) >= 20  # real, varied outputs
    keras_json, ctranslate2_json = (json.loads((logdir / "eval" / f"{name}.json").read_text())
                                    for name in ("keras", "ct2"))
    assert keras_json["engine"] == "keras" and ctranslate2_json["engine"] == "ctranslate2"
    assert ctranslate2_json["model_dir"] == model_dir
    assert ctranslate2_json["quantization"] == "float32"
    for key in ("bleu", "chrf", "truncated_sources", "truncated_outputs", "num_sentences"):
        assert ctranslate2_json[key] == keras_json[key], key
    assert keras_json["truncated_outputs"] >= 5 and keras_json["truncated_sources"] >= 1


@pytest.mark.slow
def test_eval_refuses_a_ctranslate2_model_of_other_subwords(varied, tmp_path):
    pytest.importorskip("ctranslate2")
    from kyu_transformer.export.ctranslate2 import convert

    model_dir = convert(varied["model"], varied["hparams"], varied["subwords"],
                        str(tmp_path / "ct2"))
    with open(os.path.join(model_dir, filenames.SUBWORDS), "ab") as handle:
        handle.write(b"another model")
    result = run("eval.py", "--logdir", varied["logdir"], "--ctranslate2", model_dir)
    assert result.returncode != 0
    assert f"{model_dir} was converted with another subword model than" in result.stderr
    result = run("eval.py", "--logdir", varied["logdir"], "--ctranslate2", tmp_path / "none")
    assert result.returncode != 0
    assert f"--ctranslate2 {tmp_path / 'none'}: no such directory" in result.stderr
