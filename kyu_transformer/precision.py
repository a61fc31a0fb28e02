"""Numeric precision of a run: the global Keras dtype policy."""

import keras

# The `mixed_precision` hparam's values and the Keras dtype policies they name.
PRECISION_POLICIES = {"no": "float32", "bf16": "mixed_bfloat16", "fp16": "mixed_float16"}


def set_precision(mixed_precision):
    """Sets the global Keras dtype policy for ``no`` / ``bf16`` / ``fp16``.

    Layers read the policy when they are built, so it is set before the model is.
    """
    keras.config.set_dtype_policy(PRECISION_POLICIES[mixed_precision])
