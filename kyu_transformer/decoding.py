"""Greedy and beam search over batches, with a key/value cache.

The encoder runs once per batch; the decoder runs one position per step
(`Transformer.decode_step`), reading the keys/values of earlier positions from
the cache instead of recomputing the prefix. Both searches are loops of
`keras.ops.while_loop`, compiled as a whole by `Translator` (`tf.function`),
and stop as soon as every sentence is finished.

Outputs are id matrices `(N, L)`: each row the generated ids, EOS included,
then padding (0).
"""

import numpy as np
import tensorflow as tf
from keras import ops

from kyu_transformer.data import BOS_ID, EOS_ID, PAD_ID

_NEG_INF = -1.0e9  # score of impossible hypotheses (finite: no NaN in sums)


def length_penalty(length, alpha):
    """GNMT's ``((5 + length) / 6) ** alpha`` (1 when alpha is 0)."""
    return ops.power((5.0 + ops.cast(length, "float32")) / 6.0, alpha)


def greedy_search(model, source, max_length):
    """The most likely next token, step by step.

    Args:
      model: A `Transformer`.
      source: Source ids `(N, S)` (with EOS, padded with 0).
      max_length: Most output tokens (EOS included), a Python int.

    Returns:
      ``(ids (N, max_length), coverage (N, max_length, S))``: ids end with EOS
      then 0; coverage is the last block's cross-attention averaged over heads.
    """
    memory, source_mask = model.encode(source, training=False)
    batch = ops.shape(source)[0]
    cache = model.init_cache(memory, source_mask, max_length)
    outputs = ops.zeros((batch, max_length), "int32")
    coverage = ops.zeros((batch, max_length, ops.shape(source)[1]), "float32")
    finished = ops.zeros((batch,), "bool")
    last = ops.full((batch,), BOS_ID, "int32")

    def unfinished(step, *_):
        return step < max_length

    def body(step, last, outputs, coverage, finished, cache):
        logits, cache, attention = model.decode_step(last, step, cache)
        chosen = ops.cast(ops.argmax(logits, axis=-1), "int32")  # (N,)
        chosen = ops.where(finished, PAD_ID, chosen)  # finished sentences stay padded
        outputs = ops.slice_update(outputs, (0, step), chosen[:, None])
        coverage = ops.slice_update(coverage, (0, step, 0),
                                    ops.cast(attention, "float32")[:, None, :])
        finished = ops.logical_or(finished, ops.equal(chosen, EOS_ID))
        # Once all are finished, jump to the end (the loop condition is on `step`).
        step = ops.where(ops.all(finished), max_length, step + 1)
        return step, chosen, outputs, coverage, finished, cache

    _, _, outputs, coverage, _, _ = ops.while_loop(
        unfinished, body, (0, last, outputs, coverage, finished, cache))
    return outputs, coverage


def _gather_beams(tensor, indices):
    """Rows of `tensor` `(N, K, ...)` picked per sentence by `indices` `(N, K')`."""
    trailing = len(tensor.shape) - 2
    indices = ops.reshape(indices, tuple(ops.shape(indices)) + (1,) * trailing)
    return ops.take_along_axis(tensor, indices, axis=1)


def _split_beams(tensor, beam_size):
    """`(N*K, ...)` -> `(N, K, ...)`."""
    shape = ops.shape(tensor)
    return ops.reshape(tensor, (shape[0] // beam_size, beam_size) + tuple(shape[1:]))


def beam_search(model, source, max_length, beam_size=4, alpha=0.6, n_best=1):
    """Beam search with GNMT length penalty; finished hypotheses kept apart.

    At each step the ``2K`` best extensions of the ``K`` alive hypotheses are
    taken: those ending in EOS compete (scored ``log p / length_penalty``) for
    the ``K`` finished slots, the others for the ``K`` alive slots, so finished
    hypotheses never starve the beam. A sentence is done when its worst
    finished score beats the best its alive hypotheses could still reach.

    Args:
      model: A `Transformer`.
      source: Source ids `(N, S)`.
      max_length: Most output tokens (EOS included), a Python int.
      beam_size: `K`.
      alpha: Length-penalty exponent (0: plain log-probability).
      n_best: How many hypotheses to return per sentence (<= K).

    Returns:
      ``(ids (N, n_best, max_length), scores (N, n_best))``, best first. A
      sentence with fewer finished hypotheses than `n_best` is completed from
      its alive ones (cut at `max_length`).
    """
    k = beam_size
    memory, source_mask = model.encode(source, training=False)
    batch = ops.shape(source)[0]
    vocab = model.vocab_size
    # Every sentence's state repeated K times along the batch axis.
    memory = ops.repeat(memory, k, axis=0)
    source_mask = ops.repeat(source_mask, k, axis=0)
    cache = model.init_cache(memory, source_mask, max_length)

    alive_ids = ops.zeros((batch, k, max_length), "int32")
    # Only the first beam is live at the start: the others would duplicate it.
    alive_scores = ops.tile(ops.convert_to_tensor([[0.0] + [_NEG_INF] * (k - 1)]), (batch, 1))
    finished_ids = ops.zeros((batch, k, max_length), "int32")
    finished_scores = ops.full((batch, k), _NEG_INF)
    last = ops.full((batch * k,), BOS_ID, "int32")
    done = ops.zeros((batch,), "bool")

    def unfinished(step, *_):
        return step < max_length

    def body(step, last, alive_ids, alive_scores, finished_ids, finished_scores, done, cache):
        logits, cache, _ = model.decode_step(last, step, cache)
        log_probs = ops.log_softmax(ops.cast(logits, "float32"), axis=-1)  # (N*K, V)
        candidates = alive_scores[:, :, None] + _split_beams(log_probs, k)  # (N, K, V)
        top_scores, top_flat = ops.top_k(ops.reshape(candidates, (batch, k * vocab)), 2 * k)
        top_beams = top_flat // vocab  # (N, 2K)
        top_tokens = ops.cast(top_flat % vocab, "int32")
        top_ids = ops.slice_update(_gather_beams(alive_ids, top_beams), (0, 0, step),
                                   top_tokens[:, :, None])  # (N, 2K, L)
        ends = ops.equal(top_tokens, EOS_ID)

        # Alive: the K best extensions that do not end here.
        alive_candidates = ops.where(ends, _NEG_INF, top_scores)
        alive_scores, alive_pick = ops.top_k(alive_candidates, k)  # (N, K)
        alive_ids = _gather_beams(top_ids, alive_pick)
        cache_rows = ops.reshape(
            _gather_beams(top_beams, alive_pick) + ops.arange(batch)[:, None] * k, (-1,))
        cache = {**cache, "self": [(ops.take(keys, cache_rows, axis=0),
                                    ops.take(values, cache_rows, axis=0))
                                   for keys, values in cache["self"]]}
        last = ops.reshape(_gather_beams(top_tokens, alive_pick), (-1,))

        # Finished: the K best of those kept so far and those ending here.
        ended_scores = ops.where(ends, top_scores / length_penalty(step + 1, alpha), _NEG_INF)
        ended_scores = ops.where(done[:, None], _NEG_INF, ended_scores)
        pool_scores = ops.concatenate([finished_scores, ended_scores], axis=1)  # (N, 3K)
        pool_ids = ops.concatenate([finished_ids, top_ids], axis=1)
        finished_scores, finished_pick = ops.top_k(pool_scores, k)
        finished_ids = _gather_beams(pool_ids, finished_pick)

        # Done: the best alive score can only fall; with the largest penalty
        # it may still get (at max_length) it cannot beat the worst finished.
        best_possible = alive_scores[:, 0] / length_penalty(max_length, alpha)
        worst_finished = finished_scores[:, k - 1]
        done = ops.logical_or(done, ops.logical_and(worst_finished > _NEG_INF / 2,
                                                    best_possible < worst_finished))
        step = ops.where(ops.all(done), max_length, step + 1)
        return step, last, alive_ids, alive_scores, finished_ids, finished_scores, done, cache

    loop_vars = (0, last, alive_ids, alive_scores, finished_ids, finished_scores, done, cache)
    _, _, alive_ids, alive_scores, finished_ids, finished_scores, _, _ = ops.while_loop(
        unfinished, body, loop_vars)

    # Sentences short of finished hypotheses take their alive ones, as they are.
    alive_final = alive_scores / length_penalty(max_length, alpha)
    pool_scores = ops.concatenate([finished_scores, alive_final], axis=1)
    pool_ids = ops.concatenate([finished_ids, alive_ids], axis=1)
    best_scores, best_pick = ops.top_k(pool_scores, n_best)
    return _gather_beams(pool_ids, best_pick), best_scores


def sequence_log_probs(model, source, outputs):
    """Model log-probability of each output `(N, L)` (EOS included, padding not)."""
    target_in = ops.concatenate(
        [ops.full((ops.shape(outputs)[0], 1), BOS_ID, "int32"), outputs[:, :-1]], axis=1)
    target_in = ops.where(ops.equal(outputs, PAD_ID), PAD_ID, target_in)
    logits = model({"source": source, "target_in": target_in}, training=False)
    log_probs = ops.log_softmax(ops.cast(logits, "float32"), axis=-1)
    picked = ops.take_along_axis(log_probs, ops.cast(outputs, "int32")[..., None], axis=-1)[..., 0]
    return ops.sum(ops.where(ops.equal(outputs, PAD_ID), 0.0, picked), axis=1)


def _pad_ids(sequences, width=None):
    width = width or max(len(s) for s in sequences)
    padded = np.zeros((len(sequences), width), dtype="int32")
    for row, sequence in enumerate(sequences):
        padded[row, :len(sequence)] = sequence
    return padded


class Translator:
    """Batched translation of subword ids or text with a trained `Transformer`.

    Args:
      model: The `Transformer`.
      beam_size: 1 for greedy search, else beam search.
      alpha: Length-penalty exponent of beam search.
      max_length: Most output tokens; the model's `maxlen2` when None.
      length_margin: Outputs are also limited to source length + this margin
        (per batch).
      jit_compile: Compile the search with XLA.
    """

    def __init__(self, model, beam_size=1, alpha=0.6, max_length=None, length_margin=16,
                 jit_compile=False):
        self.model = model
        self.beam_size = int(beam_size)
        self.alpha = float(alpha)
        self.max_length = int(max_length or model.maxlen2)
        self.length_margin = int(length_margin)
        self.truncated = 0
        if self.beam_size < 1:
            raise ValueError(f"`beam_size` must be at least 1, got {beam_size}")
        self._greedy = tf.function(self._greedy_fn, jit_compile=jit_compile,
                                   reduce_retracing=True)
        self._beam = tf.function(self._beam_fn, jit_compile=jit_compile, reduce_retracing=True)

    def _greedy_fn(self, source, max_length):
        return greedy_search(self.model, source, max_length)

    def _beam_fn(self, source, max_length):
        ids, _ = beam_search(self.model, source, max_length, self.beam_size, self.alpha)
        return ids[:, 0]

    def _limit(self, source):
        """Output length for a batch, rounded up to 8 (fewer traces)."""
        wanted = min(self.max_length, source.shape[1] + self.length_margin)
        return int(min(self.max_length, -(-wanted // 8) * 8))

    def translate_ids(self, source_ids, batch_size=64, with_coverage=False):
        """Lists of output ids (EOS and padding removed), in the order given.

        Sentences are decoded in batches of similar source length. Empty
        sources give empty outputs without being decoded.
        """
        results = [[] for _ in source_ids]
        coverages = [None for _ in source_ids]
        # Sources the encoder cannot take whole are cut to its `maxlen1` (and counted).
        self.truncated = sum(len(ids) + 1 > self.model.maxlen1 for ids in source_ids)
        order = sorted((i for i, ids in enumerate(source_ids) if ids),
                       key=lambda i: len(source_ids[i]))
        for first in range(0, len(order), batch_size):
            rows = order[first:first + batch_size]
            source = _pad_ids([list(source_ids[i]) + [EOS_ID] for i in rows])
            source = source[:, :self.model.maxlen1]  # the encoder's limit
            max_length = self._limit(source)
            if self.beam_size == 1 or with_coverage:
                ids, coverage = self._greedy(tf.constant(source), max_length)
            if self.beam_size > 1:
                ids = self._beam(tf.constant(source), max_length)
            ids = ids.numpy()
            for row, index in enumerate(rows):
                output = ids[row].tolist()
                output = output[:output.index(EOS_ID)] if EOS_ID in output else output
                results[index] = [i for i in output if i != PAD_ID]
                if with_coverage:
                    coverages[index] = coverage.numpy()[row]
        return (results, coverages) if with_coverage else results

    def translate(self, sentences, subwords, batch_size=64):
        """Detokenized translations of raw `sentences` (empty in, empty out)."""
        source_ids = subwords.encode(sentences)
        return [subwords.decode(ids) for ids in self.translate_ids(source_ids, batch_size)]


def recompute_greedy_search(model, source, max_length):
    """Greedy search without a cache: the whole prefix is decoded again each step.

    The baseline that the cache is measured against (and checked by): same
    outputs as `greedy_search`, cost growing with the square of the length.
    """
    memory, source_mask = model.encode(source, training=False)
    batch = ops.shape(source)[0]
    # Column 0 holds BOS; step t decodes columns 0..t and writes column t + 1.
    prefix = ops.concatenate([ops.full((batch, 1), BOS_ID, "int32"),
                              ops.zeros((batch, max_length), "int32")], axis=1)
    finished = ops.zeros((batch,), "bool")

    def unfinished(step, *_):
        return step < max_length

    def body(step, prefix, finished):
        logits = model.decode(prefix[:, :step + 1], memory, source_mask, training=False)
        chosen = ops.cast(ops.argmax(logits[:, -1], axis=-1), "int32")
        chosen = ops.where(finished, PAD_ID, chosen)
        prefix = ops.slice_update(prefix, (0, step + 1), chosen[:, None])
        finished = ops.logical_or(finished, ops.equal(chosen, EOS_ID))
        return ops.where(ops.all(finished), max_length, step + 1), prefix, finished

    _, prefix, _ = ops.while_loop(unfinished, body, (0, prefix, finished))
    return prefix[:, 1:]
