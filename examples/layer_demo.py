"""Builds a small encoder-decoder from the layers, runs it, saves it and loads it back."""

import os
import sys
import tempfile

import keras
import numpy as np

from kyu_transformer.layers import (
    DecoderBlock, Embedding, EncoderBlock, Normalize, PositionalEncoding)


def build(vocab_size=100, d_model=32, num_heads=4, d_ff=64, maxlen=20):
    source_ids = keras.Input((None,), dtype="int32", name="source")
    target_ids = keras.Input((None,), dtype="int32", name="target")
    embedding = Embedding(vocab_size, d_model)
    encoding = PositionalEncoding(maxlen)
    source = embedding(source_ids)
    source = keras.layers.Add()([source, encoding(source)])
    memory = Normalize()(EncoderBlock(num_heads, d_ff)(source))
    target = embedding(target_ids)
    target = keras.layers.Add()([target, encoding(target)])
    outputs, _, coverage = DecoderBlock(num_heads, d_ff)(target, memory,
                                                         return_attention_scores=True)
    return keras.Model([source_ids, target_ids], [outputs, coverage])


def main():
    model = build()
    model.summary()
    source = np.array([[5, 6, 7, 8, 0, 0], [9, 10, 11, 12, 13, 14]])
    target = np.array([[1, 5, 6, 0], [1, 9, 10, 11]])
    outputs, coverage = model([source, target])
    print("decoder outputs", outputs.shape, "coverage", coverage.shape)
    print("coverage of the first sentence's first target token:", np.round(coverage[0, 0], 3))
    path = os.path.join(tempfile.mkdtemp(), "demo.keras")
    model.save(path)
    reloaded = keras.models.load_model(path)
    same = np.array_equal(reloaded([source, target])[0], outputs)
    print(f"saved to {path}, reloaded, identical outputs: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
