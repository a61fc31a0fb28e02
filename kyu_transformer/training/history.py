"""Reports a training run: writes `history.jsonl` and TensorBoard scalars, and shows the
progress."""

import json
import os
import sys
import time

import keras
import tensorflow as tf

from kyu_transformer import filenames
from kyu_transformer.safety.writes import as_out_of_space, drop_torn_last_line, is_out_of_space


class TrainingLog:
    """Writes a run's records, on the chief, to `<logdir>/history.jsonl` and as TensorBoard
    scalars ``<kind>/<key>`` in `<logdir>/train`; a record is a dict of ``kind``, ``step``,
    ``epoch`` and numbers."""

    def __init__(self, logdir, chief):
        self.logdir, self.chief, self.writer = logdir, chief, None
        self.path = os.path.join(logdir, filenames.HISTORY)

    def open(self):
        """Creates the logdir and the summary writer (on the chief: the others write nothing)."""
        if self.chief:
            os.makedirs(self.logdir, exist_ok=True)
            # A line cut by a crash or a full disk would swallow the next record.
            drop_torn_last_line(self.path)
            events = os.path.join(self.logdir, filenames.TENSORBOARD)
            self.writer = tf.summary.create_file_writer(events)

    def write(self, record):
        """Appends `record` to the history file and its numbers to TensorBoard (on the chief)."""
        if not self.chief:
            return
        try:
            with open(self.path, "a", encoding="utf-8") as handle:
                handle.write(json.dumps(record) + "\n")
        except OSError as error:
            raise (as_out_of_space(error, self.path) if is_out_of_space(error) else error)
        with self.writer.as_default(step=record["step"]):
            for key, value in record.items():
                if key not in ("step", "epoch", "kind") and isinstance(value, (int, float)):
                    tf.summary.scalar(f"{record.get('kind', 'train')}/{key}", value)
        self.writer.flush()


class Window:
    """Sums the loss, hits and tokens since the last summary."""

    def __init__(self):
        self.loss = self.correct = self.tokens = 0.0
        self.started = time.time()

    def add(self, loss_sum, correct, tokens):
        """Adds the sums of some updates."""
        self.loss += loss_sum
        self.correct += correct
        self.tokens += tokens

    def summary(self):
        """Returns the loss and accuracy per token, and the tokens per second, of the window."""
        tokens = max(self.tokens, 1.0)
        return {"loss": self.loss / tokens, "accuracy": self.correct / tokens,
                "tokens_per_sec": self.tokens / max(time.time() - self.started, 1e-9)}


class Progress:
    """Shows a run's progress: a Keras progress bar on a terminal, one line per summary in a log
    file."""

    def __init__(self, epoch, num_epochs, skip, steps_per_epoch, enabled):
        self.enabled, self.bar, self.minutes_left, self.totals = enabled, None, None, Window()
        if not enabled:
            return
        print(f"epoch {epoch + 1}/{num_epochs}"
              + (f" (resuming after {skip} steps)" if skip else ""), flush=True)
        if sys.stdout.isatty():
            self.bar = keras.utils.Progbar(steps_per_epoch, unit_name="step",
                                           stateful_metrics=["loss", "acc", "run_min_left"])

    def update(self, done, estimate=None):
        """Moves the bar to `done` updates; `estimate` is ``(seconds per update, seconds left)``
        or None. The bar's loss and accuracy are the epoch's as of the last summary."""
        self.minutes_left = None if estimate is None else estimate[1] / 60
        if self.bar is not None:
            values = []
            if self.totals.tokens:
                summary = self.totals.summary()
                values = [("loss", summary["loss"]), ("acc", summary["accuracy"])]
            if self.minutes_left is not None:  # the bar's own ETA is the epoch's
                values.append(("run_min_left", self.minutes_left))
            self.bar.update(done, values)

    def add(self, window):
        """Counts a summary's sums (a `Window`) in the epoch's totals."""
        self.totals.add(window.loss, window.correct, window.tokens)

    def log(self, record):
        """Prints `record` as one line where there is no bar (the output is not a terminal)."""
        if self.enabled and self.bar is None:
            left = "" if self.minutes_left is None else f", about {self.minutes_left:.1f} min left"
            print(f"step {record['step']}: loss {record['loss']:.4f}, accuracy "
                  f"{record['accuracy']:.4f}, lr {record['lr']:.2e}, "
                  f"{record['tokens_per_sec']:.0f} target tokens/s{left}", flush=True)

    def finish(self, message=None):
        """Ends the bar's line; prints `message` (if any) below it."""
        if self.enabled and self.bar is not None:
            print()
        if self.enabled and message:
            print(message, flush=True)
