"""A job's state as every scheduler reports it, in one shape."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class JobState:
    job_id: str
    state: str  # the scheduler's own word: PENDING, RUNNING, COMPLETED, R, Q, ...
    reason: str = ""
    nodes: str = ""
    elapsed: str = ""
    restarts: Optional[int] = None
    source: str = ""  # which command said so

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_key_values(text: str) -> dict[str, str]:
    """`Key=Value Key2=Value2` (scontrol -o) into a dict; values hold no spaces there."""
    fields = {}
    for token in text.split():
        key, sep, value = token.partition("=")
        if sep:
            fields[key] = value
    return fields
