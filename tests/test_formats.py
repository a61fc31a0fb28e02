"""The files of version 0.2.0 are a promise: `tests/data/logdir_0.2.0`, a tiny run written by it
(tests/data/README.md), still loads, evaluates to the translations it gave, resumes and
fine-tunes with today's code."""

import os
import shutil

import keras
import numpy as np
import pytest

from kyu_transformer import config, filenames
from kyu_transformer.training.checkpoints import list_checkpoints, load_model
from tests import programs

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
LOGDIR = os.path.join(DATA, "logdir_0.2.0")

pytestmark = pytest.mark.slow  # starts the programs


@pytest.fixture
def logdir(tmp_path):
    """A copy of the kept logdir, for a program to write into."""
    copy = tmp_path / "logdir"
    shutil.copytree(LOGDIR, copy)
    return str(copy)


def test_its_checkpoint_and_keras_file_load_the_same_weights():
    hparams = config.load(os.path.join(LOGDIR, filenames.HPARAMS))
    model, paths = load_model(hparams, LOGDIR)
    assert paths == list_checkpoints(LOGDIR)[-1:]
    saved = keras.saving.load_model(os.path.join(LOGDIR, filenames.MODEL))
    assert len(saved.weights) == len(model.weights)
    for ours, theirs in zip(model.weights, saved.weights):
        assert ours.path == theirs.path
        np.testing.assert_array_equal(ours.numpy(), theirs.numpy())


def test_it_evaluates_to_the_translations_it_gave(logdir):
    kept_path = os.path.join(LOGDIR, filenames.EVAL, "val." + filenames.HYPOTHESES)
    with open(kept_path, encoding="utf-8") as handle:
        kept = handle.read().splitlines()
    result = programs.run("eval.py", "--logdir", logdir, "--split", "val", "--beam_size", "2",
                          "--mixed_precision", "no")
    assert result.returncode == 0, result.stderr[-3000:]
    with open(os.path.join(logdir, filenames.EVAL, "val." + filenames.HYPOTHESES),
              encoding="utf-8") as handle:
        written = handle.read().splitlines()
    assert len(written) == len(kept) == 300
    # Another processor rounds otherwise and may flip a near-tie between two tokens; a format
    # read wrong changes every line.
    assert sum(new == old for new, old in zip(written, kept)) >= 0.95 * len(kept)


def test_it_resumes_where_it_stopped(logdir):
    hparams = config.load(os.path.join(logdir, filenames.HPARAMS))
    done = hparams["num_epochs"] * hparams["steps_per_epoch"]
    result = programs.run("train.py", "--hparams", os.path.join(logdir, filenames.HPARAMS),
                          "--logdir", logdir, "--num_epochs", str(hparams["num_epochs"] + 1))
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed from {os.path.join(logdir, filenames.CHECKPOINTS, 'ckpt')}-{done}" \
        in result.stdout
    assert f"{done + hparams['steps_per_epoch']} steps" in result.stdout
    # trained when the corpus was held in memory: its batches are now read from the prepared
    # corpus, which it says once
    note = (f"note: {logdir} was trained in batches of the corpus held in memory; its remaining "
            "batches are read from the prepared corpus")
    assert result.stdout.count(note) == 1
    assert os.path.isfile(os.path.join(logdir, filenames.BATCH_ORDER))  # said once only


def test_it_fine_tunes(logdir, tmp_path):
    target = str(tmp_path / "fine_tuned")
    result = programs.run("train.py", "--hparams", "tiny", "--init_from", logdir,
                          "--logdir", target, "--data_dir", os.path.join(DATA, "multi30k"),
                          "--steps_per_epoch", "3")
    assert result.returncode == 0, result.stderr[-3000:]
    assert os.path.isfile(os.path.join(target, filenames.INIT_FROM))
    assert "done: 1 epochs, 3 steps" in result.stdout
