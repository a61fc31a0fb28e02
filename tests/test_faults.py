"""Nothing lost, nothing cryptic: kills, bad input, refusals, determinism."""

import gzip
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from kyu_transformer import config, filenames
from kyu_transformer.training.checkpoints import (
    UnreadableCheckpoint, list_checkpoints, load_model, unreadable)
from tests.programs import run
from tests.test_data import MULTI30K
from tests.test_training import ROOT, digest, run_train

pytestmark = pytest.mark.slow  # every test here starts train.py or eval.py


def wait_for(predicate, process, seconds=300):
    deadline = time.time() + seconds
    while not predicate() and process.poll() is None and time.time() < deadline:
        time.sleep(0.005)


def logged_steps(logdir):
    history = logdir / "history.jsonl"
    if not history.exists():
        return []
    return [json.loads(line)["step"] for line in history.read_text().splitlines()
            if line.endswith("}")]


def logged_losses(logdir):
    """``(step, loss)`` of every training line in the history, a step retaken after a kill
    as often as it was logged (a line the kill cut short left out)."""
    losses = []
    for line in (logdir / "history.jsonl").read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if row["kind"] == "train":
            losses.append((row["step"], row["loss"]))
    return losses


def second_run_is_refused(process, logdir, flags):
    """A second train.py on the logdir of `process` (paused meanwhile: it keeps its lock)."""
    process.send_signal(signal.SIGSTOP)
    try:
        second = run_train(logdir, *flags)
    finally:
        process.send_signal(signal.SIGCONT)
    assert second.returncode != 0 and "Traceback" not in second.stderr, second.stderr
    assert f"error: {logdir} is in use by another training run (PID {process.pid} on host " \
           in second.stderr, second.stderr
    overwrite = run_train(logdir, *flags, "--overwrite")  # a busy logdir is never moved aside
    assert overwrite.returncode != 0 and "is in use by another training run" in overwrite.stderr
    assert not [path for path in logdir.parent.iterdir() if ".old-" in path.name]


def stop_with_two_signals(process, logdir, flags):
    """SIGTERM mid-epoch, SIGINT while the checkpoint is written; checks the run's last words."""
    wait_for(lambda: any(step > 70 for step in logged_steps(logdir)), process)
    process.send_signal(signal.SIGTERM)
    wait_for(lambda: any("_temp" in name for name in os.listdir(logdir / "checkpoints")),
             process, seconds=30)
    process.send_signal(signal.SIGINT)
    output = process.stdout.read()
    assert process.wait(timeout=60) == 75, output
    stopped = re.search(r"stopped by SIGTERM after step (\d+); saved (\S+)\. Resume with: "
                        r"python \S*train\.py (.*)", output)
    assert stopped, output[-3000:]
    step, path, command = int(stopped.group(1)), stopped.group(2), stopped.group(3)
    assert 70 < step < 180 and path == str(logdir / "checkpoints" / f"ckpt-{step}")
    assert list_checkpoints(str(logdir))[-1] == path and unreadable(path) is None
    assert command.split() == ["--hparams", "tiny", "--data_dir", str(MULTI30K), "--logdir",
                               str(logdir), *flags]
    assert "Traceback" not in output


def test_kills_signals_and_a_second_run_lose_nothing(tmp_path):
    """Kills at any moment (also during checkpoint writes), SIGTERM and SIGINT, a second
    run on the logdir: the same command resumes, ending as an uninterrupted run.

    Resumption restores the weights, the optimizer, the data position (in epochs on the pairs
    both ways, BiT's, read from the prepared files) and the dropout layers' random states
    (dropout is on): the masks of a resumed step are those the uninterrupted run draws at that
    step, so the weights end bit-identical.
    Exact on any device: both runs pass --deterministic (TensorFlow's deterministic ops) and
    compute on one machine's same device, TensorFloat-32 off or on in both."""
    logdir = tmp_path / "log"
    checkpoints = logdir / "checkpoints"
    # Three epochs: the signals come in the second, and the run has a third still to train
    # whenever the poll sees their moment (on a busy machine it may see it late).
    flags = ["--num_epochs", "3", "--steps_per_epoch", "60", "--checkpoint_every", "4",
             "--dropout_rate", "0.1", "--deterministic", "--bidirectional_epochs", "2"]
    process = run_train(logdir, *flags, wait=False)
    wait_for(lambda: logged_steps(logdir), process)
    second_run_is_refused(process, logdir, flags)
    stop_with_two_signals(process, logdir, flags)
    chooser = random.Random(5)
    kills = 0
    for attempt in range(3):
        process = run_train(logdir, *flags, wait=False)
        if attempt % 2 == 0:  # the moment a checkpoint is being written
            wait_for(lambda: any("_temp" in name for name in os.listdir(checkpoints))
                     if checkpoints.exists() else False, process)
        else:  # a random moment after the first checkpoint
            wait_for(lambda: (checkpoints / "checkpoint").exists(), process)
            time.sleep(chooser.uniform(0.0, 1.5))
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
            kills += 1
        process.wait()
        # whatever the moment, the newest checkpoint loads cleanly
        if list_checkpoints(str(logdir)):
            load_model(config.load(str(logdir / "hparams.json")), str(logdir))
    assert kills >= 2
    newest = list_checkpoints(str(logdir))[-1]
    finished = run_train(logdir, *flags)
    assert finished.returncode == 0, finished.stdout + finished.stderr
    # it resumes from the newest checkpoint, and the first epoch is not trained again
    newest_step = newest.rsplit("-", 1)[1]
    assert f"resuming from {newest} at step {newest_step}, after" in finished.stdout
    assert "epoch 1/3" not in finished.stdout
    assert "done: 3 epochs, 180 steps" in finished.stdout
    # its minutes are this process's; the run's in all start from those said at the resumption
    earlier = re.search(r"at step \d+, after (\d+\.\d) min of training", finished.stdout)
    done = re.search(r"180 steps in \d+\.\d min \((\d+\.\d) min of training in all, the "
                     r"earlier runs included\)", finished.stdout)
    assert earlier and done and float(done.group(1)) >= float(earlier.group(1)), finished.stdout
    straight = run_train(tmp_path / "straight", *flags, fresh=True)  # another hash seed
    assert digest(finished.stdout) == digest(straight.stdout) != []
    # the run says its plan at start, and its time once the pace is measured
    assert "plan: 3 epochs of about 60 updates, about 180 updates\n" in straight.stdout
    assert re.search(r"estimated on this machine: \d+\.\d\d s per update, about \d+\.\d min for "
                     r"the 150 updates to go\n", straight.stdout), straight.stdout
    assert re.search(r"step 40: .* target tokens/s, about \d+\.\d min left\n", straight.stdout)
    # history lines cut by a kill are skipped, the plots are drawn
    assert (logdir / "loss.png").is_file() and (logdir / "lr.png").is_file()


def killed_at_first_checkpoint_and_resumed(tmp_path, flags):
    """``(straight, resumed)``: an uninterrupted run of train.py with `flags` (still running),
    and the result of another, SIGKILLed once its first checkpoint is listed, then resumed."""
    straight = run_train(tmp_path / "straight", *flags, wait=False, fresh=True)  # another seed
    logdir = tmp_path / "log"
    process = run_train(logdir, *flags, wait=False)
    wait_for(lambda: (logdir / "checkpoints" / "checkpoint").exists(), process)
    process.send_signal(signal.SIGKILL)
    output = process.stdout.read()
    assert process.wait() == -signal.SIGKILL, output
    resumed = run_train(logdir, *flags)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    return straight, resumed


def test_a_run_with_every_regularizer_killed_within_an_accumulated_update_resumes_bit_identical(
        tmp_path):
    """Attention, ReLU, word and residual dropout, LayerDrop, sampled segmentations, the
    decaying schedule and a first epoch on the pairs both ways (BiT), in a pre-norm model with
    ScaleNorm and FixNorm, with `--accumulate_steps 2` (a step is an update of two batches;
    checkpoints fall between updates): a run killed after a checkpoint inside its first epoch
    retakes the update it was in, resumes into the same segmentations, masks, dropped blocks
    and rates, and ends as the uninterrupted run, bit for bit, and with the same loss at every
    logged step (the steps retaken too); with residual dropout alone (no other regularizer, the
    plain schedule, one direction, post-norm layer norms) the run ends elsewhere: the
    comparison can fail. Steps, the cap and the plan count updates.
    Exact on any device: both runs pass --deterministic (TensorFlow's deterministic ops) and
    compute on one machine's same device, TensorFloat-32 off or on in both."""
    flags = ["--num_epochs", "2", "--steps_per_epoch", "12", "--accumulate_steps", "2",
             "--checkpoint_every", "3", "--log_every", "3", "--deterministic"]
    regularizers = ["--dropout_rate", "0.2", "--attention_dropout", "0.1", "--relu_dropout",
                    "0.2", "--word_dropout", "0.1", "--subword_alpha", "0.5", "--decay_steps",
                    "50", "--bidirectional_epochs", "1", "--norm_position", "pre",
                    "--norm_type", "scale", "--fix_norm", "true", "--layer_dropout", "0.2"]
    straight, resumed = killed_at_first_checkpoint_and_resumed(tmp_path, flags + regularizers)
    step = re.search(r"resuming from \S+ckpt-(\d+) at step (\d+),", resumed.stdout)
    assert step and step.group(1) == step.group(2), resumed.stdout
    # mid-epoch, the data position said in updates (twice as many batches)
    assert re.search(r"epoch 1/2 \(resuming after [1-9]\d* steps\)", resumed.stdout)
    assert "subword regularization: alpha 0.5" in resumed.stdout
    assert "both ways (BiT): the first epoch trains" in resumed.stdout
    assert "done: 2 epochs, 24 steps" in resumed.stdout
    saved = config.load(str(tmp_path / "log" / "hparams.json"))
    assert (saved["norm_position"], saved["norm_type"], saved["fix_norm"],
            saved["layer_dropout"]) == ("pre", "scale", True, 0.2)
    straight_output = straight.communicate(timeout=600)[0]
    assert straight.returncode == 0, straight_output
    assert "plan: 2 epochs of about 12 updates, about 24 updates\n" in straight_output
    assert digest(resumed.stdout) == digest(straight_output) != []
    losses = {name: logged_losses(tmp_path / name) for name in ("straight", "log")}
    # (a line's loss is the mean over the steps since the process's last line: checkpoints
    # on the lines' steps keep the resumed run's windows those of the straight run)
    assert len(losses["straight"]) == 8 and set(losses["log"]) == set(losses["straight"])
    plain = run_train(tmp_path / "plain", *flags, "--dropout_rate", "0.2")
    assert plain.returncode == 0 and digest(plain.stdout) not in ([], digest(straight_output))


def test_unwritable_logdir_fails_at_start(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    started = time.time()
    result = run_train(blocker / "log")
    assert result.returncode != 0
    assert f"the logdir {blocker / 'log'} is not writable" in result.stderr
    assert time.time() - started < 60 and "epoch 1" not in result.stdout


def test_bad_data_folders_and_hparams_through_train_py(tmp_path):
    cases = [
        (["--data_dir", tmp_path / "missing"], "no such data folder"),
        (["--data_dir", __file__], "is a file, expected a folder"),
        (["--hparams", "tiny,nothing.json"], "no such JSON file: nothing.json"),
        (["--batch_szie", "8"], "unknown flag --batch_szie (did you mean --batch_size?)"),
        (["--dropout_rate", "1.5"], "`dropout_rate` must be in [0, 1), got 1.5"),
        (["--num_heads", "3"], "`d_model` (32) must be divisible by `num_heads` (3)"),
    ]
    (tmp_path / "empty").mkdir()
    cases.append((["--data_dir", tmp_path / "empty"], "the data folder is empty"))
    broken = tmp_path / "broken.json"
    broken.write_text('{"d_model": 64,,}')
    cases.append((["--hparams", broken], "broken.json, line 1: not valid JSON"))
    for extra, message in cases:
        result = run("train.py", "--hparams", "tiny", "--data_dir", MULTI30K, "--logdir",
                     tmp_path / "log", *extra)
        assert result.returncode != 0, extra
        assert message in result.stderr, (extra, result.stderr[-2000:])
        assert "Traceback" not in result.stderr, result.stderr[-2000:]


def test_another_corpus_in_the_same_logdir_is_refused(tmp_path):
    data_dir = tmp_path / "data"
    shutil.copytree(MULTI30K, data_dir)
    logdir = tmp_path / "log"
    arguments = ["--hparams", "tiny", "--data_dir", data_dir, "--logdir", logdir,
                 "--steps_per_epoch", "2"]
    first = run("train.py", *arguments)
    assert first.returncode == 0, first.stderr
    for name in os.listdir(data_dir):
        os.chmod(data_dir / name, 0o644)
    with gzip.open(data_dir / "train.en.gz", "rb") as handle:
        lines = handle.read().splitlines(keepends=True)
    lines[0] = b"A changed sentence.\n"
    with gzip.open(data_dir / "train.en.gz", "wb") as handle:
        handle.writelines(lines)

    def written():  # the run's files (the lock is each run's own)
        return {path: path.read_bytes() for path in logdir.rglob("*")
                if path.is_file() and path.name != filenames.LOCK}

    before = written()
    refused = run("train.py", *arguments)
    assert refused.returncode != 0
    assert f"was trained with another corpus (its training files differ from those in " \
           f"{data_dir}). Use another --logdir, the same settings to resume, or --overwrite to " \
           f"move the old logdir aside and start afresh." in refused.stderr
    # nothing of the run is touched (--overwrite's move: test_training.py, on other hparams)
    assert written() == before


def test_eval_on_odd_input(tmp_path, varied_tiny_logdir):
    logdir = tmp_path / "log"
    shutil.copytree(varied_tiny_logdir, logdir)  # the session's model (eval.py writes here)
    odd = tmp_path / "odd.de"
    odd.write_text("\ufeffΩmega ♞ 漢字 ist hier.\r\n" + "sehr lang " * 60 + "\n\t \n", "utf-8")
    result = run("eval.py", "--logdir", logdir, "--src", odd, "--beam_size", 2)
    assert result.returncode == 0, result.stderr
    assert "note: 1 sentences were longer than maxlen1=48 subwords" in result.stdout
    lines = (logdir / "eval" / "odd.hyp.txt").read_text(encoding="utf-8").split("\n")
    assert len(lines) == 4 and lines[2] == ""
    empty = tmp_path / "empty.de"
    empty.write_text("")
    result = run("eval.py", "--logdir", logdir, "--src", empty)
    assert result.returncode != 0 and "no sentence to translate" in result.stderr
    result = run("eval.py", "--logdir", logdir, "--src", odd, "--ref", empty)
    assert result.returncode != 0 and "has 3 lines but" in result.stderr


def test_unreadable_checkpoints_are_skipped_named_and_set_aside(tmp_path):
    logdir = tmp_path / "log"
    flags = ["--steps_per_epoch", "12", "--checkpoint_every", "4", "--deterministic"]
    trained = run_train(logdir, *flags)
    assert trained.returncode == 0, trained.stderr
    newest = logdir / "checkpoints" / "ckpt-12"
    data_file = newest.with_name("ckpt-12.data-00000-of-00001")
    with open(data_file, "r+b") as handle:  # a copy cut short
        handle.truncate(data_file.stat().st_size // 2)
    damaged = data_file.read_bytes()
    hparams = config.load(str(logdir / "hparams.json"))

    # eval.py (and export.py, through the same loader) take the newest readable one
    result = run("eval.py", "--logdir", logdir, "--split", "val", "--beam_size", 1)
    assert result.returncode == 0, result.stderr
    assert f"note: skipped {newest}: cannot be read (Read less bytes than requested)" \
        in result.stdout
    assert f"checkpoint {newest.with_name('ckpt-8')}" in result.stdout
    # ... but refuse it when asked for it, or for an average that includes it
    with pytest.raises(UnreadableCheckpoint, match=f"^{re.escape(str(newest))}: cannot be read"):
        load_model(hparams, str(logdir), ckpt=str(newest))
    with pytest.raises(UnreadableCheckpoint, match="one of the last 2 checkpoints to average"):
        load_model(hparams, str(logdir), average_last=2)
    result = run("eval.py", "--logdir", logdir, "--split", "val", "--ckpt", newest)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert f"error: {newest}: cannot be read" in result.stderr

    # none readable: refused, nothing moved (never a fresh start over a run's checkpoints)
    every = tmp_path / "every"
    shutil.copytree(logdir, every)
    for step in (4, 8):
        os.truncate(every / "checkpoints" / f"ckpt-{step}.data-00000-of-00001", 100)
    refused = run_train(every, *flags, "--num_epochs", "2")
    assert refused.returncode != 0 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert f"error: no checkpoint of {every / 'checkpoints'} can be read (ckpt-12: Read less " \
           "bytes than requested; ckpt-8: " in refused.stderr
    assert "nothing was moved" in refused.stderr
    assert not (every / "checkpoints" / "corrupt").exists()

    # training moves it aside (never deleted), resumes from the one before, saves anew
    resumed = run_train(logdir, *flags, "--num_epochs", "2")
    assert resumed.returncode == 0, resumed.stderr
    assert f"note: {newest} cannot be read (Read less bytes than requested); moved to " \
           f"{logdir / 'checkpoints' / 'corrupt' / 'ckpt-12.'}" in resumed.stdout
    assert f"; resuming from {newest.with_name('ckpt-8')}\n" in resumed.stdout
    assert f"resumed from {newest.with_name('ckpt-8')}\n" in resumed.stdout
    assert "done: 2 epochs, 24 steps" in resumed.stdout
    [aside] = (logdir / "checkpoints" / "corrupt").iterdir()
    assert (aside / data_file.name).read_bytes() == damaged
    assert unreadable(str(newest)) is None  # step 12 saved again, beside the damaged copy
    assert [os.path.basename(path) for path in list_checkpoints(str(logdir))] == [
        "ckpt-8", "ckpt-12", "ckpt-16", "ckpt-20", "ckpt-24"]


def can_mount_a_small_disk():
    try:
        return subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                               "mount -t tmpfs -o size=1m tmpfs /mnt"],
                              capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not can_mount_a_small_disk(),
                    reason="this machine cannot mount a tmpfs in a user namespace")
def test_a_full_disk_stops_with_one_line_leaves_nothing_partial_and_resumes(tmp_path):
    """train.py and eval.py on a real file system that fills up (a tmpfs of 8 MiB)."""
    driver = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", sys.executable,
                             os.path.join(ROOT, "tests", "small_disk.py"), str(tmp_path)],
                            capture_output=True, text=True, timeout=600)
    assert driver.returncode == 0, driver.stderr[-3000:]
    report = json.loads(driver.stdout)
    assert report["first"]["code"] == 0, report["first"]["stderr"][-3000:]
    full, logdir = report["full"], os.path.dirname(os.path.dirname(report["newest_before"]))
    assert full["code"] == 1 and "Traceback" not in full["stderr"], full["stderr"][-3000:]
    size = report["checkpoint_size"] / 2**20
    assert f"error: no space left on the device writing {logdir}/checkpoints/ckpt-12 (it needs " \
           f"about {size:.1f} MiB); the newest complete checkpoint is " \
           f"{report['newest_before']}. Free some space and run the same command again to " \
           "resume." in full["stderr"].splitlines()
    # nothing partial: no temporary checkpoint folder, no piece of ckpt-12
    assert not [name for name in report["after_full"] if "_temp" in name or "ckpt-12" in name
                or ".tmp" in name], report["after_full"]
    resumed = report["resumed"]
    assert resumed["code"] == 0 and "done: 2 epochs, 16 steps" in resumed["stdout"], \
        resumed["stderr"][-3000:]
    assert f"resumed from {report['newest_before']}\n" in resumed["stdout"]
    evaluated = report["eval"]
    assert evaluated["code"] == 1 and "Traceback" not in evaluated["stderr"]
    assert f"error: no space left on the device writing {logdir}/eval/val.hyp.txt; nothing " \
           "was left half-written." in evaluated["stderr"], evaluated["stderr"][-3000:]
    assert "eval" in report["after_eval"]
    assert not [name for name in report["after_eval"] if name.startswith("eval/")]
    # the training split prepared on a full disk: one line, nothing half-written left
    cache_full, cache = report["cache_full"], report["cache"]
    assert cache_full["code"] == 1 and "Traceback" not in cache_full["stderr"], \
        cache_full["stderr"][-3000:]
    line = cache_full["stderr"].strip().splitlines()[-1]
    assert re.fullmatch(f"error: no space left on the device writing {cache}/train\\."
                        "[0-9a-f]{16}; the newest complete checkpoint is none yet. Free some "
                        "space and run the same command again to resume.", line), line
    assert [name for name in report["after_cache_full"] if not name.endswith(".lock")] == []
    freed = report["cache_freed"]
    assert freed["code"] == 0 and "done: 1 epochs, 8 steps" in freed["stdout"], \
        freed["stderr"][-3000:]
