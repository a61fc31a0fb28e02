"""Token accuracy counts against numpy, with padding and ties."""

import keras
import numpy as np
import pytest

from kyu_transformer.training.metrics import masked_accuracy_counts


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hits_are_numpy_argmax_hits_on_non_padding_tokens(dtype):
    rng = np.random.default_rng(0)
    # Distinct multiples of 1/4 in every row: exact in bfloat16, so no ties.
    logits = np.stack([rng.permutation(40) for _ in range(45)]).reshape(5, 9, 40) / 4 - 5
    logits = logits.astype("float32")
    labels = rng.integers(1, 40, (5, 9)).astype("int32")
    labels[:, ::2] = logits[:, ::2].argmax(-1)  # about half the tokens hit
    labels[labels == 0] = 1
    labels[2, 5:] = 0  # padding: never counted, even where it would hit
    logits[2, 5:, 0] = 100.0
    keep = labels != 0
    expected_hits = ((logits.argmax(-1) == labels) & keep).sum()
    correct, count = masked_accuracy_counts(labels, keras.ops.cast(logits, dtype))
    assert float(count) == keep.sum() == 5 * 9 - 4
    assert float(correct) == expected_hits > 10


def test_a_label_tied_for_the_largest_logit_is_a_hit():
    logits = np.zeros((1, 3, 4), "float32")
    logits[0, 0] = [1.0, 3.0, 3.0, 0.0]  # label 2 ties with 1 (an argmax says 1)
    logits[0, 1] = [1.0, 3.0, 2.0, 0.0]  # label 2 below the maximum
    logits[0, 2] = [5.0, 0.0, 0.0, 0.0]  # label 0 is padding
    labels = np.array([[2, 2, 0]], "int32")
    correct, count = masked_accuracy_counts(labels, logits)
    assert (float(correct), float(count)) == (1.0, 2.0)
