"""Holds CPU fast paths: each computes what a Keras operation computes, by a faster mechanism.

`Normalize` and `Dropout` (`layers.py`) use them if the global switch (on by default,
`set_enabled`) was on as they were made, else Keras' own layers (any device);
`layers.set_fast_paths` sets the choice of layers already made.
"""

import math

import keras
from keras import ops

_SETTING = {"enabled": True}


def enabled():
    """Returns whether layers made now take the fast paths (True unless switched off)."""
    return _SETTING["enabled"]


def set_enabled(on):
    """Switches the fast paths on or off for the layers made from now on."""
    _SETTING["enabled"] = bool(on)


def layer_norm(inputs, gamma, beta, epsilon):
    """Normalizes `inputs` `(..., C)` over the last axis: returns
    ``gamma * (x - mean) / sqrt(var + epsilon) + beta`` (`gamma`, `beta` `(C,)`), computed in
    float32 and returned in the inputs' dtype.

    Its gradient is stated, not autodiff through each reduction of the mean and variance:
    ``dx = (g - mean(g) - x_hat * mean(g * x_hat)) / sqrt(var + epsilon)``, ``g = dy * gamma``.
    """
    # Read outside the custom-gradient function, so that it sees tensors, not variables.
    gamma, beta = (ops.cast(ops.copy(weight), "float32") for weight in (gamma, beta))

    @ops.custom_gradient
    def forward(inputs, gamma, beta):
        x = ops.cast(inputs, "float32")  # (..., C)
        centered = x - ops.mean(x, axis=-1, keepdims=True)
        variance = ops.mean(ops.square(centered), axis=-1, keepdims=True)  # (..., 1)
        inverse_std = ops.rsqrt(variance + epsilon)
        normalized = centered * inverse_std  # (..., C)

        def grad(*args, upstream=None):
            if upstream is None:  # TensorFlow passes it by position, JAX by name
                (upstream,) = args
            upstream = ops.cast(upstream, "float32")  # (..., C)
            batch_axes = tuple(range(len(inputs.shape) - 1))
            gamma_grad = ops.sum(upstream * normalized, axis=batch_axes)  # (C,)
            beta_grad = ops.sum(upstream, axis=batch_axes)  # (C,)
            scaled = upstream * gamma
            inputs_grad = inverse_std * (
                scaled - ops.mean(scaled, axis=-1, keepdims=True)
                - normalized * ops.mean(scaled * normalized, axis=-1, keepdims=True))
            return ops.cast(inputs_grad, inputs.dtype), gamma_grad, beta_grad

        return ops.cast(normalized * gamma + beta, inputs.dtype), grad

    return forward(inputs, gamma, beta)


DRAW_LEVELS = 2 ** 16  # values a 16-bit draw takes


def dropout(inputs, rate, seed_generator):
    """Drops a `rate` in (0, 1) of `inputs` and scales the rest (inverted dropout), drawing
    from `seed_generator`.

    Drawing is most of dropout's work on CPU, so each random 32-bit word gives two 16-bit
    draws. An element is kept when its draw is at least ``round(rate * 65536)`` (the rate is
    exact to ``2**-17``) and scaled by the inverse of the kept fraction.
    """
    threshold = round(rate * DRAW_LEVELS)
    # Signed draws (draw + 2**15 is uniform in [0, 65536)); an int16 bound avoids converting.
    lowest_kept = ops.convert_to_tensor(threshold - DRAW_LEVELS // 2, "int16")
    keep = ops.greater_equal(_draws(ops.shape(inputs), seed_generator), lowest_kept)
    scale = ops.cast(DRAW_LEVELS / (DRAW_LEVELS - threshold), inputs.dtype)
    return inputs * ops.where(keep, scale, ops.zeros_like(scale))  # mask of the inputs' shape


def _draws(shape, seed_generator):
    """Returns uniform int16 draws of `shape`, two from each random 32-bit word."""
    static = all(isinstance(dim, int) for dim in shape)  # else some known only at run time
    count = math.prod(shape) if static else ops.prod(ops.convert_to_tensor(shape))
    # A static last axis keeps `ops.view` working when the batch shape is dynamic.
    words = keras.random.randint(((count + 1) // 2, 1), -2 ** 31, 2 ** 31 - 1,
                                 dtype="int32", seed=seed_generator)
    draws = ops.reshape(ops.view(words, "int16"), (-1,))  # (2 * words,)
    return ops.reshape(draws[:count], shape)
