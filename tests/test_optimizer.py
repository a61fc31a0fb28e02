"""The fused Adam against Keras' Adam.

(Under MirroredStrategy the trainer's test, test_training.py and test_updates.py, check it: two
replicas end with the weights of one.)
"""

import keras
import numpy as np
import tensorflow as tf

from kyu_transformer.training.optimizer import Adam, make_adam
from kyu_transformer.training.schedule import NoamSchedule


def train(optimizer, strategy, steps=5):
    """Weights after `steps` updates of a quadratic loss whose gradients vary."""
    rng = np.random.default_rng(0)
    targets = [rng.normal(size=(6, 4)).astype("float32") for _ in range(steps)]
    with strategy.scope():
        weights = [keras.Variable(np.ones((6, 4), "float32") * 0.5),
                   keras.Variable(np.zeros((4,), "float32"))]
        optimizer.build(weights)

    @tf.function
    def step(target):
        def replica_step():
            with tf.GradientTape() as tape:
                loss = (tf.reduce_sum((weights[0] - target) ** 4)
                        + tf.reduce_sum((weights[1] - target[0]) ** 2))
            gradients = tape.gradient(loss, [w.value for w in weights])
            optimizer.apply_gradients(zip(gradients, weights))
        strategy.run(replica_step)

    for target in targets:
        step(tf.constant(target))
    return [np.asarray(w) for w in weights]


def make(cls):
    return cls(NoamSchedule(16, 4, 0.5), beta_1=0.9, beta_2=0.98, epsilon=1e-9)


def test_fused_adam_follows_keras_adam():
    strategy = tf.distribute.get_strategy()
    with strategy.scope():
        ours, reference = make(Adam), make(keras.optimizers.Adam)
    got, expected = train(ours, strategy), train(reference, strategy)
    assert not np.allclose(got[0], 0.5)  # the weights moved
    for a, b in zip(got, expected):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert int(ours.iterations.numpy()) == 5


def test_fused_adam_checkpoint_restores_into_keras_adam(tmp_path):
    weights = [keras.Variable(np.ones((3,), "float32"))]
    ours = make(Adam)
    ours.build(weights)
    ours.apply_gradients([(tf.constant([1.0, -2.0, 3.0]), weights[0])])
    path = tf.train.Checkpoint(optimizer=ours).save(str(tmp_path / "ckpt"))
    reference = make(keras.optimizers.Adam)
    reference.build([keras.Variable(np.ones((3,), "float32"))])
    tf.train.Checkpoint(optimizer=reference).restore(path).assert_existing_objects_matched()
    for a, b in zip(reference.variables, ours.variables):
        np.testing.assert_array_equal(a, b)


def test_fast_paths_switch_picks_the_fused_adam_or_keras_adam():
    strategy = tf.distribute.get_strategy()
    fast, plain = (make_adam(NoamSchedule(16, 4, 0.5), fast_paths=fast_paths, beta_1=0.9,
                             beta_2=0.98, epsilon=1e-9) for fast_paths in (True, False))
    assert type(fast) is Adam and type(plain) is keras.optimizers.Adam
    settings = [{k: v for k, v in o.get_config().items() if k != "name"} for o in (fast, plain)]
    assert settings[0] == settings[1] and settings[0]["beta_2"] == 0.98
    got, expected = train(fast, strategy), train(plain, strategy)
    assert not np.allclose(expected[0], 0.5)
    for a, b in zip(got, expected):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
