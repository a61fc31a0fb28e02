"""Takes SIGTERM and SIGINT as requests to stop after an update, with a checkpoint."""

import signal
import threading


class StopRequests:
    """Makes SIGTERM and SIGINT, within the context, only note a request to stop after an
    update, with a checkpoint: `received` names the first (``"SIGTERM"``) or is None. A second
    one interrupts nothing; a third raises `KeyboardInterrupt` (a hung run). Notes nothing outside
    the main thread (where Python cannot install handlers)."""

    def __init__(self):
        self.received, self.count, self._previous = None, 0, {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = {number: signal.signal(number, self._note)
                              for number in (signal.SIGTERM, signal.SIGINT)}
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
