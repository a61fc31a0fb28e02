"""Starts TensorFlow for the programs: imports it and Keras with the cyclic garbage collector held
back, lets each GPU's memory grow, and names the devices a program computes on.

The imports make a great many objects, almost none of them garbage. With the collector on, each
full collection while they pile up scans them all again. The programs (train.py, eval.py,
export.py, import_tf1.py) call `start_tensorflow` where they first need TensorFlow, which imports
through `import_frozen`: the imports run with the collector off, then `gc.freeze()` moves every
object the process holds to a generation that later collections do not scan (the objects the
imports left unreachable stay there too, once). A process that has imported any of them already (a
test, a notebook calling a program's `main`) is left as it is.

TensorFlow takes nearly all of a GPU's memory for the first process that uses it, so a second
(eval.py beside train.py, two workers on one host) fails for want of memory: `start_tensorflow`
lets each GPU's memory grow as the process needs it, before TensorFlow sets the devices up (and
before a multi-worker strategy), unless the user set TensorFlow's own
``TF_FORCE_GPU_ALLOW_GROWTH=false``. The programs hide TensorFlow's warnings
(``TF_CPP_MIN_LOG_LEVEL=2``), among them the one that a GPU is skipped (a CUDA library missing):
`describe_devices` gives the line each prints instead.
"""

import gc
import importlib
import os
import sys

from kyu_transformer.precision import gpu_details

PROGRAM_MODULES = ("tensorflow", "keras")


def import_frozen(names=PROGRAM_MODULES):
    """Imports the modules `names` with the collector off, then freezes what the process holds;
    nothing when one of them is imported already."""
    if any(name in sys.modules for name in names):
        return
    enabled = gc.isenabled()
    gc.disable()
    try:
        for name in names:
            importlib.import_module(name)
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


def start_tensorflow():
    """Imports TensorFlow and Keras (`import_frozen`) and lets each GPU's memory grow
    (`grow_gpu_memory`); returns `describe_devices`' words for the devices."""
    import_frozen()
    grow_gpu_memory()
    return describe_devices()


def grow_gpu_memory():
    """Lets each visible GPU's memory grow as the process needs it instead of being taken whole
    at start; nothing under ``TF_FORCE_GPU_ALLOW_GROWTH=false`` (TensorFlow's own switch, which
    overrides the setting anyway) or once TensorFlow has set its devices up."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    if os.environ.get("TF_FORCE_GPU_ALLOW_GROWTH", "").strip().lower() == "false":
        return
    for gpu in tf.config.list_physical_devices("GPU"):
        try:
            tf.config.experimental.set_memory_growth(gpu, True)
        except RuntimeError:  # the devices are set up already (a caller that used TensorFlow)
            return


def describe_devices():
    """Returns the devices TensorFlow computes on, in words: ``2 x GPU (NVIDIA A100, compute
    capability 8.0)`` (GPUs of each name and capability counted apart, in their order), or
    ``CPU (no GPU visible to TensorFlow)``."""
    counts = {}
    for name, capability in gpu_details():
        counts[name, capability] = counts.get((name, capability), 0) + 1
    if not counts:
        return "CPU (no GPU visible to TensorFlow)"
    return ", ".join(f"{count} x GPU ({name}, compute capability {'.'.join(map(str, capability))})"
                     for (name, capability), count in counts.items())
