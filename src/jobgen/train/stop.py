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
        self.signum = 0  # 0: no request; a number travels well in a collective

    @property
    def requested(self) -> bool:
        return self.signum != 0

    @property
    def signal_name(self) -> Optional[str]:
        return signal_name(self.signum)

    def install(self) -> "StopRequest":
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: object) -> None:
        if self.signum == 0:
            self.signum = int(signum)


def signal_name(signum: int) -> Optional[str]:
    """"SIGTERM" for 15, None for 0."""
    return signal.Signals(signum).name if signum else None
