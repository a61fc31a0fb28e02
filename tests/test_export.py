"""export.py and the SavedModel it writes: eval.py's translations, outside this package."""

import json
import os

import numpy as np
import pytest
import tensorflow as tf

import export
from kyu_transformer import filenames
from kyu_transformer.conventions import EOS_ID, PAD_ID
from kyu_transformer.data.text import load_split
from kyu_transformer.decoding import search
from kyu_transformer.decoding.scoring import length_penalty, sequence_log_probs
from kyu_transformer.decoding.translator import Translator
from kyu_transformer.export import saved_model
from kyu_transformer.precision import set_precision
from kyu_transformer.training.checkpoints import load_model
from tests.conftest import copy_of_logdir, load_logdir
from tests.programs import run
from tests.test_data import MULTI30K
from tests.varied_model import clear_greedy_choices

# The text signature, and loading a SavedModel that has it, need tensorflow-text's ops.
needs_tensorflow_text = pytest.mark.skipif(
    saved_model.import_tensorflow_text() is None,
    reason=f"tensorflow-text is not installed ({saved_model.SERVE_EXTRA})")
ALPHA = 0.6
# Each export of the `exports` fixture: its export.py flags.
EXPORTS = {
    # Sampling near temperature 0 is greedy search: its sample signature must agree.
    "greedy": ("--beam_size", 1, "--sampling_topk", 0, "--sampling_temperature", 1e-3),
    # Its sample signature: 3 samples per sentence, top-k 5, top-p 0.9.
    "beam": ("--beam_size", 4, "--n_best", 3, "--sampling_topk", 5, "--sampling_topp", 0.9),
    "beam_bf16": ("--beam_size", 4, "--mixed_precision", "bf16"),
}

# Run as a program that has not imported kyu_transformer: loads SavedModels with TensorFlow and
# tensorflow-text only, calls their signatures as the request file says, and writes the outputs
# (and whether kyu_transformer got imported) as JSON.
SERVE_SCRIPT = r"""
import json, sys
import numpy as np
import tensorflow as tf
import tensorflow_text  # registers the SentencePiece ops

request = json.load(open(sys.argv[1], encoding="utf-8"))
loaded, results = {}, {}
for key, call in request.items():
    if call["dir"] not in loaded:
        loaded[call["dir"]] = tf.saved_model.load(call["dir"])
    signature = loaded[call["dir"]].signatures[call["signature"]]
    if "ids" in call:
        outputs = signature(ids=tf.constant(call["ids"], tf.int32, shape=call["shape"]))
    elif "prefix" in call:
        outputs = signature(text=tf.constant(call["text"], tf.string, shape=[len(call["text"])]),
                            prefix=tf.constant(call["prefix"], tf.string,
                                               shape=[len(call["prefix"])]))
    elif "seed" in call:
        outputs = signature(text=tf.constant(call["text"], tf.string, shape=[len(call["text"])]),
                            seed=tf.constant(call["seed"], tf.int64))
    else:
        outputs = signature(text=tf.constant(call["text"], tf.string, shape=[len(call["text"])]))
    # Strings as UTF-8 (numpy's own conversion of bytes assumes ASCII).
    results[key] = {name: (np.char.decode(value.numpy().astype(bytes), "utf-8")
                           if value.dtype == tf.string else value.numpy()).tolist()
                    for name, value in outputs.items()}
results["kyu_transformer_imported"] = "kyu_transformer" in sys.modules
json.dump(results, open(sys.argv[2], "w", encoding="utf-8"))
"""


def prefixes_of(sentences):
    """Prefixes of 0 to 4 words of `sentences`, one each."""
    return [" ".join(sentence.split()[:row % 5]) for row, sentence in enumerate(sentences)]


def run_export(logdir, out, *flags):
    return run("export.py", "--logdir", logdir, "--out", out, *flags, timeout=900)


def _padded(id_lists):
    """Id lists as a `(N, S)` int32 list of lists, padded with 0."""
    width = max([len(ids) for ids in id_lists] + [1])
    return [list(ids) + [0] * (width - len(ids)) for ids in id_lists]


def _stripped(row):
    """A `(L,)` output row of the ids signature as a list, padding removed."""
    return [int(i) for i in row if i != PAD_ID]


@pytest.fixture(scope="module")
def varied(varied_tiny_logdir, tmp_path_factory):
    """The session's model with set weights (a logdir copy), its subword model, val sentences."""
    logdir = copy_of_logdir(varied_tiny_logdir, tmp_path_factory, "export")
    hparams, model, subwords = load_logdir(logdir)
    val, _, _ = load_split(MULTI30K, "val")
    # Five val sentences joined: longer than the encoder's maxlen1.
    long = [" ".join(val[first:first + 5]) for first in range(200, 230, 5)]
    assert all(len(ids) + 1 > model.maxlen1 for ids in subwords.encode(long))
    return {"logdir": logdir, "hparams": hparams, "model": model, "subwords": subwords,
            "val": val, "long": long}


@pytest.fixture(scope="module")
def exports(varied, tmp_path_factory):
    """The directories written by export.py for each of `EXPORTS`, and its output."""
    root = tmp_path_factory.mktemp("exports")
    written = {}
    for name, flags in EXPORTS.items():
        result = run_export(varied["logdir"], root / name, *flags)
        assert result.returncode == 0, result.stdout + result.stderr
        written[name] = {"dir": str(root / name), "stdout": result.stdout}
    return written


@pytest.fixture(scope="module")
def served(varied, exports, tmp_path_factory):
    """The SavedModels' outputs, from a process that never imports kyu_transformer."""
    val, long, subwords = varied["val"], varied["long"], varied["subwords"]
    ids = subwords.encode(val[:100] + long)
    # Tabs, a no-break space, an ideographic space and runs of them, as raw input may hold.
    messy = [" \t" + line.replace(" ", "\t", 1).replace(" ", "\u00a0 ", 1)
             .replace(" ", "\u3000", 1) + " \r" for line in val[:20]]
    calls = {
        "greedy_val": ("greedy", val), "beam_val": ("beam", val), "bf16_val": ("beam_bf16", val),
        "beam_long": ("beam", long), "beam_messy": ("beam", messy),
        "beam_empty": ("beam", ["", val[0], " ", ""]), "beam_none": ("beam", []),
        "greedy_one": ("greedy", val[:1]), "greedy_thousand": ("greedy", val * 4),
    }
    request = {key: {"dir": exports[name]["dir"], "signature": saved_model.TEXT_SIGNATURE,
                     "text": text} for key, (name, text) in calls.items()}
    samples = {"cold": ("greedy", val, 5), "sample": ("beam", val, 1),
               "sample_again": ("beam", val, 1), "sample_other_seed": ("beam", val, 2),
               "sample_first": ("beam", val[:1], 1),
               # The first 100 sentences at their places, other neighbours, other batches.
               "sample_neighbours": ("beam", val[:100] + long + val[150:], 1)}
    for key, (name, text, seed) in samples.items():
        request[key] = {"dir": exports[name]["dir"], "signature": saved_model.SAMPLE_SIGNATURE,
                        "text": text, "seed": seed}
    for name in ("greedy", "beam"):  # the first words of other sentences, some none
        request[f"{name}_prefixed"] = {
            "dir": exports[name]["dir"], "signature": saved_model.PREFIX_SIGNATURE,
            "text": val[:60], "prefix": prefixes_of(val[100:160])}
        request[f"{name}_ids"] = {"dir": exports[name]["dir"],
                                  "signature": saved_model.IDS_SIGNATURE, "ids": _padded(ids),
                                  "shape": [len(ids), len(_padded(ids)[0])]}
    folder = tmp_path_factory.mktemp("served")
    with open(folder / "request.json", "w", encoding="utf-8") as handle:
        json.dump(request, handle)
    result = run("-c", SERVE_SCRIPT, folder / "request.json", folder / "results.json",
                 cwd=folder, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    with open(folder / "results.json", encoding="utf-8") as handle:
        return {**json.load(handle), "source_ids": ids}


# ------------------------------------------------------------ the programs


def test_export_refuses_bad_flags_naming_them(capsys):
    cases = [
        (["--n_best", "5", "--beam_size", "4"], "--n_best (5) must be at most --beam_size (4)"),
        (["--quantization", "int8"], "--quantization (int8) applies to --format ctranslate2"),
        (["--length_margin", "-1"], "--length_margin must be at least 0, got -1"),
        (["--ckpt", "best", "--average_last", "2"], "--ckpt (best) and --average_last (2)"),
        (["--average_last", "-1"], "--average_last must be at least 0, got -1"),
        (["--beam_szie", "4"], "unknown flag --beam_szie (did you mean --beam_size?)"),
        # A CTranslate2 model holds no search settings: given ones would be lost.
        (["--format", "ctranslate2", "--beam_size", "1", "--alpha", "1"],
         "--beam_size, --alpha applies to --format saved_model only"),
        (["--format", "ctranslate2", "--n_best", "1"], "--n_best applies to --format saved_model"),
        (["--format", "ctranslate2", "--length_margin", "3", "--batch_size", "8"],
         "--length_margin, --batch_size applies to --format saved_model only"),
        (["--format", "ctranslate2", "--sampling_topk", "5"],
         "--sampling_topk applies to --format saved_model only"),
        (["--sampling_topk", "1"], "--sampling_topk 1 does not sample"),
        (["--sampling_topk", "0", "--sampling_topp", "1.5"],
         "--sampling_topp must be in (0, 1], got 1.5"),
        (["--sampling_topp", "0.5"], "--sampling_topp applies to sampling: give --sampling_topk"),
        (["--seed", "3"], "unknown flag --seed"),
        (["--format", "ctranslate2", "--mixed_precision", "bf16"],
         "--mixed_precision (bf16) applies to --format saved_model only"),
    ]
    for flags, message in cases:
        with pytest.raises(SystemExit):
            export.parse_args(["--logdir", "log", "--out", "out", *flags])
        assert message in capsys.readouterr().err


def test_the_saved_models_search_flags_have_their_defaults():
    args = export.parse_args(["--logdir", "log", "--out", "out"])
    settings = args.settings
    assert (settings.beam_size, settings.alpha, settings.n_best, settings.length_margin,
            settings.batch_size, settings.sampling) == (4, 0.6, 1, 16, 128, False)
    assert args.sampling is None  # no sample signature unless asked for
    args = export.parse_args(["--logdir", "log", "--out", "out", "--sampling_topk", "0",
                              "--sampling_topp", "0.5", "--n_best", "2"])
    sampling = args.sampling
    assert (sampling.beam_size, sampling.sampling_topk, sampling.sampling_topp,
            sampling.n_best) == (1, 0, 0.5, 2)
    args = export.parse_args(["--logdir", "log", "--out", "out", "--format", "ctranslate2"])
    assert args.settings.beam_size == 4  # what the printed usage suggests


def test_export_refuses_a_file_as_out(tmp_path):
    path = tmp_path / "file"
    path.write_text("mine")
    with pytest.raises(SystemExit, match="is a file"):
        export.check_out(str(path), overwrite=True, logdir=str(tmp_path / "log"))


def fake_earlier_export(out):
    """A directory that export.py takes for an earlier SavedModel export."""
    (out / "assets.extra").mkdir(parents=True)
    (out / "saved_model.pb").write_text("an earlier export")
    (out / "assets.extra" / "export.json").write_text("{}")


def test_overwrite_replaces_only_an_earlier_export_and_never_the_logdir(tmp_path):
    logdir = tmp_path / "log"
    (logdir / "checkpoints").mkdir(parents=True)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("not an export")
    for out, message in ((logdir, "is or holds the --logdir"),
                         (tmp_path, "is or holds the --logdir"),
                         (mine, "holds no earlier export")):
        with pytest.raises(SystemExit, match=message):
            export.check_out(str(out), overwrite=True, logdir=str(logdir))
    earlier = tmp_path / "earlier"
    fake_earlier_export(earlier)
    export.check_out(str(earlier), overwrite=True, logdir=str(logdir))  # accepted
    with pytest.raises(SystemExit, match="already exists and is not empty; pass --overwrite"):
        export.check_out(str(earlier), overwrite=False, logdir=str(logdir))


@pytest.mark.slow
def test_a_non_empty_out_is_refused_without_overwrite_and_replaced_whole_with_it(varied,
                                                                                 tmp_path):
    out = tmp_path / "out"
    fake_earlier_export(out)
    result = run_export(varied["logdir"], out, "--beam_size", 1)
    assert result.returncode != 0
    assert "already exists and is not empty; pass --overwrite" in result.stderr
    assert (out / "saved_model.pb").read_text() == "an earlier export"

    result = run_export(varied["logdir"], out, "--beam_size", 1, "--overwrite")
    assert result.returncode == 0, result.stdout + result.stderr
    assert (out / "saved_model.pb").read_bytes() != b"an earlier export"
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no staging directory left behind


@pytest.mark.slow
def test_an_export_that_fails_leaves_the_old_one_intact(varied, tmp_path, monkeypatch):
    out = tmp_path / "out"
    fake_earlier_export(out)

    def crash(args, model, subwords, checkpoints, precision, target):
        os.makedirs(target)
        with open(os.path.join(target, "saved_model.pb"), "w") as handle:
            handle.write("half written")
        raise RuntimeError("disk full")

    monkeypatch.setattr(export, "write_saved_model", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        export.main(["--logdir", str(varied["logdir"]), "--out", str(out), "--overwrite"])
    assert sorted(os.listdir(out)) == ["assets.extra", "saved_model.pb"]
    assert (out / "saved_model.pb").read_text() == "an earlier export"
    assert sorted(os.listdir(tmp_path)) == ["out"]


@needs_tensorflow_text
@pytest.mark.slow
def test_export_says_what_it_wrote_and_how_to_call_it(varied, exports):
    stdout = exports["beam"]["stdout"]
    assert f"wrote a SavedModel to {exports['beam']['dir']}" in stdout
    assert "beam 4, alpha 0.6, n_best 3, length margin 16" in stdout
    assert "signatures: ids, prefixed, sample, serving_default" in stdout
    assert "sample: 3 samples per sentence, top-k 5, top-p 0.9, temperature 1.0" in stdout
    assert "tf.saved_model.load(" in stdout and "tensorflow/serving" in stdout
    assert ":predict" in stdout
    with open(os.path.join(exports["beam"]["dir"], filenames.SAVED_MODEL_SETTINGS)) as handle:
        record = json.load(handle)
    assert record["beam_size"] == 4 and record["n_best"] == 3 and record["maxlen1"] == 48
    assert record["sample"] == {"sampling_topk": 5, "sampling_topp": 0.9,
                                "sampling_temperature": 1.0, "n_best": 3}
    assert "float32" in exports["beam"]["stdout"]
    assert "mixed_bfloat16" in exports["beam_bf16"]["stdout"]


@needs_tensorflow_text
@pytest.mark.slow
def test_the_subword_model_is_an_asset_of_the_saved_model(varied, exports):
    asset = os.path.join(exports["beam"]["dir"], "assets", filenames.SUBWORDS)
    with open(asset, "rb") as copy, open(varied["subwords"].path, "rb") as original:
        assert copy.read() == original.read()
    saved_model.import_tensorflow_text()  # registers the SentencePiece ops the graph holds
    loaded = tf.saved_model.load(exports["beam"]["dir"])
    assert os.path.basename(loaded.subword_model.asset_path.numpy().decode()) == \
        filenames.SUBWORDS


# `saved_model_cli`, TensorFlow's console script, is this function of TensorFlow's.
SAVED_MODEL_CLI = ("import sys; from tensorflow.python.tools.saved_model_cli import main; "
                   "sys.argv[0] = 'saved_model_cli'; main()")


@needs_tensorflow_text
@pytest.mark.slow
def test_saved_model_cli_lists_both_signatures(exports):
    result = run("-c", SAVED_MODEL_CLI, "show", "--dir", exports["beam"]["dir"], "--all",
                 timeout=300)
    assert result.returncode == 0, result.stderr
    for expected in ("signature_def['serving_default']", "signature_def['ids']",
                     "signature_def['prefixed']", "inputs['prefix']",
                     "inputs['text']", "outputs['translations']", "outputs['n_best']",
                     "outputs['scores']", "inputs['ids']", "outputs['ids']"):
        assert expected in result.stdout


@pytest.mark.slow
def test_without_tensorflow_text_only_the_ids_signature_is_written(varied, tmp_path):
    out = tmp_path / "ids_only"
    # tensorflow_text made unimportable, as where it is not installed.
    block = ("import runpy, sys; sys.modules['tensorflow_text'] = None; "
             f"sys.argv = ['export.py', '--logdir', {str(varied['logdir'])!r}, "
             f"'--out', {str(out)!r}, '--beam_size', '1']; "
             "runpy.run_path('export.py', run_name='__main__')")
    result = run("-c", block, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    assert 'only the ids signature was written' in result.stdout
    assert 'pip install -e ".[serve]"' in result.stdout
    assert list(tf.saved_model.load(str(out)).signatures) == [saved_model.IDS_SIGNATURE]


@pytest.mark.slow
def test_ctranslate2_format_writes_a_model_ctranslate2_loads(varied, tmp_path):
    ctranslate2 = pytest.importorskip("ctranslate2")
    out = tmp_path / "ct2"
    result = run_export(varied["logdir"], out, "--format", "ctranslate2",
                        "--quantization", "int8")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"wrote a CTranslate2 model to {out}" in result.stdout
    assert f"python eval.py --logdir {varied['logdir']} --ctranslate2 {out}" in result.stdout
    assert "model.bin" in os.listdir(out)
    ctranslate2.Translator(str(out), device="cpu")
    assert sorted(os.listdir(tmp_path)) == ["ct2"]


# ------------------------------------------------------------ the SavedModel


@needs_tensorflow_text
@pytest.mark.slow
def test_the_saved_model_loads_without_kyu_transformer(served):
    assert served["kyu_transformer_imported"] is False


@needs_tensorflow_text
@pytest.mark.slow
@pytest.mark.parametrize("name, beam_size", [("greedy", 1), ("beam", 4)])
def test_translations_equal_the_translators_line_for_line(varied, served, name, beam_size):
    expected = Translator(varied["model"], beam_size=beam_size, alpha=ALPHA).translate(
        varied["val"], varied["subwords"])
    got = served[f"{name}_val"]["translations"]
    assert len(got) == len(expected) == 300
    assert [i for i, (a, b) in enumerate(zip(got, expected)) if a != b] == []
    assert len(set(got)) > 20  # a model that translates, not one repeating itself


@needs_tensorflow_text
@pytest.mark.slow
@pytest.mark.parametrize("name, beam_size", [("greedy", 1), ("beam", 4)])
def test_the_prefixed_signature_equals_the_translators_prefixed_translations(
        varied, served, name, beam_size):
    """The prefixed signature (text and prefix in; n-best and scores out, as the others) decodes
    as `Translator` does with those prefixes; each translation starts with its prefix."""
    translator = Translator(varied["model"], beam_size=beam_size, alpha=ALPHA,
                            n_best=3 if name == "beam" else 1)
    prefixes = prefixes_of(varied["val"][100:160])
    texts, scores = translator.translate_texts(varied["val"][:60], varied["subwords"], prefixes,
                                               n_best=translator.settings.n_best)
    got = served[f"{name}_prefixed"]
    assert got["translations"] == [row[0] for row in texts]
    assert all(text.startswith(prefix) for text, prefix in zip(got["translations"], prefixes))
    assert sum(bool(prefix) for prefix in prefixes) == 48
    for row, (row_texts, row_scores) in enumerate(zip(texts, scores)):
        assert got["n_best"][row][:len(row_texts)] == row_texts
        np.testing.assert_allclose(got["scores"][row][:len(row_scores)], row_scores, rtol=1e-5)


@needs_tensorflow_text
@pytest.mark.slow
@pytest.mark.parametrize("name, beam_size", [("greedy", 1), ("beam", 4)])
def test_translations_equal_eval_pys_hyp_txt_line_for_line(varied, served, name, beam_size):
    """eval.py run as a user runs it, on the 300 val sentences the SavedModel translated."""
    result = run("eval.py", "--logdir", varied["logdir"], "--split", "val",
                 "--data_dir", MULTI30K, "--beam_size", beam_size, "--alpha", ALPHA,
                 "--name", f"export_{name}", timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    with open(varied["logdir"] / "eval" / f"export_{name}.hyp.txt", encoding="utf-8") as handle:
        expected = handle.read().split("\n")[:-1]
    got = served[f"{name}_val"]["translations"]
    assert len(got) == len(expected) == 300
    assert [i for i, (a, b) in enumerate(zip(got, expected)) if a != b] == []


@needs_tensorflow_text
@pytest.mark.slow
def test_bfloat16_translations_equal_the_bfloat16_translators(varied, served):
    set_precision("bf16")  # as eval.py --mixed_precision bf16; conftest restores float32
    model, _ = load_model(varied["hparams"], str(varied["logdir"]))
    assert model.compute_dtype == "bfloat16"
    expected = Translator(model, beam_size=4, alpha=ALPHA).translate(varied["val"],
                                                                     varied["subwords"])
    got = served["bf16_val"]["translations"]
    assert [i for i, (a, b) in enumerate(zip(got, expected)) if a != b] == []


@needs_tensorflow_text
@pytest.mark.slow
def test_n_best_rows_are_sorted_and_start_with_the_translation(served):
    for key, k in (("beam_val", 3), ("greedy_val", 1)):
        result = served[key]
        n_best, scores = np.array(result["n_best"]), np.array(result["scores"])
        assert n_best.shape == scores.shape == (300, k)
        assert list(n_best[:, 0]) == result["translations"]
        assert np.all(np.diff(scores, axis=1) <= 0)
        assert np.all(scores < 0)
    assert np.any(np.diff(np.array(served["beam_val"]["scores"]), axis=1) < 0)


@needs_tensorflow_text
@pytest.mark.slow
@pytest.mark.parametrize("name, beam_size, n_best", [("greedy", 1, 1), ("beam", 4, 3)])
def test_the_ids_signature_equals_translate_ids(varied, served, name, beam_size, n_best):
    translator = Translator(varied["model"], beam_size=beam_size, alpha=ALPHA)
    plain = translator.translate_ids(served["source_ids"])
    best = plain.outputs
    too_long = [ids for ids in served["source_ids"] if len(ids) + 1 > varied["model"].maxlen1]
    assert plain.truncated_sources == len(too_long) >= len(varied["long"])
    found = translator.translate_ids(served["source_ids"], n_best=n_best)
    hypotheses, scores = found.hypotheses, found.scores
    result = served[f"{name}_ids"]
    got = [[_stripped(row) for row in rows] for rows in result["ids"]]
    assert [rows[0] for rows in got] == best
    assert got == hypotheses
    np.testing.assert_allclose(result["scores"], scores, rtol=1e-6)


@pytest.mark.slow
def test_a_scale_norm_fix_norm_model_saves_the_translators_translations(
        varied, tmp_path, monkeypatch):
    """Pre-norm with ScaleNorm and FixNorm ("Transformers without Tears"), each gain its own,
    in a SavedModel (its ids signature, written here): the outputs and scores of the
    `Translator`, beam 4."""
    from kyu_transformer.decoding.settings import SearchSettings
    from kyu_transformer.model import Transformer

    model = Transformer(varied["model"].vocab_size, d_model=32, d_ff=64, num_blocks=2,
                        num_heads=4, maxlen1=24, maxlen2=28, norm_position="pre",
                        norm_type="scale", fix_norm=True)
    model.build()
    gains = [weight for weight in model.weights if weight.path.endswith("/gain")]
    for gain, value in zip(gains, np.random.default_rng(3).uniform(2.0, 8.0, len(gains))):
        gain.assign(value)
    settings = SearchSettings(beam_size=4, alpha=ALPHA)
    monkeypatch.setattr(saved_model, "import_tensorflow_text", lambda: None)  # ids alone
    saved_model.save(model, varied["subwords"].path, settings, str(tmp_path / "model"))
    sources = varied["subwords"].encode(varied["val"][:40])
    result = tf.saved_model.load(str(tmp_path / "model")).signatures[saved_model.IDS_SIGNATURE](
        ids=tf.constant(_padded(sources)))
    expected = Translator(model, settings).translate_ids(sources, n_best=1)
    assert [_stripped(rows[0]) for rows in result["ids"].numpy()] == expected.outputs
    best_scores = [scores[0] for scores in expected.scores]
    np.testing.assert_allclose(result["scores"].numpy()[:, 0], best_scores, rtol=1e-5)
    assert len(set(np.round(best_scores, 3))) > 20  # each sentence's own, every weight in it


@needs_tensorflow_text
@pytest.mark.slow
@pytest.mark.parametrize("name", ["greedy", "beam"])
def test_scores_are_length_normalized_log_probabilities(varied, served, name):
    """Each hypothesis' score is its log-probability, EOS included, over GNMT's penalty."""
    model, maxlen1 = varied["model"], varied["model"].maxlen1
    sources, outputs = [], []
    for source, hypotheses in zip(served["source_ids"], served[f"{name}_ids"]["ids"]):
        encoder_input = (source + [EOS_ID])[:maxlen1]
        limit = min(model.maxlen2, len(encoder_input) + 16)
        for row in hypotheses:
            output = _stripped(row)
            # A hypothesis shorter than its limit ended with EOS; one at its limit was cut.
            sources.append(encoder_input)
            outputs.append(output + [EOS_ID] if len(output) < limit else output)
    log_probs = sequence_log_probs(model, np.array(_padded(sources), "int32"),
                                   np.array(_padded(outputs), "int32"))
    lengths = np.array([len(output) for output in outputs])
    expected = np.asarray(log_probs) / np.asarray(length_penalty(lengths, ALPHA))
    got = np.array(served[f"{name}_ids"]["scores"]).reshape(-1)
    np.testing.assert_allclose(got, expected, atol=2e-4, rtol=1e-5)


@needs_tensorflow_text
@pytest.mark.slow
@pytest.mark.cpu_exact
def test_empty_strings_give_empty_translations(varied, served):
    """Empty and blank lines give empty translations (one empty hypothesis scored 0), and
    leave the others' as they are.

    Assumes a CPU: a request of 4 sentences and one of 300 decode in batches of other
    shapes, which on a GPU round otherwise and may tip a near-tie between two tokens."""
    result = served["beam_empty"]
    assert result["translations"][0] == result["translations"][2] == \
        result["translations"][3] == ""
    assert result["translations"][1] == served["beam_val"]["translations"][0]
    for row in (0, 2, 3):  # one empty hypothesis scored 0, as Translator; no others
        assert result["n_best"][row] == ["", "", ""]
        assert result["scores"][row] == [0, search.NO_HYPOTHESIS_SCORE,
                                         search.NO_HYPOTHESIS_SCORE]
    found = Translator(varied["model"], beam_size=4, alpha=ALPHA).translate_ids([[]], n_best=3)
    assert (found.hypotheses, found.scores) == ([[[]]], [[0.0]])
    assert served["beam_none"] == {"translations": [], "n_best": [], "scores": []}


@needs_tensorflow_text
@pytest.mark.slow
def test_sources_longer_than_maxlen1_are_cut_as_eval_cuts_them(varied, served):
    translator = Translator(varied["model"], beam_size=4, alpha=ALPHA)
    expected = translator.translate(varied["long"], varied["subwords"])
    found = translator.translate_ids(varied["subwords"].encode(varied["long"]))
    assert found.truncated_sources == len(varied["long"])
    assert served["beam_long"]["translations"] == expected


@needs_tensorflow_text
@pytest.mark.slow
def test_the_sample_signature_near_temperature_zero_is_greedy_search(varied, served):
    """Where each greedy choice leads the runner-up by 0.05 in logit (a near-tie may go either
    way when sampling; see test_decoding)."""
    source_ids = varied["subwords"].encode(varied["val"])
    greedy = Translator(varied["model"], beam_size=1).translate_ids(source_ids, n_best=1)
    clear = clear_greedy_choices(varied["model"], source_ids, greedy, margin=0.05)
    assert len(clear) >= 150
    cold, plain = served["cold"]["translations"], served["greedy_val"]["translations"]
    assert [cold[i] for i in clear] == [plain[i] for i in clear]
    np.testing.assert_allclose([served["cold"]["scores"][i] for i in clear],
                               [served["greedy_val"]["scores"][i] for i in clear], atol=1e-5)


@needs_tensorflow_text
@pytest.mark.slow
@pytest.mark.cpu_exact
def test_the_sample_signature_draws_as_the_translator_and_by_its_seed(varied, served):
    """The same samples as `Translator`'s, however the request is batched; a seed repeats.

    Assumes a CPU where it compares the first sentence alone and among 300 exactly: kernels of
    other shapes, on a GPU, round otherwise and may move a logit across a draw's boundary."""
    sample = served["sample"]
    assert sample == served["sample_again"]
    differ = sum(a != b for a, b in zip(sample["n_best"], served["sample_other_seed"]["n_best"]))
    assert differ >= 100  # another seed draws other samples
    # A sentence alone in its request, or sharing it and its batches: the same samples
    # (but where the batch shape moved a logit's last bits across a draw's boundary).
    assert served["sample_first"]["n_best"][0] == sample["n_best"][0]
    neighbours = served["sample_neighbours"]["n_best"][:100]
    assert sum(a == b for a, b in zip(neighbours, sample["n_best"][:100])) >= 98
    translator = Translator(varied["model"], sampling_topk=5, sampling_topp=0.9, alpha=ALPHA)
    found = translator.translate_ids(varied["subwords"].encode(varied["val"]), n_best=3, seed=1)
    texts = [[varied["subwords"].decode(ids) for ids in row] for row in found.hypotheses]
    assert texts == sample["n_best"]
    np.testing.assert_allclose(found.scores, sample["scores"], rtol=1e-5, atol=1e-5)
    # Real, different samples (a sentence may still draw one output thrice).
    assert sum(len(set(row)) > 1 for row in texts) >= 0.8 * len(texts)


@needs_tensorflow_text
@pytest.mark.slow
@pytest.mark.cpu_exact
def test_white_space_is_folded_as_eval_reads_lines(served):
    """Lines with tabs and other white space translate as the same lines written plainly.

    Assumes a CPU: a request of 20 sentences and one of 300 decode in batches of other
    shapes, which on a GPU round otherwise and may tip a near-tie between two tokens."""
    assert served["beam_messy"]["translations"] == served["beam_val"]["translations"][:20]


@needs_tensorflow_text
@pytest.mark.slow
@pytest.mark.cpu_exact
def test_a_batch_of_one_and_one_of_over_a_thousand(served):
    """A request of 1 sentence, and one of 1,200 (ten decoding batches), translate as the
    request of 300 does.

    Assumes a CPU: their batches run kernels of other shapes, which on a GPU round otherwise and
    may tip a near-tie between two tokens."""
    greedy = served["greedy_val"]["translations"]
    assert served["greedy_one"]["translations"] == greedy[:1]
    assert served["greedy_thousand"]["translations"] == greedy * 4  # ten decoding batches


@pytest.mark.slow
def test_the_ids_signature_refuses_ids_outside_the_vocabulary(varied, exports):
    translate = tf.saved_model.load(exports["greedy"]["dir"]).signatures[saved_model.IDS_SIGNATURE]
    vocab = varied["model"].vocab_size
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=f"ids must be below the vocabulary size {vocab}"):
        translate(ids=tf.constant([[5, vocab, 7]], tf.int32))
    good = translate(ids=tf.constant([[5, vocab - 1, 7]], tf.int32))
    assert good["ids"].shape[0] == 1


@pytest.mark.slow
def test_an_export_computes_in_float32_unless_asked_whatever_the_training_precision(
        varied_tiny_logdir, tmp_path_factory):
    logdir = copy_of_logdir(varied_tiny_logdir, tmp_path_factory, "trained_in_bf16")
    hparams = json.loads((logdir / "hparams.json").read_text())
    (logdir / "hparams.json").write_text(json.dumps({**hparams, "mixed_precision": "bf16"}))
    out = str(logdir.parent / "out")
    _, _, model, _, precision = export.load(export.parse_args(["--logdir", str(logdir),
                                                               "--out", out]))
    assert precision == "no" and model.compute_dtype == "float32"
    _, _, model, _, precision = export.load(export.parse_args(
        ["--logdir", str(logdir), "--out", out, "--mixed_precision", "bf16"]))
    assert precision == "bf16" and model.compute_dtype == "bfloat16"
