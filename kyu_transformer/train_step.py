"""One training step under any tf.distribute strategy.

Keras 3's ``fit`` fails under ``MultiWorkerMirroredStrategy`` (keras-team/keras#20585), so
the step is our own: the loss summed over tokens, divided by the *global* batch's count.
"""

import keras
import tensorflow as tf

from kyu_transformer.metrics import masked_accuracy_counts


def loss_terms_function(loss_fn, xla=True):
    """``loss_terms(labels, logits)`` -> ``(loss_sum, correct, tokens)``; XLA-compiled if `xla`.

    With `xla` (a fast path) XLA fuses the loss's passes over the `(N, T, V)` logits and
    shares their row maxima with the hits, while the step's matrix products stay on
    TensorFlow's oneDNN kernels, faster than XLA's in bfloat16.
    """
    def loss_terms(labels, logits):
        token_losses = loss_fn.token_losses(labels, logits)  # (N, T)
        correct, tokens = masked_accuracy_counts(labels, logits)
        return tf.reduce_sum(token_losses), correct, tokens

    return tf.function(loss_terms, jit_compile=True) if xla else loss_terms


class TrainStep:
    """``step(iterator)`` -> ``(has_batch, loss_sum, correct, tokens, stops)`` on the next batch.

    Args:
      strategy: The `tf.distribute.Strategy` the model and optimizer live in.
      model: The model; called as ``model(features, training=True)``.
      optimizer: A Keras optimizer (a `LossScaleOptimizer` scales the loss).
      loss_terms: A function from `loss_terms_function`.
      jit_compile: Whether to compile the whole step with XLA.

    ``has_batch`` is False (and the sums 0) at the end of the data. ``stops`` counts the
    replicas whose process called `request_stop`: it rides on the token count's all-reduce,
    so every worker learns of any stop after the same update, at no cost.
    """

    def __init__(self, strategy, model, optimizer, loss_terms, jit_compile=False):
        self.strategy, self.model = strategy, model
        self.optimizer, self.loss_terms = optimizer, loss_terms
        # This process's request, outside the strategy: every worker has its own.
        self.stop_requested = tf.Variable(0.0, trainable=False, name="stop_requested")
        self.function = tf.function(self._distributed_step, jit_compile=jit_compile or None,
                                    reduce_retracing=True)

    def __call__(self, iterator):
        return self.function(iterator)

    def request_stop(self):
        """Asks every worker to stop after the next step (see ``stops``)."""
        self.stop_requested.assign(1.0)

    def _replica_step(self, features, labels):
        replica = tf.distribute.get_replica_context()
        with tf.GradientTape() as tape:
            logits = self.model(features, training=True)  # (n, T, V)
            loss_sum, correct, tokens = self.loss_terms(labels, logits)
            tokens_and_stops = replica.all_reduce(
                tf.distribute.ReduceOp.SUM,
                tf.stack([tokens, tf.cast(self.stop_requested, tokens.dtype)]))  # (2,)
            loss = loss_sum / tf.maximum(tokens_and_stops[0], 1.0)
            scaled_loss = (self.optimizer.scale_loss(loss)
                           if isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer)
                           else loss)
        gradients = tape.gradient(scaled_loss, self.model.trainable_variables)
        self.optimizer.apply_gradients(zip(gradients, self.model.trainable_variables))
        return loss_sum, correct, tokens, tokens_and_stops[1]

    def _distributed_step(self, iterator):
        """One step on the next global batch (a bare `next()` would raise at the end only
        after the optimizer counted one more iteration)."""
        batch = iterator.get_next_as_optional()
        if not batch.has_value():
            return (tf.constant(False), *[tf.constant(0.0)] * 4)
        *sums, stops = self.strategy.run(self._replica_step, args=batch.get_value())
        totals = [self.strategy.reduce(tf.distribute.ReduceOp.SUM, value, axis=None)
                  for value in sums]
        # Already summed over all replicas: every replica holds the same count.
        return (tf.constant(True), *totals, self.strategy.experimental_local_results(stops)[0])
