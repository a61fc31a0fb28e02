"""Holds what the programs at the top (train.py, eval.py, export.py, import_tf1.py) share: their
`flags`, checked before TensorFlow loads, and the `startup` import of TensorFlow and Keras."""
