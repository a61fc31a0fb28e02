"""SIGTERM and SIGINT as requests to stop cleanly: after an update, with a checkpoint.

Schedulers (Kubernetes, Slurm, `docker stop`, spot and preemptible machines)
send SIGTERM some seconds before they kill a process. While a `StopRequests`
is active, SIGTERM and SIGINT only note the request; the trainer sees it
between updates, takes it through its next update (whose all-reduce carries
it to every worker, so that all of them stop after the same update, see
`train_step.TrainStep`), saves a checkpoint and returns. A second signal while
the checkpoint is written is noted too, and interrupts nothing; a third raises
`KeyboardInterrupt` at once (for a run that hangs: the last complete checkpoint
stands, as after `kill -9`).

TensorFlow's `tf.distribute.experimental.PreemptionCheckpointHandler` agrees on
the step through its coordination service instead, but it adds a variable of
its own to the checkpoint it saves and restores the latest checkpoint when it
is made (before unreadable ones could be set aside); riding on the step's
all-reduce, the request here needs neither, and every strategy saves the same
checkpoint.
"""

import signal
import threading

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequests:
    """A context in which SIGTERM and SIGINT are noted, not obeyed at once.

    Attributes:
      received: The name of the first signal received (``"SIGTERM"``), or None.
      count: How many were received.

    Outside the main thread (where Python cannot install handlers) it notes nothing.
    """

    def __init__(self):
        self.received, self.count = None, 0
        self._previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = {number: signal.signal(number, self._note) for number in SIGNALS}
        return self

    def __exit__(self, *exception):
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous = {}

    def _note(self, number, frame):  # pylint: disable=unused-argument
        # Only flags: printing from a handler can re-enter a stream being written.
        self.count += 1
        if self.received is None:
            self.received = signal.Signals(number).name
        if self.count >= 3:
            raise KeyboardInterrupt
