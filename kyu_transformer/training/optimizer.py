"""Provides Adam with a fast path for its update (one fused TensorFlow kernel per variable), and
float16's loss scaling with one verdict on the gradients for all replicas.

Keras' Adam makes several element-wise passes per variable; ``ResourceApplyAdam`` makes one,
with Keras' formula (the paper's with the "epsilon hat" of its section 2:
``variable -= lr * sqrt(1 - beta_2**t) / (1 - beta_1**t) * m / (sqrt(v) + epsilon)``), so
checkpoints, schedules, loss scaling and strategies work as with Keras' Adam, whose own update
runs with another backend or AMSGrad.

Keras' `LossScaleOptimizer` asks each replica whether its own gradients are finite, before they
are summed over the replicas, and acts on the first local replica's answer alone: an overflow on
another replica reaches every replica's weights through the sum (`MirroredStrategy`), or workers
that answer differently wait for ever on each other's collectives (`MultiWorkerMirroredStrategy`).
`LossScaleOptimizer` here sums the replicas' answers first, so that all skip an update (and halve
the scale) together.
"""

import functools

import keras
import tensorflow as tf


def make_adam(learning_rate, fast_paths=True, **kwargs):
    """Returns the fused `Adam` if `fast_paths`, else `keras.optimizers.Adam` (either restores
    the other's checkpoints), with `learning_rate` and Keras' Adam arguments (`beta_1`, ...)."""
    return (Adam if fast_paths else keras.optimizers.Adam)(learning_rate, **kwargs)


@keras.saving.register_keras_serializable(package="kyu_transformer")
class Adam(keras.optimizers.Adam):
    """Updates variables as `keras.optimizers.Adam` does (same arguments and state), in one fused
    kernel per variable."""

    def update_step(self, gradient, variable, learning_rate):
        """Applies `gradient` to `variable` with ``ResourceApplyAdam``, or with Keras' own update
        under AMSGrad or another backend."""
        if self.amsgrad or keras.backend.backend() != "tensorflow":
            return super().update_step(gradient, variable, learning_rate)
        index = self._get_variable_index(variable)
        if isinstance(gradient, tf.IndexedSlices):  # e.g. an embedding used by lookups only
            gradient = tf.convert_to_tensor(gradient)
        constant = functools.partial(tf.cast, dtype=variable.dtype)
        step = constant(self.iterations + 1)
        beta_1, beta_2 = constant(self.beta_1), constant(self.beta_2)
        tf.raw_ops.ResourceApplyAdam(
            var=_handle(variable), m=_handle(self._momentums[index]),
            v=_handle(self._velocities[index]), beta1_power=tf.pow(beta_1, step),
            beta2_power=tf.pow(beta_2, step), lr=constant(learning_rate), beta1=beta_1,
            beta2=beta_2, epsilon=constant(self.epsilon), grad=constant(gradient),
            use_locking=False)


def _handle(variable):
    """Returns the resource handle of a Keras or TensorFlow variable (a distributed one's local
    copy)."""
    if isinstance(variable, keras.Variable):
        variable = variable.value
    return variable.handle


@keras.saving.register_keras_serializable(package="kyu_transformer")
class LossScaleOptimizer(keras.optimizers.LossScaleOptimizer):
    """Scales the loss and skips updates as `keras.optimizers.LossScaleOptimizer` does (same
    arguments and state: either restores the other's checkpoints), deciding for every replica at
    once: an update is skipped on all when any replica's gradients are not finite."""

    def check_finite(self, grads):
        """Returns whether `grads` are finite on every replica (this replica's verdict alone
        outside a replica context or with one replica)."""
        finite = super().check_finite(grads)
        replica = tf.distribute.get_replica_context()
        if replica is None or replica.num_replicas_in_sync == 1:
            return finite
        # A collective that every replica meets: Keras' `apply` calls this on each replica once
        # an update, whatever its gradients, before the condition that skips. The flags are
        # floats, which every device's and worker's all-reduce sums.
        non_finite = replica.all_reduce(tf.distribute.ReduceOp.SUM,
                                        tf.cast(tf.logical_not(finite), tf.float32))
        return tf.equal(non_finite, 0.0)
