"""One-sided reads between daemons' arenas with NIXL (UCX backend).

One agent per daemon process, named `<node>-<incarnation>`, with NIXL's
progress thread off (it burns a core idle on small machines, FIELD-NOTES):
every agent call runs on one dedicated thread of this module, so the agent
is never entered by two threads at once, and the event loop only awaits.

Grants. The member record (in etcd) carries only the agent's connection
metadata: no address, no memory key. The host arena is registered as the
destination of this node's own READs, and its metadata never leaves the
process. What a peer may READ is granted per tenant: the holder registers a
mapping of one tenant's arena file alone (HostArena.tenant_view: that
tenant's blocks at their offsets, zeros elsewhere) and hands its metadata
over in the PinBlocks answer, on the authenticated node-to-node channel, to
a member that asked for that tenant's blocks. A peer's agent refuses a READ
outside the regions it was granted (NIXL_ERR_NOT_FOUND). docs/CLUSTER.md
says what this does and does not hold against (the threat model).

Progress. A READ over UCX's TCP transport needs the *holder* to make
progress too, so while a peer holds pins here (`serving`) a task drives the
agent every millisecond; over shared memory (CMA) the reader's transfer
call does all the work. Connections are made when a peer joins, while both
sides make progress.

Deadlines. NIXL reports nothing for a READ across a cut link (FIELD-NOTES),
so `read` polls against its own deadline and, past it, releases the
transfer handle (which cancels it) and reports failure: the caller then
aborts the reserved slots, and the blocks are misses. A release that fails
leaves a READ that may still write into those slots: `read` then also
returns a future, done once the agent reports the transfer over (polled
with the agent's progress) or its peer is removed, and until then the
caller keeps the slots out of use.

Fabric. On a host with an RDMA device (InfiniBand or RoCE: an entry under
/sys/class/infiniband) UCX may use it, and READs go over RDMA. On a host
without one, UCX's InfiniBand modules are kept from loading
(UCX_MODULES=^ib,rdmacm, unless the operator set UCX_MODULES): the wheel's
bundled libnl crashes in its exit destructor there, turning every daemon
exit into SIGSEGV. `fabric()` says which of the two this host is.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

log = logging.getLogger("kvd.cluster")

PROGRESS_INTERVAL_S = 0.001
RDMA_CLASS = Path("/sys/class/infiniband")
NO_RDMA_MODULES = "^ib,rdmacm"


def rdma_devices(root: Path = RDMA_CLASS) -> list[str]:
    """The host's RDMA devices (InfiniBand HCAs and RoCE NICs alike register here)."""
    try:
        return sorted(entry.name for entry in root.iterdir())
    except OSError:
        return []


def fabric(root: Path = RDMA_CLASS, environ: dict[str, str] | None = None) -> str:
    """"rdma" when UCX may use an RDMA device of this host, else "tcp" (TCP, or shared memory
    between daemons on one host)."""
    environ = os.environ if environ is None else environ
    excluded = environ.get("UCX_MODULES", "").startswith("^") and "ib" in environ["UCX_MODULES"][1:].split(",")
    return "rdma" if rdma_devices(root) and not excluded else "tcp"


def keep_rdma_modules_out_without_a_device(root: Path = RDMA_CLASS, environ=None) -> None:
    """Before NIXL loads: UCX's InfiniBand modules stay out on a host with no RDMA device (see the
    module's docstring), unless the operator set UCX_MODULES."""
    environ = os.environ if environ is None else environ
    if not rdma_devices(root):
        environ.setdefault("UCX_MODULES", NO_RDMA_MODULES)


def nixl_available() -> bool:
    keep_rdma_modules_out_without_a_device()
    try:
        import nixl._api  # noqa: F401
    except ImportError:
        return False
    return True


class NixlTransport:
    def __init__(self, node: str, incarnation: int, arena_address: int, arena_bytes: int, agent=None,
                 spawn: Callable[..., asyncio.Task] = asyncio.create_task) -> None:
        """`agent`: a NIXL agent's stand-in (tests); by default a UCX agent of its own. `spawn` runs
        the progress task (the daemon's supervisor: an agent that fails there stops kvd loudly)."""
        self._spawn = spawn
        self.name = f"{node}-{incarnation}"
        self.fabric = fabric()
        self.arena_address = arena_address
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvd-nixl")
        if agent is None:
            from nixl._api import nixl_agent, nixl_agent_config

            config = nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
            agent = self._thread.submit(nixl_agent, self.name, config).result()
        self.agent = agent
        # The destination of this node's READs: registered, never described to anyone.
        self._registration = self._thread.submit(
            self.agent.register_memory, [(arena_address, arena_bytes, 0, "")], "DRAM").result()
        # What the member record carries: how to connect, and no memory at all.
        self.metadata: bytes = self._thread.submit(self._partial_metadata, [], True).result()
        # Regions granted to peers (address -> its registration and metadata), made on first use.
        self._grants: dict[int, asyncio.Future] = {}
        # Grants this node's agent has loaded, by peer.
        self._loaded: dict[str, set[bytes]] = {}
        self._peers: dict[str, str] = {}
        self._serving = 0
        # READs whose handle could not be released while they ran, by peer: each with the future
        # that says it can write no more (the agent reported it over, or its peer was removed).
        self._uncancelled: dict[str, list[tuple[object, asyncio.Future]]] = {}
        self._progress: asyncio.Task | None = None
        self.reads = 0
        self.failed_reads = 0

    async def _call(self, function, *args):
        return await asyncio.get_running_loop().run_in_executor(self._thread, function, *args)

    def _partial_metadata(self, regions: list[tuple[int, int]], connection: bool) -> bytes:
        """Agent thread: the metadata of exactly `regions` (each registered as one region), with
        the connection's or without."""
        rows = np.array([(address, length, 0) for address, length in regions], dtype=np.uint64).reshape(-1, 3)
        return self.agent.get_partial_agent_metadata(self._reg_descs(rows), connection, ["UCX"])

    def _reg_descs(self, rows: np.ndarray):
        """The agent's registration descriptors of `rows` (address, length, device). NIXL's own
        get_reg_descs cannot make an empty list, which connection-only metadata needs: a NIXL
        agent's is built from its memory types (a test's stand-in has none and makes its own)."""
        if len(rows) or not hasattr(self.agent, "nixl_mems"):
            return self.agent.get_reg_descs(rows, "DRAM")
        from nixl._api import nixlBind
        return nixlBind.nixlRegDList(self.agent.nixl_mems["DRAM"], rows)

    async def grant(self, address: int, length: int) -> bytes:
        """The metadata a peer needs to READ [address, address + length) and nothing else: the
        region registered on its own (once, until close)."""
        granted = self._grants.get(address)
        if granted is None:
            granted = self._grants[address] = asyncio.ensure_future(self._register_grant(address, length))
        try:
            return (await asyncio.shield(granted))[1]
        except Exception:
            if self._grants.get(address) is granted:
                del self._grants[address]  # the next PinBlocks tries again
            raise

    async def _register_grant(self, address: int, length: int):
        registration = await self._call(self.agent.register_memory, [(address, length, 0, "")], "DRAM")
        return registration, await self._call(self._partial_metadata, [(address, length)], False)

    def has_peer(self, node: str) -> bool:
        return node in self._peers

    async def add_peer(self, node: str, metadata: bytes) -> None:
        if not metadata:
            return
        try:
            name = await self._call(self.agent.add_remote_agent, metadata)
        except Exception as error:  # NIXL raises its own error types; a bad peer must not stop us
            log.warning("NIXL peer not added", extra={"node": node, "reason": str(error)})
            return
        self._peers[node] = name.decode() if isinstance(name, bytes) else name

    async def remove_peer(self, node: str) -> None:
        name = self._peers.pop(node, None)
        self._loaded.pop(node, None)
        if name is not None:
            try:
                await self._call(self.agent.remove_remote_agent, name)
            except Exception as error:
                log.warning("NIXL peer not removed", extra={"node": node, "reason": str(error)})
        # With its peer gone, an uncancelled READ from it has nothing left to read.
        for _, over in self._uncancelled.pop(node, []):
            if not over.done():
                over.set_result(None)

    def serving(self, change: int) -> None:
        """Pins held for peers went up or down: keep the agent progressing while any are."""
        self._serving = max(0, self._serving + change)
        self._keep_progressing()

    def _keep_progressing(self) -> None:
        if (self._serving or self._uncancelled) and (self._progress is None or self._progress.done()):
            self._progress = self._spawn(self._progress_while_needed(), name="nixl-progress")

    async def _progress_while_needed(self) -> None:
        """Drive the agent while peers hold pins here or READs that could not be cancelled run."""
        while self._serving or self._uncancelled:
            await self._call(self.agent.get_new_notifs)
            for node, reads in list(self._uncancelled.items()):
                self._uncancelled[node] = [read for read in reads if not await self._over(node, *read)]
                if not self._uncancelled[node]:
                    del self._uncancelled[node]
            await asyncio.sleep(PROGRESS_INTERVAL_S)

    async def _over(self, node: str, handle, over: asyncio.Future) -> bool:
        """Whether an uncancelled READ has ended (then its handle is released and `over` done)."""
        try:
            state = await self._call(self.agent.check_xfer_state, handle)
        except Exception:  # the agent no longer knows it: nothing of it runs
            state = "ERR"
        if state == "PROC":
            return False
        with contextlib.suppress(Exception):
            await self._call(self.agent.release_xfer_handle, handle)
        log.info("NIXL read that could not be cancelled has ended", extra={"node": node, "state": state})
        if not over.done():
            over.set_result(None)
        return True

    async def read(self, node: str, local_addresses: list[int], remote_addresses: list[int], length: int,
                   timeout_s: float, grant: bytes) -> tuple[bool, asyncio.Future | None]:
        """READ `length` bytes at each remote address into the local one, inside the region `grant`
        describes (the holder's PinBlocks answer): (whether all arrived in time, None or a future:
        the READ could not be cancelled and may write into the local addresses until the future
        is done)."""
        peer = self._peers.get(node)
        if peer is None or not local_addresses:
            return False, None
        deadline = time.monotonic() + timeout_s
        handle, state = None, "ERR"
        try:
            await self._load_grant(node, grant)
            handle = await self._call(self._start_read, peer, local_addresses, remote_addresses, length)
            state = await self._call(self.agent.transfer, handle)
            while state == "PROC" and time.monotonic() < deadline:
                await asyncio.sleep(PROGRESS_INTERVAL_S)
                state = await self._call(self.agent.check_xfer_state, handle)
        except Exception as error:
            log.warning("NIXL read failed", extra={"node": node, "reason": str(error)})
            state = "ERR"
        finally:
            running = await self._release(node, handle, state) if handle is not None else None
        self.reads += 1
        if state != "DONE":
            self.failed_reads += 1
            return False, running
        return True, None

    async def _load_grant(self, node: str, grant: bytes) -> None:
        """Make a holder's grant known to the agent (once per peer: a region's metadata does not
        change while its holder runs). An empty grant comes from a holder of before grants, whose
        member record described its whole arena."""
        loaded = self._loaded.setdefault(node, set())
        if grant and grant not in loaded:
            await self._call(self.agent.add_remote_agent, grant)
            loaded.add(grant)

    async def _release(self, node: str, handle, state: str) -> asyncio.Future | None:
        """Release a READ's handle (which cancels it if it still runs); a future when it could not
        be and the READ may still write (see `read`)."""
        try:
            await self._call(self.agent.release_xfer_handle, handle)
            return None
        except Exception as error:
            log.error("NIXL transfer could not be cancelled; its slots stay out of use until it ends",
                      extra={"node": node, "state": state, "reason": str(error)})
        if state == "DONE":
            return None  # it wrote all it will
        over = asyncio.get_running_loop().create_future()
        self._uncancelled.setdefault(node, []).append((handle, over))
        self._keep_progressing()
        return over

    def _start_read(self, peer: str, local: list[int], remote: list[int], length: int):
        def descs(addresses: list[int]):
            rows = np.zeros((len(addresses), 3), dtype=np.uint64)
            rows[:, 0] = addresses
            rows[:, 1] = length
            return self.agent.get_xfer_descs(rows, "DRAM")
        return self.agent.initialize_xfer("READ", descs(local), descs(remote), peer)

    async def close(self) -> None:
        self._serving = 0
        for reads in self._uncancelled.values():
            for _, over in reads:
                if not over.done():
                    over.set_result(None)  # the daemon stops: its slots go with it
        self._uncancelled.clear()
        for node in list(self._peers):
            await self.remove_peer(node)
        registrations = [self._registration]
        for granted in self._grants.values():
            if granted.done() and not granted.cancelled() and granted.exception() is None:
                registrations.append(granted.result()[0])
        self._grants.clear()
        for registration in registrations:
            try:
                await self._call(self.agent.deregister_memory, registration)
            except Exception as error:
                log.warning("NIXL deregistration failed", extra={"reason": str(error)})
        self._thread.shutdown(wait=True)
