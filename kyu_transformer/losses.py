"""Label-smoothed cross-entropy over padded token sequences."""

import keras
from keras import ops

from kyu_transformer.layers import _check_rate


@keras.saving.register_keras_serializable(package="kyu_transformer")
class LabelSmoothedCrossEntropy(keras.losses.Loss):
    """Cross-entropy against ``label_smoothing(one_hot(labels), epsilon)``.

    Averaged over the non-padding tokens only. The smoothed one-hot tensor is
    never built: with ``log p = logits - logsumexp(logits)``,
    ``-sum_v q_v log p_v = logsumexp - (1 - eps) * logit_y - eps * mean_v logit_v``.
    Computed in float32 whatever the compute dtype of the logits.

    Args:
      epsilon: Smoothing rate.
      pad_id: Label id that is padding (ignored in the mean).
      from_logits: If False, `y_pred` holds probabilities.

    Call arguments:
      y_true: Integer labels `(N, T)`.
      y_pred: Logits (or probabilities) `(N, T, V)`.

    Returns:
      The scalar mean loss per non-padding token (0 if there is none).
      `token_losses` gives the `(N, T)` per-token losses (0 at padding), for
      callers that normalize across replicas themselves.
    """

    def __init__(self, epsilon=0.1, pad_id=0, from_logits=True,
                 name="label_smoothed_cross_entropy", **kwargs):
        kwargs["reduction"] = "none"  # `call` already returns the masked mean
        super().__init__(name=name, **kwargs)
        _check_rate("epsilon", epsilon)
        self.epsilon = float(epsilon)
        self.pad_id = int(pad_id)
        self.from_logits = bool(from_logits)

    def token_losses(self, y_true, y_pred):
        """Per-token losses `(N, T)` in float32, 0 at padding positions."""
        labels = ops.cast(y_true, "int32")
        if self.from_logits:
            logits = ops.cast(y_pred, "float32")  # (N, T, V)
            log_normalizer = ops.logsumexp(logits, axis=-1)  # (N, T)
        else:
            logits = ops.log(ops.clip(ops.cast(y_pred, "float32"), 1e-7, 1.0))
            log_normalizer = ops.zeros_like(logits[..., 0])
        label_logits = ops.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]  # (N, T)
        losses = (log_normalizer - (1.0 - self.epsilon) * label_logits
                  - self.epsilon * ops.mean(logits, axis=-1))  # (N, T)
        return ops.where(ops.not_equal(labels, self.pad_id), losses, ops.zeros_like(losses))

    def call(self, y_true, y_pred):
        num_tokens = ops.sum(ops.cast(ops.not_equal(y_true, self.pad_id), "float32"))
        return ops.sum(self.token_losses(y_true, y_pred)) / ops.maximum(num_tokens, 1.0)

    def get_config(self):
        config = super().get_config()
        config.pop("reduction", None)
        config.update(epsilon=self.epsilon, pad_id=self.pad_id, from_logits=self.from_logits)
        return config
