"""Builds the tf.data pipeline: marked subword ids in, shuffled batches of padded ids out."""

import math

import numpy as np
import tensorflow as tf

from kyu_transformer.conventions import PAD_ID


# A batch's sides are padded to a multiple of this: the shapes a step meets (each compiled once
# by XLA, each a kernel choice) are then a few per bucket, not one per length. A batch of one
# bucket is already about as long as its longest pair, so this adds little.
LENGTH_MULTIPLE = 8


def _to_multiples(columns, caps):
    """Pads each `(rows, T)` array of `columns` with `PAD_ID` to a multiple of `LENGTH_MULTIPLE`,
    but not beyond its cap in `caps` (the position tables' sizes), nor shortens it."""
    def padded(ids, cap):
        length = tf.shape(ids)[1]
        rounded = length + (-length % LENGTH_MULTIPLE)
        target = tf.maximum(length, rounded if cap is None else tf.minimum(rounded, cap))
        return tf.pad(ids, [[0, 0], [0, target - length]], constant_values=PAD_ID)

    return tuple(padded(ids, cap) for ids, cap in zip(columns, caps))


def _padded_length(length, maxlens):
    """Returns the longest a batch of pairs of `length` is padded to."""
    rounded = -(-length // LENGTH_MULTIPLE) * LENGTH_MULTIPLE
    caps = [cap for cap in maxlens if cap is not None]
    return max(length, min(rounded, max(caps))) if caps else rounded


def _named(columns):
    source, target_in, target_out = columns
    return {"source": source, "target_in": target_in}, target_out


def _padded(sequences):
    """Returns `sequences` as a `(num, longest)` int32 array padded with 0, and their lengths."""
    lengths = np.array([len(s) for s in sequences], dtype=np.int32)
    padded = np.zeros((len(sequences), lengths.max()), dtype=np.int32)
    for row, sequence in enumerate(sequences):
        padded[row, :len(sequence)] = sequence
    return padded, lengths


def make_dataset(sources, targets_in, targets_out, batch_size, batch_tokens=0, maxlen=None,
                 seed=0, maxlens=(None, None)):
    """Returns a dataset of batches ``({"source", "target_in"}, target_out)`` of int32 ids
    padded with 0 to a multiple of `LENGTH_MULTIPLE`, bucketed by the longer side. With a fixed
    `seed` it gives the same batches every time, so that a resumed run can skip those trained.
    Its `cardinality()` is its count of batches, known without going through it. `maxlens`:
    the model's longest source and target, where the padding to a multiple stops."""
    maxlen = maxlen or max(max(len(s) for s in sources), max(len(t) for t in targets_in))
    columns = [_padded(sequences) for sequences in (sources, targets_in, targets_out)]
    # A pair's length, its longer side's: what it is bucketed by, and the count of batches below.
    lengths = np.maximum(columns[0][1], columns[1][1])  # (pairs,)
    dataset = tf.data.Dataset.from_tensor_slices((tuple(columns), lengths))
    # Each element back to its own length; the batches are padded again below.
    dataset = dataset.map(lambda columns, length: (
        tuple(ids[:size] for ids, size in columns), length))
    dataset = dataset.shuffle(len(sources), seed=seed, reshuffle_each_iteration=False)
    # Buckets every 8 tokens; one of lengths up to L batches min(batch_size, batch_tokens // L)
    # pairs (at most `batch_tokens` padded tokens a side, L rounded up to a multiple of 8).
    step = LENGTH_MULTIPLE
    boundaries = list(range(step + 1, maxlen + 1, step))  # bucket i: length < boundary i
    sizes = [max(1, min(batch_size, batch_tokens // length)) if batch_tokens else batch_size
             for length in [b - 1 for b in boundaries] + [_padded_length(maxlen, maxlens)]]
    dataset = dataset.bucket_by_sequence_length(
        element_length_func=lambda pair, length: length, bucket_boundaries=boundaries,
        bucket_batch_sizes=sizes, padding_values=PAD_ID)
    # Buckets emit in length order within a window: mix the batches too.
    dataset = dataset.shuffle(256, seed=seed + 1, reshuffle_each_iteration=False)
    caps = (maxlens[0], maxlens[1], maxlens[1])  # source, target in, target out
    dataset = dataset.map(lambda pair, _: _named(_to_multiples(pair, caps)))
    # tf.data checks the count: an error at a batch beyond it, or where the batches end before.
    count = _batch_count(lengths, boundaries, sizes)
    return dataset.apply(tf.data.experimental.assert_cardinality(count)).prefetch(
        tf.data.AUTOTUNE)


def _batch_count(lengths, boundaries, sizes):
    """Counts the batches `bucket_by_sequence_length` makes of pairs of `lengths` (their longer
    side's): a bucket's full batches as they fill, and its rest at the end, in any order of the
    pairs."""
    buckets = np.searchsorted(boundaries, lengths, side="right")  # boundary i-1 <= length < i
    counts = np.bincount(buckets, minlength=len(sizes))  # (buckets,) pairs in each
    return sum(math.ceil(count / size) for count, size in zip(counts, sizes))
