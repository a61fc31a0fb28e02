"""One training step under any tf.distribute strategy.

Keras 3's ``model.fit`` fails under ``MultiWorkerMirroredStrategy``
(keras-team/keras#20585), so the step is our own: ``strategy.run`` inside a
``tf.function``, the loss summed over tokens and divided by the token count of
the *global* batch (all replicas), gradients all-reduced by the Keras optimizer.
"""

import keras
import tensorflow as tf

from kyu_transformer.metrics import masked_accuracy_counts


def loss_terms_function(loss_fn, xla=True):
    """``loss_terms(labels, logits)`` -> ``(loss_sum, correct, tokens)``; XLA-compiled if `xla`.

    The summed token losses of `loss_fn`, the top-1 hits and the non-padding
    tokens of a batch. With `xla` (a fast path), only this is compiled, not
    the step: the loss makes several element-wise passes over the `(N, T, V)`
    logits, which XLA fuses into a few loops and whose row maxima it shares
    between the loss and the hits, while the matrix products stay on
    TensorFlow's oneDNN kernels, faster than XLA's in bfloat16.
    """
    def loss_terms(labels, logits):
        token_losses = loss_fn.token_losses(labels, logits)  # (N, T)
        correct, tokens = masked_accuracy_counts(labels, logits)
        return tf.reduce_sum(token_losses), correct, tokens

    return tf.function(loss_terms, jit_compile=True) if xla else loss_terms


class TrainStep:
    """``step(iterator)`` -> ``(has_batch, loss_sum, correct, tokens)`` on the next global batch.

    Args:
      strategy: The `tf.distribute.Strategy` the model and optimizer live in.
      model: The model; called as ``model(features, training=True)``.
      optimizer: A Keras optimizer (a `LossScaleOptimizer` scales the loss).
      loss_terms: A function from `loss_terms_function`.
      jit_compile: Whether to compile the whole step with XLA.

    ``has_batch`` is False at the end of the data, and the sums (over all
    replicas) are then 0.
    """

    def __init__(self, strategy, model, optimizer, loss_terms, jit_compile=False):
        self.strategy = strategy
        self.model = model
        self.optimizer = optimizer
        self.loss_terms = loss_terms
        self.function = tf.function(self._distributed_step, jit_compile=jit_compile or None,
                                    reduce_retracing=True)

    def __call__(self, iterator):
        return self.function(iterator)

    def _replica_step(self, features, labels):
        replica = tf.distribute.get_replica_context()
        with tf.GradientTape() as tape:
            logits = self.model(features, training=True)  # (n, T, V)
            loss_sum, correct, tokens = self.loss_terms(labels, logits)
            global_tokens = replica.all_reduce(tf.distribute.ReduceOp.SUM, tokens)
            loss = loss_sum / tf.maximum(global_tokens, 1.0)
            scaled_loss = (self.optimizer.scale_loss(loss)
                           if isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer)
                           else loss)
        gradients = tape.gradient(scaled_loss, self.model.trainable_variables)
        self.optimizer.apply_gradients(zip(gradients, self.model.trainable_variables))
        return loss_sum, correct, tokens

    def _distributed_step(self, iterator):
        """One step on the next global batch; ``has_batch`` False at the end of the data.

        (A bare `next()` would raise at the end, but only after the optimizer
        had counted one more iteration: ops that do not wait for the batch run.)
        """
        batch = iterator.get_next_as_optional()
        if not batch.has_value():
            return tf.constant(False), tf.constant(0.0), tf.constant(0.0), tf.constant(0.0)
        per_replica = self.strategy.run(self._replica_step, args=batch.get_value())
        totals = [self.strategy.reduce(tf.distribute.ReduceOp.SUM, value, axis=None)
                  for value in per_replica]
        return (tf.constant(True), *totals)
