"""The time budget of a training run (`max_minutes`): the run's total, across resumptions."""

import math
import time

import tensorflow as tf


class TrainingClock:
    """Seconds of training of the run: those behind the restored checkpoint, plus this process'."""

    def __init__(self, restored_seconds):
        self.restored = restored_seconds
        self.started = time.time()

    def seconds(self):
        return self.restored + time.time() - self.started


class TimeBudget:
    """`minutes` of training (0: no limit), counted across resumptions; all workers stop together.

    Args:
      minutes: The budget; 0 for none.
      strategy: The run's `tf.distribute.Strategy` (its workers vote on stopping).
    """

    def __init__(self, minutes, strategy):
        self.minutes = minutes
        self.seconds = minutes * 60.0 or math.inf
        self.strategy = strategy
        self.clock = TrainingClock(0.0)

    def start(self, restored_seconds):
        """Starts the clock from the seconds a restored checkpoint recorded."""
        self.clock = TrainingClock(restored_seconds)

    def used(self):
        """Seconds of training so far, earlier processes of the run included."""
        return self.clock.seconds()

    def spent(self):
        """Whether the budget is spent, agreed by all workers (any one's clock suffices)."""
        if self.seconds == math.inf:
            return False
        spent = self.used() > self.seconds
        if not self.strategy.extended._in_multi_worker_mode():  # pylint: disable=protected-access
            return spent
        votes = self.strategy.reduce(
            tf.distribute.ReduceOp.SUM,
            self.strategy.run(lambda: tf.constant(float(spent))), axis=None)
        return bool(votes.numpy() > 0)

    def resume_line(self, path, step):
        """What a resumed run prints: where it resumes, and the budget left."""
        seconds = self.used()
        line = f"resuming from {path} at step {step}, after {seconds / 60:.1f} min of training"
        if self.seconds == math.inf:
            return line
        left = max(self.seconds - seconds, 0.0) / 60
        return line + f"; {left:.1f} of the {self.seconds / 60:g} min budget left"
