"""Tracks a run's time: its budget (`max_minutes`, the total across resumptions), its plan of
updates and the estimate of the time they take."""

import math
import time

from kyu_transformer.training.distribution import gather, is_multi_worker


class TimeBudget:
    """Tracks a budget of `minutes` of training (0: no limit) across resumptions; all workers stop
    together."""

    def __init__(self, minutes, strategy):
        self.minutes, self.seconds, self.strategy = minutes, minutes * 60.0 or math.inf, strategy
        self.start(0.0)

    def start(self, restored_seconds):
        """Starts the clock from the seconds a restored checkpoint recorded."""
        self.restored, self.started = restored_seconds, time.time()

    def used(self):
        """Returns the seconds of training so far, earlier processes of the run included."""
        return self.restored + time.time() - self.started

    def left(self):
        """Returns the seconds the budget leaves (infinite without one)."""
        return max(self.seconds - self.used(), 0.0)

    def spent(self):
        """Returns whether the budget is spent, agreed by all workers (any one's clock
        suffices)."""
        spent = self.used() > self.seconds
        if self.seconds == math.inf or not is_multi_worker(self.strategy):
            return spent
        return bool(gather(self.strategy, [float(spent)]).any())

    def resume_line(self, path, step):
        """Returns the line a resumed run prints: where it resumes, and the budget left."""
        line = f"resuming from {path} at step {step}, after {self.used() / 60:.1f} min of training"
        if self.seconds == math.inf:
            return line
        return line + f"; {self.left() / 60:.1f} of the {self.minutes:g} min budget left"


def epoch_updates(batches, steps_per_epoch, per_update):
    """Returns ``(batches trained, updates)`` of an epoch of `batches`: updates of `per_update`
    batches (the last takes those left), at most `steps_per_epoch` of them (0: no cap)."""
    if steps_per_epoch:
        batches = min(batches, steps_per_epoch * per_update)
    return batches, math.ceil(batches / per_update)


class UpdatePlan:
    """Counts the updates a run makes (`parts`: ``(epochs, updates an epoch)`` of each kind of
    epoch in turn, `done` of them before this process) and estimates how long the rest takes at
    the pace measured here."""

    WARM_UP = 10  # updates left out of the pace: the first ones trace and compile
    MEASURE = 20  # updates timed before the first estimate is said

    def __init__(self, parts, done):
        self.parts, self.done = parts, done
        self.total = sum(epochs * per_epoch for epochs, per_epoch in parts)
        self._mark = None  # (step, time) once warmed up

    @classmethod
    def of_run(cls, kinds, steps_per_epoch, done, per_update=1):
        """Returns the plan of a run whose epochs are `kinds`: ``(dataset of an epoch, epochs
        alike)`` in turn, of `per_update` batches an update (the last of an epoch takes those
        left). Where a dataset does not know the count of its batches, they are counted by
        going through them."""
        parts = []
        for dataset, epochs in kinds:
            if steps_per_epoch:  # (counted no further than the cap)
                dataset = dataset.take(steps_per_epoch * per_update)
            batches = int(dataset.cardinality())
            if batches < 0:  # tf.data.UNKNOWN_CARDINALITY (an epoch is never endless)
                batches = int(dataset.reduce(0, lambda count, _: count + 1))
            _, per_epoch = epoch_updates(batches, steps_per_epoch, per_update)
            if parts and parts[-1][1] == per_epoch:  # alike after all (a cap): one part
                epochs += parts.pop()[0]
            parts.append((epochs, per_epoch))
        return cls(parts, done)

    def line(self, minutes=0, decay_steps=0):
        """Returns what the run says at its start, with a warning if the rate decays to 0 well
        before the planned updates end."""
        left = max(self.total - self.done, 0)
        epochs = [f"{count} of about {per_epoch:,} updates" for count, per_epoch in self.parts]
        if len(epochs) == 1:
            epochs = f"{self.parts[0][0]} epochs of about {self.parts[0][1]:,} updates"
        else:
            epochs = (f"{sum(count for count, _ in self.parts)} epochs "
                      f"({', then '.join(epochs)})")
        line = (f"plan: {epochs}, about {self.total:,} updates"
                + (f" ({left:,} to go)" if self.done else "")
                + (f", or {minutes:g} min of training" if minutes else ""))
        # Later epochs may bucket into a few batches more or less: a 5% margin.
        if decay_steps and decay_steps < 0.95 * self.total:
            line += (f"\nwarning: `decay_steps` is {decay_steps:,}: the learning rate is 0 "
                     f"for the last {self.total - decay_steps:,} planned updates (set it to "
                     "about the planned updates, or 0)")
        return line

    def seconds_left(self, step, budget_left=math.inf):
        """Returns ``(seconds per update, seconds left)`` at the pace since warm-up, or None
        until that pace is measured; the seconds left are capped at `budget_left`."""
        if self._mark is None:
            if step - self.done >= self.WARM_UP:
                self._mark = (step, time.time())
            return None
        counted = step - self._mark[0]
        if counted < self.MEASURE:
            return None
        pace = (time.time() - self._mark[1]) / counted
        return pace, min(pace * max(self.total - step, 0), budget_left)

    def estimate_line(self, step, estimate, budget_left=math.inf):
        """Returns the line that says `estimate` (from `seconds_left`) once, when it is first
        measured; else None."""
        if estimate is None or step - self._mark[0] != self.MEASURE:
            return None
        pace, left = estimate
        capped = " (the time budget's)" if left == budget_left else ""
        return (f"estimated on this machine: {pace:.2f} s per update, about {left / 60:.1f} min "
                f"for the {max(self.total - step, 0):,} updates to go{capped}")
