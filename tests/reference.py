"""Numpy references of the layers' formulas, written from the paper and the original."""

import numpy as np


def layer_norm(x, gamma, beta, epsilon):
    mean = x.mean(-1, keepdims=True)
    variance = ((x - mean) ** 2).mean(-1, keepdims=True)  # biased
    return gamma * (x - mean) / np.sqrt(variance + epsilon) + beta


def scale_norm(x, gain, epsilon):
    """ScaleNorm: each vector scaled to length `gain` (Nguyen & Salazar 2019)."""
    return gain * x / np.sqrt((x ** 2).sum(-1, keepdims=True) + epsilon)


def softmax(x):
    shifted = np.exp(x - x.max(-1, keepdims=True))
    return shifted / shifted.sum(-1, keepdims=True)


def dense(layer, x, activation=None):
    y = x @ np.asarray(layer.kernel) + np.asarray(layer.bias)
    return np.maximum(y, 0) if activation == "relu" else y


def multihead_attention(layer, queries, keys=None, query_mask=None, key_mask=None,
                        causality=False, activation=None, norm_position="post"):
    """Attention computed element by element from the layer's weights.

    ``"post"``: ``LN(q + Attn(q, k, v))``; ``"pre"``: ``q + Attn(LN(q), k, v)``,
    where self-attention (`keys` None) also takes ``LN(q)`` as keys and values.
    """
    gamma, beta = np.asarray(layer.norm.gamma), np.asarray(layer.norm.beta)
    attending = queries
    if norm_position == "pre":
        attending = layer_norm(queries, gamma, beta, layer.epsilon)
    if keys is None:
        keys = attending
    n, t_q, _ = queries.shape
    t_k = keys.shape[1]
    h = layer.num_heads
    q = dense(layer.query_dense, attending, activation)
    k = dense(layer.key_dense, keys, activation)
    v = dense(layer.value_dense, keys, activation)
    d = q.shape[-1] // h
    heads = np.zeros((n, t_q, h * d))
    weights = np.zeros((n, h, t_q, t_k))
    for b in range(n):
        for head in range(h):
            cols = slice(head * d, (head + 1) * d)
            scores = q[b, :, cols] @ k[b, :, cols].T / np.sqrt(d)  # (T_q, T_k)
            allowed = np.ones((t_q, t_k), bool)
            if key_mask is not None:
                allowed &= key_mask[b][None, :]
            if causality:
                allowed &= np.tril(np.ones((t_q, t_k), bool))
            if query_mask is not None:
                allowed &= query_mask[b][:, None]
            w = np.where(allowed, softmax(np.where(allowed, scores, -1e30)), 0.0)
            weights[b, head] = w
            heads[b, :, cols] = w @ v[b, :, cols]
    if getattr(layer, "output_projection", False):
        heads = dense(layer.output_dense, heads)
    if norm_position == "pre":
        return queries + heads, weights
    return layer_norm(queries + heads, gamma, beta, layer.epsilon), weights
