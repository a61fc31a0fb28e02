"""What the benchmarks need beyond the package: the peers they compare with, the corpus."""

import importlib
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The full Multi30k: next to the checkout on this project's machines, else where
# `python train.py` downloads it.
SHARED_DATA = os.path.join(ROOT, "..", "shared", "data", "multi30k")
DEFAULT_DATA = SHARED_DATA if os.path.isdir(SHARED_DATA) else os.path.join(ROOT, "data",
                                                                           "multi30k")


def require(module, extra="bench", hint=" (or --skip_peer)"):
    """Imports `module`, or stops with one line naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        if error.name != module:
            raise
        raise SystemExit(f"error: this benchmark compares with {module}, which is not "
                         f"installed: pip install -e \".[{extra}]\"{hint}") from None


def require_data(data_dir):
    """Stops with one line when the corpus folder is missing."""
    if not os.path.isdir(data_dir):
        raise SystemExit(f"error: {data_dir}: no such data folder. Run `python train.py "
                         "--hparams small` once (it downloads Multi30k to data/multi30k) or "
                         "pass --data_dir.")
    return data_dir
