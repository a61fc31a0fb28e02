"""CPU fast paths of the layers, apart from the concepts they compute.

Each function here computes what a Keras operation computes, by another
mechanism. `Normalize` and `Dropout` (in `layers.py`) call them when the
switch was on as they were made, and Keras' own ``LayerNormalization`` and
``Dropout`` when it was off, the plain path to fall back to on any other
device or backend. The switch is one global setting, as Keras' dtype policy
is: on by default, `set_enabled(False)` or ``with enabled_as(False):`` for
the layers made meanwhile; `Transformer.from_hparams` applies the
``fast_paths`` hparam (train.py's flag; eval.py and export.py read it from
the logdir's hparams.json).
"""

import contextlib
import math

import keras
from keras import ops

# ------------------------------------------------------------------ the switch

_SETTING = {"enabled": True}


def enabled():
    """Whether layers made now take the fast paths (True unless switched off)."""
    return _SETTING["enabled"]


def set_enabled(on):
    """Switches the fast paths on or off for the layers made from now on."""
    _SETTING["enabled"] = bool(on)


@contextlib.contextmanager
def enabled_as(on):
    """The switch set to `on` for the layers made inside the block, then restored."""
    previous = enabled()
    set_enabled(on)
    try:
        yield
    finally:
        set_enabled(previous)


# ------------------------------------------------------------------ layer norm


def layer_norm(inputs, gamma, beta, epsilon):
    """Layer normalization over the last axis, computed in float32, with a stated gradient.

    Automatic differentiation back-propagates through every step of the mean
    and the variance (each a reduction with its own broadcast back). The
    gradient has a closed form instead: with ``x_hat`` the normalized input
    and ``g = dy * gamma``,
    ``dx = (g - mean(g) - x_hat * mean(g * x_hat)) / sqrt(var + epsilon)``,
    two reductions over tensors the forward pass already holds.

    Args:
      inputs: A tensor `(..., C)`.
      gamma, beta: The scale and offset `(C,)` (variables or tensors).
      epsilon: Small number added to the variance.

    Returns:
      ``gamma * (x - mean) / sqrt(var + epsilon) + beta`` in the inputs' dtype.
    """
    # Read the weights outside the custom-gradient function, so that it sees
    # tensors (its gradient is then theirs) rather than variables.
    gamma = ops.cast(ops.copy(gamma), "float32")
    beta = ops.cast(ops.copy(beta), "float32")

    @ops.custom_gradient
    def forward(inputs, gamma, beta):
        x = ops.cast(inputs, "float32")  # (..., C)
        centered = x - ops.mean(x, axis=-1, keepdims=True)
        inverse_std = ops.rsqrt(ops.mean(ops.square(centered), axis=-1, keepdims=True)
                                + epsilon)  # (..., 1)
        normalized = centered * inverse_std  # (..., C)
        outputs = ops.cast(normalized * gamma + beta, inputs.dtype)

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

        return outputs, grad

    return forward(inputs, gamma, beta)


# --------------------------------------------------------------------- dropout

DRAW_LEVELS = 2 ** 16  # values a 16-bit draw takes


def dropout(inputs, rate, seed_generator):
    """Inverted dropout from 16-bit random draws.

    Keras' dropout draws one 32-bit random number per element, and drawing
    random numbers is most of dropout's work on CPU. Here each 32-bit random
    word is read as two 16-bit draws, so half as many words are drawn. An
    element is kept when its draw is at least ``round(rate * 65536)`` (the
    rate is exact to ``2**-17``) and scaled by the inverse of the kept
    fraction. The gradient is one multiplication by the same mask.

    Args:
      inputs: A floating-point tensor.
      rate: Fraction of the elements to drop, in (0, 1).
      seed_generator: The `keras.random.SeedGenerator` to draw from.

    Returns:
      A tensor of the inputs' shape and dtype.
    """
    threshold = round(rate * DRAW_LEVELS)
    # The draws are signed: draw + 2**15 is uniform in [0, 65536).
    # An int16 bound: an int32 one would convert every draw first.
    lowest_kept = ops.convert_to_tensor(threshold - DRAW_LEVELS // 2, "int16")
    keep = ops.greater_equal(_draws(ops.shape(inputs), seed_generator), lowest_kept)
    scale = ops.cast(DRAW_LEVELS / (DRAW_LEVELS - threshold), inputs.dtype)
    mask = ops.where(keep, scale, ops.zeros_like(scale))  # same shape as inputs
    return inputs * mask


def _draws(shape, seed_generator):
    """Uniform int16 draws of `shape` (two from each random 32-bit word)."""
    if all(isinstance(dim, int) for dim in shape):
        count = math.prod(shape)
    else:  # some dimensions known only when the graph runs
        count = ops.prod(ops.convert_to_tensor(shape))
    # A static last axis keeps `ops.view` working when the batch shape is dynamic.
    words = keras.random.randint(((count + 1) // 2, 1), -2 ** 31, 2 ** 31 - 1,
                                 dtype="int32", seed=seed_generator)
    draws = ops.reshape(ops.view(words, "int16"), (-1,))  # (2 * words,)
    return ops.reshape(draws[:count], shape)
