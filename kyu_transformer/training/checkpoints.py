"""Finds, restores and averages a logdir's checkpoints for decoding (`load_model`), and saves and
restores a training run's own (`RunCheckpoints`: weights, optimizer, data position, dropout random
states, seconds trained), so that a killed run resumes and ends as an uninterrupted one would.

A checkpoint that cannot be read (cut short, its checksums fail) is told apart from one that does
not fit the model: it is skipped with a note in place of the latest, set aside by a resuming run,
and refused when asked for by name or to average. The run's objects' names are their keys:
renaming one orphans earlier checkpoints.
"""

import atexit
import glob
import json
import os
import shutil
import tempfile
import time

import h5py
import numpy as np
import tensorflow as tf

from kyu_transformer import filenames
from kyu_transformer.conventions import check_checkpoint_choice
from kyu_transformer.model import Transformer
from kyu_transformer.precision import resolve_precision, set_precision
from kyu_transformer.safety.writes import as_out_of_space, is_out_of_space, write_text


class CheckpointError(ValueError):
    """Raised when there is no usable checkpoint; the message says which and why."""


class UnreadableCheckpoint(CheckpointError):
    """Raised for a checkpoint whose files cannot be read; the message names it and the reason."""


def _read_dataset(name, item):  # pylint: disable=unused-argument
    if isinstance(item, h5py.Dataset):
        item[()]  # pylint: disable=pointless-statement
    # Returns None: `visititems` goes on to the next item (anything else would stop it).


def unreadable(path):
    """Returns why checkpoint `path` cannot be read, in one line, or None when every tensor
    reads."""
    try:
        if path.endswith(".h5"):
            with h5py.File(path, "r") as weights:
                weights.visititems(_read_dataset)
        else:
            reader = tf.train.load_checkpoint(path)
            for name in reader.get_variable_to_shape_map():  # each read checks a checksum
                reader.get_tensor(name)
    except Exception as error:  # pylint: disable=broad-except  (any failure to read)
        return (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
    return None


def checkpoint_files(path):
    """Returns the files of checkpoint `path`: a .h5 file, or a prefix's ``.index`` and
    ``.data-*``."""
    return [path] if path.endswith(".h5") else sorted(glob.glob(glob.escape(path) + ".*"))


def held_objects(path):
    """Returns the names of the objects at a checkpoint's top (``weights``, ``optimizer``...)."""
    if path.endswith(".h5"):
        return {"weights"}
    keys = tf.train.load_checkpoint(path).get_variable_to_shape_map()
    return {key.split("/", 1)[0] for key in keys}


def model_weights(model):
    """Returns the model's variables by their path below it (``encoder_0/.../kernel``), as
    checkpoints name them: not by the object graph, so that any model of the same hparams restores
    them, whatever its name."""
    return {variable.path.split("/", 1)[1]: variable for variable in model.weights}


def checkpoint_dir(logdir):
    """Returns the folder of `logdir`'s rolling checkpoints."""
    return os.path.join(logdir, filenames.CHECKPOINTS)


def list_checkpoints(logdir):
    """Returns the rolling checkpoints of `logdir`, oldest first, as paths without suffix."""
    return listed_checkpoints(checkpoint_dir(logdir))


def listed_checkpoints(directory):
    """Returns the complete checkpoints that the index of `directory` lists, oldest first."""
    state = tf.train.get_checkpoint_state(directory)
    paths = state.all_model_checkpoint_paths if state is not None else []
    return [path for path in paths if tf.io.gfile.exists(path + ".index")]


def resolve(logdir, ckpt):
    """Returns the checkpoint that `ckpt` names: a path, or "best" (the logdir's best weights);
    raises a `CheckpointError` when it does not exist."""
    if ckpt == filenames.BEST:
        path = os.path.join(logdir, filenames.BEST_WEIGHTS)
        if not os.path.isfile(path):
            raise CheckpointError(f"{logdir}: no best checkpoint (best.weights.h5); it is "
                                  "written when training scores validation BLEU")
        return path
    if not (tf.io.gfile.exists(ckpt + ".index") or os.path.isfile(ckpt)):
        raise CheckpointError(f"{ckpt}: no such checkpoint")
    return ckpt


def _restore_into(model, path):
    try:
        if path.endswith(".weights.h5"):
            model.load_weights(path)
        else:
            tf.train.Checkpoint(weights=model_weights(model)).restore(path).expect_partial() \
                .assert_existing_objects_matched()
    except Exception as error:  # pylint: disable=broad-except  (told apart below)
        reason = unreadable(path)
        if reason:
            raise UnreadableCheckpoint(f"{path}: cannot be read ({reason})") from None
        if not isinstance(error, (ValueError, AssertionError, tf.errors.InvalidArgumentError,
                                  tf.errors.NotFoundError)):
            raise
        first_line = str(error).strip().splitlines()[0][:300]
        raise CheckpointError(f"{path}: does not fit the model described by the logdir's "
                              f"hparams.json ({first_line})") from None


def newest_readable(paths):
    """Finds the newest of `paths` (oldest first) whose every tensor reads; returns ``(path,
    bad)``: that path or None, and ``{path: reason}`` of the newer ones that cannot be read."""
    bad = {}
    for path in reversed(paths):
        reason = unreadable(path)
        if reason is None:
            return path, bad
        bad[path] = reason
    return None, bad


def _restore_latest_readable(model, logdir):
    """Restores the newest checkpoint that reads, noting those skipped; returns its path."""
    available = list_checkpoints(logdir)
    if not available:
        raise CheckpointError(f"{logdir}: no checkpoint in {checkpoint_dir(logdir)} "
                              "(has training saved one yet?)")
    path, bad = newest_readable(available)
    for bad_path, reason in bad.items():
        print(f"note: skipped {bad_path}: cannot be read ({reason})", flush=True)
    if path is None:
        tried = ", ".join(os.path.basename(path) for path in reversed(available))
        raise CheckpointError(
            f"{checkpoint_dir(logdir)}: no checkpoint can be read (tried {tried})")
    _restore_into(model, path)
    return path


def _average_into(model, paths):
    """Sets the model's weights to the mean of the checkpoints at `paths`."""
    total = None
    for path in paths:
        try:
            _restore_into(model, path)
        except UnreadableCheckpoint as error:
            raise UnreadableCheckpoint(f"{error}; it is one of the last {len(paths)} "
                                       "checkpoints to average: average fewer, or give "
                                       "one with --ckpt") from None
        # Summed in float64: the mean of many float32 checkpoints loses nothing to rounding.
        weights = [np.asarray(weight, np.float64) for weight in model.get_weights()]
        total = weights if total is None else [t + w for t, w in zip(total, weights)]
    model.set_weights([t / len(paths) for t in total])


def describe(paths):
    """Describes checkpoints `paths` in words: the path of one, or ``average of N checkpoints
    (names)`` for several."""
    names = ", ".join(os.path.basename(path) for path in paths)
    return paths[0] if len(paths) == 1 else f"average of {len(paths)} checkpoints ({names})"


def load_model(hparams, logdir, ckpt=None, average_last=0):
    """Builds a `Transformer` of `hparams` with the weights of checkpoints `paths`; returns
    ``(model, paths)``. The checkpoints are `ckpt` (a path, or "best"), the mean of the last
    `average_last` (> 1) rolling ones (the paper's averaging), or by default the latest that can be
    read. A `CheckpointError` (or its subclass `UnreadableCheckpoint`) says which is missing, too
    few, unreadable, or does not fit."""
    average_last = int(average_last or 0)
    check_checkpoint_choice(ckpt, average_last)
    model = Transformer.from_hparams(hparams, name="transformer")
    model.build()
    if average_last > 1:
        available = list_checkpoints(logdir)
        if len(available) < average_last:
            names = ", ".join(os.path.basename(path) for path in available) or "none"
            raise CheckpointError(
                f"{checkpoint_dir(logdir)}: asked to average the last {average_last} checkpoints "
                f"(average_last={average_last}), but {len(available)} exist: {names}")
        _average_into(model, available[-average_last:])
        return model, available[-average_last:]
    if not ckpt:
        return model, [_restore_latest_readable(model, logdir)]
    path = resolve(logdir, ckpt)
    _restore_into(model, path)
    return model, [path]


def load_trained(hparams, logdir, ckpt=None, average_last=0, mixed_precision="no", log=print):
    """Loads a model for decoding: sets the Keras dtype policy to `mixed_precision` (``auto``:
    chosen for this machine, the choice said through `log`), then loads the model and checkpoints
    as `load_model` does; returns ``(model, paths, precision)``. The weights stay float32 whatever
    the policy."""
    precision = resolve_precision(mixed_precision, hparams, log=log)
    set_precision(precision)
    model, paths = load_model(hparams, logdir, ckpt, average_last)
    return model, paths, precision


# The objects every run checkpoint holds beside the weights.
RUN_STATE = ("optimizer", "epoch", "step_in_epoch")


class RunCheckpoints:
    """Saves and restores the checkpoints of a run in `directory` (the chief keeps the
    `max_to_keep` latest, the others none) and the run state they hold: the data position `epoch`
    and `step_in_epoch` (batches done in it), and `train_seconds` (resumed runs included: what
    `max_minutes` limits).
    """

    def __init__(self, strategy, model, optimizer, directory, max_to_keep, chief):
        with strategy.scope():
            self.epoch = tf.Variable(0, dtype=tf.int64, trainable=False, name="epoch")
            self.step_in_epoch = tf.Variable(0, dtype=tf.int64, trainable=False,
                                             name="step_in_epoch")
            self.train_seconds = tf.Variable(0.0, dtype=tf.float64, trainable=False,
                                             name="train_seconds")
        self.directory, self.chief, self.max_to_keep = directory, chief, max_to_keep
        self.checkpoint = tf.train.Checkpoint(
            weights=model_weights(model), optimizer=optimizer, epoch=self.epoch,
            step_in_epoch=self.step_in_epoch,
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
        path, bad = newest_readable(listed_checkpoints(self.directory))
        if path is None:
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
        self.checkpoint.restore(path).assert_existing_objects_matched()
        return path

    def save(self, step, train_seconds):
        """Saves checkpoint number `step`; returns its path on the chief, else None. On a full
        disk it removes what the save had written and raises `writes.OutOfSpace`."""
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
    """Raises a `CheckpointError` for a checkpoint of weights without a run's state (no
    optimizer, epoch or data position: an imported or hand-made one), which no run can resume
    from."""
    if not set(RUN_STATE) <= held_objects(path):
        logdir = os.path.dirname(os.path.dirname(path))
        raise CheckpointError(
            f"{path} holds weights without a run state (no optimizer, epoch or data position): "
            f"a run cannot resume from it. To train from these weights, start a new run: "
            f"--init_from {logdir} with a new --logdir")


def random_states(model):
    """Returns the dropout layers' seed-generator states in `model.variables` order, which
    depends on the structure only, unlike their names (which count the process's earlier
    generators)."""
    weights = {id(weight) for weight in model.weights}
    return [variable for variable in model.variables
            if id(variable) not in weights and "seed_generator" in variable.path]


def private_dir(prefix):
    """Makes a throw-away folder, removed when the process ends (also when the run fails);
    returns its path."""
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def set_aside(path):
    """Moves checkpoint `path`'s files to `corrupt/` beside it, out of the index; returns the
    folder they went to. They are never deleted: neither a later save of the same step nor the
    rotation reaches them."""
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
    """Returns the size in bytes of checkpoint `path`'s files: what another one like it needs."""
    return sum(os.path.getsize(name) for name in checkpoint_files(path))
