"""SIGTERM and SIGINT as requests to stop cleanly: after an update, with a checkpoint.

Schedulers (Kubernetes, Slurm, `docker stop`, spot machines) send SIGTERM some seconds before
a kill. While a `StopRequests` is active, a signal only notes the request; the trainer passes
it through its next update, whose all-reduce tells every worker to stop after that same update
(`train_step.TrainStep`), then saves and returns. A second signal interrupts nothing; a third
raises `KeyboardInterrupt` at once (for a hung run; the last complete checkpoint stands).

Unlike TensorFlow's `PreemptionCheckpointHandler`, this adds no variable to the checkpoint and
restores nothing when made (before unreadable checkpoints could be set aside).
"""

import signal
import threading

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequests:
    """A context in which SIGTERM and SIGINT are noted, not obeyed at once.

    `received` names the first one (``"SIGTERM"``) or is None; `count` counts them. Outside
    the main thread (where Python cannot install handlers) it notes nothing.
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
