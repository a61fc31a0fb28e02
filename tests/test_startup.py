"""How the programs start TensorFlow (`kyu_transformer.cli.startup`): the import of it and Keras,
each GPU's memory let grow, the line naming the devices."""

import gc
import json

import pytest

from kyu_transformer.cli.startup import (
    describe_devices, grow_gpu_memory, import_frozen, start_tensorflow)
from tests import gpus, programs
from tests.gpus import A100, T4
from tests.programs import ROOT

FIRST_IMPORT = """
import gc, sys
sys.path.insert(0, sys.argv[1])
from kyu_transformer.cli.startup import import_frozen
collections = []
gc.callbacks.append(lambda phase, info: phase == "start" and collections.append(info))
import_frozen()
print("tensorflow" in sys.modules and "keras" in sys.modules, len(collections), gc.isenabled(),
      gc.get_freeze_count())
"""


@pytest.mark.slow  # a fresh interpreter, as a program starts
@pytest.mark.tensorflow_only("the programs' import of TensorFlow")
def test_a_program_imports_without_collections_then_freezes_what_it_holds():
    result = programs.run("-c", FIRST_IMPORT, ROOT, fresh=True)
    assert result.returncode == 0, result.stderr[-3000:]
    imported, collections, enabled, frozen = result.stdout.split()
    assert (imported, collections, enabled) == ("True", "0", "True")
    assert int(frozen) > 100_000  # the imports' objects, out of later collections' scans


def test_a_process_that_imported_them_is_left_as_it_is():
    frozen = gc.get_freeze_count()
    import_frozen()  # Keras is imported here already
    assert gc.get_freeze_count() == frozen and gc.isenabled()


# ------------------------------------------------------------------ GPUs, faked (none here)

@pytest.fixture
def fake_gpus(monkeypatch):
    return gpus.faker(monkeypatch)


def test_the_devices_line_names_each_kind_of_gpu_or_the_cpu(fake_gpus):
    fake_gpus()
    assert describe_devices() == "CPU (no GPU visible to TensorFlow)"
    fake_gpus(A100)
    assert describe_devices() == "1 x GPU (NVIDIA A100-SXM4-80GB, compute capability 8.0)"
    fake_gpus(A100, A100)
    assert describe_devices() == "2 x GPU (NVIDIA A100-SXM4-80GB, compute capability 8.0)"
    fake_gpus(T4, A100, T4)  # each kind counted, in the order they come
    assert describe_devices() == ("2 x GPU (Tesla T4, compute capability 7.5), "
                                  "1 x GPU (NVIDIA A100-SXM4-80GB, compute capability 8.0)")


def test_each_gpus_memory_grows_unless_tensorflows_own_switch_says_false(fake_gpus, monkeypatch):
    grown = fake_gpus(A100, T4)
    assert start_tensorflow() == ("1 x GPU (NVIDIA A100-SXM4-80GB, compute capability 8.0), "
                                  "1 x GPU (Tesla T4, compute capability 7.5)")
    assert grown == [("/physical_device:GPU:0", True), ("/physical_device:GPU:1", True)]
    grown.clear()
    monkeypatch.setenv("TF_FORCE_GPU_ALLOW_GROWTH", "true")
    grow_gpu_memory()
    assert len(grown) == 2
    grown.clear()
    monkeypatch.setenv("TF_FORCE_GPU_ALLOW_GROWTH", "false")  # the user wants it all taken
    grow_gpu_memory()
    assert grown == []


def test_memory_growth_leaves_devices_set_up_already_as_they_are(fake_gpus, monkeypatch):
    import tensorflow as tf

    fake_gpus(A100)
    message = "Physical devices cannot be modified after being initialized"
    monkeypatch.setattr(tf.config.experimental, "set_memory_growth",
                        lambda device, enable: (_ for _ in ()).throw(RuntimeError(message)))
    grow_gpu_memory()  # TensorFlow's own error for a process that used its devices


# Runs a program (argv[1], its arguments after) with two faked A100s, and prints, after its output,
# the memory growth it set and whether TensorFlow had set its devices up by then.
FAKE_GPU_PROGRAM = """
import runpy, sys
import tensorflow as tf
from tensorflow.python.eager import context

gpus = [tf.config.PhysicalDevice(f"/physical_device:GPU:{i}", "GPU") for i in range(2)]
real = tf.config.list_physical_devices
tf.config.list_physical_devices = lambda kind=None: gpus if kind == "GPU" else real(kind)
tf.config.experimental.get_device_details = lambda gpu: {
    "device_name": "NVIDIA A100-SXM4-80GB", "compute_capability": (8, 0)}
grown = []
tf.config.experimental.set_memory_growth = lambda gpu, enable: grown.append(
    (gpu.name, enable, context.context()._initialized))
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit as stop:
    print("exit", stop.code)
print("memory growth", grown)
"""
TWO_A100 = "devices: 2 x GPU (NVIDIA A100-SXM4-80GB, compute capability 8.0)"
GROWN = ("memory growth [('/physical_device:GPU:0', True, False), "
         "('/physical_device:GPU:1', True, False)]")


@pytest.mark.slow  # three programs: a short training, a translation and an export
@pytest.mark.tensorflow_only("the programs")
def test_the_programs_let_gpu_memory_grow_first_and_name_their_devices(tmp_path):
    from tests.test_data import MULTI30K

    logdir = tmp_path / "log"
    trained = programs.run("-c", FAKE_GPU_PROGRAM, "train.py", "--hparams", "tiny", "--data_dir",
                           MULTI30K, "--logdir", logdir, "--num_epochs", 1,
                           "--steps_per_epoch", 2, "--mixed_precision", "auto")
    assert "exit 0" in trained.stdout, trained.stdout + trained.stderr[-3000:]
    lines = trained.stdout.splitlines()
    # first, before the choice of precision (which follows the devices) and the strategy
    assert lines[0] == TWO_A100 and lines[1].startswith("mixed_precision auto: no (")
    assert lines[-1] == GROWN
    (tmp_path / "a.de").write_text("Ein Hund rennt.\n")
    (tmp_path / "a.en").write_text("A dog runs.\n")
    evaluated = programs.run("-c", FAKE_GPU_PROGRAM, "eval.py", "--logdir", logdir, "--src",
                             tmp_path / "a.de", "--ref", tmp_path / "a.en", "--beam_size", 1)
    assert "exit 0" in evaluated.stdout, evaluated.stdout + evaluated.stderr[-3000:]
    assert evaluated.stdout.splitlines()[-1] == GROWN
    assert f"{TWO_A100}\n" in evaluated.stderr  # standard output may hold translations only
    recorded = json.loads((logdir / "eval" / "a.json").read_text())
    assert recorded["device"] == TWO_A100.removeprefix("devices: ")
    exported = programs.run("-c", FAKE_GPU_PROGRAM, "export.py", "--logdir", logdir, "--out",
                            tmp_path / "exported.keras", "--format", "keras")
    assert "exit 0" in exported.stdout, exported.stdout + exported.stderr[-3000:]
    lines = exported.stdout.splitlines()
    assert lines[0] == TWO_A100 and lines[-1] == GROWN
