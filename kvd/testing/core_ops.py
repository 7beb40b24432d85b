"""What only tests need of the engine's parts: the mover, the event log, the eviction policy and
the disk admission filter.

Each is a function of the part, outside its class, because nothing in the
daemon or the simulator calls it: a round abandoned through the mover's own
calls, and counts and contents the parts keep but never show (these read
the part's internals).
"""

from __future__ import annotations

from kvd.core.durable import NotDurable
from kvd.core.events import EventLog
from kvd.core.mover import Mover, WriteRound
from kvd.core.policy.admission import AdmissionFilter
from kvd.core.policy.s3fifo import S3FifoPolicy


def abandon_round(mover: Mover, round_: WriteRound) -> list[tuple[object, NotDurable | None]]:
    """The round's I/O could not run at all (shutdown): nothing was written. Its removals are
    journalled if they were not yet, then it finishes with every write failed; the outcome for
    each durable wait on one of its blocks."""
    if not round_.journalled:
        mover.round_removals_journalled(round_, {slot for _, _, slot in round_.removals})
    return mover.finish_round(round_)


def tracker_count(log: EventLog) -> int:
    """Key trackers registered with the log, all namespaces."""
    return sum(map(len, log._trackers.values()))


def retained_events(log: EventLog) -> int:
    """Events the log's ring holds now."""
    return len(log._ring)


def ghost_keys(policy: S3FifoPolicy) -> list[bytes]:
    """S3-FIFO's ghost queue G, oldest first."""
    return list(policy._ghost)


def memory_bytes(admission: AdmissionFilter) -> int:
    """The bytes of the admission filter's counter table."""
    return admission._table.nbytes
