"""The fast paths compute what Keras' own layers compute: the switch changes speed, not results."""

import contextlib
import inspect
import math

import keras
import numpy as np
import pytest
from keras import ops

from kyu_transformer import fast_paths
from kyu_transformer.conventions import LAYER_NORM_EPSILON
from kyu_transformer.layers import Dropout, EncoderBlock, Normalize, set_fast_paths
from kyu_transformer.losses import LabelSmoothedCrossEntropy
from kyu_transformer.model import Transformer


@contextlib.contextmanager
def switched(on):
    """Sets the global switch to `on` for the layers made inside the block, then back on."""
    fast_paths.set_enabled(on)
    try:
        yield
    finally:
        fast_paths.set_enabled(True)


# ------------------------------------------------------------------ layer norm


def normalize_gradients(value_and_gradients, layer, x, upstream):
    """Gradients of ``sum(upstream * layer(x))`` with respect to x, gamma and beta."""
    def loss(x):
        return ops.sum(ops.cast(layer(x), "float32") * upstream), None

    return value_and_gradients(loss, [x], [layer.gamma, layer.beta])[1]


def normalize_pair(shape, fast=True, **kwargs):
    """`Normalize` (made with the switch `fast`) and Keras' `LayerNormalization`, same weights."""
    with switched(fast):
        ours = Normalize(**kwargs)
    assert ours.fast_paths is fast
    keras_layer = keras.layers.LayerNormalization(epsilon=ours.epsilon, dtype=ours.dtype_policy)
    for layer in (ours, keras_layer):
        layer.build(shape)
        layer.gamma.assign(np.linspace(0.5, 1.5, shape[-1]))
        layer.beta.assign(np.linspace(-1, 1, shape[-1]))
    return ours, keras_layer


@pytest.mark.parametrize("shape", [(2, 5, 8), (3, 16)])
def test_normalize_gradient_equals_automatic_differentiation(rng, value_and_gradients, shape):
    # The stated gradient against Keras' LayerNormalization differentiated by the backend.
    x = (rng.normal(size=shape) * 3 + 1).astype("float32")
    upstream = rng.normal(size=shape).astype("float32")
    ours, keras_layer = normalize_pair(shape)
    assert ours.fast_paths
    for got, expected in zip(normalize_gradients(value_and_gradients, ours, x, upstream),
                             normalize_gradients(value_and_gradients, keras_layer, x, upstream)):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "mixed_bfloat16"])
def test_normalize_switch_gives_equal_outputs_and_gradients(rng, value_and_gradients, dtype):
    shape = (4, 6, 32)
    x = (rng.normal(size=shape) * 3 + 1).astype("float32")
    upstream = rng.normal(size=shape).astype("float32")
    fast, _ = normalize_pair(shape, dtype=dtype)
    plain, _ = normalize_pair(shape, fast=False, dtype=dtype)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == "float32" else dict(rtol=2e-2, atol=3e-2)
    inputs = ops.cast(x, fast.compute_dtype)
    np.testing.assert_allclose(ops.cast(fast(inputs), "float32"),
                               ops.cast(plain(inputs), "float32"), **tolerance)
    for got, expected in zip(normalize_gradients(value_and_gradients, fast, inputs, upstream),
                             normalize_gradients(value_and_gradients, plain, inputs, upstream)):
        np.testing.assert_allclose(ops.cast(got, "float32"), ops.cast(expected, "float32"),
                                   **tolerance)


def calls_of(monkeypatch, name):
    """The list of calls that `fast_paths.<name>` will record from now on."""
    calls, real = [], getattr(fast_paths, name)

    def counting(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(fast_paths, name, counting)
    return calls


def test_normalize_switch_selects_the_path(rng, monkeypatch):
    calls = calls_of(monkeypatch, "layer_norm")
    x = rng.normal(size=(2, 3, 8)).astype("float32")
    with switched(False):
        plain = Normalize()
    plain(x)
    assert not calls
    Normalize(axis=1)(x)  # another axis: Keras' own, whatever the switch
    assert not calls
    Normalize()(x)
    assert len(calls) == 1


# --------------------------------------------------------------------- dropout


def inputs_without_zeros(rng, shape):
    """Inputs none of which is zero, so that a zero output marks a dropped element."""
    return (rng.uniform(0.5, 2.0, size=shape) * rng.choice([-1.0, 1.0], size=shape)).astype(
        "float32")


def drop_fraction_and_scale(value_and_gradients, layer, x, upstream):
    """Dropped fraction, scale of what is kept, and the gradient's agreement with the mask."""
    def loss(x):
        outputs = layer(x, training=True)
        return ops.sum(outputs * upstream), outputs

    outputs, (gradient,) = value_and_gradients(loss, [x])
    outputs, gradient = np.asarray(outputs), np.asarray(gradient)
    kept = outputs != 0
    scales = outputs[kept] / x[kept]
    # The gradient is the same mask and scale as the forward pass.
    np.testing.assert_allclose(gradient, upstream * np.where(kept, outputs / x, 0.0), rtol=1e-6)
    return 1.0 - kept.mean(), scales


@pytest.mark.parametrize("rate", [0.1, 0.3, 0.6])
def test_dropout_switch_gives_equal_outputs_and_gradients(rng, value_and_gradients, rate):
    x = inputs_without_zeros(rng, (97, 211))
    upstream = rng.normal(size=x.shape).astype("float32")
    fast = Dropout(rate, seed=4)
    with switched(False):
        plain = Dropout(rate, seed=4)
    # Outside training both are the identity.
    for layer in (fast, plain):
        np.testing.assert_array_equal(layer(x), x)
    # In training the random draws differ, the function does not: the same
    # fraction dropped, the same scale on what is kept, the same mask in the gradient.
    fast_dropped, fast_scales = drop_fraction_and_scale(value_and_gradients, fast, x, upstream)
    plain_dropped, plain_scales = drop_fraction_and_scale(value_and_gradients, plain, x,
                                                          upstream)
    bound = 5 * math.sqrt(2 * rate * (1 - rate) / x.size)
    assert abs(fast_dropped - plain_dropped) < bound
    assert abs(fast_dropped - rate) < bound
    np.testing.assert_allclose(fast_scales, 1 / (1 - rate), rtol=1e-4)
    np.testing.assert_allclose(plain_scales, 1 / (1 - rate), rtol=1e-6)


def test_dropout_switch_selects_the_path(rng, monkeypatch):
    calls = calls_of(monkeypatch, "dropout")
    x = rng.normal(size=(4, 8)).astype("float32")
    with switched(False):
        plain = Dropout(0.5)
    plain(x, training=True)
    Dropout(0.5, noise_shape=(4, 1))(x, training=True)  # Keras' own, whatever the switch
    Dropout(0.5)(x)  # not training
    assert not calls
    Dropout(0.5)(x, training=True)
    assert len(calls) == 1


def test_dropout_draws_are_uniform_over_sixteen_bits():
    seed = keras.random.SeedGenerator(3)
    draws = np.asarray(fast_paths._draws((200, 501), seed)).astype(np.int64) + 2 ** 15
    assert draws.min() >= 0 and draws.max() < fast_paths.DRAW_LEVELS
    counts = np.bincount(draws.reshape(-1) // 4096, minlength=16)  # 16 equal bins
    expected = draws.size / 16
    assert np.all(np.abs(counts - expected) < 5 * math.sqrt(expected))


# ------------------------------------------------------------------- the model

SIZE = dict(vocab_size=60, d_model=16, d_ff=32, num_blocks=2, num_heads=2, maxlen1=12,
            maxlen2=12, dropout_rate=0.0)


def training_batch(rng):
    source = rng.integers(4, 60, size=(8, 10))
    source[1, 6:] = 0
    target = rng.integers(4, 60, size=(8, 9))
    target[2, 4:] = 0
    labels = np.concatenate([target[:, 1:], np.zeros((8, 1), target.dtype)], axis=1)
    return {"source": source, "target_in": target}, labels


def twin_models(**size):
    """The same Transformer (same weights) with the fast paths on and off."""
    fast = Transformer(**size)
    with switched(False):
        plain = Transformer(**size)
    fast.build()  # the blocks' layers are made now, with the switch of the block's making
    plain.build()
    plain.set_weights(fast.get_weights())
    return fast, plain


def sub_layers(model):
    return [layer for layer in model._flatten_layers() if isinstance(layer, (Normalize, Dropout))]


@pytest.mark.parametrize("norm_position", ["post", "pre"])
def test_transformer_switch_reaches_every_normalization_and_dropout(norm_position):
    fast, plain = twin_models(**SIZE, norm_position=norm_position)
    assert sub_layers(fast) and len(sub_layers(fast)) == len(sub_layers(plain))
    assert all(layer.fast_paths for layer in sub_layers(fast))
    assert not any(layer.fast_paths for layer in sub_layers(plain))


@pytest.mark.parametrize("norm_position", ["post", "pre"])
def test_transformer_trains_the_same_with_and_without_fast_paths(rng, norm_position):
    features, labels = training_batch(rng)
    models = twin_models(**SIZE, norm_position=norm_position)
    np.testing.assert_allclose(models[0](features), models[1](features), rtol=1e-5, atol=1e-5)
    losses = []
    for model in models:
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss=LabelSmoothedCrossEntropy(0.1),
                      jit_compile=False)
        history = model.fit(features, labels, batch_size=8, epochs=5, shuffle=False, verbose=0)
        losses.append(history.history["loss"])
    assert losses[0][-1] < losses[0][0]  # it trains
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)
    for fast_weight, plain_weight in zip(*(model.get_weights() for model in models)):
        np.testing.assert_allclose(fast_weight, plain_weight, rtol=1e-4, atol=1e-5)


def test_hparams_set_the_switch_of_the_model_they_make():
    for on in (True, False):
        model = Transformer.from_hparams({**SIZE, "fast_paths": on})
        model.build()
        assert {layer.fast_paths for layer in sub_layers(model)} == {on}
    assert fast_paths.enabled()  # restored


def test_a_block_gives_its_sub_layers_the_switch_it_was_made_with():
    with switched(False):
        block = EncoderBlock(num_heads=2, d_ff=16)
    block.build((2, 3, 8))  # the switch is on again: the sub-layers are made now
    assert sub_layers(block) and not any(layer.fast_paths for layer in sub_layers(block))


def test_set_fast_paths_switches_layers_already_made(rng, monkeypatch):
    calls = calls_of(monkeypatch, "layer_norm")
    x = rng.normal(size=(2, 3, 8)).astype("float32")
    block = EncoderBlock(num_heads=2, d_ff=16)
    block(x)
    assert len(calls) == 2  # the attention's norm and the feed-forward's
    assert set_fast_paths(block, False) is block
    block(x)
    assert len(calls) == 2 and not any(layer.fast_paths for layer in sub_layers(block))
    set_fast_paths(block, True)
    block(x)
    assert len(calls) == 4


def test_the_switch_is_on_by_default_and_no_layer_takes_it_as_an_argument():
    from kyu_transformer import layers

    assert fast_paths.enabled()
    for cls in (Transformer, Normalize, Dropout, layers.ScaledDotProductAttention,
                layers.MultiHeadAttention, layers.FeedForward, layers.EncoderBlock,
                layers.DecoderBlock):
        assert "fast_paths" not in inspect.signature(cls).parameters, cls
    assert Normalize().fast_paths and Dropout(0.1).fast_paths
    assert Normalize().epsilon == LAYER_NORM_EPSILON
