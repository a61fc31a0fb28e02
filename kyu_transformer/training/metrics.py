"""Computes token-level metrics that ignore padding."""

from keras import ops

from kyu_transformer.conventions import PAD_ID


def masked_accuracy_counts(labels, logits, pad_id=PAD_ID):
    """Counts the top-1 hits and the non-padding tokens; returns ``(correct, count)`` in float32.

    A token is a hit when its label's logit is the row's largest, ties included (as
    ``tf.math.in_top_k``).
    Comparing float32 logits lets XLA share the row maxima with the loss, not so an argmax.
    """
    keep = ops.not_equal(labels, pad_id)  # (N, T)
    full = ops.cast(logits, "float32")  # (N, T, V)
    label_logits = ops.take_along_axis(
        full, ops.cast(labels, "int32")[..., None], axis=-1)[..., 0]  # (N, T)
    hits = ops.logical_and(keep, ops.greater_equal(label_logits, ops.max(full, axis=-1)))
    return ops.sum(ops.cast(hits, "float32")), ops.sum(ops.cast(keep, "float32"))

