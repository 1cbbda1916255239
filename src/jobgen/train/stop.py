"""Graceful-stop requests: signal handlers that only set a flag, and the batch shell's stop file.

The trainer reads `StopRequest.requested` at every optimizer-step boundary and all ranks agree on
it with one collective (see `jobgen.train.trainer`), so a signal delivered to any one rank, or to
all of them at different moments, stops every rank at the same step with a complete checkpoint.
Nothing else happens inside a handler: no I/O, no collectives, no exceptions.

The batch script asks for a stop (at the time-limit warning) by creating RUN_DIR/stop-requested:
a file reaches every rank on every node whatever the launcher forwards (srun, for one, kills a
step it is sent SIGTERM for), and it is read here, outside any handler, at the step boundary.
"""

from __future__ import annotations

import os
import signal
from typing import Optional

from jobgen.rundir.files import STOP_REQUESTED

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT)
STOP_FILE = STOP_REQUESTED
# Not a signal number (they end at 64): the stop file, carried in the same collective.
STOP_FILE_REQUEST = 256


class StopRequest:
    """Set by SIGTERM, SIGUSR1, SIGUSR2 or SIGINT, or by the stop file; remembers the first."""

    def __init__(self, stop_file: Optional[str] = None) -> None:
        self._signum = 0  # 0: no request; a number travels well in a collective
        self.stop_file = stop_file

    @property
    def signum(self) -> int:
        """The request, read at a step boundary: the first signal, else the stop file."""
        if self._signum == 0 and self.stop_file and os.path.exists(self.stop_file):
            self._signum = STOP_FILE_REQUEST
        return self._signum

    @signum.setter
    def signum(self, value: int) -> None:
        self._signum = value

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
        if self._signum == 0:
            self._signum = int(signum)


def signal_name(signum: int) -> Optional[str]:
    """"SIGTERM" for 15, "stop file" for the batch shell's request, None for 0."""
    if signum == STOP_FILE_REQUEST:
        return "stop file"
    return signal.Signals(signum).name if signum else None
