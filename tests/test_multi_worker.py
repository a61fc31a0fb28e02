"""Two worker processes on 127.0.0.1 under MultiWorkerMirroredStrategy."""

import json
import os
import socket
import subprocess
import sys

from tests.test_data import MULTI30K
from tests.test_training import ROOT


def free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in sockets]
    for sock in sockets:
        sock.close()
    return ports


def test_two_workers_train_to_identical_weights_and_only_the_chief_writes(tmp_path):
    workers = [f"127.0.0.1:{port}" for port in free_ports(2)]
    logdir = tmp_path / "log"
    processes = []
    for index in range(2):
        scratch = tmp_path / f"tmp{index}"
        scratch.mkdir()
        config = {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}
        environment = {**os.environ, "TF_CONFIG": json.dumps(config), "TMPDIR": str(scratch),
                       "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1"}
        command = [sys.executable, os.path.join(ROOT, "train.py"), "--strategy", "multi_worker",
                   "--hparams", "tiny", "--data_dir", MULTI30K, "--logdir", str(logdir),
                   "--num_epochs", "2", "--steps_per_epoch", "6", "--log_every", "3"]
        processes.append(subprocess.Popen(command, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                                          env=environment))
    outputs = []
    for process in processes:
        try:
            output, _ = process.communicate(timeout=420)
        finally:
            for other in processes:
                if other.poll() is None and process.returncode is None:
                    other.kill()
        outputs.append(output)
        assert process.returncode == 0, output[-4000:]
    digests = [line for output in outputs for line in output.splitlines()
               if line.startswith("weights sha256:")]
    assert len(digests) == 2 and digests[0] == digests[1], digests
    assert all("Strategy with 2 replica(s)" in out for out in outputs)
    assert all("done: 2 epochs, 12 steps" in out for out in outputs)
    # the chief's files, once; nothing left behind by the other worker
    assert sorted(os.listdir(logdir / "checkpoints")) == [
        "checkpoint", "ckpt-12.data-00000-of-00001", "ckpt-12.index",
        "ckpt-6.data-00000-of-00001", "ckpt-6.index"]
    assert len(os.listdir(logdir / "train")) == 1
    assert os.listdir(tmp_path / "tmp1") == []
