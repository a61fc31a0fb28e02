"""The workers of a multi-worker run agreeing with the chief before they train together.

Every worker runs the same program; only the chief writes the logdir. Two
things can go wrong before the first step, and neither raises by itself:
a worker reads the logdir while the chief is moving it aside (``--overwrite``),
and a worker that does not see the chief's files (no shared file system)
trains a different model or starts from step 0 while the chief resumes, so
that the collectives mix two runs. The functions here use the strategy's own
all-reduce as the channel: a barrier that also carries the chief's verdict,
and a comparison of facts (step, digests) that every worker makes alike, so
that all of them stop together with the same message.
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

    An all-gather made of one all-reduce: each worker fills its own row of a
    zero matrix and the rows are summed. float64 holds integers below 2**53
    exactly (digests are cut to 48 bits for that reason). Each worker adds its
    row once, from its first local replica.
    """
    count, index = worker_count_and_index(strategy)
    rows = np.zeros((count, len(values)), "float64")
    rows[index] = values

    local_replicas = strategy.num_replicas_in_sync // count

    def contribute():
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        first = tf.equal(replica % local_replicas, 0)
        return tf.where(first, tf.constant(rows), tf.zeros_like(rows))

    total = strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(contribute), axis=None)
    return total.numpy()


def chief_choice(strategy, value, choices):
    """The chief's `value` (one of `choices`), on every worker: what the chief chose."""
    codes = gather(strategy, [float(choices.index(value))])
    return choices[int(codes[0, 0])]


def short_digest(data):
    """48 bits of the SHA-256 of `data` (bytes or str), as an int: exact in a float64."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    return int.from_bytes(hashlib.sha256(data).digest()[:6], "big")


def barrier(strategy, failure=None):
    """Waits until every worker is here; stops all of them if one of them failed.

    A worker passes `failure` (its error message, or None when all went
    well). A worker that fails before a collective would leave the others
    waiting in it forever, so each one reaches the barrier with its verdict:
    a failed worker raises its own message, the others a `WorkerDisagreement`
    naming it. No-op outside multi-worker runs.
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
      values: ``{description: integer}`` that must be equal on every worker and
        are worth printing (e.g. the restored step).
      digests: ``{description: short_digest(...)}`` of things that must be equal
        (e.g. a hyperparameter, the subword vocabulary); a difference is named,
        the digests are not printed.
    """
    if not is_multi_worker(strategy):
        return
    values, digests = dict(values or {}), dict(digests or {})
    names = list(values) + list(digests)
    table = gather(strategy, [float(values.get(name, digests.get(name))) for name in names])
    problems = []
    for column, name in enumerate(names):
        for worker in range(1, len(table)):
            if table[worker, column] == table[0, column]:
                continue
            problems.append(f"worker {worker} has {name} {int(table[worker, column])} but the "
                            f"chief {int(table[0, column])}" if name in values else
                            f"worker {worker} has another {name} than the chief")
    if problems:
        raise WorkerDisagreement(
            "the workers do not agree with the chief: " + "; ".join(problems) + ". Give every "
            "worker the same command and the same --logdir on a file system they all see, so "
            "that all of them read the chief's subword model and checkpoints.")
