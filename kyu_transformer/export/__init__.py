"""Exports a trained model for use outside this package: a TensorFlow `saved_model` (text in,
text out) and a `ctranslate2` model, with a translator over it."""
