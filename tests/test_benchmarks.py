"""The benchmark scripts: their message without the `bench` extra, and `--baseline`."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests import programs
from tests.programs import ROOT
from tests.test_data import MULTI30K

MISSING_KERAS_HUB = 'raise ModuleNotFoundError("No module named \'keras_hub\'", name="keras_hub")\n'
# `python SCRIPT` with FOLDER on its module path, after the script's own folder, where PYTHONPATH
# would put it: `programs.run("-c", WITH_FOLDER_ON_PATH, FOLDER, SCRIPT)`. Forked (see
# `tests/programs.py`), the script does not print what importing TensorFlow prints: the server
# imported it once, unseen.
WITH_FOLDER_ON_PATH = ("import os, runpy, sys; folder, script = sys.argv[1:3]; "
                       "sys.path[:0] = [os.path.dirname(script), folder]; sys.argv = [script]; "
                       "runpy.run_path(script, run_name='__main__')")


def test_a_benchmark_imports_its_own_checkouts_package_installed_or_not(tmp_path):
    """``python benchmarks/recipe_search.py`` from another folder, with no site-packages at all
    (``-S``: no installed package to fall back on): it imports the package of its checkout."""
    script = os.path.join(ROOT, "benchmarks", "recipe_search.py")
    result = subprocess.run([sys.executable, "-S", script, "--help"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "--commit" in result.stdout, result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("script", ["train_throughput.py", "decode_speed.py"])
def test_benchmark_without_its_extra_names_the_extra(tmp_path, script):
    hidden = tmp_path / "site" / "keras_hub"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text(MISSING_KERAS_HUB)  # as if not installed
    result = programs.run("-c", WITH_FOLDER_ON_PATH, tmp_path / "site",
                          os.path.join(ROOT, "benchmarks", script), timeout=300)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == (
        'error: this benchmark compares with keras_hub, which is not installed: '
        'pip install -e ".[bench]" (or --skip_peer)')


# `train_throughput.py --shape` of the tests: a model far smaller than the benchmark's.
SMALL_SHAPE = "vocab_size=300,d_model=32,d_ff=64,num_blocks=1"


def _skip_unless_git_checkout():
    if shutil.which("git") is None or subprocess.run(
            ["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout: --baseline reads the package from git")


@pytest.mark.slow  # traces two training steps
@pytest.mark.op_determinism
def test_a_baseline_revision_trains_beside_the_current_package(monkeypatch):
    """`train_throughput.py --baseline REV`: the package at REV trains in the same process.

    At HEAD (in a clean checkout) its units are today's code under another
    name, so its first two training steps, the second after its own Adam's
    update, give the current package's losses exactly (on a smaller model than
    the benchmark's: what is compared is the code; the end-to-end test below
    runs a small one too, through `--shape`). Exact on any device: both steps run on this
    process's device with TensorFlow's deterministic ops (`op_determinism`).
    """
    _skip_unless_git_checkout()
    bench = _benchmark_module("train_throughput")
    import keras

    for key, value in bench.shape_flag(SMALL_SHAPE).items():
        monkeypatch.setitem(bench.SHAPE, key, value)

    import kyu_transformer.model

    baseline = bench.package_at("HEAD")
    assert baseline.Transformer.__module__ == "kyu_transformer_at_HEAD.model"
    assert baseline.Transformer is not kyu_transformer.model.Transformer
    assert baseline.Adam.__module__ == "kyu_transformer_at_HEAD.training.optimizer"
    assert baseline.loss_terms_function.__module__ == "kyu_transformer_at_HEAD.training.step"
    assert sys.modules["kyu_transformer.model"] is kyu_transformer.model  # left in place
    features, labels = bench.batch()
    losses = []
    for package in (bench.CURRENT, baseline):
        keras.utils.set_random_seed(0)
        model = bench.ours(package)
        model.build()
        step = bench.make_step(model, False, package.Adam, xla_loss=True, package=package)
        losses.append([float(step(features, labels)) for _ in range(2)])
    assert type(model).__module__ == "kyu_transformer_at_HEAD.model"
    assert np.isfinite(losses[0]).all() and losses[0][0] > 1.0
    assert losses[0][1] != losses[0][0]  # the update moved the weights
    assert losses[1] == losses[0]
    with pytest.raises(SystemExit, match="--baseline no-such-revision: "):
        bench.package_at("no-such-revision")
    # the peak measured where none is given (on matrices small enough for a test): the FLOPs of
    # its chain over its fastest call
    assert 1e8 < bench.matmul_peak(bench.tf.float32, size=128, repeats=4) < 1e15


@pytest.mark.slow
def test_the_baseline_comparison_runs_in_turns_and_prints_its_paired_ratio():
    """`--baseline HEAD` end to end: both packages timed, in reverse order every other turn
    (on a smaller model than the benchmark's, as `--shape` makes it)."""
    _skip_unless_git_checkout()
    result = programs.run("benchmarks/train_throughput.py", "--skip_peer", "--baseline", "HEAD",
                          "--variants", "fp32", "--repeats", "2", "--steps", "1", "--shape",
                          SMALL_SHAPE, "--peak_tflops", "0.001", "1000")
    assert result.returncode == 0, result.stderr[-3000:]
    # the MFU against the float32 peak given, 1 GFLOP/s (none measured: a float32 configuration
    # alone): each median rate's FLOP/s over it; a measured peak or the 16-bit one would be
    # hundreds of times more
    assert "given float32 matmul peak: 1 GFLOP/s\n" in result.stdout
    assert result.stdout.count("matmul peak") == 1
    bench = _benchmark_module("train_throughput")
    flops = bench.training_flops(bench.shape_flag(SMALL_SHAPE), bench.BATCH, bench.SOURCE_LEN,
                                 bench.TARGET_LEN)
    rates = re.findall(r"^(\S+) +median +(\d+) target tokens/s, +\d+ GFLOP/s, MFU (\d+)%$",
                       result.stdout, re.MULTILINE)
    assert [name for name, _, _ in rates] == ["ours-fp32", "at-HEAD-fp32"], result.stdout
    for _, rate, mfu in rates:
        percent = int(rate) / (bench.BATCH * bench.TARGET_LEN) * flops / 1e9 * 100
        assert abs(int(mfu) - percent) <= 0.51 + 1e-3 * percent, (rate, mfu, percent)
    timed = [line.split()[0] for line in result.stdout.splitlines() if " repeat " in line]
    assert timed == ["ours-fp32", "at-HEAD-fp32", "at-HEAD-fp32", "ours-fp32"]
    assert "ratio ours-fp32 / at-HEAD-fp32: " in result.stdout
    assert "at-HEAD-fp32     median" in result.stdout
    assert ("shape: {'vocab_size': 300, 'd_model': 32, 'd_ff': 64, 'num_blocks': 1, "
            "'num_heads': 4}, batch 64 x 24/24 tokens") in result.stdout
    # what `mixed_precision auto` would train this shape in, beside the configurations
    assert re.search(r"mixed_precision auto picks no here \(the model's matrix products are too "
                     r"small .*\): ours-fp32\n", result.stdout), result.stdout
    refused = programs.run("benchmarks/train_throughput.py", "--peak_tflops", "0", "1",
                           timeout=120)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1].endswith(
        "error: --peak_tflops: expected two peaks over 0, not 0.0 and 1.0"), refused.stderr
    for shape, error in [("d_model=32,layers=2", "'layers=2': expected KEY=N (N a positive "
                          "integer, KEY one of vocab_size, d_model, d_ff, num_blocks, num_heads)"),
                         ("d_model=30", "'d_model=30': d_model (30) must be a multiple of "
                          "num_heads (4)"),
                         ("vocab_size=4", "'vocab_size=4': vocab_size (4) must be over 4, the "
                          "special ids")]:
        rejected = programs.run("benchmarks/train_throughput.py", "--skip_peer", "--shape",
                                shape, timeout=120)
        assert rejected.returncode == 2 and "Traceback" not in rejected.stderr
        assert rejected.stderr.strip().splitlines()[-1].endswith(
            f"error: argument --shape: {error}"), rejected.stderr


def test_benchmarks_time_in_turns_reversed_every_other_round():
    in_turns = _benchmark_module("prerequisites").in_turns

    assert [in_turns(["a", "b", "c"], number) for number in range(3)] == [
        ["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"]]
    assert in_turns({"x": 1, "y": 2}.items(), 1) == [("y", 2), ("x", 1)]


@pytest.mark.slow  # two train.py runs of a few updates
def test_the_program_comparison_runs_both_trees_in_turns_and_prints_the_ratio():
    """One round end to end (each later round in turns: `in_turns`)."""
    _skip_unless_git_checkout()
    result = programs.run("benchmarks/train_program_speed.py", "--baseline", "HEAD", "--hparams",
                          "tiny", "--steps", "3", "--rounds", "1", "--data_dir", MULTI30K,
                          "--baseline_hparams", "tiny,vocab_size=300")
    assert result.returncode == 0, result.stderr[-3000:]
    runs = [line for line in result.stdout.splitlines() if line.startswith("round ")]
    assert [line.split(":")[0] for line in runs] == [
        "round 1, this checkout", "round 1, at HEAD"]
    assert all("over 3 updates" in line for line in runs)
    assert "ratio this checkout / at HEAD: " in result.stdout
    # each program runs its own hparams (two recipes compared on one machine)
    assert "updates, --hparams tiny)\n" in result.stdout
    assert "updates, --hparams tiny,vocab_size=300)\n" in result.stdout
    rejected = programs.run("benchmarks/train_program_speed.py", "--baseline", "no-such-revision",
                            "--data_dir", ROOT, timeout=120)
    assert rejected.returncode != 0 and "Traceback" not in rejected.stderr
    assert "error: --baseline no-such-revision: " in rejected.stderr


@pytest.mark.slow  # counts, trains a tiny model (stopped once), then eval.py four times
def test_a_recipe_candidate_is_trained_at_its_commit_and_alpha_is_chosen_on_val(tmp_path):
    """A candidate's training FLOPs are those of the batches its run trains on, beside the
    budget's. Stopped by SIGTERM in training, a candidate keeps its minutes so far in
    search.json and says so in one line; run again, it resumes, and val's best alpha is the
    one tested."""
    _skip_unless_git_checkout()
    data_dir = os.path.join(ROOT, "tests", "data", "multi30k")
    candidate, budget = "tiny,steps_per_epoch=60,checkpoint_every=5", "tiny,num_epochs=3"

    def recipe_search(*flags, alphas=("0.6", "1.4")):
        return [sys.executable, os.path.join(ROOT, "benchmarks", "recipe_search.py"),
                "--name", "c", "--hparams", candidate, "--budget", budget,
                "--runs_dir", str(tmp_path), "--data_dir", data_dir, "--alphas", *alphas,
                "--average_last", "2", *flags]

    command = recipe_search("--mixed_precision", "bf16", "--test")
    environment = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    first = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=environment)
    listed = tmp_path / "c" / "checkpoints" / "checkpoint"
    deadline = time.time() + 600
    while not listed.exists() and first.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    first.send_signal(signal.SIGTERM)
    _, stderr = first.communicate(timeout=300)
    log = tmp_path / "c.train.log"
    assert first.returncode != 0 and "Traceback" not in stderr, stderr
    assert stderr.strip().splitlines()[-1] == (
        f"error: train.py stopped (75); see {log}. What was done is in "
        f"{tmp_path / 'c' / 'search.json'}: run the same command again to go on")
    stopped = json.loads((tmp_path / "c" / "search.json").read_text())
    assert stopped["train_minutes"] > 0 and stopped["max_rss_gb"] > 0.1
    # the batches of the candidate's own logdir: its subword model and prepared corpus
    assert (stopped["updates"], stopped["flops"]) == _training_flops_of_the_batches(
        candidate, data_dir, tmp_path / "c")  # exactly: integers
    assert 0.5 < stopped["flops_ratio"] < 1  # 60 updates against 90 of like batches
    assert stopped["flops_ratio"] == round(stopped["flops"] / stopped["budget_flops"], 3)
    assert stopped["steps"] is None and "val" not in stopped
    result = subprocess.run(command, capture_output=True, text=True, timeout=900,
                            env=environment)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    resumed = re.search(r"resuming from \S+ckpt-(\d+) at step \d+,", log.read_text())
    assert resumed and 5 <= int(resumed.group(1)) < 60, log.read_text()[-3000:]
    record = json.loads((tmp_path / "c" / "search.json").read_text())
    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip()
    assert record["commit"] == head and record["steps"] == 60 and record["decoded_in"] == "bf16"
    assert stopped["trained_in"] == record["trained_in"] == "no"  # the tiny preset's
    assert record["max_rss_gb"] > 0.1 and record["train_minutes"] >= stopped["train_minutes"]
    # each figure is eval.py's own, of the averaged checkpoints; the alpha is val's best
    for split, alpha, figure in [("val", "0.6", record["val"]["0.6"]),
                                 ("val", "1.4", record["val"]["1.4"]),
                                 ("test_2016_flickr", record["alpha"], record["test"])]:
        written = json.loads(
            (tmp_path / "c" / "eval" / f"{split}-beam4-avg2-alpha{float(alpha)}.json").read_text())
        assert written["bleu"] == pytest.approx(figure, abs=0.005)
        assert written["mixed_precision"] == "bf16"  # all alike, not auto's choice of the moment
        assert (written["beam_size"], len(written["checkpoints"])) == (4, 2)
    assert record["val"][record["alpha"]] == max(record["val"].values())
    row = result.stdout.strip().splitlines()[-1]
    assert row.startswith(f"| {record['date']} | `{head}` | c: `tiny,") and " (" in row
    assert f"| 60 ({stopped['flops_ratio']} of {budget}'s FLOPs) |" in row
    assert f"({record['alpha']}; beam 4, the last 2 averaged) |" in row
    assert "training FLOPs of" not in result.stdout  # resumed: counted once, at the start
    # scored again in float32 with beam 2, without --test (at one alpha): the bfloat16 beam-4
    # test figure does not stay
    rescored = subprocess.run(recipe_search("--mixed_precision", "no", "--beam_size", "2",
                                            "--eval_only", alphas=("1.4",)),
                              capture_output=True, text=True, timeout=600, env=environment)
    assert rescored.returncode == 0, rescored.stderr[-3000:]
    record = json.loads((tmp_path / "c" / "search.json").read_text())
    assert record["decoded_in"] == "no" and "test" not in record and record["steps"] == 60
    written = json.loads((tmp_path / "c" / "eval" / "val-beam2-avg2-alpha1.4.json").read_text())
    assert record["beam_size"] == written["beam_size"] == 2 and record["average_last"] == 2
    assert rescored.stdout.strip().splitlines()[-1].endswith(
        "(1.4; beam 2, the last 2 averaged) |  | " f"{record['max_rss_gb']} GB |")
    assert record["val"] == {"1.4": pytest.approx(written["bleu"], abs=0.005)}


def test_a_recipe_over_its_budget_is_refused_once_both_are_counted(tmp_path):
    """`training_flops.py --budget`: the counts written, then one line and exit 1 for a recipe
    over the budget (recipe_search.py ends with that line)."""
    data_dir = os.path.join(ROOT, "tests", "data", "multi30k")
    counts = tmp_path / "over.json"
    with pytest.raises(SystemExit) as refused:
        _benchmark_module("training_flops").main([
            "--hparams", "tiny,steps_per_epoch=60", "--budget", "tiny,steps_per_epoch=30",
            "--data_dir", data_dir, "--scratch", str(tmp_path / "flops"), "--json", str(counts)])
    written = json.loads(counts.read_text())
    ratio = written["ratio"]
    assert written["candidate"]["updates"] == 60 and written["budget"]["updates"] == 30
    assert 1.5 < ratio < 2.5  # twice the updates, of like batches
    assert ratio == written["candidate"]["flops"] / written["budget"]["flops"]
    assert refused.value.code == (  # a message: exit status 1; the ratio as printed above it
        f"error: tiny,steps_per_epoch=60 would train on {ratio:.3f} times the FLOPs of --budget "
        "tiny,steps_per_epoch=30: fewer epochs or a smaller model")


def _benchmark_module(name):
    """Imports `benchmarks/<name>.py` (with the folder on the path while it imports)."""
    import importlib

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))


def _training_flops_of_the_batches(spec, data_dir, model_dir):
    """``(updates, FLOPs)`` of recipe `spec`'s run: `training_flops` of each batch its
    `Corpus` gives, at the shape the batch really has."""
    import hparams as hp
    from kyu_transformer.data.corpus import Corpus

    training_flops = _benchmark_module("train_comparison").training_flops
    hparams = hp.parse(spec)
    corpus = Corpus(data_dir, str(model_dir), hparams, log=lambda line: None)
    shape = {key: hparams[key] for key in ("vocab_size", "d_model", "d_ff", "num_blocks")}
    updates = flops = 0
    for epoch in range(hparams["num_epochs"]):
        for features, _ in corpus.train_batches(epoch).take(hparams["steps_per_epoch"]):
            rows, source_width = features["source"].shape
            updates, flops = updates + 1, flops + training_flops(
                shape, rows, source_width, features["target_in"].shape[1])
    return updates, flops


# A `sitecustomize` that makes `import tensorflow` fail, as where TensorFlow is not installed: on
# a program's PYTHONPATH it runs before the program, and before each process the program spawns.
NO_TENSORFLOW = '''import importlib.abc
import sys


class NoTensorFlow(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "tensorflow" or name.startswith("tensorflow."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, NoTensorFlow())
'''


def _matrix_product_flops(batch, source, target, shape):
    """A training step's matrix-product FLOPs, product by product (3x the forward's, 2mkn each)."""
    d, d_ff, v = shape["d_model"], shape["d_ff"], shape["vocab_size"]
    products = []  # (m, k, n)
    for _ in range(shape["num_blocks"]):
        products += [(batch * source, d, d)] * 4  # encoder: Q, K, V, output projections
        products += [(batch * source, d, source), (batch * source, source, d)]  # QK^T, AV
        products += [(batch * source, d, d_ff), (batch * source, d_ff, d)]  # feed-forward
        products += [(batch * target, d, d)] * 4  # decoder self-attention's projections
        products += [(batch * target, d, target), (batch * target, target, d)]
        products += [(batch * target, d, d)] * 2 + [(batch * source, d, d)] * 2  # cross: Q, O; K, V
        products += [(batch * target, d, source), (batch * target, source, d)]
        products += [(batch * target, d, d_ff), (batch * target, d_ff, d)]
    products.append((batch * target, d, v))  # output layer
    return 3 * sum(2 * m * k * n for m, k, n in products)


def test_the_jax_benchmark_knows_gpu_peaks_and_refuses_a_length_over_the_tables(monkeypatch):
    """`jax_throughput.device_peaks`: a GPU's dense peaks by its JAX `device_kind` (the first
    pattern that matches, so that an H100 PCIe is not taken for an SXM, nor an L40S for an L4);
    none for a CPU or an unknown device; `--peak_tflops` over any. A `--length` the model cannot
    take is refused in one line."""
    import keras

    # Restored after the test: importing the benchmark sets KERAS_BACKEND to "jax".
    monkeypatch.setenv("KERAS_BACKEND", keras.backend.backend())
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import jax_throughput

    peaks = {kind: jax_throughput.device_peaks(kind, "gpu")[0] for kind in [
        "NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200",
        "NVIDIA A100-SXM4-40GB", "NVIDIA L4", "NVIDIA L40S", "Tesla T4", "Tesla V100-SXM2-16GB",
        "Tesla V100-PCIE-32GB"]}
    assert peaks == {
        "NVIDIA H100 80GB HBM3": {"float32": 494.7, "16-bit": 989.4},
        "NVIDIA H100 PCIe": {"float32": 378.0, "16-bit": 756.5},
        "NVIDIA H100 NVL": {"float32": 417.5, "16-bit": 835.5},
        "NVIDIA H200": {"float32": 494.7, "16-bit": 989.4},
        "NVIDIA A100-SXM4-40GB": {"float32": 156.0, "16-bit": 312.0},
        "NVIDIA L4": {"float32": 60.0, "16-bit": 121.0},
        "NVIDIA L40S": None,
        "Tesla T4": {"float32": 8.1, "16-bit": 65.0},
        "Tesla V100-SXM2-16GB": {"float32": 15.7, "16-bit": 125.0},
        "Tesla V100-PCIE-32GB": {"float32": 14.0, "16-bit": 112.0}}
    assert jax_throughput.device_peaks("NVIDIA H100 PCIe", "gpu")[1] == "PEAK_TFLOPS"
    assert jax_throughput.device_peaks("cpu", "cpu") == (None, None)
    assert jax_throughput.device_peaks("cpu", "cpu", [1.5, 3.0]) == (
        {"float32": 1.5, "16-bit": 3.0}, "--peak_tflops")
    # a length over the position tables: one line (`sys.exit`'s message: stderr, exit status 1),
    # before any model is built
    monkeypatch.setattr(sys, "argv", ["jax_throughput.py", "--hparams", "tiny", "--length", "49"])
    with pytest.raises(SystemExit) as refused:
        jax_throughput.main()
    assert refused.value.code == (
        "error: --length 49 is over the model's maxlen1/maxlen2 (48); raise them in --hparams")


@pytest.mark.slow  # two processes, each compiling a training step on JAX
def test_the_jax_benchmark_times_both_models_without_tensorflow(tmp_path):
    """`jax_throughput.py` where TensorFlow cannot be imported: each model in mixed bfloat16
    (float32, its other default, is the same code under another dtype policy), its figures
    printed and in --json, consistent with the step time, the FLOPs counted product by product
    and the peaks given."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(NO_TENSORFLOW)
    env = programs.environment(PYTHONPATH=os.pathsep.join(
        filter(None, [str(tmp_path / "site"), os.environ.get("PYTHONPATH")])))
    blocked = programs.run("-c", "import tensorflow", env=env, fresh=True, timeout=120)
    assert "No module named 'tensorflow'" in blocked.stderr and blocked.returncode != 0
    path = tmp_path / "figures.json"
    result = programs.run("benchmarks/jax_throughput.py", "--hparams", "tiny", "--batch", "8",
                          "--length", "6", "--warmup", "1", "--steps", "2", "--precisions",
                          "bf16", "--peak_tflops", "0.5", "2", "--json", str(path), env=env,
                          fresh=True, timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    figures = json.loads(path.read_text())
    shape = dict(vocab_size=400, d_model=32, d_ff=64, num_blocks=1, num_heads=2)  # tiny's
    assert figures["shape"] == shape and figures["batch"] == 8 and figures["length"] == 6
    assert figures["flops_per_step"] == _matrix_product_flops(8, 6, 6, shape)
    assert figures["peak_source"] == "--peak_tflops"
    results = figures["results"]
    assert [(r["model"], r["policy"]) for r in results] == [
        ("ours", "mixed_bfloat16"), ("keras-hub", "mixed_bfloat16")]
    for r in results:
        assert r["target_tokens_per_s"] == pytest.approx(8 * 6 / r["step_seconds"])
        assert r["tflops_per_s"] == pytest.approx(
            figures["flops_per_step"] / r["step_seconds"] / 1e12)
        assert r["mfu"] == pytest.approx(r["tflops_per_s"] / 2.0)  # the 16-bit peak
        assert 5.0 < r["loss"] < 7.0  # about ln(400): untrained
        assert r["memory"] == ("process RSS" if r["platform"] == "cpu" else "device")
        assert r["peak_memory_bytes"] > 2**26
        assert (f"{r['model']:9s} {r['policy']:14s} median {r['target_tokens_per_s']:10,.0f} "
                f"target tokens/s ({r['step_seconds'] * 1e3:.2f} ms/step), "
                f"{r['tflops_per_s']:.3f} TFLOP/s, MFU {r['mfu']:.1%}, peak memory "
                f"{r['peak_memory_bytes'] / 2**30:.2f} GiB ({r['memory']})\n") in result.stdout
    ratio = results[0]["target_tokens_per_s"] / results[1]["target_tokens_per_s"]
    assert figures["ratios"] == {"bf16": pytest.approx(ratio)}
    assert f"ratio ours / keras-hub, mixed_bfloat16: {ratio:.2f}x\n" in result.stdout
