"""Imports TensorFlow and Keras for the programs with the cyclic garbage collector held back.

The imports make a great many objects, almost none of them garbage. With the collector on, each
full collection while they pile up scans them all again. The programs (train.py, eval.py,
export.py, import_tf1.py) call `import_frozen` where they first need TensorFlow: the imports run
with the collector off, then `gc.freeze()` moves every object the process holds to a generation
that later collections do not scan (the objects the imports left unreachable stay there too,
once). A process that has imported any of them already (a test, a notebook calling a program's
`main`) is left as it is.
"""

import gc
import importlib
import sys

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
