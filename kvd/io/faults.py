"""Faults injected into a whole daemon's I/O engine, for tests that run kvd as a user does.

`KVD_INJECT_IO_FAULTS="write:ENOSPC:1000,read:EIO:5"` makes the engine fail
that many matching entries with that errno; `read:SHORT:5` makes them
transfer 0 bytes, a short read, as past the end of a truncated segment.
The disk plane applies it when it opens the drives, with a warning in the
log; a malformed value stops the daemon at start.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass

from kvd.io.engine import Op

FAULTS_ENV = "KVD_INJECT_IO_FAULTS"
SHORT = "SHORT"


@dataclass(frozen=True, slots=True)
class InjectedFault:
    """One item of KVD_INJECT_IO_FAULTS (the engine's own matching rule is kvd.io.engine.FaultRule)."""

    op: Op
    count: int
    error: int | None = None  # errno, or None for a short transfer
    short_bytes: int | None = None


def parse_injected_faults(text: str) -> list[InjectedFault]:
    faults = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        op_name, kind, count_text = (item.split(":") + ["1"])[:3]
        error_number = getattr(errno, kind.upper(), None)
        if (op_name.upper() not in Op.__members__ or (error_number is None and kind.upper() != SHORT)
                or not count_text.isdigit()):
            raise ValueError(f"{FAULTS_ENV}: cannot parse {item!r} (want op:ERRNO[:count] or op:SHORT[:count])")
        faults.append(InjectedFault(Op[op_name.upper()], int(count_text), error_number,
                                    None if error_number is not None else 0))
    return faults


def inject(engine, text: str) -> list[InjectedFault]:
    """Arm `engine` (a kvd.io.engine.IoEngine) with the faults `text` names; what it armed."""
    faults = parse_injected_faults(text)
    for fault in faults:
        if fault.error is not None:
            engine.inject_fault(fault.op, errno=fault.error, count=fault.count)
        else:
            engine.inject_fault(fault.op, short_bytes=fault.short_bytes, count=fault.count)
    return faults
