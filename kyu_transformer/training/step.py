"""Runs one training step under any tf.distribute strategy (Keras 3's ``fit`` fails under
``MultiWorkerMirroredStrategy``, keras-team/keras#20585): the loss is summed over tokens and divided
by the *global* batch's count; with ``accumulate_steps`` N, one update on N batches is made as on
their union.
"""

import keras
import tensorflow as tf

from kyu_transformer.conventions import PAD_ID
from kyu_transformer.training.metrics import masked_accuracy_counts


def loss_terms_function(loss_fn, xla=True):
    """Returns ``loss_terms(labels, logits)`` -> ``(loss_sum, correct, tokens)``, compiled with
    XLA if `xla` (a fast path: XLA fuses the loss's passes over the logits, while the step's matrix
    products stay on TensorFlow's oneDNN kernels, faster than XLA's in bfloat16)."""
    def loss_terms(labels, logits):
        token_losses = loss_fn.token_losses(labels, logits)  # (N, T)
        correct, tokens = masked_accuracy_counts(labels, logits)
        return tf.reduce_sum(token_losses), correct, tokens

    return tf.function(loss_terms, jit_compile=True, autograph=False) if xla else loss_terms


class TrainStep:
    """Makes one update of `accumulate_steps` batches from an iterator of `Trainer.distribute`'s:
    ``step(iterator)`` -> ``(batches, loss_sum, correct, tokens, stops)`` (`loss_terms`: from
    `loss_terms_function`; `jit_compile`: the whole step compiled with XLA).

    ``batches`` counts the batches the update took: fewer at the end of the data, 0 (and the
    sums 0) once it has ended. ``stops`` counts the replicas whose process called
    `request_stop`: riding on the token count's all-reduce, it tells every worker of any stop
    after the same update, without a collective of its own.
    """

    def __init__(self, strategy, model, optimizer, loss_terms, jit_compile=False,
                 accumulate_steps=1):
        self.strategy, self.model, self.optimizer = strategy, model, optimizer
        self.loss_terms, self.accumulate_steps = loss_terms, accumulate_steps
        # This process's request, outside the strategy: every worker has its own.
        self.stop_requested = tf.Variable(0.0, trainable=False, name="stop_requested")
        step = self._distributed_step if accumulate_steps == 1 else self._accumulated_step
        # Its conditions are tf.cond's already: AutoGraph would only parse and rewrite the source
        # of every function the step calls, in every process that starts training.
        self.function = tf.function(step, jit_compile=jit_compile or None, reduce_retracing=True,
                                    autograph=False)

    def __call__(self, iterator):
        """Runs the step on `iterator`; returns ``(batches, loss_sum, correct, tokens, stops)``."""
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
            scaled_loss = self._scaled(loss)
        gradients = tape.gradient(scaled_loss, self.model.trainable_variables)
        self.optimizer.apply_gradients(zip(gradients, self.model.trainable_variables))
        return loss_sum, correct, tokens, tokens_and_stops[1]

    def _scaled(self, loss):
        if isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer):
            return self.optimizer.scale_loss(loss)
        return loss

    def _distributed_step(self, iterator):
        """Runs one step on the next global batch (a bare `next()` would raise at the end only
        after the optimizer counted one more iteration)."""
        batch = iterator.get_next_as_optional()

        def step():
            *sums, stops = self.strategy.run(self._replica_step, args=batch.get_value())
            # Already summed over all replicas: every replica holds the same count.
            return (tf.constant(1), *self._summed(sums),
                    self.strategy.experimental_local_results(stops)[0])

        return tf.cond(tf.logical_not(batch.has_value()),
                       lambda: (tf.constant(0), *[tf.constant(0.0)] * 4), step)

    def _accumulated_step(self, iterator):
        """Makes one update on the next `accumulate_steps` batches of an endless iterator: their
        tokens counted first, each batch's loss is divided by the count of all."""
        micro_batches = [next(iterator) for _ in range(self.accumulate_steps)]
        counts = self.strategy.run(self._counts, args=(micro_batches,))
        tokens_stops_rows = self.strategy.experimental_local_results(counts)[0]
        # The data ended where the batches have no rows (no real global batch is empty).
        batches = tf.reduce_sum(tf.cast(tokens_stops_rows[2:] > 0, tf.int32))

        def update():
            sums = self.strategy.run(self._replica_update, args=(micro_batches, counts))
            return (batches, *self._summed(sums), tokens_stops_rows[1])

        return tf.cond(tf.equal(batches, 0),
                       lambda: (batches, *[tf.constant(0.0)] * 3, tokens_stops_rows[1]), update)

    def _summed(self, values):
        return [self.strategy.reduce(tf.distribute.ReduceOp.SUM, value, axis=None)
                for value in values]

    def _counts(self, micro_batches):
        """Returns ``[tokens, stops, rows of each batch]`` summed over replicas in one
        all-reduce. A token is a label that is not padding, as the loss counts them."""
        tokens = tf.add_n([tf.reduce_sum(tf.cast(tf.not_equal(labels, PAD_ID), tf.float32))
                           for _, labels in micro_batches])
        rows = [tf.cast(tf.shape(labels)[0], tf.float32) for _, labels in micro_batches]
        return tf.distribute.get_replica_context().all_reduce(
            tf.distribute.ReduceOp.SUM,
            tf.stack([tokens, tf.cast(self.stop_requested, tf.float32), *rows]))

    def _replica_update(self, micro_batches, counts):
        """Computes the gradients of `micro_batches` one batch after another, then applies their
        sum once; returns the summed ``(loss_sum, correct, tokens)``."""
        variables, gradients, sums = self.model.trainable_variables, None, []
        for features, labels in micro_batches:
            if gradients is not None:  # a batch's forward pass waits for the last one's gradients
                done = [tensor for tensor in tf.nest.flatten(gradients, expand_composites=True)
                        if tensor is not None]
                with tf.control_dependencies(done):
                    features, labels = tf.nest.map_structure(tf.identity, (features, labels))
            with tf.GradientTape() as tape:
                logits = self.model(features, training=True)  # (n, T, V)
                loss_sum, correct, tokens = self.loss_terms(labels, logits)
                scaled_loss = self._scaled(loss_sum / tf.maximum(counts[0], 1.0))
            batch_gradients = tape.gradient(scaled_loss, variables)
            gradients = (batch_gradients if gradients is None else
                         [_added(total, more) for total, more in zip(gradients, batch_gradients)])
            sums.append((loss_sum, correct, tokens))
        self.optimizer.apply_gradients(zip(gradients, variables))
        return [tf.add_n(list(column)) for column in zip(*sums)]


def _added(total, more):
    """Returns the sum of two gradients of one variable (sparse ones stay sparse: their rows
    joined)."""
    if total is None or more is None:
        return more if total is None else total
    if isinstance(total, tf.IndexedSlices) and isinstance(more, tf.IndexedSlices):
        return tf.IndexedSlices(tf.concat([total.values, more.values], 0),
                                tf.concat([total.indices, more.indices], 0), total.dense_shape)
    return tf.convert_to_tensor(total) + tf.convert_to_tensor(more)
