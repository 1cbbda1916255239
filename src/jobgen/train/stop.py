"""Graceful-stop requests: signal handlers that only set a flag.

The trainer reads `StopRequest.requested` at every optimizer-step boundary and all ranks agree on
it with one collective (see `jobgen.train.trainer`), so a signal delivered to any one rank, or to
all of them at different moments, stops every rank at the same step with a complete checkpoint.
Nothing else happens inside a handler: no I/O, no collectives, no exceptions.
"""

from __future__ import annotations

import signal
from typing import Optional

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT)


class StopRequest:
    """Set by SIGTERM, SIGUSR1, SIGUSR2 or SIGINT; remembers the first signal received."""

    def __init__(self) -> None:
        self.signal_name: Optional[str] = None

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def install(self) -> "StopRequest":
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: object) -> None:
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name
