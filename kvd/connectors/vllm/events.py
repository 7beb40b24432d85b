"""kvd's KV events for the namespace, as vLLM KV cache events (for KV-aware routers).

vLLM publishes what its connector returns from take_events() with its own
events (--kv-events-config), so a router that scores engines by cached
prefix also sees what kvd holds for this engine. A thread follows kvd's
event stream of the engine's namespace (shard 0) and turns each event into
vLLM's terms: STORED -> BlockStored, REMOVED -> BlockRemoved, a tier change
-> BlockStored in the new medium. Block hashes are kvd's 32-byte keys
(vLLM's ExternalBlockHash admits bytes). When kvd says events were missed
(a restart, a slow reader), the feed sends AllBlocksCleared and the
namespace's current blocks again.
"""

from __future__ import annotations

import threading

from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

from kvd.client import Client, EventKind, KvEvent, Namespace, ResyncRequired
from kvd.connectors.vllm.logs import log
from kvd.v1 import kvd_pb2

MEDIUM = {kvd_pb2.TIER_DEVICE: "GPU", kvd_pb2.TIER_HOST: "CPU", kvd_pb2.TIER_DISK: "STORAGE"}
MAX_PENDING = 100_000  # events kept for take_events; beyond, the oldest are dropped and a resync sent


def _stored(keys: list[bytes], parent: bytes, tier: int, block_size: int) -> BlockStored:
    return BlockStored(block_hashes=list(keys), parent_block_hash=parent or None, token_ids=[],
                       block_size=block_size, lora_id=None, medium=MEDIUM.get(tier, "STORAGE"), lora_name=None)


class EventFeed:
    def __init__(self, client: Client, namespace: Namespace) -> None:
        self._client = client
        self._namespace = namespace
        self._pending: list[KVCacheEvent] = []
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._watch = None
        self._thread = threading.Thread(target=self._follow, name="kvd-events", daemon=True)
        self._thread.start()

    def take(self) -> list[KVCacheEvent]:
        with self._lock:
            events, self._pending = self._pending, []
        return events

    def _emit(self, events: list[KVCacheEvent]) -> None:
        with self._lock:
            self._pending.extend(events)
            if len(self._pending) > MAX_PENDING:
                self._pending = [AllBlocksCleared()]  # the router rebuilds from later events

    def _convert(self, event: KvEvent) -> KVCacheEvent:
        block_size = self._namespace.spec.block_tokens
        if event.kind == EventKind.REMOVED:
            return BlockRemoved(block_hashes=list(event.keys), medium=None)
        return _stored(event.keys, event.parent_key if event.kind == EventKind.STORED else b"", event.tier, block_size)

    def _resync(self) -> int:
        snapshot = self._client.event_snapshot(self._namespace)
        block_size = self._namespace.spec.block_tokens
        events: list[KVCacheEvent] = [AllBlocksCleared()]
        events += [_stored([key], parent, tier, block_size)
                   for key, parent, tier in zip(snapshot.keys, snapshot.parent_keys, snapshot.tiers)]
        self._emit(events)
        return snapshot.sequence + 1

    def _follow(self) -> None:
        start: int | None = 0
        while not self._closed.is_set():
            if start is None:
                start = self._resynced()
                continue
            try:
                start = self._watch_from(start)
            except ResyncRequired:
                start = None
            except Exception as error:  # noqa: BLE001 - the daemon away, the channel closed: retry or end
                if self._closed.is_set():
                    return
                log.debug("kvd event watch ended (%r); reconnecting", error)
                self._closed.wait(1.0)
                start = None

    def _watch_from(self, start: int) -> int:
        self._watch = self._client.watch_events(self._namespace, start)
        for event in self._watch:
            self._emit([self._convert(event)])
            start = event.sequence + 1
        return start

    def _resynced(self) -> int | None:
        """The sequence to watch from after a resync, None if the daemon is away."""
        try:
            return self._resync()
        except Exception:  # noqa: BLE001 - tried again after a pause
            self._closed.wait(1.0)
            return None

    def close(self) -> None:
        self._closed.set()
        if self._watch is not None:
            self._watch.close()
