"""Builds the tf.data pipeline: columns of subword ids in, shuffled batches of marked and padded
ids out.

An epoch's order is computed from the sentences' lengths alone: the pairs bucketed by length,
batched, and the batches shuffled by the epoch's seed. A batch's ids are read when the pipeline
reaches it, so that memory holds the lengths and the batches in flight, not the corpus, and a
resumed run starts at its batch without reading the ones before.
"""

import numpy as np
import tensorflow as tf

from kyu_transformer.conventions import BOS_ID, EOS_ID, PAD_ID, replica_rows

# A batch's sides are padded to a multiple of this: the shapes a step meets (each compiled once
# by XLA, each a kernel choice) are then a few per bucket, not one per length. A batch of one
# bucket is already about as long as its longest pair, so this adds little.
LENGTH_MULTIPLE = 8


def padded_length(length, cap=None):
    """Returns the length a side whose longest sentence has `length` ids is padded to: the
    next multiple of `LENGTH_MULTIPLE`, but not beyond `cap` (the position table's size), nor
    shorter than `length`."""
    rounded = -(-length // LENGTH_MULTIPLE) * LENGTH_MULTIPLE
    return rounded if cap is None else max(length, min(rounded, cap))


def batch_plan(lengths, batch_size, batch_tokens, maxlen, seed):
    """Returns an epoch's batches of the pairs of `lengths` (each pair's longer side, markers
    included) as ``(order, begins, ends)``: batch ``b`` holds pairs
    ``order[begins[b]:ends[b]]``. The pairs are shuffled with `seed` and bucketed every
    `LENGTH_MULTIPLE` tokens; a bucket of lengths up to L batches ``min(batch_size,
    batch_tokens // L)`` pairs (`batch_size` alone without `batch_tokens`), its last batch
    what is left; the batches are shuffled with `seed` too."""
    rng = np.random.default_rng(seed)
    boundaries = np.arange(LENGTH_MULTIPLE + 1, maxlen + 1, LENGTH_MULTIPLE)  # bucket i: < b_i
    longest = np.append(boundaries - 1, padded_length(maxlen))  # (buckets,) a bucket's longest
    sizes = (np.clip(batch_tokens // longest, 1, batch_size) if batch_tokens
             else np.full(len(longest), batch_size))
    shuffled = rng.permutation(len(lengths))
    buckets = np.searchsorted(boundaries, lengths[shuffled], side="right")  # (pairs,)
    order = shuffled[np.argsort(buckets, kind="stable")]  # by bucket, shuffled within
    counts = np.bincount(buckets, minlength=len(sizes))  # (buckets,) pairs in each
    firsts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    begins, ends = [], []
    for first, count, size in zip(firsts, counts, sizes):  # a bucket's batches
        starts = np.arange(first, first + count, size)
        begins.append(starts)
        ends.append(np.minimum(starts + size, first + count))
    begins, ends = np.concatenate(begins), np.concatenate(ends)
    mixed = rng.permutation(len(begins))
    return order, begins[mixed], ends[mixed]


class BatchReader:
    """Reads batch ``b`` of a `batch_plan` from `IdColumn`s `sources` and `targets` (ids
    without markers): ``(source + EOS, BOS + target, target + EOS)``, each side padded with
    `PAD_ID` to `padded_length` under its cap of `maxlens`. With `share` ``(first, count,
    total)``, only the rows of replicas ``first .. first + count - 1`` of `total` are read (the
    others stay padding): a worker reads what it trains on."""

    def __init__(self, sources, targets, plan, maxlens, share=None):
        self.sources, self.targets, self.maxlens = sources, targets, maxlens
        self.order, self.begins, self.ends = plan
        self.share = share

    def __call__(self, batch):
        pairs = self.order[self.begins[batch]:self.ends[batch]]  # (rows,)
        first, last = (0, len(pairs)) if self.share is None else replica_rows(
            len(pairs), *self.share)
        source_lengths = self.sources.ends[pairs] - self.sources.begins[pairs] + 1
        target_lengths = self.targets.ends[pairs] - self.targets.begins[pairs] + 1
        source = np.full((len(pairs), padded_length(source_lengths.max(), self.maxlens[0])),
                         PAD_ID, np.int32)
        target_in = np.full((len(pairs), padded_length(target_lengths.max(), self.maxlens[1])),
                            PAD_ID, np.int32)
        target_out = target_in.copy()
        for row in range(first, last):
            ids = self.sources.sentence(pairs[row])
            source[row, :len(ids)], source[row, len(ids)] = ids, EOS_ID
            ids = self.targets.sentence(pairs[row])
            target_in[row, 0], target_in[row, 1:len(ids) + 1] = BOS_ID, ids
            target_out[row, :len(ids)], target_out[row, len(ids)] = ids, EOS_ID
        return source, target_in, target_out


def make_dataset(sources, targets, batch_size, batch_tokens=0, maxlens=(None, None), seed=0,
                 skip=0, share=None):
    """Returns the batches ``({"source", "target_in"}, target_out)`` of the pairs of
    `IdColumn`s `sources` and `targets` that fit `maxlens` with their markers, from batch
    `skip` on (those before are not read), in the order `batch_plan` gives with `seed`: the
    same batches for the same seed. Its `cardinality()` is its count of batches. `share`:
    see `BatchReader`."""
    source_lengths, target_lengths = sources.lengths() + 1, targets.lengths() + 1
    fits = np.ones(len(sources), bool)
    for lengths, cap in ((source_lengths, maxlens[0]), (target_lengths, maxlens[1])):
        if cap is not None:
            fits &= lengths <= cap
    kept = np.flatnonzero(fits)  # (pairs,) of the columns
    lengths = np.maximum(source_lengths[kept], target_lengths[kept])
    maxlen = max(cap if cap is not None else int(lengths.max(initial=1)) for cap in maxlens)
    order, begins, ends = batch_plan(lengths, batch_size, batch_tokens, maxlen, seed)
    read = BatchReader(sources, targets, (kept[order], begins, ends), maxlens, share)

    def read_batch(batch):
        columns = tf.numpy_function(read, [batch], (tf.int32,) * 3, stateful=False)
        source, target_in, target_out = (tf.ensure_shape(ids, (None, None)) for ids in columns)
        return {"source": source, "target_in": target_in}, target_out

    dataset = tf.data.Dataset.range(min(skip, len(begins)), len(begins))
    return dataset.map(read_batch, num_parallel_calls=tf.data.AUTOTUNE,
                       deterministic=True).prefetch(tf.data.AUTOTUNE)
