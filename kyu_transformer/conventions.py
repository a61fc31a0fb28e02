"""Holds what the layers, the data, the searches and the programs agree on: the special ids, the
layer-norm defaults, and the rules their arguments follow (each rule is one function, applied by
the layers for their callers and by `hparams.py` before a run starts). It imports no Keras or
TensorFlow, so that a program checks its flags before they load."""

# The ids of padding, unknown piece, start and end of a sentence: the subword model is trained to
# give them (`data.subwords`) and the searches use them, so that decoding needs no corpus code.
# Padding is 0 because the layers tell padding by it (`Embedding`'s mask).
PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3

# Where each sub-layer's normalization sits: after the residual sum ("post", the paper and the
# original) or before the sub-layer ("pre").
NORM_POSITIONS = ("post", "pre")

# 1e-6 as OpenNMT-tf and tensor2tensor; the original's 1e-8 is zero in float16. Trained models
# keep theirs (a TensorFlow 1 import: 1e-8).
LAYER_NORM_EPSILON = 1e-6


def check_choice(name, value, choices):
    """Raises ValueError unless `value` is one of `choices`."""
    if value not in choices:
        raise ValueError(f"`{name}` must be one of {choices}, got {value!r}.")


def check_rates(**rates):
    """Raises ValueError for a dropout or smoothing rate outside [0, 1)."""
    for name, value in rates.items():
        if not 0.0 <= value < 1.0:
            raise ValueError(f"`{name}` must be in [0, 1), got {value!r}.")


def check_heads(width, num_heads, width_name="d_model"):
    """Raises ValueError unless `num_heads` is positive and divides `width` (the heads split it)."""
    if num_heads < 1:
        raise ValueError(f"`num_heads` must be positive, got {num_heads}.")
    if width % num_heads:
        raise ValueError(f"`{width_name}` ({width}) must be divisible by `num_heads` "
                         f"({num_heads}).")


def check_decay(decay_steps, warmup_steps):
    """Raises ValueError unless `decay_steps` is 0 (no decay) or past the warm-up's end, where
    the learning rate's linear decay to 0 starts."""
    if decay_steps and decay_steps <= warmup_steps:
        raise ValueError(f"`decay_steps` ({decay_steps}) must be 0 or more than `warmup_steps` "
                         f"({warmup_steps}).")
