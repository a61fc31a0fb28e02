"""Fine-tuning (train.py --init_from): the source's architecture, subword model and weights, a
fresh optimizer; weights-only logdirs; refusals that write nothing."""

import filecmp
import hashlib
import json
import os
import random
import re
import shutil
import threading
import time

import numpy as np
import pytest
import tensorflow as tf

import hparams as hp
import train
from kyu_transformer import config, filenames
from kyu_transformer.data.corpus import Corpus
from kyu_transformer.data.text import load_split
from kyu_transformer.losses import LabelSmoothedCrossEntropy
from kyu_transformer.model import Transformer
from kyu_transformer.training.checkpoints import (
    CheckpointError, checkpoint_files, load_model, model_weights)
from kyu_transformer.training.fine_tuning import ARCHITECTURE_KEYS, Source
from kyu_transformer.training.trainer import Trainer
from tests import programs
from tests.test_data import MULTI30K
from tests.test_training import refusals

# Pairs with characters the Multi30k sample never shows: its subword model maps them to unknown.
UNSEEN = [("Ein Roboter ☃ spielt Schach.", "A robot ☃ plays chess."),
          ("Zwei 猫 schlafen im Garten.", "Two 猫 sleep in the garden.")]


def write_corpus(folder, pairs_by_split):
    folder.mkdir()
    for split, pairs in pairs_by_split.items():
        for side, lang in enumerate(("de", "en")):
            (folder / f"{split}.{lang}").write_text(
                "".join(pair[side] + "\n" for pair in pairs), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def new_corpus(tmp_path_factory):
    """Another corpus than the source's: the sample's test split as training data, and UNSEEN."""
    test = list(zip(*load_split(MULTI30K, "test_2016_flickr")[:2]))
    val = list(zip(*load_split(MULTI30K, "val")[:2]))
    return write_corpus(tmp_path_factory.mktemp("new-corpus") / "data",
                        {"train": test + UNSEEN, "val": val[:50]})


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A run of the tiny preset after 20 updates on the Multi30k sample, as train.py leaves it."""
    logdir = tmp_path_factory.mktemp("source") / "log"
    hparams = hp.parse("tiny", {"logdir": str(logdir), "data_dir": MULTI30K})
    corpus = Corpus(MULTI30K, str(logdir), hparams, log=lambda line: None)
    config.save(hparams, str(logdir / filenames.HPARAMS))
    Trainer(hparams, verbose=False).fit(corpus.train_batches, steps_per_epoch=20)
    return logdir


def weights_only_logdir(logdir, hparams, model, subwords_of):
    """A logdir as the TF1 importer writes it: hparams.json, the subword model (of logdir
    `subwords_of`) and a checkpoint of `model`'s weights alone (no optimizer, epoch or data
    position). Returns the checkpoint's path."""
    os.makedirs(logdir / filenames.CHECKPOINTS)
    config.save({**hparams, "logdir": str(logdir)}, str(logdir / filenames.HPARAMS))
    for name in (filenames.SUBWORDS, filenames.SUBWORDS_VOCABULARY):
        (logdir / name).write_bytes((subwords_of / name).read_bytes())
    manager = tf.train.CheckpointManager(
        tf.train.Checkpoint(weights=model_weights(model)), str(logdir / filenames.CHECKPOINTS),
        max_to_keep=1, checkpoint_name=filenames.CHECKPOINT_PREFIX)
    return manager.save()


def fine_tune_hparams(logdir, data_dir):
    return hp.parse("tiny", {"logdir": str(logdir), "data_dir": str(data_dir), "lr": 0.05,
                             "warmup_steps": 2})


def mean_loss(model, batches, smoothing):
    loss = LabelSmoothedCrossEntropy(smoothing)
    return float(np.mean([float(loss(target, model(inputs))) for inputs, target in batches]))


def call_train(*arguments):
    """train.py in this process; its exit status, or the message it stopped with."""
    try:
        return train.main([str(argument) for argument in arguments])
    except SystemExit as stop:
        return str(stop.code)


def starts_exactly_at(origin, logdir, corpus_dir, optimizer=False):
    """A trainer fine-tuning from logdir `origin`, checked to give, before its first update,
    exactly the outputs of `origin`'s model on the new corpus."""
    theirs = config.load(str(origin / filenames.HPARAMS))
    hparams = {**fine_tune_hparams(logdir, corpus_dir),
               **{key: theirs[key] for key in ARCHITECTURE_KEYS}}
    trainer = Trainer(hparams, verbose=False,
                      initialize=Source(str(origin), theirs, optimizer=optimizer).initialize)
    assert trainer.restore() is None and trainer.global_step() == 0
    model, _ = load_model(theirs, str(origin))
    corpus = Corpus(str(corpus_dir), str(origin), hparams, log=lambda line: None)
    for inputs, _ in corpus.train_batches(0).take(3):
        np.testing.assert_array_equal(trainer.model(inputs).numpy(), model(inputs).numpy())
    return trainer


def file_digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.slow
def test_fine_tuning_takes_the_source_and_learns_the_new_corpus(tmp_path, source, new_corpus,
                                                                capsys):
    logdir = tmp_path / "fine-tuned"
    command = ["--hparams", "tiny", "--data_dir", new_corpus, "--logdir", logdir,
               "--init_from", source, "--lr", "0.05", "--warmup_steps", "2",
               "--steps_per_epoch", "6"]
    assert call_train(*command) == 0
    output = capsys.readouterr().out
    checkpoint = source / filenames.CHECKPOINTS / "ckpt-20"
    assert f"fine-tuning: the weights of {checkpoint}; a fresh step counter" in output, output
    # the new corpus, encoded with the source's subword model: its unknown pieces are counted
    unknown = re.search(r"unknown subwords: (\d+) of (\d+) training sentences \(both sides\) "
                        r"hold one; (\d+) of \d+ pieces", output)
    assert unknown, output
    assert int(unknown[1]) >= 2 * len(UNSEEN) and int(unknown[2]) == 2 * (300 + len(UNSEEN))
    assert int(unknown[3]) >= int(unknown[1])
    for name in (filenames.SUBWORDS, filenames.SUBWORDS_VOCABULARY):
        assert filecmp.cmp(source / name, logdir / name, shallow=False), name
    # the source's architecture (and subword settings); training values from the command line
    hparams, theirs = (config.load(str(folder / filenames.HPARAMS)) for folder in (logdir, source))
    assert hparams == {**theirs, "logdir": str(logdir), "data_dir": str(new_corpus),
                       "lr": 0.05, "warmup_steps": 2, "steps_per_epoch": 6}
    record = json.loads((logdir / filenames.INIT_FROM).read_text())
    assert record == {"logdir": str(source), "ckpt": "latest", "average_last": 0,
                      "checkpoints": [str(checkpoint)], "optimizer": False,
                      "sha256": {path.name: file_digest(path) for path in
                                 checkpoint.parent.glob("ckpt-20.*")}}
    assert len(record["sha256"]) == 2  # .index and .data-00000-of-00001
    # six updates on the new corpus: its loss there falls below the source model's
    batches = list(Corpus(str(new_corpus), str(logdir), hparams, log=lambda line: None)
                   .train_batches(0).take(6))
    before = mean_loss(load_model(theirs, str(source))[0], batches, hparams["smoothing"])
    after = mean_loss(load_model(hparams, str(logdir))[0], batches, hparams["smoothing"])
    assert after < before, (before, after)

    # Resumed, it takes its own checkpoints: the source is not even read (here: gone).
    aside = source.with_name("moved-away")
    source.rename(aside)
    try:
        assert call_train(*command, "--num_epochs", "2") == 0
    finally:
        aside.rename(source)
    output = capsys.readouterr().out
    assert f"--init_from {source} is not read" in output and "resumed from" in output, output
    assert "fine-tuning: the weights" not in output
    assert json.loads((logdir / filenames.INIT_FROM).read_text()) == record
    assert config.load(str(logdir / filenames.HPARAMS)) == hparams

    # Before its first update a fine-tuning run's model is its source's, exactly: from a run
    # of train.py and from a fine-tuned run.
    starts_exactly_at(source, tmp_path / "again", new_corpus)
    starts_exactly_at(logdir, tmp_path / "once-more", new_corpus)


@pytest.mark.slow
def test_init_optimizer_takes_the_moments_with_a_fresh_step_counter(tmp_path, source,
                                                                    new_corpus):
    trainer = starts_exactly_at(source, tmp_path / "log", new_corpus, optimizer=True)
    theirs = Trainer(config.load(str(source / filenames.HPARAMS)), logdir=str(tmp_path / "theirs"),
                     verbose=False)
    theirs.checkpoint.restore(str(source / filenames.CHECKPOINTS / "ckpt-20"))
    assert theirs.global_step() == 20 and trainer.global_step() == 0
    # by path below the optimizer (its own name counts the process's optimizers)
    names = [variable.path.split("/", 1)[1] for variable in trainer.optimizer.variables]
    assert names == [variable.path.split("/", 1)[1] for variable in theirs.optimizer.variables]
    moments = [(mine, their) for mine, their in zip(trainer.optimizer.variables,
                                                    theirs.optimizer.variables)
               if "iteration" not in mine.path]
    assert moments and any(np.any(their.numpy()) for _, their in moments)
    for mine, their in moments:
        np.testing.assert_array_equal(mine.numpy(), their.numpy(), err_msg=mine.path)
    assert json.loads((tmp_path / "log" / filenames.INIT_FROM).read_text())["optimizer"]


@pytest.mark.slow
def test_a_source_checkpoint_removed_after_it_was_read_is_named_in_one_line(
        tmp_path, source, new_corpus):
    """A source still training removes its oldest checkpoints: one gone after its weights were
    read (at the check of its optimizer state, the hashing of its files, or the taking of its
    optimizer state) stops the run with a CheckpointError naming it, not a traceback."""
    origin = tmp_path / "source"
    shutil.copytree(source, origin)
    theirs = config.load(str(origin / filenames.HPARAMS))
    taken = Source(str(origin), theirs, optimizer=True)
    for name in os.listdir(origin / filenames.CHECKPOINTS):
        if name.startswith("ckpt-20."):
            os.remove(origin / filenames.CHECKPOINTS / name)
    expected = (f"--init_from {origin}: {taken.paths[0]} was removed while this run read it "
                "(is the source still training?")
    with pytest.raises(CheckpointError, match=re.escape(expected)):
        taken._check_optimizer_state(theirs, run_precision=None)
    with pytest.raises(CheckpointError, match=re.escape(expected)):
        taken._digests(checkpoint_files)
    hparams = {**fine_tune_hparams(tmp_path / "log", new_corpus),
               **{key: theirs[key] for key in ARCHITECTURE_KEYS}}
    trainer = Trainer(hparams, verbose=False, initialize=taken.initialize)
    with pytest.raises(CheckpointError, match=re.escape(expected)):
        trainer.restore()


def test_a_best_checkpoint_replaced_while_it_is_read_is_refused_or_recorded_as_read(
        tmp_path, source):
    """A source still training replaces its best.weights.h5 whole at each better model: one
    replaced while it is read is refused in one line, never recorded with another's digest."""
    origin = tmp_path / "source"
    shutil.copytree(source, origin)
    theirs = config.load(str(origin / filenames.HPARAMS))
    model, _ = load_model(theirs, str(origin))
    versions, paths = {}, []
    for _ in range(12):  # better and better models, each new: its weights moved by 0.001
        for variable in model.weights:
            variable.assign(variable + 0.001)
        paths.append(tmp_path / f"{len(paths)}.weights.h5")
        model.save_weights(str(paths[-1]))
        versions[file_digest(paths[-1])] = {key: variable.numpy()
                                            for key, variable in model_weights(model).items()}
    best = origin / filenames.BEST_WEIGHTS
    shutil.copyfile(paths[0], best)

    pauses, failures = random.Random(3), []

    def keep_replacing():  # as training/validation.py does, by a rename: each file stands whole
        try:
            for path in paths[1:]:  # at moments within reads, and some reads between them
                time.sleep(pauses.uniform(0.5, 3.0) * read_seconds)
                os.link(path, origin / "best.next")
                os.replace(origin / "best.next", best)
        except OSError as error:  # pragma: no cover  (said in the main thread)
            failures.append(error)

    def holds_what_it_records(taken):
        read = versions[taken.record["sha256"][filenames.BEST_WEIGHTS]]
        for key, weights in read.items():
            np.testing.assert_array_equal(taken.weights[key], weights)
        return True

    # Pauses of about a read on this machine: some replacements fall within reads, some reads
    # between them, however fast the machine reads (the first read, left alone, timed).
    started = time.perf_counter()
    assert holds_what_it_records(Source(str(origin), theirs, ckpt="best"))
    read_seconds = time.perf_counter() - started
    replacing, refused, recorded = threading.Thread(target=keep_replacing), 0, 0
    replacing.start()
    try:
        while replacing.is_alive():
            try:
                taken = Source(str(origin), theirs, ckpt="best")
            except CheckpointError as error:
                assert f"{best} was replaced while this run read it" in str(error)
                refused += 1
                continue
            recorded += holds_what_it_records(taken)
    finally:
        replacing.join()
    assert not failures and refused > 0 and recorded > 0, (failures, refused, recorded)
    assert holds_what_it_records(Source(str(origin), theirs, ckpt="best"))  # left alone: read


@pytest.mark.slow
def test_a_weights_only_logdir_is_a_source_but_no_run_of_its_own(tmp_path, source, new_corpus):
    """A logdir with a checkpoint of weights alone (the TF1 importer's) can be fine-tuned from;
    train.py on it is refused in one line; a checkpoint that does not fit its hparams.json, or
    --init_optimizer from weights alone, is refused before the new logdir gets any file."""
    theirs = config.load(str(source / filenames.HPARAMS))
    imported = tmp_path / "imported"
    checkpoint = weights_only_logdir(imported, theirs, load_model(theirs, str(source))[0],
                                     subwords_of=source)
    starts_exactly_at(imported, tmp_path / "fine-tuned", new_corpus)

    files = sorted(os.listdir(imported / filenames.CHECKPOINTS))
    logdir_files = set(os.listdir(imported))
    message = call_train("--hparams", "tiny", "--data_dir", MULTI30K, "--logdir", imported)
    assert message == (
        f"error: {checkpoint} holds weights without a run state (no optimizer, epoch or data "
        f"position): a run cannot resume from it. To train from these weights, start a new "
        f"run: --init_from {imported} with a new --logdir")
    assert sorted(os.listdir(imported / filenames.CHECKPOINTS)) == files
    assert set(os.listdir(imported)) - {filenames.LOCK} == logdir_files  # nothing written
    # Given other hparams, the same hint (not "the same settings to resume"), before TensorFlow.
    message = call_train("--hparams", "tiny", "--d_model", "48", "--data_dir", MULTI30K,
                         "--logdir", imported)
    assert message.startswith(f"error: {imported} holds checkpoints but no {filenames.CORPUS}")
    assert "d_model: 32 -> 48" in message and message.endswith(
        f"start a new run: --init_from {imported} with a new --logdir")
    assert set(os.listdir(imported)) - {filenames.LOCK} == logdir_files

    wide = Transformer.from_hparams({**theirs, "d_model": 64, "d_ff": 128}, name="transformer")
    wide.build()
    weights_only_logdir(tmp_path / "other", theirs, wide, subwords_of=source)
    fine_tune = ["--hparams", "tiny", "--data_dir", new_corpus]
    for origin, extra, expected in (
            (imported, ["--init_optimizer"], "holds no optimizer state (weights only)"),
            (tmp_path / "other", [], "does not fit the model described by the logdir's "
                                     "hparams.json")):
        logdir = tmp_path / f"new-{origin.name}"
        message = call_train(*fine_tune, "--logdir", logdir, "--init_from", origin, *extra)
        assert message.startswith("error: ") and expected in message, message
        assert not logdir.exists(), os.listdir(logdir)  # the folder it made, removed again


@pytest.mark.slow
def test_init_optimizer_across_loss_scaling_is_refused_before_anything_is_written(
        tmp_path, source, new_corpus):
    """float16's optimizer (loss scaling) holds state the others lack, and theirs is not its:
    --init_optimizer from one kind into the other is refused in one line, with the new logdir
    never made, in both directions."""
    half = tmp_path / "half"
    trained = programs.run("train.py", "--hparams", "tiny", "--data_dir", MULTI30K, "--logdir",
                           half, "--steps_per_epoch", "3", "--mixed_precision", "fp16")
    assert trained.returncode == 0, trained.stderr[-3000:]
    fine_tune = ["--hparams", "tiny", "--data_dir", new_corpus, "--init_optimizer"]
    for origin, extra, expected in (
            (half, [], "is that of float16's loss scaling (mixed_precision fp16), this run's "
                       "would not be (mixed_precision no)"),
            (source, ["--mixed_precision", "fp16"], "is not that of float16's loss scaling "
             "(mixed_precision no), this run's would be (mixed_precision fp16)")):
        logdir = tmp_path / f"new-{origin.name}"
        message = call_train(*fine_tune, "--logdir", logdir, "--init_from", origin, *extra)
        assert message.startswith("error: --init_optimizer: the optimizer state of "), message
        assert expected in message, message
        assert not logdir.exists(), os.listdir(logdir)


def test_fine_tuning_mistakes_are_refused_before_tensorflow_loads(tmp_path):
    """A missing source, a folder that is not a logdir, a contradicting architecture flag and
    wrong init flags: refused in one line naming them, without TensorFlow, writing nothing."""
    trained = tmp_path / "trained"  # what these checks read of a logdir, without TensorFlow
    (trained / filenames.CHECKPOINTS).mkdir(parents=True)
    config.save(hp.parse("tiny", {"logdir": str(trained)}), str(trained / filenames.HPARAMS))
    for name in (filenames.SUBWORDS, os.path.join(filenames.CHECKPOINTS,
                                                  filenames.CHECKPOINT_INDEX)):
        (trained / name).write_text("")
    bare, missing = tmp_path / "bare", tmp_path / "missing"
    bare.mkdir()
    cases = [
        (["--init_from", missing], f"error: --init_from {missing}: no such folder"),
        (["--init_from", bare], f"error: --init_from {bare}: not a logdir of train.py (no "
                                "hparams.json)"),
        (["--init_from", trained, "--d_model", "64", "--num_heads", "2"],
         f"error: --init_from {trained}: a fine-tuning run keeps the source run's architecture, "
         "which the command line contradicts (d_model: 64 given, 32 in the source)"),
        (["--init_from", trained, "--hparams", "tiny,vocab_size=500"],
         "(vocab_size: 500 given, 400 in the source)"),
        (["--init_ckpt", "best"], "--init_ckpt chooses a checkpoint of --init_from LOGDIR"),
        (["--init_from", trained, "--init_ckpt", "best", "--init_average_last", "2"],
         "--init_ckpt (best) and --init_average_last (2) exclude each other"),
        (["--init_from", trained, "--init_optimizer", "--init_ckpt", "best"],
         "--init_optimizer needs one checkpoint of train.py's; --init_ckpt best has no"),
        (["--init_optimizer"], "--init_optimizer takes the optimizer of --init_from LOGDIR"),
        (["--init_from", trained, "--logdir", trained],
         f"error: --init_from {trained} is this run's own --logdir: fine-tune into a new"),
    ]
    runs = [("train.py", ["--hparams", "tiny", "--data_dir", MULTI30K, "--logdir",
                          tmp_path / f"new-{number}", *extra])
            for number, (extra, _) in enumerate(cases)]
    results = refusals(runs)
    for number, ((extra, message), (_, error, tensorflow, keras)) in enumerate(
            zip(cases, results)):
        assert message in error and "Traceback" not in error, (extra, error)
        assert not tensorflow and not keras, (extra, "loaded TensorFlow")
        assert not (tmp_path / f"new-{number}").exists(), extra


def test_given_keys_are_those_a_preset_file_or_flag_sets(tmp_path):
    settings = tmp_path / "settings.json"
    settings.write_text('{"d_ff": 256}')
    args = hp.argument_parser("test").parse_args(
        ["--hparams", f"tiny,{settings},sinusoid=false", "--num_heads", "4"])
    given = hp.given_keys(args)
    assert {"vocab_size", "d_model", "d_ff", "sinusoid", "num_heads"} <= given
    assert not given & {"norm_position", "share_embeddings", "epsilon", "subword_model_type"}
    assert hp.given_keys(hp.argument_parser("test").parse_args([])) == set()
