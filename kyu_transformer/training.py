"""The distributed training loop: one step function for every tf.distribute strategy.

Keras 3's ``model.fit`` fails under ``MultiWorkerMirroredStrategy``
(keras-team/keras#20585), so the step is our own: ``strategy.run`` inside a
``tf.function``, the loss summed over tokens and divided by the token count of
the *global* batch (all replicas), gradients all-reduced by the Keras optimizer.

Every replica count sees the same global batches: each global batch is cut
into one contiguous slice per replica, so a run on two devices computes the
same loss as a run on one. The data position (epoch, batches done in it) is
checkpointed with the model and the optimizer, so a killed run continues
where it stopped.
"""

import atexit
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
import time

import keras
import numpy as np
import tensorflow as tf

from kyu_transformer.checkpoints import model_weights
from kyu_transformer.losses import LabelSmoothedCrossEntropy
from kyu_transformer.metrics import masked_accuracy_counts
from kyu_transformer.model import Transformer
from kyu_transformer.optimizers import Adam
from kyu_transformer.plots import plot_training
from kyu_transformer.schedules import NoamSchedule
from kyu_transformer.workers import check_agreement

STRATEGIES = ("auto", "default", "mirrored", "multi_worker")
PRECISION_POLICIES = {"no": "float32", "bf16": "mixed_bfloat16", "fp16": "mixed_float16"}


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. the loss is no longer finite)."""


def make_strategy(name="auto"):
    """The tf.distribute strategy called `name`.

    ``auto``: `MirroredStrategy` when more than one GPU is visible, else the
    default strategy. ``multi_worker`` reads the cluster from ``TF_CONFIG``.
    """
    if name not in STRATEGIES:
        raise ValueError(f"--strategy must be one of {', '.join(STRATEGIES)}, got {name!r}")
    if name == "auto":
        name = "mirrored" if len(tf.config.list_logical_devices("GPU")) > 1 else "default"
    if name == "default":
        return tf.distribute.get_strategy()
    if name == "mirrored":
        return tf.distribute.MirroredStrategy()
    if "TF_CONFIG" not in os.environ:
        raise ValueError("--strategy multi_worker needs the cluster in the TF_CONFIG "
                         "environment variable")
    return tf.distribute.MultiWorkerMirroredStrategy()


def set_precision(mixed_precision):
    """Sets the global Keras dtype policy for ``no`` / ``bf16`` / ``fp16``."""
    keras.config.set_dtype_policy(PRECISION_POLICIES[mixed_precision])


def is_chief(strategy):
    """Whether this process writes checkpoints, summaries and plots."""
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None or not resolver.task_type:
        return True
    cluster = resolver.cluster_spec().as_dict()
    if "chief" in cluster:
        return resolver.task_type == "chief"
    return resolver.task_type == "worker" and resolver.task_id == 0


def loss_terms_function(loss_fn, xla=True):
    """``loss_terms(labels, logits)`` -> ``(loss_sum, correct, tokens)``, compiled with XLA if `xla`.

    The summed token losses of `loss_fn`, the top-1 hits and the non-padding
    tokens of a batch. Only this is compiled, not the step: on CPU the loss
    makes several element-wise passes over the `(N, T, V)` logits, which XLA
    fuses into a few loops and whose row maxima it shares between the loss
    and the hits (forward and backward at the benchmark shape in bf16: 28 ms
    uncompiled, 15 ms compiled), while the matrix products stay on
    TensorFlow's oneDNN kernels, faster than XLA's in bfloat16.
    """
    def loss_terms(labels, logits):
        token_losses = loss_fn.token_losses(labels, logits)  # (N, T)
        correct, tokens = masked_accuracy_counts(labels, logits)
        return tf.reduce_sum(token_losses), correct, tokens

    return tf.function(loss_terms, jit_compile=True) if xla else loss_terms


def replica_slices(dataset, num_replicas, first_replica, local_replicas):
    """Each global batch -> the slices of `local_replicas` replicas, in order.

    Replica ``r`` of ``R`` takes rows ``[n*r//R, n*(r+1)//R)`` of a batch of
    ``n`` rows (possibly none: a replica with an empty slice adds 0 tokens).
    """
    if num_replicas == 1:
        return dataset

    def pieces(features, labels):
        size = tf.shape(labels)[0]

        def piece(replica):
            start = size * tf.cast(replica, tf.int32) // num_replicas
            stop = size * (tf.cast(replica, tf.int32) + 1) // num_replicas
            return tf.nest.map_structure(lambda t: t[start:stop], (features, labels))

        return tf.data.Dataset.range(first_replica, first_replica + local_replicas).map(piece)

    return dataset.flat_map(pieces)


class Trainer:
    """Trains a `Transformer` under a strategy, with checkpoints and summaries.

    Args:
      hparams: dict of resolved hyperparameters (see `hparams.py`).
      strategy: A `tf.distribute.Strategy`; the default strategy when None.
      logdir: Where checkpoints, `history.jsonl`, TensorBoard events and plots
        go; `hparams["logdir"]` when None.
      hooks: Callables ``hook(trainer, epoch, logs)`` run on the chief after
        each epoch (e.g. validation BLEU); they may add entries to `logs`.
      verbose: Whether to show a progress bar.
    """

    def __init__(self, hparams, strategy=None, logdir=None, hooks=(), verbose=True):
        self.hparams = dict(hparams)
        self.strategy = strategy or tf.distribute.get_strategy()
        self.logdir = logdir or hparams["logdir"]
        self.hooks = list(hooks)
        self.verbose = verbose
        self.chief = is_chief(self.strategy)
        set_precision(hparams["mixed_precision"])
        with self.strategy.scope():
            self.model = Transformer.from_hparams(hparams, name="transformer")
            self.model.build()
            self.schedule = NoamSchedule(hparams["d_model"], hparams["warmup_steps"],
                                         hparams["lr"])
            optimizer = Adam(self.schedule, beta_1=0.9, beta_2=0.98, epsilon=1e-9)
            if hparams["mixed_precision"] == "fp16":
                optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
            self.optimizer = optimizer
            self.optimizer.build(self.model.trainable_variables)
            self.epoch = tf.Variable(0, dtype=tf.int64, trainable=False, name="epoch")
            self.step_in_epoch = tf.Variable(0, dtype=tf.int64, trainable=False,
                                             name="step_in_epoch")
            # Seconds of training behind the checkpoint: `max_minutes` is the run's
            # total, however often it is resumed.
            self.train_seconds = tf.Variable(0.0, dtype=tf.float64, trainable=False,
                                             name="train_seconds")
        self._clock = _TrainingClock(0.0)
        self.loss_fn = LabelSmoothedCrossEntropy(hparams["smoothing"])
        self._loss_terms = loss_terms_function(self.loss_fn, xla=hparams["xla_loss"])
        self.checkpoint = tf.train.Checkpoint(
            weights=model_weights(self.model), optimizer=self.optimizer,
            epoch=self.epoch, step_in_epoch=self.step_in_epoch,
            # `model.weights` leaves out the dropout layers' random states: without
            # them a resumed run would draw the masks of step 1 again.
            random_states=random_states(self.model), train_seconds=self.train_seconds)
        self.checkpoint_dir = os.path.join(self.logdir, "checkpoints")
        self.manager = tf.train.CheckpointManager(
            self.checkpoint, self._writable_dir(self.checkpoint_dir),
            max_to_keep=hparams["keep_checkpoints"])
        self._train_step = tf.function(self._distributed_step,
                                       jit_compile=hparams["jit_compile"] or None,
                                       reduce_retracing=True)

    def global_step(self):
        """Optimizer steps taken so far (a Python int, under any strategy)."""
        return int(self.optimizer.iterations.value.numpy())

    # ------------------------------------------------------------ the step

    def _replica_step(self, features, labels):
        replica = tf.distribute.get_replica_context()
        with tf.GradientTape() as tape:
            logits = self.model(features, training=True)  # (n, T, V)
            loss_sum, correct, tokens = self._loss_terms(labels, logits)
            global_tokens = replica.all_reduce(tf.distribute.ReduceOp.SUM, tokens)
            loss = loss_sum / tf.maximum(global_tokens, 1.0)
            scaled_loss = (self.optimizer.scale_loss(loss)
                           if isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer)
                           else loss)
        gradients = tape.gradient(scaled_loss, self.model.trainable_variables)
        self.optimizer.apply_gradients(zip(gradients, self.model.trainable_variables))
        return loss_sum, correct, tokens

    def _distributed_step(self, iterator):
        """One step on the next global batch; ``has_batch`` False at the end of the data.

        (A bare `next()` would raise at the end, but only after the optimizer
        had counted one more iteration: ops that do not wait for the batch run.)
        """
        batch = iterator.get_next_as_optional()
        if not batch.has_value():
            return tf.constant(False), tf.constant(0.0), tf.constant(0.0), tf.constant(0.0)
        per_replica = self.strategy.run(self._replica_step, args=batch.get_value())
        totals = [self.strategy.reduce(tf.distribute.ReduceOp.SUM, value, axis=None)
                  for value in per_replica]
        return (tf.constant(True), *totals)

    # ------------------------------------------------------------ the data

    def distribute(self, make_global_batches):
        """A distributed dataset from `make_global_batches()` (global batches)."""
        strategy = self.strategy

        def dataset_fn(context):
            local = strategy.num_replicas_in_sync // context.num_input_pipelines
            return replica_slices(make_global_batches(), strategy.num_replicas_in_sync,
                                  context.input_pipeline_id * local, local)

        options = tf.distribute.InputOptions(experimental_fetch_to_device=False)
        return strategy.distribute_datasets_from_function(dataset_fn, options)

    # ------------------------------------------------------- checkpointing

    def _writable_dir(self, directory):
        """`directory` on the chief; a throw-away folder on the other workers.

        Every worker must take part in a save (it is a collective), but only
        the chief's files are kept.
        """
        if self.chief:
            os.makedirs(directory, exist_ok=True)
            return directory
        private = tempfile.mkdtemp(prefix="worker-checkpoints-")
        atexit.register(shutil.rmtree, private, ignore_errors=True)  # also when the run fails
        return private

    def restore(self):
        """Restores the latest checkpoint, if any; returns its path or None."""
        latest = self.manager.latest_checkpoint
        if latest is None and not self.chief:
            latest = tf.train.latest_checkpoint(self.checkpoint_dir)
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

    def save(self):
        self.train_seconds.assign(self._clock.seconds())
        path = self.manager.save(checkpoint_number=self.global_step())
        return path if self.chief else None

    def weights_digest(self):
        """SHA-256 of all model weights: equal digests, bit-identical models."""
        digest = hashlib.sha256()
        for weight in self.model.weights:
            digest.update(np.ascontiguousarray(weight.numpy()).tobytes())
        return digest.hexdigest()

    def export(self):
        """Writes the model to `<logdir>/model.keras` (replaced atomically)."""
        if not self.chief:
            return None
        path = os.path.join(self.logdir, "model.keras")
        temporary = os.path.join(self.logdir, ".model.tmp.keras")
        self.model.save(temporary)
        os.replace(temporary, path)
        return path

    # --------------------------------------------------------- the loop

    def _log(self, record):
        if not self.chief:
            return
        with open(os.path.join(self.logdir, "history.jsonl"), "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")
        with self.writer.as_default(step=record["step"]):
            for key, value in record.items():
                if key not in ("step", "epoch", "kind") and isinstance(value, (int, float)):
                    tf.summary.scalar(f"{record.get('kind', 'train')}/{key}", value)
        self.writer.flush()

    def _out_of_time(self, budget):
        """Whether the time budget is spent, agreed by all workers (who stop together)."""
        if budget == math.inf:
            return False
        spent = self._clock.seconds() > budget
        if not self.strategy.extended._in_multi_worker_mode():  # pylint: disable=protected-access
            return spent
        votes = self.strategy.reduce(
            tf.distribute.ReduceOp.SUM,
            self.strategy.run(lambda: tf.constant(float(spent))), axis=None)
        return bool(votes.numpy() > 0)

    def fit(self, make_epoch_batches, steps_per_epoch=None):
        """Trains until `num_epochs`, `max_minutes` or the end of the data.

        Args:
          make_epoch_batches: ``epoch -> tf.data.Dataset`` of global batches
            ``({"source", "target_in"}, target_out)``, the same every time for
            the same epoch (so that a resumed run can skip what it has done).
          steps_per_epoch: Cap on the steps of an epoch (None: the whole data).

        Returns:
          A dict: ``resumed_from``, ``steps``, ``epochs``, ``stopped``
          (``"done"`` or ``"time"``), ``last_loss``, ``train_seconds`` (the
          run's training time, resumed runs included: what `max_minutes` limits).
        """
        hparams = self.hparams
        if self.chief:
            os.makedirs(self.logdir, exist_ok=True)
        self.writer = (tf.summary.create_file_writer(os.path.join(self.logdir, "train"))
                       if self.chief else tf.summary.create_noop_writer())
        resumed_from = self.restore()
        check_agreement(self.strategy, values={"restored step": self.global_step()})
        self._clock = _TrainingClock(float(self.train_seconds.numpy()))
        budget = hparams["max_minutes"] * 60.0 or math.inf
        if resumed_from and self.chief:
            print(_resume_line(resumed_from, self.global_step(), self._clock.seconds(),
                               budget), flush=True)
        # A run killed after its budget was spent (and saved) trains no further.
        stopped, last_loss = ("time" if self._out_of_time(budget) else "done"), None
        while int(self.epoch.numpy()) < hparams["num_epochs"] and stopped == "done":
            epoch = int(self.epoch.numpy())
            skip = int(self.step_in_epoch.numpy())

            def batches(epoch=epoch, skip=skip):
                dataset = make_epoch_batches(epoch)
                if steps_per_epoch:
                    dataset = dataset.take(steps_per_epoch)
                return dataset.skip(skip)

            iterator = iter(self.distribute(batches))
            stopped, last_loss = self._run_epoch(iterator, epoch, skip, steps_per_epoch, budget)
            if stopped == "done":
                logs = {"kind": "epoch", "step": self.global_step(),
                        "epoch": epoch + 1}
                self.epoch.assign_add(1)
                self.step_in_epoch.assign(0)
                self.save()
                if self.chief:
                    for hook in self.hooks:
                        hook(self, epoch + 1, logs)
                    self._log(logs)
            else:
                self.save()
        if self.chief:
            self.export()
            plot_training(self.logdir)
        else:  # a worker's checkpoints were only its part of the collective save
            shutil.rmtree(self.manager.directory, ignore_errors=True)
        return {"resumed_from": resumed_from, "steps": self.global_step(),
                "epochs": int(self.epoch.numpy()), "stopped": stopped, "last_loss": last_loss,
                "train_seconds": self._clock.seconds()}

    def _run_epoch(self, iterator, epoch, skip, steps_per_epoch, budget):
        hparams = self.hparams
        progress = _Progress(epoch, hparams["num_epochs"], skip, steps_per_epoch,
                             enabled=self.verbose and self.chief)
        window = _Window()
        done, last_loss = skip, None
        while True:
            has_batch, loss_sum, correct, tokens = self._train_step(iterator)
            if not bool(has_batch):
                progress.finish()
                return "done", last_loss
            loss_sum, correct, tokens = float(loss_sum), float(correct), float(tokens)
            step = self.global_step()
            done += 1
            self.step_in_epoch.assign(done)
            last_loss = loss_sum / max(tokens, 1.0)
            if not math.isfinite(last_loss):
                raise TrainingError(
                    f"the training loss became {last_loss} at step {step}; stopping without "
                    f"saving. The last good checkpoint is {self.manager.latest_checkpoint}. "
                    "Lower `lr`, raise `warmup_steps`, or check the data.")
            window.add(loss_sum, correct, tokens)
            progress.update(done, loss_sum, correct, tokens)
            if step % hparams["log_every"] == 0:
                record = {"kind": "train", "step": step, "epoch": epoch + 1,
                          **window.summary(), "lr": float(self.schedule(step - 1))}
                self._log(record)
                progress.log(record)
                window = _Window()
            if hparams["checkpoint_every"] and step % hparams["checkpoint_every"] == 0:
                self.save()
            if self._out_of_time(budget):
                progress.finish(f"stopping: the budget of {hparams['max_minutes']} minutes "
                                "is used")
                return "time", last_loss


class _TrainingClock:
    """Seconds of training of the run: those behind the restored checkpoint, plus this process'."""

    def __init__(self, restored_seconds):
        self.restored = restored_seconds
        self.started = time.time()

    def seconds(self):
        return self.restored + time.time() - self.started


def _resume_line(path, step, seconds, budget):
    line = f"resuming from {path} at step {step}, after {seconds / 60:.1f} min of training"
    if budget == math.inf:
        return line
    left = max(budget - seconds, 0.0) / 60
    return line + f"; {left:.1f} of the {budget / 60:g} min budget left"


def random_states(model):
    """The random-number states the model's layers draw from (dropout's seed generators).

    Listed in the order of `model.variables`, which depends on the model's
    structure only (their names also count the generators made before in the
    process, so they cannot serve as checkpoint keys).
    """
    weights = {id(weight) for weight in model.weights}
    return [variable for variable in model.variables
            if id(variable) not in weights and "seed_generator" in variable.path]


class _Window:
    """Sums of loss, hits and tokens since the last summary."""

    def __init__(self):
        self.loss = self.correct = self.tokens = 0.0
        self.started = time.time()

    def add(self, loss_sum, correct, tokens):
        self.loss += loss_sum
        self.correct += correct
        self.tokens += tokens

    def summary(self):
        tokens = max(self.tokens, 1.0)
        return {"loss": self.loss / tokens, "accuracy": self.correct / tokens,
                "tokens_per_sec": self.tokens / max(time.time() - self.started, 1e-9)}


class _Progress:
    """A Keras progress bar on a terminal; one line per summary in a log file."""

    def __init__(self, epoch, num_epochs, skip, steps_per_epoch, enabled):
        self.enabled = enabled
        self.bar = None
        self.totals = _Window()
        if not enabled:
            return
        print(f"epoch {epoch + 1}/{num_epochs}"
              + (f" (resuming after {skip} steps)" if skip else ""), flush=True)
        if sys.stdout.isatty():
            self.bar = keras.utils.Progbar(steps_per_epoch, unit_name="step",
                                           stateful_metrics=["loss", "acc"])

    def update(self, done, loss_sum, correct, tokens):
        self.totals.add(loss_sum, correct, tokens)
        if self.bar is not None:
            summary = self.totals.summary()
            self.bar.update(done, [("loss", summary["loss"]), ("acc", summary["accuracy"])])

    def log(self, record):
        if self.enabled and self.bar is None:
            print(f"step {record['step']}: loss {record['loss']:.4f}, accuracy "
                  f"{record['accuracy']:.4f}, lr {record['lr']:.2e}, "
                  f"{record['tokens_per_sec']:.0f} target tokens/s", flush=True)

    def finish(self, message=None):
        if self.enabled:
            if self.bar is not None:
                print()
            if message:
                print(message, flush=True)


def copy_aside(path):
    """Moves `path` to `<path>.old-<time>` (nothing is deleted); returns the new name."""
    stem = f"{path}.old-{time.strftime('%Y%m%d-%H%M%S')}"
    aside, number = stem, 1
    while os.path.exists(aside):  # twice in one second: never move into the older copy
        number += 1
        aside = f"{stem}-{number}"
    shutil.move(path, aside)
    return aside


def seed_everything(seed, deterministic=False):
    keras.utils.set_random_seed(seed)
    np.random.seed(seed)
    if deterministic:
        tf.config.experimental.enable_op_determinism()
