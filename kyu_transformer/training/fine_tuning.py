"""Checks and reads the source of a fine-tuning run, a run that starts from another run's weights
(``train.py --init_from LOGDIR``, docs/fine_tuning.md). TensorFlow is imported by the parts that
need it, so that train.py refuses a wrong source before TensorFlow loads.
"""

import filecmp
import json
import os
import shutil

from kyu_transformer import filenames
from kyu_transformer.config import ARCHITECTURE, keys_of
from kyu_transformer.safety.writes import replaced_atomically, sha256, write_text

# What the weights and the subword model depend on: the source's, never the command line's.
ARCHITECTURE_KEYS = keys_of(ARCHITECTURE)


class FineTuningError(ValueError):
    """Raised for a source that cannot be fine-tuned from, or for flags that contradict it; its
    message is one line."""


def has_own_checkpoint(logdir):
    """Returns whether `logdir` lists checkpoints of its own (it resumes from them), without
    TensorFlow."""
    return os.path.isfile(os.path.join(logdir, filenames.CHECKPOINTS, filenames.CHECKPOINT_INDEX))


def check_source(logdir, ckpt=None):
    """Returns the path of the source's hparams.json, or raises a FineTuningError for a folder
    that is not a trained run's logdir (no hparams.json, subword model or, unless `ckpt` names one,
    checkpoint)."""
    flag = f"--init_from {logdir}"
    if not os.path.exists(logdir):
        raise FineTuningError(f"{flag}: no such folder")
    if not os.path.isdir(logdir):
        raise FineTuningError(f"{flag}: is a file, expected the logdir of a trained run")
    path = os.path.join(logdir, filenames.HPARAMS)
    if not os.path.isfile(path):
        raise FineTuningError(f"{flag}: not a logdir of train.py (no {filenames.HPARAMS}); "
                              "give the logdir of a trained run")
    if not os.path.isfile(os.path.join(logdir, filenames.SUBWORDS)):
        raise FineTuningError(f"{flag}: no subword model ({filenames.SUBWORDS}) to encode the "
                              "new corpus with")
    if not ckpt and not has_own_checkpoint(logdir):
        raise FineTuningError(f"{flag}: no checkpoint in {filenames.CHECKPOINTS}/ (has it been "
                              "trained?)")
    return path


def with_architecture(hparams, given, source, source_logdir):
    """Returns `hparams` with the `source` hparams' architecture; raises a FineTuningError naming
    every architecture value in `given` (the names set on the command line) that contradicts it."""
    conflicts = [f"{key}: {hparams[key]!r} given, {source[key]!r} in the source"
                 for key in ARCHITECTURE_KEYS if key in given and hparams[key] != source[key]]
    if conflicts:
        raise FineTuningError(
            f"--init_from {source_logdir}: a fine-tuning run keeps the source run's "
            f"architecture, which the command line contradicts ({'; '.join(conflicts)}). Leave "
            "these out, or give the source's values")
    return {**hparams, **{key: source[key] for key in ARCHITECTURE_KEYS}}


def copy_subwords(source_logdir, directory):
    """Copies the source's subword model (and its .vocab) into `directory`, byte for byte;
    one already there must be the same (else FineTuningError)."""
    model = os.path.join(directory, filenames.SUBWORDS)
    if os.path.isfile(model):
        if not filecmp.cmp(model, os.path.join(source_logdir, filenames.SUBWORDS), shallow=False):
            raise FineTuningError(
                f"{model} is not the subword model of --init_from {source_logdir}: use another "
                "--logdir (or --overwrite to move this one aside)")
        return
    os.makedirs(directory, exist_ok=True)
    # The .vocab first, the .model last: a model file only ever stands complete, as trained.
    for name in (filenames.SUBWORDS_VOCABULARY, filenames.SUBWORDS):
        if os.path.isfile(os.path.join(source_logdir, name)):
            with replaced_atomically(os.path.join(directory, name)) as temporary:
                shutil.copyfile(os.path.join(source_logdir, name), temporary)


class Source:
    """Reads a source run's weights (`ckpt`, `average_last`: as `checkpoints.load_model` takes
    them) and checks them against its `hparams` before the new run writes anything; `initialize`
    sets a trainer to them. With `optimizer`, it also takes its optimizer's moments (whose float16
    loss scaling, or not, must be that of `run_precision`, the new run's `mixed_precision`).
    """

    def __init__(self, logdir, hparams, ckpt=None, average_last=0, optimizer=False,
                 run_precision=None):
        from kyu_transformer.training.checkpoints import (
            CheckpointError, checkpoint_files, load_model, model_weights, resolve)

        self.logdir, self.optimizer = logdir, optimizer
        # A source still training replaces its best.weights.h5 whole at each better model:
        # hashed before and after the read, it is known to hold the weights read.
        whole = resolve(logdir, ckpt) if ckpt else ""
        try:
            before = sha256(whole) if whole.endswith(".h5") else None
        except OSError:  # `load_model` says why
            before = None
        model, self.paths = load_model(hparams, logdir, ckpt, average_last)
        self.weights = {key: variable.numpy() for key, variable in model_weights(model).items()}
        if optimizer:
            self._check_optimizer_state(hparams, run_precision)
        self.record = {
            "logdir": os.path.abspath(logdir), "ckpt": ckpt or "latest",
            "average_last": int(average_last or 0),
            "checkpoints": [os.path.abspath(path) for path in self.paths],
            "sha256": self._digests(checkpoint_files), "optimizer": bool(optimizer)}
        if before and self.record["sha256"][os.path.basename(whole)] != before:
            raise CheckpointError(f"--init_from {logdir}: {whole} was replaced while this run "
                                  "read it (the source, still training, found a better model); "
                                  "run again, or give --init_ckpt a numbered checkpoint")

    def _digests(self, checkpoint_files):
        """Returns the sha256 of each file of the checkpoints read; raises a `CheckpointError`
        for one gone since it was read (a source still training removes its oldest as it saves)."""
        from kyu_transformer.training.checkpoints import CheckpointError

        digests = {}
        for path in self.paths:
            try:
                names = checkpoint_files(path)
                digests.update({os.path.basename(name): sha256(name) for name in names})
            except FileNotFoundError:
                names = []
            if not names:
                raise CheckpointError(self._gone(path))
        return digests

    def _gone(self, path):
        return (f"--init_from {self.logdir}: {path} was removed while this run read it (is the "
                "source still training? it keeps only its last checkpoints); give --init_ckpt "
                "one it keeps, or start once the source has stopped")

    def _check_optimizer_state(self, hparams, run_precision):
        import tensorflow as tf

        from kyu_transformer.precision import scales_the_loss
        from kyu_transformer.training.checkpoints import CheckpointError, held_objects

        path = self.paths[0]
        try:
            held = held_objects(path)
        except tf.errors.NotFoundError:
            raise CheckpointError(self._gone(path)) from None
        if len(self.paths) > 1 or "optimizer" not in held:
            raise CheckpointError(f"--init_optimizer: {path} holds no optimizer state (weights "
                                  "only); leave --init_optimizer out to start a fresh optimizer")
        theirs = scales_the_loss(hparams["mixed_precision"], hparams)
        if run_precision is not None and theirs != scales_the_loss(run_precision, hparams):
            raise CheckpointError(
                f"--init_optimizer: the optimizer state of {path} is {'' if theirs else 'not '}"
                f"that of float16's loss scaling (mixed_precision {hparams['mixed_precision']}), "
                f"this run's would {'not ' if theirs else ''}be (mixed_precision "
                f"{run_precision}); train in the same kind, or leave --init_optimizer out")

    def initialize(self, trainer):
        """Sets `trainer`'s weights (and optimizer moments, its step counter back at 0) to the
        source's; the chief records where they came from (`filenames.INIT_FROM`)."""
        import tensorflow as tf

        from kyu_transformer.training.checkpoints import CheckpointError, model_weights

        for key, variable in model_weights(trainer.model).items():
            variable.assign(self.weights[key])
        if self.optimizer:
            try:
                tf.train.Checkpoint(optimizer=trainer.optimizer).restore(self.paths[0]) \
                    .expect_partial().assert_existing_objects_matched()
            except tf.errors.NotFoundError:
                raise CheckpointError(self._gone(self.paths[0])) from None
            except (AssertionError, ValueError) as error:  # e.g. fp16's loss-scale optimizer
                raise CheckpointError(
                    f"--init_optimizer: the optimizer state of {self.paths[0]} does not fit "
                    f"this run's ({str(error).strip().splitlines()[0][:200]})") from None
            trainer.optimizer.iterations.assign(0)  # a fresh step counter and schedule
        if trainer.chief:
            write_text(os.path.join(trainer.logdir, filenames.INIT_FROM),
                       json.dumps(self.record, indent=2) + "\n")
            taken = "weights and optimizer moments" if self.optimizer else "weights"
            print(f"fine-tuning: the {taken} of {', '.join(self.paths)}; a fresh step counter "
                  "and learning-rate schedule", flush=True)
