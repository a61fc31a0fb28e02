import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_keras_state():
    """Every test starts with float32, a fixed seed and no leftover policy."""
    keras.config.set_dtype_policy("float32")
    keras.utils.set_random_seed(1234)
    yield
    keras.config.set_dtype_policy("float32")


@pytest.fixture
def rng():
    return np.random.default_rng(0)
