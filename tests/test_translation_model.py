"""Translating from Python: `TranslationModel` in one `.keras` file (on every backend),
`load_translator` for a logdir and each export, eval.py and export.py on `.keras` files, target
prefixes through the programs, and `BleuCallback` for `fit`."""

import json
import os
import shutil

import keras
import numpy as np
import pytest

from kyu_transformer import TranslationModel
from kyu_transformer.data.subwords import Subwords
from kyu_transformer.data.text import load_split
from kyu_transformer.decoding.settings import SearchSettings
from tests import programs
from tests.conftest import BACKEND, copy_of_logdir
from tests.test_data import MULTI30K

SHAPE = {"d_model": 32, "d_ff": 64, "num_blocks": 1, "num_heads": 4, "maxlen1": 24,
         "maxlen2": 24}
# Search flags of the comparisons with eval.py, as flags and as `SearchSettings` fields.
SEARCH = {"beam_size": 4, "alpha": 1.0}
SEARCH_FLAGS = [word for name, value in SEARCH.items() for word in (f"--{name}", str(value))]


@pytest.fixture(scope="module")
def small_translator(tmp_path_factory):
    """An untrained `TranslationModel` of a 200-piece subword model, and val sentences."""
    sources, targets, _ = load_split(MULTI30K, "train")
    subwords = Subwords.train_or_load(str(tmp_path_factory.mktemp("subwords")),
                                      sources + targets, 200)
    model = TranslationModel({**SHAPE, "vocab_size": subwords.vocab_size},
                             SearchSettings(beam_size=2, alpha=0.8), subwords)
    val, references, _ = load_split(MULTI30K, "val")
    return {"model": model, "val": val[:20], "references": references[:20]}


def test_a_keras_file_holds_the_network_subwords_and_settings(small_translator, tmp_path):
    """Saved and loaded back (Keras' own `load_model`), on any backend: the same logits, scores,
    settings and subword model; translating names what needs TensorFlow where it is not."""
    model, val = small_translator["model"], small_translator["val"]
    path = str(tmp_path / "translator.keras")
    model.save(path)
    shutil.rmtree(os.path.dirname(model.subwords.path))  # the archive holds its own copy
    loaded = keras.saving.load_model(path)
    assert type(loaded) is TranslationModel and loaded.settings == model.settings
    assert loaded.hparams == model.hparams
    assert loaded.subwords.digest() == model.subwords.digest()
    assert loaded.subwords.encode(val) == model.subwords.encode(val)
    ids = np.array([[5, 6, 7, 3, 0], [9, 10, 3, 0, 0]], "int32")
    inputs = {"source": ids, "target_in": ids[:, ::-1].copy()}
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(loaded(inputs)),
                                  keras.ops.convert_to_numpy(model(inputs)))
    translations = small_translator["references"]
    scored = loaded.score(val, translations)
    assert [s.score for s in scored] == [s.score for s in model.score(val, translations)]
    assert all(s.log_prob < 0 and s.tokens > 1 for s in scored)
    if BACKEND == "tensorflow":
        assert loaded.translate(val) == model.translate(val)
    else:
        with pytest.raises(RuntimeError, match=r"^translate\(\) searches with TensorFlow's while "
                                               rf"loop .* KERAS_BACKEND is {BACKEND}: .*"):
            loaded.translate(val)


# -------------------------------------------- TensorFlow: the programs and the other engines

# The val sentences the comparisons with eval.py translate.
SENTENCES = 60


@pytest.fixture(scope="module")
def exported(trained_tiny_logdir, tmp_path_factory):
    """A copy of the trained logdir, its `.keras` export (beam 4, alpha 1.0, the last two
    checkpoints averaged), and eval.py's translations of both of the first `SENTENCES` of val."""
    logdir = copy_of_logdir(trained_tiny_logdir, tmp_path_factory, "keras-file")
    path = logdir.parent / "small.keras"
    val, _, _ = load_split(MULTI30K, "val")
    sources = logdir.parent / "val.de"
    sources.write_text("\n".join(val[:SENTENCES]) + "\n")
    result = programs.run("export.py", "--logdir", logdir, "--out", path, "--format", "keras",
                          "--average_last", "2", *SEARCH_FLAGS)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"wrote {path}: checkpoint " in result.stdout
    hypotheses = {}
    for name, flags in (("logdir", ["--logdir", logdir, "--average_last", "2", *SEARCH_FLAGS]),
                        ("file", ["--logdir", path])):  # the file's own settings
        result = programs.run("eval.py", *flags, "--src", sources, "--mixed_precision", "no")
        assert result.returncode == 0, result.stdout + result.stderr
        out_dir = logdir / "eval" if name == "logdir" else logdir.parent / "small-eval"
        hypotheses[name] = (out_dir / "val.hyp.txt").read_text().splitlines()
        assert len(hypotheses[name]) == SENTENCES
    return {"logdir": logdir, "path": path, "hypotheses": hypotheses}


# `import kyu_transformer` first, as the README says: Keras, imported after it, learns the class.
LOAD_AND_TRANSLATE = r"""
import json, sys
import kyu_transformer
import keras

model = keras.saving.load_model(sys.argv[1])
print(json.dumps(model.translate(json.load(open(sys.argv[2], encoding="utf-8")))))
"""


@pytest.mark.tensorflow_only("decoding")
@pytest.mark.slow
def test_a_keras_file_translates_as_eval_py_in_a_fresh_process_without_the_logdir(
        exported, tmp_path):
    val, _, _ = load_split(MULTI30K, "val")
    assert exported["hypotheses"]["file"] == exported["hypotheses"]["logdir"]
    assert len(set(exported["hypotheses"]["logdir"])) > 10  # a tiny model: few distinct ones
    (tmp_path / "val.json").write_text(json.dumps(val[:SENTENCES]))
    away = tmp_path / "away"
    os.rename(exported["logdir"], away)  # gone while the file loads (back for the next tests)
    try:
        result = programs.run("-c", LOAD_AND_TRANSLATE, exported["path"],
                              tmp_path / "val.json", fresh=True)
    finally:
        os.rename(away, exported["logdir"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.splitlines()[-1]) == exported["hypotheses"]["logdir"]


@pytest.mark.tensorflow_only("decoding")
@pytest.mark.slow
@pytest.mark.cpu_exact  # a sentence alone and in a batch of 5 as in eval.py's batches
def test_two_lines_translate_a_logdir_as_eval_py(exported):
    from kyu_transformer import load_translator

    val, _, _ = load_split(MULTI30K, "val")
    translator = load_translator(str(exported["logdir"]), average_last=2,
                                 mixed_precision="no", **SEARCH)
    assert translator.translate(val[:SENTENCES]) == exported["hypotheses"]["logdir"]
    assert translator.translate(val[3]) == exported["hypotheses"]["logdir"][3]
    best = translator.translate(val[:5], n_best=3)
    assert [row[0].text for row in best] == exported["hypotheses"]["logdir"][:5]
    assert all(len(row) == 3 and row[0].score >= row[1].score >= row[2].score for row in best)
    prefixed = translator.translate(val[:5], prefixes=["Two", "", None, "A woman", "The"])
    assert prefixed[1:3] == exported["hypotheses"]["logdir"][1:3]
    assert prefixed[0].startswith("Two") and prefixed[3].startswith("A woman")
    scored = translator.score(val[:5], [row[0].text for row in best])
    np.testing.assert_allclose([s.score for s in scored], [row[0].score for row in best],
                               rtol=1e-5)
    sampled = translator.with_settings(sampling_topk=0, seed=5).translate(val[:5], n_best=2)
    assert all(len(row) == 2 for row in sampled)


@pytest.mark.tensorflow_only("the exports")
@pytest.mark.slow
@pytest.mark.cpu_exact  # CTranslate2's text against the Keras model's, each on its own device
def test_every_export_loads_into_the_same_translator_and_takes_prefixes(exported, tmp_path):
    """A SavedModel and a CTranslate2 model load into `TextTranslator` as the logdir does and,
    all in float32 and greedy, translate alike with and without prefixes."""
    from kyu_transformer import load_translator
    from kyu_transformer.export.saved_model import import_tensorflow_text

    val, references, _ = load_split(MULTI30K, "val")
    sources = val[:40]
    prefixes = [" ".join(reference.split()[:row % 3]) for row, reference in
                enumerate(references[:40])]
    outs = {"ctranslate2": tmp_path / "ct2"}
    if import_tensorflow_text() is not None:
        outs["saved_model"] = tmp_path / "saved_model"
    for export_format, out in outs.items():
        flags = ["--beam_size", "1"] if export_format == "saved_model" else []
        result = programs.run("export.py", "--logdir", exported["logdir"], "--out", out,
                              "--format", export_format, *flags)
        assert result.returncode == 0, result.stdout + result.stderr
    keras_one = load_translator(str(exported["logdir"]), mixed_precision="no", beam_size=1)
    expected = keras_one.translate(sources), keras_one.translate(sources, prefixes)
    assert all(text.startswith(prefix) for text, prefix in zip(expected[1], prefixes))
    for export_format, out in outs.items():
        translator = load_translator(str(out), beam_size=1)
        assert translator.translate(sources) == expected[0], export_format
        assert translator.translate(sources, prefixes) == expected[1], export_format
    for path, arguments in ((outs["ctranslate2"], {"average_last": 2}),
                            (exported["path"], {"ckpt": "best"})):
        with pytest.raises(ValueError, match="choose a logdir's checkpoints; an export holds"):
            load_translator(str(path), **arguments)
    with pytest.raises(ValueError, match="`mixed_precision` applies to a Keras model"):
        load_translator(str(outs["ctranslate2"]), mixed_precision="bf16")
    if "saved_model" in outs:  # exported greedy: it decodes only so
        with pytest.raises(ValueError, match="decodes as it was exported"):
            load_translator(str(outs["saved_model"]), beam_size=3)


JAX_LOGITS_AND_SCORES = r"""
import json, sys
import keras
import numpy as np
import kyu_transformer

model = keras.saving.load_model(sys.argv[1])
request = json.load(open(sys.argv[2], encoding="utf-8"))
logits = model({"source": np.array(request["source"], "int32"),
                "target_in": np.array(request["target_in"], "int32")})
print(json.dumps({"backend": keras.backend.backend(),
                  "logits": keras.ops.convert_to_numpy(logits).tolist(),
                  "scores": [s.score for s in model.score(request["val"], request["outputs"])]}))
"""


@pytest.mark.tensorflow_only("writes the file under TensorFlow, reads it under JAX")
@pytest.mark.slow
def test_a_file_written_on_tensorflow_gives_the_same_logits_and_scores_on_jax(exported,
                                                                              tmp_path):
    pytest.importorskip("jax")
    model = keras.saving.load_model(exported["path"])
    val, _, _ = load_split(MULTI30K, "val")
    outputs = exported["hypotheses"]["logdir"][:20]
    ids = np.array([[5, 6, 7, 3, 0], [9, 10, 3, 0, 0]], "int32")
    request = {"source": ids.tolist(), "target_in": ids[:, ::-1].tolist(), "val": val[:20],
               "outputs": outputs}
    (tmp_path / "request.json").write_text(json.dumps(request))
    result = programs.run("-c", JAX_LOGITS_AND_SCORES, exported["path"],
                          tmp_path / "request.json", env=programs.environment(KERAS_BACKEND="jax"))
    assert result.returncode == 0, result.stderr[-3000:]
    on_jax = json.loads(result.stdout.splitlines()[-1])
    assert on_jax["backend"] == "jax"
    np.testing.assert_allclose(on_jax["logits"], keras.ops.convert_to_numpy(
        model({"source": ids, "target_in": ids[:, ::-1].copy()})), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(on_jax["scores"], [s.score for s in model.score(val[:20],
                                                                               outputs)],
                               rtol=1e-5)


@pytest.mark.tensorflow_only("eval.py")
@pytest.mark.slow
@pytest.mark.cpu_exact  # standard input decodes a line at a time, a file in batches
def test_eval_py_starts_each_translation_with_its_prefix_line(exported, tmp_path):
    val, references, _ = load_split(MULTI30K, "val")
    lines = [" ".join(reference.split()[:row % 3]) for row, reference in
             enumerate(references[:30])]
    lines[4] = " ".join([references[4]] * 6)  # longer than its sentence's output limit
    for name, texts in (("src.de", val[:30]), ("ref.en", references[:30]), ("prefix", lines),
                        ("short", lines[:29])):
        (tmp_path / name).write_text("\n".join(texts) + "\n")
    flags = ["eval.py", "--logdir", exported["logdir"], "--src", tmp_path / "src.de", "--ref",
             tmp_path / "ref.en", "--mixed_precision", "no", "--average_last", "2",
             *SEARCH_FLAGS]
    result = programs.run(*flags, "--target_prefix", tmp_path / "prefix")
    assert result.returncode == 0, result.stdout + result.stderr
    hypotheses = (exported["logdir"] / "eval" / "src.hyp.txt").read_text().splitlines()
    assert all(text.startswith(prefix) for row, (text, prefix) in
               enumerate(zip(hypotheses, lines)) if row != 4)
    assert lines[4].startswith(hypotheses[4]) and len(hypotheses[4]) > 20  # the cut prefix
    record = json.loads((exported["logdir"] / "eval" / "src.json").read_text())
    assert record["truncated_prefixes"] == 1
    assert record["target_prefix"] == str(tmp_path / "prefix")
    assert "note: 1 prefixes were longer than their sentence's output limit" in result.stdout
    # standard input: a tab, then the prefix; a line without one has none
    prefixed = {1, 3, 4, 5}  # line 5 (row 4): the prefix cut to its limit
    stdin = "".join(f"{source}\t{prefix}\n" if row in prefixed else f"{source}\n"
                    for row, (source, prefix) in enumerate(zip(val[:6], lines)))
    streamed = programs.run("eval.py", "--logdir", exported["logdir"], "--src", "-",
                            "--target_prefix", "-", "--mixed_precision", "no",
                            "--average_last", "2", *SEARCH_FLAGS, stdin=stdin)
    assert streamed.returncode == 0, streamed.stderr
    unprefixed = exported["hypotheses"]["logdir"]
    assert streamed.stdout.splitlines() == [hypotheses[row] if row in prefixed
                                            else unprefixed[row] for row in range(6)]
    assert "note: line 5: its prefix is longer than its output limit" in streamed.stderr
    assert "note: line" not in streamed.stderr.replace("note: line 5:", "")
    for command, expected in (
            ([*flags, "--target_prefix", tmp_path / "short"],
             f"error: {tmp_path / 'short'} has 29 lines but {tmp_path / 'src.de'} has 30: "
             "--target_prefix needs one line per source line (empty for no prefix)"),
            (["eval.py", "--logdir", exported["logdir"], "--src", tmp_path / "src.de",
              "--target_prefix", tmp_path / "prefix", "--score", tmp_path / "ref.en"],
             "--score and --target_prefix exclude each other")):
        refused = programs.run(*command)
        assert refused.returncode != 0 and "Traceback" not in refused.stderr
        assert expected in refused.stderr.strip().splitlines()[-1], refused.stderr


def _copy_task(rng, count):
    """``(inputs, labels, sources, targets)`` of a copy task: random ids of 3 to 7 tokens."""
    sources = [rng.integers(4, 40, size=rng.integers(3, 8)).tolist() for _ in range(count)]
    width = 8
    pad = lambda rows: np.array([row + [0] * (width - len(row)) for row in rows], "int32")  # noqa
    inputs = {"source": pad(sources), "target_in": pad([[2] + row for row in sources])}
    return inputs, pad([row + [3] for row in sources]), sources, sources


@pytest.mark.tensorflow_only("decoding")
@pytest.mark.slow
def test_bleu_callback_logs_each_epoch_and_restores_the_best_weights(tmp_path):
    """`fit` on a copy task gets train.py's validation BLEU: in `History` and TensorBoard each
    epoch; the last epoch, at a rate that wrecks the model, scores worse, and the weights of
    the best epoch are restored."""
    import tensorflow as tf

    from kyu_transformer.losses import LabelSmoothedCrossEntropy
    from kyu_transformer.model import Transformer
    from kyu_transformer.training.validation import BleuCallback

    rng = np.random.default_rng(0)
    inputs, labels, _, _ = _copy_task(rng, 512)
    _, _, sources, targets = _copy_task(rng, 32)
    model = Transformer(vocab_size=40, d_model=32, d_ff=64, num_blocks=1, num_heads=4,
                        maxlen1=12, maxlen2=12)
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=LabelSmoothedCrossEntropy(0.1))
    weights = []
    keep = keras.callbacks.LambdaCallback(on_epoch_end=lambda *_: weights.append(
        model.get_weights()))
    wreck = keras.callbacks.LearningRateScheduler(lambda epoch, rate: 30.0 if epoch == 5
                                                  else 1e-2)
    bleu = BleuCallback(sources, targets)
    history = model.fit(inputs, labels, batch_size=32, epochs=6, verbose=0, callbacks=[
        wreck, bleu, keep, keras.callbacks.TensorBoard(str(tmp_path / "tb"))])
    scores = history.history["val_bleu"]
    assert len(scores) == len(history.history["val_chrf"]) == 6
    # it learns (seen: 0.3 to 5.6 in five epochs), then the wrecked epoch falls (seen: 0.0)
    assert max(scores) > 3 * scores[0] and scores[-1] < max(scores) / 2, scores
    assert bleu.best_epoch == scores.index(max(scores)) and bleu.best_bleu == max(scores)
    for restored, best in zip(model.get_weights(), weights[bleu.best_epoch]):
        np.testing.assert_array_equal(restored, best)
    logged = [float(tf.make_ndarray(value.tensor))
              for name in os.listdir(tmp_path / "tb" / "validation")
              for event in tf.compat.v1.train.summary_iterator(
                  str(tmp_path / "tb" / "validation" / name))
              for value in event.summary.value if value.tag == "epoch_bleu"]
    np.testing.assert_allclose(logged, scores, rtol=1e-6)
    # another fit is scored on its own: its best epoch, worse than the first fit's, is kept
    model.fit(inputs, labels, batch_size=32, epochs=1, verbose=0, callbacks=[
        keras.callbacks.LearningRateScheduler(lambda epoch, rate: 30.0), bleu, keep])
    assert bleu.best_epoch == 0 and bleu.best_bleu < max(scores)
    for restored, last in zip(model.get_weights(), weights[-1]):
        np.testing.assert_array_equal(restored, last)


@pytest.mark.tensorflow_only("export.py")
@pytest.mark.slow
def test_export_refuses_a_keras_out_it_cannot_write_or_would_replace(exported, tmp_path):
    path = tmp_path / "small.keras"  # a copy: the module's other tests read the fixture's
    shutil.copy(exported["path"], path)
    exported = {**exported, "path": path}
    earlier = exported["path"].read_bytes()
    for flags, expected in (
            (["--out", exported["path"]], f"error: --out {exported['path']} already exists; "
                                          "pass --overwrite to replace it"),
            (["--out", tmp_path / "small"], f"error: --out {tmp_path / 'small'}: --format keras "
                                            "writes one file named *.keras"),
            (["--out", tmp_path / "x.keras", "--mixed_precision", "bf16"],
             "--mixed_precision (bf16) applies to --format saved_model only")):
        refused = programs.run("export.py", "--logdir", exported["logdir"], "--format", "keras",
                               *flags)
        assert refused.returncode != 0 and "Traceback" not in refused.stderr
        assert expected in refused.stderr.strip().splitlines()[-1], refused.stderr
    assert exported["path"].read_bytes() == earlier
    replaced = programs.run("export.py", "--logdir", exported["logdir"], "--format", "keras",
                            "--out", exported["path"], "--overwrite", "--beam_size", "2")
    assert replaced.returncode == 0, replaced.stderr
    assert keras.saving.load_model(exported["path"]).settings.beam_size == 2
    # eval.py checks the flags given against the file's settings, before TensorFlow loads
    refused = programs.run("eval.py", "--logdir", exported["path"], "--n_best", "3")
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    assert "devices:" not in refused.stderr  # said once TensorFlow has started
    assert refused.stderr.strip().splitlines()[-1].endswith(
        "error: --n_best (3) must be at most --beam_size (2): the search keeps only --beam_size "
        "hypotheses"), refused.stderr
    (tmp_path / "damaged.keras").write_bytes(earlier[:1000])
    for flags, expected in (
            (["--logdir", exported["path"], "--average_last", "2"],
             "--ckpt and --average_last choose a logdir's checkpoints; a .keras file holds its "
             "weights"),
            (["--logdir", tmp_path / "damaged.keras"],
             f"error: --logdir {tmp_path / 'damaged.keras'}: not a translator saved by "
             "kyu_transformer (export.py --format keras)")):
        refused = programs.run("eval.py", *flags)
        assert refused.returncode != 0 and "Traceback" not in refused.stderr
        assert expected in refused.stderr.strip().splitlines()[-1], refused.stderr
    assert not [name for name in os.listdir(exported["path"].parent) if name.startswith(".")]
