"""Finding, restoring and averaging the checkpoints of a logdir."""

import os

import tensorflow as tf

from kyu_transformer.model import Transformer

BEST = "best"


class CheckpointError(ValueError):
    """No usable checkpoint; the message says which and why."""


def model_weights(model):
    """The model's variables by path below the model (``encoder_0/.../kernel``).

    Checkpoints name weights this way, not by the Keras object graph, so that
    any model built from the same hparams restores them, whatever its name.
    """
    return {variable.path.split("/", 1)[1]: variable for variable in model.weights}


def checkpoint_dir(logdir):
    return os.path.join(logdir, "checkpoints")


def list_checkpoints(logdir):
    """The rolling checkpoints of `logdir`, oldest first (paths without suffix)."""
    state = tf.train.get_checkpoint_state(checkpoint_dir(logdir))
    if state is None:
        return []
    return [path for path in state.all_model_checkpoint_paths
            if tf.io.gfile.exists(path + ".index")]


def resolve(logdir, ckpt=None):
    """The checkpoint to use: `ckpt` (a path, or "best"), else the latest."""
    if ckpt == BEST:
        path = os.path.join(logdir, "best.weights.h5")
        if not os.path.isfile(path):
            raise CheckpointError(f"{logdir}: no best checkpoint (best.weights.h5); it is "
                                  "written when training scores validation BLEU")
        return path
    if ckpt:
        if not (tf.io.gfile.exists(ckpt + ".index") or os.path.isfile(ckpt)):
            raise CheckpointError(f"{ckpt}: no such checkpoint")
        return ckpt
    available = list_checkpoints(logdir)
    if not available:
        raise CheckpointError(f"{logdir}: no checkpoint in {checkpoint_dir(logdir)} "
                              "(has training saved one yet?)")
    return available[-1]


def _restore_into(model, path):
    try:
        if path.endswith(".weights.h5"):
            model.load_weights(path)
        else:
            tf.train.Checkpoint(weights=model_weights(model)).restore(path).expect_partial() \
                .assert_existing_objects_matched()
    except (ValueError, AssertionError, tf.errors.InvalidArgumentError,
            tf.errors.NotFoundError) as error:
        first_line = str(error).strip().splitlines()[0][:300]
        raise CheckpointError(
            f"{path}: does not fit the model described by the logdir's hparams.json "
            f"({first_line})") from None


def load_model(hparams, logdir, ckpt=None, average_last=0):
    """A `Transformer` built from `hparams` with the weights of a checkpoint.

    With ``average_last=N`` the weights are the mean of the last N rolling
    checkpoints (the checkpoint averaging of the Transformer paper).

    Returns ``(model, description)``, the description naming the checkpoint(s).
    """
    model = Transformer.from_hparams(hparams, name="transformer")
    model.build()
    if average_last and average_last > 1:
        paths = list_checkpoints(logdir)[-average_last:]
        if not paths:
            raise CheckpointError(f"{logdir}: no checkpoint to average")
        total = None
        for path in paths:
            _restore_into(model, path)
            weights = model.get_weights()
            total = weights if total is None else [t + w for t, w in zip(total, weights)]
        model.set_weights([t / len(paths) for t in total])
        names = ", ".join(os.path.basename(p) for p in paths)
        return model, f"average of {len(paths)} checkpoints ({names})"
    path = resolve(logdir, ckpt)
    _restore_into(model, path)
    return model, path

