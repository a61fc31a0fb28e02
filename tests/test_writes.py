"""Whole-file writes that leave nothing half-written; a full disk told from other errors.

The full disk here is the kernel's own: every write to /dev/full fails with ENOSPC.
"""

import errno
import json

import pytest
import tensorflow as tf

from kyu_transformer.filenames import LOCK
from kyu_transformer.safety.lock import LogdirBusy, LogdirLock
from kyu_transformer.safety.writes import (
    OutOfSpace, as_out_of_space, drop_torn_last_line, is_out_of_space, replaced_atomically,
    write_text)
from kyu_transformer.training.history import TrainingLog


def fill_dev_full():
    with open("/dev/full", "w", encoding="utf-8") as handle:
        handle.write("x" * 100_000)
        handle.flush()


def test_a_write_replaces_the_file_only_when_it_succeeds(tmp_path):
    path = tmp_path / "result.json"
    write_text(path, "old\n")
    with pytest.raises(OutOfSpace) as raised:
        with replaced_atomically(str(path)) as temporary:
            with open(temporary, "w", encoding="utf-8") as handle:
                handle.write("new, half")
            fill_dev_full()
    assert raised.value.path == str(path) and raised.value.errno == errno.ENOSPC
    assert str(raised.value) == f"no space left on the device writing {path}"
    assert path.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result.json"]  # no temporary left
    with pytest.raises(ZeroDivisionError):  # other errors pass through, also cleaned up
        with replaced_atomically(str(path)) as temporary:
            open(temporary, "w", encoding="utf-8").close()
            _ = 1 / 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result.json"]
    with replaced_atomically(str(tmp_path / "model.weights.h5")) as temporary:
        assert temporary.endswith(".weights.h5")  # the ending Keras chooses the format by
        open(temporary, "w", encoding="utf-8").close()
    assert (tmp_path / "model.weights.h5").exists()


def test_out_of_space_is_told_apart_and_names_the_path():
    with pytest.raises(OSError) as raised:
        fill_dev_full()
    assert is_out_of_space(raised.value)
    with pytest.raises(tf.errors.ResourceExhaustedError) as raised:
        tf.io.write_file("/dev/full", "x" * 100_000)
    assert is_out_of_space(raised.value)
    assert as_out_of_space(raised.value).path == "/dev/full"  # from TensorFlow's message
    assert str(as_out_of_space(raised.value, "/a/ckpt-3", needed=3 * 2**20)) == \
        "no space left on the device writing /a/ckpt-3 (it needs about 3.0 MiB)"
    assert not is_out_of_space(PermissionError(errno.EACCES, "Permission denied"))
    assert not is_out_of_space(tf.errors.ResourceExhaustedError(None, None, "OOM"))


def test_a_torn_history_line_is_dropped_when_the_log_opens(tmp_path):
    history = tmp_path / "history.jsonl"
    history.write_text('{"kind": "train", "step": 10}\n{"kind": "train", "st')
    log = TrainingLog(str(tmp_path), chief=True)
    log.open()
    log.write({"kind": "train", "step": 20, "epoch": 1, "loss": 1.5})
    assert [json.loads(line)["step"] for line in history.read_text().splitlines()] == [10, 20]
    assert not drop_torn_last_line(str(history))  # whole lines are kept as they are
    assert not drop_torn_last_line(str(tmp_path / "missing.jsonl"))


def test_a_logdir_made_for_the_lock_alone_goes_with_it(tmp_path):
    """`LogdirLock.release` removes the logdir it made when nothing but the lock was written
    (a run refused after taking it leaves no folder); a logdir that existed, or holds a file of
    the run, stays. A second lock is refused while the first is held."""
    made = tmp_path / "made" / "log"
    lock = LogdirLock(str(made)).acquire()
    with pytest.raises(LogdirBusy):
        LogdirLock(str(made)).acquire()
    lock.release()
    assert not made.exists() and (tmp_path / "made").is_dir()
    written = tmp_path / "written"
    lock = LogdirLock(str(written)).acquire()
    (written / "hparams.json").write_text("{}")
    lock.release()
    assert sorted(p.name for p in written.iterdir()) == [LOCK, "hparams.json"]
    existing = tmp_path / "existing"
    existing.mkdir()
    LogdirLock(str(existing)).acquire().release()
    assert [p.name for p in existing.iterdir()] == [LOCK]
