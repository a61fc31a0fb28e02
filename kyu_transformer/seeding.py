"""One seed for every random number generator a run draws from."""

import keras
import numpy as np
import tensorflow as tf


def seed_everything(seed, deterministic=False):
    """Seeds Python, NumPy, TensorFlow and Keras; with `deterministic`, TensorFlow's ops
    also run deterministically (two runs with one seed give bit-identical weights)."""
    keras.utils.set_random_seed(seed)
    np.random.seed(seed)
    if deterministic:
        tf.config.experimental.enable_op_determinism()
