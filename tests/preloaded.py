"""Imported last by the tests' forkserver (`tests/programs.py`), after the modules it preloads.

`gc.freeze()` moves every object that exists now (those of Keras, TensorFlow and the other
imports: some 400,000, none of them garbage) to a generation the collector never scans. A
forked program's collections then scan only what the program made itself, instead of the
imports again at each full collection.
"""
import gc

gc.freeze()
