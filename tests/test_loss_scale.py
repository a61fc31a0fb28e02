"""Float16's loss scaling: an overflow on one replica skips the update on every replica (two
devices, two workers), and one device's run is Keras' own, checkpoints included."""

import hashlib
import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import hparams as hp
from kyu_transformer.training.checkpoints import RunCheckpoints, checkpoint_dir
from kyu_transformer.training.step import TrainStep
from kyu_transformer.training.trainer import Trainer
from tests import programs
from tests.programs import ROOT

pytestmark = pytest.mark.tensorflow_only("tf.distribute and TensorFlow checkpoints")

SCALE = 2.0 ** 15  # Keras' initial loss scale
# Far beyond float16's largest value (65504) once a token's loss is scaled by it: every
# gradient that is not exactly 0 overflows in the model's float16 layers.
OVERFLOW_SCALE = 2.0 ** 60


def batch(seed, padded_rows=0):
    """A batch of 4 rows of the `tiny` preset's vocabulary; the labels of its first
    `padded_rows` rows are all padding."""
    rng = np.random.default_rng(seed)
    source = rng.integers(4, 400, size=(4, 7)).astype("int32")
    target = rng.integers(4, 400, size=(4, 6)).astype("int32")
    labels = np.roll(target, -1, axis=1)
    labels[:padded_rows] = 0
    return {"source": source, "target_in": target}, labels


def overflowing_batch():
    """A batch whose first two rows (the first replica's of two) hold no token: their gradients
    are exactly 0, finite under any scale; the last two rows' overflow under OVERFLOW_SCALE."""
    return batch(1, padded_rows=2)


def fp16_trainer(logdir, strategy=None, **overrides):
    """A `Trainer` of the `tiny` preset in float16 (dropout 0), seeded alike each time."""
    keras.utils.set_random_seed(7)
    hparams = hp.parse("tiny", {"logdir": str(logdir), "mixed_precision": "fp16", **overrides})
    return Trainer(hparams, strategy, verbose=False)


def updates(trainer, optimizer=None):
    """Makes an update on overflowing batches under OVERFLOW_SCALE, then one on normal batches
    at SCALE (each update takes `accumulate_steps` batches), with the trainer's optimizer or
    `optimizer`; returns each local replica's state (`replica_state`) before, after the first
    and after the second."""
    optimizer = optimizer or trainer.optimizer
    step = (trainer._train_step if optimizer is trainer.optimizer else TrainStep(
        trainer.strategy, trainer.model, optimizer, trainer._train_step.loss_terms,
        accumulate_steps=trainer.per_update))
    batches = [overflowing_batch()] * trainer.per_update + [batch(2)] * trainer.per_update

    def dataset(share=None):
        return tf.data.Dataset.from_generator(lambda: iter(batches), output_signature=(
            {"source": tf.TensorSpec((None, None), tf.int32),
             "target_in": tf.TensorSpec((None, None), tf.int32)},
            tf.TensorSpec((None, None), tf.int32)))

    iterator, states = iter(trainer.distribute(dataset)), [replica_states(trainer, optimizer)]
    for scale in (OVERFLOW_SCALE, SCALE):
        optimizer.dynamic_scale.assign(scale)
        assert int(step(iterator)[0]) == trainer.per_update
        states.append(replica_states(trainer, optimizer))
    return [dict(zip(("before", "overflow", "normal"), replica)) for replica in zip(*states)]


def replica_states(trainer, optimizer):
    """Each local replica's weights and Adam moments (digests: equal only if equal bit for bit),
    whether its weights are finite, its loss scale, steps since the scale changed, and
    updates."""
    def local(variable):
        return [np.asarray(value) for value in
                trainer.strategy.experimental_local_results(variable.value)]

    weights = list(zip(*map(local, trainer.model.trainable_weights)))
    moments = list(zip(*map(local, [variable for variable in optimizer.inner_optimizer.variables
                                    if variable is not optimizer.iterations])))
    return [{"weights": digest(replica_weights), "moments": digest(replica_moments),
             "finite": bool(all(np.isfinite(value).all() for value in replica_weights)),
             "scale": float(scale), "counter": int(counter), "iterations": int(iterations)}
            for replica_weights, replica_moments, scale, counter, iterations in zip(
                weights, moments, local(optimizer.dynamic_scale),
                local(optimizer.step_counter), local(optimizer.iterations))]


def digest(arrays):
    return hashlib.sha256(b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)).hexdigest()


def assert_skipped_on_all_then_updated(replicas):
    """The overflow update left every replica's weights, moments and update count as they were
    and halved every replica's scale; the normal update moved all alike."""
    before = replicas[0]["before"]
    assert before["finite"] and before["scale"] == SCALE and before["iterations"] == 0
    assert [replica["before"] for replica in replicas] == [before] * len(replicas)
    assert [replica["overflow"] for replica in replicas] == [
        dict(before, scale=OVERFLOW_SCALE / 2)] * len(replicas)
    normal = replicas[0]["normal"]
    assert normal["weights"] != before["weights"] and normal["moments"] != before["moments"]
    assert [replica["normal"] for replica in replicas] == [
        dict(before, weights=normal["weights"], moments=normal["moments"], counter=1,
             iterations=1)] * len(replicas)


@pytest.fixture
def float32_after():
    """Sets Keras' global dtype policy back to float32 after a float16 trainer of this
    process."""
    yield
    keras.config.set_dtype_policy("float32")


def test_one_device_is_keras_loss_scaling_and_restores_its_checkpoints(tmp_path, float32_after):
    """On one device the updates are Keras' `LossScaleOptimizer`'s bit for bit (an overflow of
    the whole batch skips), and a checkpoint of Keras' restores into the trainer's."""
    ours = updates(fp16_trainer(tmp_path / "ours"))
    assert_skipped_on_all_then_updated(ours)
    theirs_trainer = fp16_trainer(tmp_path / "keras")
    keras_optimizer = keras.optimizers.LossScaleOptimizer(theirs_trainer.optimizer.inner_optimizer)
    keras_optimizer.build(theirs_trainer.model.trainable_variables)
    assert updates(theirs_trainer, keras_optimizer) == ours

    keras_optimizer.dynamic_scale.assign(3.0)  # a scale no fresh optimizer has
    RunCheckpoints(theirs_trainer.strategy, theirs_trainer.model, keras_optimizer,
                   checkpoint_dir(tmp_path / "keras"), 1, chief=True).save(1, 0.0)
    resumed = fp16_trainer(tmp_path / "keras")
    assert resumed.restore() is not None  # every object of the trainer's found in the checkpoint
    assert ([variable.name for variable in resumed.optimizer.variables]
            == [variable.name for variable in keras_optimizer.variables])
    for restored, saved in zip(resumed.optimizer.variables, keras_optimizer.variables):
        np.testing.assert_array_equal(restored.numpy(), saved.numpy(), err_msg=saved.name)


# Writes `updates` of each of the given (fast_paths, accumulate_steps) to <folder>/updates.json,
# under MirroredStrategy on two logical CPUs, or MultiWorkerMirroredStrategy (TF_CONFIG's).
UPDATES_SCRIPT = r"""
import json, os, sys
import tensorflow as tf
if sys.argv[3] == "mirrored":
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
else:
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
sys.path.insert(0, sys.argv[1])
from tests.test_loss_scale import fp16_trainer, updates

results = {}
for fast_paths, accumulate_steps in json.loads(sys.argv[4]):
    logdir = os.path.join(sys.argv[2], f"log-{fast_paths}-{accumulate_steps}")
    results[f"{fast_paths} {accumulate_steps}"] = updates(fp16_trainer(
        logdir, strategy, fast_paths=fast_paths, accumulate_steps=accumulate_steps))
with open(os.path.join(sys.argv[2], "updates.json"), "w") as file:
    json.dump(results, file)
"""
# The fused Adam and Keras', two batches an update and one: each path of a skipped update once.
RUNS = [(True, 2), (False, 1)]


def read_updates(folder):
    with open(os.path.join(folder, "updates.json"), encoding="utf-8") as file:
        return json.load(file)


@pytest.mark.slow  # starts a program
def test_an_overflow_on_one_replica_skips_the_update_on_both(tmp_path):
    """Two replicas (MirroredStrategy on two CPUs), the second's gradients overflowing alone:
    both skip the update and halve their scale, with the fused Adam (two batches an update) and
    Keras' (one); a normal update then moves both alike."""
    program = programs.run("-c", UPDATES_SCRIPT, ROOT, tmp_path, "mirrored", json.dumps(RUNS))
    assert program.returncode == 0, program.stderr[-3000:]
    results = read_updates(tmp_path)
    assert list(results) == [f"{fast_paths} {steps}" for fast_paths, steps in RUNS]
    for run, replicas in results.items():
        assert len(replicas) == 2, run
        assert_skipped_on_all_then_updated(replicas)


@pytest.mark.slow  # starts two programs
def test_an_overflow_on_one_worker_skips_the_update_on_both(tmp_path):
    """Two workers (MultiWorkerMirroredStrategy, a replica each), the second's gradients
    overflowing alone: both skip the update and halve their scale; a normal update then moves
    both alike. The fused Adam, one batch an update: the replicas agree in the loss scaling
    whichever optimizer it wraps (both paths on two replicas, above)."""
    processes, runs = [], [(True, 1)]
    for index, config in enumerate(programs.cluster_configs(2)):
        folder = tmp_path / f"worker{index}"
        folder.mkdir()
        processes.append(programs.start(
            "-c", UPDATES_SCRIPT, ROOT, folder, "multi_worker", json.dumps(runs),
            env=programs.environment(TF_CONFIG=config)))
    programs.finish_all(processes)
    results = [read_updates(tmp_path / f"worker{index}") for index in range(2)]
    assert [list(worker) for worker in results] == [["True 1"]] * 2
    for run in (f"{fast_paths} {steps}" for fast_paths, steps in runs):
        assert [len(worker[run]) for worker in results] == [1, 1], run
        assert_skipped_on_all_then_updated([worker[run][0] for worker in results])
