"""Training: the loss falls, a small set is learnt, strategies agree, runs resume."""

import json
import os
import signal
import subprocess
import sys
import time
import types

import numpy as np
import pytest
import tensorflow as tf

import hparams as hp
from kyu_transformer import config
from kyu_transformer.conventions import BOS_ID, EOS_ID
from kyu_transformer.data.corpus import Corpus
from kyu_transformer.data.subwords import Subwords
from kyu_transformer.data.text import load_split
from kyu_transformer.losses import LabelSmoothedCrossEntropy
from kyu_transformer.safety.lock import LogdirLock
from kyu_transformer.training.checkpoints import list_checkpoints, unreadable
from kyu_transformer.training.clock import UpdatePlan
from kyu_transformer.training.distribution import batch_line, replica_slices
from kyu_transformer.training.metrics import masked_accuracy_counts
from kyu_transformer.training.schedule import NoamSchedule
from kyu_transformer.training.step import loss_terms_function
from kyu_transformer.training.trainer import Trainer, TrainingError
from tests import programs
from tests.programs import ROOT
from tests.test_data import MULTI30K, lists_of


def tiny(tmp_path, **overrides):
    return hp.parse("tiny", {"logdir": str(tmp_path / "log"), "data_dir": MULTI30K,
                             **overrides})


@pytest.fixture(scope="module")
def multi30k_tiny(tmp_path_factory):
    """Multi30k with the tiny preset's subword model, prepared once for the module."""
    logdir = tmp_path_factory.mktemp("corpus")
    return Corpus(MULTI30K, str(logdir), hp.parse("tiny"), log=lambda line: None)


class GpuStrategy:
    """What `batch_line` reads of a strategy, for replicas on GPUs this machine lacks."""

    def __init__(self, replicas):
        self.num_replicas_in_sync = replicas
        self.extended = types.SimpleNamespace(
            worker_devices=[f"/job:localhost/replica:0/task:0/device:GPU:{index}"
                            for index in range(replicas)])


def test_the_start_up_line_states_the_batch_per_replica_and_warns_a_starved_gpu(monkeypatch):
    hparams = hp.parse("small", {"accumulate_steps": 2})
    assert batch_line(tf.distribute.get_strategy(), hparams) == (
        "strategy: _DefaultDistributionStrategy with 1 replica(s); a batch of 4,096 tokens a "
        "side (--batch_tokens, the global batch), 4,096 per replica; an update of 2 batch(es), "
        "8,192 tokens")
    assert "\n" not in batch_line(GpuStrategy(2), hparams)  # 2,048 tokens each
    line, warning = batch_line(GpuStrategy(8), hparams).split("\n")
    assert "4,096 tokens a side (--batch_tokens, the global batch), 512 per replica" in line
    assert warning == ("warning: 512 tokens per replica are too few to keep a GPU busy: raise "
                       "--batch_tokens to 16,384 or more (the global batch; lower "
                       "--accumulate_steps to keep an update's size)")
    # The default strategy on one GPU (TensorFlow lists CPU:0 first), a small batch.
    gpu = types.SimpleNamespace(name="/job:localhost/replica:0/task:0/device:GPU:0")
    monkeypatch.setattr(tf.config, "list_logical_devices",
                        lambda kind=None: [gpu] if kind == "GPU" else [])
    assert "too few to keep a GPU busy" in batch_line(
        tf.distribute.get_strategy(), dict(hparams, batch_tokens=1024))
    pairs = batch_line(GpuStrategy(8), dict(hparams, batch_tokens=0, batch_size=64))
    assert "a batch of 64 pairs a side (--batch_size, the global batch), 8 per replica" in pairs
    assert "warning" not in pairs  # tokens unknown: sentences of any length


def test_noam_schedule_formula():
    schedule = NoamSchedule(d_model=256, warmup_steps=100, lr=2.0)
    for step in (1, 50, 100, 101, 1000):
        expected = 2.0 * 256 ** -0.5 * min(step ** -0.5, step * 100 ** -1.5)
        assert float(schedule(step - 1)) == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_loss_compiled_with_xla_equals_the_uncompiled_loss(dtype):
    rng = np.random.default_rng(3)
    labels = rng.integers(1, 50, (4, 7)).astype("int32")
    labels[1, 4:] = 0  # padding
    labels[3, :] = 0
    logits = tf.constant(rng.normal(size=(4, 7, 50)) * 3, dtype=dtype)
    loss_fn = LabelSmoothedCrossEntropy(0.1)
    results = {}
    for xla in (False, True):
        terms = loss_terms_function(loss_fn, xla=xla)

        @tf.function
        def value_and_gradient(logits, terms=terms):
            with tf.GradientTape() as tape:
                tape.watch(logits)
                loss_sum, correct, tokens = terms(labels, logits)
            return loss_sum, correct, tokens, tape.gradient(loss_sum, logits)

        results[xla] = [np.asarray(tf.cast(t, tf.float32)) for t in value_and_gradient(logits)]
    (plain_loss, plain_correct, plain_tokens, plain_gradient) = results[False]
    (xla_loss, xla_correct, xla_tokens, xla_gradient) = results[True]
    expected_tokens = float((labels != 0).sum())
    assert plain_tokens == xla_tokens == expected_tokens
    assert plain_correct == xla_correct
    np.testing.assert_allclose(xla_loss, plain_loss, rtol=1e-5)
    atol = 1e-6 if dtype == "float32" else 4e-3  # bf16 rounding of the gradient
    np.testing.assert_allclose(xla_gradient, plain_gradient, atol=atol)
    assert np.all(xla_gradient[3] == 0) and np.all(xla_gradient[1, 4:] == 0)
    assert np.abs(xla_gradient[0]).sum() > 0


def test_replica_slices_cut_each_global_batch_in_order():
    batch = ({"source": tf.reshape(tf.range(14), (7, 2))}, tf.reshape(tf.range(7), (7, 1)))
    dataset = tf.data.Dataset.from_tensors(batch)
    pieces = [labels.numpy().ravel().tolist()
              for _, labels in replica_slices(dataset, num_replicas=3, first_replica=1,
                                              local_replicas=2)]
    assert pieces == [[2, 3], [4, 5, 6]]  # rows 7*1//3..7*2//3 and 7*2//3..7


@pytest.mark.slow
def test_tiny_preset_loss_falls_on_multi30k(tmp_path, multi30k_tiny):
    # with the loss compiled by XLA, as the small and base recipes train
    # The host reads the updates' sums (loss, hits, tokens) at log steps only, and at the end
    # of the data; an update's one read is its small tensor of counts.
    hparams = tiny(tmp_path, num_epochs=1, log_every=5, xla_loss=True)
    trainer = Trainer(hparams, verbose=False)
    reads, take_sums = [], trainer._train_step.take_sums
    trainer._train_step.take_sums = lambda: reads.append(trainer.global_step()) or take_sums()
    result = trainer.fit(multi30k_tiny.train_batches, steps_per_epoch=40)
    assert result["steps"] == 40 and result["stopped"] == "done"
    assert reads == [5, 10, 15, 20, 25, 30, 35, 40, 40]
    with open(os.path.join(hparams["logdir"], "history.jsonl"), encoding="utf-8") as handle:
        losses = [r["loss"] for r in map(json.loads, handle) if r["kind"] == "train"]
    assert len(losses) == 8
    assert losses[0] > 5.0 and losses[-1] < losses[0] - 0.8
    for name in ("loss.png", "lr.png", "model.keras", "checkpoints/checkpoint"):
        assert os.path.isfile(os.path.join(hparams["logdir"], name)), name
    events = tf.io.gfile.glob(os.path.join(hparams["logdir"], "train", "events.out.tfevents*"))
    tags = {value.tag for path in events for event in tf.compat.v1.train.summary_iterator(path)
            for value in event.summary.value}
    assert {"train/loss", "train/accuracy", "train/lr"} <= tags


# The `small` preset's blocks (pre-norm, ScaleNorm, FixNorm, its dropout 0.3) at the test's
# width: with that dropout, 100 passes reached 0.82 of the tokens, 200 0.95.
SMALL_BLOCKS = {key: hp.PRESETS["small"][key] for key in (
    "norm_position", "norm_type", "fix_norm", "dropout_rate", "attention_dropout")}


@pytest.mark.slow
@pytest.mark.parametrize("blocks, passes", [({}, 100), (SMALL_BLOCKS, 200)],
                         ids=["post-norm", "small-blocks"])
def test_a_64_pair_subset_is_learnt(tmp_path, multi30k_tiny, blocks, passes):
    sources, targets = multi30k_tiny.train_columns(0)
    fit = np.flatnonzero((sources.lengths() < multi30k_tiny.maxlens[0])
                         & (targets.lengths() < multi30k_tiny.maxlens[1]))[:64]
    sources, targets = sources.rows(fit), targets.rows(fit)
    hparams = tiny(tmp_path, d_model=64, d_ff=128, num_heads=4, lr=1.0, warmup_steps=30,
                   log_every=1000, **blocks)
    from kyu_transformer.data.pipeline import make_dataset

    def batches(epoch, skip=0, share=None):  # `passes` over the pairs (a batch per length
        # bucket); without dropout 0.95 after 40
        return make_dataset(sources, targets, batch_size=64, batch_tokens=0,
                            maxlens=multi30k_tiny.maxlens, seed=epoch).repeat(passes).skip(skip)

    trainer = Trainer(hparams, verbose=False)
    trainer.fit(batches)
    source = tf.ragged.constant([[*ids, EOS_ID] for ids in lists_of(sources)]).to_tensor()
    target_in = tf.ragged.constant([[BOS_ID, *ids] for ids in lists_of(targets)]).to_tensor()
    target_out = tf.ragged.constant([[*ids, EOS_ID] for ids in lists_of(targets)]).to_tensor()
    logits = trainer.model({"source": source, "target_in": target_in})
    correct, count = masked_accuracy_counts(target_out, logits)
    assert float(correct / count) > 0.9


def fixed_batches(epoch):
    """Three global batches (with padding), the same for every epoch."""
    rng = np.random.default_rng(0)
    rows = []
    for size in (8, 7, 5):
        source = rng.integers(4, 400, size=(size, 9)).astype("int32")
        source[0, 6:] = 0
        target = rng.integers(4, 400, size=(size, 8)).astype("int32")
        target[-1, 3:] = 0
        rows.append(({"source": source, "target_in": target}, np.roll(target, -1, axis=1)))
    return tf.data.Dataset.from_generator(lambda: iter(rows), output_signature=(
        {"source": tf.TensorSpec((None, None), tf.int32),
         "target_in": tf.TensorSpec((None, None), tf.int32)},
        tf.TensorSpec((None, None), tf.int32)))


def test_a_resumed_epoch_capped_below_what_it_did_trains_no_more_of_it(tmp_path):
    """Stopped after 5 batches of an epoch, resumed with `steps_per_epoch` 2: the epoch ends
    at once (a negative count would take every batch left)."""
    def batches(epoch, skip=0, share=None):  # nine batches an epoch
        return fixed_batches(epoch).repeat(3).skip(skip)

    trainer = Trainer(tiny(tmp_path, num_epochs=1, dropout_rate=0.0), verbose=False)
    trainer.step_in_epoch.assign(5)
    result = trainer.fit(batches, steps_per_epoch=2)
    assert result["steps"] == 0 and result["epochs"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("precision, checkpoint_every", [("no", 0), ("fp16", 1)])
def test_non_finite_loss_stops_and_keeps_the_last_checkpoint(tmp_path, multi30k_tiny, precision,
                                                             checkpoint_every):
    """Also under float16 (its three updates before the poison are mixed float16's, the loss
    scaled), whose loss scaling skips the update (it is named by the number it would have had),
    and where a checkpoint is due at every update."""
    import keras

    def poison(trainer, epoch, logs):  # after epoch 1 and its checkpoint
        weights = trainer.model.target_embedding.embeddings
        weights.assign(np.full(weights.shape, np.nan, "float32"))

    hparams = tiny(tmp_path, num_epochs=2, mixed_precision=precision,
                   checkpoint_every=checkpoint_every)
    trainer = Trainer(hparams, hooks=[poison], verbose=False)
    assert trainer.model.compute_dtype == {"no": "float32", "fp16": "float16"}[precision]
    assert trainer.model.variable_dtype == "float32"
    assert isinstance(trainer.optimizer, keras.optimizers.LossScaleOptimizer) == (
        precision == "fp16")
    with pytest.raises(TrainingError, match=r"loss became non-finite at step 4.*ckpt-3"):
        trainer.fit(multi30k_tiny.train_batches, steps_per_epoch=3)
    saved = trainer.manager.latest_checkpoint
    assert saved.endswith("ckpt-3")
    fresh = Trainer(hparams, verbose=False)
    fresh.checkpoint.restore(saved).assert_existing_objects_matched()
    assert np.all(np.isfinite(fresh.model.target_embedding.embeddings.numpy()))
    assert int(fresh.epoch) == 1 and int(fresh.optimizer.iterations) == 3


@pytest.mark.slow  # starts a program
def test_eval_and_export_do_not_import_the_trainer():
    script = ("import sys; sys.path.insert(0, sys.argv[1]); import eval, export; "
              "print(sorted(m for m in sys.modules if m.startswith('kyu_transformer')))")
    output = programs.run("-c", script, ROOT, timeout=120)
    assert output.returncode == 0, output.stderr[-3000:]
    modules = output.stdout.strip().splitlines()[-1]
    assert "'kyu_transformer.precision'" in modules
    assert "'kyu_transformer.training.trainer'" not in modules, modules


REFUSALS_SCRIPT = r"""
import contextlib, io, json, runpy, sys
sys.path.insert(0, sys.argv[1])
for program, arguments in json.loads(sys.argv[2]):
    sys.argv, errors = [program, *arguments], io.StringIO()
    with contextlib.redirect_stderr(errors):
        try:
            runpy.run_path(program, run_name="__main__")
        except SystemExit as stop:
            print(json.dumps([program, errors.getvalue() + str(stop.code),
                              "tensorflow" in sys.modules, "keras" in sys.modules]))
"""


def refusals(runs):
    """``[(program, error, tensorflow loaded, keras loaded)]`` of `runs` ``[(program, arguments)]``,
    each run in turn in one fresh interpreter (the tests' server has TensorFlow loaded already)."""
    output = subprocess.run(
        [sys.executable, "-c", REFUSALS_SCRIPT, ROOT,
         json.dumps([(program, list(map(str, arguments))) for program, arguments in runs])],
        capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert output.returncode == 0, output.stderr[-3000:]
    results = [json.loads(line) for line in output.stdout.splitlines() if line.startswith("[")]
    assert len(results) == len(runs), output.stdout[-3000:]
    return results


def test_programs_refuse_mistakes_before_tensorflow_loads(tmp_path):
    """Flags, hparams, busy logdirs, data folders, logdirs trained otherwise and inputs are
    checked first: a mistake is refused without loading TensorFlow (seconds), in the order of a
    run that loads it (a busy logdir before a missing data folder)."""
    logdir, bare, missing = tmp_path / "log", tmp_path / "bare", str(tmp_path / "missing")
    busy_dir = tmp_path / "busy"
    trained = hp.parse("tiny", {"data_dir": MULTI30K, "logdir": str(logdir), "d_model": 64})
    for folder in (logdir, bare):  # `bare`: no subword model
        folder.mkdir()
        config.save(trained, str(folder / "hparams.json"))
    sources, targets, _ = load_split(MULTI30K, "val")
    Subwords.train_or_load(str(logdir), sources + targets, 200, trained["subword_model_type"])
    texts = {name: tmp_path / name for name in ("empty.de", "one.en", "two.de")}
    for name, lines in (("empty.de", ""), ("one.en", "A dog.\n"), ("two.de", "Ein Hund.\nJa.\n")):
        texts[name].write_text(lines, encoding="utf-8")
    train = ["--hparams", "tiny", "--data_dir", MULTI30K, "--logdir", str(logdir)]
    evaluate = ["--logdir", str(logdir)]
    cases = [
        ("train.py", [*train, "--num_heads", "3"], "must be divisible by `num_heads` (3)"),
        ("train.py", [*train[:3], missing, *train[4:]], f"error: {missing}: no such data folder"),
        ("train.py", train, "was trained with other hyperparameters (d_model: 64 -> 32)"),
        ("train.py", [*train, "--batch_szie", "8"], "(did you mean --batch_size?)"),
        ("train.py", [*train[:3], missing, "--logdir", str(busy_dir)],
         f"error: {busy_dir} is in use by another"),
        ("eval.py", ["--logdir", missing], "hparams.json: no such file"),
        ("eval.py", ["--logdir", str(logdir), "--ckpt", "best", "--average_last", "2"],
         "--ckpt (best) and --average_last (2) exclude each other"),
        ("eval.py", [*evaluate, "--n_best", "5"], "--n_best (5) must be at most"),
        ("eval.py", ["--logdir", str(bare)], "subwords.model: no subword model"),
        ("eval.py", [*evaluate, "--src", missing], f"error: {missing}: no such file"),
        ("eval.py", [*evaluate, "--src", texts["empty.de"]], "no sentence to translate"),
        ("eval.py", [*evaluate, "--src", texts["two.de"], "--ref", texts["one.en"]],
         "two.de has 2 lines but"),
        ("eval.py", [*evaluate, "--src", texts["two.de"], "--score", texts["one.en"]],
         "--score needs one translation per source line"),
        ("eval.py", [*evaluate, "--ctranslate2", missing], f"--ctranslate2 {missing}: no such"),
        ("export.py", ["--logdir", str(bare), "--out", str(tmp_path / "out")],
         "no subword model"),
        ("export.py", ["--logdir", missing, "--out", str(tmp_path / "out")],
         "hparams.json: no such file"),
        ("export.py", ["--logdir", str(logdir), "--out", str(logdir)], "is or holds the --logdir"),
    ]
    busy = LogdirLock(str(busy_dir)).acquire()  # as a run in another process holds it
    try:
        results = refusals([(program, arguments) for program, arguments, _ in cases])
    finally:
        busy.release()
    for (program, arguments, message), (_, error, tensorflow, keras) in zip(cases, results):
        assert message in error, (program, arguments, error)
        assert not tensorflow and not keras, (program, arguments, "loaded TensorFlow")


MIRRORED_SCRIPT = r"""
import json, os, sys
import numpy as np, tensorflow as tf, keras
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
sys.path.insert(0, sys.argv[1])
import hparams as hp
from kyu_transformer.training.trainer import Trainer

rng = np.random.default_rng(0)
def batch(rows):
    source = rng.integers(4, 400, size=(rows, 9)).astype("int32"); source[0, 6:] = 0
    target = rng.integers(4, 400, size=(rows, 8)).astype("int32"); target[-1, 3:] = 0
    return {"source": source, "target_in": target}, np.roll(target, -1, axis=1)
batches = [batch(rows) for rows in (8, 7, 5)]
def dataset(epoch):
    return tf.data.Dataset.from_generator(lambda: iter(batches), output_signature=(
        {"source": tf.TensorSpec((None, None), tf.int32),
         "target_in": tf.TensorSpec((None, None), tf.int32)},
        tf.TensorSpec((None, None), tf.int32)))
results = {}
for name, strategy in (("default", tf.distribute.get_strategy()),
                       ("mirrored", tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]))):
    keras.utils.set_random_seed(7)
    hparams = hp.parse("tiny", {"logdir": os.path.join(sys.argv[2], name), "num_epochs": 2})
    trainer = Trainer(hparams, strategy, verbose=False)
    losses = []
    for epoch in range(2):
        iterator = iter(trainer.distribute(lambda share: dataset(epoch)))
        for _ in batches:
            trainer._train_step(iterator)
            loss_sum, _, tokens = trainer._train_step.take_sums()
            losses.append(loss_sum / tokens)
    results[name] = {"replicas": strategy.num_replicas_in_sync, "losses": losses,
                     "weights": {w.path.split("/", 1)[1]: w.numpy().tolist()
                                 for w in trainer.model.weights}}
    iterator = iter(trainer.distribute(lambda share: dataset(0)))
    stops = [float(trainer._train_step(iterator)[1])]
    trainer._train_step.request_stop()  # what a signal to this process asks
    stops.append(float(trainer._train_step(iterator)[1]))
    results[name]["stops"] = stops
print(json.dumps(results))
"""


@pytest.mark.slow
@pytest.mark.cpu_exact
def test_mirrored_two_devices_equals_default_strategy(tmp_path):
    """Two replicas on two logical CPUs train as the default strategy does, step by step.

    Assumes a CPU: the default strategy trains on the GPU where one is seen, whose kernels
    round otherwise than the CPUs' (a tolerance of CPUs' rounding, which Adam magnifies where
    a gradient is near 0)."""
    output = programs.run("-c", MIRRORED_SCRIPT, ROOT, tmp_path, timeout=300)
    assert output.returncode == 0, output.stderr[-3000:]
    results = json.loads(output.stdout.strip().splitlines()[-1])
    assert results["default"]["replicas"] == 1 and results["mirrored"]["replicas"] == 2
    # a stop asked for reaches the step's result through every replica's all-reduce
    assert results["default"]["stops"] == [0.0, 1.0]
    assert results["mirrored"]["stops"] == [0.0, 2.0]
    np.testing.assert_allclose(results["mirrored"]["losses"], results["default"]["losses"],
                               rtol=1e-5)
    assert results["default"]["losses"][-1] < results["default"]["losses"][0]
    # Key biases are left out: their true gradient is zero (a softmax does not change when
    # one number is added to all its scores), so Adam steps them by rounding noise alone.
    names = [name for name in results["default"]["weights"] if "key_dense/bias" not in name]
    assert set(results["mirrored"]["weights"]) == set(results["default"]["weights"])
    for name in names:
        np.testing.assert_allclose(results["mirrored"]["weights"][name],
                                   results["default"]["weights"][name], rtol=1e-4, atol=1e-6,
                                   err_msg=name)


def run_train(logdir, *extra, wait=True, fresh=False):
    """train.py on the tiny recipe to its end, or started (`wait=False`) as a `Popen` to signal,
    kill or read while it runs (`fresh`: see `programs.run`)."""
    arguments = ["--hparams", "tiny", "--data_dir", MULTI30K, "--logdir", str(logdir), *extra]
    return (programs.run if wait else programs.start)("train.py", *arguments, fresh=fresh)


def digest(output):
    return [line for line in output.splitlines() if line.startswith("weights sha256:")]


def kill_when(process, condition, timeout=300):
    """SIGKILLs `process` as soon as `condition()` holds (or it ended, or time ran out)."""
    deadline = time.time() + timeout
    while not condition() and process.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    output = process.stdout.read()
    process.wait()
    assert process.returncode == -signal.SIGKILL, output
    return output


def train_seconds(checkpoint):
    """The training time a checkpoint records (0 while there is none)."""
    if checkpoint is None:
        return 0.0
    return float(tf.train.load_checkpoint(checkpoint).get_tensor(
        "train_seconds/.ATTRIBUTES/VARIABLE_VALUE"))


def train_seconds_so_far(checkpoints):
    """`train_seconds` of the newest checkpoint in `checkpoints` while a run writes there; 0 when
    it cannot be read at that moment: an epoch's end saves the step of the periodic checkpoint
    just written again, and a read while the files are replaced can see the old index with
    the new data (a checksum mismatch)."""
    try:
        return train_seconds(tf.train.latest_checkpoint(str(checkpoints)))
    except (tf.errors.OpError, RuntimeError):
        return 0.0


def newest_readable(logdir):
    """The checkpoint a resumed run restores: the newest that can be read (a kill while one is
    saved again can leave it unreadable; train.py sets it aside)."""
    return [path for path in list_checkpoints(str(logdir)) if unreadable(path) is None][-1]


@pytest.mark.slow
def test_time_budget_is_the_runs_total_across_resumptions(tmp_path):
    logdir = tmp_path / "log"
    checkpoints = logdir / "checkpoints"
    budget = 0.3 * 60
    flags = ["--max_minutes", "0.3", "--num_epochs", "100", "--checkpoint_every", "5"]
    process = run_train(logdir, *flags, wait=False)
    kill_when(process, lambda: train_seconds_so_far(checkpoints) > budget / 2)
    restored = train_seconds(newest_readable(logdir))
    assert budget / 2 < restored < budget

    again = run_train(logdir, *flags)
    assert again.returncode == 0, again.stdout + again.stderr
    left = (budget - restored) / 60
    assert f"of training; {left:.1f} of the 0.3 min budget left" in again.stdout, again.stdout
    assert "stopping: the budget of 0.3 minutes is used" in again.stdout
    total = train_seconds(tf.train.latest_checkpoint(str(checkpoints)))
    # One step (and its checkpoint) past the budget at most. A budget restarted on
    # resumption would end at restored + budget or later: the bound between them leaves
    # over 8 s for that last step, which a machine under load (the suite's other process,
    # a training beside it) has taken up to 6 s.
    assert budget <= total < budget + restored - 1.0, (restored, total)


@pytest.mark.slow
def test_logdir_with_other_hparams_is_refused_then_moved_aside(tmp_path):
    logdir = tmp_path / "log"
    first = run_train(logdir, "--steps_per_epoch", "2")
    assert first.returncode == 0, first.stdout + first.stderr
    saved = (logdir / "hparams.json").read_text()
    subwords = (logdir / "subwords.model").read_bytes()
    refused = run_train(logdir, "--steps_per_epoch", "2", "--d_model", "64")
    assert refused.returncode != 0
    assert "was trained with other hyperparameters (d_model: 32 -> 64)" in refused.stderr
    assert (logdir / "hparams.json").read_text() == saved
    assert (logdir / "subwords.model").read_bytes() == subwords
    moved = run_train(logdir, "--steps_per_epoch", "2", "--d_model", "64", "--overwrite")
    assert moved.returncode == 0, moved.stdout + moved.stderr
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("log.old-")]
    assert len(aside) == 1 and (aside[0] / "hparams.json").read_text() == saved
    assert json.loads((logdir / "hparams.json").read_text())["d_model"] == 64
    # With the same settings, --overwrite still starts afresh instead of resuming.
    fresh = run_train(logdir, "--steps_per_epoch", "2", "--d_model", "64", "--overwrite")
    assert fresh.returncode == 0, fresh.stdout + fresh.stderr
    assert "--overwrite: moved the old logdir" in fresh.stdout and "resuming" not in fresh.stdout
    assert len([p for p in tmp_path.iterdir() if p.name.startswith("log.old-")]) == 2


@pytest.mark.slow
def test_bfloat16_trains(tmp_path, multi30k_tiny):
    """Mixed bfloat16, without loss scaling (float16's: the non-finite loss test above)."""
    import keras

    hparams = tiny(tmp_path, mixed_precision="bf16", log_every=5)
    trainer = Trainer(hparams, verbose=False)
    result = trainer.fit(multi30k_tiny.train_batches, steps_per_epoch=10)
    assert result["steps"] == 10 and np.isfinite(result["last_loss"])
    assert trainer.model.compute_dtype == "bfloat16"
    assert trainer.model.variable_dtype == "float32"
    assert not isinstance(trainer.optimizer, keras.optimizers.LossScaleOptimizer)


def test_the_plan_counts_an_epochs_updates_and_its_estimate_keeps_to_the_budget():
    epoch = tf.data.Dataset.range(59).batch(2)  # 30 batches, a count tf.data knows
    assert UpdatePlan.of_run([(epoch, 3)], 0, 0).total == 90
    assert UpdatePlan.of_run([(epoch, 3)], 5, 0).total == 15  # steps_per_epoch caps each epoch
    unknown = epoch.filter(lambda batch: True)  # counted by going through it
    assert int(unknown.cardinality()) == tf.data.UNKNOWN_CARDINALITY
    assert UpdatePlan.of_run([(unknown, 3)], 0, 0).total == 90
    assert UpdatePlan.of_run([(unknown, 3)], 5, 0).total == 15
    # updates of 4 batches: 8 an epoch, the last of 2; the cap counts updates
    assert UpdatePlan.of_run([(epoch, 3)], 0, 0, per_update=4).total == 24
    assert UpdatePlan.of_run([(epoch, 3)], 5, 0, per_update=4).total == 15
    assert UpdatePlan.of_run([(epoch, 3)], 8, 0, per_update=4).total == 24
    resumed = UpdatePlan.of_run([(epoch, 3)], 0, 20)
    assert resumed.line(40) == ("plan: 3 epochs of about 30 updates, about 90 updates "
                                "(70 to go), or 40 min of training")
    # a decay that ends before the plan does is said; one within 5% of its end is not
    assert resumed.line(0, decay_steps=80) == (
        "plan: 3 epochs of about 30 updates, about 90 updates (70 to go)\nwarning: "
        "`decay_steps` is 80: the learning rate is 0 for the last 10 planned updates (set it "
        "to about the planned updates, or 0)")
    assert "warning" not in resumed.line(0, decay_steps=86) + resumed.line(0, decay_steps=200)
    # epochs of two kinds (the first on the pairs both ways): each counted, in turn
    both_ways = tf.data.Dataset.range(119).batch(2)  # 60 batches
    mixed = UpdatePlan.of_run([(both_ways, 1), (epoch, 2)], 0, 0)
    assert mixed.total == 60 + 2 * 30
    assert mixed.line() == ("plan: 3 epochs (1 of about 60 updates, then 2 of about 30 "
                            "updates), about 120 updates")
    assert UpdatePlan.of_run([(both_ways, 1), (epoch, 2)], 20, 0).parts == [(3, 20)]  # capped
    measured = UpdatePlan.WARM_UP + UpdatePlan.MEASURE
    estimates = [resumed.seconds_left(step) for step in range(21, 21 + measured)]
    assert estimates[:-1] == [None] * (measured - 1)  # warm-up, then the pace is measured
    pace, left = estimates[-1]
    assert pace >= 0 and left == pytest.approx(pace * (90 - 20 - measured))
    step = 20 + measured
    capped = resumed.seconds_left(step, budget_left=0.0)
    assert capped[1] == 0.0
    assert resumed.estimate_line(step, capped, 0.0).endswith(
        f"about 0.0 min for the {90 - step} updates to go (the time budget's)")


def test_the_trainer_takes_a_precision_already_chosen(tmp_path):
    """A run resolves `auto` once, before its trainer (train.py); the trainer refuses it."""
    with pytest.raises(ValueError, match="`mixed_precision` is auto: resolve it first"):
        Trainer(tiny(tmp_path, mixed_precision="auto"), verbose=False)
