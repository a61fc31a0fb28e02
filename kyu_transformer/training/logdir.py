"""Settles a training run's logdir against the hyperparameters and corpus it was trained with,
prepares it (the data folder, the subword model, `hparams.json`, `corpus.json`) on the chief, and
has every worker of a multi-worker run agree on it. TensorFlow is imported by the parts that need
it, so that train.py refuses a logdir trained otherwise before TensorFlow loads."""

import contextlib
import json
import os

from kyu_transformer import filenames
from kyu_transformer.config import (
    CHOICES, DEFAULTS, RESUMABLE, SPEC, HParamsError, keys_of, load, save)
from kyu_transformer.data.subwords import Subwords
from kyu_transformer.decoding.archive import is_archive, read_archive
from kyu_transformer.data.text import DataError, check_data_dir, ensure_multi30k, fingerprint
from kyu_transformer.precision import AUTO, resolve_precision
from kyu_transformer.safety.writes import copy_aside
from kyu_transformer.training.fine_tuning import (
    FineTuningError, copy_subwords, has_own_checkpoint)

RESUMABLE_KEYS = keys_of(RESUMABLE)  # what a resumed run may change (the logdir too)
# How a run orders its batches (`data.pipeline.batch_plan`), in `batch_order.json`: a logdir
# without the file was trained before batches were read from a prepared corpus.
BATCH_ORDER = {"batches": "planned from the lengths, read from the prepared corpus"}


class LogdirError(ValueError):
    """Raised for a logdir that this run cannot train in; the message says why and what to do."""


def settle_logdir(hparams, overwrite):
    """Returns the hparams to train with: the logdir's own when resuming, else the given ones. A
    logdir of other hyperparameters or another corpus is refused (`LogdirError`), or with
    `overwrite` moved aside."""
    logdir = hparams["logdir"]
    if overwrite and set(os.listdir(logdir)) - {filenames.LOCK}:
        print(f"--overwrite: moved the old logdir to {copy_aside(logdir, keep=(filenames.LOCK,))}")
        return hparams
    saved_path = os.path.join(logdir, filenames.HPARAMS)
    corpus_path = os.path.join(logdir, filenames.CORPUS)
    problems = []
    saved = load(saved_path) if os.path.isfile(saved_path) else None
    if saved is not None:
        changed = sorted(key for key in SPEC
                         if key not in RESUMABLE_KEYS and saved[key] != hparams[key]
                         # `auto` was resolved when the run began: it matches what it chose
                         and not (key == "mixed_precision" and hparams[key] == AUTO))
        if changed:
            problems.append("other hyperparameters (" + ", ".join(
                f"{key}: {saved[key]!r} -> {hparams[key]!r}" for key in changed) + ")")
    if os.path.isfile(corpus_path):
        with open(corpus_path, encoding="utf-8") as handle:
            if json.load(handle) != corpus_fingerprint(hparams):
                problems.append(f"another corpus (its training files differ from those in "
                                f"{hparams['data_dir']})")
    if not problems:
        return {**(saved or hparams), **{key: hparams[key] for key in RESUMABLE_KEYS}}
    if not os.path.isfile(corpus_path) and has_own_checkpoint(logdir):  # weights, no run
        raise LogdirError(
            f"{logdir} holds checkpoints but no {filenames.CORPUS} (weights written "
            f"without a run of train.py, as import_tf1.py writes them) and differs in "
            f"{' and '.join(problems)}. To train from its weights, start a new run: --init_from "
            f"{logdir} with a new --logdir")
    raise LogdirError(f"{logdir} was trained with {' and '.join(problems)}. Use another "
                      "--logdir, the same settings to resume, or --overwrite to move the old "
                      "logdir aside and start afresh.")


def read_trained(logdir):
    """Reads what decoding with a trained `logdir` needs before its weights: returns
    ``(hparams, subwords)``, its `hparams.json` and subword model (`HParamsError`, `DataError`);
    from a `.keras` file's archive (`decoding.archive`) where `logdir` is one."""
    if is_archive(logdir):
        hparams, _, subwords = read_archive(logdir)
        return hparams, subwords
    return (load(os.path.join(logdir, filenames.HPARAMS)),
            Subwords(os.path.join(logdir, filenames.SUBWORDS)))


def corpus_fingerprint(hparams):
    """Returns the digests of the run's training files (`corpus.json`), which tell one corpus from
    another."""
    return fingerprint(hparams["data_dir"], "train", hparams["src_lang"], hparams["tgt_lang"])


def prepare_logdir(hparams, overwrite, chief, source=None):
    """Checks the data folder (downloading the default one if missing) and settles the logdir;
    returns ``(hparams, corpus)``. The chief also writes `hparams.json` and `corpus.json` the first
    time. A fine-tuning run's corpus is encoded with its `source`'s subword model, copied first."""
    from kyu_transformer.data.corpus import Corpus
    from kyu_transformer.training.checkpoints import (
        list_checkpoints, private_dir, refuse_weights_only, unreadable)

    data_dir = hparams["data_dir"]
    if default_corpus_missing(data_dir):
        print(f"{data_dir} is missing: downloading Multi30k")
        ensure_multi30k(data_dir)
    check_data_dir(data_dir)
    hparams = settle_logdir(hparams, overwrite)
    if chief:  # the others take the chief's choice (`agree_with_chief`)
        hparams["mixed_precision"] = resolve_precision(hparams["mixed_precision"], hparams)
    if chief and not os.path.isfile(os.path.join(hparams["logdir"], filenames.CORPUS)):
        # An imported logdir, refused before anything is written (the restore would refuse it
        # after; it also sets an unreadable checkpoint aside).
        for path in list_checkpoints(hparams["logdir"])[-1:]:
            if unreadable(path) is None:
                refuse_weights_only(path)
    model_dir = hparams["logdir"]
    if not chief and not os.path.isfile(os.path.join(model_dir, filenames.SUBWORDS)):
        # A worker that cannot see the chief's trains the same model, deterministically, apart.
        model_dir = private_dir("worker-subwords-")
    if source is not None:
        copy_subwords(source.logdir, model_dir)
    corpus = Corpus(hparams["data_dir"], model_dir, hparams)
    if chief:
        note_batch_order(hparams["logdir"])
        for name, value in ((filenames.HPARAMS, hparams),
                            (filenames.CORPUS, corpus.fingerprint),
                            (filenames.BATCH_ORDER, BATCH_ORDER)):
            path = os.path.join(hparams["logdir"], name)
            if not os.path.isfile(path):
                save(value, path)
    return hparams, corpus


def note_batch_order(logdir):
    """Says so when `logdir` was trained in another batch order than `BATCH_ORDER`: its
    remaining batches follow this one."""
    path = os.path.join(logdir, filenames.BATCH_ORDER)
    if os.path.isfile(path) or not os.path.isfile(os.path.join(logdir, filenames.CORPUS)):
        return  # written by this code, or a new run
    print(f"note: {logdir} was trained in batches of the corpus held in memory; its remaining "
          "batches are read from the prepared corpus, in its order (the current epoch's may "
          "repeat or leave out some pairs)")


def agree_with_chief(strategy, hparams, corpus, source):
    """Stops every worker of a multi-worker run unless all have the chief's hparams, corpus,
    subword model and fine-tuning source; a worker still at ``auto`` takes the chief's choice."""
    from kyu_transformer.training.distribution import check_agreement, chief_choice, short_digest

    chosen = chief_choice(strategy, hparams["mixed_precision"], CHOICES["mixed_precision"])
    if hparams["mixed_precision"] == AUTO:  # a worker without the chief's hparams.json
        hparams["mixed_precision"] = chosen
    facts = {f"hyperparameter {key}": value
             for key, value in sorted(hparams.items()) if key not in ("logdir", "data_dir")}
    facts["corpus"] = corpus_fingerprint(hparams)
    facts["subword vocabulary"] = corpus.subwords.digest()
    # A source still training may save between reads (null: a worker that read none).
    facts["fine-tuning source"] = source and source.record["sha256"]
    check_agreement(strategy, digests={key: short_digest(fact) for key, fact in facts.items()})


@contextlib.contextmanager
def all_workers_past(strategy):
    """Runs the block, then waits at a barrier for every worker: an error of the block stops
    this worker with its message and every other one naming it, so that none waits for ever."""
    from kyu_transformer.training.checkpoints import CheckpointError
    from kyu_transformer.training.distribution import barrier, is_multi_worker

    failure = None
    try:
        yield
    except SystemExit as error:
        failure = str(error).removeprefix("error: ")
    except (HParamsError, DataError, CheckpointError, FineTuningError, LogdirError) as error:
        failure = str(error)
    except Exception as error:  # pylint: disable=broad-except
        if not is_multi_worker(strategy):
            raise
        # Unforeseen, but it must still reach the barrier: the others would wait for ever.
        failure = f"{type(error).__name__}: {error}"
    barrier(strategy, failure)


def default_corpus_missing(data_dir):
    """Returns whether `data_dir` is the default one and missing: Multi30k is downloaded there."""
    return not os.path.exists(data_dir) and (
        os.path.normpath(data_dir) == os.path.normpath(DEFAULTS["data_dir"]))
