"""Reads parallel text from disk: plain or ``.gz`` files, a corpus folder's splits (plain
``<split>.<lang>[.gz]`` as Multi30k's, or IWSLT 2016's) and their fingerprint; downloads
Multi30k. It imports no TensorFlow, so that the programs read and check text before it loads."""

import glob
import gzip
import html
import http.client
import itertools
import os
import re
import shutil
import urllib.request

from kyu_transformer.safety.writes import sha256, staging_beside

MULTI30K_URL = "https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw"
MULTI30K_SPLITS = ("train", "val", "test_2016_flickr")
MULTI30K_FILES = tuple(f"{split}.{lang}.gz" for split in MULTI30K_SPLITS for lang in ("de", "en"))


class DataError(ValueError):
    """Raised for a problem with the corpus; the message names the file (and line)."""


def normalize_line(text):
    """Collapses runs of white space (tabs, CR, non-breaking...) to one space."""
    return " ".join(text.split())


def open_binary(path):
    """Opens a plain or gzip (``.gz``) file for reading its bytes."""
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def iter_lines(path):
    """Yields the lines of a UTF-8 text file, plain or gzip (BOM, CRLF accepted), spaces
    normalized, one at a time; raises DataError for a file it cannot read."""
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such file")
    try:
        with open_binary(path) as handle:
            for number, raw in enumerate(handle, start=1):
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as error:
                    raise DataError(f"{path}, line {number}: invalid UTF-8 "
                                    f"(byte {raw[error.start]:#04x} at column {error.start + 1})"
                                    ) from None
                yield normalize_line(text.lstrip("\ufeff") if number == 1 else text)
    except (OSError, EOFError) as error:  # e.g. a truncated or non-gzip .gz
        raise DataError(f"{path}: cannot read ({error})") from None


def read_lines(path):
    """Returns the lines of a text file as `iter_lines` reads them."""
    return list(iter_lines(path))


def iter_parallel(source_path, target_path, reader=iter_lines, counts=None):
    """Yields the non-empty pairs ``(source, target)`` of two aligned files, read side by side;
    raises DataError, at the end, if their line counts differ or no pair was found. `counts`, a
    dict, receives ``pairs`` and ``empty`` (the pairs with an empty side, skipped)."""
    counts = {} if counts is None else counts
    counts.update(pairs=0, empty=0)
    lines = [0, 0]
    for source, target in itertools.zip_longest(reader(source_path), reader(target_path)):
        lines[0] += source is not None
        lines[1] += target is not None
        if source and target:
            counts["pairs"] += 1
            yield source, target
        elif source is not None and target is not None:
            counts["empty"] += 1
    if lines[0] != lines[1]:
        raise DataError(f"{source_path} has {lines[0]} lines but {target_path} has "
                        f"{lines[1]}: the two sides must be sentence-aligned")
    if not counts["pairs"]:
        raise DataError(f"{source_path} / {target_path}: no non-empty sentence pair")


def read_parallel(source_path, target_path, reader=iter_lines):
    """Returns the non-empty pairs of two aligned files as ``(sources, targets, num_empty)``;
    raises DataError if their line counts differ or no pair is left."""
    counts = {}
    pairs = list(iter_parallel(source_path, target_path, reader, counts))
    return [s for s, _ in pairs], [t for _, t in pairs], counts["empty"]


_SEGMENT = re.compile(r"<seg[^>]*>(.*?)</seg>", re.IGNORECASE)


def read_iwslt(path):
    """Yields the sentences of one of IWSLT 2016's files: of ``IWSLT16.TED.*.xml``, the text of
    every ``<seg>`` element; of ``train.tags.*``, every line that is not an XML tag line."""
    if path.endswith(".xml"):
        return (normalize_line(html.unescape(segment)) for line in iter_lines(path)
                for segment in _SEGMENT.findall(line))
    return (line for line in iter_lines(path) if not line.startswith("<"))


IWSLT_SPLITS = {"val": "tst2013", "test": "tst2014"}  # Kyubyong's choice


def split_files(data_dir, split, source_lang="de", target_lang="en"):
    """Returns ``([source_path, target_path], reader)`` of a split, plain or IWSLT's; raises
    DataError if the split has no files."""
    languages, pair = (source_lang, target_lang), f"{source_lang}-{target_lang}"
    plain = [path if os.path.isfile(path) else path + ".gz"
             for path in (os.path.join(data_dir, f"{split}.{lang}") for lang in languages)]
    if all(os.path.isfile(p) for p in plain):
        return plain, iter_lines
    iwslt = IWSLT_SPLITS.get(split, split)
    if iwslt == "train":
        paths = [os.path.join(data_dir, f"train.tags.{pair}.{lang}") for lang in languages]
    else:  # the last IWSLT xml file whose name holds the split (e.g. tst2014)
        found = sorted(glob.glob(os.path.join(data_dir, f"*{iwslt}*.{pair}.{source_lang}.xml")))
        stem = found[-1][:-len(f".{source_lang}.xml")] if found else None
        paths = [f"{stem}.{lang}.xml" for lang in languages] if found else []
    if paths and all(os.path.isfile(p) for p in paths):
        return paths, read_iwslt
    name = os.path.basename(split)
    raise DataError(f"{data_dir}: no `{split}` split for {pair}; expected {name}.{source_lang}"
                    f"[.gz] and {name}.{target_lang}[.gz] (or the IWSLT 2016 files)")


def check_data_dir(data_dir):
    """Raises DataError unless `data_dir` is a folder that exists and is not empty."""
    if not os.path.exists(data_dir):
        raise DataError(f"{data_dir}: no such data folder")
    if not os.path.isdir(data_dir):
        raise DataError(f"{data_dir}: is a file, expected a folder of parallel text")
    if not os.listdir(data_dir):
        raise DataError(f"{data_dir}: the data folder is empty")


def load_split(data_dir, split, source_lang="de", target_lang="en"):
    """Returns ``(sources, targets, num_empty)`` of one split of a corpus folder."""
    check_data_dir(data_dir)
    paths, reader = split_files(data_dir, split, source_lang, target_lang)
    return read_parallel(*paths, reader)


def fingerprint(data_dir, split="train", source_lang="de", target_lang="en"):
    """Returns ``{file name: sha256}`` of a split's files, which tells one corpus from
    another."""
    paths, _ = split_files(data_dir, split, source_lang, target_lang)
    return {os.path.basename(path): sha256(path) for path in paths}


def ensure_multi30k(data_dir, base_url=None, timeout=30):
    """Downloads the six raw Multi30k files into `data_dir` if it does not exist (from
    `base_url`, else ``$MULTI30K_URL``); a failed download leaves nothing."""
    if os.path.exists(data_dir):
        return data_dir
    base_url = base_url or os.environ.get("MULTI30K_URL", MULTI30K_URL)
    staging = staging_beside(data_dir, "download")  # makes `data/` of a fresh clone
    try:
        for name in MULTI30K_FILES:
            _download(f"{base_url}/{name}", os.path.join(staging, name), timeout)
        for split in MULTI30K_SPLITS:
            load_split(staging, split)
    except BaseException as error:
        shutil.rmtree(staging, ignore_errors=True)
        if not isinstance(error, DataError):
            raise
        raise DataError(
            f"{data_dir} does not exist and Multi30k could not be downloaded from {base_url} "
            f"({error}). Put the six files {', '.join(MULTI30K_FILES)} (from the "
            f"`data/task1/raw/` folder of the multi30k/dataset repository) in {data_dir}, "
            "or pass --data_dir.") from None
    try:
        os.replace(staging, data_dir)  # all six files or none
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not os.path.isdir(data_dir):
            raise
        # Another process put a complete (checked) corpus there first.
    return data_dir


def _download(url, path, timeout):
    """Downloads `url` to `path`; raises `DataError` naming the URL on HTTP errors and cut
    connections."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response, open(path, "wb") as handle:
            shutil.copyfileobj(response, handle)
    except (OSError, http.client.HTTPException) as error:
        raise DataError(f"{url}: {error or type(error).__name__}") from None
