"""`model.fit` and `model.evaluate` with `LabelSmoothedCrossEntropy`, as a Keras user runs them.

The models here are trained by Keras' own loop, not by the project's `Trainer`:
a functional model made of the layers (whose logits carry the target's Keras
mask) and the project's `Transformer` (whose logits carry none); the suite's
command runs them with the TensorFlow backend, then with JAX. The runs on two
devices are a subprocess, since the devices must be set up before TensorFlow
starts. This module imports no TensorFlow at its top, so that it runs with JAX.
"""

import json

import keras
import numpy as np
import pytest

from kyu_transformer.layers import DecoderBlock, Embedding, EncoderBlock, PositionalEncoding
from kyu_transformer.losses import LabelSmoothedCrossEntropy
from kyu_transformer.model import Transformer
from tests import programs
from tests.programs import ROOT

pytestmark = pytest.mark.slow  # every test here trains a model, most in a subprocess

VOCAB = 40
EPSILON = 0.1
BOS, EOS = 1, 2
# Target tokens (before EOS) of the rows of each batch of 8. Both halves of a
# batch, and its even and odd rows, hold equal token counts (18 tokens + 4 EOS
# = 22 labels each), so every way of cutting a batch for two replicas gives each
# replica the same number of tokens: the mean of the replicas' means, which
# Keras computes, is then the mean over the batch.
LENGTHS = ((3, 5, 4, 6, 5, 3, 6, 4), (2, 7, 5, 4, 7, 2, 4, 5))
WIDTH = 9  # target_in / labels width: every row has padding


def make_data(seed=0):
    """``({"source", "target_in"}, labels)`` as numpy int32 arrays, `len(LENGTHS)` batches of 8.

    A target row is ``BOS t_1 .. t_n EOS`` then padding; `target_in` drops its
    last position and `labels` its first, so both have ``n + 1`` non-padding
    positions, at the same places.
    """
    rng = np.random.default_rng(seed)
    lengths = np.concatenate(LENGTHS)
    rows = len(lengths)
    full = rng.integers(EOS + 1, VOCAB, size=(rows, WIDTH + 1))
    full[:, 0] = BOS
    for row, length in enumerate(lengths):
        full[row, length + 1] = EOS
        full[row, length + 2:] = 0
    source = rng.integers(EOS + 1, VOCAB, size=(rows, 7))
    for row, length in enumerate(rng.integers(2, 8, size=rows)):
        source[row, length:] = 0
    features = {"source": source.astype("int32"), "target_in": full[:, :-1].astype("int32")}
    return features, full[:, 1:].astype("int32")


def as_dataset(features, labels):
    """The arrays as a tf.data dataset of batches of 8, in order."""
    import tensorflow as tf

    return tf.data.Dataset.from_tensor_slices((features, labels)).batch(8)


def build_functional(d_model=16, num_heads=2, d_ff=32, maxlen=16):
    """An encoder-decoder of the layers; its logits carry the Keras mask ``target_in != 0``."""
    source_ids = keras.Input((None,), dtype="int32", name="source")
    target_ids = keras.Input((None,), dtype="int32", name="target_in")
    embedding = Embedding(VOCAB, d_model)
    encoding = PositionalEncoding(maxlen)
    source = embedding(source_ids)
    source = keras.layers.Add()([source, encoding(source)])
    memory = EncoderBlock(num_heads, d_ff)(source)
    target = embedding(target_ids)
    target = keras.layers.Add()([target, encoding(target)])
    states = DecoderBlock(num_heads, d_ff)(target, memory)  # masks: the Keras masks of both
    logits = keras.layers.Dense(VOCAB)(states)
    return keras.Model({"source": source_ids, "target_in": target_ids}, logits)


def build_transformer():
    """The project's `Transformer`, tiny, without dropout (so that runs can be compared)."""
    model = Transformer(VOCAB, d_model=16, d_ff=32, num_blocks=1, num_heads=2, maxlen1=16,
                        maxlen2=16, dropout_rate=0.0)
    model.build()
    return model


def compile_model(model, learning_rate=0.5):
    model.compile(optimizer=keras.optimizers.SGD(learning_rate),
                  loss=LabelSmoothedCrossEntropy(EPSILON))
    return model


def reference_loss(labels, logits, epsilon=EPSILON):
    """Mean over non-padding labels of the cross-entropy against explicit smoothed one-hots."""
    logits = np.asarray(logits, dtype="float64")
    targets = (1.0 - epsilon) * np.eye(VOCAB)[labels] + epsilon / VOCAB
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    per_token = -(targets * log_probs).sum(-1)
    keep = labels != 0
    return per_token[keep].sum() / keep.sum()


def fit_against_reference(steps=4):
    """Trains the functional model one full-batch step at a time, with the loss by hand before each.

    Returns ``{"expected", "reported", "evaluated", "mask"}``: the reference
    loss of the weights before each step, the loss `fit` reported for that
    step, `evaluate` of the same weights, and whether the logits carried a
    Keras mask.
    """
    from keras.src.backend import get_keras_mask

    features, labels = make_data()
    keras.utils.set_random_seed(3)
    model = compile_model(build_functional())
    result = {"expected": [], "reported": [], "evaluated": [],
              "mask": get_keras_mask(model(features)) is not None}
    for _ in range(steps):
        logits = keras.ops.convert_to_numpy(model(features, training=False))
        result["expected"].append(float(reference_loss(labels, logits)))
        result["evaluated"].append(float(model.evaluate(features, labels, batch_size=len(labels),
                                                        verbose=0)))
        history = model.fit(features, labels, batch_size=len(labels), epochs=1, shuffle=False,
                            verbose=0)
        result["reported"].append(float(history.history["loss"][0]))
    return result


def check_fit_against_reference(result):
    assert result["mask"]  # the case that matters: Keras applies the logits' mask too
    assert np.all(np.isfinite(result["reported"]))
    np.testing.assert_allclose(result["reported"], result["expected"], rtol=1e-5)
    np.testing.assert_allclose(result["evaluated"], result["expected"], rtol=1e-5)
    assert all(later < earlier for earlier, later in
               zip(result["reported"], result["reported"][1:]))


def test_fit_and_evaluate_report_the_masked_mean_of_the_weights():
    check_fit_against_reference(fit_against_reference())


MIRRORED_SCRIPT = r"""
import json, sys
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
sys.path.insert(0, sys.argv[1])
import keras
import numpy as np
from tests.test_keras_fit import (as_dataset, build_functional, build_transformer, compile_model,
                                  make_data, reference_loss)

features, labels = make_data()
# One MirroredStrategy for both models: with a second one over the same
# devices in this process, the second model's gradient all-reduce failed
# (a shape mismatch between the replicas).
strategies = (("default", tf.distribute.get_strategy()),
              ("mirrored", tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])))
results = {}
for name, build in (("functional", build_functional), ("transformer", build_transformer)):
    keras.utils.set_random_seed(5)
    initial = build().get_weights()
    results[name] = {}
    for where, strategy in strategies:
        with strategy.scope():
            model = build()
            model.set_weights(initial)
            compile_model(model)
        logits = keras.ops.convert_to_numpy(model(features))
        # evaluate's loss: each batch's masked mean, weighted by its rows
        expected = np.mean([reference_loss(labels[start:start + 8], logits[start:start + 8])
                            for start in range(0, len(labels), 8)])
        dataset = as_dataset(features, labels)
        evaluated = model.evaluate(dataset, verbose=0)
        history = model.fit(dataset, epochs=3, verbose=0)
        results[name][where] = {
            "replicas": strategy.num_replicas_in_sync, "evaluated": float(evaluated),
            "expected": float(expected),
            "losses": [float(value) for value in history.history["loss"]],
            "weights": [weight.tolist() for weight in model.get_weights()]}
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def mirrored_results():
    output = programs.run("-c", MIRRORED_SCRIPT, ROOT, timeout=300,
                          env=programs.environment(KERAS_BACKEND="tensorflow"))
    assert output.returncode == 0, output.stderr[-3000:]
    return json.loads(output.stdout.strip().splitlines()[-1])


@pytest.mark.tensorflow_only("tf.distribute.MirroredStrategy")
@pytest.mark.parametrize("name", ["functional", "transformer"])
@pytest.mark.cpu_exact
def test_fit_on_two_replicas_equals_one_device(mirrored_results, name):
    """`fit` on two logical CPUs evaluates, trains and ends as on one device.

    Assumes a CPU: the one device is the GPU where one is seen, whose kernels round otherwise
    than the CPUs' (a tolerance of CPUs' rounding, which Adam magnifies where a gradient is
    near 0)."""
    one, two = mirrored_results[name]["default"], mirrored_results[name]["mirrored"]
    assert (one["replicas"], two["replicas"]) == (1, 2)
    assert two["evaluated"] == pytest.approx(one["evaluated"], rel=1e-5)
    np.testing.assert_allclose(two["losses"], one["losses"], rtol=1e-5)
    assert one["losses"][-1] < one["losses"][0]
    assert len(two["weights"]) == len(one["weights"])
    for index, (mirrored, default) in enumerate(zip(two["weights"], one["weights"])):
        np.testing.assert_allclose(mirrored, default, rtol=1e-5, atol=1e-6,
                                   err_msg=f"weight {index}")


@pytest.mark.tensorflow_only("tf.distribute.MirroredStrategy")
@pytest.mark.parametrize("name", ["functional", "transformer"])
def test_evaluate_reports_the_masked_mean_on_one_and_two_replicas(mirrored_results, name):
    for where in ("default", "mirrored"):
        result = mirrored_results[name][where]
        assert result["evaluated"] == pytest.approx(result["expected"], rel=1e-5), where


def test_the_loss_in_a_compiled_function_masks_padding_itself(compiled):
    """Logits without a Keras mask, in the backend's compiled function (`jax.jit` in the JAX
    run, `tf.function` in the TensorFlow one): the padding mask must come from the loss itself."""
    _, labels = make_data()
    logits = np.random.default_rng(1).normal(size=labels.shape + (VOCAB,)).astype("float32")
    loss = compiled(LabelSmoothedCrossEntropy(EPSILON))
    assert float(loss(labels, logits)) == pytest.approx(reference_loss(labels, logits), rel=1e-5)


@pytest.mark.tensorflow_only("tf.data and tf.distribute, as docs/layers.md's example")
def test_the_keras_way_of_docs_layers_trains_the_transformer():
    """docs/layers.md's example of Keras' fit as written (default dropout, no explicit build),
    at a small size."""
    import tensorflow as tf

    features, labels = make_data()
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        model = Transformer(vocab_size=VOCAB, d_model=32, d_ff=64, num_blocks=1, num_heads=2)
        model.compile(optimizer=keras.optimizers.Adam(1e-2),
                      loss=LabelSmoothedCrossEntropy(EPSILON))
    dataset = tf.data.Dataset.from_tensor_slices((features, labels)).batch(8)
    history = model.fit(dataset, epochs=8, verbose=0)
    losses = history.history["loss"]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.5, losses
