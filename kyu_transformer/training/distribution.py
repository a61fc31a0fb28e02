"""Makes tf.distribute strategies, tells the chief, cuts batches per replica, and has the workers
of a multi-worker run agree.

Each global batch is cut into contiguous slices, one per replica: any replica count computes the
same loss. Workers that do not see the chief's files would mix two runs in the collectives: over
the all-reduce, a barrier carries each worker's verdict, and a comparison of facts stops all alike.
"""

import hashlib
import json
import os

import numpy as np
import tensorflow as tf

from kyu_transformer.conventions import STRATEGIES, replica_rows


class WorkerDisagreement(RuntimeError):
    """Raised when the workers of one run do not agree with the chief; the message says on
    what."""


def make_strategy(name="auto"):
    """Returns the tf.distribute strategy called `name` (``auto``: mirrored if more than one GPU is
    visible, else the default; ``multi_worker`` reads the cluster from ``TF_CONFIG``)."""
    if name not in STRATEGIES:
        raise ValueError(f"--strategy must be one of {', '.join(STRATEGIES)}, got {name!r}")
    if name == "auto":
        name = "mirrored" if len(tf.config.list_logical_devices("GPU")) > 1 else "default"
    if name == "multi_worker" and "TF_CONFIG" not in os.environ:
        raise ValueError("--strategy multi_worker needs the cluster in the TF_CONFIG "
                         "environment variable")
    return {"default": tf.distribute.get_strategy, "mirrored": tf.distribute.MirroredStrategy,
            "multi_worker": tf.distribute.MultiWorkerMirroredStrategy}[name]()


def is_chief(strategy):
    """Returns whether this process writes checkpoints, summaries and plots: the chief task, or
    worker 0 of a cluster without one (any process of a single-worker strategy)."""
    return strategy.extended.should_checkpoint


def is_multi_worker(strategy):
    """Returns whether `strategy` runs in multi-worker mode."""
    return bool(strategy.extended._in_multi_worker_mode())  # pylint: disable=protected-access


def replica_slices(dataset, num_replicas, first_replica, local_replicas):
    """Cuts each global batch of `dataset` into the slices of `local_replicas` replicas from
    `first_replica`, each replica's rows as `replica_rows` says."""
    if num_replicas == 1:
        return dataset

    def pieces(features, labels):
        size = tf.shape(labels)[0]

        def piece(replica):
            start, stop = replica_rows(size, tf.cast(replica, tf.int32), 1, num_replicas)
            return tf.nest.map_structure(lambda t: t[start:stop], (features, labels))

        return tf.data.Dataset.range(first_replica, first_replica + local_replicas).map(piece)

    return dataset.flat_map(pieces)


# Below this many tokens a batch's matrix products are too small to fill a GPU: its time goes
# to launching kernels and to the all-reduce, which costs the same for any batch.
BUSY_GPU_TOKENS = 2048


def batch_line(strategy, hparams):
    """Returns what a run says of its batches: the global batch (`batch_tokens`, else
    `batch_size` pairs) cut per replica, and an update's, with `accumulate_steps`; with a warning
    when a GPU replica gets fewer than `BUSY_GPU_TOKENS` tokens."""
    replicas, per_update = strategy.num_replicas_in_sync, hparams.get("accumulate_steps", 1)
    flag, size = (("batch_tokens", hparams["batch_tokens"]) if hparams["batch_tokens"]
                  else ("batch_size", hparams["batch_size"]))
    unit = "tokens" if flag == "batch_tokens" else "pairs"
    line = (f"strategy: {type(strategy).__name__} with {replicas} replica(s); a batch of "
            f"{size:,} {unit} a side (--{flag}, the global batch), {size // replicas:,} per "
            f"replica; an update of {per_update} batch(es), {size * per_update:,} {unit}")
    gpus = any("GPU" in device.upper() for device in _devices(strategy))
    if gpus and unit == "tokens" and size // replicas < BUSY_GPU_TOKENS:
        line += (f"\nwarning: {size // replicas:,} tokens per replica are too few to keep a GPU "
                 f"busy: raise --batch_tokens to {BUSY_GPU_TOKENS * replicas:,} or more (the "
                 "global batch; lower --accumulate_steps to keep an update's size)")
    return line


def _devices(strategy):
    """Returns the names of this worker's devices that `strategy` computes on."""
    try:
        return list(strategy.extended.worker_devices)
    except RuntimeError:  # the default strategy: the one device TensorFlow places on, a GPU
        # where there is one (CPU:0 is listed first either way)
        devices = tf.config.list_logical_devices("GPU") or tf.config.list_logical_devices("CPU")
        return [device.name for device in devices[:1]]


def distribute_batches(strategy, make_global_batches, endless=False):
    """Returns a distributed dataset from `make_global_batches(share)`, each global batch cut
    per replica; `share` ``(first, count, total)``: the replicas this worker's pipeline feeds,
    the only rows of a global batch it trains on (a dataset may leave the others empty). With
    `endless`, empty batches follow for ever (a step of several batches tells the end by
    them)."""

    def dataset_fn(context):
        replicas = strategy.num_replicas_in_sync
        local = replicas // context.num_input_pipelines
        share = (context.input_pipeline_id * local, local, replicas)
        slices = replica_slices(make_global_batches(share), replicas, share[0], local)
        if not endless:
            return slices
        empty = tf.nest.map_structure(lambda spec: tf.zeros([0] * spec.shape.rank, spec.dtype),
                                      slices.element_spec)
        return slices.concatenate(tf.data.Dataset.from_tensors(empty).repeat())

    # Each replica's slices are prefetched to its device (tf.distribute's default), empty slices
    # and any lengths alike.
    return strategy.distribute_datasets_from_function(dataset_fn)


def gather(strategy, values):
    """Gathers every worker's `values` (numbers) into a ``(workers, len(values))`` float64 array
    (exact below 2**53) in one all-reduce: each worker's first local replica fills its row of
    zeros."""
    resolver = strategy.cluster_resolver
    cluster = resolver.cluster_spec().as_dict()
    chiefs = len(cluster.get("chief", []))
    count = chiefs + len(cluster.get("worker", []))
    index = resolver.task_id if resolver.task_type == "chief" else chiefs + resolver.task_id
    rows = np.zeros((count, len(values)), "float64")
    rows[index] = values
    local_replicas = strategy.num_replicas_in_sync // count

    def contribute():
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        first = tf.equal(replica % local_replicas, 0)
        return tf.where(first, tf.constant(rows), tf.zeros_like(rows))

    return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(contribute), axis=None).numpy()


def chief_choice(strategy, value, choices):
    """Returns the chief's `value` (one of `choices`) on every worker, so that all take what the
    chief chose."""
    return choices[int(gather(strategy, [float(choices.index(value))])[0, 0])]


def short_digest(value):
    """Returns 48 bits of the SHA-256 of JSON value `value` (keys sorted) as an int, which a
    float64 holds exactly."""
    data = json.dumps(value, sort_keys=True).encode("utf-8")
    return int.from_bytes(hashlib.sha256(data).digest()[:6], "big")


def barrier(strategy, failure=None):
    """Waits until every worker is here; if one failed (`failure`: its message), it raises its
    message and the others one naming it, so that none waits for ever in a collective."""
    failed = (gather(strategy, [float(failure is not None)])[:, 0] if is_multi_worker(strategy)
              else np.zeros(1))
    if failure is not None:
        raise WorkerDisagreement(failure)
    if failed.any():
        names = ", ".join("the chief" if worker == 0 else f"worker {worker}"
                          for worker in np.flatnonzero(failed))
        raise WorkerDisagreement(f"{names} stopped before training (see its output); "
                                 "this worker stops too")


def check_agreement(strategy, values=None, digests=None):
    """Raises `WorkerDisagreement` on every worker unless all agree with the chief (no-op
    unless multi-worker): `values` ``{description: integer}`` are named with their numbers
    (e.g. the step), `digests` ``{description: short_digest(...)}`` without."""
    if not is_multi_worker(strategy):
        return
    values, digests = dict(values or {}), dict(digests or {})
    names = list(values) + list(digests)
    table = gather(strategy, [float(values.get(name, digests.get(name))) for name in names])
    problems = []
    for column, name in enumerate(names):
        for worker in range(1, len(table)):
            if table[worker, column] != table[0, column]:
                problems.append(f"worker {worker} has {name} {int(table[worker, column])} but "
                                f"the chief {int(table[0, column])}" if name in values else
                                f"worker {worker} has another {name} than the chief")
    if problems:
        raise WorkerDisagreement(
            "the workers do not agree with the chief: " + "; ".join(problems) + ". Give every "
            "worker the same command and the same --logdir on a file system they all see, so "
            "that all of them read the chief's subword model and checkpoints.")
