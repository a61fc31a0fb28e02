"""A training run's checkpoints: what they hold, and resuming from the latest.

A checkpoint holds the model's weights, the optimizer, the data position
(epoch, batches done in it), the dropout layers' random states and the
seconds of training so far, so that a killed run continues where it stopped
and ends as an uninterrupted run would. The object names (``weights``,
``optimizer``, ``epoch``, ``step_in_epoch``, ``random_states``,
``train_seconds``) are the checkpoint's keys: renaming one orphans the
checkpoints written before.
"""

import atexit
import os
import shutil
import tempfile
import time

import tensorflow as tf

from kyu_transformer.checkpoints import model_weights


class RunCheckpoints:
    """The checkpoints of a run in `directory`, and the run-state variables they hold.

    Args:
      strategy: The `tf.distribute.Strategy` the run-state variables live in.
      model: The model (its weights and random states are saved).
      optimizer: Its optimizer.
      directory: Where the chief keeps the checkpoints.
      max_to_keep: How many recent checkpoints to keep.
      chief: Whether this process keeps what it saves (see `writable_dir`).

    Attributes:
      epoch, step_in_epoch: The data position: epochs done, batches done in
        the current epoch.
      train_seconds: Seconds of training behind the checkpoint: `max_minutes`
        is the run's total, however often it is resumed.
      checkpoint, manager: The `tf.train.Checkpoint` and its manager.
    """

    def __init__(self, strategy, model, optimizer, directory, max_to_keep, chief):
        with strategy.scope():
            self.epoch = tf.Variable(0, dtype=tf.int64, trainable=False, name="epoch")
            self.step_in_epoch = tf.Variable(0, dtype=tf.int64, trainable=False,
                                             name="step_in_epoch")
            self.train_seconds = tf.Variable(0.0, dtype=tf.float64, trainable=False,
                                             name="train_seconds")
        self.model, self.optimizer = model, optimizer
        self.directory, self.chief = directory, chief
        self.checkpoint = tf.train.Checkpoint(
            weights=model_weights(model), optimizer=optimizer,
            epoch=self.epoch, step_in_epoch=self.step_in_epoch,
            # `model.weights` leaves out the dropout layers' random states: without
            # them a resumed run would draw the masks of step 1 again.
            random_states=random_states(model), train_seconds=self.train_seconds)
        self.manager = tf.train.CheckpointManager(
            self.checkpoint, writable_dir(directory, chief), max_to_keep=max_to_keep)

    def restore(self):
        """Restores the latest checkpoint, if any; returns its path or None."""
        latest = self.manager.latest_checkpoint
        if latest is None and not self.chief:
            latest = tf.train.latest_checkpoint(self.directory)
        if latest:
            try:
                self.checkpoint.restore(latest).assert_existing_objects_matched()
            except AssertionError:
                self._restore_without_run_state(latest)
        return latest

    def _restore_without_run_state(self, path):
        """Restores a checkpoint written before random states and training time were saved."""
        tf.train.Checkpoint(weights=model_weights(self.model), optimizer=self.optimizer,
                            epoch=self.epoch, step_in_epoch=self.step_in_epoch
                            ).restore(path).assert_existing_objects_matched()
        if self.chief:
            print(f"note: {path} holds no dropout random state or training time (an older "
                  "checkpoint): dropout masks and the time budget start afresh", flush=True)

    def save(self, step, train_seconds):
        """Saves as checkpoint number `step`; returns its path on the chief, else None."""
        self.train_seconds.assign(train_seconds)
        path = self.manager.save(checkpoint_number=step)
        return path if self.chief else None

    def discard_private(self):
        """Removes a worker's throw-away checkpoints (its part of the collective saves)."""
        if not self.chief:
            shutil.rmtree(self.manager.directory, ignore_errors=True)


def random_states(model):
    """The random-number states the model's layers draw from (dropout's seed generators).

    Listed in the order of `model.variables`, which depends on the model's
    structure only (their names also count the generators made before in the
    process, so they cannot serve as checkpoint keys).
    """
    weights = {id(weight) for weight in model.weights}
    return [variable for variable in model.variables
            if id(variable) not in weights and "seed_generator" in variable.path]


def writable_dir(directory, chief):
    """`directory` on the chief; a throw-away folder on the other workers.

    Every worker must take part in a save (it is a collective), but only
    the chief's files are kept.
    """
    if chief:
        os.makedirs(directory, exist_ok=True)
        return directory
    private = tempfile.mkdtemp(prefix="worker-checkpoints-")
    atexit.register(shutil.rmtree, private, ignore_errors=True)  # also when the run fails
    return private


def copy_aside(path):
    """Moves `path` to `<path>.old-<time>` (nothing is deleted); returns the new name."""
    stem = f"{path}.old-{time.strftime('%Y%m%d-%H%M%S')}"
    aside, number = stem, 1
    while os.path.exists(aside):  # twice in one second: never move into the older copy
        number += 1
        aside = f"{stem}-{number}"
    shutil.move(path, aside)
    return aside
