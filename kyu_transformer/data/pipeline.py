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
    included; `maxlen` the longest a batch is padded to) as ``(order, begins, ends)``: batch
    ``b`` holds pairs ``order[begins[b]:ends[b]]``. The pairs are shuffled with `seed` and
    bucketed every `LENGTH_MULTIPLE` tokens; a bucket of lengths up to L batches
    ``min(batch_size, batch_tokens // L)`` pairs (`batch_size` alone without `batch_tokens`),
    its last batch what is left; the batches are shuffled with `seed` too."""
    rng = np.random.default_rng(seed)
    boundaries = np.arange(LENGTH_MULTIPLE + 1, maxlen + 1, LENGTH_MULTIPLE)  # bucket i: < b_i
    longest = np.append(boundaries - 1, maxlen)  # (buckets,) a bucket's longest
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
    """Reads a batch of pairs from the flat id arrays `source_ids` and `target_ids` (ids
    without markers), given each pair's offsets: ``(source + EOS, BOS + target, target +
    EOS)``, each side padded with `PAD_ID` to `padded_length` under its cap of `maxlens`. With
    `share` ``(first, count, total)``, only the rows of replicas ``first .. first + count - 1``
    of `total` are read (the others stay padding): a worker reads what it trains on. It holds
    no epoch's plan: tf.data keeps a Python function for the process's life, a plan goes with
    its dataset."""

    def __init__(self, source_ids, target_ids, maxlens, share=None):
        self.source_ids, self.target_ids = source_ids, target_ids
        self.maxlens, self.share = maxlens, share

    def __call__(self, source_begins, source_ends, target_begins, target_ends):
        rows = len(source_begins)
        first, last = (0, rows) if self.share is None else replica_rows(rows, *self.share)
        source_width, target_width = padded_widths(source_ends - source_begins,
                                                   target_ends - target_begins, self.maxlens)
        source = np.full((rows, source_width), PAD_ID, np.int32)
        target_in = np.full((rows, target_width), PAD_ID, np.int32)
        target_out = target_in.copy()
        for row in range(first, last):
            ids = self.source_ids[source_begins[row]:source_ends[row]]
            source[row, :len(ids)], source[row, len(ids)] = ids, EOS_ID
            ids = self.target_ids[target_begins[row]:target_ends[row]]
            target_in[row, 0], target_in[row, 1:len(ids) + 1] = BOS_ID, ids
            target_out[row, :len(ids)], target_out[row, len(ids)] = ids, EOS_ID
        return source, target_in, target_out


def fitting_pairs(sources, targets, maxlens):
    """Returns the numbers of the pairs of `IdColumn`s `sources` and `targets` whose sides fit
    `maxlens` (None: any length) with their markers."""
    fits = np.ones(len(sources), bool)
    for column, cap in zip((sources, targets), maxlens):
        if cap is not None:
            fits &= column.lengths() + 1 <= cap
    return np.flatnonzero(fits)


def padded_widths(source_lengths, target_lengths, maxlens):
    """Returns the widths ``(source, target)`` of a batch whose sentences have these counts of
    ids (without markers), each side padded to `padded_length` under its cap of `maxlens`."""
    return tuple(padded_length(int(np.max(lengths)) + 1, cap)
                 for lengths, cap in zip((source_lengths, target_lengths), maxlens))


def epoch_plan(sources, targets, batch_size, batch_tokens=0, maxlens=(None, None), seed=0):
    """Returns an epoch's batches of the pairs of `IdColumn`s `sources` and `targets` that fit
    `maxlens` with their markers, in the order `batch_plan` gives with `seed`, as ``(pairs,
    begins, ends)``: batch ``b`` holds the pairs numbered ``pairs[begins[b]:ends[b]]``."""
    kept = fitting_pairs(sources, targets, maxlens)  # (pairs,) of the columns
    lengths = np.maximum(sources.lengths()[kept], targets.lengths()[kept]) + 1  # with markers
    caps = [cap for cap in maxlens if cap is not None]
    longest = max(caps) if caps else padded_length(int(lengths.max(initial=1)))
    order, begins, ends = batch_plan(lengths, batch_size, batch_tokens, longest, seed)
    return kept[order], begins, ends


def batch_shapes(sources, targets, plan, maxlens=(None, None)):
    """Returns ``(rows, source width, target width)`` of each batch of `plan` (`epoch_plan`'s),
    as `BatchReader` pads it: ``(batches, 3)`` int64."""
    pairs, begins, ends = plan
    source_lengths, target_lengths = sources.lengths()[pairs], targets.lengths()[pairs]
    return np.array([(end - begin, *padded_widths(source_lengths[begin:end],
                                                  target_lengths[begin:end], maxlens))
                     for begin, end in zip(begins, ends)], np.int64).reshape(-1, 3)


def make_dataset(sources, targets, batch_size, batch_tokens=0, maxlens=(None, None), seed=0,
                 skip=0, share=None):
    """Returns the batches ``({"source", "target_in"}, target_out)`` of `epoch_plan`'s pairs
    of `IdColumn`s `sources` and `targets`, from batch `skip` on (those before are not read):
    the same batches for the same seed. Its `cardinality()` is its count of batches. `share`:
    see `BatchReader`."""
    pairs, begins, ends = epoch_plan(sources, targets, batch_size, batch_tokens, maxlens, seed)
    # The plan as constants of the dataset's function, freed with it: every pair's offsets in
    # the plan's order (N,), a batch's rows within them (batches,).
    offsets = [tf.constant(array[pairs]) for column in (sources, targets)
               for array in (column.begins, column.ends)]
    begins, ends = tf.constant(begins), tf.constant(ends)
    read = BatchReader(sources.ids, targets.ids, maxlens, share)

    def read_batch(batch):
        rows = [array[begins[batch]:ends[batch]] for array in offsets]
        columns = tf.numpy_function(read, rows, (tf.int32,) * 3, stateful=False)
        source, target_in, target_out = (tf.ensure_shape(ids, (None, None)) for ids in columns)
        return {"source": source, "target_in": target_in}, target_out

    count = int(begins.shape[0])  # batches
    dataset = tf.data.Dataset.range(min(skip, count), count)
    return dataset.map(read_batch, num_parallel_calls=tf.data.AUTOTUNE,
                       deterministic=True).prefetch(tf.data.AUTOTUNE)
