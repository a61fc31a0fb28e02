"""Each layer's formula against numpy, and what its masks hide."""

import math

import keras
import numpy as np
import pytest
from keras import ops

from kyu_transformer.conventions import LAYER_NORM_EPSILON
from kyu_transformer.layers import (
    DecoderBlock, Dropout, Embedding, EncoderBlock, FeedForward, MultiHeadAttention, Normalize,
    PositionalEncoding, ScaledDotProductAttention, ScaleNorm, label_smoothing, make_norm,
    project_heads)
from tests import reference
from tests.test_fast_paths import switched


def padded_ids(rng, batch=3, length=7, vocab=50, lengths=(7, 4, 2)):
    ids = rng.integers(1, vocab, size=(batch, length))
    for row, keep in enumerate(lengths):
        ids[row, keep:] = 0
    return ids


# ---------------------------------------------------------------- Normalize

def test_normalize_matches_numpy(rng):
    x = rng.normal(size=(2, 5, 8)).astype("float32") * 3 + 1
    layer = Normalize()
    layer.build(x.shape)
    layer.gamma.assign(rng.normal(size=8))
    layer.beta.assign(rng.normal(size=8))
    expected = reference.layer_norm(x, np.asarray(layer.gamma), np.asarray(layer.beta),
                                    layer.epsilon)
    np.testing.assert_allclose(layer(x), expected, rtol=1e-5, atol=1e-5)


def test_normalize_weights_are_named_gamma_beta_and_start_at_one_zero():
    layer = Normalize()
    layer.build((None, 6))
    assert sorted(w.path.split("/")[-1] for w in layer.weights) == ["beta", "gamma"]
    np.testing.assert_array_equal(layer.gamma, np.ones(6))
    np.testing.assert_array_equal(layer.beta, np.zeros(6))
    assert layer.epsilon == LAYER_NORM_EPSILON == 1e-6


def normalize_gradients(value_and_gradients, layer, x, upstream):
    """Gradients of ``sum(upstream * layer(x))`` with respect to x, gamma and beta."""
    def loss(x):
        return ops.sum(ops.cast(layer(x), "float32") * upstream), None

    return value_and_gradients(loss, [x], [layer.gamma, layer.beta])[1]


# The stated gradient against Keras' LayerNormalization: tests/test_fast_paths.py.


def test_normalize_gradient_in_bfloat16_is_computed_in_float32(rng, value_and_gradients):
    x = (rng.normal(size=(4, 6, 32)) * 3 + 1).astype("float32")
    upstream = rng.normal(size=(4, 6, 32)).astype("float32")
    reference_layer = Normalize()
    reference_layer.build(x.shape)
    expected = normalize_gradients(value_and_gradients, reference_layer,
                                   ops.cast(ops.cast(x, "bfloat16"), "float32"), upstream)
    layer = Normalize(dtype="mixed_bfloat16")
    layer.build(x.shape)
    got = normalize_gradients(value_and_gradients, layer, ops.cast(x, "bfloat16"), upstream)
    assert keras.backend.standardize_dtype(got[0].dtype) == "bfloat16"
    assert keras.backend.standardize_dtype(got[1].dtype) == "float32"
    np.testing.assert_allclose(ops.cast(got[0], "float32"), expected[0], rtol=2e-2, atol=2e-2)
    # The upstream gradient arrives rounded to bfloat16 (the layer's output dtype).
    np.testing.assert_allclose(got[1], expected[1], rtol=1e-2, atol=3e-2)
    np.testing.assert_allclose(got[2], expected[2], rtol=1e-2, atol=3e-2)


def test_normalize_over_another_axis_matches_numpy(rng):
    x = rng.normal(size=(2, 5, 8)).astype("float32")
    layer = Normalize(axis=1)
    moved = np.moveaxis(x, 1, -1)
    expected = np.moveaxis(reference.layer_norm(moved, 1.0, 0.0, layer.epsilon), -1, 1)
    np.testing.assert_allclose(layer(x), expected, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- ScaleNorm

def test_scale_norm_matches_numpy_and_keeps_a_zero_vector_zero(rng):
    x = rng.normal(size=(2, 5, 8)).astype("float32") * 3 + 1
    x[1, 4] = 0.0  # a padding position's state
    layer = ScaleNorm(epsilon=1e-2)
    layer.build(x.shape)
    np.testing.assert_allclose(layer.gain, math.sqrt(8))  # a unit-variance vector's length
    layer.gain.assign(2.5)
    outputs = np.asarray(layer(x))
    np.testing.assert_allclose(outputs, reference.scale_norm(x, 2.5, 1e-2), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(outputs[1, 4], 0.0)
    lengths = np.linalg.norm(outputs[0], axis=-1)
    assert np.all(np.abs(lengths - 2.5) < 2.5 * 1e-2)  # the epsilon's share only
    assert [w.path.split("/")[-1] for w in layer.weights] == ["gain"]
    assert ScaleNorm.from_config(layer.get_config()).epsilon == 1e-2


def test_scale_norm_in_bfloat16_computes_in_float32_and_trains_a_float32_gain(
        rng, value_and_gradients):
    x = (rng.normal(size=(4, 6, 32)) * 3 + 1).astype("float32")
    layer = ScaleNorm(dtype="mixed_bfloat16")
    layer.build(x.shape)
    layer.gain.assign(3.0)

    def loss(inputs):
        return ops.sum(ops.cast(layer(inputs), "float32")), None

    outputs = layer(ops.cast(x, "bfloat16"))
    assert keras.backend.standardize_dtype(outputs.dtype) == "bfloat16"
    rounded = np.asarray(ops.cast(ops.cast(x, "bfloat16"), "float32"))
    np.testing.assert_allclose(ops.cast(outputs, "float32"),
                               reference.scale_norm(rounded, 3.0, layer.epsilon), rtol=1e-2)
    (gain_gradient,) = value_and_gradients(loss, [ops.cast(x, "bfloat16")], [layer.gain])[1][1:]
    assert keras.backend.standardize_dtype(gain_gradient.dtype) == "float32"
    # d/dg of sum(g x / |x|) is sum(x / |x|)
    np.testing.assert_allclose(
        gain_gradient, reference.scale_norm(rounded, 1.0, layer.epsilon).sum(), rtol=2e-2)


def test_make_norm_names_the_two_types_and_refuses_a_third():
    assert type(make_norm("layer", 1e-3, "norm")) is Normalize
    norm = make_norm("scale", 1e-3, "norm")
    assert (type(norm), norm.epsilon, norm.name) == (ScaleNorm, 1e-3, "norm")
    with pytest.raises(ValueError, match="`norm_type` must be one of layer, scale, got 'rms'"):
        make_norm("rms", 1e-3, "norm")


# ---------------------------------------------------------------- Dropout

DROPOUT_RATES = [0.1, 0.3, 0.5, 0.8]


def inputs_without_zeros(rng, shape):
    """Inputs none of which is zero, so that a zero output marks a dropped element."""
    return (rng.uniform(0.5, 2.0, size=shape) * rng.choice([-1.0, 1.0], size=shape)).astype(
        "float32")


def assert_fraction_near(observed, probability, draws):
    """`observed` within five standard deviations of a binomial fraction's."""
    assert abs(observed - probability) < 5 * math.sqrt(probability * (1 - probability) / draws)


# The scale `1 / (1 - rate)` may be rounded with the rate (which a layer may
# draw at 16-bit resolution): to a few parts in 100,000 in float32.
SCALE_RTOL = {"float32": 1e-4, "bfloat16": 1e-2}


# Every Dropout test runs the fast path and Keras' own (the switch off as the layer is made).
FAST_PATHS = pytest.mark.parametrize("fast_paths", [True, False], ids=["fast", "plain"])


def dropout(rate, fast_paths, **kwargs):
    with switched(fast_paths):
        layer = Dropout(rate, **kwargs)
    assert layer.fast_paths is fast_paths
    return layer


@FAST_PATHS
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rate", DROPOUT_RATES)
def test_dropout_drops_the_rate_and_scales_the_rest(rng, dtype, rate, fast_paths):
    x = inputs_without_zeros(rng, (101, 999))
    inputs = ops.cast(x, dtype)
    layer = dropout(rate, fast_paths, seed=3, dtype=dtype)
    outputs = np.asarray(ops.cast(layer(inputs, training=True), "float32"))
    x = np.asarray(ops.cast(inputs, "float32"))  # as the layer saw them
    dropped = outputs == 0
    assert_fraction_near(dropped.mean(), rate, dropped.size)
    np.testing.assert_allclose(outputs[~dropped], x[~dropped] / (1 - rate),
                               rtol=SCALE_RTOL[dtype])
    # Neighbouring elements are dropped independently of each other.
    pairs = dropped.reshape(-1)[: dropped.size // 2 * 2].reshape(-1, 2)
    assert_fraction_near(pairs.all(axis=1).mean(), rate ** 2, len(pairs))


@FAST_PATHS
@pytest.mark.parametrize("rate", [0.1, 0.3, 0.6])
def test_dropout_gradient_is_the_same_mask(rng, value_and_gradients, rate, fast_paths):
    layer = dropout(rate, fast_paths, seed=5)
    x = inputs_without_zeros(rng, (37, 129))
    upstream = rng.normal(size=x.shape).astype("float32")

    def loss(x):
        outputs = layer(x, training=True)
        return ops.sum(outputs * upstream), outputs

    outputs, (gradient,) = value_and_gradients(loss, [x])
    outputs, gradient = np.asarray(outputs), np.asarray(gradient)
    dropped = outputs == 0
    assert_fraction_near(dropped.mean(), rate, dropped.size)
    np.testing.assert_array_equal(gradient[dropped], 0.0)
    np.testing.assert_allclose(gradient[~dropped], upstream[~dropped] / (1 - rate),
                               rtol=SCALE_RTOL["float32"])


@FAST_PATHS
def test_dropout_is_the_identity_outside_training_and_new_in_each_call(rng, fast_paths):
    layer = dropout(0.5, fast_paths, seed=1)
    x = rng.normal(size=(4, 50)).astype("float32")
    np.testing.assert_array_equal(layer(x), x)
    np.testing.assert_array_equal(layer(x, training=False), x)
    np.testing.assert_array_equal(dropout(0.0, fast_paths)(x, training=True), x)
    first, second = layer(x, training=True), layer(x, training=True)
    assert not np.array_equal(np.asarray(first) == 0, np.asarray(second) == 0)


@FAST_PATHS
@pytest.mark.parametrize("shape", [(1, 1, 1), (1, 1, 3), (5, 7, 3), (3, 5)])
def test_dropout_of_odd_sizes_keeps_the_shape_and_scales_what_it_keeps(rng, shape, fast_paths):
    x = inputs_without_zeros(rng, shape)
    outputs = np.asarray(dropout(0.25, fast_paths, seed=2)(x, training=True))
    assert outputs.shape == shape
    kept = outputs != 0
    np.testing.assert_allclose(outputs[kept], x[kept] / 0.75, rtol=SCALE_RTOL["float32"])


@FAST_PATHS
@pytest.mark.tensorflow_only("tf.function with dimensions unknown until the graph runs")
def test_dropout_with_unknown_batch_shape(fast_paths):
    import tensorflow as tf

    layer = dropout(0.25, fast_paths, seed=2)
    drop = tf.function(lambda x: layer(x, training=True),
                       input_signature=[tf.TensorSpec((None, None, 3))])
    for shape in [(1, 1, 3), (5, 7, 3), (64, 33, 3)]:
        outputs = drop(tf.ones(shape)).numpy()
        assert outputs.shape == shape
        np.testing.assert_allclose(outputs[outputs != 0], 1 / 0.75, rtol=SCALE_RTOL["float32"])
    dropped = drop(tf.ones((64, 33, 3))).numpy() == 0
    assert_fraction_near(dropped.mean(), 0.25, dropped.size)


@pytest.mark.parametrize("noise_shape", [(300, 1, 40), (None, 1, None)])
@pytest.mark.parametrize("rate", [0.2, 0.5])
def test_dropout_with_noise_shape_shares_the_mask_along_broadcast_axes(rng, noise_shape, rate):
    x = inputs_without_zeros(rng, (300, 6, 40))
    outputs = np.asarray(Dropout(rate, noise_shape=noise_shape, seed=0)(x, training=True))
    dropped = outputs == 0
    # One draw per (batch, channel), shared by the 6 steps of the broadcast axis.
    np.testing.assert_array_equal(dropped, np.broadcast_to(dropped[:, :1], dropped.shape))
    assert_fraction_near(dropped[:, 0].mean(), rate, dropped[:, 0].size)
    np.testing.assert_allclose(outputs[~dropped], x[~dropped] / (1 - rate),
                               rtol=SCALE_RTOL["float32"])


# ---------------------------------------------------------------- Embedding

def test_embedding_scale_zero_row_and_mask(rng):
    ids = padded_ids(rng)
    layer = Embedding(50, 8)
    outputs = np.asarray(layer(ids))
    table = np.asarray(layer.embeddings)
    assert table.shape == (50, 8)
    np.testing.assert_array_equal(table[0], 0.0)
    expected = table[ids] * math.sqrt(8)
    np.testing.assert_allclose(outputs, expected, rtol=1e-6)
    assert np.all(outputs[ids == 0] == 0.0)
    np.testing.assert_array_equal(layer.compute_mask(ids), ids != 0)


def test_embedding_initializer_draws_every_row_but_padding():
    layer = Embedding(10, 4, embeddings_initializer="ones")
    outputs = np.asarray(layer(np.array([[0, 1, 9]])))
    np.testing.assert_array_equal(np.asarray(layer.embeddings)[1:], 1.0)
    np.testing.assert_array_equal(outputs[0], [[0.0] * 4, [2.0] * 4, [2.0] * 4])  # sqrt(4)
    assert layer.get_config()["embeddings_initializer"]["class_name"] == "Ones"


def test_embedding_glorot_uniform_range():
    layer = Embedding(1000, 64)
    layer.build(None)
    limit = math.sqrt(6.0 / (1000 + 64))
    table = np.asarray(layer.embeddings)
    assert np.abs(table).max() <= limit
    assert np.abs(table).max() > 0.9 * limit


def test_embedding_attend_is_matmul_with_table(rng):
    layer = Embedding(20, 6)
    layer.build(None)
    x = rng.normal(size=(2, 3, 6)).astype("float32")
    np.testing.assert_allclose(layer.attend(x), x @ np.asarray(layer.embeddings).T,
                               rtol=1e-5, atol=1e-6)


def test_embedding_with_unit_norm_reads_every_row_at_length_one(rng):
    ids = padded_ids(rng, vocab=20)
    layer = Embedding(20, 6, unit_norm=True)
    outputs = np.asarray(layer(ids))  # (N, T, C)
    table = np.asarray(layer.embeddings)
    lengths = np.linalg.norm(table[1:], axis=-1, keepdims=True)
    units = np.concatenate([table[:1], table[1:] / lengths])  # the padding row stays zero
    np.testing.assert_allclose(outputs, units[ids] * math.sqrt(6), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(outputs[ids == 0], 0.0)
    x = rng.normal(size=(2, 3, 6)).astype("float32")
    np.testing.assert_allclose(layer.attend(x), x @ units.T, rtol=1e-5, atol=1e-6)
    assert Embedding.from_config(layer.get_config()).unit_norm is True


def test_embedding_pad_row_stays_zero_after_optimizer_steps(value_and_gradients):
    layer = Embedding(12, 4)
    layer.build(None)
    optimizer = keras.optimizers.AdamW(learning_rate=0.1, weight_decay=0.1)
    ids = np.array([[0, 3, 0, 5], [1, 0, 2, 0]])
    counts = np.bincount(ids.reshape(-1), minlength=12)[:, None]  # (V, 1)

    def loss():
        return ops.sum(layer(ids) ** 2) + ops.sum(layer.attend(np.ones((1, 4), "float32"))), None

    for _ in range(5):
        table = np.asarray(layer.embeddings)
        _, (gradient,) = value_and_gradients(loss, [], layer.trainable_variables)
        # The loss is sum((sqrt(4) * table[ids])**2) + sum(table @ ones): row r gets
        # 8 * table[r] per lookup of r and 1 from the logits; the padding row nothing.
        expected = 8.0 * counts * table + 1.0
        expected[0] = 0.0
        np.testing.assert_allclose(gradient, expected, rtol=1e-5, atol=1e-6)
        optimizer.apply([gradient], layer.trainable_variables)
    assert np.all(np.asarray(layer(ids))[ids == 0] == 0.0)
    np.testing.assert_array_equal(np.asarray(layer.embeddings)[0], 0.0)


# ------------------------------------------------------- PositionalEncoding

def sinusoid_value(pos, i, d):
    angle = pos / 10000 ** (2 * (i // 2) / d)
    return math.sin(angle) if i % 2 == 0 else math.cos(angle)


def test_interleaved_sinusoid_at_several_positions():
    d = 16
    layer = PositionalEncoding(maxlen=60, num_units=d)
    ids = np.ones((1, 60), dtype="int32")
    table = np.asarray(layer(ids))[0]
    for pos in (0, 1, 7, 33, 59):
        for i in (0, 1, 2, 3, 10, 11, 14, 15):
            assert table[pos, i] == pytest.approx(sinusoid_value(pos, i, d), abs=1e-6)


def test_concat_sinusoid_is_tensor2tensor_layout():
    d = 8
    layer = PositionalEncoding(maxlen=30, num_units=d, style="concat")
    table = np.asarray(layer(np.ones((1, 30), "int32")))[0]
    timescales = d // 2
    increment = math.log(10000) / (timescales - 1)
    for pos in (0, 3, 29):
        for j in range(timescales):
            scaled = pos * math.exp(-j * increment)
            assert table[pos, j] == pytest.approx(math.sin(scaled), abs=1e-6)
            assert table[pos, timescales + j] == pytest.approx(math.cos(scaled), abs=1e-6)


def test_sinusoid_is_not_trainable_and_learned_table_is():
    fixed = PositionalEncoding(maxlen=10, num_units=4)
    fixed(np.ones((1, 3), "int32"))
    assert fixed.trainable_weights == []
    learned = PositionalEncoding(maxlen=10, num_units=4, sinusoid=False)
    outputs = np.asarray(learned(np.ones((2, 3), "int32")))
    assert [w.shape for w in learned.trainable_weights] == [(10, 4)]
    np.testing.assert_allclose(outputs[1], np.asarray(learned.position_embeddings)[:3])


def test_encoding_masks_padding_from_ids_and_from_keras_mask(rng):
    ids = padded_ids(rng)
    from_ids = np.asarray(PositionalEncoding(maxlen=10, num_units=8)(ids))
    table = np.array([[sinusoid_value(pos, i, 8) for i in range(8)] for pos in range(7)])
    expected = np.where((ids != 0)[..., None], table[None], 0.0)
    np.testing.assert_allclose(from_ids, expected, atol=1e-6)
    embedded = Embedding(50, 8)(ids)  # carries the Keras mask ids != 0
    from_mask = np.asarray(PositionalEncoding(maxlen=10)(embedded))
    np.testing.assert_array_equal(from_mask, from_ids)


def test_encoding_longer_than_maxlen_names_both_numbers():
    layer = PositionalEncoding(maxlen=4, num_units=6)
    with pytest.raises(ValueError, match=r"length 5.*maxlen=4"):
        layer(np.ones((1, 5), "int32"))


# ------------------------------------------------------- MultiHeadAttention

def attention_inputs(rng, n=3, t_q=5, t_k=6, c=8):
    queries = rng.normal(size=(n, t_q, c)).astype("float32")
    keys = rng.normal(size=(n, t_k, c)).astype("float32")
    query_mask = np.ones((n, t_q), bool)
    query_mask[1, 3:] = False
    key_mask = np.ones((n, t_k), bool)
    key_mask[0, 4:] = False
    key_mask[2, 1:] = False
    return queries, keys, query_mask, key_mask


@pytest.mark.parametrize("causality", [False, True])
@pytest.mark.parametrize("activation", [None, "relu"])
def test_attention_matches_numpy_from_its_own_kernels(rng, causality, activation):
    queries, keys, query_mask, key_mask = attention_inputs(rng, t_k=5)
    layer = MultiHeadAttention(num_heads=2, causality=causality,
                               projection_activation=activation)
    outputs, weights, _ = layer(queries, keys, query_mask=query_mask, key_mask=key_mask)
    expected, expected_weights = reference.multihead_attention(
        layer, queries, keys, query_mask, key_mask, causality, activation)
    assert weights.shape == (3, 2, 5, 5)
    np.testing.assert_allclose(weights, expected_weights, atol=1e-5)
    np.testing.assert_allclose(outputs, expected, atol=1e-4)


@pytest.mark.parametrize("use_bias,activation", [(True, None), (False, "relu")])
def test_every_projection_equals_its_dense(rng, use_bias, activation):
    # The one projection path (side-by-side kernels) computes what each Dense does.
    queries, keys, _, _ = attention_inputs(rng)
    layer = MultiHeadAttention(num_heads=2, use_bias=use_bias, projection_activation=activation)
    layer.build(queries.shape, keys.shape)
    if use_bias:
        for dense in (layer.query_dense, layer.key_dense, layer.value_dense):
            dense.bias.assign(rng.normal(size=8))

    def heads(x):  # (N, T, C) -> (N, h, T, d_k)
        return np.asarray(x).reshape(x.shape[0], x.shape[1], 2, 4).transpose(0, 2, 1, 3)

    expected = [heads(dense(inputs)) for dense, inputs in
                [(layer.query_dense, queries), (layer.key_dense, queries),
                 (layer.value_dense, queries), (layer.key_dense, keys),
                 (layer.value_dense, keys)]]
    self_heads = project_heads(queries, (layer.query_dense, layer.key_dense, layer.value_dense),
                               2, "float32")
    got = [*self_heads, *layer.project_keys_values(keys)]
    for got_heads, expected_heads in zip(got, expected):
        np.testing.assert_allclose(got_heads, expected_heads, rtol=1e-6, atol=1e-6)
    for got_heads, expected_heads in zip(layer.project_keys_values(keys, keys), expected[3:]):
        np.testing.assert_allclose(got_heads, expected_heads, rtol=1e-6, atol=1e-6)


def test_attention_with_output_projection_matches_numpy(rng):
    queries, keys, query_mask, key_mask = attention_inputs(rng)
    layer = MultiHeadAttention(num_heads=4, output_projection=True)
    outputs, _, _ = layer(queries, keys, query_mask=query_mask, key_mask=key_mask)
    assert layer.query_dense.kernel.shape == layer.output_dense.kernel.shape == (8, 8)
    expected, _ = reference.multihead_attention(layer, queries, keys, query_mask, key_mask)
    np.testing.assert_allclose(outputs, expected, atol=1e-4)


def test_masked_keys_get_zero_weight_and_their_content_is_ignored(rng):
    queries, keys, query_mask, key_mask = attention_inputs(rng)
    layer = MultiHeadAttention(num_heads=2)
    outputs, weights, _ = layer(queries, keys, key_mask=key_mask)
    weights = np.asarray(weights)
    assert np.all(weights.transpose(0, 2, 1, 3)[~key_mask[:, None, None, :].repeat(5, 1)
                                                .repeat(2, 2)] == 0.0)
    changed = keys.copy()
    changed[~key_mask] = rng.normal(size=changed[~key_mask].shape) * 100
    np.testing.assert_array_equal(layer(queries, changed, key_mask=key_mask)[0], outputs)


def test_causality_hides_the_future(rng):
    x = rng.normal(size=(2, 6, 8)).astype("float32")
    layer = MultiHeadAttention(num_heads=2, causality=True)
    outputs, weights, _ = layer(x)
    assert np.all(np.triu(np.ones((6, 6)), k=1)[None, None] * np.asarray(weights) == 0.0)
    changed = x.copy()
    changed[:, 4:] = rng.normal(size=(2, 2, 8)) * 10
    np.testing.assert_allclose(np.asarray(layer(changed)[0])[:, :4],
                               np.asarray(outputs)[:, :4], atol=1e-6)


def test_masked_queries_get_all_zero_weights(rng):
    queries, keys, query_mask, _ = attention_inputs(rng)
    layer = MultiHeadAttention(num_heads=2)
    outputs, weights, _ = layer(queries, keys, query_mask=query_mask)
    weights = np.asarray(weights)
    assert np.all(weights[1, :, 3:] == 0.0)
    np.testing.assert_allclose(weights[0].sum(-1), 1.0, atol=1e-6)
    # a masked query's output is then LN(q + 0): the residual alone
    outputs = np.asarray(outputs)
    expected = reference.layer_norm(queries[1, 3:], 1.0, 0.0, layer.epsilon)
    np.testing.assert_allclose(outputs[1, 3:], expected, atol=1e-5)


def test_explicit_masks_equal_keras_masks_in_a_functional_model(rng):
    source = padded_ids(rng)
    target = padded_ids(rng, lengths=(3, 7, 5))
    source_in = keras.Input((None,), dtype="int32")
    target_in = keras.Input((None,), dtype="int32")
    embedding = Embedding(50, 8)
    attention = MultiHeadAttention(num_heads=2)
    implicit, _, _ = attention(embedding(target_in), embedding(source_in))
    model = keras.Model([source_in, target_in], implicit)
    explicit, _, _ = attention(embedding(target), embedding(source),
                               query_mask=target != 0, key_mask=source != 0)
    no_mask, _, _ = attention(embedding(target), embedding(source),
                              query_mask=np.ones_like(target, bool),
                              key_mask=np.ones_like(source, bool))
    np.testing.assert_array_equal(model([source, target]), explicit)
    assert not np.allclose(explicit, no_mask)


def test_self_attention_takes_the_mask_of_its_queries(rng):
    ids = padded_ids(rng)
    embedded = Embedding(50, 8)(ids)
    layer = MultiHeadAttention(num_heads=2)
    np.testing.assert_array_equal(
        layer(embedded)[0], layer(embedded, query_mask=ids != 0, key_mask=ids != 0)[0])
    everything_seen = layer(embedded, query_mask=np.ones(ids.shape, bool))[0]
    assert not np.allclose(layer(embedded)[0], everything_seen)


@pytest.mark.parametrize("sinusoid", [True, False])
def test_one_positions_encoding_is_that_row_of_the_table(rng, sinusoid):
    """`encoding_at(p)` (a decoding step's) equals row `p` of the encodings `call` adds,
    and is made from that row alone (a step does not rebuild the whole table)."""
    layer = PositionalEncoding(12, 6, sinusoid=sinusoid)
    ids = rng.integers(1, 50, size=(1, 12)).astype("int32")
    table = np.asarray(layer(ids))[0]  # (T, C), every position present
    rows = [np.asarray(layer.encoding_at(ops.convert_to_tensor(p)))[0] for p in range(12)]
    np.testing.assert_array_equal(np.stack(rows), table)

    def whole_table(length):
        raise AssertionError(f"encoding_at built the table of {length} positions")

    layer._table = whole_table
    np.testing.assert_array_equal(np.asarray(layer.encoding_at(3))[0], table[3])


@pytest.mark.parametrize("norm_position", ["post", "pre"])
def test_self_attention_is_told_by_keys_none_not_by_identity(rng, norm_position):
    """`mha(x)` attends over `x` itself (normalized in pre-norm); `mha(x, keys)` over `keys`
    as given, whether or not they are the queries' tensor."""
    x = ops.convert_to_tensor(rng.normal(size=(2, 5, 8)).astype("float32"))
    v = ops.convert_to_tensor(rng.normal(size=(2, 5, 8)).astype("float32"))
    layer = MultiHeadAttention(num_heads=2, norm_position=norm_position)
    self_attention = np.asarray(layer(x)[0])
    keys = layer.norm(x) if norm_position == "pre" else x  # what self-attention attends over
    np.testing.assert_allclose(layer(x, keys)[0], self_attention, atol=1e-6)
    if norm_position == "pre":
        assert not np.allclose(layer(x, x)[0], self_attention, atol=1e-3)
    given = np.asarray(layer(x, x, v)[0])
    assert not np.allclose(given, np.asarray(layer(x, x)[0]))
    np.testing.assert_array_equal(layer(x, ops.copy(x), v)[0], given)
    with pytest.raises(ValueError, match="`values` need `keys`"):
        layer(x, values=v)


def test_returned_keys_and_values_are_the_next_steps_cache(rng):
    x = ops.convert_to_tensor(rng.normal(size=(2, 5, 8)).astype("float32"))
    layer = MultiHeadAttention(num_heads=2, causality=True)
    whole, weights, (k, v) = layer(x)
    assert k.shape == v.shape == (2, 2, 5, 4)
    _, _, prefix = layer(x[:, :3])
    step, step_weights, grown = layer(x[:, 3:4], cache=prefix)
    np.testing.assert_allclose(step[:, 0], whole[:, 3], atol=1e-5)
    np.testing.assert_allclose(step_weights[:, :, 0], weights[:, :, 3, :4], atol=1e-6)
    np.testing.assert_allclose(grown[0], k[:, :, :4], atol=1e-6)
    memory = ops.convert_to_tensor(rng.normal(size=(2, 6, 8)).astype("float32"))
    cross = MultiHeadAttention(num_heads=2)
    expected, _, projected = cross(x, memory)
    outputs, _, cache = cross(x, memory, cache=projected)  # the memory's, projected once
    for got, given in zip(cache, projected):
        np.testing.assert_array_equal(got, given)
    np.testing.assert_allclose(outputs, expected, atol=1e-6)


@pytest.mark.parametrize("policy", ["float32", "mixed_float16", "mixed_bfloat16"])
def test_fully_masked_row_is_finite(rng, value_and_gradients, policy):
    keras.config.set_dtype_policy(policy)
    queries, keys, _, _ = attention_inputs(rng)
    key_mask = np.zeros((3, 6), bool)
    key_mask[1] = True
    layer = MultiHeadAttention(num_heads=2, causality=True)
    outputs, weights, _ = layer(queries * 50, keys * 50, key_mask=key_mask)
    assert outputs.dtype == keras.config.dtype_policy().compute_dtype
    outputs = np.asarray(keras.ops.cast(outputs, "float32"))
    weights = np.asarray(keras.ops.cast(weights, "float32"))
    assert np.all(np.isfinite(outputs)) and np.all(np.isfinite(weights))
    assert np.all(weights[[0, 2]] == 0.0)

    # the gradients stay finite too (a NaN hidden behind `where` still poisons them)
    def total(queries):
        outputs, _, _ = layer(queries, keys * 50, key_mask=key_mask)
        return ops.sum(ops.cast(outputs, "float32")), None

    _, gradients = value_and_gradients(total, [queries * 50], layer.trainable_variables)
    assert len(gradients) == 1 + len(layer.trainable_variables)
    assert all(np.all(np.isfinite(np.asarray(ops.cast(g, "float32")))) for g in gradients)


def float16_attention_reference(q, k, v, mask=None):
    """``(outputs, weights)`` of float16 `q`, `k`, `v` `(N, h, T, d_k)` in float64, hidden keys
    (`mask` False) at weight 0, a query that sees no key at all-zero weights."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    scores = q @ k.swapaxes(-1, -2) / np.sqrt(q.shape[-1])
    mask = np.ones(scores.shape, bool) if mask is None else np.broadcast_to(mask, scores.shape)
    weights = np.where(mask, reference.softmax(np.where(mask, scores, -1e30)), 0.0)
    return weights @ v, weights


def test_float16_attention_forms_no_product_above_its_largest_number(rng, value_and_gradients):
    """Queries of +-16 and keys of about 64 (d_k 64) have products q.k about +-65600, beyond
    float16's 65504; their scores, 8 times smaller, are not. The numbers are chosen so that
    float16 holds every partial sum exactly (multiples of 8 below 16384): the outputs, weights
    and gradients equal float64's to float16's rounding. Scores tie at the top (three keys at
    8208) and lie 8 apart, so the weights are far from one-hot."""
    signs = rng.choice([-1.0, 1.0], size=(1, 2, 1, 64))  # (N, h, 1, d_k), a sign per head
    q = np.concatenate([16 * signs, -16 * signs], axis=2)  # (1, 2, 2, 64)
    steps = rng.integers(-3, 4, size=(1, 2, 5, 64))
    steps[..., -1] = np.array([2, 2, 1, 2, 0]) - steps[..., :-1].sum(-1)
    k = signs * (64 + 4 * steps)  # scores 8192 + 8 * [2, 2, 1, 2, 0], exactly
    v = rng.uniform(-1, 1, size=(1, 2, 5, 16))
    q, k, v = (x.astype("float16") for x in (q, k, v))
    assert np.all(np.abs(q.astype(np.float64) @ k.astype(np.float64).swapaxes(-1, -2)) > 65504)
    upstream = rng.normal(size=(1, 2, 2, 16)).astype("float32")
    keras.config.set_dtype_policy("float16")  # the layer and its dropout
    layer = ScaledDotProductAttention()

    def loss(q, k, v):
        outputs, weights = layer(q, k, v)
        return ops.sum(ops.cast(outputs, "float32") * upstream), (outputs, weights)

    (outputs, weights), gradients = value_and_gradients(loss, [q, k, v])
    assert outputs.dtype == weights.dtype == "float16"
    expected, expected_weights = float16_attention_reference(q, k, v)
    np.testing.assert_allclose(np.asarray(weights, np.float64), expected_weights, atol=1e-3)
    np.testing.assert_allclose(np.asarray(outputs, np.float64), expected, atol=2e-3)
    # d outputs / d (q, k, v) of float64, through the softmax's Jacobian
    q64, k64, v64 = (np.asarray(x, np.float64) for x in (q, k, v))
    weights_grad = upstream @ v64.swapaxes(-1, -2)  # (1, 2, 2, 5)
    scores_grad = expected_weights * (
        weights_grad - (weights_grad * expected_weights).sum(-1, keepdims=True)) / 8
    for got, want in zip(gradients, [scores_grad @ k64, scores_grad.swapaxes(-1, -2) @ q64,
                                     expected_weights.swapaxes(-1, -2) @ upstream]):
        got = np.asarray(ops.cast(got, "float32"), np.float64)
        np.testing.assert_allclose(got, want, atol=1e-2 * np.abs(want).max())


def test_float16_masking_hides_a_key_beside_the_largest_scores(rng, value_and_gradients):
    """Scores near float16's largest (+-61440 of 65504): a hidden key scored 61440 beside kept
    ones of 1024 and 1023 gets weight 0 (a float16 bias of -3e4 left it 31440, the row's
    largest), and a query that sees no key, all its scores -61440, gets zero weights, finite
    outputs and gradients (-61440 - 3e4 overflowed to -inf in float16, its softmax NaN)."""
    q = np.full((2, 1, 1, 64), 16.0)  # (N, h, T_q, d_k): scaled to 2
    k = np.stack([np.stack([np.full(64, 480.0), np.full(64, 8.0), np.full(64, 8.0)]),
                  np.full((3, 64), -480.0)])[:, None]  # (N, h, T_k, d_k)
    k[0, 0, 2, 0] = 7.5  # scores [61440, 1024, 1023] and [-61440] * 3
    v = rng.uniform(-1, 1, size=(2, 1, 3, 8))
    q, k, v = (x.astype("float16") for x in (q, k, v))
    mask = np.array([[False, True, True], [False, False, False]])[:, None, None]  # (N, 1, 1, T_k)
    keras.config.set_dtype_policy("float16")  # the layer and its dropout
    layer = ScaledDotProductAttention()

    def loss(q, k, v):
        outputs, weights = layer(q, k, v, mask)
        return ops.sum(ops.cast(outputs, "float32")), (outputs, weights)

    (outputs, weights), gradients = value_and_gradients(loss, [q, k, v])
    assert outputs.dtype == weights.dtype == "float16"
    weights = np.asarray(weights, np.float64)
    expected, expected_weights = float16_attention_reference(q, k, v, mask)
    assert weights[0, 0, 0, 0] == 0.0 and np.all(weights[1] == 0.0)
    np.testing.assert_allclose(weights, expected_weights, atol=1e-3)
    np.testing.assert_allclose(expected_weights[0, 0, 0, 1:], [0.7311, 0.2689], atol=1e-4)
    np.testing.assert_allclose(np.asarray(outputs, np.float64), expected, atol=2e-3)
    assert all(np.all(np.isfinite(np.asarray(ops.cast(g, "float32")))) for g in gradients)


def test_attention_dropout_only_in_training(rng):
    queries, keys, _, _ = attention_inputs(rng)
    layer = MultiHeadAttention(num_heads=2, dropout_rate=0.5)
    inference = [np.asarray(layer(queries, keys)[0]) for _ in range(2)]
    np.testing.assert_array_equal(inference[0], inference[1])
    np.testing.assert_array_equal(inference[0], layer(queries, keys, training=False)[0])
    _, inference_weights, _ = layer(queries, keys)
    trained, weights, _ = layer(queries, keys, training=True)
    assert not np.allclose(trained, inference[0])
    # The returned weights are those before dropout: the same as in inference.
    np.testing.assert_allclose(weights, inference_weights, rtol=1e-6, atol=1e-7)


def test_residual_dropout_only_in_training_and_after_the_attention(rng):
    queries, keys, _, _ = attention_inputs(rng)
    layer = MultiHeadAttention(num_heads=2, residual_dropout_rate=0.5)
    inference, inference_weights, _ = layer(queries, keys)
    np.testing.assert_array_equal(inference, layer(queries, keys, training=False)[0])
    trained, weights, _ = layer(queries, keys, training=True)
    assert not np.allclose(trained, inference)
    np.testing.assert_array_equal(weights, inference_weights)  # the attention itself is kept


@pytest.mark.parametrize("cross", [False, True])
def test_pre_norm_attention_matches_numpy(rng, cross):
    queries, keys, query_mask, key_mask = attention_inputs(rng, t_k=5)
    if not cross:
        keys, key_mask = None, query_mask
    layer = MultiHeadAttention(num_heads=2, norm_position="pre", causality=not cross)
    layer.build(queries.shape, None if keys is None else keys.shape)
    # Weights away from their ones/zeros start, so that a missing or
    # misplaced normalization shows.
    layer.norm.gamma.assign(rng.uniform(0.5, 1.5, size=8))
    layer.norm.beta.assign(rng.normal(size=8))
    outputs, weights, _ = layer(queries, keys, query_mask=query_mask, key_mask=key_mask)
    expected, expected_weights = reference.multihead_attention(
        layer, queries, keys, query_mask, key_mask, causality=not cross, norm_position="pre")
    np.testing.assert_allclose(weights, expected_weights, atol=1e-5)
    np.testing.assert_allclose(outputs, expected, atol=1e-4)


def test_attention_rejects_bad_sizes():
    # The width is known at build: the heads are checked there.
    with pytest.raises(ValueError, match=r"`d_model` \(8\) must be divisible by `num_heads` \(3\)"):
        MultiHeadAttention(num_heads=3)(np.zeros((1, 2, 8), "float32"))
    with pytest.raises(ValueError, match="`num_heads` must be positive"):
        MultiHeadAttention(num_heads=0)(np.zeros((1, 2, 8), "float32"))
    with pytest.raises(ValueError, match="norm_position"):
        MultiHeadAttention(norm_position="middle")


# -------------------------------------------------------------- FeedForward

@pytest.mark.parametrize("activation", ["relu", None])
@pytest.mark.parametrize("norm_position", ["post", "pre"])
def test_feedforward_matches_numpy(rng, norm_position, activation):
    x = rng.normal(size=(2, 3, 8)).astype("float32")
    layer = FeedForward((16, 8), norm_position=norm_position, activation=activation)
    outputs = np.asarray(layer(x))
    ln = lambda y: reference.layer_norm(y, 1.0, 0.0, layer.epsilon)  # noqa: E731
    inner = lambda y: reference.dense(  # noqa: E731
        layer.outer_dense, reference.dense(layer.inner_dense, y, activation))
    expected = ln(x + inner(x)) if norm_position == "post" else x + inner(ln(x))
    np.testing.assert_allclose(outputs, expected, atol=1e-5)
    assert layer.inner_dense.kernel.shape == (8, 16)


@pytest.mark.parametrize("norm_position", ["post", "pre"])
def test_feedforward_with_scale_norm_matches_numpy(rng, norm_position):
    x = rng.normal(size=(2, 3, 8)).astype("float32")
    layer = FeedForward((16, 8), norm_position=norm_position, norm_type="scale")
    layer.build(x.shape)
    layer.norm.gain.assign(1.7)
    sn = lambda y: reference.scale_norm(y, 1.7, layer.epsilon)  # noqa: E731
    inner = lambda y: reference.dense(  # noqa: E731
        layer.outer_dense, reference.dense(layer.inner_dense, y, "relu"))
    expected = sn(x + inner(x)) if norm_position == "post" else x + inner(sn(x))
    np.testing.assert_allclose(layer(x), expected, atol=1e-5)
    assert FeedForward.from_config(layer.get_config()).norm_type == "scale"


def test_feedforward_dropout_only_in_training(rng):
    x = rng.normal(size=(2, 3, 8)).astype("float32")
    layer = FeedForward((16, 8), dropout_rate=0.5)
    np.testing.assert_array_equal(layer(x), layer(x, training=False))
    assert not np.allclose(layer(x, training=True), layer(x))


def test_feedforward_outer_width_must_match_input():
    with pytest.raises(ValueError, match="outer width"):
        FeedForward((16, 4))(np.zeros((1, 2, 8), "float32"))


# ---------------------------------------------------------- label_smoothing

def test_label_smoothing_docstring_example():
    inputs = np.array([[[0, 0, 1], [0, 1, 0], [1, 0, 0]],
                       [[1, 0, 0], [1, 0, 0], [0, 1, 0]]], "float32")
    expected = np.where(inputs == 1, 0.93333334, 0.03333334)
    np.testing.assert_allclose(label_smoothing(inputs), expected, rtol=1e-6)


# ------------------------------------------------------------------- Blocks

def test_encoder_block_is_attention_then_feedforward(rng):
    ids = padded_ids(rng)
    x = np.asarray(Embedding(50, 8)(ids))
    block = EncoderBlock(num_heads=2, d_ff=16)
    outputs = np.asarray(block(x, mask=ids != 0))
    attended, _, _ = block.self_attention(x, query_mask=ids != 0, key_mask=ids != 0)
    np.testing.assert_allclose(outputs, block.feed_forward(attended), atol=1e-6)
    changed = x.copy()
    changed[ids == 0] = 42.0  # padding content cannot leak into real positions
    np.testing.assert_allclose(np.asarray(block(changed, mask=ids != 0))[ids != 0],
                               outputs[ids != 0], atol=1e-5)


def test_decoder_block_masks_future_and_source_padding(rng):
    source = padded_ids(rng)
    memory = rng.normal(size=(3, 7, 8)).astype("float32")
    target = rng.normal(size=(3, 5, 8)).astype("float32")
    block = DecoderBlock(num_heads=2, d_ff=16)
    outputs, weights, coverage = block(target, memory, memory_mask=source != 0,
                                       return_attention_scores=True)
    assert weights.shape == (3, 2, 5, 7) and coverage.shape == (3, 5, 7)
    np.testing.assert_allclose(coverage, np.asarray(weights).mean(1), atol=1e-6)
    assert np.all(np.asarray(coverage)[source[:, None, :].repeat(5, 1) == 0] == 0.0)
    changed_memory = memory.copy()
    changed_memory[source == 0] = 99.0
    changed_target = target.copy()
    changed_target[:, 3:] = -7.0
    again = block(changed_target, changed_memory, memory_mask=source != 0)
    np.testing.assert_allclose(np.asarray(again)[:, :3], np.asarray(outputs)[:, :3], atol=1e-5)


def test_decoder_block_takes_keras_masks(rng):
    source, target = padded_ids(rng), padded_ids(rng, lengths=(2, 5, 7))
    embedding = Embedding(50, 8)
    block = DecoderBlock(num_heads=2, d_ff=16)
    implicit = block(embedding(target), embedding(source))
    explicit = block(np.asarray(embedding(target)), np.asarray(embedding(source)),
                     mask=target != 0, memory_mask=source != 0)
    np.testing.assert_array_equal(implicit, explicit)


def test_block_dropout_only_in_training(rng):
    x = rng.normal(size=(2, 4, 8)).astype("float32")
    block = EncoderBlock(num_heads=2, d_ff=16, dropout_rate=0.3)
    np.testing.assert_array_equal(block(x), block(x, training=False))
    assert not np.allclose(block(x, training=True), block(x))


# ----------------------------------------------------------- implicit masks

def apply_layer(kind, layer, target, source, target_mask=None, source_mask=None):
    """`layer` on target (and source) states, with the masks given (None: the Keras masks)."""
    if kind == "self_attention":
        return layer(target, query_mask=target_mask, key_mask=target_mask)[0]
    if kind == "cross_attention":
        return layer(target, source, query_mask=target_mask, key_mask=source_mask)[0]
    if kind == "encoder_block":
        return layer(target, mask=target_mask)
    return layer(target, source, mask=target_mask, memory_mask=source_mask)


MASKED_LAYERS = {
    "self_attention": lambda: MultiHeadAttention(num_heads=2),
    "cross_attention": lambda: MultiHeadAttention(num_heads=2),
    "encoder_block": lambda: EncoderBlock(num_heads=2, d_ff=16),
    "decoder_block": lambda: DecoderBlock(num_heads=2, d_ff=16),
}


@pytest.mark.parametrize("mode", ["eager", "compiled"])
@pytest.mark.parametrize("kind", list(MASKED_LAYERS))
def test_implicit_masks_of_layers_called_directly(rng, compiled, kind, mode):
    # Outside a functional model the Keras mask travels on the tensors
    # themselves, and a compiled function's tensors (JAX tracers) cannot hold
    # it as an attribute: Keras keeps it aside, and the layers must find it there.
    source, target = padded_ids(rng), padded_ids(rng, lengths=(3, 7, 5))
    embedding, encoding, add = Embedding(50, 8), PositionalEncoding(maxlen=10), keras.layers.Add()
    layer = MASKED_LAYERS[kind]()

    def embed(ids):  # the Keras mask ids != 0 passes from Embedding through the sum
        embedded = embedding(ids)
        return add([embedded, encoding(embedded)])

    # Plain arrays: they carry no Keras mask, only the masks passed explicitly count.
    target_states, source_states = np.asarray(embed(target)), np.asarray(embed(source))
    apply_layer(kind, layer, target_states, source_states)  # builds the layer eagerly
    run = compiled if mode == "compiled" else (lambda fn: fn)
    implicit = run(lambda target, source: apply_layer(kind, layer, embed(target), embed(source)))
    explicit = run(lambda *args: apply_layer(kind, layer, *args))
    with_masks = np.asarray(explicit(target_states, source_states, target != 0, source != 0))
    without_masks = np.asarray(explicit(target_states, source_states, np.ones(target.shape, bool),
                                        np.ones(source.shape, bool)))
    np.testing.assert_allclose(implicit(target, source), with_masks, rtol=1e-6, atol=1e-6)
    assert not np.allclose(with_masks, without_masks, atol=1e-3)


def test_output_shapes_are_given_without_a_call_as_wrappers_ask(rng):
    # keras.layers.TimeDistributed and other wrappers ask `compute_output_shape` before any call.
    ids = padded_ids(rng)
    embedding = Embedding(50, 8)
    assert embedding.compute_output_shape(ids.shape) == ids.shape + (8,)
    for layer in (FeedForward(num_units=(16, 8)), EncoderBlock(num_heads=2, d_ff=16)):
        assert tuple(layer.compute_output_shape((3, 7, 8))) == (3, 7, 8)
    wrapped = keras.layers.TimeDistributed(FeedForward(num_units=(16, 8)))
    assert tuple(wrapped(np.zeros((2, 3, 5, 8), "float32")).shape) == (2, 3, 5, 8)
