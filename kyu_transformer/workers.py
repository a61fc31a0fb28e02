"""The workers of a multi-worker run agreeing with the chief before they train together.

Only the chief writes the logdir. Silent failures: a worker reads it while the chief moves
it aside (``--overwrite``), or does not see the chief's files and trains another model or
step, mixing two runs in the collectives. Over the strategy's all-reduce, a barrier carries
each worker's verdict and a comparison of facts (step, digests) stops all alike.
"""

import hashlib

import numpy as np
import tensorflow as tf


class WorkerDisagreement(RuntimeError):
    """The workers of one run do not agree with the chief; the message says on what."""


def is_multi_worker(strategy):
    return bool(strategy.extended._in_multi_worker_mode())  # pylint: disable=protected-access


def worker_count_and_index(strategy):
    """``(number of workers, this worker's index)``, the chief first."""
    resolver = strategy.cluster_resolver
    cluster = resolver.cluster_spec().as_dict()
    chiefs = len(cluster.get("chief", []))
    count = chiefs + len(cluster.get("worker", []))
    index = resolver.task_id if resolver.task_type == "chief" else chiefs + resolver.task_id
    return count, index


def gather(strategy, values):
    """Every worker's `values` (a list of numbers), as a ``(workers, len(values))`` array.

    One all-reduce: each worker's first local replica fills its row of a zero matrix.
    float64 holds integers below 2**53 exactly (hence 48-bit digests).
    """
    count, index = worker_count_and_index(strategy)
    rows = np.zeros((count, len(values)), "float64")
    rows[index] = values
    local_replicas = strategy.num_replicas_in_sync // count

    def contribute():
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        first = tf.equal(replica % local_replicas, 0)
        return tf.where(first, tf.constant(rows), tf.zeros_like(rows))

    return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(contribute), axis=None).numpy()


def chief_choice(strategy, value, choices):
    """The chief's `value` (one of `choices`), on every worker: what the chief chose."""
    return choices[int(gather(strategy, [float(choices.index(value))])[0, 0])]


def short_digest(data):
    """48 bits of the SHA-256 of `data` (bytes or str), as an int: exact in a float64."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    return int.from_bytes(hashlib.sha256(data).digest()[:6], "big")


def barrier(strategy, failure=None):
    """Waits until every worker is here; stops all of them if one failed (`failure`: its message).

    A worker failing before a collective would leave the others waiting forever, so each
    brings its verdict: a failed worker raises its message, the others one naming it.
    Outside multi-worker runs, only raises `failure`.
    """
    if failure is not None and not is_multi_worker(strategy):
        raise WorkerDisagreement(failure)
    if not is_multi_worker(strategy):
        return
    failed = gather(strategy, [0.0 if failure is None else 1.0])[:, 0]
    if failure is not None:
        raise WorkerDisagreement(failure)
    if failed.any():
        names = ", ".join("the chief" if worker == 0 else f"worker {worker}"
                          for worker in np.flatnonzero(failed))
        raise WorkerDisagreement(f"{names} stopped before training (see its output); "
                                 "this worker stops too")


def check_agreement(strategy, values=None, digests=None):
    """Raises `WorkerDisagreement` on every worker unless all agree with the chief.

    Args:
      strategy: The run's strategy (no-op unless multi-worker).
      values: ``{description: integer}`` that must be equal and are printed (e.g. the step).
      digests: ``{description: short_digest(...)}`` that must be equal (e.g. the subword
        vocabulary); a difference is named, the digests are not printed.
    """
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
