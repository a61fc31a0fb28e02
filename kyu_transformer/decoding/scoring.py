"""Scores given outputs by forced decoding: the model's log-probability of each output, and that
over GNMT's length penalty, as the searches score their hypotheses.

Keras operations and numpy only: it runs on every Keras backend (the searches need TensorFlow).
"""

import collections

import numpy as np
from keras import ops

from kyu_transformer.conventions import BOS_ID, EOS_ID, PAD_ID


def length_penalty(length, alpha):
    """Returns GNMT's length penalty ``((5 + length) / 6) ** alpha`` (1 when alpha is 0)."""
    return ops.power((5.0 + ops.cast(length, "float32")) / 6.0, alpha)


def sequence_log_probs(model, source, outputs):
    """Returns the model's log-probability `(N,)` of each output of `outputs` `(N, L)` (EOS
    included, padding not), by forced decoding of `source`."""
    target_in = ops.concatenate(
        [ops.full((ops.shape(outputs)[0], 1), BOS_ID, "int32"), outputs[:, :-1]], axis=1)
    target_in = ops.where(ops.equal(outputs, PAD_ID), PAD_ID, target_in)
    logits = model({"source": source, "target_in": target_in}, training=False)
    log_probs = ops.log_softmax(ops.cast(logits, "float32"), axis=-1)
    picked = ops.take_along_axis(log_probs, ops.cast(outputs, "int32")[..., None], axis=-1)[..., 0]
    return ops.sum(ops.where(ops.equal(outputs, PAD_ID), 0.0, picked), axis=1)


class ScoredOutput(collections.namedtuple("ScoredOutput", "log_prob tokens score truncated")):
    """Holds an output's log-probability, length (EOS included), score, and whether it was cut
    to the most output tokens (then without EOS)."""


def padded_ids(sequences):
    """Returns lists of ids as an int32 array `(N, L)` padded with `PAD_ID` (L at least 1)."""
    array = np.full((len(sequences), max([1] + [len(ids) for ids in sequences])), PAD_ID, "int32")
    for row, ids in enumerate(sequences):
        array[row, :len(ids)] = ids
    return array


def score_outputs(log_probs, source_ids, target_ids, limits, batch_size):
    """Scores each target of `target_ids` for its source of `source_ids` (lists of ids, without
    EOS); returns ``(scored, truncated_sources)``: a `ScoredOutput` of each, and how many sources
    were cut.

    `log_probs(source (B, S), outputs (B, L))` gives the log-probabilities `(B,)` of int32
    arrays (`sequence_log_probs` of a model); `limits` is ``(maxlen1, max_length, alpha)``: a
    source gets EOS and is cut to ``maxlen1``, a target gets EOS and is cut to ``max_length``
    (then without EOS), as beam search scores a hypothesis cut at its limit.
    """
    maxlen1, max_length, alpha = limits
    if len(source_ids) != len(target_ids):
        raise ValueError(f"{len(source_ids)} sources but {len(target_ids)} targets")
    sources = [(list(ids) + [EOS_ID])[:maxlen1] for ids in source_ids]
    targets = [(list(ids) + [EOS_ID])[:max_length] for ids in target_ids]
    found = np.zeros(len(targets))
    order = sorted(range(len(targets)), key=lambda i: len(targets[i]))  # a batch pads little
    for first in range(0, len(order), batch_size):
        rows = order[first:first + batch_size]
        found[rows] = ops.convert_to_numpy(log_probs(
            padded_ids([sources[i] for i in rows]), padded_ids([targets[i] for i in rows])))
    lengths = np.array([len(ids) for ids in targets])
    scores = found / np.asarray(ops.convert_to_numpy(length_penalty(lengths, alpha)), "float64")
    cut = [len(ids) + 1 > max_length for ids in target_ids]
    truncated_sources = sum(len(ids) + 1 > maxlen1 for ids in source_ids)
    return ([ScoredOutput(*values) for values in
             zip(found.tolist(), lengths.tolist(), scores.tolist(), cut)], truncated_sources)
