"""Computes label-smoothed cross-entropy over padded token sequences."""

import keras
from keras import ops

from kyu_transformer.conventions import PAD_ID, check_rates

# `Loss.__call__` reads `call`'s output mask with `get_keras_mask`; a JAX tracer refuses a
# plain attribute, so Keras' setter is used (public only in newer Keras versions).
set_keras_mask = getattr(keras.backend, "set_keras_mask", None) or keras.src.backend.set_keras_mask


@keras.saving.register_keras_serializable(package="kyu_transformer")
class LabelSmoothedCrossEntropy(keras.losses.Loss):
    """Computes the cross-entropy of logits against ``label_smoothing(one_hot(labels),
    epsilon)`` in float32, ignoring padding labels.

    The smoothed one-hot tensor is never built: with ``log p = logits - logsumexp(logits)``,
    ``-sum_v q_v log p_v = logsumexp - (1 - eps) * logit_y - eps * mean_v logit_v``.
    `call` masks the per-token losses at padding for Keras to reduce; under a strategy Keras
    averages the replicas' means, where the `Trainer` divides by the global token count.

    Args:
      epsilon: Smoothing rate; pad_id: label id that is padding (ignored in the mean).
      from_logits: If False, `y_pred` holds probabilities.
      reduction: Keras' reduction of the masked per-token losses; the default is the mean
        over non-padding tokens, ``"none"`` gives the `(N, T)` losses (0 at padding).
      name: Name of the loss; **kwargs: other `keras.losses.Loss` arguments (`dtype`).
      fast_paths: If True (default), `_stated_gradient_cross_entropy`'s stated gradient.

    Call arguments:
      y_true: Integer labels `(N, T)`; y_pred: logits (or probabilities) `(N, T, V)`.
      sample_weight: Optional `(N, 1)` or `(N, T)` weights, applied as Keras does; the
        default reduction still divides by the number of non-padding tokens.

    Returns:
      The reduced loss (by default the mean per non-padding token, 0 if none).
    """

    def __init__(self, epsilon=0.1, pad_id=PAD_ID, from_logits=True,
                 reduction="sum_over_batch_size", name="label_smoothed_cross_entropy",
                 fast_paths=True, **kwargs):
        super().__init__(name=name, reduction=reduction, **kwargs)
        check_rates(epsilon=epsilon)
        self.epsilon, self.pad_id = float(epsilon), int(pad_id)
        self.from_logits, self.fast_paths = bool(from_logits), bool(fast_paths)

    def token_losses(self, y_true, y_pred):
        """Returns the per-token losses `(N, T)` in float32, 0 at padding positions."""
        labels = ops.cast(y_true, "int32")
        if self.from_logits and self.fast_paths:
            losses = _stated_gradient_cross_entropy(y_pred, labels, self.epsilon)
        elif self.from_logits:
            full = ops.cast(y_pred, "float32")  # (N, T, V)
            losses = _smoothed(ops.logsumexp(full, axis=-1), full, labels, self.epsilon)
        else:
            log_probs = ops.log(ops.clip(ops.cast(y_pred, "float32"), 1e-7, 1.0))
            losses = _smoothed(0.0, log_probs, labels, self.epsilon)  # (N, T)
        return ops.where(ops.not_equal(labels, self.pad_id), losses, ops.zeros_like(losses))

    def call(self, y_true, y_pred):
        losses = self.token_losses(y_true, y_pred)  # (N, T)
        # Reducing here would hide the token count from Keras: it would neither scale for
        # distribution nor apply a mask of the logits before reducing.
        set_keras_mask(losses, ops.not_equal(ops.cast(y_true, "int32"), self.pad_id))
        return losses

    def get_config(self):
        return dict(super().get_config(), epsilon=self.epsilon, pad_id=self.pad_id,
                    from_logits=self.from_logits, fast_paths=self.fast_paths)


def _smoothed(base, scores, labels, epsilon):
    """Returns ``base - (1 - eps) * scores_y - eps * mean_v scores_v`` `(N, T)` of scores
    `(N, T, V)`: the smoothed cross-entropy, `base` being the scores' log-normalizer (0 for
    log-probabilities)."""
    label_scores = ops.take_along_axis(scores, labels[..., None], axis=-1)[..., 0]  # (N, T)
    return base - (1.0 - epsilon) * label_scores - epsilon * ops.mean(scores, axis=-1)


def _stated_gradient_cross_entropy(logits, labels, epsilon):
    """Computes the smoothed cross-entropy `(N, T)` of logits `(N, T, V)` in float32, with a
    stated gradient (a fast path).

    ``softmax(logits) - (1 - eps) * one_hot(label) - eps / V`` times the upstream gradient:
    it reuses the forward exponentials, and the one-hot is a comparison inside the same
    expression, so XLA fuses it into one pass over the logits (autodiff would scatter the
    label gather's gradient over the whole `(N, T, V)` tensor).
    """
    vocab = logits.shape[-1]

    @ops.custom_gradient
    def forward(logits):
        full = ops.cast(logits, "float32")  # (N, T, V)
        row_max = ops.max(full, axis=-1, keepdims=True)  # (N, T, 1)
        exponentials = ops.exp(full - row_max)  # (N, T, V)
        normalizer = ops.sum(exponentials, axis=-1)  # (N, T)
        log_normalizer = row_max[..., 0] + ops.log(normalizer)  # (N, T)

        def grad(*args, upstream=None):
            if upstream is None:
                (upstream,) = args
            is_label = ops.equal(ops.arange(vocab, dtype="int32"), labels[..., None])  # (N, T, V)
            label_term = ((1.0 - epsilon) * upstream)[..., None]  # (N, T, 1)
            gradient = (exponentials * (upstream / normalizer)[..., None]
                        - (epsilon / vocab * upstream)[..., None]
                        - ops.where(is_label, label_term, ops.zeros_like(label_term)))  # (N, T, V)
            return ops.cast(gradient, logits.dtype)

        return _smoothed(log_normalizer, full, labels, epsilon), grad

    return forward(logits)
