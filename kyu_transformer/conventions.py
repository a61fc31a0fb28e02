"""Holds what the layers, the data, the searches, the library and the programs agree on, free of
Keras and TensorFlow so that a program checks its flags before they load: the special ids and the
cut of an output at its end, the layer-norm defaults, the names of strategies and weight types,
the rows of a batch each replica takes, and the rules arguments follow (each rule one function,
which the library applies for its callers and the programs before TensorFlow loads)."""

# The ids of padding, unknown piece, start and end of a sentence: the subword model is trained to
# give them (`data.subwords`) and the searches use them, so that decoding needs no corpus code.
# Padding is 0 because the layers tell padding by it (`Embedding`'s mask).
PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3

# The tf.distribute strategies a run can take (`training.distribution.make_strategy`).
STRATEGIES = ("auto", "default", "mirrored", "multi_worker")


def replica_rows(rows, first, count, total):
    """Returns the rows ``[begin, end)`` of a global batch of `rows` that replicas `first` ..
    ``first + count - 1`` of `total` train on: replica ``r`` takes ``[rows*r//total,
    rows*(r+1)//total)`` (possibly none), so that any replica count computes the same loss.
    Integers or integer tensors alike."""
    return rows * first // total, rows * (first + count) // total


# The weight types of CTranslate2's CPU wheel (`export.ctranslate2.convert`).
QUANTIZATIONS = ("float32", "int8", "int8_float32")

# Where each sub-layer's normalization sits: after the residual sum ("post", the paper and the
# original) or before the sub-layer ("pre").
NORM_POSITIONS = ("post", "pre")

# What each normalization computes: layer norm (mean and variance, a gain and a bias per unit)
# or ScaleNorm (Nguyen & Salazar 2019: the vector scaled to one learned length).
NORM_TYPES = ("layer", "scale")

# How an embedding table starts: Glorot uniform (the original's Xavier: a standard deviation of
# sqrt(2 / (V + C)), so that once scaled by sqrt(C) the embeddings are smaller than the
# sinusoids added to them, whose standard deviation is 0.71) or normal with standard deviation
# 1 / sqrt(C) (tensor2tensor's and fairseq's: standard deviation 1 once scaled).
EMBEDDING_INITS = ("glorot", "normal")

# 1e-6 as OpenNMT-tf and tensor2tensor; the original's 1e-8 is zero in float16. Trained models
# keep theirs (a TensorFlow 1 import: 1e-8).
LAYER_NORM_EPSILON = 1e-6


def cut_at_end(ids):
    """Returns an output's ids (any ints) as a list cut before its first EOS, with the padding
    left out: the tokens the output holds. The SavedModel does the same in its graph."""
    ids = [int(i) for i in ids]
    if EOS_ID in ids:
        ids = ids[:ids.index(EOS_ID)]
    return [i for i in ids if i != PAD_ID]


def check_choice(name, value, choices):
    """Raises ValueError unless `value` is one of `choices`."""
    if value not in choices:
        raise ValueError(f"`{name}` must be one of {', '.join(map(str, choices))}, got {value!r}.")


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


def check_checkpoint_choice(ckpt, average_last):
    """Raises ValueError for a negative `average_last`, or for both a checkpoint `ckpt` and a
    number of last checkpoints to average."""
    if average_last < 0:
        raise ValueError(f"`average_last` must be at least 0, got {average_last}")
    if ckpt and average_last:
        raise ValueError(f"`ckpt` ({ckpt}) and `average_last` ({average_last}) exclude each "
                         "other: give one checkpoint, or the number of last ones to average")
