"""Runs train.py and eval.py on a small tmpfs that fills up (a run's logdir, then its prepared
corpus); prints what happened as JSON.

    unshare --user --map-root-user --mount python tests/small_disk.py WORKDIR

Run inside its own user and mount namespaces (so that an unprivileged user
may mount, and the mount vanishes with the process): the file system is a
real one, and its writes fail as a full disk's do, with ENOSPC.
"""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from tests import programs  # noqa: E402

DATA = os.path.join(ROOT, "tests", "data", "multi30k")
FLAGS = ["--hparams", "tiny", "--data_dir", DATA, "--steps_per_epoch", "8",
         "--checkpoint_every", "4", "--deterministic"]


def run(*command):
    result = programs.run(*command, timeout=300)
    return {"code": result.returncode, "stdout": result.stdout, "stderr": result.stderr}


def fill(disk, leave):
    """Fills `disk` with a file, then frees `leave` bytes of it."""
    filler = os.path.join(disk, "filler")
    chunk = b"\0" * 65536
    with open(filler, "ab") as handle:
        try:
            while True:
                handle.write(chunk)
                handle.flush()
        except OSError:
            pass
    size = os.path.getsize(filler)
    os.truncate(filler, max(size - leave, 0))
    return filler


def listing(folder):
    return sorted(os.path.relpath(os.path.join(parent, name), folder)
                  for parent, folders, files in os.walk(folder) for name in folders + files)


def main(workdir):
    disk = os.path.join(workdir, "disk")
    os.makedirs(disk, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", disk], check=True)
    logdir = os.path.join(disk, "log")
    report = {"first": run("train.py", *FLAGS, "--logdir", logdir)}
    checkpoint = os.path.join(logdir, "checkpoints", "ckpt-8")
    checkpoint_size = sum(os.path.getsize(os.path.join(logdir, "checkpoints", name))
                          for name in os.listdir(os.path.join(logdir, "checkpoints"))
                          if name.startswith("ckpt-8."))
    report["checkpoint_size"] = checkpoint_size
    # Room for history lines and summaries, not for another checkpoint.
    filler = fill(disk, leave=checkpoint_size // 3)
    report["full"] = run("train.py", *FLAGS, "--logdir", logdir, "--num_epochs", "2")
    report["after_full"] = listing(logdir)
    os.remove(filler)
    report["resumed"] = run("train.py", *FLAGS, "--logdir", logdir, "--num_epochs", "2")
    os.makedirs(os.path.join(logdir, "eval"), exist_ok=True)
    filler = fill(disk, leave=0)
    report["eval"] = run("eval.py", "--logdir", logdir, "--split", "val", "--beam_size", "1")
    report["after_eval"] = listing(logdir)
    report["newest_before"] = checkpoint
    # The training split prepared on the full disk (--corpus_cache), the logdir elsewhere.
    os.remove(filler)
    cache, elsewhere = os.path.join(disk, "cache"), os.path.join(workdir, "log-elsewhere")
    filler = fill(disk, leave=4096)
    report["cache"] = cache
    report["cache_full"] = run("train.py", *FLAGS, "--logdir", elsewhere, "--corpus_cache", cache)
    report["after_cache_full"] = listing(cache)
    os.remove(filler)
    report["cache_freed"] = run("train.py", *FLAGS, "--logdir", elsewhere, "--corpus_cache",
                                cache)
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1])
