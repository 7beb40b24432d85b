"""The engine's clients: every request of the trace, from its arrival to its reply's Put.

A request goes through the engine as a client of the daemon would:

    arrival        lookup the prompt's keys (records each block's tier),
                   begin_get: pin the stored prefix, plan its loads
    reads done     finish_loads, settle_get: the servable prefix, checked
                   against the fake bytes; then reserve the rest (Put)
    prefill done   write the reserved slots, commit, release the Get lease
    decode done    Put the reply's blocks (reserve + commit at once)

The Get's rules (starved plans waiting for a write round, its own pins,
when it may settle, why it serves less) are the daemon's own
(kvd.core.get_life); its reads run on the modelled devices
(kvd.sim.drives). A client that crashes (the trace says which) stops after
its reserve and holds its leases until they expire. On request, some Puts
wait to be acknowledged durable (kvd.sim.durable), some prompts are
prefetched before their Get, some replies are Deleted, and tenants have
host quotas. Each choice is drawn from a source of its own, seeded from
the run's seed, apart from the trace.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np

from kvd.core.block import NO_SLOT, Block
from kvd.core.engine import ReserveStatus, TierId
from kvd.core.get_life import GetLife, GetPhase
from kvd.core.keys import chain_keys
from kvd.core.quota import QuotaExceeded
from kvd.core.reads import GetCut, LoadOutcome
from kvd.core.requests import CommitRequest, KeysRequest
from kvd.errors import ResourceExhausted
from kvd.invariants import check
from kvd.sim.config import MIDDLE_TIER
from kvd.sim.disk import DiskOp
from kvd.sim.drives import Drives
from kvd.sim.durable import DurablePuts
from kvd.sim.events import EventKind
from kvd.sim.traces import Request
from kvd.sim.world import World


@dataclass(slots=True, eq=False)
class Flow:
    """One request on its way through the engine."""

    request: Request
    namespace: int
    keys: list[bytes]
    client_id: str
    tiers: list[TierId] = field(default_factory=list)
    # Its Get (kvd.core.get_life), and the blocks it waits for others to read.
    life: GetLife | None = None
    waits: set = field(default_factory=set)
    # The read operations this request waits for (its own, another Get's, a prefetch's).
    wait_ops: set = field(default_factory=set)
    # Until when a starved Get may wait for write-back to make room.
    starved_deadline_us: int = 0
    waiting_write_back: bool = False
    hit_blocks: int = 0
    read_lease: int = 0
    write_lease: int = 0
    # (host slot, key) of each reserved block.
    reserved: list[tuple[int, bytes]] = field(default_factory=list)
    # A durable Put: the blocks it still waits for, the pins that hold
    # them meanwhile, why some are not durable, and when it began.
    durable: bool = False
    durable_pending: set = field(default_factory=set)
    durable_pins: list = field(default_factory=list)
    durable_failures: list = field(default_factory=list)
    durable_since_us: int = -1


class Clients:
    def __init__(self, world: World, drives: Drives, durable: DurablePuts) -> None:
        self.world = world
        self.drives = drives
        self.durable = durable
        seed = world.config.seed
        self.durability = random.Random(seed + 1)
        self.deletions = random.Random(seed + 2)
        self.prefetches = random.Random(seed + 3)
        self.unsettled: set[Flow] = set()  # Gets planned, not settled: each holds its own pins
        # Gets starved of host slots, waiting for a write-back batch.
        self.starved: list[Flow] = []
        self.ttft_us: list[int] = []

    # ------------------------------------------------------------------
    # The Get

    def arrive(self, request: Request) -> None:
        world = self.world
        config, timeline = world.config, world.timeline
        namespace_id = world.namespace_ids[request.tenant]
        keys = chain_keys(world.specs[request.tenant], request.prompt)
        flow = Flow(request, request.tenant, keys, f"client-{request.request_id}")
        flow.durable = self.drives.disk is not None and self.durability.random() < config.durable_share
        flow.starved_deadline_us = timeline.now_us + config.starved_get_wait_ms * 1000
        counters = world.expected.counters[request.tenant]
        matched = world.engine.lookup(namespace_id, keys)
        counters[0] += len(matched)
        counters[1] += len(keys) - len(matched)
        if self.drives.disk is not None and self.prefetches.random() < config.prefetch_share:
            self._prefetch(flow)
            timeline.schedule(timeline.now_us + config.prefetch_lead_ms * 1000, EventKind.GET, flow)
        else:
            self.begin_get(flow, final=False)

    def _prefetch(self, flow: Flow) -> None:
        """A router's Prefetch, planned by the mover: PREFETCH read jobs behind restores."""
        world = self.world
        plan, jobs = world.mover.prefetch(world.namespace_ids[flow.namespace], flow.keys)
        world.stats.prefetched_blocks += len(plan.loads)
        self.drives.prefetch(jobs)

    def begin_get(self, flow: Flow, *, final: bool) -> None:
        """The Get planned, as the daemon's is (kvd.core.get_life): a plan starved of host slots
        by blocks waiting for write-back waits for the next write round, until
        `starved_get_wait_ms` has passed; then it takes what it can."""
        world = self.world
        engine = world.engine
        namespace_id = world.namespace_ids[flow.namespace]
        keys = flow.keys
        # What a lookup would see now, without its side effects.
        matched = engine.namespace(namespace_id).index.match(keys)
        flow.tiers = [engine.tier_of(block) for block in matched]
        if flow.life is None:
            flow.life = GetLife(engine, world.mover, flow.starved_deadline_us)
        life = flow.life
        try:
            phase = life.begin(KeysRequest(namespace_id, flow.client_id, keys, world.config.lease_ms,
                                           world.timeline.clock.now_ms()), world.timeline.now_us, final=final)
        except ResourceExhausted:
            life.cancel()
            world.stats.get_refused += 1
            self.settle(flow)
            return
        if phase is GetPhase.WAITING_FOR_ROOM:  # what it took and counted is given back
            flow.waiting_write_back = True
            self.starved.append(flow)
            world.timeline.schedule(flow.starved_deadline_us, EventKind.STARVED_TIMEOUT, flow)
            return
        counters = world.expected.counters[flow.namespace]
        counters[2] += len(matched)
        counters[3] += len(keys) - len(matched)
        plan = life.plan
        # begin_get sees the index as it is at this instant, cut at most (no
        # host slot for a disk block, or a block the policy keeps on disk).
        check([block.key for block in plan.matched] == [block.key for block in matched[: len(plan.matched)]],
              "begin_get matched another prefix than the index holds")
        self.unsettled.add(flow)
        if plan.lease is not None:
            world.expected.leases[plan.lease.lease_id] = plan.lease.deadline_ms
            flow.read_lease = plan.lease.lease_id
        self.drives.start_get_reads(flow)
        if not flow.wait_ops:
            self.settle(flow)

    def starved_timeout(self, flow: Flow) -> None:
        if flow.waiting_write_back:
            # Waited long enough: one last try, served with what it gets.
            self.starved.remove(flow)
            flow.waiting_write_back = False
            self.begin_get(flow, final=True)

    def retry_starved(self) -> None:
        """Starved Gets try again once a round is on disk (after its demotions: kvd.core.get_life)."""
        if self.starved:
            waiting, self.starved = self.starved, []
            for flow in waiting:
                flow.waiting_write_back = False
                self.begin_get(flow, final=False)

    def read_done(self, flow: Flow, operation: DiskOp, outcomes: list[LoadOutcome]) -> None:
        """A read the Get waited for ended: its blocks' outcomes told; settled once none is left."""
        flow.wait_ops.discard(operation.op_id)
        for load, outcome in zip(operation.loads, outcomes):
            if load.block in flow.waits:
                flow.life.wait_done(load.block, outcome)
        if not flow.wait_ops:
            self.settle(flow)

    def settle(self, flow: Flow) -> None:
        """The Get is served (what could be); then the rest is reserved."""
        world = self.world
        stats = world.stats
        request = flow.request
        served = self._served(flow)
        flow.hit_blocks = len(served)
        served_tiers = flow.tiers[: len(served)]
        host_hits = served_tiers.count(TierId.HOST)
        middle_hits = served_tiers.count(MIDDLE_TIER)
        stats.requests += 1
        stats.prompt_tokens += len(request.prompt)
        stats.prompt_blocks += len(flow.keys)
        stats.host_hit_blocks += host_hits
        stats.middle_hit_blocks += middle_hits
        stats.disk_hit_blocks += len(served) - host_hits - middle_hits
        stats.miss_blocks += len(flow.keys) - len(served)
        self._reserve(flow)
        if request.client_crashes:
            # Dies holding its leases; they expire.
            stats.clients_crashed += 1
            return
        missing_tokens = len(request.prompt) - flow.hit_blocks * world.config.block_tokens
        prefill_us = int(missing_tokens * 1_000_000 / world.config.prefill_tokens_per_s)
        world.timeline.schedule(world.timeline.now_us + prefill_us, EventKind.PREFILL_DONE, flow)

    def _served(self, flow: Flow) -> list[Block]:
        """The blocks the Get serves, checked against the fake bytes; none if it never read."""
        life = flow.life
        if life is None or life.phase is not GetPhase.READING:
            return []
        stats = self.world.stats
        # Nothing, if the lease ran out while the loads were queued (kvd.core.get_life).
        answer = life.settle()
        self.unsettled.discard(flow)
        self.world.contents.check_served(answer.blocks)
        if life.plan.lease is None and flow.read_lease:
            del self.world.expected.leases[flow.read_lease]  # cut to nothing: closed
            flow.read_lease = 0
        if len(answer.blocks) < len(flow.tiers):
            stats.get_starved += 1
        if answer.cut == GetCut.CORRUPT:
            stats.get_cut_corrupt += 1
        return answer.blocks

    # ------------------------------------------------------------------
    # The Put

    def _reserve(self, flow: Flow) -> None:
        world = self.world
        stats = world.stats
        keys = flow.keys
        namespace_id = world.namespace_ids[flow.namespace]
        try:
            result = world.engine.reserve(KeysRequest(namespace_id, flow.client_id, keys, world.config.lease_ms,
                                                      world.timeline.clock.now_ms()))
        except ResourceExhausted as refusal:
            stats.put_refused += 1
            stats.quota_refused += isinstance(refusal, QuotaExceeded)
            return
        stats.put_reserved += result.statuses.count(ReserveStatus.RESERVED)
        stats.put_in_flight += result.statuses.count(ReserveStatus.IN_FLIGHT)
        stats.put_no_space += result.statuses.count(ReserveStatus.NO_SPACE)
        if result.lease is not None:
            world.expected.leases[result.lease.lease_id] = result.lease.deadline_ms
            flow.write_lease = result.lease.lease_id
            flow.reserved = [(slot, key) for key, slot in zip(keys, result.slots) if slot != NO_SLOT]

    def prefill_done(self, flow: Flow) -> None:
        world = self.world
        leases = world.expected.leases
        if flow.write_lease in leases:
            self._commit(flow)
            if flow.durable:
                self.durable.wait(flow)
        if flow.read_lease in leases:
            world.engine.release(flow.client_id, [flow.read_lease])
            del leases[flow.read_lease]
        now_us = world.timeline.now_us
        self.ttft_us.append(now_us - flow.request.arrival_us)
        reply_us = len(flow.request.reply) * world.config.decode_us_per_token
        world.timeline.schedule(now_us + reply_us, EventKind.DECODE_DONE, flow)

    def decode_done(self, flow: Flow) -> None:
        """Store the reply's full blocks too: a chat's next turn starts with them."""
        request = flow.request
        spec = self.world.specs[request.tenant]
        tokens = np.concatenate([request.prompt, request.reply])
        done = len(flow.keys) * spec.block_tokens
        parent = flow.keys[-1] if flow.keys else None
        flow.keys = flow.keys + chain_keys(spec, tokens[done:], parent=parent)
        flow.write_lease = 0
        self._reserve(flow)
        if flow.write_lease:
            self._commit(flow)
        if self.deletions.random() < self.world.config.delete_share:
            self._delete_reply(flow, done // spec.block_tokens)

    def _delete_reply(self, flow: Flow, prompt_blocks: int) -> None:
        """The client Deletes its reply's blocks (the chain from the first of
        them, and whatever hangs under it); as the daemon's Delete, their
        removals are journalled at once."""
        if len(flow.keys) <= prompt_blocks:
            return
        world = self.world
        engine = world.engine
        namespace_id = world.namespace_ids[flow.namespace]
        first = flow.keys[prompt_blocks]
        deleted, pinned = engine.delete(namespace_id, [first])
        world.stats.deleted_blocks += deleted
        world.stats.deletes_pinned += pinned
        check(pinned or engine.namespace(namespace_id).index.get(first) is None, "a Delete left its block")
        if self.drives.disk is not None and engine.disk.pool.removals:
            self.drives.journal(world.mover.take_removals(), None)

    def _commit(self, flow: Flow) -> None:
        """The writer filled its reserved slots: seal them all."""
        world = self.world
        engine = world.engine
        # The client wrote into these slots all along, so they must still be
        # its blocks': a slot handed to another block meanwhile would hold
        # the bytes of two blocks at once.
        owners = engine.host.pool.owners
        for slot, key in flow.reserved:
            owner = owners[slot]
            check(owner is not None and owner.key == key,
                  f"host slot {slot} was reserved for a writer still writing it, and now belongs to {owner!r}")
        world.contents.fill([key for _, key in flow.reserved], [slot for slot, _ in flow.reserved])
        sealed, aborted, _ = engine.commit(CommitRequest(world.namespace_ids[flow.namespace], flow.client_id,
                                                      flow.write_lease, world.timeline.clock.now_ms()))
        check((sealed, aborted) == (len(flow.reserved), 0), f"commit sealed {sealed} and aborted {aborted}")
        del world.expected.leases[flow.write_lease]
