"""Config round-trips and `.keras` save/load of a model made of every layer."""

import keras
import numpy as np
import pytest

from kyu_transformer.layers import (
    DecoderBlock, Dropout, Embedding, EncoderBlock, FeedForward, MultiHeadAttention, Normalize,
    PositionalEncoding, ScaledDotProductAttention, ScaleNorm)
from tests.test_fast_paths import switched

LAYERS = [
    (Normalize(epsilon=1e-6), (2, 3, 8)),
    (ScaleNorm(epsilon=1e-3), (2, 3, 8)),
    (Embedding(30, 8, embeddings_initializer="uniform"), "ids"),
    (Embedding(30, 8, unit_norm=True), "ids"),
    (PositionalEncoding(12, num_units=8, style="concat"), "ids"),
    (PositionalEncoding(12, sinusoid=False), (2, 3, 8)),
    (MultiHeadAttention(num_heads=4, dropout_rate=0.1, causality=True, use_bias=False,
                        projection_activation="relu", output_projection=True,
                        norm_position="pre", epsilon=1e-6, residual_dropout_rate=0.2),
     (2, 3, 8)),
    (FeedForward((16, 8), dropout_rate=0.1, activation="gelu", norm_position="pre",
                 inner_dropout_rate=0.1), (2, 3, 8)),
    (MultiHeadAttention(num_heads=2, output_projection=True, norm_type="scale"), (2, 3, 8)),
    (EncoderBlock(num_heads=2, d_ff=16, dropout_rate=0.1, norm_position="pre",
                  attention_dropout_rate=0.0, inner_dropout_rate=0.1), (2, 3, 8)),
    (DecoderBlock(num_heads=2, d_ff=16, dropout_rate=0.1), (2, 3, 8)),
    (DecoderBlock(num_heads=2, d_ff=16, norm_position="pre", norm_type="scale"), (2, 3, 8)),
    (ScaledDotProductAttention(dropout_rate=0.1), None),
    (Dropout(0.2, seed=7), (2, 3, 8)),
]
LAYERS = [(layer, input_kind, True) for layer, input_kind in LAYERS]
# The plain Keras path round-trips as well (the switch is global: off while these are made,
# and while they load).
with switched(False):
    LAYERS += [
        (Normalize(), (2, 3, 8), False),
        (Dropout(0.2, seed=7), (2, 3, 8), False),
        (ScaledDotProductAttention(dropout_rate=0.1), None, False),
        (MultiHeadAttention(num_heads=2, dropout_rate=0.1), (2, 3, 8), False),
        (FeedForward((16, 8), dropout_rate=0.1), (2, 3, 8), False),
        (EncoderBlock(num_heads=2, d_ff=16, dropout_rate=0.1), (2, 3, 8), False),
        (DecoderBlock(num_heads=2, d_ff=16, dropout_rate=0.1), (2, 3, 8), False),
    ]


def switches(layer):
    """The fast-paths choice of every `Normalize` and `Dropout` in `layer` (built)."""
    return {sub.fast_paths for sub in layer._flatten_layers()
            if isinstance(sub, (Normalize, Dropout))}


def states(layer, *args):
    """The outputs of `layer` on `args` (of a `MultiHeadAttention`, the first of its results)."""
    outputs = layer(*args)
    return outputs[0] if isinstance(layer, MultiHeadAttention) else outputs


@pytest.mark.parametrize("layer,input_kind,fast", LAYERS, ids=lambda v: type(v).__name__)
def test_config_round_trip_gives_same_layer_and_outputs(rng, layer, input_kind, fast):
    config = keras.saving.serialize_keras_object(layer)
    with switched(fast):
        clone = keras.saving.deserialize_keras_object(config)
    assert type(clone) is type(layer)
    assert clone.get_config() == layer.get_config()
    if input_kind is None:
        return
    inputs = (rng.integers(0, 30, size=(2, 3)) if input_kind == "ids"
              else rng.normal(size=input_kind).astype("float32"))
    args = (inputs, inputs) if isinstance(layer, DecoderBlock) else (inputs,)
    outputs = states(layer, *args)
    clone(*args)
    assert switches(layer) <= {fast} and switches(clone) == switches(layer)
    clone.set_weights(layer.get_weights())
    np.testing.assert_array_equal(states(clone, *args), outputs)


def build_model():
    source_in = keras.Input((None,), dtype="int32", name="source")
    target_in = keras.Input((None,), dtype="int32", name="target")
    embedding = Embedding(40, 16, name="embedding")
    encoding = PositionalEncoding(20, name="encoding")
    source = embedding(source_in)
    source = keras.layers.Add()([source, encoding(source)])
    memory = EncoderBlock(num_heads=2, d_ff=32, name="encoder")(source)
    memory = Normalize(name="final_norm")(memory)
    target = embedding(target_in)
    target = keras.layers.Add()([target, encoding(target)])
    target, _, _ = MultiHeadAttention(num_heads=4, causality=True, name="extra_attention")(target)
    target = FeedForward((32, 16), name="extra_ffn")(target)
    target, _, coverage = DecoderBlock(num_heads=2, d_ff=32, name="decoder")(
        target, memory, return_attention_scores=True)
    return keras.Model([source_in, target_in], [target, coverage])


def test_functional_model_of_every_layer_saves_and_loads(tmp_path, rng):
    model = build_model()
    source = rng.integers(1, 40, size=(3, 9))
    source[1, 5:] = 0
    target = rng.integers(1, 40, size=(3, 6))
    target[2, 2:] = 0
    before = [np.asarray(o) for o in model([source, target])]
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.models.load_model(path, safe_mode=False)
    after = [np.asarray(o) for o in loaded([source, target])]
    for first, second in zip(before, after):
        np.testing.assert_array_equal(first, second)
    # different lengths than at save time: the batch and time axes stay free
    longer = rng.integers(1, 40, size=(2, 13))
    assert loaded([longer, longer[:, :4]])[0].shape == (2, 4, 16)
