"""The contenders of bench_tenant_arena.py (not a benchmark itself).

Contender: one daemon and its client(s), one per tenant, whose rounds Put
blocks totalling the arena (each Put followed by Gets of its blocks) and
record the Put's time with its breakdown: slot tenant changes and Reserve's
handler time (from the daemon's /metrics), the client's copy into the
arena, and page faults on both sides. time_claims times HostArena.claim in
this process. bench_tenant_arena.py's docstring says what they measure.
"""

from __future__ import annotations

import gc
import resource
import statistics
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import _common  # noqa: F401  (puts the repository on sys.path, for kvd)

from kvd.testing.tenants import write_tenants_file

TOKENS = {"a": "bench-tenant-a-token-4d1f9c2e", "b": "bench-tenant-b-token-8a7e05b3"}
CHANGES_METRIC = "kvd_arena_slot_tenant_changes_total"
RESERVE_SUM = 'kvd_rpc_duration_seconds_sum{method="Reserve"}'


def tenants_file(directory: Path, host_bytes: int = 0) -> Path:
    """The tenants, each with a host quota of `host_bytes` (0: none)."""
    directory.mkdir(parents=True, exist_ok=True)
    return write_tenants_file(directory / "tenants.toml", {
        name: {"token": token, "namespaces": ["*"], "host_bytes": host_bytes} for name, token in TOKENS.items()
    })


def scrape(url: str) -> dict[str, float]:
    """Every sample of a daemon's /metrics, keyed by its line up to the value."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            samples[key] = float(value)
    return samples


def minor_faults_of(pid: int) -> int:
    """minflt of a process (field 10 of /proc/<pid>/stat)."""
    text = Path(f"/proc/{pid}/stat").read_text()
    return int(text.rsplit(")", 1)[1].split()[7])


# Per-round sums over a round's Put calls (the breakdown's columns).
SUMMED = ("put_s", "slot_tenant_changes", "reserve_handler_s", "client_copy_s", "client_minflt_put",
          "daemon_minflt_put")


class Contender:
    """One daemon and the client(s) that Put into it: every round Puts totalling
    the arena, in `calls` Puts, each followed by Gets of its blocks.

    With two clients (tenants), they take turns per round (`turns` =
    "round"), or share every round's Puts equally in an order shuffled anew
    each round (`turns` = "shuffled", seeded)."""

    def __init__(self, name: str, label: str, daemon, tokens: list[str | None], spec, count: int,
                 calls: int = 1, turns: str = "round") -> None:
        from kvd.client import Client

        assert turns in ("round", "shuffled") and 1 <= calls <= count
        self.name = name
        self.label = label
        self.daemon = daemon
        self.spec = spec
        self.count = count
        self.turns = turns
        # Block ranges of the round's Puts: sizes differ by at most one block.
        self.ranges = [(int(part[0]), int(part[-1]) + 1) for part in np.array_split(np.arange(count), calls)]
        self.clients = [Client(daemon.unix_target, token=token) for token in tokens]
        for client in self.clients:
            if not client.uses_shared_memory:
                raise RuntimeError(f"{name}: the client could not map the daemon's arena; shared memory is required")
        self.namespaces = [client.register_namespace(spec) for client in self.clients]
        self.turn = 0
        self.shuffler = np.random.default_rng(20240612)
        self.samples: dict[str, list[float]] = {"put": [], "get": []}
        self.details: list[dict[str, float]] = []
        self.scatter_seconds = 0.0
        self.last: list[tuple[int, list[bytes], int, int]] = []
        for client in self.clients:
            self._time_scatter(client)

    @property
    def calls(self) -> int:
        return len(self.ranges)

    def _time_scatter(self, client) -> None:
        """Add the client's copy into the arena to scatter_seconds (a wrapper on its mapping)."""
        arena = client.session.arena
        original = arena.scatter

        def scatter(rows, offsets) -> None:
            started = time.perf_counter()
            try:
                original(rows, offsets)
            finally:
                self.scatter_seconds += time.perf_counter() - started

        arena.scatter = scatter

    def close(self) -> None:
        for client in self.clients:
            client.close()

    def counters(self) -> dict[str, float]:
        samples = scrape(self.daemon.metrics_url)
        return {
            "changes": samples.get(CHANGES_METRIC, 0.0),
            "reserve_s": samples.get(RESERVE_SUM, 0.0),
            "daemon_minflt": float(minor_faults_of(self.daemon.pid)),
        }

    def _tenants_of_round(self) -> list[int]:
        """The client (tenant) of each of the round's Puts."""
        if self.turns == "round":
            index = self.turn % len(self.clients)
            self.turn += 1
            return [index] * self.calls
        # Each tenant its share of the Puts (the first one more when odd, in turn).
        first = self.turn % len(self.clients)
        self.turn += 1
        order = [(first + call) % len(self.clients) for call in range(self.calls)]
        self.shuffler.shuffle(order)
        return order

    def round(self, keys_for: Callable[[Any, int], list[bytes]], src: np.ndarray, out: np.ndarray,
              warmup: bool, get_repeats: int = 1) -> dict[str, float]:
        """One round: Puts of blocks totalling the arena, each followed by Gets of its blocks."""
        detail = dict.fromkeys(SUMMED, 0.0)
        detail["client_minflt_get"] = 0.0
        get_sums = [0.0] * get_repeats
        tenants = set()
        last = []
        for (start, stop), index in zip(self.ranges, self._tenants_of_round(), strict=True):
            tenants.add(index)
            client, namespace = self.clients[index], self.namespaces[index]
            blocks = stop - start
            keys = keys_for(namespace, blocks)
            before = self.counters()
            scatter_before = self.scatter_seconds
            gc.collect()
            faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            started = time.perf_counter()
            written = client.put(namespace, keys, src[start:stop])
            put_s = time.perf_counter() - started
            faults_put = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before
            if written != blocks:
                raise RuntimeError(f"{self.name}: put wrote {written} of {blocks} blocks")
            after = self.counters()
            for repeat in range(get_repeats):
                gc.collect()
                faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                started = time.perf_counter()
                found = client.get_numpy(namespace, keys, out=out[start:stop])
                get_sums[repeat] += time.perf_counter() - started
                detail["client_minflt_get"] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before
                if found.shape[0] != blocks:
                    raise RuntimeError(f"{self.name}: get matched {found.shape[0]} of {blocks} blocks")
            detail["put_s"] += put_s
            detail["slot_tenant_changes"] += after["changes"] - before["changes"]
            detail["reserve_handler_s"] += after["reserve_s"] - before["reserve_s"]
            detail["client_copy_s"] += self.scatter_seconds - scatter_before
            detail["client_minflt_put"] += faults_put
            detail["daemon_minflt_put"] += after["daemon_minflt"] - before["daemon_minflt"]
            last.append((index, keys, start, stop))
        detail["client_minflt_get"] /= get_repeats
        detail["get_s"] = statistics.median(get_sums)
        # The round's tenant: 0 or 1, or -1 when both Put in it.
        detail["tenant"] = float(tenants.pop()) if len(tenants) == 1 else -1.0
        self.last = last
        if not warmup:
            self.samples["put"].append(detail["put_s"])
            self.samples["get"].extend(get_sums)
            self.details.append(detail)
        return detail

    def verify(self, src: np.ndarray, out: np.ndarray) -> None:
        """The last round's blocks read back bit-exact (untimed)."""
        assert self.last
        for index, keys, start, stop in self.last:
            part = out[start:stop]
            part.view(np.uint8).reshape(-1)[:] = 0
            found = self.clients[index].get_numpy(self.namespaces[index], keys, out=part)
            if found.shape[0] != stop - start or not np.array_equal(part.view(np.uint8), src[start:stop].view(np.uint8)):
                raise RuntimeError(f"{self.name}: GET returned different bytes than were PUT")


def time_claims(slot_bytes: int, slots: int, rounds: int = 3) -> dict[str, Any]:
    """HostArena.claim in this process: two tenants take all `slots` in turn.

    After each round the new tenant's "client" (a mapping of its file here)
    writes every slot, as the real client's copy does, so the next round's
    punches have its pages and page-table entries to drop. That first
    write takes the faults that zero the pages claim allocated: it is
    timed too, and so is a second write of every slot, for comparison.
    Returns microseconds per slot (medians over rounds, after one warm-up)."""
    import mmap

    from kvd.tiers.host import ArenaLayout, HostArena

    arena = HostArena(ArenaLayout(slot_bytes, slots), per_tenant=True)
    handles = {}
    try:
        for tenant in "ab":
            handles[tenant] = mmap.mmap(arena.tenant_fd(tenant), arena.layout.arena_bytes, mmap.MAP_SHARED,
                                        mmap.PROT_READ | mmap.PROT_WRITE)
        per_claim, first_write, rewrite = [], [], []
        for number in range(rounds + 1):
            tenant = "ab"[number % 2]
            started = time.perf_counter()
            for slot in range(slots):
                arena.claim(slot, tenant)
            seconds = time.perf_counter() - started
            view = np.frombuffer(handles[tenant], dtype=np.uint8)
            started = time.perf_counter()
            view[:] = number + 1
            first_seconds = time.perf_counter() - started
            started = time.perf_counter()
            view[:] = number + 2
            again_seconds = time.perf_counter() - started
            del view
            if number:
                per_claim.append(seconds / slots * 1e6)
                first_write.append(first_seconds / slots * 1e6)
                rewrite.append(again_seconds / slots * 1e6)
        return {"slots": slots, "rounds": rounds, "us_per_claim": per_claim,
                "median_us_per_claim": statistics.median(per_claim),
                "us_per_first_write": first_write, "median_us_per_first_write": statistics.median(first_write),
                "us_per_rewrite": rewrite, "median_us_per_rewrite": statistics.median(rewrite)}
    finally:
        for handle in handles.values():
            handle.close()
        arena.close()
