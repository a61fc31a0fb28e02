"""Holds Kyubyong Park's Transformer (`modules.py`, 2017) as Keras 3 layers, and the toolkit
that trains, evaluates and exports it.

Read the port first: `layers` (modules.py's builders as layers), `model` (the
encoder-decoder `Transformer`) and `losses`, with `conventions` (the ids and rules they share)
and `fast_paths` (their CPU fast paths); then the rooms of the toolkit: `data/` (text, subwords,
the corpus, the tf.data pipeline), `training/`, `decoding/`, `export/`, `safety/` (whole files,
the lock, signals) and `cli/` (what the programs share); `config` (every hyperparameter),
`precision`, `filenames` and `tf1_checkpoint` (Kyubyong's TensorFlow 1 checkpoints) beside them.
"""

__version__ = "0.2.0"
