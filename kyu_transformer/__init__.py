"""Holds Kyubyong Park's Transformer (`modules.py`, 2017) as Keras 3 layers, and the toolkit
that trains, evaluates and exports it.

Read the port first: `layers` (modules.py's builders as layers), `model` (the
encoder-decoder `Transformer`) and `losses`, with `conventions` (the ids and rules they share)
and `fast_paths` (their CPU fast paths); then the rooms of the toolkit: `data/` (text, subwords,
the corpus, the tf.data pipeline), `training/`, `decoding/`, `export/`, `safety/` (whole files,
the lock, signals) and `cli/` (what the programs share); `config` (every hyperparameter),
`precision`, `filenames` and `tf1_checkpoint` (Kyubyong's TensorFlow 1 checkpoints) beside them.

From Python, `load_translator(path)` translates with a logdir or an export, and
``keras.saving.load_model("small.keras")`` loads a `TranslationModel` after ``import
kyu_transformer``.
"""

import importlib
import importlib.abc
import sys

__version__ = "0.2.0"

# The names this package gives, from the modules that hold them (imported when first asked for).
_PUBLIC = {"load_translator": "kyu_transformer.decoding.text_translator",
           "TextTranslator": "kyu_transformer.decoding.text_translator",
           "TranslationModel": "kyu_transformer.decoding.translation_model"}
# What Keras must know by name to load a `.keras` file of this package: the module registers it.
_SAVED_BY_NAME = "kyu_transformer.decoding.translation_model"


def __getattr__(name):
    """Returns one of the names of `_PUBLIC`, importing its module the first time."""
    if name not in _PUBLIC:
        raise AttributeError(f"module 'kyu_transformer' has no attribute {name!r}")
    return getattr(importlib.import_module(_PUBLIC[name]), name)


class _RegisterWithKeras(importlib.abc.MetaPathFinder):
    """Registers `TranslationModel` with Keras' saving as soon as Keras is imported, by
    whichever module: ``import kyu_transformer`` does not import Keras (the programs check their
    flags before Keras and TensorFlow load), yet `keras.saving.load_model` finds a saved
    class by the name it was registered under."""

    def find_spec(self, name, path=None, target=None):
        if name != "keras":
            return None
        # The other finders' spec (TensorFlow asks for one without importing Keras: each
        # spec found is one Keras may be imported by).
        specs = (finder.find_spec(name, path, target) for finder in sys.meta_path
                 if finder is not self and hasattr(finder, "find_spec"))
        spec = next((spec for spec in specs if spec is not None), None)
        if spec is not None and spec.loader is not None:
            run_module = spec.loader.exec_module

            def run_then_register(module):
                run_module(module)
                if self in sys.meta_path:
                    sys.meta_path.remove(self)
                importlib.import_module(_SAVED_BY_NAME)

            spec.loader.exec_module = run_then_register
        return spec


if "keras" in sys.modules:
    importlib.import_module(_SAVED_BY_NAME)
elif not any(isinstance(finder, _RegisterWithKeras) for finder in sys.meta_path):
    sys.meta_path.insert(0, _RegisterWithKeras())
