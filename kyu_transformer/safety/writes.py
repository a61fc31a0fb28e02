"""Writes files so that a crash, a signal or a full disk leaves nothing half-written.

Files are written under a temporary name and renamed into place (a reader sees the old file or
the new one); a lack of space becomes an `OutOfSpace`, which the programs print as one line.
"""

import contextlib
import errno
import functools
import hashlib
import os
import re
import shutil
import tempfile
import time

from kyu_transformer import filenames


class OutOfSpace(OSError):
    """Raised when writing `path` (a file or folder) failed for lack of space; it `needed` bytes
    (or None)."""

    def __init__(self, path, needed=None):
        super().__init__(errno.ENOSPC, "No space left on device", path)
        self.path, self.needed = path, needed

    def __str__(self):
        needed = f" (it needs about {self.needed / 2**20:.1f} MiB)" if self.needed else ""
        return f"no space left on the device writing {self.path}{needed}"


def is_out_of_space(error):
    """Returns whether `error` (an OSError, a TensorFlow or h5py error...) says the disk is
    full."""
    return (isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)
            or any(text in str(error) for text in ("No space left on device",
                                                   "Disk quota exceeded")))


def as_out_of_space(error, path=None, needed=None):
    """Returns `error` as an `OutOfSpace` naming `path` (or the path the error names)."""
    if isinstance(error, OutOfSpace):
        return error
    # TensorFlow names its files in the message: its first absolute path, not "device_/job:...".
    match = re.search(r"(?:^|\s)(/[^\s;,'\"]+)", str(error))
    path = path or getattr(error, "filename", None) or (match and match.group(1)) or "a file"
    return OutOfSpace(path, needed)


@contextlib.contextmanager
def replaced_atomically(path):
    """Yields a temporary path (with `path`'s ending, by which Keras and matplotlib choose the
    format) that replaces `path` when the block succeeds, and is removed when it fails."""
    folder, name = os.path.split(path)
    temporary = os.path.join(folder, f".tmp-{os.getpid()}-{name}")
    try:
        yield temporary
        os.replace(temporary, path)
    except BaseException as error:
        with contextlib.suppress(OSError):
            os.remove(temporary)
        if isinstance(error, Exception) and is_out_of_space(error):
            raise as_out_of_space(error, path) from None
        raise


def stops_cleanly_when_full(main):
    """Wraps a program's `main`: a full disk ends it with one line, not a traceback."""
    @functools.wraps(main)
    def wrapped(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except Exception as error:  # pylint: disable=broad-except  (re-raised unless full)
            if not is_out_of_space(error):
                raise
            raise SystemExit(f"error: {as_out_of_space(error)}; nothing was left half-written. "
                             "Free some space and run the command again.") from None
    return wrapped


def sha256(path):
    """Returns the SHA-256 of file `path` in hex, reading it in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def staging_beside(path, label):
    """Makes a new hidden folder beside `path` (its parent made if missing) to write in first:
    on the same file system, so that renaming from it to `path` is atomic. Returns its path, or
    raises OSError if it cannot be made."""
    parent, base = os.path.split(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    return tempfile.mkdtemp(prefix=f".{base}.{label}-", dir=parent)


def write_text(path, text):
    """Writes `text` (UTF-8) to `path`, atomically."""
    with replaced_atomically(path) as temporary, open(temporary, "w", encoding="utf-8") as handle:
        handle.write(text)


def drop_torn_last_line(path):
    """Cuts a text file back to its last complete line (after a crash or a full disk); returns
    whether it cut anything."""
    if not os.path.isfile(path):
        return False
    with open(path, "rb+") as handle:
        data = handle.read()
        if not data or data.endswith(b"\n"):
            return False
        handle.truncate(data.rfind(b"\n") + 1)
    return True


def copy_aside(path, keep=()):
    """Moves the contents of folder `path` but `keep` (a run's lock) to `<path>.old-<time>` and
    returns that path; deletes nothing."""
    path = os.path.normpath(path)  # "log/x/": the copy goes beside it, not into it
    stem = filenames.ASIDE.format(path, time.strftime('%Y%m%d-%H%M%S'))
    aside, number = stem, 1
    while os.path.exists(aside):  # twice in one second: never move into the older copy
        number += 1
        aside = f"{stem}-{number}"
    os.mkdir(aside)
    for name in sorted(set(os.listdir(path)) - set(keep)):
        shutil.move(os.path.join(path, name), os.path.join(aside, name))
    return aside


def replace_directory(new, out, staging):
    """Moves the complete directory `new` (in `staging`, from `staging_beside`) to `out`. The old
    `out` goes into `staging` first, to be deleted with it, and back should the second rename fail;
    only a crash between the renames leaves no `out` (the old one is then in `staging`)."""
    if os.path.isdir(out) and os.listdir(out):
        old = os.path.join(staging, "old")
        os.rename(out, old)
        try:
            os.rename(new, out)
        except OSError:
            os.rename(old, out)
            raise
        return
    if os.path.isdir(out):
        os.rmdir(out)
    os.rename(new, out)
