"""Holds a training split encoded once into subword ids on disk, read back by memory mapping (as
fairseq's binarized datasets are): each side's ids one sentence after another in one flat file,
with every sentence's offsets in another.

A preparation is written whole in a staging folder and renamed into place, so that a folder
under its final name is always complete; a lock of its own lets one process prepare while the
others wait. Its name holds a fingerprint of the corpus files and the subword model, so that a
changed corpus or model is prepared anew and several corpora share one cache folder.
"""

import contextlib
import glob
import hashlib
import itertools
import json
import os
import shutil
import time

import numpy as np

from kyu_transformer.conventions import UNK_ID
from kyu_transformer.data.text import DataError, iter_parallel, open_binary
from kyu_transformer.safety.lock import exclusive
from kyu_transformer.safety.writes import (
    OutOfSpace, is_out_of_space, sha256, staging_beside, write_text)

FORMAT = 1  # of the files below; a new format is prepared anew
RECORD = "prepared.json"  # what was prepared, from what; written last
SIDES = ("sources", "targets")
CHUNK_PAIRS = 20_000  # pairs encoded at once: SentencePiece's batch call, bounded memory


class IdColumn:
    """Many sentences' subword ids, one after another in `ids`, sentence ``i`` at
    ``ids[begins[i]:ends[i]]`` (arrays, memory-mapped or not)."""

    def __init__(self, ids, begins, ends):
        self.ids, self.begins, self.ends = ids, np.asarray(begins), np.asarray(ends)

    def __len__(self):
        return len(self.begins)

    def lengths(self):
        """Returns every sentence's count of ids, ``(sentences,)``."""
        return self.ends - self.begins

    def rows(self, index):
        """Returns the column of the sentences `index` (a slice or an array of numbers) picks."""
        return IdColumn(self.ids, self.begins[index], self.ends[index])

    def sentence(self, row):
        """Returns sentence `row`'s ids as an int32 array."""
        return np.asarray(self.ids[self.begins[row]:self.ends[row]], np.int32)

    @classmethod
    def joined(cls, first, second):
        """Returns the column of `first`'s sentences, then `second`'s, reading their ids where
        they are (a corpus on disk stays there; the offsets, 16 bytes a sentence, are copied)."""
        ids, shift = first.ids, 0
        if second.ids is not first.ids:
            ids, shift = ChainedIds(first.ids, second.ids), len(first.ids)
        return cls(ids, np.concatenate([first.begins, second.begins + shift]),
                   np.concatenate([first.ends, second.ends + shift]))


class ChainedIds:
    """Two flat id arrays read as one: positions from ``len(first)`` on are `second`'s. A slice
    lies within one of them (a sentence is never split)."""

    def __init__(self, first, second):
        self.first, self.second = first, second

    def __len__(self):
        return len(self.first) + len(self.second)

    def __getitem__(self, index):
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError("ChainedIds reads a slice of consecutive ids")
        start, stop, _ = index.indices(len(self))
        border = len(self.first)
        if stop <= border:
            return self.first[start:stop]
        if start >= border:
            return self.second[start - border:stop - border]
        raise IndexError(f"ids {start}:{stop} cross the border of two arrays at {border}")


class PreparedSplit:
    """A prepared training split in `folder`: ``sources`` and ``targets`` (`IdColumn`s of
    memory-mapped ids, without BOS/EOS) and ``record`` (the counts of `prepare`)."""

    def __init__(self, folder):
        self.folder = folder
        with open(os.path.join(folder, RECORD), encoding="utf-8") as handle:
            self.record = json.load(handle)
        dtype = np.dtype(self.record["dtype"])
        for side in SIDES:
            offsets = _mapped(os.path.join(folder, f"{side}.offsets"), np.int64)
            setattr(self, side, IdColumn(_mapped(os.path.join(folder, f"{side}.ids"), dtype),
                                         offsets[:-1], offsets[1:]))

    @classmethod
    def open_or_prepare(cls, cache_dir, paths, reader, files, subwords, log=print):
        """Returns the split of corpus files `paths` (source, target; read with `reader`; their
        digests `files`, as `text.fingerprint` gives them) encoded with `subwords`, prepared
        first if `cache_dir` holds no such preparation; waits, saying so, while another process
        prepares it."""
        key = hashlib.sha256(json.dumps([FORMAT, files, subwords.digest()]).encode()).hexdigest()
        folder = os.path.join(os.path.abspath(cache_dir), f"train.{key[:16]}")
        if os.path.isfile(os.path.join(folder, RECORD)):
            return cls(folder)
        os.makedirs(cache_dir, exist_ok=True)
        with exclusive(folder + ".lock", f"waiting for another process preparing {folder}", log):
            if not os.path.isfile(os.path.join(folder, RECORD)):  # nobody prepared it meanwhile
                _discard_leftovers_of(folder)
                prepare(folder, paths, reader, subwords, files, log)
        return cls(folder)


def _mapped(path, dtype):
    """Maps file `path` of `dtype` values read-only (an empty file is an empty array: mmap
    refuses a length of 0)."""
    if os.path.getsize(path) == 0:
        return np.zeros(0, dtype)
    return np.memmap(path, dtype=dtype, mode="r")


def prepare(folder, paths, reader, subwords, files, log=print):
    """Encodes the non-empty pairs of corpus files `paths` with `subwords` into `folder`,
    `CHUNK_PAIRS` at a time, in a staging folder renamed to `folder` once complete. Raises
    DataError, keeping nothing, if a file's digest is no longer its `files` entry (it changed
    while it was read)."""
    started, staging = time.time(), staging_beside(folder, "prepare")
    dtype = np.uint16 if subwords.vocab_size <= 2**16 else np.int32
    counts, unknown = {}, {"pieces": 0, "sentences": 0, "all pieces": 0}
    try:
        with contextlib.ExitStack() as stack:
            handles = {side: [stack.enter_context(open(os.path.join(staging, f"{side}.{kind}"),
                                                       "wb")) for kind in ("ids", "offsets")]
                       for side in SIDES}
            for _, offsets_handle in handles.values():
                offsets_handle.write(np.zeros(1, np.int64).tobytes())
            ends = dict.fromkeys(SIDES, 0)
            progress = _Progress(paths[0], log)
            pairs = iter_parallel(*paths, reader, counts)
            while chunk := list(itertools.islice(pairs, CHUNK_PAIRS)):
                for side, sentences in zip(SIDES, zip(*chunk)):
                    ends[side] = _append(subwords.encode(sentences), handles[side], ends[side],
                                         dtype, unknown)
                progress.update(counts["pairs"] + counts["empty"])
        for path in paths:
            if sha256(path) != files[os.path.basename(path)]:
                raise DataError(f"{path} changed while it was being prepared; nothing of it "
                                "was kept: run again to prepare the file as it is now")
        record = {"format": FORMAT, "files": files, "subwords": subwords.digest(),
                  "dtype": np.dtype(dtype).name, "pairs": counts["pairs"],
                  "empty": counts["empty"], "unknown": unknown,
                  "seconds": round(time.time() - started, 1)}
        write_text(os.path.join(staging, RECORD), json.dumps(record, indent=1) + "\n")
        os.replace(staging, folder)
    except OSError as error:
        if is_out_of_space(error):
            raise OutOfSpace(folder) from None
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    progress.done(counts["pairs"], record["seconds"], folder)


def _append(encoded, handles, end, dtype, unknown):
    """Writes the id lists `encoded` to a side's `handles` (ids, offsets) after offset `end`;
    counts their unknown pieces into `unknown`; returns the new end."""
    lengths = np.fromiter(map(len, encoded), np.int64, len(encoded))
    ids = np.fromiter(itertools.chain.from_iterable(encoded), np.int32, int(lengths.sum()))
    is_unknown = ids == UNK_ID
    unknown["pieces"] += int(is_unknown.sum())
    unknown["all pieces"] += len(ids)
    sentence_of = np.repeat(np.arange(len(lengths)), lengths)  # (ids,); a sentence may have none
    unknown["sentences"] += len(np.unique(sentence_of[is_unknown]))
    # file.write, not ndarray.tofile: its OSError keeps the errno (a full disk's ENOSPC).
    handles[0].write(ids.astype(dtype).tobytes())
    handles[1].write((end + np.cumsum(lengths)).tobytes())
    return end + int(lengths.sum())


class _Progress:
    """Says how far a preparation is, by the lines read of corpus file `path` (its lines
    counted first: a fast pass over the bytes), at most every few seconds."""

    def __init__(self, path, log, every=5.0):
        self.log, self.every, self.last = log, every, time.time()
        self.lines = _count_lines(path)
        log(f"preparing the training split ({self.lines:,} lines of {path}) once: encoded "
            "into subword ids on disk, read from there by every later run")

    def update(self, lines):
        """Says how many of the file's `lines` are prepared, unless it said so just now."""
        if time.time() - self.last >= self.every:
            self.last = time.time()
            self.log(f"  prepared {lines:,} of {self.lines:,} lines "
                     f"({lines / max(self.lines, 1):.0%})")

    def done(self, pairs, seconds, folder):
        """Says the preparation is complete: its `pairs`, `seconds` and `folder`."""
        self.log(f"prepared {pairs:,} pairs in {seconds:.1f} s ({folder})")


def _count_lines(path):
    """Counts the lines of a text file, plain or gzip."""
    with open_binary(path) as handle:
        count, last = 0, b"\n"
        for block in iter(lambda: handle.read(1 << 20), b""):
            count, last = count + block.count(b"\n"), block[-1:]
        return count + (last != b"\n")


def _discard_leftovers_of(folder):
    """Removes what a killed preparation of `folder` or a removal cut short left: staging
    folders, and `folder` itself without its record (the lock is held: no live process writes
    them)."""
    parent, base = os.path.split(os.path.abspath(folder))
    for staging in glob.glob(os.path.join(glob.escape(parent), f".{base}.prepare-*")):
        shutil.rmtree(staging, ignore_errors=True)
    shutil.rmtree(folder, ignore_errors=True)
