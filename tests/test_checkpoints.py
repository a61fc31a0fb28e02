"""Restoring and averaging the checkpoints of a logdir."""

import os

import numpy as np
import pytest
import tensorflow as tf

from kyu_transformer import config
from kyu_transformer.training.checkpoints import (
    CheckpointError, describe, list_checkpoints, load_model, model_weights)
from tests.test_training import run_train

pytestmark = pytest.mark.tensorflow_only("TensorFlow checkpoints written by train.py")


@pytest.fixture(scope="module")
def trained_logdir(tmp_path_factory):
    """A tiny run with three checkpoints (steps 4, 8 and 12)."""
    logdir = tmp_path_factory.mktemp("checkpoints") / "log"
    result = run_train(logdir, "--steps_per_epoch", "12", "--checkpoint_every", "4")
    assert result.returncode == 0, result.stdout + result.stderr
    return logdir


def _checkpoint_tensor(reader, name):
    """The tensor saved for model weight `name` (the object graph escapes "." and "/")."""
    escaped = name.replace(".", "..").replace("/", ".S")
    return reader.get_tensor(f"weights/{escaped}/.ATTRIBUTES/VARIABLE_VALUE")


def test_averaged_weights_are_the_mean_of_the_checkpoints(trained_logdir):
    hparams = config.load(str(trained_logdir / "hparams.json"))
    available = list_checkpoints(str(trained_logdir))
    assert [os.path.basename(path) for path in available] == ["ckpt-4", "ckpt-8", "ckpt-12"]
    model, paths = load_model(hparams, str(trained_logdir), average_last=2)
    assert paths == available[-2:]
    assert describe(paths) == "average of 2 checkpoints (ckpt-8, ckpt-12)"
    readers = [tf.train.load_checkpoint(path) for path in paths]
    weights = model_weights(model)
    assert len(weights) > 10
    for name, variable in weights.items():
        saved = [_checkpoint_tensor(reader, name) for reader in readers]
        assert not np.array_equal(saved[0], saved[1]), name  # a mean of different tensors
        np.testing.assert_allclose(variable.numpy(), np.mean(saved, axis=0), rtol=1e-6,
                                   atol=1e-7, err_msg=name)


def test_one_checkpoint_is_loaded_as_saved(trained_logdir):
    hparams = config.load(str(trained_logdir / "hparams.json"))
    first = list_checkpoints(str(trained_logdir))[0]
    model, paths = load_model(hparams, str(trained_logdir), ckpt=first)
    assert paths == [first]
    reader = tf.train.load_checkpoint(first)
    for name, variable in model_weights(model).items():
        np.testing.assert_array_equal(variable.numpy(), _checkpoint_tensor(reader, name))


def test_averaging_more_checkpoints_than_exist_is_an_error(trained_logdir):
    hparams = config.load(str(trained_logdir / "hparams.json"))
    with pytest.raises(CheckpointError, match=r"last 5 checkpoints \(average_last=5\), but 3 "
                                              r"exist: ckpt-4, ckpt-8, ckpt-12"):
        load_model(hparams, str(trained_logdir), average_last=5)


def test_a_checkpoint_and_averaging_together_are_refused(trained_logdir):
    hparams = config.load(str(trained_logdir / "hparams.json"))
    first = list_checkpoints(str(trained_logdir))[0]
    with pytest.raises(ValueError, match=r"`ckpt` \(.*ckpt-4\) and `average_last` \(2\) "
                                         r"exclude each other"):
        load_model(hparams, str(trained_logdir), ckpt=first, average_last=2)
    with pytest.raises(ValueError, match="`average_last` must be at least 0, got -1"):
        load_model(hparams, str(trained_logdir), average_last=-1)
