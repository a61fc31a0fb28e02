"""A training run's checkpoints (weights, optimizer, data position, dropout random states, seconds
trained: a killed run ends as an uninterrupted one would), and resuming from the latest. Their
object names are their keys: renaming one orphans the checkpoints written before.
"""

import atexit
import glob
import json
import os
import shutil
import tempfile
import time

import tensorflow as tf

from kyu_transformer import filenames
from kyu_transformer.checkpoints import (
    CheckpointError, UnreadableCheckpoint, checkpoint_files, held_objects, listed_checkpoints,
    model_weights, unreadable)
from kyu_transformer.files import as_out_of_space, is_out_of_space, write_text


# The objects every run checkpoint holds beside the weights (older ones lack the others).
RUN_STATE = ("optimizer", "epoch", "step_in_epoch")


class RunCheckpoints:
    """The checkpoints of a run in `directory` (the chief keeps the `max_to_keep` latest, the
    others none) and the run state they hold: the data position `epoch` and `step_in_epoch`
    (batches done in it), `train_seconds` (resumed runs included: what `max_minutes` limits).
    """

    def __init__(self, strategy, model, optimizer, directory, max_to_keep, chief):
        with strategy.scope():
            self.epoch = tf.Variable(0, dtype=tf.int64, trainable=False, name="epoch")
            self.step_in_epoch = tf.Variable(0, dtype=tf.int64, trainable=False,
                                             name="step_in_epoch")
            self.train_seconds = tf.Variable(0.0, dtype=tf.float64, trainable=False,
                                             name="train_seconds")
        self.directory, self.chief, self.max_to_keep = directory, chief, max_to_keep
        # What checkpoints written before random states and training time were saved hold.
        self._older = dict(weights=model_weights(model), optimizer=optimizer, epoch=self.epoch,
                           step_in_epoch=self.step_in_epoch)
        self.checkpoint = tf.train.Checkpoint(
            **self._older,
            # Not in `model.weights`; without them a resumed run redraws step 1's dropout masks.
            random_states=random_states(model), train_seconds=self.train_seconds)
        if chief:
            os.makedirs(directory, exist_ok=True)
        # The others save to a throw-away folder (a save is collective).
        self.manager = self._manager(directory if chief else private_dir("worker-checkpoints-"))

    def _manager(self, directory):
        return tf.train.CheckpointManager(self.checkpoint, directory, max_to_keep=self.max_to_keep,
                                          checkpoint_name=filenames.CHECKPOINT_PREFIX)

    def restore(self):
        """Restores the latest readable checkpoint (of the chief's), if any; returns its path.
        Each is read in full first (a damaged one never leaves half its values in the model);
        one that cannot be read is skipped, named, and moved aside by the chief."""
        bad = {}
        for path in reversed(listed_checkpoints(self.directory)):
            bad[path] = unreadable(path)
            if bad[path] is None:
                del bad[path]
                break
        else:
            # None reads: refuse to start afresh (other workers' step 0 fails the step check).
            if bad and self.chief:
                raise UnreadableCheckpoint(
                    f"no checkpoint of {self.directory} can be read ("
                    + "; ".join(f"{os.path.basename(p)}: {reason}" for p, reason in bad.items())
                    + "); nothing was moved. Copy them again, or start afresh with --overwrite")
            return None
        refuse_weights_only(path)
        if bad and self.chief:
            for bad_path, reason in bad.items():
                print(f"note: {bad_path} cannot be read ({reason}); moved to "
                      f"{set_aside(bad_path)}; resuming from {path}", flush=True)
            self.manager = self._manager(self.directory)  # its list still held what was moved
        self._restore(path)
        return path

    def _restore(self, path):
        try:
            self.checkpoint.restore(path).assert_existing_objects_matched()
        except AssertionError:  # an older checkpoint (`_older`)
            tf.train.Checkpoint(**self._older).restore(path).assert_existing_objects_matched()
            if self.chief:
                print(f"note: {path} holds no dropout random state or training time (an older "
                      "checkpoint): dropout masks and the time budget start afresh", flush=True)

    def save(self, step, train_seconds):
        """Saves checkpoint number `step`; returns its path on the chief, else None. A full disk
        raises `files.OutOfSpace`, what the save had written removed."""
        self.train_seconds.assign(train_seconds)
        try:
            path = self.manager.save(checkpoint_number=step)
        except Exception as error:  # pylint: disable=broad-except  (re-raised)
            self._remove_partial(step)
            if is_out_of_space(error):
                latest = listed_checkpoints(self.manager.directory)
                needed = checkpoint_bytes(latest[-1]) if latest else None
                raise as_out_of_space(error, self._prefix(step), needed=needed) from None
            raise
        return path if self.chief else None

    def _prefix(self, step):
        return os.path.join(self.manager.directory, f"{filenames.CHECKPOINT_PREFIX}-{step}")

    def _remove_partial(self, step):
        """Removes what a failed save of checkpoint `step` left (temporary folder, files)."""
        prefix = self._prefix(step)
        shutil.rmtree(prefix + "_temp", ignore_errors=True)
        # TensorFlow writes the index through a temporary file of its own.
        index = os.path.join(glob.escape(self.manager.directory), filenames.CHECKPOINT_INDEX)
        partial = glob.glob(index + ".tmp*")
        if prefix not in listed_checkpoints(self.manager.directory):
            partial += checkpoint_files(prefix)
        for name in partial:
            os.remove(name)

    def discard_private(self):
        """Removes a worker's throw-away checkpoints (its part of the collective saves)."""
        if not self.chief:
            shutil.rmtree(self.manager.directory, ignore_errors=True)


def refuse_weights_only(path):
    """A `CheckpointError` for a checkpoint of weights without a run's state (no optimizer,
    epoch or data position: an imported or hand-made one), which no run can resume from."""
    if not set(RUN_STATE) <= held_objects(path):
        logdir = os.path.dirname(os.path.dirname(path))
        raise CheckpointError(
            f"{path} holds weights without a run state (no optimizer, epoch or data position): "
            f"a run cannot resume from it. To train from these weights, start a new run: "
            f"--init_from {logdir} with a new --logdir")


def random_states(model):
    """The dropout layers' seed-generator states in `model.variables` order: it depends on the
    structure only, unlike their names (which count the process's earlier generators)."""
    weights = {id(weight) for weight in model.weights}
    return [variable for variable in model.variables
            if id(variable) not in weights and "seed_generator" in variable.path]


def private_dir(prefix):
    """A throw-away folder, removed when the process ends (also when the run fails)."""
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def set_aside(path):
    """Moves checkpoint `path`'s files to `corrupt/` beside it, out of the index; returns where
    (never deleted; neither a later save of the same step nor the rotation reaches them)."""
    directory, name = os.path.split(path)
    target = os.path.join(directory, filenames.CORRUPT, f"{name}.{time.strftime('%Y%m%d-%H%M%S')}")
    number, unique = 1, target
    while os.path.exists(unique):
        number += 1
        unique = f"{target}-{number}"
    os.makedirs(unique)
    for file_name in checkpoint_files(path):
        shutil.move(file_name, unique)
    drop_from_index(directory, path)
    return unique


def drop_from_index(directory, path):
    """Rewrites the checkpoint index of `directory` without `path`, as the manager writes it:
    relative names (a copied logdir still reads), timestamps (without them the manager neither
    lists nor rotates), and no index at all for none (TensorFlow reads an empty one as broken)."""
    state = tf.train.get_checkpoint_state(directory)
    stamps = list(state.all_model_checkpoint_timestamps)
    kept = [(os.path.basename(listed), stamps[number] if stamps else None)
            for number, listed in enumerate(state.all_model_checkpoint_paths) if listed != path]
    index = os.path.join(directory, filenames.CHECKPOINT_INDEX)
    if not kept:
        os.remove(index)
        return
    lines = [f"model_checkpoint_path: {json.dumps(kept[-1][0])}"]
    lines += [f"all_model_checkpoint_paths: {json.dumps(name)}" for name, _ in kept]
    lines += [f"all_model_checkpoint_timestamps: {stamp!r}" for _, stamp in kept if stamps]
    lines.append(f"last_preserved_timestamp: {state.last_preserved_timestamp!r}")
    write_text(index, "\n".join(lines) + "\n")


def checkpoint_bytes(path):
    """The size of checkpoint `path`'s files (what another one of it needs)."""
    return sum(os.path.getsize(name) for name in checkpoint_files(path))
