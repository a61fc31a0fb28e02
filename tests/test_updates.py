"""The training step's updates: the fast paths, `accumulate_steps` and `jit_compile` make the
updates of the plain step, on one device and on two replicas."""

import numpy as np
import pytest
import tensorflow as tf

import hparams as hp
from kyu_transformer.training.schedule import NoamSchedule
from kyu_transformer.training.trainer import Trainer
from tests import programs
from tests.programs import ROOT


def micro_batches():
    """Five batches of unlike rows, lengths and padding (the one-row batch leaves one of two
    replicas an empty slice)."""
    rng = np.random.default_rng(3)
    batches = []
    for rows, source_length, target_length in ((6, 9, 8), (3, 12, 6), (5, 7, 10), (4, 8, 8),
                                               (1, 6, 5)):
        source = rng.integers(4, 400, size=(rows, source_length)).astype("int32")
        source[0, -3:] = 0
        target = rng.integers(4, 400, size=(rows, target_length)).astype("int32")
        target[-1, 2:] = 0
        batches.append(({"source": source, "target_in": target}, np.roll(target, -1, axis=1)))
    return batches


def unions(batches, size):
    """Each `size` consecutive batches joined into one, padded to the longest."""
    def joined(arrays):
        length = max(array.shape[1] for array in arrays)
        return np.concatenate([np.pad(array, ((0, 0), (0, length - array.shape[1])))
                               for array in arrays])

    groups = [batches[start:start + size] for start in range(0, len(batches), size)]
    return [({key: joined([features[key] for features, _ in group])
              for key in ("source", "target_in")}, joined([labels for _, labels in group]))
            for group in groups]


def train_to_the_end(batches, logdir, strategy=None, **overrides):
    """Steps a tiny model (dropout 0 unless `overrides` say) through `batches` to their end;
    ``(batches taken by each step, losses, weights, stops after a stop request)``."""
    return step_to_the_end(tiny_trainer(logdir, strategy, **overrides), batches)


def tiny_trainer(logdir, strategy=None, **overrides):
    """A `Trainer` of the `tiny` preset (dropout 0 unless `overrides` say), seeded alike each
    time."""
    import keras

    keras.utils.set_random_seed(7)
    hparams = hp.parse("tiny", {"logdir": str(logdir), "dropout_rate": 0.0, **overrides})
    return Trainer(hparams, strategy, verbose=False)


def step_to_the_end(trainer, batches):
    """`train_to_the_end` with a trainer of the caller's."""
    def dataset(share=None):
        return tf.data.Dataset.from_generator(lambda: iter(batches), output_signature=(
            {"source": tf.TensorSpec((None, None), tf.int32),
             "target_in": tf.TensorSpec((None, None), tf.int32)},
            tf.TensorSpec((None, None), tf.int32)))

    iterator, taken, losses = iter(trainer.distribute(dataset)), [], []
    while taken[-1:] != [0] and len(taken) < 10:
        count, _, step, _ = trainer._train_step(iterator).numpy()
        loss_sum, _, tokens = trainer._train_step.take_sums()
        taken.append(int(count))
        losses.append(loss_sum / max(tokens, 1.0))
        assert step == trainer.global_step()
    assert trainer.global_step() == len(taken) - 1  # a step is an update
    weights = {weight.path: weight.numpy() for weight in trainer.model.weights}
    trainer._train_step.request_stop()
    stops = float(trainer._train_step(iter(trainer.distribute(dataset)))[1])
    return taken, losses[:-1], weights, stops


def assert_same_weights(actual, expected, atol):
    # Key biases are left out: their true gradient is zero, so Adam steps them by rounding
    # noise alone (see `test_mirrored_two_devices_equals_default_strategy`).
    assert set(actual) == set(expected)
    for name in expected:
        if "key_dense/bias" not in name:
            np.testing.assert_allclose(actual[name], expected[name], rtol=1e-4, atol=atol,
                                       err_msg=name)


def adam_rounding_tolerance(updates):
    """1% of the `tiny` preset's learning rates summed over `updates`. Adam moves a weight by
    at most about its rate per update, whatever its gradient's scale: where a gradient is near
    0, the rounding of the sums behind it (two batches' gradients added against one joined
    batch's; oneDNN's kernels and TensorFlow's own round differently) changes that weight's step
    by a part of the rate, far more than the rounding's own relative size (seen: one weight
    1.6e-5 off, 0.2% of the rates' sum, with TF_ENABLE_ONEDNN_OPTS=0)."""
    hparams = hp.parse("tiny", {})
    schedule = NoamSchedule(hparams["d_model"], hparams["warmup_steps"], hparams["lr"])
    return 0.01 * sum(float(schedule(step)) for step in range(updates))


@pytest.fixture(scope="module")
def joined_runs(tmp_path_factory):
    """`micro_batches` joined two by two, one batch an update, with the fast paths on and off:
    ``{fast_paths: (trainer, its initial weights, the run as `step_to_the_end` gives it)}``."""
    runs = {}
    for fast_paths in (True, False):
        trainer = tiny_trainer(tmp_path_factory.mktemp(f"joined-{fast_paths}"),
                               fast_paths=fast_paths)
        initial = {weight.path: weight.numpy() for weight in trainer.model.weights}
        runs[fast_paths] = trainer, initial, step_to_the_end(trainer, unions(micro_batches(), 2))
    return runs


def test_trainer_fast_paths_switch_trains_the_same_steps(joined_runs):
    """Fused Adam and the stated loss gradient (on) against Keras' Adam and autodiff (off):
    the same losses update by update and the same weights after them (the XLA loss, which
    `fast_paths` also gates, is off in `tiny`)."""
    import keras

    from kyu_transformer.training.optimizer import Adam

    for fast_paths, (trainer, _, _) in joined_runs.items():
        assert isinstance(trainer.optimizer, Adam) == fast_paths
        assert isinstance(trainer.optimizer, keras.optimizers.Adam)
        assert trainer.loss_fn.fast_paths == fast_paths
        assert getattr(trainer.model, "fast_paths", fast_paths) == fast_paths
    (_, initial, on), (_, _, off) = joined_runs[True], joined_runs[False]
    assert on[0] == off[0] == [1, 1, 1, 0]
    np.testing.assert_allclose(on[1], off[1], rtol=1e-5)
    tolerance = adam_rounding_tolerance(updates=3)
    assert_same_weights(on[2], off[2], tolerance)
    # it trains: the updates moved the weights far beyond the tolerance
    assert max(np.abs(on[2][name] - initial[name]).max() for name in initial) > 10 * tolerance


ACCUMULATION_SCRIPT = r"""
import os, sys
import numpy as np, tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
sys.path.insert(0, sys.argv[1])
from tests.test_updates import micro_batches, train_to_the_end

mirrored = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
for fast_paths in (True, False):
    taken, losses, weights, stops = train_to_the_end(
        micro_batches(), os.path.join(sys.argv[2], f"mirrored-{fast_paths}"), mirrored,
        fast_paths=fast_paths, accumulate_steps=2)
    np.savez(os.path.join(sys.argv[2], f"mirrored-{fast_paths}.npz"), taken=taken,
             losses=losses, stops=stops,
             **{key.replace("/", "|"): value for key, value in weights.items()})
"""


def jit_batches():
    """Three of `micro_batches`, two batches an update: on two replicas the one-row batch, last
    and alone (the data ends within its update), leaves one replica nothing to compute."""
    batches = micro_batches()
    return [batches[0], batches[1], batches[4]]


JIT_SCRIPT = r"""
import os, sys
import numpy as np, tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
sys.path.insert(0, sys.argv[1])
from tests.test_updates import jit_batches, train_to_the_end

mirrored = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
taken, losses, weights, stops = train_to_the_end(
    jit_batches(), os.path.join(sys.argv[2], "jit"), mirrored, jit_compile=True,
    accumulate_steps=2)
np.savez(os.path.join(sys.argv[2], "jit.npz"), taken=taken, losses=losses, stops=stops,
         **{key.replace("/", "|"): value for key, value in weights.items()})
"""


@pytest.mark.slow
@pytest.mark.cpu_exact
def test_jit_compile_on_two_replicas_trains_as_the_plain_step(tmp_path):
    """`jit_compile` under `MirroredStrategy` on two logical CPUs (in a process of its own, run
    meanwhile), two batches an update: each replica's gradients compiled with XLA (the iterator
    read outside them) make the plain step's updates on one device, the last update of one
    batch, its one row leaving a replica empty slices; the end of the data and a stop request
    still reach the loop. XLA's kernels round otherwise than oneDNN's: equal within the
    rounding Adam magnifies. Assumes a CPU: the plain run takes the GPU where one is seen."""
    mirrored = programs.start("-c", JIT_SCRIPT, ROOT, tmp_path)
    taken, losses, weights, stops = train_to_the_end(jit_batches(), tmp_path / "plain",
                                                     accumulate_steps=2)
    assert taken == [2, 1, 0] and stops == 1.0
    output, _ = mirrored.communicate(timeout=300)
    assert mirrored.returncode == 0, output[-3000:]
    results = {key.replace("|", "/"): value
               for key, value in np.load(tmp_path / "jit.npz").items()}
    assert list(results.pop("taken")) == taken and results.pop("stops") == 2.0
    np.testing.assert_allclose(results.pop("losses"), losses, rtol=1e-4)
    assert_same_weights(results, weights, adam_rounding_tolerance(updates=2))


@pytest.fixture(scope="module")
def one_device_jit(tmp_path_factory):
    """`jit_compile` on one device with dropout on, as `small` and `base` train (the dropout
    seeds drawn inside the compiled update), stepped through two batches of unlike shapes to
    their end: ``(batches, the run as `step_to_the_end` gives it, the trainer, the first
    batch's loss without dropout at the same initial weights)``."""
    batches = micro_batches()[:2]
    trainer = tiny_trainer(tmp_path_factory.mktemp("jit"), dropout_rate=0.1, jit_compile=True)
    (features, labels), loss_terms = batches[0], trainer._train_step.loss_terms
    loss_sum, _, tokens = loss_terms(labels, trainer.model(features, training=False))
    return batches, step_to_the_end(trainer, batches), trainer, float(loss_sum / tokens)


def test_jit_compile_is_one_xla_function_with_dropout_on(one_device_jit):
    """The update is one XLA function, traced once for two shapes (XLA compiles each as it
    meets it), with dropout on (the first loss is not the one without it); its losses are
    finite, and the end of the data and a stop request reach the loop. No exactness assumed:
    runs on a GPU too."""
    _, (taken, losses, weights, stops), trainer, loss_without_dropout = one_device_jit
    update = trainer._train_step.replica_update
    assert update._jit_compile and update.experimental_get_tracing_count() == 1
    assert taken == [1, 1, 0] and stops == 1.0
    assert abs(losses[0] - loss_without_dropout) > 1e-2
    assert np.all(np.isfinite(losses)) and all(np.isfinite(w).all() for w in weights.values())


@pytest.mark.cpu_exact
def test_jit_compile_on_one_device_makes_the_plain_steps_updates(one_device_jit, tmp_path):
    """The compiled updates are the plain step's, the same dropout masks included, within the
    rounding Adam magnifies (XLA's kernels round otherwise than oneDNN's). Assumes a CPU: the
    plain run takes the GPU where one is seen."""
    batches, compiled, _, _ = one_device_jit
    plain = train_to_the_end(batches, tmp_path / "plain", dropout_rate=0.1)
    assert plain[0] == [1, 1, 0] and plain[3] == 1.0
    np.testing.assert_allclose(compiled[1], plain[1], rtol=1e-4)
    assert_same_weights(compiled[2], plain[2], adam_rounding_tolerance(updates=2))


@pytest.mark.slow
@pytest.mark.cpu_exact
def test_accumulated_updates_equal_updates_on_the_joined_batches(joined_runs, tmp_path):
    """`accumulate_steps` 2: each update is the one of its two batches joined (the last, of
    the one batch left), with the fused Adam and with Keras' (`fast_paths` off), on one device
    and under `MirroredStrategy` on two logical CPUs (in a process of its own, run meanwhile;
    one replica's slice of the one-row batch is empty).

    Assumes a CPU: the joined batches train on the GPU where one is seen, and its kernels
    round otherwise than the two logical CPUs' (a tolerance of CPUs' rounding, which Adam
    magnifies where a gradient is near 0)."""
    mirrored = programs.start("-c", ACCUMULATION_SCRIPT, ROOT, tmp_path)
    batches, joined = micro_batches(), {}
    tolerance = adam_rounding_tolerance(updates=3)
    for fast_paths in (True, False):
        taken, losses, weights, stops = train_to_the_end(
            batches, tmp_path / f"accumulated-{fast_paths}", fast_paths=fast_paths,
            accumulate_steps=2)
        assert taken == [2, 2, 1, 0] and stops == 1.0
        joined_taken, *joined[fast_paths], _ = joined_runs[fast_paths][2]
        assert joined_taken == [1, 1, 1, 0]
        np.testing.assert_allclose(losses, joined[fast_paths][0], rtol=1e-5)
        assert_same_weights(weights, joined[fast_paths][1], tolerance)
    # Updates on the batches one by one end elsewhere, in the weights compared, far beyond the
    # tolerance: the test can fail.
    _, _, one_by_one, _ = train_to_the_end(batches, tmp_path / "one-by-one")
    assert max(np.abs(one_by_one[name] - weights[name]).max() for name in weights
               if "key_dense/bias" not in name) > 10 * tolerance

    output, _ = mirrored.communicate(timeout=300)
    assert mirrored.returncode == 0, output[-3000:]
    for fast_paths in (True, False):
        results = {key.replace("|", "/"): value
                   for key, value in np.load(tmp_path / f"mirrored-{fast_paths}.npz").items()}
        assert list(results.pop("taken")) == [2, 2, 1, 0]
        assert results.pop("stops") == 2.0  # a stop rides on both replicas' token count
        np.testing.assert_allclose(results.pop("losses"), joined[fast_paths][0], rtol=1e-5)
        assert_same_weights(results, joined[fast_paths][1], tolerance)
