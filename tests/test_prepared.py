"""The training split prepared once on disk: what it holds, when it is prepared again, the
subword model's sample, and what a kill, a changing corpus or a second process leave."""

import gzip
import os
import shutil
import signal
import time

import numpy as np
import pytest

import hparams as hp
from kyu_transformer.data.prepared import PreparedSplit
from kyu_transformer.data.subwords import Subwords, sample_pairs
from kyu_transformer.data.text import DataError, fingerprint, load_split, split_files
from tests import programs
from tests.programs import ROOT
from tests.test_data import MULTI30K, lists_of


@pytest.fixture(scope="module")
def subwords(tmp_path_factory):
    sources, targets, _ = load_split(MULTI30K, "train")
    return Subwords.train_or_load(str(tmp_path_factory.mktemp("subwords")), sources + targets,
                                  vocab_size=400)


@pytest.fixture(scope="module")
def large_corpus(tmp_path_factory):
    """The sample's training split 20 times over (48,000 pairs): a preparation of seconds."""
    folder = tmp_path_factory.mktemp("large")
    for lang in ("de", "en"):
        with gzip.open(os.path.join(MULTI30K, f"train.{lang}.gz"), "rb") as handle:
            (folder / f"train.{lang}").write_bytes(handle.read() * 20)
    return str(folder)


def prepare(data_dir, cache, subwords, lines=None):
    paths, reader = split_files(data_dir, "train")
    return PreparedSplit.open_or_prepare(str(cache), paths, reader, fingerprint(data_dir),
                                         subwords, (lines if lines is not None else []).append)


def test_a_prepared_split_holds_every_pairs_ids_and_is_read_again_not_prepared(
        tmp_path, subwords):
    lines = []
    split = prepare(MULTI30K, tmp_path / "cache", subwords, lines)
    sources, targets, empty = load_split(MULTI30K, "train")
    assert lists_of(split.sources) == subwords.encode(sources)
    assert lists_of(split.targets) == subwords.encode(targets)
    assert split.sources.ids.dtype == np.uint16 and isinstance(split.sources.ids, np.memmap)
    assert (split.record["pairs"], split.record["empty"]) == (len(sources), empty)
    assert lines[0].startswith("preparing the training split (2,400 lines of ")
    assert lines[-1] == f"prepared {len(sources):,} pairs in {split.record['seconds']:.1f} s " \
                        f"({split.folder})"
    # read again, by another process alike: nothing prepared, nothing said
    lines = []
    assert prepare(MULTI30K, tmp_path / "cache", subwords, lines).folder == split.folder
    assert lines == []
    assert sorted(os.listdir(tmp_path / "cache")) == sorted(
        [os.path.basename(split.folder), os.path.basename(split.folder) + ".lock"])


def test_a_sentence_of_no_subword_is_prepared_and_counted(tmp_path, subwords):
    """A line the subword model's normalization empties (control characters) has no ids; its
    pair is kept (its source reads as EOS alone), and the unknown pieces are counted right."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "train.de").write_text("ein Hund \u2603\n\x01\nzwei \u2603 Katzen\n\x01\x02\n")
    (corpus / "train.en").write_text("a dog\na cat\ntwo cats\nnothing\n")
    split = prepare(str(corpus), tmp_path / "cache", subwords)
    assert list(split.sources.lengths() == 0) == [False, True, False, True]
    assert split.record["pairs"] == 4
    assert split.record["unknown"]["sentences"] == 2  # the snowmen's
    assert split.record["unknown"]["pieces"] == 2


def test_another_corpus_or_subword_model_is_prepared_apart(tmp_path, subwords):
    first = prepare(MULTI30K, tmp_path / "cache", subwords)
    changed = tmp_path / "changed"
    shutil.copytree(MULTI30K, changed)
    with gzip.open(changed / "train.en.gz", "ab") as handle:
        handle.write(b"one more sentence\n")
    with gzip.open(changed / "train.de.gz", "ab") as handle:
        handle.write(b"noch ein Satz\n")
    other_corpus = prepare(str(changed), tmp_path / "cache", subwords)
    assert other_corpus.folder != first.folder
    assert other_corpus.record["pairs"] == first.record["pairs"] + 1
    sources, targets, _ = load_split(MULTI30K, "train")
    retrained = Subwords.train_or_load(str(tmp_path / "other"), sources + targets, 300)
    assert prepare(MULTI30K, tmp_path / "cache", retrained).folder not in (
        first.folder, other_corpus.folder)
    # the same model trained in another folder (its file differs by that path) is the same
    alike = Subwords.train_or_load(str(tmp_path / "alike"), sources + targets, 400)
    assert alike.digest() == subwords.digest()
    assert prepare(MULTI30K, tmp_path / "cache", alike).folder == first.folder
    assert os.path.isdir(first.folder)  # the others stay


def test_a_corpus_that_changes_while_it_is_prepared_leaves_nothing(tmp_path, subwords):
    corpus = tmp_path / "corpus"
    shutil.copytree(MULTI30K, corpus)
    paths, reader = split_files(str(corpus), "train")

    def changing(path):  # the target file rewritten, a word changed, once it is being read
        for number, line in enumerate(reader(path)):
            if number == 10 and path == paths[0]:
                with gzip.open(paths[1], "rb") as handle:
                    text = handle.read()
                with gzip.open(paths[1] + ".new", "wb") as handle:
                    handle.write(text.replace(b"man", b"woman", 1))
                os.replace(paths[1] + ".new", paths[1])
            yield line

    with pytest.raises(DataError, match=f"^{paths[1]} changed while it was being prepared; "
                                        "nothing of it was kept: run again"):
        PreparedSplit.open_or_prepare(str(tmp_path / "cache"), paths, changing,
                                      fingerprint(str(corpus)), subwords, lambda line: None)
    assert [name for name in os.listdir(tmp_path / "cache") if not name.endswith(".lock")] == []


def test_the_subword_sample_is_every_pair_in_order_up_to_its_size_then_a_seeded_draw():
    pairs = [(f"s{number}", f"t{number}") for number in range(1000)]
    assert sample_pairs(iter(pairs), 1000, seed=0) == [s for s, _ in pairs] + [t for _, t in pairs]
    drawn = sample_pairs(iter(pairs), 300, seed=0)
    sources, targets = drawn[:300], drawn[300:]
    assert [f"t{source[1:]}" for source in sources] == targets  # whole pairs
    assert sorted(sources, key=lambda s: int(s[1:])) == sources and len(set(sources)) == 300
    assert drawn == sample_pairs(iter(pairs), 300, seed=0) != sample_pairs(iter(pairs), 300, 1)
    # drawn evenly: each tenth of the corpus holds about a tenth of the sample
    counts = np.bincount([int(s[1:]) // 100 for s in sources], minlength=10)
    assert counts.min() > 10 and counts.max() < 50


@pytest.mark.tensorflow_only("the Corpus builds tf.data batches")
def test_bidirectional_epochs_train_every_pair_both_ways_then_one_way(tmp_path):
    """BiT: the first `bidirectional_epochs` epochs hold every pair and every pair reversed
    (twice the batches), the later ones the pairs as given; the counting of FLOPs and the
    training's plan (the runs of epochs alike) see them."""
    from kyu_transformer.data.corpus import Corpus

    lines = []
    corpus = Corpus(MULTI30K, str(tmp_path / "log"), hp.parse("tiny,bidirectional_epochs=1"),
                    log=lines.append)
    forth, back = corpus.train_columns(0)
    sources, targets = corpus.train_columns(1)
    assert (sources, targets) == (corpus.prepared.sources, corpus.prepared.targets)
    assert lists_of(forth) == lists_of(sources) + lists_of(targets)
    assert lists_of(back) == lists_of(targets) + lists_of(sources)
    both, one = len(corpus.train_batch_shapes(0)), len(corpus.train_batch_shapes(1))
    assert 1.8 * one < both < 2.2 * one
    assert corpus.epochs_alike(3) == [(0, 1), (1, 2)] and corpus.epochs_alike(1) == [(0, 1)]
    assert ("both ways (BiT): the first epoch trains on every pair and every pair reversed "
            "(about twice the batches)") in lines
    # train.py's plan counts each run of epochs alike (said before any update; a budget of
    # 0.06 s stops the run at once, after one update at most)
    planned = programs.run("train.py", "--hparams", "tiny", "--bidirectional_epochs", "1",
                           "--num_epochs", "3", "--steps_per_epoch", "0", "--max_minutes",
                           "0.001", "--data_dir", MULTI30K, "--logdir", tmp_path / "run")
    assert planned.returncode == 0, planned.stderr[-3000:]
    assert (f"plan: 3 epochs (1 of about {both} updates, then 2 of about {one} updates), "
            f"about {both + 2 * one} updates, or 0.001 min of training\n") in planned.stdout


@pytest.mark.tensorflow_only("the Corpus builds tf.data batches")
def test_the_corpus_trains_todays_subword_model_on_a_corpus_within_the_sample(tmp_path):
    """Multi30k's 29,000 pairs are within the sample: the subword model is the one trained on
    every training sentence, sources then targets (as before the sample)."""
    from kyu_transformer.data.corpus import Corpus

    corpus = Corpus(MULTI30K, str(tmp_path / "log"), hp.parse("tiny"), log=lambda line: None)
    sources, targets, _ = load_split(MULTI30K, "train")
    everything = Subwords.train_or_load(str(tmp_path / "all"), sources + targets,
                                        hp.parse("tiny")["vocab_size"])
    assert corpus.subwords.digest() == everything.digest()
    assert corpus.prepared.folder.startswith(str(tmp_path / "log" / "prepared"))


@pytest.mark.tensorflow_only("the Corpus builds tf.data batches")
def test_subword_alpha_is_refused_in_one_line_above_its_size(tmp_path, monkeypatch):
    from kyu_transformer.data import corpus

    monkeypatch.setattr(corpus, "SAMPLED_SEGMENTATION_PAIRS", 1000)
    with pytest.raises(DataError) as refused:
        corpus.Corpus(MULTI30K, str(tmp_path), hp.parse("tiny", {"subword_alpha": "0.5"}),
                      log=lambda line: None)
    assert str(refused.value) == (
        f"{MULTI30K}/train.de.gz: subword_alpha 0.5 keeps every training sentence's best "
        "segmentations in memory, for at most 1,000 pairs; this corpus has 2,400: train it "
        "with subword_alpha 0")


PREPARE_SCRIPT = r"""
import sys
sys.path.insert(0, sys.argv[1])
from kyu_transformer.data.prepared import PreparedSplit
from kyu_transformer.data.subwords import Subwords
from kyu_transformer.data.text import fingerprint, split_files

paths, reader = split_files(sys.argv[2], "train")
split = PreparedSplit.open_or_prepare(sys.argv[3], paths, reader, fingerprint(sys.argv[2]),
                                      Subwords(sys.argv[4]), lambda line: print(line, flush=True))
print("ids", int(split.sources.ids.sum()), int(split.targets.ids.sum()), split.folder)
"""


def start_preparing(large_corpus, cache, subwords):
    return programs.start("-c", PREPARE_SCRIPT, ROOT, large_corpus, str(cache), subwords.path)


def wait_for_staging(cache, process, timeout=120):
    """Waits until a preparation in `cache` has written ids to its staging folder."""
    deadline = time.time() + timeout
    while time.time() < deadline and process.poll() is None:
        for name in os.listdir(cache) if os.path.isdir(cache) else []:
            ids = os.path.join(cache, name, "sources.ids")
            if ".prepare-" in name and os.path.isfile(ids) and os.path.getsize(ids) > 0:
                return os.path.join(cache, name)
        time.sleep(0.02)
    raise AssertionError("no preparation was seen under way")


@pytest.mark.slow  # starts programs
def test_a_killed_preparation_is_never_read_and_the_next_start_prepares_again(
        tmp_path, subwords, large_corpus):
    cache = tmp_path / "cache"
    killed = start_preparing(large_corpus, cache, subwords)
    staging = wait_for_staging(cache, killed)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert [name for name in os.listdir(cache) if not name.startswith(".")] == [
        name for name in os.listdir(cache) if name.endswith(".lock")]  # no prepared folder
    lines = []
    split = prepare(large_corpus, cache, subwords, lines)
    assert lines[0].startswith("preparing the training split") and not os.path.exists(staging)
    assert split.record["pairs"] == 48000
    assert lists_of(split.sources)[:2400] == lists_of(split.sources)[-2400:]


@pytest.mark.slow  # starts programs
def test_two_processes_preparing_at_once_prepare_once_and_read_the_same(
        tmp_path, subwords, large_corpus):
    cache = tmp_path / "cache"
    first = start_preparing(large_corpus, cache, subwords)
    wait_for_staging(cache, first)
    second = start_preparing(large_corpus, cache, subwords)
    outputs = [process.communicate(timeout=300)[0] for process in (first, second)]
    assert [process.returncode for process in (first, second)] == [0, 0], outputs
    assert "\nprepared 48,000 pairs in " in outputs[0]
    assert "waiting for another process preparing" in outputs[1]
    assert "preparing the training split" not in outputs[1]
    results = [output.strip().splitlines()[-1] for output in outputs]
    assert results[0] == results[1] and results[0].startswith("ids ")
