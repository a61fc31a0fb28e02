"""Which tf.distribute strategy a run uses, which process leads, and how batches reach replicas.

Each global batch is cut into contiguous slices, one per replica, so any replica count
computes the same loss.
"""

import os

import tensorflow as tf

from kyu_transformer.flags import STRATEGIES


def make_strategy(name="auto"):
    """The tf.distribute strategy called `name` (``auto``: mirrored if more than one GPU is
    visible, else the default; ``multi_worker`` reads the cluster from ``TF_CONFIG``)."""
    if name not in STRATEGIES:
        raise ValueError(f"--strategy must be one of {', '.join(STRATEGIES)}, got {name!r}")
    if name == "auto":
        name = "mirrored" if len(tf.config.list_logical_devices("GPU")) > 1 else "default"
    if name == "default":
        return tf.distribute.get_strategy()
    if name == "mirrored":
        return tf.distribute.MirroredStrategy()
    if "TF_CONFIG" not in os.environ:
        raise ValueError("--strategy multi_worker needs the cluster in the TF_CONFIG "
                         "environment variable")
    return tf.distribute.MultiWorkerMirroredStrategy()


def is_chief(strategy):
    """Whether this process writes checkpoints, summaries and plots."""
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None or not resolver.task_type:
        return True
    cluster = resolver.cluster_spec().as_dict()
    if "chief" in cluster:
        return resolver.task_type == "chief"
    return resolver.task_type == "worker" and resolver.task_id == 0


def replica_slices(dataset, num_replicas, first_replica, local_replicas):
    """Each global batch -> the slices of `local_replicas` replicas from `first_replica`:
    replica ``r`` of ``R`` takes rows ``[n*r//R, n*(r+1)//R)`` of ``n`` (possibly none)."""
    if num_replicas == 1:
        return dataset

    def pieces(features, labels):
        size = tf.shape(labels)[0]

        def piece(replica):
            start = size * tf.cast(replica, tf.int32) // num_replicas
            stop = size * (tf.cast(replica, tf.int32) + 1) // num_replicas
            return tf.nest.map_structure(lambda t: t[start:stop], (features, labels))

        return tf.data.Dataset.range(first_replica, first_replica + local_replicas).map(piece)

    return dataset.flat_map(pieces)


def distribute_batches(strategy, make_global_batches, endless=False):
    """A distributed dataset from `make_global_batches()`, each global batch cut per replica.

    `endless`: then empty batches (no rows) for ever, for a step that takes several batches
    at once: it needs no condition on each, and tells the end of the data by their rows.
    """

    def dataset_fn(context):
        local = strategy.num_replicas_in_sync // context.num_input_pipelines
        slices = replica_slices(make_global_batches(), strategy.num_replicas_in_sync,
                                context.input_pipeline_id * local, local)
        if not endless:
            return slices
        empty = tf.nest.map_structure(lambda spec: tf.zeros([0] * spec.shape.rank, spec.dtype),
                                      slices.element_spec)
        return slices.concatenate(tf.data.Dataset.from_tensors(empty).repeat())

    options = tf.distribute.InputOptions(experimental_fetch_to_device=False)
    return strategy.distribute_datasets_from_function(dataset_fn, options)
