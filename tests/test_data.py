"""Reading parallel text, its errors, subwords and the tf.data pipeline."""

import functools
import gc
import gzip
import http.server
import math
import os
import shutil
import threading
import tracemalloc

import numpy as np
import pytest

from kyu_transformer import filenames
from kyu_transformer.conventions import BOS_ID, EOS_ID, PAD_ID
from kyu_transformer.data import pipeline
from kyu_transformer.data.prepared import IdColumn
from kyu_transformer.data.subwords import Subwords
from kyu_transformer.data.text import (
    MULTI30K_FILES, DataError, ensure_multi30k, load_split, read_parallel)
from tests import programs

# The first lines of Multi30k's splits, shipped with the tests (see tests/data/README.md).
MULTI30K = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "multi30k")


def write(path, text, mode="w"):
    if str(path).endswith(".gz"):
        with gzip.open(path, "wb") as handle:
            handle.write(text if isinstance(text, bytes) else text.encode("utf-8"))
    elif isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return str(path)


def corpus(tmp_path, source, target, split="train"):
    return (write(tmp_path / f"{split}.de", source), write(tmp_path / f"{split}.en", target))


def test_reads_plain_and_gzip_with_bom_crlf_tabs_and_blank_lines(tmp_path):
    source = write(tmp_path / "train.de.gz", "\ufeffEin Hund.\r\nZwei\tKatzen.\r\n   \r\nDrei.\n")
    target = write(tmp_path / "train.en", "A dog.\nTwo  cats.\nNothing here\nThree.\n")
    sources, targets, empty = read_parallel(source, target)
    assert sources == ["Ein Hund.", "Zwei Katzen.", "Drei."]
    assert targets == ["A dog.", "Two cats.", "Three."]
    assert empty == 1


def test_line_counts_that_differ_name_both_files(tmp_path):
    source, target = corpus(tmp_path, "a\nb\nc\n", "x\ny\n")
    with pytest.raises(DataError, match=r"train.de has 3 lines but .*train.en has 2"):
        read_parallel(source, target)


def test_invalid_utf8_names_file_and_line(tmp_path):
    source, target = corpus(tmp_path, b"gut\nauch gut\nkaputt \xff\xfe\n", "a\nb\nc\n")
    with pytest.raises(DataError, match=r"train.de, line 3: invalid UTF-8"):
        read_parallel(source, target)


def test_empty_corpus_is_an_error(tmp_path):
    source, target = corpus(tmp_path, "\n  \n", "\n\n")
    with pytest.raises(DataError, match="no non-empty sentence pair"):
        read_parallel(source, target)


def test_data_folder_missing_empty_or_a_file(tmp_path):
    with pytest.raises(DataError, match="no such data folder"):
        load_split(str(tmp_path / "nowhere"), "train")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="the data folder is empty"):
        load_split(str(tmp_path / "empty"), "train")
    with pytest.raises(DataError, match="is a file"):
        load_split(write(tmp_path / "file.txt", "x"), "train")
    corpus(tmp_path, "a\n", "b\n")
    with pytest.raises(DataError, match=r"no `val` split for de-en; expected val.de"):
        load_split(str(tmp_path), "val")


def test_multi30k_sample_splits_shipped_with_the_tests():
    sources, targets, empty = load_split(MULTI30K, "test_2016_flickr")
    assert len(sources) == len(targets) == 300 and empty == 0
    assert sources[0].startswith("Ein Mann mit einem orangefarbenen Hut")


def test_iwslt_layout(tmp_path):
    write(tmp_path / "train.tags.de-en.de",
          "<url>http://x</url>\n<talkid>1</talkid>\nHallo Welt.\nWie geht's?\n<title>T</title>\n")
    write(tmp_path / "train.tags.de-en.en",
          "<url>http://x</url>\n<talkid>1</talkid>\nHello world.\nHow are you?\n<title>T</title>\n")
    xml = ('<mteval>\n<srcset setid="x" srclang="{lang}">\n<doc docid="1">\n'
           '<seg id="1"> {one} </seg>\n<seg id="2">{two}</seg>\n</doc>\n</srcset>\n</mteval>\n')
    write(tmp_path / "IWSLT16.TED.tst2014.de-en.de.xml",
          xml.format(lang="de", one="Guten Tag.", two="A &amp; B"))
    write(tmp_path / "IWSLT16.TED.tst2014.de-en.en.xml",
          xml.format(lang="en", one="Good day.", two="A &amp; B"))
    assert load_split(str(tmp_path), "train")[:2] == (
        ["Hallo Welt.", "Wie geht's?"], ["Hello world.", "How are you?"])
    sources, targets, _ = load_split(str(tmp_path), "test")
    assert sources == ["Guten Tag.", "A & B"] and targets == ["Good day.", "A & B"]


@pytest.fixture
def file_server(tmp_path):
    """A loopback HTTP server over a copy of the shipped Multi30k sample."""
    served = tmp_path / "served"
    shutil.copytree(MULTI30K, served)
    for name in os.listdir(served):
        os.chmod(served / name, 0o644)
    handler = functools.partial(_QuietHandler, directory=str(served))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", served
    server.shutdown()
    server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def nothing_left(parent, name):
    """No corpus folder `name` in `parent`, and no staging folder either (`staging_beside`'s
    hidden ``.<name>.<label>-*``)."""
    return not (parent / name).exists() and not [
        entry for entry in os.listdir(parent) if entry.startswith(f".{name}.")]


def test_multi30k_download_when_missing(tmp_path, file_server):
    url, served = file_server
    target = tmp_path / "multi30k"
    ensure_multi30k(str(target), base_url=url, timeout=5)
    assert sorted(os.listdir(target)) == sorted(MULTI30K_FILES)
    for name in MULTI30K_FILES:
        assert (target / name).read_bytes() == (served / name).read_bytes()
    assert load_split(str(target), "val") == load_split(MULTI30K, "val")


def test_broken_downloads_leave_no_corpus_behind(tmp_path, file_server, monkeypatch):
    url, served = file_server
    os.remove(served / "val.en.gz")  # HTTP 404
    with pytest.raises(DataError, match=r"could not be downloaded from http://127.0.0.1:"
                       r"\d+ \(http://127.0.0.1:\d+/val.en.gz: HTTP Error 404.*Put the six files"):
        ensure_multi30k(str(tmp_path / "multi30k"), base_url=url, timeout=5)
    assert nothing_left(tmp_path, "multi30k")

    shutil.copy(MULTI30K + "/val.en.gz", served / "val.en.gz")
    whole = (served / "train.de.gz").read_bytes()
    (served / "train.de.gz").write_bytes(whole[:len(whole) // 2])  # a cut-off transfer
    with pytest.raises(DataError, match=r"train.de.gz: cannot read"):
        ensure_multi30k(str(tmp_path / "multi30k"), base_url=url, timeout=5)
    assert nothing_left(tmp_path, "multi30k")

    # Files of different lengths (one side of another version) are not a corpus either.
    write(served / "train.de.gz", "Nur ein Satz.\n")
    monkeypatch.setenv("MULTI30K_URL", url)  # the default base URL comes from here
    with pytest.raises(DataError, match=r"train.de.gz has 1 lines but .*train.en.gz has 2400"):
        ensure_multi30k(str(tmp_path / "multi30k"), timeout=5)
    assert nothing_left(tmp_path, "multi30k")

    (served / "train.de.gz").write_bytes(whole)  # the server mended, the same call succeeds
    ensure_multi30k(str(tmp_path / "multi30k"), timeout=5)
    assert sorted(os.listdir(tmp_path / "multi30k")) == sorted(MULTI30K_FILES)


@pytest.mark.slow
def test_train_py_downloads_multi30k_on_first_use(tmp_path, file_server):
    """`python train.py --hparams ...` without --data_dir, as README's first command."""
    url, served = file_server
    command = ["train.py", "--hparams", "tiny", "--steps_per_epoch", "2", "--logdir", "log"]
    environment = programs.environment(MULTI30K_URL=url)
    whole = (served / "test_2016_flickr.en.gz").read_bytes()
    (served / "test_2016_flickr.en.gz").write_bytes(whole[:100])
    broken = programs.run(*command, cwd=tmp_path, env=environment, timeout=300)
    assert broken.returncode != 0
    assert "error: data/multi30k does not exist and Multi30k could not be downloaded" in \
        broken.stderr and "test_2016_flickr.en.gz: cannot read" in broken.stderr, broken.stderr
    assert "Traceback" not in broken.stderr
    assert nothing_left(tmp_path / "data", "multi30k")

    (served / "test_2016_flickr.en.gz").write_bytes(whole)
    first = programs.run(*command, cwd=tmp_path, env=environment, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "data/multi30k is missing: downloading Multi30k" in first.stdout
    assert "done: 1 epochs, 2 steps" in first.stdout
    assert sorted(os.listdir(tmp_path / "data" / "multi30k")) == sorted(MULTI30K_FILES)


def test_subwords_train_once_then_reuse(tmp_path):
    sentences = [f"the cat number {i} sat on the mat" for i in range(200)]
    first = Subwords.train_or_load(str(tmp_path), sentences, vocab_size=60)
    stamp = os.path.getmtime(first.path)
    again = Subwords.train_or_load(str(tmp_path), ["completely different text"] * 50,
                                   vocab_size=99)
    assert os.path.getmtime(again.path) == stamp and again.vocab_size == first.vocab_size
    # The model and its vocabulary only: nothing of the training's staging folder is left.
    assert sorted(os.listdir(tmp_path)) == sorted([filenames.SUBWORDS,
                                                   filenames.SUBWORDS_VOCABULARY])
    ids = first.encode(["the cat sat"])[0]
    assert all(i > EOS_ID for i in ids)
    assert first.decode([BOS_ID] + ids + [PAD_ID, EOS_ID, 7, 8]) == "the cat sat"
    assert first.processor.pad_id() == 0 and first.processor.bos_id() == 2


def test_failed_subword_training_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        Subwords.train_or_load(str(tmp_path / "logdir"), [], vocab_size=60)  # no sentences
    assert os.listdir(tmp_path / "logdir") == []


def column_of(sequences):
    """The `IdColumn` of `sequences` (lists of ids)."""
    lengths = np.array([len(ids) for ids in sequences], np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    return IdColumn(np.array([i for ids in sequences for i in ids], np.int32), offsets[:-1],
                    offsets[1:])


def lists_of(column):
    """Every sentence of `column` as a list of ids."""
    return [column.sentence(row).tolist() for row in range(len(column))]


def columns(sources, targets):
    return column_of(sources), column_of(targets)


def test_columns_joined_read_both_arrays_where_they_are_through_the_pipeline(tmp_path):
    """`IdColumn.joined`: the sentences of two columns over two arrays on disk (memory-mapped,
    not copied), read by the pipeline's batches: every pair both ways, as BiT trains."""
    def on_disk(name, sequences):
        column = column_of(sequences)
        path = tmp_path / name
        column.ids.tofile(path)
        return IdColumn(np.memmap(path, np.int32, mode="r"), column.begins, column.ends)

    sources = on_disk("sources", [[5, 6], [7], [8, 9, 10]])
    targets = on_disk("targets", [[11], [12, 13], [14, 15]])
    forth, back = IdColumn.joined(sources, targets), IdColumn.joined(targets, sources)
    assert lists_of(forth) == [[5, 6], [7], [8, 9, 10], [11], [12, 13], [14, 15]]
    assert lists_of(back) == [[11], [12, 13], [14, 15], [5, 6], [7], [8, 9, 10]]
    assert isinstance(forth.ids.first, np.memmap) and isinstance(forth.ids.second, np.memmap)
    pairs = set()
    for source, _, target_out in collect(pipeline.make_dataset(forth, back, batch_size=2)):
        for row in range(len(source)):
            pairs.add((tuple(source[row][source[row] > EOS_ID]),
                       tuple(target_out[row][target_out[row] > EOS_ID])))
    assert pairs == {((5, 6), (11,)), ((7,), (12, 13)), ((8, 9, 10), (14, 15)),
                     ((11,), (5, 6)), ((12, 13), (7,)), ((14, 15), (8, 9, 10))}
    same = IdColumn.joined(sources.rows(slice(0, 1)), sources.rows(slice(2, 3)))
    assert same.ids is sources.ids and lists_of(same) == [[5, 6], [8, 9, 10]]  # no chain
    with pytest.raises(IndexError, match="cross the border"):
        forth.ids[5:7]  # no sentence lies across the two arrays


def test_markers_are_added_and_pairs_too_long_with_them_dropped():
    batches = collect(pipeline.make_dataset(
        *columns([[5, 6], [5] * 9, [7], [6, 6, 6]], [[8], [9], [10] * 9, [11, 12, 13]]),
        batch_size=8, maxlens=(4, 4)))
    assert len(batches) == 1
    source, target_in, target_out = batches[0]  # each side padded to its cap, 4
    order = np.argsort(source[:, 0])  # the batch's rows come shuffled
    np.testing.assert_array_equal(source[order], [[5, 6, EOS_ID, 0], [6, 6, 6, EOS_ID]])
    np.testing.assert_array_equal(target_in[order], [[BOS_ID, 8, 0, 0], [BOS_ID, 11, 12, 13]])
    np.testing.assert_array_equal(target_out[order], [[8, EOS_ID, 0, 0], [11, 12, 13, EOS_ID]])


def make_pairs(rng, count=500):
    """`count` pairs of random ids (no markers) of unlike lengths, as columns."""
    lengths = rng.integers(1, 40, size=count)
    sources = [list(rng.integers(4, 100, size=n)) for n in lengths]
    targets = [list(rng.integers(4, 100, size=max(1, n + rng.integers(-3, 4))))
               for n in lengths]
    return columns(sources, targets)


def collect(dataset):
    return [(x["source"].numpy(), x["target_in"].numpy(), y.numpy()) for x, y in dataset]


def unpadded(ids):
    return tuple(int(i) for i in ids if i != PAD_ID)


def test_batches_hold_every_pair_once_marked_within_the_token_budget(rng):
    sources, targets = make_pairs(rng)
    batches = collect(pipeline.make_dataset(sources, targets, batch_size=64, batch_tokens=400,
                                            seed=3))
    read = sorted((unpadded(s), unpadded(t)) for batch in batches for s, t in zip(*batch[:2]))
    assert read == sorted(((*s, EOS_ID), (BOS_ID, *t))
                          for s, t in zip(lists_of(sources), lists_of(targets)))
    for source, target_in, target_out in batches:
        assert source.size <= 400 and target_in.size <= 400 and len(source) <= 64
        assert target_in.shape == target_out.shape
        shifted = target_out[:, :-1]  # the labels are the inputs shifted, EOS for BOS
        np.testing.assert_array_equal(target_in[:, 1:], np.where(shifted == EOS_ID, 0, shifted))
        assert np.all((source == 0) == (np.cumsum(source == 0, axis=1) > 0))  # pad at the end
    # bucketing: batches hold similar lengths, so padding stays small
    real = sum((s != 0).sum() for s, _, _ in batches)
    assert real / sum(s.size for s, _, _ in batches) > 0.8


def test_an_epoch_meets_few_shapes_every_length_a_multiple_of_eight():
    """Each side of a batch is padded to a multiple of 8: XLA compiles a step (or the loss) once
    per shape it meets, so the shapes of an epoch stay a few per bucket of 8 lengths (a full
    batch and the bucket's rest), and the padding stays small."""
    sources, targets = make_pairs(np.random.default_rng(0), count=2000)
    batches = collect(pipeline.make_dataset(sources, targets, batch_size=64, batch_tokens=400,
                                            seed=3))
    for source, target_in, target_out in batches:
        assert source.shape[1] % 8 == 0 and target_in.shape[1] % 8 == 0
        assert source.size <= 400 and target_out.size <= 400
    buckets = math.ceil((max(sources.lengths().max(), targets.lengths().max()) + 1) / 8)
    shapes = {(len(source), source.shape[1], target.shape[1]) for source, target, _ in batches}
    assert len(shapes) <= 2 * buckets
    real = sum((t != 0).sum() for _, t, _ in batches)
    assert real / sum(t.size for _, t, _ in batches) > 0.8


def test_padding_to_a_multiple_stops_at_the_models_longest():
    """Lengths of 97 to 100 with the marker under maxlen 100 (the default hparams'), a target
    limit of 98: each side padded up to its model's position table, not beyond it."""
    rng = np.random.default_rng(1)
    sources = [list(rng.integers(4, 100, size=n)) for n in rng.integers(96, 100, size=40)]
    targets = [list(rng.integers(4, 100, size=n)) for n in rng.integers(89, 97, size=40)]
    batches = collect(pipeline.make_dataset(*columns(sources, targets), 8, 800, seed=3,
                                            maxlens=(100, 98)))
    assert sum(len(source) for source, _, _ in batches) == 40
    assert {source.shape[1] for source, _, _ in batches} == {100}
    assert {target.shape[1] for _, target, _ in batches} <= {96, 98}
    assert all(source.size <= 800 for source, _, _ in batches)


@pytest.mark.parametrize("batch_size, batch_tokens, maxlen", [
    (64, 400, None), (32, 600, None), (7, 0, None), (16, 0, 20), (32, 600, 20)])
def test_the_dataset_knows_its_count_of_batches(rng, batch_size, batch_tokens, maxlen):
    """Without going through it (the plan of a run reads it); with `maxlen`, of the pairs that
    fit."""
    sources, targets = make_pairs(rng)
    dataset = pipeline.make_dataset(sources, targets, batch_size, batch_tokens,
                                    (maxlen, maxlen), seed=3)
    batches = collect(dataset)
    fit = (maxlen is None or np.sum((sources.lengths() < maxlen) & (targets.lengths() < maxlen)))
    pairs = len(sources) if maxlen is None else fit
    assert int(dataset.cardinality()) == len(batches) > pairs / batch_size
    assert sum(len(source) for source, _, _ in batches) == pairs


def test_same_seed_same_batches_other_seed_other_order(rng):
    sources, targets = make_pairs(rng)
    make = functools.partial(pipeline.make_dataset, sources, targets, 32, 600)
    first, again, other = collect(make(seed=1)), collect(make(seed=1)), collect(make(seed=2))
    assert len(first) == len(again)
    assert all(np.array_equal(a[0], b[0]) for a, b in zip(first, again))
    assert not all(a[0].shape == b[0].shape and np.array_equal(a[0], b[0])
                   for a, b in zip(first, other))


class CountedIds:
    """Flat ids that count the sentences read from them."""

    def __init__(self, ids):
        self.ids, self.read = ids, 0

    def __getitem__(self, index):
        self.read += 1
        return self.ids[index]


def counted(column):
    return IdColumn(CountedIds(column.ids), column.begins, column.ends)


def test_a_resumed_epoch_starts_at_its_batch_without_reading_the_ones_before(rng):
    sources, targets = make_pairs(rng)
    whole = collect(pipeline.make_dataset(sources, targets, 32, 600, seed=5))
    columns = counted(sources), counted(targets)
    dataset = pipeline.make_dataset(*columns, 32, 600, seed=5, skip=10)
    assert int(dataset.cardinality()) == len(whole) - 10
    rest = collect(dataset)
    assert len(rest) == len(whole) - 10
    assert all(np.array_equal(a[0], b[0]) and np.array_equal(a[2], b[2])
               for a, b in zip(rest, whole[10:]))
    # each pair of the batches from the tenth on read once, none of the ten before
    assert columns[0].ids.read == sum(len(batch[0]) for batch in whole[10:]) < len(sources)


def test_a_worker_reads_the_rows_of_its_replicas_alone(rng):
    """Share ``(1, 2, 4)``: replicas 1 and 2 of 4, rows ``[n//4, 3n//4)`` of a batch of n; the
    other rows stay padding, the shapes those of the whole batch."""
    sources, targets = make_pairs(rng)
    whole = collect(pipeline.make_dataset(sources, targets, 32, 600, seed=5))
    columns = counted(sources), counted(targets)
    shared = collect(pipeline.make_dataset(*columns, 32, 600, seed=5, share=(1, 2, 4)))
    assert len(shared) == len(whole)
    for mine, full in zip(shared, whole):
        rows = len(full[0])
        begin, end = rows // 4, 3 * rows // 4
        for ours, theirs in zip(mine, full):
            assert ours.shape == theirs.shape
            np.testing.assert_array_equal(ours[begin:end], theirs[begin:end])
            assert not ours[:begin].any() and not ours[end:].any()
    assert columns[0].ids.read == sum(3 * len(b[0]) // 4 - len(b[0]) // 4 for b in whole)


def test_an_epochs_plan_is_freed_with_its_dataset():
    """tf.data keeps a mapped Python function for the process's life: an epoch's plan (arrays
    of 8 bytes a pair) must not be held by that function. Traced NumPy memory does not grow
    from one epoch to the next (the plan's constants, TensorFlow's, go with the dataset)."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 40, 200_000)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    column = IdColumn(rng.integers(4, 400, offsets[-1]).astype(np.uint16), offsets[:-1],
                      offsets[1:])

    def an_epoch(seed):
        next(iter(pipeline.make_dataset(column, column, 64, 2000, seed=seed)))
        gc.collect()

    an_epoch(0)  # tf.data's own first allocations
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for seed in range(1, 6):
            an_epoch(seed)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 2**20, grown  # five plans kept would be over 8 MB
