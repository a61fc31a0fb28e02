"""Token-level metrics that ignore padding."""

from keras import ops


def masked_accuracy_counts(labels, logits, pad_id=0):
    """``(correct, count)``: top-1 hits and number of non-padding tokens, float32.

    A token is a hit when its label's logit is the largest of its row; a label
    tied for the largest counts as a hit (as ``tf.math.in_top_k`` with
    ``k=1``), where an argmax would pick the first of the tied classes. The
    comparison is made on the float32 logits, the values the loss reduces:
    compiled together with the loss (`train_step.loss_terms_function`), XLA
    computes the row maxima once for both, where an argmax would be one more
    reduction over the `(N, T, V)` logits.
    """
    keep = ops.not_equal(labels, pad_id)  # (N, T)
    full = ops.cast(logits, "float32")  # (N, T, V)
    label_logits = ops.take_along_axis(
        full, ops.cast(labels, "int32")[..., None], axis=-1)[..., 0]  # (N, T)
    hits = ops.logical_and(keep, ops.greater_equal(label_logits, ops.max(full, axis=-1)))
    return ops.sum(ops.cast(hits, "float32")), ops.sum(ops.cast(keep, "float32"))


def masked_accuracy(labels, logits, pad_id=0):
    """Share of non-padding tokens whose label has the largest logit (see above)."""
    correct, count = masked_accuracy_counts(labels, logits, pad_id)
    return correct / ops.maximum(count, 1.0)
