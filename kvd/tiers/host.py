"""The host tier's bytes: a preallocated arena of slots in memfd files.

    daemon's view (one contiguous mapping, slot s at s * slot_bytes)
    +----------+----------+----------+-----+--------------+
    | slot 0   | slot 1   | slot 2   | ... | slot n-1     |   each slot_bytes,
    +----------+----------+----------+-----+--------------+   4 KiB aligned
         |          |          |
      tenant A   tenant B   tenant A     <- which memfd backs the slot
      file @0    file @1*sb file @2*sb      (at the same offset in every file)

A block occupies the first block_bytes of one slot, layer-major
([layer 0: K V][layer 1: K V]...).

There is no name in /dev/shm: the arena lives in anonymous memfd files, and
a co-located client gets a file descriptor for it over the daemon's arena
socket (kvd.server.arena_socket), which hands one out only to a client that
authenticates. So the arena is as private as the token, whatever the
client's uid, and nothing of it outlives the daemon and its clients.

Isolation between tenants (`per_tenant=True`, auth.mode = "token"): every
tenant has a file of its own, as large as the arena and sparse, and a slot
is backed by the file of the tenant whose block it holds. When the engine
gives a slot to a block of another tenant (`claim`), the daemon maps the
new tenant's file over that slot (mmap MAP_FIXED, same offset) and punches
the slot out of the previous tenant's file: that tenant's clients now read
zeros there, and never the new tenant's bytes, which are in a file they
were never given. Slots nobody has claimed yet are backed by a spare file.
Without tenants there is one file, and `claim` is never called.

Which slot holds which block is decided by the engine (the host tier's
kvd.core.slot_pool.SlotPool); this module only creates, maps, pre-faults and re-backs the
slots, and copies bytes for the inline (non-shared-memory) path.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import mmap
import os
import secrets
from dataclasses import dataclass

import numpy as np

from kvd.invariants import check

log = logging.getLogger(__name__)

PAGE_BYTES = 4096
SLOT_ALIGN_BYTES = 4096
# The tenant of a daemon without auth (and of namespaces that have none).
DEFAULT_TENANT = ""

# Linux constants the mmap and os modules do not export (x86-64 and arm64 agree).
_MAP_FIXED = 0x10
_MADV_POPULATE_WRITE = 23
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_MAP_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.fallocate.restype = ctypes.c_int
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
_libc.madvise.restype = ctypes.c_int
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def _fallocate(fd: int, mode: int, offset: int, length: int) -> None:
    if _libc.fallocate(fd, mode, offset, length) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"fallocate: {os.strerror(error)}")


@dataclass(frozen=True, slots=True)
class ArenaLayout:
    slot_bytes: int
    slot_count: int

    @property
    def arena_bytes(self) -> int:
        return self.slot_bytes * self.slot_count

    @staticmethod
    def from_capacity(capacity_bytes: int, slot_bytes: int) -> ArenaLayout:
        check(slot_bytes > 0 and slot_bytes % SLOT_ALIGN_BYTES == 0, "slot_bytes must be a multiple of 4 KiB")
        slot_count = capacity_bytes // slot_bytes
        check(slot_count > 0, "capacity holds no slot")
        return ArenaLayout(slot_bytes, slot_count)


def shmem_huge_page_mode() -> str:
    """The kernel's transparent huge page setting for shared memory (the selected word), or "unknown"."""
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read()
    except OSError:
        return "unknown"
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else "unknown"


def shmem_huge_page_bytes() -> int:
    """Bytes of shared memory this process maps with huge pages (the arena's, in the daemon)."""
    try:
        with open("/proc/self/smaps_rollup") as rollup:
            for line in rollup:
                if line.startswith("ShmemPmdMapped:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


class HostArena:
    """Owner of the arena's files and of the daemon's mapping; `close()` drops both."""

    def __init__(self, layout: ArenaLayout, *, prefault: bool = True, huge_pages: bool = False,
                 per_tenant: bool = False, granule_bytes: int = 0) -> None:
        """`granule_bytes`: the smallest slot (of the smallest size class) a
        tenant's file may back on its own; default the whole slot."""
        self.layout = layout
        self.granule_bytes = granule_bytes or layout.slot_bytes
        check(self.granule_bytes % PAGE_BYTES == 0 and layout.slot_bytes % self.granule_bytes == 0,
              "arena granules must be whole pages that divide a slot")
        self.instance_id = secrets.token_hex(8)
        self.per_tenant = per_tenant
        self._prefault = prefault
        self._huge_pages = huge_pages
        # tenant -> its memfd; with tenants, the spare file backs unclaimed slots.
        self._files: dict[str, int] = {}
        self._closed = True
        # tenant -> the address of a mapping of its file alone (tenant_view).
        self._views: dict[str, int] = {}
        backing = self._new_file("spare") if per_tenant else self.tenant_fd(DEFAULT_TENANT)
        self._spare = backing if per_tenant else None
        # The tenant whose file backs each granule, as an index into
        # _tenant_names (-1: the spare file).
        self._tenant_names: list[str] = []
        self._tenant_indices: dict[str, int] = {}
        self._granule_tenants = np.full(layout.arena_bytes // self.granule_bytes,
                                        -1 if per_tenant else self._tenant_index(DEFAULT_TENANT), dtype=np.int32)
        self._mmap = mmap.mmap(backing, layout.arena_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._closed = False
        self.array = np.frombuffer(self._mmap, dtype=np.uint8)
        self._base = self.array.ctypes.data
        # Rows are slots: the inline path and tests copy with one numpy call.
        self.slots = self.array.reshape(layout.slot_count, layout.slot_bytes)
        if huge_pages:
            self._advise_huge_pages(0, layout.arena_bytes)
        if prefault:
            self.prefault()
        self.reassigned_slots = 0
        log.info("host arena created", extra={"arena_bytes": layout.arena_bytes, "slot_bytes": layout.slot_bytes,
                                               "per_tenant": per_tenant, "huge_pages": self._huge_pages,
                                               "shmem_enabled": shmem_huge_page_mode(),
                                               "huge_page_bytes": shmem_huge_page_bytes() if prefault else None})

    # ------------------------------------------------------------------
    # Files

    def _new_file(self, label: str) -> int:
        """A sealed memfd the size of the arena: no client can grow or shrink
        it (a shrink would turn the daemon's reads of its slots into SIGBUS)."""
        fd = os.memfd_create(f"kvd-arena-{label}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, self.layout.arena_bytes)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def tenant_fd(self, tenant: str) -> int:
        """The file of `tenant` (made on first use): what its clients map.

        Without tenants every caller gets the one file. With tenants, the
        file holds only the slots of that tenant's blocks; all else reads
        as zeros."""
        if not self.per_tenant:
            tenant = DEFAULT_TENANT
        fd = self._files.get(tenant)
        if fd is None:
            fd = self._files[tenant] = self._new_file("tenant" if tenant else "default")
        return fd

    def tenant_view(self, tenant: str) -> int:
        """The address, in this process, of a mapping of `tenant`'s file alone (made on first use,
        kept until close): its blocks at their arena offsets, zeros wherever another tenant's
        block is. What a peer may be granted to READ for that tenant's fetches
        (kvd.cluster.nixl_transport); without tenants, the arena's one file."""
        tenant = tenant if self.per_tenant else DEFAULT_TENANT
        address = self._views.get(tenant)
        if address is None:
            # Writable only because RDMA registration asks for local write access; nothing writes here.
            address = _libc.mmap(None, self.layout.arena_bytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED,
                                 self.tenant_fd(tenant), 0)
            if address in (None, _MAP_FAILED):
                error = ctypes.get_errno()
                raise OSError(error, f"mmap of tenant {tenant!r}'s arena file: {os.strerror(error)}")
            self._views[tenant] = address
        return address

    def claim(self, slot: int, tenant: str) -> None:
        """Back page-sized `slot` with `tenant`'s file (see claim_range)."""
        slot_bytes = self.layout.slot_bytes
        self.claim_range(slot * slot_bytes, slot_bytes, tenant)

    def claim_range(self, offset: int, length: int, tenant: str) -> None:
        """Back arena bytes [offset, offset + length) with `tenant`'s file,
        before a block of that tenant goes there (a slot of any size class:
        whole granules, `granule_bytes` being the smallest slot).

        A no-op when it already is. Otherwise the new file's pages for the
        range are allocated (when the arena is pre-faulted: charged to kvd,
        and a shortage shows here, not in a client), the file is mapped
        over the range, and the files that backed it before (a previous
        tenant's, or several, or the spare) lose those pages, so their
        clients can no longer read what was there. The kernel zeroes the
        new pages: that, not the calls, is the cost (about 1.3-1.5 ms per
        2 MiB with 4 KiB pages; far less with huge pages), which is why the
        engine prefers a tenant's own slots.
        """
        granule = self.granule_bytes
        check(offset % granule == 0 and length % granule == 0 and 0 < length
              and offset + length <= self.layout.arena_bytes, "claim of bytes {}+{} off the granules", offset, length)
        index = self._tenant_index(tenant)
        first, last = offset // granule, (offset + length) // granule
        owners = self._granule_tenants[first:last]
        if (owners == index).all():
            return
        check(self.per_tenant, "slots change tenant only in a per-tenant arena")
        previous = self._runs(first, owners)
        fd = self.tenant_fd(tenant)
        if self._prefault and not self._huge_pages:
            try:
                _fallocate(fd, 0, offset, length)
            except OSError as error:
                log.warning("arena slot not preallocated; its pages come on first touch", extra={"reason": str(error)})
        if not self._map_range(offset, length, fd):
            self._restore(offset, length, fd, previous)
        if self._huge_pages:
            # Advice first, then the pages: allocated any other way they are 4 KiB ones.
            self._advise_huge_pages(offset, length)
            if self._prefault and _libc.madvise(self._base + offset, length, _MADV_POPULATE_WRITE) != 0:
                try:
                    _fallocate(fd, 0, offset, length)  # kernels before 5.14
                except OSError:
                    pass
        for run_offset, run_length, old_fd in previous:
            _fallocate(old_fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, run_offset, run_length)
        owners[:] = index
        self.reassigned_slots += 1

    def _tenant_index(self, tenant: str) -> int:
        if tenant not in self._tenant_indices:
            self._tenant_indices[tenant] = len(self._tenant_names)
            self._tenant_names.append(tenant)
        return self._tenant_indices[tenant]

    def _runs(self, first: int, owners: np.ndarray) -> list[tuple[int, int, int]]:
        """(offset, length, fd) of each run of granules backed by one file."""
        granule = self.granule_bytes
        edges = [0, *(np.flatnonzero(owners[1:] != owners[:-1]) + 1).tolist(), len(owners)]
        runs = []
        for start, stop in zip(edges, edges[1:]):
            index = int(owners[start])
            fd = self._spare if index < 0 else self._files[self._tenant_names[index]]
            runs.append(((first + start) * granule, (stop - start) * granule, fd))
        return runs

    def _restore(self, offset: int, length: int, fd: int, previous: list[tuple[int, int, int]]) -> None:
        """After a failed MAP_FIXED (which may have unmapped the range): map the
        previous files back, give back the pages allocated, and raise."""
        error = ctypes.get_errno()
        restored = all([self._map_range(run_offset, run_length, old_fd) for run_offset, run_length, old_fd in previous])
        try:
            _fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length)
        except OSError:
            pass
        log.error("arena slot not switched to another tenant's memory; the request gets no slot",
                  extra={"offset": offset, "reason": os.strerror(error), "previous_restored": restored})
        check(restored, f"arena bytes at {offset} are mapped to no file")
        raise OSError(error, f"mmap of arena bytes {offset}+{length} for a tenant: {os.strerror(error)}")

    def _map_range(self, offset: int, length: int, fd: int) -> bool:
        """Map `fd` over the range, at the range's own offset in it (MAP_FIXED); False on failure (errno set)."""
        address = _libc.mmap(self._base + offset, length, mmap.PROT_READ | mmap.PROT_WRITE,
                             mmap.MAP_SHARED | _MAP_FIXED, fd, offset)
        if address in (None, _MAP_FAILED):
            return False
        check(address == self._base + offset, "MAP_FIXED moved the slot")
        return True

    # ------------------------------------------------------------------

    def prefault(self) -> None:
        """Touch every page now, so the first Put does not pay page faults
        and a host short of memory fails at start-up, not with the OOM
        killer later."""
        self.array[::PAGE_BYTES] = 0

    def _advise_huge_pages(self, offset: int, length: int) -> None:
        advice = getattr(mmap, "MADV_HUGEPAGE", None)
        if advice is None:
            log.warning("huge pages requested but madvise(MADV_HUGEPAGE) is unavailable")
            return
        if _libc.madvise(self._base + offset, length, advice) != 0:
            log.warning("huge pages requested but madvise failed: %s", os.strerror(ctypes.get_errno()))

    def offset(self, slot: int) -> int:
        return slot * self.layout.slot_bytes

    def address(self, slot: int) -> int:
        """Virtual address of a page-sized slot in this process (for native I/O)."""
        check(0 <= slot < self.layout.slot_count, "slot out of range")
        return self._base + slot * self.layout.slot_bytes

    def address_at(self, offset: int) -> int:
        """Virtual address of arena byte `offset` in this process (a slot of any class)."""
        check(0 <= offset < self.layout.arena_bytes, "arena offset {} out of range", offset)
        return self._base + offset

    def write(self, slot: int, payload: bytes | memoryview) -> None:
        check(len(payload) <= self.layout.slot_bytes, "payload larger than a slot")
        self.write_at(self.offset(slot), payload)

    def write_at(self, offset: int, payload: bytes | memoryview) -> None:
        check(0 <= offset and offset + len(payload) <= self.layout.arena_bytes, "write past the arena")
        self._mmap[offset : offset + len(payload)] = payload

    def read(self, slot: int, length: int) -> bytes:
        check(length <= self.layout.slot_bytes, "read past a slot")
        return self.read_at(self.offset(slot), length)

    def read_at(self, offset: int, length: int) -> bytes:
        check(0 <= offset and offset + length <= self.layout.arena_bytes, "read past the arena")
        return self._mmap[offset : offset + length]

    def close(self) -> None:
        """Idempotent: close the files (clients keep what they mapped), then unmap."""
        if self._closed:
            return
        self._closed = True
        for address in self._views.values():
            _libc.munmap(address, self.layout.arena_bytes)
        self._views.clear()
        for fd in {*self._files.values(), *([self._spare] if self._spare is not None else [])}:
            os.close(fd)
        self._files.clear()
        self.slots = self.array = None  # type: ignore[assignment]
        try:
            self._mmap.close()
        except BufferError:
            # A view still exports the buffer; the mapping goes with the process.
            log.warning("host arena still referenced at close; unmapping at exit")
