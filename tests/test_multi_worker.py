"""Two worker processes on 127.0.0.1 under MultiWorkerMirroredStrategy."""

import gzip
import json
import os
import re
import shutil
import signal
import time

import pytest

from kyu_transformer.training.checkpoints import list_checkpoints
from tests import programs
from tests.test_data import MULTI30K
from tests.test_training import run_train

pytestmark = pytest.mark.slow  # two train.py processes per test


def run_workers(tmp_path, logdirs, *extra, worker_extra=(), while_running=None,
                two_seeds=False):
    """train.py on two loopback workers; returns their ``(return code, output)``.

    `extra` goes to both, `worker_extra` to the second only (after `extra`);
    `while_running(processes)` is called once both have started. With `two_seeds` the second
    worker starts in a fresh interpreter, with another hash seed, as on another machine: once
    for each way the workers must end alike (training, resuming, fine-tuning; a fresh start
    costs an import of TensorFlow), the other runs fork both.
    """
    workers = [f"127.0.0.1:{port}" for port in programs.free_ports(2)]
    processes = []
    for index, logdir in enumerate(logdirs):
        scratch = tmp_path / f"tmp{index}"
        scratch.mkdir(exist_ok=True)
        config = {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}
        environment = programs.environment(TF_CONFIG=json.dumps(config), TMPDIR=str(scratch))
        processes.append(programs.start(
            "train.py", "--strategy", "multi_worker", "--hparams", "tiny", "--data_dir", MULTI30K,
            "--logdir", logdir, "--num_epochs", "2", "--steps_per_epoch", "6", "--log_every", "3",
            *extra, *(worker_extra if index else ()), env=environment,
            fresh=two_seeds and index == 1))
    results = []
    try:
        if while_running:
            while_running(processes)
        for process in processes:
            output, _ = process.communicate(timeout=420)
            results.append((process.returncode, output))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    return results


def digests(results):
    return [line for _, output in results for line in output.splitlines()
            if line.startswith("weights sha256:")]


def test_two_workers_train_to_identical_weights_and_only_the_chief_writes(tmp_path):
    """Two workers end with the same weights; only the chief writes the logdir.

    Exact on any device: both workers apply the same all-reduced gradients (an all-reduce
    gives every worker the same bits) by elementwise updates."""
    # `auto` is the chief's to resolve: a worker that cannot read the chief's hparams.json
    # (here: a logdir of its own, as without a shared file system) takes the chief's choice
    # instead of making its own, and writes nothing there.
    logdir, worker_dir = tmp_path / "log", tmp_path / "worker_auto"
    results = run_workers(tmp_path, [logdir, worker_dir], "--mixed_precision", "auto",
                          two_seeds=True)
    for code, output in results:
        assert code == 0, output[-4000:]
    assert len(digests(results)) == 2 and len(set(digests(results))) == 1, digests(results)
    assert all("Strategy with 2 replica(s)" in out for _, out in results)
    assert all("done: 2 epochs, 12 steps" in out for _, out in results)
    assert "mixed_precision auto: no (" in results[0][1]
    assert "mixed_precision auto" not in results[1][1]
    assert json.loads((logdir / "hparams.json").read_text())["mixed_precision"] == "no"
    assert not worker_dir.exists() or not any(worker_dir.rglob("*")), list(worker_dir.rglob("*"))
    assert os.listdir(tmp_path / "tmp1") == []

    # --overwrite, one logdir for both (a shared file system): the chief alone moves the old
    # logdir aside, the other worker waits for it (instead of reading the old hparams.json and
    # refusing, or racing the move); the chief's files, once; nothing left by the other worker.
    results = run_workers(tmp_path, [logdir, logdir], "--overwrite", "--d_model", "64")
    for code, output in results:
        assert code == 0, output[-4000:]
    assert len(set(digests(results))) == 1
    assert "--overwrite: moved the old logdir" in results[0][1]
    assert "--overwrite" not in results[1][1]
    assert len([p for p in tmp_path.iterdir() if p.name.startswith("log.old-")]) == 1
    assert json.loads((logdir / "hparams.json").read_text())["d_model"] == 64
    assert sorted(os.listdir(logdir / "checkpoints")) == [
        "checkpoint", "ckpt-12.data-00000-of-00001", "ckpt-12.index",
        "ckpt-6.data-00000-of-00001", "ckpt-6.index"]
    assert len(os.listdir(logdir / "train")) == 1
    assert os.listdir(tmp_path / "tmp1") == []

    # A worker that does not see the chief's logdir (no shared file system) would start
    # from step 0 while the chief resumes from step 12: both stop, saying so.
    results = run_workers(tmp_path, [logdir, tmp_path / "elsewhere"], "--d_model", "64",
                          "--num_epochs", "3")
    expected = ("the workers do not agree with the chief: "
                "worker 1 has restored step 0 but the chief 12")
    for code, output in results:
        assert code != 0 and expected in output, output[-4000:]
        assert "Traceback" not in output, output[-4000:]
    assert (logdir / "checkpoints" / "ckpt-12.index").exists()  # nothing lost

    # The chief refuses the logdir (other hyperparameters): the other worker does not wait
    # for it in a collective forever, it stops too and says why.
    results = run_workers(tmp_path, [logdir, logdir], "--d_model", "32")
    assert results[0][0] != 0 and "was trained with other hyperparameters" in results[0][1]
    assert results[1][0] != 0
    assert "error: the chief stopped before training (see its output)" in results[1][1]


def test_a_signal_to_one_worker_stops_both_after_the_same_update_with_a_checkpoint(tmp_path):
    """SIGTERM to one worker stops both after the same update, with a checkpoint; both resume
    to the same weights.

    Exact on any device: both workers apply the same all-reduced gradients (an all-reduce
    gives every worker the same bits) by elementwise updates."""
    logdir = tmp_path / "log"
    flags = ("--steps_per_epoch", "40", "--log_every", "2", "--checkpoint_every", "0")

    def terminate_the_second_worker_mid_epoch(processes):
        history = logdir / "history.jsonl"
        deadline = time.time() + 300
        while (not (history.exists() and '"step": 4,' in history.read_text())
               and processes[1].poll() is None and time.time() < deadline):
            time.sleep(0.005)
        processes[1].send_signal(signal.SIGTERM)

    results = run_workers(tmp_path, [logdir, logdir], *flags,
                          while_running=terminate_the_second_worker_mid_epoch)
    stops = [re.search(r"stopped by (SIGTERM|a signal to another worker) after step (\d+)",
                       output) for _, output in results]
    for (code, output), stop in zip(results, stops):
        assert code == 75 and stop, output[-4000:]
    assert [stop.group(1) for stop in stops] == ["a signal to another worker", "SIGTERM"]
    step = int(stops[0].group(2))
    assert 4 <= step < 40 and int(stops[1].group(2)) == step
    assert f"saved {logdir / 'checkpoints' / f'ckpt-{step}'}" in results[0][1]
    assert list_checkpoints(str(logdir))[-1].endswith(f"ckpt-{step}")
    resumed = run_workers(tmp_path, [logdir, logdir], *flags, two_seeds=True)
    for code, output in resumed:
        assert code == 0 and f"resumed from {logdir}/checkpoints/ckpt-{step}\n" in output, \
            output[-4000:]
        assert "done: 2 epochs, 80 steps" in output
    assert len(set(digests(resumed))) == 1


def test_workers_that_disagree_with_the_chief_stop_and_name_the_difference(tmp_path):
    """Each worker checks its hyperparameters, corpus and vocabulary against the chief's."""
    logdir = tmp_path / "log"
    results = run_workers(tmp_path, [logdir, logdir], worker_extra=("--log_every", "2"))
    expected = "the workers do not agree with the chief: worker 1 has another hyperparameter " \
               "log_every than the chief"
    for code, output in results:
        assert code != 0 and expected in output, output[-4000:]
        assert "Traceback" not in output, output[-4000:]

    # Another corpus on the worker's own disk: other training files, another vocabulary.
    other_corpus = tmp_path / "other_corpus"
    shutil.copytree(MULTI30K, other_corpus)
    for side in ("de", "en"):
        path = other_corpus / f"train.{side}.gz"
        os.chmod(path, 0o644)
        with gzip.open(path, "rb") as handle:
            lines = handle.read().splitlines(keepends=True)
        with gzip.open(path, "wb") as handle:
            handle.writelines(lines[1200:])
    results = run_workers(tmp_path, [logdir, tmp_path / "elsewhere"],
                          worker_extra=("--data_dir", str(other_corpus)))
    for code, output in results:
        assert code != 0, output[-4000:]
        assert "worker 1 has another corpus than the chief" in output, output[-4000:]
        assert "worker 1 has another subword vocabulary than the chief" in output
    assert os.listdir(tmp_path / "tmp1") == []  # the worker's private files, removed

    # A worker (not the chief) with a bad flag: the chief does not wait for it.
    results = run_workers(tmp_path, [logdir, logdir], worker_extra=("--dropout_rate", "1.5"))
    assert results[1][0] != 0 and "`dropout_rate` must be in [0, 1), got 1.5" in results[1][1]
    assert results[0][0] != 0
    assert "error: worker 1 stopped before training (see its output)" in results[0][1]


def test_two_workers_fine_tune_alike_and_a_failure_on_one_stops_both(tmp_path):
    """Fine-tuning on two workers; then faults that reach one worker only (a logdir the other
    does not see, checkpoints only the chief refuses) stop both with one line, none waiting.

    Exact on any device: both workers apply the same all-reduced gradients (an all-reduce
    gives every worker the same bits) by elementwise updates."""
    source, logdir = tmp_path / "source", tmp_path / "log"
    trained = run_train(source, "--num_epochs", "1", "--steps_per_epoch", "4")
    assert trained.returncode == 0, trained.stdout + trained.stderr
    results = run_workers(tmp_path, [logdir, logdir], "--init_from", str(source),
                          two_seeds=True)
    for code, output in results:
        assert code == 0 and "done: 2 epochs, 12 steps" in output, output[-4000:]
    assert len(digests(results)) == 2 and len(set(digests(results))) == 1, digests(results)
    assert f"fine-tuning: the weights of {source}/checkpoints/ckpt-4" in results[0][1]
    assert json.loads((logdir / "init_from.json").read_text())["checkpoints"] == [
        f"{source}/checkpoints/ckpt-4"]

    # The chief resumes from its checkpoints; a worker that does not see them would read
    # the source again (its vector of facts one longer than the chief's in the all-reduce).
    results = run_workers(tmp_path, [logdir, tmp_path / "elsewhere"], "--init_from", str(source))
    expected = "worker 1 has another fine-tuning source than the chief"
    for code, output in results:
        assert code != 0 and expected in output, output[-4000:]
        assert "Traceback" not in output, output[-4000:]

    # Every checkpoint damaged: the chief alone refuses them (the other worker would start
    # afresh); both stop at the barrier after restoring, the worker naming the chief.
    for data_file in (logdir / "checkpoints").glob("ckpt-*.data-*"):
        os.truncate(data_file, 100)
    results = run_workers(tmp_path, [logdir, logdir], "--init_from", str(source))
    assert results[0][0] != 0 and f"error: no checkpoint of {logdir}/checkpoints can be read" \
        in results[0][1], results[0][1][-4000:]
    assert results[1][0] != 0
    assert "error: the chief stopped before training (see its output)" in results[1][1], \
        results[1][1][-4000:]
    assert all("Traceback" not in output for _, output in results)
