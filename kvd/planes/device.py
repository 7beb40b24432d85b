"""The daemon's device plane: engines' paged KV pools registered with kvd, and the saves and loads
kvd drives between them and the arena (docs/GPU.md; the RPCs are RegisterPool, UnregisterPool,
SaveLayers and LoadLayers).

A registration names one IPC handle per layer of the namespace and one for the pool's flag words.
kvd opens each handle once per process (the device counts references, so two registrations of one
allocation share a mapping), checks the device and the layout against the namespace, and gives
the pool a stream of its own, so one pool's transfers run in order and never wait behind
another's. A pool lives until its engine unregisters it or leaves it unused for its lease; then
its stream is drained before its mappings are closed, so no copy ever touches an unmapped page.

Flag words live in CPU-device memory, host memory both processes map (a GPU engine registers it
with cudaHostRegister so its stream stores to it with cuStreamWriteValue64). For a save, the
daemon watches the engine's word from the host and issues a layer's copy only once the layer is
written: a stream is never left waiting on an engine that stopped, and a timeout costs nothing
but the save.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvd.device import Device, DeviceError, IpcHandle, Memory, Stream
from kvd.device.cpu import CpuDevice, read_flag, store_flag
from kvd.device.transfer import FAILED, PoolLayout, save_layers
from kvd.planner.distance import NONE
from kvd.planes.device_loads import LayerLoad, issue_now, load_sources
from kvd.planes.device_ring import PoolRing, RingLoad, ring_answer, settle_load
from kvd.planes.device_tier import DeviceTier
from kvd.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from kvd.invariants import check

log = logging.getLogger(__name__)

MAX_POOL_BLOCKS = 1 << 31
_POLL_MAX_S = 0.0005


# Descriptors deposited over the arena socket wait this long for the RegisterPool that names them.
DEPOSIT_TTL_S = 60.0
MAX_DEPOSITS = 256
# Descriptors all waiting deposits may hold together: a client cannot run the daemon out of them.
MAX_DEPOSITED_FDS = 4096
DEPOSIT_PREFIX = b"deposit:"


@dataclass(slots=True)
class Deposit:
    """Descriptors an engine passed over the arena socket (SCM_RIGHTS) for one RegisterPool."""

    tenant: str
    fds: list[int]
    deadline: float  # time.monotonic()


@dataclass(slots=True)
class Pool:
    pool_id: int
    client_id: str
    namespace_id: bytes
    device: Device            # the device its memory is on (its plane)
    arena: Memory             # the arena as that device addresses it
    layout: PoolLayout
    flags: Memory             # the flag words, as the host reads them
    flags_on_device: Memory   # the same words as the device's streams store to them
    stream: Stream
    lease_ms: int
    deadline_ms: int
    opened: list[Memory] = field(default_factory=list)
    tenant: str = ""
    ring: PoolRing | None = None  # with io_ring: disk hits read through the engine's I/O ring
    busy: int = 0             # transfers issued and not yet drained
    closing: bool = False
    idle: asyncio.Event = field(default_factory=asyncio.Event)  # set whenever busy is 0

    def __post_init__(self) -> None:
        self.idle.set()

    def begin(self) -> None:
        """A transfer starts: the pool stays mapped until its end(). NotFound once the pool is
        going (its lease ran out, or it was unregistered, while the transfer's call waited)."""
        if self.closing:
            raise NotFound(f"pool {self.pool_id} was unregistered while the transfer waited (its lease ran out, or "
                           "its engine unregistered it); register the pool again")
        self.busy += 1
        self.idle.clear()

    def end(self) -> None:
        check(self.busy > 0, "a pool transfer ended twice")
        self.busy -= 1
        if not self.busy:
            self.idle.set()

    @property
    def flag_words(self) -> int:
        return self.flags.nbytes // 8


class DevicePlane:
    """One device plane per device it serves (a GPU each, by UUID): a pool goes to the device its
    memory is on, with the arena registered for that device; the device tier lives on the first."""

    def __init__(self, devices: Device | Sequence[Device], arena_address: int, arena_bytes: int, max_pools: int,
                 pool_lease_ms: int, flag_timeout_ms: int, host: CpuDevice | None = None,
                 tier: DeviceTier | None = None) -> None:
        devices = [devices] if isinstance(devices, Device) else list(devices)
        check(bool(devices) and len({device.uuid for device in devices}) == len(devices),
              "a device plane serves distinct devices")
        self.device = devices[0]
        self.devices = {device.uuid: device for device in devices}
        self.tier = tier
        self.saved_blocks = self.loaded_blocks = 0
        # Loads whose layers went to the engine as they landed from disk, by how they ended.
        self.disk_loads = {"landed": 0, "failed": 0}
        # Loads read through pools' I/O rings, by whether every read was verified.
        self.ring_loads = {"verified": 0, "failed": 0}
        self.host = host if host is not None else (self.device if isinstance(self.device, CpuDevice) else CpuDevice())
        # Flag words come from the CPU device of the engine's host side: the CPU devices served, or `host`.
        self.hosts = {uuid: device for uuid, device in self.devices.items() if isinstance(device, CpuDevice)} \
            or {self.host.uuid: self.host}
        self.arenas = self._register_arena(arena_address, arena_bytes)
        self.max_pools = max_pools
        self.pool_lease_ms = pool_lease_ms
        self.flag_timeout_s = flag_timeout_ms / 1000.0
        self.pools: dict[int, Pool] = {}
        self.deposits: dict[str, Deposit] = {}
        self._ids = itertools.count(1)
        self._drains: set[asyncio.Task] = set()
        # Where a failed transfer task goes (the daemon's supervisor: kvd stops loudly).
        self.on_bug: Callable[[str, BaseException], None] | None = None

    def _registers_arena(self, device: Device) -> bool:
        """Whether `device` holds a registration of the arena of its own. A CUDA registration is
        portable (every device's context sees it), so the first device's serves every GPU; the CPU
        device's only records the range, each its own."""
        return device is self.device or device.kind != "cuda"

    def _register_arena(self, address: int, nbytes: int) -> dict[str, Memory]:
        """The arena as each device addresses it."""
        first = self.device.register_host(address, nbytes)
        return {uuid: first if device is self.device else device.register_host(address, nbytes)
                if self._registers_arena(device) else dataclasses.replace(first, device_uuid=uuid)
                for uuid, device in self.devices.items()}

    # ---------------------------------------------------------------- registration

    def register(self, request, num_layers: int, layer_bytes: int, now_ms: int, tenant: str = "",
                 ring_fds: list[int] | None = None) -> Pool:
        """A pool for the engine's memory; with request.io_ring, its I/O ring over the drives'
        segment files `ring_fds` (None: this kvd has no disk tier)."""
        if request.io_ring and ring_fds is None:
            raise FailedPrecondition("io_ring: this kvd has no disk tier to read through a ring ([disk] directories)")
        if len(self.pools) >= self.max_pools:
            raise ResourceExhausted(f"{len(self.pools)} pools are registered, the most [device] max_pools allows; "
                                    "unregister one first")
        if len(request.layers) != num_layers:
            raise InvalidArgument(f"layers: {len(request.layers)} IPC handles for a namespace of {num_layers} layers")
        if not 1 <= request.num_blocks <= MAX_POOL_BLOCKS:
            raise InvalidArgument(f"num_blocks must be in [1, {MAX_POOL_BLOCKS}], got {request.num_blocks}")
        try:
            shape = PoolLayout((Memory(1, 1 << 62, self.device.uuid),), layer_bytes, request.num_blocks,
                               request.page_stride_bytes, request.v_offset_bytes)
        except DeviceError as error:
            raise InvalidArgument(f"page_stride_bytes, v_offset_bytes: {error}") from None
        handles = [self._handle(f"layers[{i}]", data, shape.layer_bytes_needed(), self.devices)
                   for i, data in enumerate(request.layers)]
        device = self.devices[handles[0].device_uuid]
        if any(handle.device_uuid != device.uuid for handle in handles):
            raise InvalidArgument("layers: a pool's layers are memory of one device; these name "
                                  f"{sorted({handle.device_uuid for handle in handles})}")
        flags_handle = self._handle("flags", request.flags, 8, self.hosts)
        host = self.hosts[flags_handle.device_uuid]
        opened: list[Memory] = []
        flags_on_device = None
        ring = stream = None
        try:
            layers = [self._open(device, handle, name, opened, tenant) for name, handle in
                      ((f"layers[{i}]", h) for i, h in enumerate(handles))]
            flags = self._open(host, flags_handle, "flags", opened, tenant)
            flags = Memory(flags.address, flags.nbytes - flags.nbytes % 8, flags.device_uuid, flags.token)
            flags_on_device = flags if device is host else device.register_host(flags.address, flags.nbytes)
            layout = PoolLayout(tuple(layers), layer_bytes, request.num_blocks, shape.page_stride, shape.v_offset)
            ring = PoolRing(layout, device, ring_fds) if request.io_ring else None
            stream = device.stream()
        except BaseException:
            if ring is not None:
                ring.close()
            if flags_on_device is not None and flags_on_device is not flags:
                device.unregister_host(flags_on_device)
            self._close_all(opened)
            raise
        for handle in (*handles, flags_handle):  # a deposit serves one registration
            if handle.handle.startswith(DEPOSIT_PREFIX):
                self._drop_deposit(handle.handle.split(b":")[1].decode())
        lease_ms = request.lease_ms or self.pool_lease_ms
        pool = Pool(next(self._ids), request.client_id, request.namespace_id, device, self.arenas[device.uuid], layout,
                    flags, flags_on_device, stream, lease_ms, now_ms + lease_ms, opened, tenant, ring)
        self.pools[pool.pool_id] = pool
        log.info("pool registered", extra={"pool_id": pool.pool_id, "client_id": pool.client_id,
                                           "layers": num_layers, "num_blocks": request.num_blocks,
                                           "device_uuid": device.uuid})
        return pool

    def _handle(self, name: str, data: bytes, least_bytes: int, devices: dict[str, Device]) -> IpcHandle:
        """The handle in `data`, of memory of one of `devices` (the device planes', or the flag words')."""
        try:
            handle = IpcHandle.from_bytes(data)
        except (DeviceError, ValueError) as error:
            raise InvalidArgument(f"{name}: not a kvd IPC handle ({error})") from None
        kind = next(iter(devices.values())).kind
        if handle.kind != kind:
            raise FailedPrecondition(f"{name} is memory of a {handle.kind!r} device; this kvd's "
                                     f"{'device plane' if devices is self.devices else 'flag words'} use "
                                     f"{kind!r}")
        if handle.device_uuid not in devices:
            raise FailedPrecondition(f"{name} is memory of device {handle.device_uuid}, not of this kvd's "
                                     f"{kind} devices {sorted(devices)} ([device] index and count)")
        if handle.nbytes < least_bytes:
            raise InvalidArgument(f"{name} holds {handle.nbytes} bytes, less than the {least_bytes} it must")
        return handle

    def _open(self, device: Device, handle: IpcHandle, name: str, opened: list[Memory], tenant: str) -> Memory:
        try:
            if handle.handle.startswith(DEPOSIT_PREFIX):
                memory = device.import_fd(self._deposited(handle.handle, name, tenant), handle.offset, handle.nbytes)
            else:
                memory = device.open(handle)
        except DeviceError as error:
            raise FailedPrecondition(f"{name}: {error}") from None
        opened.append(memory)
        return memory

    # ---------------------------------------------------------------- descriptors over the arena socket

    def deposit(self, tenant: str, fds: list[int]) -> dict:
        """Keep copies of `fds` (the caller closes its own) for a RegisterPool that names them as
        deposit:<ticket>:<index>; the arena socket's reply."""
        self._expire_deposits()
        if not fds:
            return {"ok": False, "code": "INVALID_ARGUMENT", "message": "a deposit passes at least one descriptor"}
        held = sum(len(deposit.fds) for deposit in self.deposits.values())
        if len(self.deposits) >= MAX_DEPOSITS or held + len(fds) > MAX_DEPOSITED_FDS:
            return {"ok": False, "code": "RESOURCE_EXHAUSTED",
                    "message": f"{len(self.deposits)} deposits ({held} descriptors) wait for their RegisterPool; "
                               f"at most {MAX_DEPOSITS} and {MAX_DEPOSITED_FDS} descriptors: register or wait"}
        ticket = secrets.token_hex(16)
        self.deposits[ticket] = Deposit(tenant, [os.dup(fd) for fd in fds], time.monotonic() + DEPOSIT_TTL_S)
        return {"ok": True, "ticket": ticket, "count": len(fds)}

    def _deposited(self, handle: bytes, name: str, tenant: str) -> int:
        """A new descriptor for deposit:<ticket>:<index> (the device's import_fd takes it over)."""
        try:
            _, ticket, index = handle.decode().split(":")
            deposit = self.deposits.get(ticket)
            fd = deposit.fds[int(index)] if deposit is not None and deposit.tenant == tenant else -1
        except (ValueError, IndexError):
            raise InvalidArgument(f"{name}: a deposit handle is deposit:<ticket>:<index>") from None
        if fd < 0 or time.monotonic() > deposit.deadline:
            raise FailedPrecondition(f"{name}: no deposit {ticket[:32]!r} of this tenant (used by another "
                                     f"RegisterPool, or older than {DEPOSIT_TTL_S:.0f} s)")
        return os.dup(fd)

    def _drop_deposit(self, ticket: str) -> None:
        deposit = self.deposits.pop(ticket, None)
        for fd in deposit.fds if deposit is not None else ():
            os.close(fd)

    def _expire_deposits(self) -> None:
        now = time.monotonic()
        for ticket in [t for t, deposit in self.deposits.items() if deposit.deadline < now]:
            self._drop_deposit(ticket)

    def _close_all(self, opened: list[Memory]) -> None:
        for memory in opened:
            (self.devices.get(memory.device_uuid) or self.hosts[memory.device_uuid]).close(memory)

    def pool(self, client_id: str, pool_id: int, namespace_id: bytes | None = None) -> Pool:
        pool = self.pools.get(pool_id)
        if pool is None or pool.client_id != client_id or pool.closing:
            raise NotFound(f"no pool {pool_id} registered by this client (unregistered, or its lease ran out)")
        if namespace_id is not None and pool.namespace_id != namespace_id:
            raise FailedPrecondition(f"pool {pool_id} holds another namespace's blocks")
        return pool

    def renew(self, pool: Pool, now_ms: int) -> None:
        pool.deadline_ms = now_ms + pool.lease_ms

    async def unregister(self, client_id: str, pool_id: int) -> None:
        await self._retire(self.pool(client_id, pool_id))

    async def sweep(self, now_ms: int) -> int:
        """Unregister the pools whose lease ran out (and drop stale deposits); returns how many pools."""
        self._expire_deposits()
        expired = [pool for pool in self.pools.values() if pool.deadline_ms <= now_ms and not pool.closing]
        for pool in expired:
            log.warning("pool lease ran out; unregistering it", extra={"pool_id": pool.pool_id, "client_id": pool.client_id})
            await self._retire(pool)
        return len(expired)

    async def _retire(self, pool: Pool) -> None:
        """Let the pool's transfers end (a save issuing copies ends within flag_timeout_ms), drain its stream,
        then close its mappings: no copy touches them after, and no transfer begins (Pool.begin)."""
        pool.closing = True
        await pool.idle.wait()
        try:
            await asyncio.to_thread(pool.stream.synchronize)
        except DeviceError as error:
            log.warning("pool stream failed before unregistering", extra={"pool_id": pool.pool_id,
                                                                          "error": str(error)})
        pool.stream.close()
        if pool.ring is not None:
            pool.ring.close()  # every ring load has settled: the pool was idle
        if pool.flags_on_device is not pool.flags:
            pool.device.unregister_host(pool.flags_on_device)
        self._close_all(pool.opened)
        self.pools.pop(pool.pool_id, None)

    async def close(self) -> None:
        for ticket in list(self.deposits):
            self._drop_deposit(ticket)
        for task in list(self._drains):
            await task
        for pool in list(self.pools.values()):
            await self._retire(pool)
        for uuid, device in self.devices.items():
            if self._registers_arena(device):
                device.unregister_host(self.arenas[uuid])
        if self.tier is not None:
            self.tier.close()

    def counters(self) -> dict[str, int]:
        """For the metrics: pools, blocks moved, and the device tier's state."""
        tier = self.tier
        return {"pools": len(self.pools), "saved_blocks": self.saved_blocks, "loaded_blocks": self.loaded_blocks,
                "disk_loads_landed": self.disk_loads["landed"], "disk_loads_failed": self.disk_loads["failed"],
                "ring_loads_verified": self.ring_loads["verified"], "ring_loads_failed": self.ring_loads["failed"],
                "tier_blocks": len(tier) if tier else 0, "tier_slots": tier.slot_count if tier else 0,
                "tier_hits": tier.hits if tier else 0, "tier_misses": tier.misses if tier else 0,
                "tier_evictions": tier.evictions if tier else 0, "tier_used_slots": tier.used_slots if tier else 0,
                "tier_host_layers": tier.host_layers if tier else 0}

    # ---------------------------------------------------------------- transfers

    def check_transfer(self, pool: Pool, keys, pages, flag_indexes: dict[str, int], base: int) -> np.ndarray:
        if base + len(pool.layout.layers) >= FAILED:
            raise InvalidArgument(f"base must be below 2**63 - {len(pool.layout.layers)} (the top bit marks a "
                                  "failed transfer)")
        if len(pages) != len(keys):
            raise InvalidArgument(f"pages: {len(pages)} for {len(keys)} keys")
        pages = np.asarray(pages, dtype=np.int64)
        if len(pages) and int(pages.max()) >= pool.layout.num_blocks:
            raise InvalidArgument(f"pages must be in [0, {pool.layout.num_blocks}), got {int(pages.max())}")
        for name, index in flag_indexes.items():
            if index >= pool.flag_words:
                raise InvalidArgument(f"{name} {index} is past the pool's {pool.flag_words} flag words")
        return pages

    async def save(self, pool: Pool, pages: np.ndarray, slot_offsets: list[int], engine_flag: int,
                   kvd_flag: int, base: int, keys=(), blocks=(), distance: int = NONE) -> int:
        """Copy the reserved blocks out of their pages, layer by layer as the engine writes them;
        returns the kvd flag value meaning every layer is out. With a device tier, `keys` and
        `blocks` (the index's Blocks being stored) get a copy there too: of the layers a plan at
        offload `distance` keeps on the device (NONE: all). DeadlineExceeded when a
        layer's flag did not come in time: kvd's flag is then set to that value anyway (it reads
        the pages no more) and nothing of the save may be committed."""
        done = base + len(pool.layout.layers)
        pool.begin()
        tier_entries, also = self._tier_places(pool, pages, keys, blocks, distance)
        copying = asyncio.ensure_future(asyncio.to_thread(self._save_now, pool, pages, slot_offsets, engine_flag,
                                                          kvd_flag, base, also))
        landed = False
        try:
            await asyncio.shield(copying)
            landed = True
        except asyncio.CancelledError:
            # The copies may still be writing the reserved slots: they end before the slots go back.
            await asyncio.wait({copying})
            raise
        finally:
            pool.end()
            if self._tier_of(pool) is not None:
                self.tier.settle(pool.namespace_id, keys, tier_entries, landed)
        self.saved_blocks += len(slot_offsets)
        return done

    def _tier_of(self, pool: Pool) -> DeviceTier | None:
        """The device tier, for pools on its device (the first): copies between GPUs stay out of it."""
        return self.tier if pool.device is self.device else None

    def _tier_places(self, pool: Pool, pages: np.ndarray, keys, blocks, distance: int) -> tuple[list, list]:
        """Device tier entries for a save's blocks (pinned), and the copy list that fills them."""
        if self._tier_of(pool) is None or not len(keys):
            return [], []
        layout = pool.layout
        entries = self.tier.place(pool.namespace_id, keys, blocks, layout.page_bytes, len(layout.layers), distance)
        placed = [i for i, entry in enumerate(entries) if entry is not None]
        if not placed:
            return entries, []
        return entries, [(self.tier.memory, pages[placed], np.stack([entries[i].offsets for i in placed]))]

    def _save_now(self, pool: Pool, pages, slot_offsets, engine_flag: int, kvd_flag: int, base: int,
                  also) -> None:
        deadline = time.monotonic() + self.flag_timeout_s

        def written(layer: int) -> None:
            self._wait_flag(pool.flags, engine_flag, base + layer + 1, deadline, layer)

        done = base + len(pool.layout.layers)
        try:
            save_layers(pool.stream, pool.layout, pages, pool.arena, slot_offsets, pool.flags_on_device,
                        pool.flags_on_device, kvd_flag, base, written=written, engine_flag_index=engine_flag,
                        also=also)
            pool.stream.synchronize()
        except DeadlineExceeded:
            pool.stream.synchronize()  # the layers already issued land before the slots are given back
            store_flag(pool.flags, kvd_flag, FAILED | done)  # kvd reads the pages no more
            raise
        except DeviceError as error:
            store_flag(pool.flags, kvd_flag, FAILED | done)
            raise FailedPrecondition(f"copying out of the pool failed: {error}") from None

    @staticmethod
    def _wait_flag(flags: Memory, index: int, value: int, deadline: float, layer: int) -> None:
        pause = 0.0
        while read_flag(flags, index) < value:
            if time.monotonic() >= deadline:
                raise DeadlineExceeded(f"the engine's flag word {index} did not reach {value} (layer {layer} "
                                       f"written) within [device] flag_timeout_ms; nothing was stored")
            time.sleep(pause)
            pause = min(_POLL_MAX_S, pause * 2 or 0.00002)

    def load(self, pool: Pool, pages: np.ndarray, keys, blocks, slot_offsets: list[int], kvd_flag: int, base: int,
             on_landed, reading: tuple[asyncio.Queue, asyncio.Future] | None = None,
             cancelled=None) -> tuple[int, list[bool]]:
        """Issue the per-layer scatter of `blocks` (pinned by the caller, in the arena at
        slot_offsets; from the device tier where it holds them) into the pages; `on_landed()` runs
        on the loop once every copy landed or the stream failed. Returns flags[kvd_flag]'s final
        value, and which blocks came from the device tier. `reading`: (the disk reads' on_layer
        steps, the Get's task): each layer is issued as it lands (kvd.planes.device_loads).
        `cancelled()`: whether the engine cancelled (device_loads.cancel_word)."""
        pool.begin()
        tier = self._tier_of(pool)
        entries = tier.find(pool.namespace_id, keys, blocks) if tier is not None else []

        def landed() -> None:
            if tier is not None:
                tier.unpin(pool.namespace_id, keys, entries)
            on_landed()

        sources = load_sources(pool, self.tier, pages, slot_offsets, entries)
        if reading is None:
            try:
                done, ending = issue_now(pool, sources, kvd_flag, base, landed, cancelled)
            except BaseException:
                pool.end()
                if tier is not None:
                    tier.unpin(pool.namespace_id, keys, entries)
                raise
        else:
            as_read = LayerLoad(pool, sources, kvd_flag, base, len(blocks), *reading, cancelled=cancelled)
            done, ending = as_read.done, self._count_disk_load(as_read.run(landed))
        self.loaded_blocks += len(blocks)
        self.spawn(ending)
        return done, [entry is not None for entry in entries] or [False] * len(blocks)

    def load_by_ring(self, pool: Pool, pages: np.ndarray, places, on_settled, on_bad_reads) -> RingLoad:
        """Grant the reads of blocks only on disk (at `places`: kvd.tiers.disk.reads.Places) into
        `pages` through the pool's ring, for the engine to publish; `on_settled()` runs once every
        grant was read, or revoked at [device] flag_timeout_ms (a read taken by then finished);
        then `on_bad_reads(positions)` for blocks whose read failed (device_ring.settle_load)."""
        pool.begin()
        try:
            load = pool.ring.grant(pages, places.files, places.offsets, places.checksums)
        except BaseException:
            pool.end()
            raise
        self.loaded_blocks += len(pages)
        self.spawn(settle_load(pool, load, time.monotonic() + self.flag_timeout_s, self.ring_loads, on_settled,
                                on_bad_reads))
        return load

    def ring_fd(self, tenant: str, token: str) -> tuple[dict, int]:
        """The arena socket's answer to {"op": "ring"} (kvd.planes.device_ring.ring_answer)."""
        return ring_answer(self.pools.values(), tenant, token)

    async def _count_disk_load(self, running) -> None:
        self.disk_loads["landed" if await running else "failed"] += 1

    def spawn(self, work) -> None:
        """A task that ends a transfer (kept until done; a bug in it goes to the supervisor)."""
        task = asyncio.get_running_loop().create_task(work)
        self._drains.add(task)
        task.add_done_callback(self._transfer_ended)

    def _transfer_ended(self, task: asyncio.Task) -> None:
        self._drains.discard(task)
        if not task.cancelled() and task.exception() is not None and self.on_bug is not None:
            self.on_bug("a device transfer's completion", task.exception())
