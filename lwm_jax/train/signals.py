"""Graceful stop on SIGTERM / SIGINT: the handler only sets a flag; the train loop checks it
between steps, saves a checkpoint and returns. A second SIGINT (Ctrl-C twice) raises
KeyboardInterrupt at once, for when saving itself hangs.
"""
from __future__ import annotations

import signal
import threading


class StopRequest:
    """Context manager installing the handlers (main thread only; elsewhere a no-op).

    `requested` is the name of the first signal received ("SIGTERM" / "SIGINT"), or None.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.requested: str | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame):
        if self.requested == "SIGINT" and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = self.requested or signal.Signals(signum).name

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
