"""One training run per logdir: an operating-system lock held for the run's whole life.

The lock is `flock(2)` on `<logdir>/.lock`: the kernel releases it when the
process ends, however it ends (`kill -9` included), so no stale lock is ever
left behind. The file records who holds it (PID and host), for the message a
second run prints. On a shared file system the lock follows that file
system's semantics: on Linux NFS clients `flock` is carried by the server's
byte-range locks and holds across hosts; other network file systems may lock
per host only.
"""

import fcntl
import os
import socket

from kyu_transformer.filenames import LOCK


class LogdirBusy(RuntimeError):
    """Another process holds the logdir's lock; the message names it."""


class LogdirLock:
    """The lock on `logdir`; `acquire()` takes it or raises `LogdirBusy`.

    Args:
      logdir: The run's logdir (made if missing).

    Attributes:
      path: The lock file, `<logdir>/.lock`.
    """

    def __init__(self, logdir):
        self.logdir = logdir
        self.path = os.path.join(logdir, LOCK)
        self._handle = None

    def acquire(self):
        """Takes the lock without waiting; returns self.

        Raises:
          LogdirBusy: Another process holds it.
          OSError: The logdir cannot be made or written.
        """
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
        if self._handle is not None:
            self._handle.close()  # closing the descriptor releases the flock
            self._handle = None
