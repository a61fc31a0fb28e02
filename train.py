"""Trains a Transformer translation model.

    python train.py --hparams small --data_dir ../shared/data/multi30k --logdir log/small

Re-running the same command after a crash resumes from the last checkpoint; SIGTERM or SIGINT
stops after an update with a checkpoint (exit status 75). A run holds its logdir's lock; a logdir
trained otherwise is refused unless ``--overwrite`` moves it aside. ``--init_from LOGDIR``
fine-tunes (docs/fine_tuning.md). Mistakes are refused before TensorFlow loads (the modules on
it are imported in the functions that use them).
"""

import contextlib
import os
import shlex
import signal
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import hparams as hp  # noqa: E402
from kyu_transformer import filenames  # noqa: E402
from kyu_transformer.cli.flags import (  # noqa: E402
    add_checkpoint_arguments, check_checkpoint_arguments, refuse_clashes)
from kyu_transformer.cli.startup import start_tensorflow  # noqa: E402
from kyu_transformer.config import HParamsError, load, resolve  # noqa: E402
from kyu_transformer.conventions import STRATEGIES  # noqa: E402
from kyu_transformer.data.text import DataError, check_data_dir  # noqa: E402
from kyu_transformer.safety.lock import LogdirBusy, LogdirLock  # noqa: E402
from kyu_transformer.safety.writes import as_out_of_space, is_out_of_space  # noqa: E402
from kyu_transformer.training.fine_tuning import (  # noqa: E402
    FineTuningError, check_source, has_own_checkpoint, with_architecture)
from kyu_transformer.training.logdir import (  # noqa: E402
    LogdirError, agree_with_chief, all_workers_past, default_corpus_missing, prepare_logdir,
    settle_logdir)

STOPPED_BY_SIGNAL = 75  # after SIGTERM or SIGINT and a checkpoint (EX_TEMPFAIL: run it again)


def main(argv=None):
    """Runs train.py; returns its exit status (0, or 75 after a stop by a signal)."""
    # Outside training SIGTERM acts as Ctrl-C; in it, both ask the trainer to stop after an update.
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        return train(argv)
    except KeyboardInterrupt:
        print("stopped by a signal before a checkpoint could be saved (outside training, or a "
              "third signal); the last complete checkpoint stands. Run the same command again "
              "to go on.", file=sys.stderr, flush=True)
        return STOPPED_BY_SIGNAL
    finally:
        signal.signal(signal.SIGTERM, previous)


def train(argv):
    """Parses, checks, prepares the logdir and corpus, trains and reports; the logdir stays
    locked until it returns."""
    args = parse_args(argv)
    with contextlib.ExitStack() as held:
        return train_locked(args, held, argv)


def train_locked(args, held, argv):
    """Does the work of `train` with `held`, the ExitStack that holds the logdir's lock."""
    if args.strategy != "multi_worker":
        check_before_tensorflow(args, held)
    devices = start_tensorflow()
    from kyu_transformer.training.checkpoints import CheckpointError
    from kyu_transformer.training.distribution import WorkerDisagreement, is_chief, make_strategy
    from kyu_transformer.training.trainer import TrainingError

    # Multi-worker collectives must be set up before TensorFlow runs anything else.
    strategy = make_strategy(args.strategy)
    print(f"devices: {devices}", flush=True)  # each worker's own
    chief, hparams = is_chief(strategy), {}
    try:
        hparams, corpus, source = prepare_run(args, strategy, chief, held)
        trainer = make_trainer(hparams, corpus, strategy, args.deterministic, source)
        started = time.time()
        result = trainer.fit(corpus.train_batches, hparams["steps_per_epoch"] or None,
                             corpus.epochs_alike(hparams["num_epochs"]))
    except (TrainingError, WorkerDisagreement, CheckpointError) as error:
        raise SystemExit(f"error: {error}")
    except Exception as error:  # pylint: disable=broad-except  (re-raised unless the disk is full)
        if not is_out_of_space(error):
            raise
        raise SystemExit(out_of_space_line(error, hparams.get("logdir") or args.logdir)) from None
    return report(result, trainer, hparams["logdir"], (time.time() - started) / 60, argv)


def parse_args(argv):
    """Parses train.py's flags and checks them, stopping with the parser's error."""
    parser = hp.argument_parser(__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="auto", choices=STRATEGIES,
                        help="tf.distribute strategy (multi_worker reads TF_CONFIG)")
    parser.add_argument("--overwrite", action="store_true", help="start afresh in a logdir "
                        "trained otherwise (moving the old one to <logdir>.old-<time>)")
    parser.add_argument("--deterministic", action="store_true",
                        help="TensorFlow op determinism: identical runs for the same seed")
    fine_tuning = parser.add_argument_group("fine-tuning (docs/fine_tuning.md)")
    add_checkpoint_arguments(fine_tuning, prefix="init_")
    fine_tuning.add_argument("--init_optimizer", action="store_true", help="also take the source "
                             "checkpoint's optimizer moments (its step counter still starts at 0)")
    args = parser.parse_args(argv)
    check_checkpoint_arguments(parser, args, prefix="init_")
    refuse_clashes(parser, args, CLASHES)
    return args


# The flags that cannot be given together, and why (`refuse_clashes`).
CLASHES = (
    (lambda args: args.init_optimizer and not args.init_from,
     "--init_optimizer takes the optimizer of --init_from LOGDIR, which is not given"),
    (lambda args: args.init_optimizer and (args.init_ckpt == filenames.BEST
                                           or args.init_average_last > 1),
     lambda args: "--init_optimizer needs one checkpoint of train.py's; "
                  + (f"--init_ckpt {filenames.BEST}" if args.init_ckpt == filenames.BEST
                     else f"--init_average_last {args.init_average_last}")
                  + " has no optimizer state (best.weights.h5 holds weights only; an average "
                  "has none)"),
)


def check_before_tensorflow(args, held):
    """Refuses at once, in a run of one process, its hparams, a busy or unwritable logdir (the
    lock is taken here, until `held` closes), its data folder, a logdir trained otherwise.
    (In a cluster each worker reports its own at a barrier instead.)"""
    try:
        hparams = run_hparams(args)
        hold_logdir(hparams["logdir"], held)
        if default_corpus_missing(hparams["data_dir"]):
            return  # the corpus comes first: `prepare_logdir` downloads it, then checks the rest
        check_data_dir(hparams["data_dir"])
        if not args.overwrite:
            settle_logdir(hparams, overwrite=False)
    except (HParamsError, DataError, LogdirError) as error:
        raise SystemExit(f"error: {error}") from None


def run_hparams(args):
    """Returns the run's hparams: its flags', and for a fine-tuning run (--init_from) the source's
    architecture, which values given again must equal. A run resuming from checkpoints of its own
    takes the architecture from its own hparams.json: the source is not read again."""
    hparams = hp.from_args(args)
    if not args.init_from:
        return hparams
    own = hparams["logdir"]
    if os.path.abspath(args.init_from) == os.path.abspath(own):
        raise SystemExit(f"error: --init_from {args.init_from} is this run's own --logdir: "
                         "fine-tune into a new --logdir")
    try:
        origin = os.path.join(own, filenames.HPARAMS)
        if args.overwrite or not (has_own_checkpoint(own) and os.path.isfile(origin)):
            origin = check_source(args.init_from, args.init_ckpt)
        return resolve(with_architecture(hparams, hp.given_keys(args), load(origin),
                                         args.init_from))
    except FineTuningError as error:
        raise SystemExit(f"error: {error}") from None


def hold_logdir(logdir, held):
    """Takes the logdir's lock (before anything is written) until `held` (an ExitStack) closes."""
    try:
        held.enter_context(LogdirLock(logdir))
    except LogdirBusy as error:
        raise SystemExit(f"error: {error}") from None
    except OSError as error:
        raise SystemExit(f"error: the logdir {logdir} is not writable ({error.strerror})")


def read_source(args, hparams, chief):
    """Returns the source of a fine-tuning run that starts now, its weights read before anything is
    written; None without --init_from, or when the run resumes from its own checkpoints."""
    from kyu_transformer.training.checkpoints import list_checkpoints
    from kyu_transformer.training.fine_tuning import Source

    if not args.init_from:
        return None
    if not args.overwrite and list_checkpoints(hparams["logdir"]):
        if chief:
            print(f"note: {hparams['logdir']} has checkpoints of its own: it resumes from them, "
                  f"and --init_from {args.init_from} is not read", flush=True)
        return None
    return Source(args.init_from, load(os.path.join(args.init_from, filenames.HPARAMS)),
                  args.init_ckpt, args.init_average_last, args.init_optimizer,
                  run_precision=hparams["mixed_precision"])


def prepare_run(args, strategy, chief, held):
    """Settles the logdir, makes the subword model ready and reads a fine-tuning run's
    `fine_tuning.Source` (or None); returns ``(hparams, corpus, source)``. The chief goes first
    (it alone locks and writes the logdir; in a run of one process `check_before_tensorflow` has
    locked it), then the others; all check that they agree. A worker that fails says so at the
    next barrier."""
    from kyu_transformer.training.distribution import is_multi_worker

    corpus = None
    with all_workers_past(strategy):  # the chief has written what it had to
        hparams = run_hparams(args)
        source = read_source(args, hparams, chief)  # also checks it: before any write
        if chief:
            if args.strategy == "multi_worker":  # else locked before TensorFlow loaded
                hold_logdir(hparams["logdir"], held)
            hparams, corpus = prepare_logdir(hparams, args.overwrite, True, source)
    with all_workers_past(strategy):  # every worker has hparams and subwords
        if not chief:
            hparams, corpus = prepare_logdir(hparams, False, False, source)
    if is_multi_worker(strategy):
        agree_with_chief(strategy, hparams, corpus, source)
    return hparams, corpus, source


def make_trainer(hparams, corpus, strategy, deterministic, source=None):
    """Makes the run's `Trainer` (validation BLEU after each epoch when `eval_sentences`),
    everything seeded first; a fine-tuning `source` sets the starting weights."""
    from kyu_transformer.training.distribution import batch_line
    from kyu_transformer.training.trainer import Trainer, seed_everything
    from kyu_transformer.training.validation import ValidationBleu

    seed_everything(hparams["seed"], deterministic)
    print(batch_line(strategy, hparams))
    hooks = ([ValidationBleu(corpus.val_sources, corpus.val_targets, corpus.subwords,
                             hparams["eval_sentences"], hparams["eval_batch_size"])]
             if hparams["eval_sentences"] else [])
    trainer = Trainer(hparams, strategy, hooks=hooks, initialize=source and source.initialize)
    print(f"model: {trainer.model.count_params():,} parameters")
    return trainer


def report(result, trainer, logdir, minutes, argv):
    """Prints how the run ended; returns the exit status."""
    from kyu_transformer.training.trainer import weights_digest

    if result["resumed_from"]:
        print(f"resumed from {result['resumed_from']}")
    if result["stopped"] not in ("done", "time"):
        saved = result["checkpoint"] or "the chief's checkpoint"
        # The command that resumes: without --overwrite, which would start afresh.
        arguments = [arg for arg in (sys.argv[1:] if argv is None else argv)
                     if arg != "--overwrite"]
        resume = shlex.join(["python", sys.argv[0] if argv is None else "train.py", *arguments])
        print(f"stopped by {result['stopped']} after step {result['steps']}; saved {saved}. "
              f"Resume with: {resume}", flush=True)
        return STOPPED_BY_SIGNAL
    # A resumed run's minutes are this process's; the run's training time spans them all.
    spent = f"{minutes:.1f} min" + (
        f" ({result['train_seconds'] / 60:.1f} min of training in all, the earlier runs "
        "included)" if result["resumed_from"] else "")
    print(f"{result['stopped']}: {result['epochs']} epochs, {result['steps']} steps in {spent}; "
          f"last loss {result['last_loss']}; logdir {logdir}")
    print(f"weights sha256: {weights_digest(trainer.model)}")
    return 0


def out_of_space_line(error, logdir):
    """Returns the one line a run stopped by a full disk ends with."""
    from kyu_transformer.training.checkpoints import list_checkpoints

    try:
        newest = list_checkpoints(logdir) if logdir and os.path.isdir(logdir) else []
    except ValueError:  # an index cut short
        newest = []
    return (f"error: {as_out_of_space(error)}; the newest complete checkpoint is "
            f"{newest[-1] if newest else 'none yet'}. Free some space and run the same "
            "command again to resume.")


if __name__ == "__main__":
    sys.exit(main())
