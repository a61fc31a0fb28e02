"""Finding, restoring and averaging the checkpoints of a logdir. One that cannot be read (cut
short, its checksums fail) is told apart from one that does not fit the model, and skipped with a
note in place of the latest (refused when asked for by name or to average).
"""

import glob
import os

import h5py
import numpy as np
import tensorflow as tf

from kyu_transformer import filenames
from kyu_transformer.model import Transformer

BEST = "best"


class CheckpointError(ValueError):
    """No usable checkpoint; the message says which and why."""


class UnreadableCheckpoint(CheckpointError):
    """A checkpoint whose files cannot be read; the message names it and the reason."""


def _read_dataset(name, item):  # pylint: disable=unused-argument
    if isinstance(item, h5py.Dataset):
        item[()]  # pylint: disable=pointless-statement
    # Returns None: `visititems` goes on to the next item (anything else would stop it).


def unreadable(path):
    """Why checkpoint `path` cannot be read (one line); None when every tensor reads."""
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
    """The files of checkpoint `path`: a .h5 file, or a prefix's ``.index`` and ``.data-*``."""
    return [path] if path.endswith(".h5") else sorted(glob.glob(glob.escape(path) + ".*"))


def held_objects(path):
    """The names of the objects at a checkpoint's top (``weights``, ``optimizer``...)."""
    if path.endswith(".h5"):
        return {"weights"}
    keys = tf.train.load_checkpoint(path).get_variable_to_shape_map()
    return {key.split("/", 1)[0] for key in keys}


def model_weights(model):
    """The model's variables by path below it (``encoder_0/.../kernel``), as checkpoints name them
    (not by the object graph: any model of the same hparams restores them, whatever its name)."""
    return {variable.path.split("/", 1)[1]: variable for variable in model.weights}


def checkpoint_dir(logdir):
    return os.path.join(logdir, filenames.CHECKPOINTS)


def list_checkpoints(logdir):
    """The rolling checkpoints of `logdir`, oldest first (paths without suffix)."""
    return listed_checkpoints(checkpoint_dir(logdir))


def listed_checkpoints(directory):
    """The complete checkpoints the index of `directory` lists, oldest first."""
    state = tf.train.get_checkpoint_state(directory)
    paths = state.all_model_checkpoint_paths if state is not None else []
    return [path for path in paths if tf.io.gfile.exists(path + ".index")]


def resolve(logdir, ckpt):
    """The checkpoint named by `ckpt`: a path, or "best" (the logdir's best weights)."""
    if ckpt == BEST:
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


def _restore_latest_readable(model, logdir):
    """Restores the newest checkpoint that reads, noting those skipped; returns its path."""
    available = list_checkpoints(logdir)
    if not available:
        raise CheckpointError(f"{logdir}: no checkpoint in {checkpoint_dir(logdir)} "
                              "(has training saved one yet?)")
    for path in reversed(available):
        try:
            _restore_into(model, path)
            return path
        except UnreadableCheckpoint as error:
            print(f"note: skipped {error}", flush=True)
    tried = ", ".join(os.path.basename(path) for path in reversed(available))
    raise CheckpointError(f"{checkpoint_dir(logdir)}: no checkpoint can be read (tried {tried})")


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
    """A checkpoint path, or ``average of N checkpoints (names)`` for several."""
    names = ", ".join(os.path.basename(path) for path in paths)
    return paths[0] if len(paths) == 1 else f"average of {len(paths)} checkpoints ({names})"


def load_model(hparams, logdir, ckpt=None, average_last=0):
    """``(model, paths)``: a `Transformer` of `hparams` with the weights of checkpoints `paths`:
    `ckpt` (a path, or "best"), the mean of the last `average_last` (> 1) rolling ones (the
    paper's averaging), or by default the latest that can be read. A `CheckpointError` (its subclass
    `UnreadableCheckpoint`) says which is missing, too few, unreadable, or does not fit."""
    average_last = int(average_last or 0)
    if average_last < 0:
        raise ValueError(f"`average_last` must be at least 0, got {average_last}")
    if ckpt and average_last:
        raise ValueError(f"`ckpt` ({ckpt}) and `average_last` ({average_last}) exclude each "
                         "other: give one checkpoint, or the number of last ones to average")
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
