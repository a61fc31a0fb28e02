"""Holds the `Trainer`, which builds a run's parts (its `step`, `distribution`, `checkpoints`,
`clock`, `history`, the precision) and drives them, epoch by epoch. The ``fast_paths`` hparam
selects the fused Adam, the loss's stated gradient and the loss compiled alone with XLA
(``xla_loss``).
"""

import hashlib
import math
import os

import keras
import numpy as np
import tensorflow as tf

from kyu_transformer import filenames
from kyu_transformer.losses import LabelSmoothedCrossEntropy
from kyu_transformer.model import Transformer
from kyu_transformer.precision import AUTO, set_precision
from kyu_transformer.safety.signals import StopRequests
from kyu_transformer.safety.writes import replaced_atomically
from kyu_transformer.training.checkpoints import CheckpointError, RunCheckpoints, checkpoint_dir
from kyu_transformer.training.clock import TimeBudget, UpdatePlan
from kyu_transformer.training.distribution import (
    barrier, check_agreement, distribute_batches, is_chief, is_multi_worker)
from kyu_transformer.training.history import Progress, TrainingLog, Window
from kyu_transformer.training.optimizer import LossScaleOptimizer, make_adam
from kyu_transformer.training.plots import plot_training
from kyu_transformer.training.schedule import NoamSchedule
from kyu_transformer.training.step import TrainStep, loss_terms_function


def seed_everything(seed, deterministic=False):
    """Seeds Python, NumPy, TensorFlow and Keras; with `deterministic`, TensorFlow's ops
    also run deterministically (two runs with one seed give bit-identical weights)."""
    keras.utils.set_random_seed(seed)
    if deterministic:
        tf.config.experimental.enable_op_determinism()


def weights_digest(model):
    """Returns the SHA-256 of all of `model`'s weights: equal digests mean bit-identical models."""
    digest = hashlib.sha256()
    for weight in model.weights:
        digest.update(np.ascontiguousarray(weight.numpy()).tobytes())
    return digest.hexdigest()


def build_model_and_optimizer(hparams):
    """Returns a run's built ``(model, schedule, optimizer)``, made in the current strategy's
    scope: Adam as the paper sets it, its rate `NoamSchedule`'s, with loss scaling under fp16."""
    model = Transformer.from_hparams(hparams, name="transformer")
    model.build()
    schedule = NoamSchedule(hparams["d_model"], hparams["warmup_steps"], hparams["lr"],
                            hparams.get("decay_steps", 0))
    optimizer = make_adam(schedule, fast_paths=hparams.get("fast_paths", True), beta_1=0.9,
                          beta_2=0.98, epsilon=1e-9)
    if hparams["mixed_precision"] == "fp16":
        optimizer = LossScaleOptimizer(optimizer)
    optimizer.build(model.trainable_variables)
    return model, schedule, optimizer


class TrainingError(RuntimeError):
    """Raised when training cannot go on (e.g. the loss is no longer finite)."""


class Trainer:
    """Trains a `Transformer` under `strategy`, with checkpoints and summaries in `logdir`.

    ``mixed_precision`` must be chosen already (``no``, ``bf16``, ``fp16``): a run resolves
    ``auto`` once (`training.logdir.prepare_logdir`, on the chief). `hooks`: ``hook(trainer,
    epoch, logs)``, run on the chief after each epoch (may add to `logs`). `initialize(trainer)`
    sets the starting weights where there is no checkpoint (`fine_tuning.Source.initialize`)."""

    def __init__(self, hparams, strategy=None, logdir=None, hooks=(), verbose=True,
                 initialize=None):
        self.hparams = hparams = dict(hparams)
        self.strategy = strategy or tf.distribute.get_strategy()
        self.logdir = logdir or hparams["logdir"]
        self.hooks, self.verbose, self.initialize = list(hooks), verbose, initialize
        self.chief = is_chief(self.strategy)
        fast_paths = hparams.get("fast_paths", True)
        if hparams["mixed_precision"] == AUTO:
            raise ValueError("`mixed_precision` is auto: resolve it first "
                             "(kyu_transformer.precision.resolve_precision)")
        set_precision(hparams["mixed_precision"])
        with self.strategy.scope():
            self.model, self.schedule, self.optimizer = build_model_and_optimizer(hparams)
        self.checkpoints = RunCheckpoints(self.strategy, self.model, self.optimizer,
                                          checkpoint_dir(self.logdir), hparams["keep_checkpoints"],
                                          self.chief)
        self.per_update = hparams.get("accumulate_steps", 1)
        self.last_saved = self.plan = self.last_loss = None  # last_loss: the last summary's mean
        self.budget = TimeBudget(hparams["max_minutes"], self.strategy)
        self.log = TrainingLog(self.logdir, self.chief)
        self.loss_fn = LabelSmoothedCrossEntropy(hparams["smoothing"], fast_paths=fast_paths)
        loss_terms = loss_terms_function(self.loss_fn, xla=fast_paths and hparams["xla_loss"])
        self._train_step = TrainStep(self.strategy, self.model, self.optimizer, loss_terms,
                                     hparams["jit_compile"], self.per_update)

    # The run state, as the checkpoints hold it.
    epoch = property(lambda self: self.checkpoints.epoch)
    step_in_epoch = property(lambda self: self.checkpoints.step_in_epoch)
    train_seconds = property(lambda self: self.checkpoints.train_seconds)
    checkpoint = property(lambda self: self.checkpoints.checkpoint)
    manager = property(lambda self: self.checkpoints.manager)

    def global_step(self):
        """Returns the optimizer steps taken so far, as a Python int under any strategy."""
        return int(self.optimizer.iterations.value.numpy())

    def distribute(self, make_global_batches):
        """Returns the step's `distribute_batches` (endless for updates of several batches)."""
        return distribute_batches(self.strategy, make_global_batches, endless=self.per_update > 1)

    def restore(self):
        """Restores the latest readable checkpoint (returns its path), else runs `initialize`;
        then waits at a barrier, so that a worker failing here (the chief's unreadable
        checkpoints) stops all."""
        try:
            path = self.checkpoints.restore()
            if path is None and self.initialize is not None:
                self.initialize(self)
        except (CheckpointError, OSError) as error:
            if not is_multi_worker(self.strategy):
                raise
            barrier(self.strategy, str(error))  # raises, on every worker
        barrier(self.strategy)
        return path

    def save(self):
        """Saves a checkpoint of the run; returns its path on the chief (else None)."""
        self.last_saved = self.checkpoints.save(self.global_step(), self.budget.used())
        return self.last_saved

    def fit(self, make_epoch_batches, steps_per_epoch=None, epochs_alike=None):
        """Trains until `num_epochs`, `max_minutes` or the end of the data; a signal stops it
        after an update with a checkpoint (`model.keras` and the plots left to a later run).

        `make_epoch_batches`: ``(epoch, skip=0, share=None) -> tf.data.Dataset`` of global
        batches ``({"source", "target_in"}, target_out)``, the same for the same epoch, from
        batch `skip` on (a resumed run starts where it stopped), the rows of the replicas
        `share` (see `distribute_batches`; None: all) filled at least; `steps_per_epoch` caps
        an epoch's updates; `epochs_alike`: ``[(first epoch, count), ...]``, the runs of epochs
        whose batches are alike, which the plan counts apart (`Corpus.epochs_alike`; None: all
        `num_epochs` alike). Returns a dict:
        ``resumed_from``, ``steps``, ``epochs``, ``stopped`` (``"done"``, ``"time"``,
        ``"SIGTERM"``...), ``last_loss`` (the mean loss of the last summary's updates),
        ``train_seconds`` (resumed runs included) and ``checkpoint`` (the last saved, on the
        chief)."""
        self._train_step.stop_requested.assign(0.0)
        with StopRequests() as self._stop_requests:
            resumed_from = self._resume()
            kinds = [(make_epoch_batches(first), count)
                     for first, count in epochs_alike or [(0, self.hparams["num_epochs"])]]
            self.plan = UpdatePlan.of_run(kinds, steps_per_epoch, self.global_step(),
                                          self.per_update)
            if self.chief and self.verbose:
                print(self.plan.line(self.budget.minutes, self.schedule.decay_steps), flush=True)
            # A run killed after its budget was spent (and saved) trains no further.
            stopped = "time" if self.budget.spent() else "done"
            while int(self.epoch.numpy()) < self.hparams["num_epochs"] and stopped == "done":
                stopped = self._train_epoch(make_epoch_batches, steps_per_epoch)
            if self.chief and stopped in ("done", "time"):
                with replaced_atomically(os.path.join(self.logdir, filenames.MODEL)) as temporary:
                    self.model.save(temporary)
                plot_training(self.logdir)
        self.checkpoints.discard_private()
        return {"resumed_from": resumed_from, "steps": self.global_step(),
                "epochs": int(self.epoch.numpy()), "stopped": stopped, "last_loss": self.last_loss,
                "train_seconds": self.budget.used(), "checkpoint": self.last_saved}

    def _resume(self):
        """Restores the latest checkpoint, then opens the log and the clock; returns its path."""
        resumed_from = self.restore()
        self.log.open()
        check_agreement(self.strategy, values={"restored step": self.global_step()})
        self.budget.start(float(self.train_seconds.numpy()))
        if resumed_from and self.chief:
            print(self.budget.resume_line(resumed_from, self.global_step()), flush=True)
        return resumed_from

    def _train_epoch(self, make_epoch_batches, steps_per_epoch):
        """Trains the current epoch from where it stopped; returns how it stopped."""
        epoch, skip = int(self.epoch.numpy()), int(self.step_in_epoch.numpy())

        def batches(share):  # (a resumed run may cap the epoch below what it has done)
            dataset, most = make_epoch_batches(epoch, skip, share), steps_per_epoch or 0
            return dataset.take(max(most * self.per_update - skip, 0)) if most else dataset

        iterator = iter(self.distribute(batches))
        progress = Progress(epoch, self.hparams["num_epochs"], math.ceil(skip / self.per_update),
                            steps_per_epoch, enabled=self.verbose and self.chief)
        stopped = self._run_steps(iterator, epoch, skip, progress)
        if stopped == "done":
            self.epoch.assign_add(1)
            self.step_in_epoch.assign(0)
        self.save()
        if stopped == "done" and self.chief:
            logs = {"kind": "epoch", "step": self.global_step(), "epoch": epoch + 1}
            for hook in self.hooks:
                hook(self, epoch + 1, logs)
            self.log.write(logs)
        return stopped

    def _run_steps(self, iterator, epoch, done, progress):
        """Steps until the data or the budget ends; returns how it stopped (`fit`'s ``stopped``).

        An update's one read by the host is its ``[batches, stops, step, non_finite]``; the sums
        stay on the device until a log step, a stop or the epoch's end."""
        window = Window()
        while True:
            if self._stop_requests.received:  # the next step tells every worker
                self._train_step.request_stop()
            batches, stops, step, non_finite = self._train_step(iterator).numpy().tolist()
            self._check_finite(non_finite)
            if not batches:
                self._summarize(window, progress, step, epoch, record=False)
                progress.finish()
                return "done"
            done += batches  # the epoch's batches
            self.step_in_epoch.assign(done)
            estimate = self.plan.seconds_left(step, self.budget.left())
            progress.update(math.ceil(done / self.per_update), estimate)
            if line := self.plan.estimate_line(step, estimate, self.budget.left()):
                progress.finish(line)
            if step % self.hparams["log_every"] == 0:
                self._summarize(window, progress, step, epoch)
                window = Window()  # a summary's tokens per second are its own
            if stops:
                self._summarize(window, progress, step, epoch, record=False)
                progress.finish(f"stopping after step {step}: "
                                f"{self._stop_requests.received or 'another worker'} received")
                return self._stop_requests.received or "a signal to another worker"
            if self.hparams["checkpoint_every"] and step % self.hparams["checkpoint_every"] == 0:
                self.save()
            if self.budget.spent():
                self._summarize(window, progress, step, epoch, record=False)
                progress.finish(f"stopping: the budget of {self.budget.minutes} minutes is used")
                return "time"

    def _summarize(self, window, progress, step, epoch, record=True):
        """Adds the device's sums since the last summary to `window` and the epoch's totals;
        with `record`, logs the window. Its mean loss becomes `last_loss`."""
        window.add(*self._train_step.take_sums())
        progress.add(window)
        if window.tokens:
            self.last_loss = window.loss / window.tokens
        if record and window.tokens:
            record = {"kind": "train", "step": step, "epoch": epoch + 1, **window.summary(),
                      "lr": float(self.schedule(step - 1))}
            self.log.write(record)
            progress.log(record)

    def _check_finite(self, step):
        """Raises a `TrainingError` (nothing saved) if update `step` (0: none) had a loss that
        was not finite."""
        if step:
            raise TrainingError(
                f"the training loss became non-finite at step {step}; stopping without "
                f"saving. The last good checkpoint is {self.manager.latest_checkpoint}. "
                "Lower `lr`, raise `warmup_steps`, or check the data.")
