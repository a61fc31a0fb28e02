"""kyu_transformer: a readable Transformer for Keras 3 and TensorFlow 2."""

__version__ = "0.1.0"
