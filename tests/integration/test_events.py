"""KV events through a real daemon: WatchEvents, EventSnapshot, resyncs, drain.

A `Subscriber` reads a watch on a thread so that a test can wait for the
events it expects with a deadline. Whenever a test compares, it first
takes an EventSnapshot (which publishes every change made so far), waits
until the watch has delivered that snapshot's sequence, then compares the
mirror built from events with the snapshot and with Lookup.
"""

from __future__ import annotations

import asyncio
import queue
import random
import signal
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from kvd.client import AsyncClient, BlockMirror, Client, EventKind, KvEvent, ResyncRequired
from kvd.client.events import EventWatch
from kvd.core.keys import DType, NamespaceSpec
from kvd.testing.daemon import run_daemon, start_daemon
from kvd.v1 import kvd_pb2, kvd_pb2_grpc
from tests.integration.conftest import SMALL_SPEC, random_blocks
from tests.integration.test_api_errors import assert_status
from tests.integration.disk_tier_helpers import SPEC as DISK_SPEC
from tests.integration.disk_tier_helpers import blocks_for, disk_config, metric_samples

HOST, DISK = kvd_pb2.TIER_HOST, kvd_pb2.TIER_DISK
STORED, REMOVED, TIER_CHANGED = EventKind.STORED, EventKind.REMOVED, EventKind.TIER_CHANGED
# 16 host slots of 64 KiB; SMALL_SPEC blocks are 16 KiB.
SMALL_HOST = {"host": {"capacity_bytes": 16 << 16, "slot_bytes": 64 << 10}}
WAIT_S = 30.0


class Subscriber:
    """A watch read on a thread: events wait in a queue until the test takes them."""

    def __init__(self, watch: EventWatch) -> None:
        self.watch = watch
        self.sequence = watch.sequence
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for event in self.watch:
                self._queue.put(event)
        except BaseException as error:  # handed to the test thread, which raises it
            self._queue.put(error)

    def until(self, sequence: int, timeout_s: float = WAIT_S) -> list[KvEvent]:
        """Events up to and including `sequence`, in order and without a gap."""
        events = []
        deadline = time.monotonic() + timeout_s
        while self.sequence < sequence:
            item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            if isinstance(item, BaseException):
                raise item
            assert item.sequence == self.sequence + 1, (item.sequence, self.sequence)
            self.sequence = item.sequence
            events.append(item)
        return events

    def error(self, timeout_s: float = WAIT_S) -> BaseException:
        """The exception that ended the watch (after any events still queued)."""
        deadline = time.monotonic() + timeout_s
        while True:
            item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            if isinstance(item, BaseException):
                return item

    def close(self) -> None:
        self.watch.close()
        self._thread.join(WAIT_S)


def shape(events: list[KvEvent]) -> list[tuple]:
    return [(event.sequence, event.kind, event.keys, event.parent_key, event.tier) for event in events]


def catch_up(client: Client, namespace, subscriber: Subscriber, mirror: BlockMirror) -> list[KvEvent]:
    """Apply events until the mirror is at the daemon's newest; it must equal the snapshot then."""
    snapshot = client.event_snapshot(namespace)
    events = subscriber.until(snapshot.sequence)
    for event in events:
        mirror.apply(event)
    assert mirror.sequence == snapshot.sequence
    assert mirror.tiers == dict(zip(snapshot.keys, snapshot.tiers))
    assert mirror.parents == dict(zip(snapshot.keys, snapshot.parent_keys))
    return events


def wait_for_metric(daemon, name: str, value: float) -> None:
    """Stream ends reach the daemon asynchronously: wait until a gauge shows one."""
    deadline = time.monotonic() + WAIT_S
    while daemon.metric(name) != value:
        assert time.monotonic() < deadline, f"{name} stayed at {daemon.metric(name)}, not {value}"
        time.sleep(0.02)


def assert_lookup_agrees(client: Client, namespace, subscriber: Subscriber, mirror: BlockMirror,
                         chains: list[list[bytes]]) -> None:
    """Lookup answers what the events say. The daemon may still be moving
    blocks (write-back, reclaim), so the Lookups count only when no event
    was published between a snapshot taken before them and one after."""
    deadline = time.monotonic() + WAIT_S
    while True:
        catch_up(client, namespace, subscriber, mirror)
        lookups = [client.lookup(namespace, keys) for keys in chains]
        if client.event_snapshot(namespace).sequence == mirror.sequence:
            break
        assert time.monotonic() < deadline, "the daemon never stopped publishing events"
    for keys, lookup in zip(chains, lookups):
        expected = 0
        while expected < len(keys) and keys[expected] in mirror.tiers:
            expected += 1
        assert lookup.matched == expected
        assert lookup.tiers == [mirror.tiers[key] for key in keys[:expected]]


def test_put_delete_and_eviction_are_stored_and_removed_events(tmp_path):
    with run_daemon(tmp_path, config=SMALL_HOST) as daemon, Client(daemon.unix_target) as client:
        namespace = client.register_namespace(SMALL_SPEC)
        subscriber = Subscriber(client.watch_events(namespace))
        assert subscriber.sequence == 0 and subscriber.watch.instance_id
        first = namespace.keys(np.arange(12 * 16))
        client.put(namespace, first, random_blocks(SMALL_SPEC, 12, seed=1))
        # One Put of 12 blocks is one event.
        assert shape(subscriber.until(1)) == [(1, STORED, first, b"", HOST)]
        assert client.delete(namespace, first[10:11]) == (2, 0)
        (removed,) = subscriber.until(2)
        assert removed.kind == REMOVED and sorted(removed.keys) == sorted(first[10:])
        # 12 new blocks in a 16-slot tier holding 10: six old ones are
        # evicted, from the tail of their chain (its only leaf), in one event.
        second = namespace.keys(np.arange(12 * 16) + 10**6)
        client.put(namespace, second, random_blocks(SMALL_SPEC, 12, seed=2))
        evicted, stored = subscriber.until(4)
        assert evicted.kind == REMOVED and sorted(evicted.keys) == sorted(first[4:10])
        assert shape([stored]) == [(4, STORED, second, b"", HOST)]
        # A continued chain names its parent.
        more = namespace.keys(np.arange(14 * 16) + 10**6)[12:]
        client.put(namespace, more, random_blocks(SMALL_SPEC, 2, seed=3), parent_key=second[-1])
        evicted, stored = subscriber.until(6)
        assert evicted.kind == REMOVED and sorted(evicted.keys) == sorted(first[2:4])
        assert shape([stored]) == [(6, STORED, more, second[-1], HOST)]
        mirror = BlockMirror(client.event_snapshot(namespace))
        assert mirror.sequence == 6
        assert_lookup_agrees(client, namespace, subscriber, mirror, [first, second + more])
        samples = metric_samples(daemon.metrics_url)
        assert samples['kvd_events_total{kind="stored"}'] == 3
        assert samples['kvd_event_keys_total{kind="stored"}'] == 12 + 12 + 2
        assert samples['kvd_events_total{kind="removed"}'] == 3
        assert samples["kvd_event_subscribers"] == 1
        subscriber.close()
        wait_for_metric(daemon, "kvd_event_subscribers", 0)


def test_demotion_and_promotion_are_tier_changed_events(tmp_path):
    with run_daemon(tmp_path / "d", config=disk_config(tmp_path)) as daemon, Client(daemon.unix_target) as client:
        namespace = client.register_namespace(DISK_SPEC)
        subscriber = Subscriber(client.watch_events(namespace))
        mirror = BlockMirror(client.event_snapshot(namespace))
        first = namespace.keys(np.arange(12 * 16))
        blocks = blocks_for(12, seed=1)
        assert client.put(namespace, first, blocks, durable=True) == 12
        others = []
        for round_ in range(2):
            keys = namespace.keys(np.arange(16 * 16) + 10**6 * (round_ + 1))
            client.put(namespace, keys, blocks_for(16, seed=10 + round_))
            others.append(keys)
        catch_up(client, namespace, subscriber, mirror)
        assert [mirror.tiers[key] for key in first] == [DISK] * 12
        assert_lookup_agrees(client, namespace, subscriber, mirror, [first, *others])
        assert np.array_equal(client.get_numpy(namespace, first), blocks)
        events = catch_up(client, namespace, subscriber, mirror)
        # The promotion was announced as such, all 12 keys of it in one event
        # (reclaim may demote some of them again right after: more events).
        promotions = [event for event in events if event.kind == TIER_CHANGED and event.tier == HOST]
        assert [sorted(event.keys) for event in promotions] == [sorted(first)]
        assert_lookup_agrees(client, namespace, subscriber, mirror, [first, *others])
        samples = metric_samples(daemon.metrics_url)
        assert samples['kvd_events_total{kind="tier_changed"}'] >= 2
        subscriber.close()


def test_resume_replays_and_a_too_old_or_foreign_sequence_asks_for_a_resync(tmp_path):
    config = {**SMALL_HOST, "events": {"ring_events": 8, "max_subscribers": 2}}
    with run_daemon(tmp_path, config=config) as daemon, Client(daemon.unix_target) as client:
        namespace = client.register_namespace(SMALL_SPEC)
        roots = [namespace.keys(np.arange(16) + 1000 * n) for n in range(5)]
        for number, keys in enumerate(roots):
            client.put(namespace, keys, random_blocks(SMALL_SPEC, 1, seed=number))
        instance_id = client.event_snapshot(namespace).instance_id
        with client.watch_events(namespace, from_sequence=3, instance_id=instance_id) as watch:
            assert watch.sequence == 2
            assert shape([next(watch) for _ in range(3)]) == [
                (3, STORED, roots[2], b"", HOST),
                (4, STORED, roots[3], b"", HOST),
                (5, STORED, roots[4], b"", HOST),
            ]
        # Resuming right after the newest event waits for the next one.
        subscriber = Subscriber(client.watch_events(namespace, from_sequence=6))
        for number in range(10):
            client.delete(namespace, roots[number % 5])
            client.put(namespace, roots[number % 5], random_blocks(SMALL_SPEC, 1, seed=number))
        newest = client.event_snapshot(namespace).sequence
        assert newest == 25
        assert [event.sequence for event in subscriber.until(newest)] == list(range(6, 26))
        # The ring holds the last 8 events: 18 is the oldest a watch may ask for.
        with pytest.raises(ResyncRequired) as raised:
            client.watch_events(namespace, from_sequence=17)
        assert raised.value.reason == "sequence_too_old" and raised.value.sequence == 25
        wait_for_metric(daemon, "kvd_event_subscribers", 1)  # the first watch has ended
        with client.watch_events(namespace, from_sequence=18) as watch:
            assert next(watch).sequence == 18
        # The daemon ends a closed watch's subscription soon, not at once.
        wait_for_metric(daemon, "kvd_event_subscribers", 1)
        with pytest.raises(ResyncRequired) as raised:
            client.watch_events(namespace, from_sequence=20, instance_id="another-instance")
        assert raised.value.reason == "instance_changed" and raised.value.instance_id == instance_id
        samples = metric_samples(daemon.metrics_url)
        assert samples['kvd_event_resyncs_total{reason="sequence_too_old"}'] == 1
        assert samples['kvd_event_resyncs_total{reason="instance_changed"}'] == 1
        # Two subscribers at most here: the subscriber above and this one
        # (once the daemon has seen the watches above end).
        wait_for_metric(daemon, "kvd_event_subscribers", 1)
        with client.watch_events(namespace):
            with grpc.insecure_channel(daemon.unix_target) as channel:
                stub = kvd_pb2_grpc.KvdStub(channel)
                request = kvd_pb2.WatchEventsRequest(namespace_id=namespace.namespace_id)
                assert_status(lambda: next(stub.WatchEvents(request)), grpc.StatusCode.RESOURCE_EXHAUSTED,
                              "too many event subscribers (max 2)")
        subscriber.close()


def test_bad_requests_get_precise_statuses(daemon):
    with Client(daemon.unix_target) as client, grpc.insecure_channel(daemon.unix_target) as channel:
        stub = kvd_pb2_grpc.KvdStub(channel)
        namespace = client.register_namespace(SMALL_SPEC)
        newest = client.event_snapshot(namespace).sequence

        def watch(**fields):
            return lambda: next(stub.WatchEvents(kvd_pb2.WatchEventsRequest(**fields), timeout=10))

        def snapshot(**fields):
            return lambda: list(stub.EventSnapshot(kvd_pb2.EventSnapshotRequest(**fields), timeout=10))

        for call in (watch(namespace_id=b"\x01" * 32), snapshot(namespace_id=b"\x01" * 32)):
            assert_status(call, grpc.StatusCode.NOT_FOUND, "not registered")
        for call in (watch(namespace_id=b"short"), snapshot()):
            assert_status(call, grpc.StatusCode.INVALID_ARGUMENT, "namespace_id must be 32 bytes")
        assert_status(watch(namespace_id=namespace.namespace_id, from_sequence=newest + 2),
                      grpc.StatusCode.INVALID_ARGUMENT, f"watch from at most {newest + 1}")
        with pytest.raises(ValueError, match="from_sequence must be >= 0"):
            client.watch_events(namespace, from_sequence=-1)
        # The first message after the newest event is fine: it waits for it.
        with client.watch_events(namespace, from_sequence=newest + 1) as ok:
            assert ok.sequence == newest


def test_snapshot_then_watch_reconstructs_the_daemon_while_it_changes(tmp_path):
    """A subscriber that joins in the middle of a workload (puts, gets, deletes,
    evictions, demotions, promotions) ends with exactly what Lookup sees."""
    rng = random.Random(5)
    with run_daemon(tmp_path / "d", config=disk_config(tmp_path)) as daemon, Client(daemon.unix_target) as client:
        namespace = client.register_namespace(DISK_SPEC)
        chains = [namespace.keys(np.arange(8 * 16) + 10**5 * n) for n in range(6)]
        payload = blocks_for(8, seed=0)
        joined = threading.Event()
        failures = []

        def workload():
            try:
                with Client(daemon.unix_target) as worker:
                    for step in range(160):
                        if step == 40:
                            joined.wait(WAIT_S)
                        keys = rng.choice(chains)[: rng.randint(1, 8)]
                        action = rng.random()
                        if action < 0.5:
                            worker.put(namespace, keys, payload[: len(keys)], durable=rng.random() < 0.3)
                        elif action < 0.85:
                            worker.get_numpy(namespace, keys)
                        else:
                            worker.delete(namespace, keys[-1:])
            except BaseException as error:
                failures.append(error)
                raise

        thread = threading.Thread(target=workload)
        thread.start()
        time.sleep(0.2)
        snapshot = client.event_snapshot(namespace)
        mirror = BlockMirror(snapshot)
        subscriber = Subscriber(client.watch_events(namespace, snapshot.sequence + 1, snapshot.instance_id))
        joined.set()
        thread.join(120)
        assert not thread.is_alive() and not failures
        catch_up(client, namespace, subscriber, mirror)
        assert_lookup_agrees(client, namespace, subscriber, mirror, chains)
        assert mirror.sequence > snapshot.sequence
        samples = metric_samples(daemon.metrics_url)
        for kind in ("stored", "removed", "tier_changed"):
            assert samples[f'kvd_events_total{{kind="{kind}"}}'] > 0, kind
        subscriber.close()


def daemon_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


# 1 KiB blocks in 4 KiB slots: 4,096 of them per 16 MiB tier.
TINY_SPEC = NamespaceSpec(model_id="events-tiny", num_layers=1, num_kv_heads=1, head_dim=8, block_tokens=16,
                          kv_dtype=DType.FLOAT32)


def test_a_slow_subscriber_is_told_to_resync_and_the_daemon_stays_bounded(tmp_path):
    """A subscriber that stops reading while 400 events of 4,096 keys each
    (about 60 MB of events) go by costs the daemon a bounded amount of
    memory; once it reads again it gets what was buffered, then
    RESYNC_REQUIRED, and its stream ends."""
    config = {"host": {"capacity_bytes": 16 << 20, "slot_bytes": 4096}, "events": {"ring_keys": 16384}}
    with run_daemon(tmp_path, config=config) as daemon, Client(daemon.unix_target) as client:
        namespace = client.register_namespace(TINY_SPEC)
        blocks = np.zeros((4096, *TINY_SPEC.block_shape), dtype=np.float32)
        rounds = [namespace.keys(np.arange(4096 * 16) + 10**7 * n) for n in range(2)]
        client.put(namespace, rounds[0], blocks)
        client.put(namespace, rounds[1], blocks)
        with grpc.insecure_channel(daemon.unix_target) as channel:
            stream = kvd_pb2_grpc.KvdStub(channel).WatchEvents(
                kvd_pb2.WatchEventsRequest(namespace_id=namespace.namespace_id)
            )
            assert next(stream).kind == kvd_pb2.KV_EVENT_KIND_WATCHING
            rss_before = daemon_rss_bytes(daemon.pid)
            # Each Put evicts the other round: a REMOVED and a STORED event of 4,096 keys.
            for number in range(200):
                client.put(namespace, rounds[number % 2], blocks)
            assert client.event_snapshot(namespace).sequence >= 2 + 400
            growth = daemon_rss_bytes(daemon.pid) - rss_before
            # Unbounded buffering would hold ~60 MB of messages (and more as
            # Python objects); the ring and gRPC's flow-control window, a few.
            assert growth < 24 << 20, growth
            messages = list(stream)
        assert messages[-1].kind == kvd_pb2.KV_EVENT_KIND_RESYNC_REQUIRED
        assert messages[-1].resync_reason == kvd_pb2.RESYNC_REASON_SUBSCRIBER_TOO_SLOW
        delivered = [message.sequence for message in messages[:-1]]
        assert delivered == list(range(delivered[0], delivered[0] + len(delivered)))
        assert len(delivered) < 200
        samples = metric_samples(daemon.metrics_url)
        assert samples['kvd_event_resyncs_total{reason="subscriber_too_slow"}'] == 1
        assert samples["kvd_event_subscribers"] == 0


def test_sigterm_ends_event_streams_promptly(tmp_path):
    daemon = start_daemon(tmp_path, config={"server": {"grace_period_s": 30.0}})
    try:
        with Client(daemon.unix_target) as client:
            namespace = client.register_namespace(SMALL_SPEC)
            subscribers = [Subscriber(client.watch_events(namespace)) for _ in range(3)]
            client.put(namespace, namespace.keys(np.arange(16)), random_blocks(SMALL_SPEC, 1, seed=1))
            subscribers[0].until(1)
            started = time.monotonic()
            assert daemon.stop(signal.SIGTERM) == 0
            # Well within the 30 s grace period: idle streams do not hold the drain.
            assert time.monotonic() - started < 10
            for subscriber in subscribers:
                error = subscriber.error()
                assert isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.UNAVAILABLE, error
                assert "draining" in error.details()
    finally:
        daemon.stop(signal.SIGKILL)


def test_async_client_watches_and_snapshots(daemon):
    async def scenario():
        async with AsyncClient(daemon.unix_target) as client:
            spec = NamespaceSpec(model_id="events-async", num_layers=4, num_kv_heads=2, head_dim=16, block_tokens=16,
                                 kv_dtype=DType.FLOAT32)
            namespace = await client.register_namespace(spec)
            snapshot = await client.event_snapshot(namespace)
            assert (snapshot.sequence, snapshot.keys) == (0, [])
            keys = namespace.keys(np.arange(3 * 16))
            async with await client.watch_events(namespace, 1, snapshot.instance_id) as watch:
                await client.put(namespace, keys, random_blocks(spec, 3, seed=4))
                event = await asyncio.wait_for(anext(watch), WAIT_S)
                assert (event.sequence, event.kind, event.keys, event.tier) == (1, STORED, keys, HOST)
            snapshot = await client.event_snapshot(namespace)
            assert (snapshot.sequence, snapshot.keys, snapshot.parent_keys) == (1, keys, [b"", keys[0], keys[1]])
            with pytest.raises(ResyncRequired):
                await client.watch_events(namespace, 1, "another-instance")

    asyncio.run(scenario())
