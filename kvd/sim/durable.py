"""Durable Puts (the daemon's ACK_DURABLE), through the mover's durable waits (kvd.core.durable).

A Put that asked to be acknowledged durable pins its blocks and waits
until each is written (or found hopeless: a failed write, a parent that
never reached disk), at most `durable_wait_ms`. It is acknowledged only
if every block is on disk with its own bytes, which is checked here
against the fake slot contents; otherwise it is refused, with why.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvd.core.block import NO_SLOT
from kvd.core.durable import NotDurable
from kvd.invariants import check
from kvd.sim.events import EventKind
from kvd.sim.world import World

if TYPE_CHECKING:
    from kvd.sim.clients import Flow


class DurablePuts:
    def __init__(self, world: World) -> None:
        self.world = world
        # The Puts waiting for their acknowledgement.
        self.flows: set[Flow] = set()

    def wait(self, flow: Flow) -> None:
        """The Put's blocks, committed, start their wait; it is answered at once if none must wait."""
        world = self.world
        timeline = world.timeline
        blocks = world.engine.stored(world.namespace_ids[flow.namespace], flow.keys)
        started, failures, pins, _ = world.mover.durable.start(blocks, "", lambda block: (flow, block))
        flow.durable_pending, flow.durable_pins, flow.durable_failures = set(started), pins, failures
        flow.durable_since_us = timeline.now_us
        self.flows.add(flow)
        if started:
            timeline.schedule(timeline.now_us + world.config.durable_wait_ms * 1000, EventKind.DURABLE_TIMEOUT, flow)
        else:
            self._done(flow)

    def outcomes(self, outcomes: Iterable) -> None:
        """The mover's word on blocks waited for: written, or (with why) never to be."""
        for (flow, block), failure in outcomes:
            if flow not in self.flows:
                continue  # it gave up at its deadline
            flow.durable_pending.discard(block)
            if failure is not None:
                flow.durable_failures.append(failure)
            if not flow.durable_pending:
                self._done(flow)

    def timeout(self, flow: Flow) -> None:
        if flow in self.flows:
            flow.durable_failures.extend(NotDurable(block, "DEADLINE_EXCEEDED", "not written in time")
                                         for block in flow.durable_pending)
            flow.durable_pending = set()
            self._done(flow)

    def _done(self, flow: Flow) -> None:
        """The Put is answered: acknowledged durable only if every block is on disk, with its own bytes."""
        world = self.world
        self.flows.discard(flow)
        for pin in flow.durable_pins:
            pin.release()
        flow.durable_pins = []
        stats = world.stats
        stats.durable_wait_max_us = max(stats.durable_wait_max_us, world.timeline.now_us - flow.durable_since_us)
        if flow.durable_failures:
            stats.durable_failed += 1
            return
        stats.durable_acked += 1
        engine = world.engine
        for block in engine.stored(world.namespace_ids[flow.namespace], flow.keys):
            slot = engine.disk_slot(block)
            check(slot != NO_SLOT and world.contents.disk.get(slot) == block.key,
                  "a Put acknowledged durable left {!r} off the disk", block)
