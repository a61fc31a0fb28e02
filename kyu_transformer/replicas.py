"""Gives each replica of a `tf.distribute` step random draws of its own.

Under MirroredStrategy (and MultiWorkerMirroredStrategy) every replica runs the same layers with
copies of the same seed states, which advance alike: seeds drawn from them alone would be the
same on every device. `replica_seeds` folds the replica's id into each seed, so that replicas
draw differently and reproducibly; replica 0, and any run on one device or another backend,
draws the seeds unchanged. Layers use it through Keras alone; TensorFlow is imported only where
it is Keras' backend.
"""

import keras
from keras import ops

# Added to a seed's first word once per replica id. It is a prime, so prime to 2**31 - 2, the
# modulus by which TensorFlow's random ops take 64-bit seeds to 32 bits: two replicas' seeds
# differ unless their ids differ by a multiple of 2**31 - 2.
REPLICA_STRIDE = 2654435761


def replica_id():
    """Returns the id of the replica running this code, counted over all workers: a scalar
    integer tensor inside a `tf.distribute` step of several replicas, else 0."""
    if keras.backend.backend() != "tensorflow":
        return 0
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    context = tf.distribute.get_replica_context()  # None in a cross-replica context
    if context is None or context.num_replicas_in_sync == 1:
        return 0
    return context.replica_id_in_sync_group


def replica_seeds(seed_generator):
    """Returns `seed_generator` itself outside a step of several replicas, else a seed
    generator whose seeds are its seeds with the replica's id folded in."""
    replica = replica_id()
    if isinstance(replica, int) and replica == 0:
        return seed_generator
    return _FoldedSeeds(seed_generator, replica)


class _FoldedSeeds(keras.random.SeedGenerator):
    """Draws the seeds of `generator` (advancing it), each ``REPLICA_STRIDE * replica`` more in
    its first word."""

    def __init__(self, generator, replica):  # pylint: disable=super-init-not-called
        # No state of its own: SeedGenerator's __init__ would make a variable.
        self.generator, self.replica = generator, replica

    def next(self, ordered=True):
        seed = self.generator.next(ordered=ordered)  # (2,)
        stride = ops.convert_to_tensor([REPLICA_STRIDE, 0], seed.dtype)
        return seed + ops.cast(self.replica, seed.dtype) * stride
