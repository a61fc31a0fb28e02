"""LabelSmoothedCrossEntropy against an explicit one-hot computation."""

import keras
import numpy as np
import pytest
from keras.src.backend import set_keras_mask

from kyu_transformer.layers import label_smoothing
from kyu_transformer.losses import LabelSmoothedCrossEntropy


def explicit_loss(labels, logits, epsilon, pad_id=0):
    vocab = logits.shape[-1]
    targets = np.asarray(label_smoothing(np.eye(vocab, dtype="float64")[labels], epsilon))
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    per_token = -(targets * log_probs).sum(-1)
    keep = labels != pad_id
    return per_token[keep].sum() / keep.sum(), np.where(keep, per_token, 0.0)


@pytest.mark.parametrize("fast_paths", [True, False])
@pytest.mark.parametrize("epsilon", [0.0, 0.1, 0.3])
def test_loss_equals_explicit_one_hot_cross_entropy(rng, epsilon, fast_paths):
    labels = rng.integers(1, 11, size=(4, 6))
    labels[0, 3:] = 0
    labels[2, 1:] = 0
    logits = rng.normal(size=(4, 6, 11)) * 3
    loss = LabelSmoothedCrossEntropy(epsilon=epsilon, fast_paths=fast_paths)
    expected, expected_tokens = explicit_loss(labels, logits, epsilon)
    assert float(loss(labels, logits.astype("float32"))) == pytest.approx(expected, rel=1e-5)
    np.testing.assert_allclose(loss.token_losses(labels, logits.astype("float32")),
                               expected_tokens, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fast_paths", [True, False])
@pytest.mark.parametrize("epsilon", [0.0, 0.1])
def test_gradient_equals_softmax_minus_smoothed_targets(rng, epsilon, fast_paths,
                                                        value_and_gradients):
    labels = rng.integers(1, 11, size=(3, 5))
    labels[1, 2:] = 0
    logits = rng.normal(size=(3, 5, 11)) * 3
    keep = labels != 0
    targets = np.asarray(label_smoothing(np.eye(11)[labels], epsilon))
    probabilities = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    expected = (probabilities - targets) * keep[..., None] / keep.sum()  # padding: no gradient
    loss = LabelSmoothedCrossEntropy(epsilon=epsilon, fast_paths=fast_paths)
    _, (gradient,) = value_and_gradients(lambda inputs: (loss(labels, inputs), None),
                                         [logits.astype("float32")])
    np.testing.assert_allclose(gradient, expected, atol=1e-6)


def test_padding_is_ignored_and_other_pad_ids_work(rng):
    labels = np.array([[3, 4, 2, 2]])
    logits = rng.normal(size=(1, 4, 6)).astype("float32")
    loss = LabelSmoothedCrossEntropy(pad_id=2)
    changed = logits.copy()
    changed[0, 2:] = 100.0
    assert float(loss(labels, changed)) == pytest.approx(float(loss(labels, logits)))
    expected, _ = explicit_loss(labels, logits.astype("float64"), 0.1, pad_id=2)
    assert float(loss(labels, logits)) == pytest.approx(expected, rel=1e-5)


def test_probabilities_input(rng):
    labels = rng.integers(1, 5, size=(2, 3))
    logits = rng.normal(size=(2, 3, 5))
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    from_probs = LabelSmoothedCrossEntropy(from_logits=False)(labels, probs.astype("float32"))
    from_logits = LabelSmoothedCrossEntropy()(labels, logits.astype("float32"))
    assert float(from_probs) == pytest.approx(float(from_logits), rel=1e-4)


def test_loss_is_float32_for_bfloat16_logits(rng):
    labels = rng.integers(1, 7, size=(2, 5))
    logits = rng.normal(size=(2, 5, 7)).astype("float32")
    low = keras.ops.cast(logits, "bfloat16")
    value = LabelSmoothedCrossEntropy()(labels, low)
    assert keras.backend.standardize_dtype(value.dtype) == "float32"
    rounded = np.asarray(keras.ops.cast(low, "float32"), dtype="float64")
    assert float(value) == pytest.approx(explicit_loss(labels, rounded, 0.1)[0], rel=1e-5)


def test_loss_config_round_trip():
    loss = LabelSmoothedCrossEntropy(epsilon=0.2, pad_id=1, from_logits=False, reduction="sum")
    again = keras.losses.deserialize(keras.losses.serialize(loss))
    assert (again.epsilon, again.pad_id, again.from_logits) == (0.2, 1, False)
    assert again.reduction == "sum"
    assert again.fast_paths is True
    plain = keras.losses.deserialize(keras.losses.serialize(
        LabelSmoothedCrossEntropy(fast_paths=False)))
    assert plain.fast_paths is False


def test_configs_saved_without_a_reduction_load_with_the_mean(rng):
    # Earlier versions left `reduction` out of their config.
    config = {"name": "label_smoothed_cross_entropy", "epsilon": 0.2, "pad_id": 0,
              "from_logits": True}
    loss = LabelSmoothedCrossEntropy.from_config(config)
    assert loss.reduction == "sum_over_batch_size"
    assert loss.fast_paths is True  # nor `fast_paths`: the stated gradient
    labels = np.array([[3, 4, 0]])
    logits = rng.normal(size=(1, 3, 6)).astype("float32")
    expected, _ = explicit_loss(labels, logits.astype("float64"), 0.2)
    assert float(loss(labels, logits)) == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("dtype, atol", [("float32", 1e-6), ("bfloat16", 4e-3)])
def test_fast_paths_switch_keeps_the_value_and_the_gradient(rng, dtype, atol, value_and_gradients):
    """The stated gradient (on) and automatic differentiation (off) agree."""
    labels = rng.integers(1, 40, size=(3, 6))
    labels[1, 3:] = 0
    logits = keras.ops.cast(rng.normal(size=(3, 6, 40)) * 3, dtype)
    results = {}
    for fast_paths in (True, False):
        loss = LabelSmoothedCrossEntropy(0.1, fast_paths=fast_paths)
        value, (gradient,) = value_and_gradients(
            lambda inputs, loss=loss: (loss(labels, inputs),) * 2, [logits])
        results[fast_paths] = (float(value), np.asarray(keras.ops.cast(gradient, "float32")))
    assert results[True][0] == pytest.approx(results[False][0], rel=1e-6)
    np.testing.assert_allclose(results[True][1], results[False][1], atol=atol)
    assert np.all(results[False][1][1, 3:] == 0) and np.abs(results[False][1]).sum() > 0


def test_loss_rejects_bad_epsilon():
    with pytest.raises(ValueError, match="epsilon"):
        LabelSmoothedCrossEntropy(epsilon=1.0)


def masked(logits, mask):
    """`logits` as a tensor carrying the Keras mask `mask`, as a layer's output does."""
    tensor = keras.ops.convert_to_tensor(logits)
    set_keras_mask(tensor, keras.ops.convert_to_tensor(mask))
    return tensor


def test_logits_with_a_keras_mask_give_the_same_scalar(rng):
    labels = rng.integers(1, 9, size=(3, 6))
    labels[0, 4:] = 0
    labels[1, 2:] = 0
    logits = (rng.normal(size=(3, 6, 9)) * 2).astype("float32")
    loss = LabelSmoothedCrossEntropy()
    plain = loss(labels, logits)
    with_mask = loss(labels, masked(logits, labels != 0))
    assert tuple(with_mask.shape) == ()
    expected, _ = explicit_loss(labels, logits.astype("float64"), 0.1)
    assert float(with_mask) == pytest.approx(float(plain), rel=1e-6)
    assert float(with_mask) == pytest.approx(expected, rel=1e-5)


def test_a_mask_of_the_logits_and_the_padding_of_the_labels_combine(rng):
    labels = rng.integers(1, 9, size=(2, 5))
    labels[0, 3:] = 0
    logits = rng.normal(size=(2, 5, 9)).astype("float32")
    mask = np.ones((2, 5), dtype=bool)
    mask[1, 0] = False  # a real label that the logits' own mask leaves out
    value = LabelSmoothedCrossEntropy()(labels, masked(logits, mask))
    _, per_token = explicit_loss(labels, logits.astype("float64"), 0.1)
    keep = (labels != 0) & mask
    assert float(value) == pytest.approx(per_token[keep].sum() / keep.sum(), rel=1e-5)


def test_reductions_mean_what_keras_says(rng):
    labels = rng.integers(1, 7, size=(3, 5))
    labels[2, 1:] = 0
    logits = rng.normal(size=(3, 5, 7)).astype("float32")
    _, per_token = explicit_loss(labels, logits.astype("float64"), 0.1)
    tokens = (labels != 0).sum()
    none = LabelSmoothedCrossEntropy(reduction="none")(labels, logits)
    assert tuple(none.shape) == (3, 5)
    np.testing.assert_allclose(none, per_token, rtol=1e-5, atol=1e-6)
    total = LabelSmoothedCrossEntropy(reduction="sum")(labels, logits)
    assert float(total) == pytest.approx(per_token.sum(), rel=1e-5)
    weights = np.array([[1.0], [2.0], [0.5]])  # one weight per sequence
    weighted = LabelSmoothedCrossEntropy()(labels, logits, sample_weight=weights)
    assert float(weighted) == pytest.approx((per_token * weights).sum() / tokens, rel=1e-5)

