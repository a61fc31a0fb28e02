"""Reads a `TranslationModel`'s `.keras` archive without Keras: the hyperparameters, search
settings and subword model it holds, so that the programs check them before TensorFlow loads.

Keras writes the archive as a zip file: ``config.json`` (the object's `get_config`) and
``assets/`` (what `TranslationModel.save_assets` wrote), beside the weights.
"""

import json
import os
import zipfile

from kyu_transformer import filenames
from kyu_transformer.data.subwords import Subwords
from kyu_transformer.data.text import DataError

SUFFIX = ".keras"
_CONFIG, _SUBWORDS = "config.json", f"assets/{filenames.SUBWORDS}"


def is_archive(path):
    """Tells whether `path` names a `.keras` file (rather than a logdir or an export folder)."""
    return str(path).endswith(SUFFIX) and not os.path.isdir(path)


def read_archive(path):
    """Returns ``(hparams, settings, subwords)`` of the `.keras` file at `path`: dicts of its
    hyperparameters and `SearchSettings` fields, and its `Subwords`; DataError naming the file
    if it is missing or holds no translator."""
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such file")
    try:
        with zipfile.ZipFile(path) as archive:
            config = json.loads(archive.read(_CONFIG))
            subwords = Subwords.from_serialized(archive.read(_SUBWORDS))
        return config["config"]["hparams"], config["config"]["settings"], subwords
    except (zipfile.BadZipFile, KeyError, ValueError, TypeError, OSError,
            RuntimeError) as error:  # RuntimeError: sentencepiece's, for a damaged model
        raise DataError(f"{path}: not a translator saved by kyu_transformer (export.py --format "
                        f"keras): {error}") from None
