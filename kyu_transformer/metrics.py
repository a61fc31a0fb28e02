"""Token-level metrics that ignore padding."""

from keras import ops


def masked_accuracy_counts(labels, logits, pad_id=0):
    """``(correct, count)``: argmax hits and number of non-padding tokens, float32."""
    keep = ops.not_equal(labels, pad_id)  # (N, T)
    predicted = ops.cast(ops.argmax(logits, axis=-1), labels.dtype)  # (N, T)
    hits = ops.logical_and(keep, ops.equal(predicted, labels))
    return ops.sum(ops.cast(hits, "float32")), ops.sum(ops.cast(keep, "float32"))


def masked_accuracy(labels, logits, pad_id=0):
    """Share of non-padding tokens whose argmax is the label."""
    correct, count = masked_accuracy_counts(labels, logits, pad_id)
    return correct / ops.maximum(count, 1.0)
