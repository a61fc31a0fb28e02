"""Searches over batches with a key/value cache: greedy search, beam search and sampling.

One `keras.ops.while_loop`, `search`, serves every strategy (`GreedySearch`, `BeamSearch`,
`SamplingSearch`): the encoder runs once per batch, the decoder one cached position a step
(`Transformer.decode_step`) until every sentence is done, each at its own limit. A target prefix
forces each sentence's first tokens in every strategy (`forced_tokens`): they are scored by the
model as forced decoding scores them, and the search goes on from them.
"""

import collections

import numpy as np
import tensorflow as tf
from keras import ops

from kyu_transformer.conventions import BOS_ID, EOS_ID, PAD_ID
from kyu_transformer.decoding.scoring import length_penalty
from kyu_transformer.decoding.settings import SearchSettings, checked_max_length

_NEG_INF = -1.0e9  # score of impossible hypotheses (finite: no NaN in sums)
# The score of a missing hypothesis where a fixed number is given (the SavedModel's `n_best`
# columns).
NO_HYPOTHESIS_SCORE = _NEG_INF


def output_limit(source_length, maxlen1, max_length, length_margin):
    """Returns a sentence's most output tokens, EOS included, as every path limits them
    (`Engine.output_limits`): ``min(max_length, min(source_length + 1, maxlen1) +
    length_margin)``. `source_length` (without EOS) is an int, an int array (numpy out) or a
    tensor; `max_length` comes from `checked_max_length`."""
    minimum = ops.minimum if tf.is_tensor(source_length) else np.minimum
    return minimum(max_length, minimum(source_length + 1, maxlen1) + length_margin)


def _limits(max_length, batch):
    """Returns ``(limits (N,), bound)`` from one Python int or a tensor `(N,)` of limits."""
    if isinstance(max_length, (int, np.integer)):
        max_length = int(checked_max_length(max_length))
        return ops.full((batch,), max_length, "int32"), max_length
    limits = ops.cast(max_length, "int32")
    return limits, ops.max(limits)


def _at_limit(step, state):
    """Tells for each sentence whether the token of `step` is the last it may have (its limit
    counts EOS)."""
    return ops.greater_equal(step + 1, state["limits"])


def _scored(log_probs, ids, alpha):
    """Divides `log_probs` by GNMT's length penalty of `ids`, whose last axis holds each
    hypothesis' tokens (padding is no token): a hypothesis' score."""
    lengths = ops.sum(ops.cast(ops.not_equal(ids, PAD_ID), "int32"), axis=-1)
    return log_probs / length_penalty(lengths, alpha)


# Beam layout: slot ``l * K + j`` of a sentence's self-attention cache holds position `l` of
# its hypothesis `j`-th when made. The cache is never reordered; `history` `(N, K, l * K)` marks
# the slots each hypothesis descends from (`_self_mask`).


def own_history(length, hypotheses):
    """Returns the boolean history ``(1, K, length*K)`` in which slot ``l * K + j`` is seen by
    hypothesis `j` alone."""
    slots = ops.arange(length * hypotheses)[None, :]  # (1, length*K)
    return ops.equal(slots % hypotheses, ops.arange(hypotheses)[:, None])[None]


def _self_mask(history):
    """Returns ``history`` `(N, K, l*K)` with each hypothesis' newest slot added:
    `(N, K, (l+1)*K)`."""
    batch, k = ops.shape(history)[0], history.shape[1]
    own_slots = ops.broadcast_to(ops.eye(k, dtype="bool")[None], (batch, k, k))  # (N, K, K)
    return ops.concatenate([history, own_slots], axis=2)


def _relaxed(structure):
    """Returns `structure` with its tensors' batch axis (and third) unknown to the graph,
    because in the loop sentences may leave the batch and caches grow."""
    def relax(tensor):
        if not isinstance(tensor, tf.Tensor) or len(tensor.shape) == 0:
            return tensor
        shape = [None if axis in (0, 2) else size for axis, size in enumerate(tensor.shape)]
        return tf.raw_ops.PlaceholderWithDefault(input=tensor, shape=shape)

    return tf.nest.map_structure(relax, structure)


def _gather_beams(tensor, indices):
    """Returns ``tensor[n, indices[n, j], ...]``, by one batched `tf.gather` rather than
    `ops.take_along_axis`."""
    return tf.gather(tensor, indices, batch_dims=1)


def _block_width(vocab):
    """Returns a divisor of `vocab` near its square root (the blocks of `_top_k_rows`), or
    None."""
    root = int(np.sqrt(vocab))
    for distance in range(root // 2):
        for width in (root + distance, root - distance):
            if width > 1 and vocab % width == 0:
                return width
    return None


def _top_k_rows(values, count):
    """Computes ``ops.top_k`` of rows `(R, V)` (ties aside) in blocks of about ``sqrt(V)``,
    the `count` of largest maxima holding the top `count`; returns ``(values, indices, maxima
    (R, 1))``."""
    vocab = values.shape[-1]
    width = _block_width(vocab)
    if width is None or vocab // width <= count:
        best, indices = ops.top_k(values, count)
        return best, indices, ops.max(values, axis=-1, keepdims=True)
    rows = ops.shape(values)[0]
    block_maxima = ops.max(ops.reshape(values, (rows, vocab // width, width)), axis=-1)  # (R, B)
    _, best_blocks = ops.top_k(block_maxima, count)  # (R, count)
    # Gathered as rows of a (R*B, W) matrix: no transpose of the whole input.
    block_rows = best_blocks + ops.arange(rows)[:, None] * (vocab // width)  # (R, count)
    candidates = tf.gather(ops.reshape(values, (-1, width)), block_rows)  # (R, count, W)
    best, flat = ops.top_k(ops.reshape(candidates, (rows, count * width)), count)
    indices = _gather_beams(best_blocks, flat // width) * width + flat % width
    return best, indices, ops.max(block_maxima, axis=-1, keepdims=True)


def _top_extensions(logits, alive_scores, count, forced=None):
    """Returns ``(scores, beams, tokens)`` `(N, count)`: the best one-token extensions of
    `logits` `(N, K, V)` and `alive_scores` `(N, K)`, best first (no `(N, K, V)` log-softmax
    made). Where `forced` `(N,)` holds a token (not `PAD_ID`), a sentence's hypotheses extend by
    it alone, scored by its log-probability; the other extensions are impossible."""
    batch, hypotheses, vocab = ops.shape(logits)[0], logits.shape[1], logits.shape[2]
    rows = ops.reshape(ops.cast(logits, "float32"), (-1, vocab))  # (N*K, V)
    if forced is not None:
        row_forced = ops.repeat(forced, hypotheses)[:, None]  # (N*K, 1)
        maxima = ops.max(rows, axis=-1, keepdims=True)  # the normalizer's: of every token
        barred = ops.logical_and(ops.not_equal(row_forced, PAD_ID),
                                 ops.not_equal(ops.arange(vocab)[None, :], row_forced))
        best_logits, best_tokens, _ = _top_k_rows(ops.where(barred, _NEG_INF, rows), count)
    else:
        best_logits, best_tokens, maxima = _top_k_rows(rows, count)  # (N*K, count), .., (N*K, 1)
    # logsumexp, reusing the row maxima the top-k has already found (one pass fewer).
    normalizer = maxima + ops.log(ops.sum(ops.exp(rows - maxima), axis=-1, keepdims=True))
    candidates = ops.reshape(best_logits - normalizer, (batch, hypotheses * count))
    candidates = candidates + ops.repeat(alive_scores, count, axis=1)  # (N, K*count)
    scores, flat = ops.top_k(candidates, count)
    tokens = _gather_beams(ops.reshape(best_tokens, (batch, hypotheses * count)), flat)
    return scores, flat // count, ops.cast(tokens, "int32")


Hypotheses = collections.namedtuple("Hypotheses", "ids scores coverage")
Hypotheses.__doc__ = """Holds what `search` finds for `N` sentences, `K` hypotheses each, best
first.

`ids` `(N, K, L)`; `scores` `(N, K)`, log-probability (EOS included) over GNMT's length
penalty (None from `GreedySearch(scores=False)`); `coverage` `(N, L, S)`, the last block's
cross-attention averaged over heads (greedy search only, else None).
"""


def forced_tokens(prefix, step):
    """Returns the token each sentence must take at `step` `(N,)`, `PAD_ID` where it is free:
    `prefix` `(N, P)` holds each sentence's first tokens, padded with `PAD_ID` (P at least 1)."""
    width = ops.shape(prefix)[1]
    token = ops.take(prefix, ops.minimum(step, width - 1), axis=1)  # (N,)
    return ops.where(step < width, token, PAD_ID)


def search(model, source, max_length, strategy, prefix=None):
    """Returns the `Hypotheses` `strategy` finds with `model` (a `Transformer`) for `source`
    `(N, S)` (with EOS, 0-padded).

    `max_length`: most output tokens, EOS included, a Python int or an int tensor `(N,)` of
    each sentence's own; `strategy`: a `GreedySearch`, `BeamSearch` or `SamplingSearch`;
    `prefix`: None, or each sentence's forced first tokens `(N, P)` int32, padded with `PAD_ID`
    (``P >= 1``; a row of padding forces nothing), at most its limit.
    """
    memory, source_mask = model.encode(source, training=False)
    batch = ops.shape(source)[0]
    limits, bound = _limits(max_length, batch)
    # Ids as wide as any limit can be: their shapes repeat from batch to batch (`_ROW_GROUP`).
    width = max_length if isinstance(max_length, (int, np.integer)) else model.maxlen2
    cache = model.init_cache(memory, source_mask)
    table = cache.pop("target_table")  # the same for every sentence
    state = {**strategy.start(batch, bound, width, ops.shape(source)[1]),
             "limits": limits, "cache": cache, "done": ops.zeros((batch,), "bool")}
    if prefix is not None:  # in the state: it leaves with its sentence (`_retire`)
        state["prefix"] = ops.cast(prefix, "int32")
    results = strategy.no_results(batch, width)

    def unfinished(step, *_):
        return step < bound

    def body(step, state, results):
        tokens, self_mask = strategy.inputs(state)
        logits, cache, coverage = model.decode_step(
            tokens, step, {**state["cache"], "target_table": table}, self_mask)
        cache.pop("target_table")
        forced = forced_tokens(state["prefix"], step) if prefix is not None else None
        state = strategy.advance(step, logits, coverage, self_mask, {**state, "cache": cache},
                                 forced)
        all_done = ops.all(state["done"])
        state, results = strategy.leave(state, results, all_done)
        # Once all are done, jump to the end (the loop condition is on `step`).
        return ops.where(all_done, bound, step + 1), state, results

    _, state, results = ops.while_loop(unfinished, body, (0, _relaxed(state), results))
    return strategy.hypotheses(state, results, bound)


class _Strategy:
    """Defines what `search` asks of a strategy: `start` gives the state, `inputs` a step's
    tokens and self-attention mask, `advance` the next state (taking the `forced_tokens` of the
    step where a prefix is given, else None), `hypotheses` the result. `leave` may
    retire done sentences to `results` (`no_results` at the start); by default the state holds
    them all to the end."""

    def no_results(self, batch, width):
        """Returns the `results` before any sentence leaves: none by default."""
        return ()

    def leave(self, state, results, all_done):
        """Returns ``(state, results)`` unchanged: by default no sentence leaves early."""
        return state, results

    def inputs(self, state):
        """Returns a step's tokens `(N, K)` and the self-attention mask of their hypotheses."""
        return state["last"], _self_mask(state["history"])  # beam search and sampling


class GreedySearch(_Strategy):
    """Picks the most likely next token, one hypothesis per sentence, and records the
    `coverage`.

    `alpha` only scores; `scores` False saves a log-sum-exp a step (scores are then None).
    """

    def __init__(self, alpha, scores=True):
        self.alpha, self.scores = float(alpha), bool(scores)

    def start(self, batch, bound, width, source_length):
        return {"last": ops.full((batch,), BOS_ID, "int32"),
                "ids": ops.zeros((batch, bound), "int32"),
                "coverage": ops.zeros((batch, bound, source_length), "float32"),
                "log_probs": ops.zeros((batch,), "float32")}

    def inputs(self, state):
        return state["last"], None  # one query per sentence: it sees every cache slot

    def advance(self, step, logits, coverage, self_mask, state, forced=None):
        done = state["done"]
        chosen = ops.cast(ops.argmax(logits, axis=-1), "int32")  # (N,)
        if forced is not None:
            chosen = ops.where(ops.equal(forced, PAD_ID), chosen, forced)
        chosen = ops.where(done, PAD_ID, chosen)  # finished sentences stay padded
        log_probs = state["log_probs"]
        if self.scores:
            # log p(chosen) = logit - logsumexp; the logit of the argmax is the maximum itself.
            logits = ops.cast(logits, "float32")
            best = ops.max(logits, axis=-1, keepdims=True)  # (N, 1)
            log_prob = -ops.log(ops.sum(ops.exp(logits - best), axis=-1))  # (N,)
            if forced is not None:
                picked = ops.take_along_axis(logits, chosen[:, None], axis=-1)[:, 0]
                log_prob = log_prob + (picked - best[:, 0])
            # Padding (finished sentences, or a PAD picked) is no token: as forced decoding.
            log_probs = log_probs + ops.where(ops.equal(chosen, PAD_ID), 0.0, log_prob)
        limit_reached = _at_limit(step, state)
        return {**state, "last": chosen, "log_probs": log_probs,
                "ids": ops.slice_update(state["ids"], (0, step), chosen[:, None]),
                "coverage": ops.slice_update(state["coverage"], (0, step, 0),
                                             ops.cast(coverage, "float32")[:, None, :]),
                "done": ops.logical_or(done, ops.logical_or(ops.equal(chosen, EOS_ID),
                                                            limit_reached))}

    def hypotheses(self, state, results, bound):
        scores = None
        if self.scores:
            scores = _scored(state["log_probs"], state["ids"], self.alpha)[:, None]
        return Hypotheses(state["ids"][:, None], scores, state["coverage"])


class BeamSearch(_Strategy):
    """Searches with a beam of `beam_size` `K` and GNMT's length penalty (`alpha`), returning
    `n_best` hypotheses.

    Each step the ``2K`` best extensions of the ``K`` alive hypotheses are taken: those ending
    in EOS compete (scored ``log p / length_penalty``) for the ``K`` finished slots, the others
    for the ``K`` alive ones. A sentence is done when its worst finished score beats the best
    its alive ones could reach, or at its limit (where every extension may finish).
    """

    def __init__(self, beam_size, alpha, n_best=1):
        SearchSettings(beam_size=beam_size, n_best=n_best)  # refuses `n_best` over `beam_size`
        self.k, self.alpha, self.n_best = int(beam_size), float(alpha), int(n_best)

    def start(self, batch, bound, width, source_length):
        k = self.k
        # `rows`: each row's sentence of `source`, as done sentences leave (`_retire`).
        # Only the first beam is live at the start: the others would duplicate it.
        return {"rows": ops.arange(batch), "last": ops.full((batch, k), BOS_ID, "int32"),
                "history": ops.zeros((batch, k, 0), "bool"),
                "alive_ids": ops.zeros((batch, k, width), "int32"),
                "alive_scores": ops.tile(ops.convert_to_tensor([[0.0] + [_NEG_INF] * (k - 1)]),
                                         (batch, 1)),
                "finished_ids": ops.zeros((batch, k, width), "int32"),
                "finished_scores": ops.full((batch, k), _NEG_INF)}

    def no_results(self, batch, width):
        return (ops.zeros((batch, self.n_best, width), "int32"),
                ops.full((batch, self.n_best), _NEG_INF))

    def advance(self, step, logits, coverage, self_mask, state, forced=None):
        k, alpha = self.k, self.alpha
        top_scores, top_beams, top_tokens = _top_extensions(logits, state["alive_scores"], 2 * k,
                                                            forced)
        if forced is not None:  # impossible stays impossible, not a sum of impossibles
            top_scores = ops.where(top_scores < _NEG_INF / 2, _NEG_INF, top_scores)
        top_ids = ops.slice_update(_gather_beams(state["alive_ids"], top_beams), (0, 0, step),
                                   top_tokens[:, :, None])  # (N, 2K, L)
        ends = ops.equal(top_tokens, EOS_ID)
        # Alive: the K best extensions that do not end here.
        alive_scores, alive_pick = ops.top_k(ops.where(ends, _NEG_INF, top_scores), k)  # (N, K)
        history = _gather_beams(self_mask, _gather_beams(top_beams, alive_pick))  # kept beams'
        # Finished: the K best of those kept and those ending here (at the limit, all).
        done, limits = state["done"], state["limits"]
        at_limit = _at_limit(step, state)  # (N,)
        ending = ops.logical_or(ends, at_limit[:, None])
        ended_scores = ops.where(ending, top_scores / length_penalty(step + 1, alpha), _NEG_INF)
        ended_scores = ops.where(done[:, None], _NEG_INF, ended_scores)
        if forced is not None:  # an impossible extension does not finish (penalized, it would
            # look possible)
            ended_scores = ops.where(top_scores > _NEG_INF / 2, ended_scores, _NEG_INF)
        pool_scores = ops.concatenate([state["finished_scores"], ended_scores], axis=1)  # (N, 3K)
        pool_ids = ops.concatenate([state["finished_ids"], top_ids], axis=1)
        finished_scores, finished_pick = ops.top_k(pool_scores, k)
        # Done when the best alive score, under its largest penalty, cannot beat the worst finished.
        best_possible = alive_scores[:, 0] / length_penalty(limits, alpha)
        worst_finished = finished_scores[:, k - 1]
        beaten = ops.logical_and(worst_finished > _NEG_INF / 2, best_possible < worst_finished)
        return {**state, "last": _gather_beams(top_tokens, alive_pick), "history": history,
                "alive_ids": _gather_beams(top_ids, alive_pick), "alive_scores": alive_scores,
                "finished_ids": _gather_beams(pool_ids, finished_pick),
                "finished_scores": finished_scores,
                "done": ops.logical_or(done, ops.logical_or(at_limit, beaten))}

    def leave(self, state, results, all_done):
        # Leave once that removes a quarter of the rows (a step costs per row, leaving one copy).
        rows = ops.shape(state["done"])[0]
        worth_it = ops.logical_and(ops.logical_not(all_done),
                                   _kept_rows(state["done"]) * 4 <= rows * 3)
        return ops.cond(worth_it, lambda: _retire(state, results, self.n_best),
                        lambda: (state, results))

    def hypotheses(self, state, results, bound):
        # Every sentence still here is done: at the latest, its limit came.
        ids, scores = _write_results(results, state, self.n_best)
        return Hypotheses(ids[:, :, :bound], scores, None)


class SamplingSearch(_Strategy):
    """Draws `n` samples per sentence (`_draw`), scored as beam search scores, best first
    (duplicates kept).

    Sample `j` of sentence `i` draws from a random stream of ``(seed, i, j)`` alone (`_uniforms`),
    whatever its batch: `sentences` `(N,)` gives each row's ``i``, `seed` is an int64 scalar.
    """

    def __init__(self, topk, topp, temperature, n, alpha, seed, sentences):
        self.topk, self.topp, self.temperature = int(topk), float(topp), float(temperature)
        self.n, self.alpha, self.seed, self.sentences = int(n), float(alpha), seed, sentences

    def start(self, batch, bound, width, source_length):
        n = self.n
        return {"last": ops.full((batch, n), BOS_ID, "int32"),
                "history": ops.zeros((batch, n, 0), "bool"),
                "ids": ops.zeros((batch, n, bound), "int32"),
                "log_probs": ops.zeros((batch, n), "float32"),
                "finished": ops.zeros((batch, n), "bool")}

    def advance(self, step, logits, coverage, self_mask, state, forced=None):
        logits = ops.cast(logits, "float32")  # (N, n, V)
        uniforms = _uniforms(self.seed, self.sentences, self.n, step)  # (N, n)
        chosen = _draw(logits, self.temperature, self.topk, self.topp, uniforms)
        if forced is not None:  # (a draw is a hash of its step: drawing here shifts none later)
            chosen = ops.where(ops.equal(forced, PAD_ID)[:, None], chosen, forced[:, None])
        finished = state["finished"]
        chosen = ops.where(finished, PAD_ID, chosen)  # finished hypotheses stay padded
        best = ops.max(logits, axis=-1, keepdims=True)
        normalizer = best[..., 0] + ops.log(ops.sum(ops.exp(logits - best), axis=-1))
        log_prob = ops.take_along_axis(logits, chosen[..., None], axis=-1)[..., 0] - normalizer
        limit_reached = _at_limit(step, state)[:, None]  # (N, 1)
        finished = ops.logical_or(finished, ops.logical_or(ops.equal(chosen, EOS_ID),
                                                           limit_reached))
        return {**state, "last": chosen, "history": self_mask, "finished": finished,
                "log_probs": state["log_probs"] + ops.where(ops.equal(chosen, PAD_ID), 0.0,
                                                            log_prob),
                "ids": ops.slice_update(state["ids"], (0, 0, step), chosen[:, :, None]),
                "done": ops.all(finished, axis=1)}

    def hypotheses(self, state, results, bound):
        scores = _scored(state["log_probs"], state["ids"], self.alpha)  # (N, n)
        order = ops.argsort(-scores, axis=1)  # best first
        return Hypotheses(_gather_beams(state["ids"], order), _gather_beams(scores, order), None)


def _draw(logits, temperature, topk, topp, uniforms):
    """Draws one token per row of `logits` `(N, n, V)` with `uniforms` `(N, n)` in [0, 1),
    never PAD or BOS: the logits are divided by `temperature`, cut to the `topk` largest (0: all),
    then to the fewest whose renormalized probability reaches `topp`."""
    vocab = logits.shape[-1]
    ids = ops.arange(vocab)
    never = ops.logical_or(ops.equal(ids, PAD_ID), ops.equal(ids, BOS_ID))  # (V,)
    logits = ops.where(never, _NEG_INF, logits)
    # Shifted by the largest drawable logit before the division: a small temperature
    # cannot overflow; masked again after it: a large one cannot bring them back.
    logits = (logits - ops.max(logits, axis=-1, keepdims=True)) / temperature
    logits = ops.where(never, float("-inf"), logits)
    if topk == 0 and topp >= 1.0:
        values, tokens = logits, None  # no cut: no sorting either
    else:
        values, tokens = ops.top_k(logits, min(topk or vocab, vocab))  # (N, n, k), largest
    probs = ops.softmax(values, axis=-1)
    if topp < 1.0:
        # A token stays if the tokens before it fall short of `topp` (the first always stays).
        probs = ops.where(ops.cumsum(probs, axis=-1) - probs < topp, probs, 0.0)
    cumulative = ops.cumsum(probs, axis=-1)
    threshold = uniforms[..., None] * cumulative[..., -1:]
    picked = ops.sum(ops.cast(cumulative <= threshold, "int32"), axis=-1)
    picked = ops.minimum(picked, values.shape[-1] - 1)  # (N, n)
    if tokens is None:
        return picked
    return ops.take_along_axis(tokens, picked[..., None], axis=-1)[..., 0]


def _mix(hash_):
    """Applies MurmurHash3's 32-bit finalizer, under which every input bit changes each output
    bit with probability one half."""
    for shift, factor in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
        hash_ = tf.bitwise.bitwise_xor(hash_, tf.bitwise.right_shift(hash_, shift))
        hash_ = hash_ * tf.constant(factor, tf.uint32)
    return tf.bitwise.bitwise_xor(hash_, tf.bitwise.right_shift(hash_, 16))


def _uniforms(seed, sentences, n, step):
    """Returns uniforms in [0, 1) `(N, n)`, element ``(r, j)`` a hash of ``(seed,
    sentences[r], j, step)`` alone, so that a sentence draws the same anywhere in a batch
    (TensorFlow's stateless random ops take one seed per call, not one per row)."""
    seed = tf.cast(seed, tf.int64)
    words = [tf.cast(seed // (1 << 32), tf.uint32), tf.cast(seed % (1 << 32), tf.uint32)]
    hash_ = _mix(_mix(words[0]) + words[1])
    rows = _mix(hash_ + tf.cast(sentences, tf.uint32))[:, None]  # (N, 1)
    hash_ = _mix(rows + tf.cast(tf.range(n), tf.uint32)[None, :])  # (N, n)
    hash_ = _mix(hash_ + tf.cast(step, tf.uint32) + tf.constant(0x9E3779B9, tf.uint32))
    # 24 bits: exact in float32, and never 1.
    return tf.cast(tf.bitwise.right_shift(hash_, 8), tf.float32) / float(1 << 24)


def strategy_for(settings, n_best, scores=True, seed=0, sentences=None):
    """Returns the strategy that `settings` (a `SearchSettings`) asks for, for `n_best`
    hypotheses (`scores` applies to greedy search only)."""
    if settings.sampling:
        return SamplingSearch(settings.sampling_topk, settings.sampling_topp,
                              settings.sampling_temperature, n_best, settings.alpha, seed,
                              sentences)
    if settings.beam_size == 1:
        return GreedySearch(settings.alpha, scores)
    return BeamSearch(settings.beam_size, settings.alpha, n_best)


# Done sentences leave in groups: the undone stay, topped up with done ones (frozen) to a multiple
# of `_ROW_GROUP` rows, so (ids of a fixed width) a batch meets the shapes earlier ones met.
_ROW_GROUP = 16


def _kept_rows(done):
    """Counts the rows that stay when the done sentences leave: the undone, rounded up to a
    group."""
    undone = ops.sum(ops.cast(ops.logical_not(done), "int32"))
    return ops.minimum(ops.shape(done)[0], -(-undone // _ROW_GROUP) * _ROW_GROUP)


def _retire(state, results, n_best):
    """Writes the done sentences' best hypotheses to `results`; keeps the undone (`_ROW_GROUP`)."""
    leaving = ops.nonzero(state["done"])[0]
    results = _write_results(results, {name: tf.gather(state[name], leaving) for name in
                                       ("rows", "finished_ids", "finished_scores")}, n_best)
    staying = ops.argsort(ops.cast(state["done"], "int32"))[:_kept_rows(state["done"])]
    # `tf.gather`: the indices are never negative, and `ops.take` would wrap negative ones
    # for every tensor.
    state = tf.nest.map_structure(lambda tensor: tf.gather(tensor, staying), state)
    return state, results


def _write_results(results, state, n_best):
    """Returns `results` ``(ids, scores)`` with each of `state`'s sentences (its ``rows``) set
    to its `n_best` finished hypotheses and their scores."""
    sentences = state["rows"][:, None]
    return (ops.scatter_update(results[0], sentences, state["finished_ids"][:, :n_best]),
            ops.scatter_update(results[1], sentences, state["finished_scores"][:, :n_best]))
