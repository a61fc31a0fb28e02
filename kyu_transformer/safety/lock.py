"""Allows one training run per logdir by `flock(2)` on `<logdir>/.lock`, held for the run's whole
life; holds other files' locks, waiting for them (`exclusive`).

The kernel releases it however the process ends (`kill -9` included). The file names the holder
(PID and host) for a second run's message. Across hosts it holds on Linux NFS; other network file
systems may lock per host only.
"""

import contextlib
import fcntl
import os
import socket

from kyu_transformer.filenames import LOCK


class LogdirBusy(RuntimeError):
    """Raised when another process holds the logdir's lock; the message names it."""


class LogdirLock:
    """Holds the lock on `logdir` (made if missing), in file `path`: `acquire()` takes it,
    `release()` gives it back; as a context, it is held for the block."""

    def __init__(self, logdir):
        self.logdir, self.path = logdir, os.path.join(logdir, LOCK)
        self._handle, self._made = None, False

    def acquire(self):
        """Takes the lock without waiting; returns self, or raises `LogdirBusy` (or OSError)."""
        self._made = not os.path.isdir(self.logdir)
        os.makedirs(self.logdir, exist_ok=True)
        # "a+": opening must not empty the holder's record before the lock is ours.
        handle = open(self.path, "a+", encoding="utf-8")  # pylint: disable=consider-using-with
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            handle.close()
            raise LogdirBusy(f"{self.logdir} is in use by another training run ({holder}); "
                             "wait for it to end, stop it, or use another --logdir") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"PID {os.getpid()} on host {socket.gethostname()}\n")
        handle.flush()
        self._handle = handle
        return self

    def release(self):
        """Releases the lock; a logdir it made that holds only the lock goes too."""
        if self._handle is None:
            return
        if self._made and os.listdir(self.logdir) == [LOCK]:
            with contextlib.suppress(OSError):  # still held: another run is refused as busy
                os.remove(self.path)
                os.rmdir(self.logdir)
        self._handle.close()  # closing the descriptor releases the flock
        self._handle = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exception):
        self.release()


@contextlib.contextmanager
def exclusive(path, waiting_line, log=print):
    """Holds an exclusive `flock(2)` on file `path` (made if missing) for the block; where
    another process holds it, says `waiting_line` and waits for it."""
    with open(path, "a+", encoding="utf-8") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(waiting_line)
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield
