"""Imported by the tests' forkserver (`tests/programs.py`) before it forks any program: Keras
(and its backend), sentencepiece and sacrebleu, as the programs import TensorFlow and Keras
(`kyu_transformer.startup`: the collector held back, then what the process holds frozen). A
forked program finds them imported, and its collections scan only what it makes itself.
"""
from kyu_transformer.startup import import_frozen

import_frozen(("keras", "sentencepiece", "sacrebleu"))
