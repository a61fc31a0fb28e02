"""Runs one training step under any tf.distribute strategy (Keras 3's ``fit`` fails under
``MultiWorkerMirroredStrategy``, keras-team/keras#20585): the loss is summed over tokens and divided
by the *global* batch's count; with ``accumulate_steps`` N, one update on N batches is made as on
their union.

An update gives the host one small tensor to read (the batches it took, the stop requests, its
step, and its number where its loss was not finite, so that nothing is saved after it); its
sums (loss, hits, tokens) add up in a variable on the device, read at log steps by `take_sums`.
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
    ``step(iterator)`` -> an int64 tensor ``[batches, stops, step, non_finite]`` (`loss_terms`: from
    `loss_terms_function`; `jit_compile`: each replica's update compiled with XLA, see
    `_compiled_on_its_device`).

    ``batches`` counts the batches the update took: fewer at the end of the data, 0 (and no
    update) once it has ended. ``stops`` counts the replicas whose process called
    `request_stop`: riding on the token count's all-reduce, it tells every worker of any stop
    after the same update, without a collective of its own. ``step`` is the optimizer's count of
    updates after it; ``non_finite`` the update's number (one more than the count before it, as
    float16's loss scaling skips such an update) where its loss is not finite, else 0.
    """

    def __init__(self, strategy, model, optimizer, loss_terms, jit_compile=False,
                 accumulate_steps=1):
        self.strategy, self.model, self.optimizer = strategy, model, optimizer
        self.loss_terms, self.accumulate_steps = loss_terms, accumulate_steps
        # This process's request and sums, outside the strategy: every worker has its own.
        self.stop_requested = tf.Variable(0.0, trainable=False, name="stop_requested")
        # Loss, hits, tokens; float64 counts tokens exactly past float32's 2**24.
        self.sums = tf.Variable(tf.zeros([3], tf.float64), trainable=False, name="sums")
        self.replica_update = self._replica_update
        if jit_compile and strategy.num_replicas_in_sync == 1:
            self.replica_update = _compiled(self._replica_update)
        elif jit_compile:
            self.replica_update = self._replica_update_of(_compiled_on_its_device(self._gradients))
        step = self._one_batch_step if accumulate_steps == 1 else self._accumulated_step
        # Its conditions are tf.cond's already: AutoGraph would only parse and rewrite the source
        # of every function the step calls, in every process that starts training.
        self.function = tf.function(step, reduce_retracing=True, autograph=False)

    def __call__(self, iterator):
        """Runs the step on `iterator`; returns the int64 tensor of the class's docstring."""
        return self.function(iterator)

    def request_stop(self):
        """Asks every worker to stop after the next step (see ``stops``)."""
        self.stop_requested.assign(1.0)

    def take_sums(self):
        """Returns the ``(loss_sum, correct, tokens)`` of the updates since the last call, as
        Python floats, and starts the next sums at 0."""
        sums = [float(value) for value in self.sums.numpy()]
        self.sums.assign(tf.zeros([3], tf.float64))
        return sums

    def _one_batch_step(self, iterator):
        """Updates on the next global batch (a bare `next()` would raise at the end only after
        the optimizer counted one more iteration)."""
        batch = iterator.get_next_as_optional()
        return tf.cond(tf.logical_not(batch.has_value()),
                       lambda: self._counts_and_step(tf.constant(0.0), tf.constant(0.0)),
                       lambda: self._update([batch.get_value()], tf.constant(1.0)))

    def _accumulated_step(self, iterator):
        """Makes one update on the next `accumulate_steps` batches of an endless iterator."""
        micro_batches = [next(iterator) for _ in range(self.accumulate_steps)]
        counts = self.strategy.run(self._counts, args=(micro_batches,))
        tokens_stops_rows = self.strategy.experimental_local_results(counts)[0]
        # The data ended where the batches have no rows (no real global batch is empty).
        batches = tf.reduce_sum(tf.cast(tokens_stops_rows[2:] > 0, tf.float32))
        return tf.cond(tf.equal(batches, 0),
                       lambda: self._counts_and_step(batches, tokens_stops_rows[1]),
                       lambda: self._update(micro_batches, batches, counts))

    def _update(self, micro_batches, batches, counts=None):
        """Updates on `micro_batches` (each replica's slices), their `counts` from `_counts`;
        adds the sums to `sums`; returns what `__call__` does."""
        if counts is None:
            counts = self.strategy.run(self._counts, args=(micro_batches,))
        number = tf.cast(self.optimizer.iterations, tf.int64) + 1  # read before the update
        with tf.control_dependencies([number]):
            sums = self.strategy.run(self.replica_update, args=(micro_batches, counts))
        sums = [self.strategy.reduce(tf.distribute.ReduceOp.SUM, value, axis=None)
                for value in sums]  # loss, hits, tokens
        self.sums.assign_add(tf.cast(tf.stack(sums), tf.float64))
        non_finite = tf.where(tf.math.is_finite(sums[0]), tf.constant(0, tf.int64), number)
        stops = self.strategy.experimental_local_results(counts)[0][1]
        return self._counts_and_step(batches, stops, non_finite)

    def _counts_and_step(self, batches, stops, non_finite=0):
        """Returns ``[batches, stops, step, non_finite]`` as one int64 tensor: the host reads it
        at once."""
        return tf.stack([tf.cast(batches, tf.int64), tf.cast(stops, tf.int64),
                         tf.cast(self.optimizer.iterations, tf.int64),
                         tf.cast(non_finite, tf.int64)])

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
        """Updates on `micro_batches` (see `_gradients`); returns their summed ``(loss_sum,
        correct, tokens)``."""
        return self._replica_update_of(self._gradients)(micro_batches, counts)

    def _replica_update_of(self, gradients_function):
        """Returns `_replica_update` with the gradients computed by `gradients_function`."""
        def replica_update(micro_batches, counts):
            gradients, sums = gradients_function(micro_batches, counts)
            self.optimizer.apply_gradients(zip(gradients, self.model.trainable_variables))
            return sums

        return replica_update

    def _gradients(self, micro_batches, counts):
        """Computes the gradients of `micro_batches` one batch after another, each batch's loss
        divided by the count of all (`counts[0]`); returns their sum and the summed
        ``(loss_sum, correct, tokens)``."""
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
        return gradients, [tf.add_n(list(column)) for column in zip(*sums)]

    def _scaled(self, loss):
        if isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer):
            return self.optimizer.scale_loss(loss)
        return loss


def _compiled(function):
    return tf.function(function, jit_compile=True, reduce_retracing=True, autograph=False)


def _compiled_on_its_device(function):
    """Returns `function` compiled with XLA, for one of several replicas: each call placed on the
    replica's device.

    Under several replicas only the forward and backward passes are compiled: the optimizer sums
    the replicas' gradients by a `merge_call`, which XLA compiles only where every device is a
    GPU. The call is placed by hand because a compiled call inside `strategy.run` is otherwise
    placed on the first device, away from the other replicas' variables."""
    compiled = _compiled(function)

    def placed(*args):
        context = tf.distribute.get_replica_context()
        devices = context.strategy.extended.worker_devices  # this worker's replicas'
        replica = tf.get_static_value(context.replica_id_in_sync_group)
        with tf.device(devices[replica % len(devices)]):
            return compiled(*args)

    return placed


def _added(total, more):
    """Returns the sum of two gradients of one variable (sparse ones stay sparse: their rows
    joined)."""
    if total is None or more is None:
        return more if total is None else total
    if isinstance(total, tf.IndexedSlices) and isinstance(more, tf.IndexedSlices):
        return tf.IndexedSlices(tf.concat([total.values, more.values], 0),
                                tf.concat([total.indices, more.indices], 0), total.dense_shape)
    return tf.convert_to_tensor(total) + tf.convert_to_tensor(more)
