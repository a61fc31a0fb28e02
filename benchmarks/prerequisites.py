"""What the benchmarks need beyond the package: the peers they compare with, the corpus, an
earlier revision's tree, a recipe flag's check (`recipe`); and the order they time things in
(`in_turns`). Imported, it puts this checkout first on `sys.path`, so that a benchmark run as
``python benchmarks/NAME.py`` measures this checkout's package, installed or not."""

import argparse
import atexit
import importlib
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
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


def recipe(value):
    """An argparse type: a recipe as train.py's --hparams takes it (not empty)."""
    if not value.strip():
        raise argparse.ArgumentTypeError("expected a recipe, as train.py's --hparams")
    return value


def tree_at(revision, *paths, flag="--baseline"):
    """A temporary folder with this repository's files (or `paths`) at git `revision`.

    Removed when the process ends; stops with one line naming `flag` (the script's flag that
    gave `revision`) when git or the revision is missing.
    """
    try:
        archive = subprocess.run(["git", "-C", ROOT, "archive", revision, *paths],
                                 capture_output=True, check=False)
    except FileNotFoundError:
        sys.exit(f"error: {flag} {revision}: needs git, which is not installed")
    if archive.returncode != 0:
        sys.exit(f"error: {flag} {revision}: {archive.stderr.decode().strip()}")
    folder = tempfile.mkdtemp(prefix="baseline_")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    subprocess.run(["tar", "-x", "-C", folder], input=archive.stdout, check=True)
    return folder


def in_turns(items, round_number):
    """Returns `items` in the order of round `round_number` (from 0): as given in even rounds,
    reversed in odd ones, so that no item always runs right after the same other one and the
    machine's drifts reach all alike."""
    items = list(items)
    return items if round_number % 2 == 0 else items[::-1]
