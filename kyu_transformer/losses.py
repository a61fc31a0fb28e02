"""Label-smoothed cross-entropy over padded token sequences."""

import keras
from keras import ops
# `Loss.__call__` reads the mask of `call`'s output with `get_keras_mask`. A
# JAX value traced by `jit` (as `fit` runs the loss) refuses a plain attribute:
# Keras' setter then keeps the mask in the table that `get_keras_mask` reads.
# Keras 3.15 exports it from `keras.src.backend` only; the public path is used
# when a Keras version provides it.
set_keras_mask = getattr(keras.backend, "set_keras_mask", None)
if set_keras_mask is None:
    from keras.src.backend import set_keras_mask

from kyu_transformer.layers import _check_rate


@keras.saving.register_keras_serializable(package="kyu_transformer")
class LabelSmoothedCrossEntropy(keras.losses.Loss):
    """Cross-entropy against ``label_smoothing(one_hot(labels), epsilon)``.

    Averaged over the non-padding tokens only. The smoothed one-hot tensor is
    never built: with ``log p = logits - logsumexp(logits)``,
    ``-sum_v q_v log p_v = logsumexp - (1 - eps) * logit_y - eps * mean_v logit_v``.
    Computed in float32 whatever the compute dtype of the logits.

    `call` returns the per-token losses `(N, T)` with the Keras mask
    ``labels != pad_id`` attached, and Keras reduces them: with the default
    ``reduction="sum_over_batch_size"`` Keras divides the sum by the number of
    unmasked tokens, which makes the loss the mean over non-padding tokens.
    When the logits carry a Keras mask of their own (e.g. from an `Embedding`
    upstream), Keras combines the two, and a token counts only where both keep
    it. Under a `tf.distribute` strategy Keras also divides each replica's
    mean by the number of replicas and sums the gradients, so `model.fit`
    minimizes (and reports) the mean of the replicas' means: the same as on one
    device when the replicas hold equal numbers of tokens, not otherwise. As
    with Keras' own losses, a direct call inside a strategy's scope is divided
    by the number of replicas too. The project's `Trainer` normalizes by the
    token count of the whole global batch instead, from `token_losses`.

    Args:
      epsilon: Smoothing rate.
      pad_id: Label id that is padding (ignored in the mean).
      from_logits: If False, `y_pred` holds probabilities.
      reduction: Keras' reduction of the masked per-token losses:
        ``"sum_over_batch_size"`` (default) or ``"mean"``, the mean over
        non-padding tokens; ``"sum"``, their sum;
        ``"mean_with_sample_weight"``, the sum divided by the sample weights
        summed over non-padding tokens (without weights, their count);
        ``"none"`` or None, the `(N, T)` losses, 0 at padding.
      name: Name of the loss.
      fast_paths: If True (the default), the gradient with respect to the
        logits is the stated one of `_stated_gradient_cross_entropy`; if
        False, automatic differentiation through the same formula.
      **kwargs: Other `keras.losses.Loss` arguments (`dtype`).

    Call arguments:
      y_true: Integer labels `(N, T)`.
      y_pred: Logits (or probabilities) `(N, T, V)`.
      sample_weight: Optional weights, `(N, 1)` per sequence or `(N, T)` per
        token, multiplied into the masked per-token losses as Keras does; the
        default reduction still divides by the number of non-padding tokens.

    Returns:
      With the default reduction, the scalar mean loss per non-padding token
      (0 if there is none); otherwise as `reduction` says.
      `token_losses` gives the `(N, T)` per-token losses (0 at padding), for
      callers that normalize across replicas themselves.
    """

    def __init__(self, epsilon=0.1, pad_id=0, from_logits=True,
                 reduction="sum_over_batch_size", name="label_smoothed_cross_entropy",
                 fast_paths=True, **kwargs):
        super().__init__(name=name, reduction=reduction, **kwargs)
        _check_rate("epsilon", epsilon)
        self.epsilon = float(epsilon)
        self.pad_id = int(pad_id)
        self.from_logits = bool(from_logits)
        self.fast_paths = bool(fast_paths)

    def token_losses(self, y_true, y_pred):
        """Per-token losses `(N, T)` in float32, 0 at padding positions."""
        labels = ops.cast(y_true, "int32")
        if self.from_logits:
            cross_entropy = (_stated_gradient_cross_entropy if self.fast_paths
                             else _smoothed_cross_entropy)
            losses = cross_entropy(y_pred, labels, self.epsilon)
        else:
            log_probs = ops.log(ops.clip(ops.cast(y_pred, "float32"), 1e-7, 1.0))
            label_log_probs = ops.take_along_axis(log_probs, labels[..., None], axis=-1)[..., 0]
            losses = (-(1.0 - self.epsilon) * label_log_probs
                      - self.epsilon * ops.mean(log_probs, axis=-1))  # (N, T)
        return ops.where(ops.not_equal(labels, self.pad_id), losses, ops.zeros_like(losses))

    def call(self, y_true, y_pred):
        losses = self.token_losses(y_true, y_pred)  # (N, T)
        # Keras turns this mask into weights (and ANDs it with any mask of the
        # logits), divides by the kept tokens and scales for distribution.
        # Reducing here would hide the token count from Keras: it would neither
        # divide the mean by the number of replicas nor apply a mask of the
        # logits before reducing (it would multiply the reduced value by it).
        set_keras_mask(losses, ops.not_equal(ops.cast(y_true, "int32"), self.pad_id))
        return losses

    def get_config(self):
        config = super().get_config()  # name, reduction; configs without it get the default
        # Configs saved without `fast_paths` load with the default, True.
        config.update(epsilon=self.epsilon, pad_id=self.pad_id, from_logits=self.from_logits,
                      fast_paths=self.fast_paths)
        return config


def _smoothed_cross_entropy(logits, labels, epsilon):
    """Per-token smoothed cross-entropy `(N, T)` of logits `(N, T, V)`, in float32.

    ``logsumexp(logits) - (1 - eps) * logit_y - eps * mean_v logit_v``,
    differentiated automatically.
    """
    full = ops.cast(logits, "float32")  # (N, T, V)
    label_logits = ops.take_along_axis(full, labels[..., None], axis=-1)[..., 0]  # (N, T)
    return (ops.logsumexp(full, axis=-1) - (1.0 - epsilon) * label_logits
            - epsilon * ops.mean(full, axis=-1))


# ----------------------------------------------------- fast path: stated gradient


def _stated_gradient_cross_entropy(logits, labels, epsilon):
    """`_smoothed_cross_entropy`, with its gradient with respect to the logits written out.

    The gradient is ``softmax(logits) - (1 - eps) * one_hot(label) - eps / V``
    (times the upstream gradient). Left to automatic differentiation, the
    label-logit gather back-propagates through a scatter over the whole
    `(N, T, V)` tensor. Here the gradient reuses the forward pass's
    exponentials, and the one-hot term is a comparison of each class index
    with the label inside the same expression: compiled with XLA (as the
    trainer and Keras' `fit` compile the loss), the gradient is one fused
    pass over the logits.
    """
    vocab = logits.shape[-1]

    @ops.custom_gradient
    def forward(logits):
        full = ops.cast(logits, "float32")  # (N, T, V)
        row_max = ops.max(full, axis=-1, keepdims=True)  # (N, T, 1)
        exponentials = ops.exp(full - row_max)  # (N, T, V)
        normalizer = ops.sum(exponentials, axis=-1)  # (N, T)
        log_normalizer = row_max[..., 0] + ops.log(normalizer)  # (N, T)
        label_logits = ops.take_along_axis(full, labels[..., None], axis=-1)[..., 0]  # (N, T)
        losses = (log_normalizer - (1.0 - epsilon) * label_logits
                  - epsilon * ops.mean(full, axis=-1))

        def grad(*args, upstream=None):
            if upstream is None:
                (upstream,) = args
            is_label = ops.equal(ops.arange(vocab, dtype="int32"), labels[..., None])  # (N, T, V)
            label_term = ((1.0 - epsilon) * upstream)[..., None]  # (N, T, 1)
            gradient = (exponentials * (upstream / normalizer)[..., None]
                        - (epsilon / vocab * upstream)[..., None]
                        - ops.where(is_label, label_term, ops.zeros_like(label_term)))  # (N, T, V)
            return ops.cast(gradient, logits.dtype)

        return losses, grad

    return forward(logits)
