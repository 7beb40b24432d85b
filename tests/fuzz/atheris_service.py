"""Coverage-guided fuzzing of the daemon's request handling, in process (atheris, libFuzzer).

    python tests/fuzz/atheris_service.py [libFuzzer flags] CORPUS_DIR

The gRPC fuzzers (test_grpc_fuzz.py) talk to a real daemon, so they cannot
see which branches of the daemon a request reached. Here the same handlers
the daemon registers (kvd.server.registration.method_handlers: request
parsing, then KvdService over a real Engine and HostArena, no disk tier)
run in this process with kvd's bytecode instrumented, and libFuzzer keeps
the inputs that reach new branches.

One input: byte 0 picks the method, byte 1 moves the clock (low nibble:
that many 100 ms; high bit: expire leases first), the rest is the request
as wire bytes, as a client would send them. CORPUS_DIR, when empty, is
seeded with a valid request of every method, aimed at a stored chain.

Each input must end with OK or a precise status (never INTERNAL or
UNKNOWN, never a Python exception out of a handler, never longer than
HANDLER_TIMEOUT_S); after each, Engine.verify() checks every structure of
the engine, and every CHECK_EVERY inputs a pinned reference chain (in a
namespace no input can name) is checked bit-exact in the arena. A failure
is an uncaught exception: atheris prints it and writes the input to
crash-<sha1> in the working directory.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import sys
from pathlib import Path

import atheris

with atheris.instrument_imports(include=["kvd"]):
    import grpc

    from kvd.clock import ManualClock
    from kvd.core.engine import Engine, EngineLimits
    from kvd.core.events import EventLog
    from kvd.core.keys import DType, NamespaceSpec
    from kvd.metrics import make_registry
    from kvd.server.registration import method_handlers
    from kvd.server.service import KvdService
    from kvd.testing import engine_ops
    from kvd.tiers.host import ArenaLayout, HostArena
    from kvd.v1 import kvd_pb2

METHODS = [method.name for method in kvd_pb2.DESCRIPTOR.services_by_name["Kvd"].methods]
PRECISE = {
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.ALREADY_EXISTS,
}
HANDLER_TIMEOUT_S = 5.0
CHECK_EVERY = 256
STREAM_MESSAGES_MAX = 64
SLOTS = 64
SPEC = NamespaceSpec(model_id="atheris-play", num_layers=2, num_kv_heads=1, head_dim=32, block_tokens=16,
                     kv_dtype=DType.FLOAT32)
HIDDEN_SPEC = NamespaceSpec(model_id="atheris-hidden-" + os.urandom(8).hex(), num_layers=2, num_kv_heads=1,
                            head_dim=32, block_tokens=16, kv_dtype=DType.FLOAT32)
CHAIN_BLOCKS = 8


class Aborted(grpc.aio.AbortError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class Context:
    """What the handlers use of grpc.aio.ServicerContext."""

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise Aborted(code, details)

    def time_remaining(self) -> float | None:
        return None

    def invocation_metadata(self) -> tuple:
        return ()

    def cancelled(self) -> bool:
        return False


def chain_keys(seed: bytes, count: int) -> list[bytes]:
    keys, parent = [], seed
    for _ in range(count):
        parent = hashlib.sha256(parent).digest()
        keys.append(parent)
    return keys


def block(key: bytes, block_bytes: int) -> bytes:
    return (key * (block_bytes // len(key) + 1))[:block_bytes]


class Harness:
    def __init__(self) -> None:
        self.clock = ManualClock(1_000_000)
        self.engine = Engine(host_slot_count=SLOTS, host_slot_bytes=SPEC.block_bytes,
                             limits=EngineLimits(lease_ms_default=2000, lease_ms_max=60_000, max_leases=256,
                                                 max_pins_per_client=32, max_namespaces=16),
                             events=EventLog(256, 4096))
        # memfd files: libFuzzer's exit() leaves nothing behind.
        self.arena = HostArena(ArenaLayout.from_capacity(SLOTS * SPEC.block_bytes, SPEC.block_bytes), prefault=False)
        _, metrics = make_registry(self.engine)
        self.service = KvdService(self.engine, self.arena, self.clock, metrics, 1 << 20)
        self.handlers = method_handlers(self.service, lambda method: None)
        self.loop = asyncio.new_event_loop()
        self.inputs = 0
        self.play_id, self.play_keys = self._store(SPEC, b"play")
        hidden_id, hidden_keys = self._store(HIDDEN_SPEC, b"hidden")
        # Pinned by handles outside any lease: no input can end them.
        self.reference = engine_ops.acquire(self.engine, hidden_id, hidden_keys)
        assert len(self.reference) == CHAIN_BLOCKS

    def _store(self, spec: NamespaceSpec, seed: bytes) -> tuple[bytes, list[bytes]]:
        from kvd.client._wire import spec_message

        code, responses = self.call("RegisterNamespace",
                                    kvd_pb2.RegisterNamespaceRequest(spec=spec_message(spec)).SerializeToString())
        assert code == grpc.StatusCode.OK, code
        namespace_id = responses[0].namespace_id
        keys = chain_keys(seed, CHAIN_BLOCKS)
        request = kvd_pb2.PutInlineRequest(namespace_id=namespace_id, client_id="setup", keys=keys,
                                           blocks=[block(key, spec.block_bytes) for key in keys])
        code, responses = self.call("PutInline", request.SerializeToString())
        assert code == grpc.StatusCode.OK and responses[0].sealed == CHAIN_BLOCKS, (code, responses)
        return namespace_id, keys

    def call(self, method: str, payload: bytes) -> tuple[grpc.StatusCode, list]:
        handler = self.handlers[method]
        request = handler.request_deserializer(payload)
        context = Context()
        try:
            if handler.unary_unary is not None:
                responses = [self.loop.run_until_complete(
                    asyncio.wait_for(handler.unary_unary(request, context), HANDLER_TIMEOUT_S))]
            else:
                responses = self.loop.run_until_complete(
                    asyncio.wait_for(self._stream(handler.unary_stream(request, context), method), HANDLER_TIMEOUT_S))
        except Aborted as aborted:
            return aborted.code, []
        return grpc.StatusCode.OK, responses

    @staticmethod
    async def _stream(stream, method: str) -> list:
        messages = []
        try:
            async for message in stream:
                messages.append(message)
                if method == "WatchEvents" or len(messages) > STREAM_MESSAGES_MAX:
                    break  # WatchEvents never ends by itself
        finally:
            await stream.aclose()
        return messages

    def check_reference(self) -> None:
        for handle in self.reference:
            stored = bytes(self.arena.read(self.engine.host_slot(handle.block), HIDDEN_SPEC.block_bytes))
            assert stored == block(handle.block.key, HIDDEN_SPEC.block_bytes), "a pinned reference block changed"

    def one_input(self, data: bytes) -> None:
        if len(data) < 2:
            return
        method = METHODS[data[0] % len(METHODS)]
        self.clock.advance((data[1] & 0x0F) * 100)
        if data[1] & 0x80:
            self.engine.expire(self.clock.now_ms())
        code, _ = self.call(method, data[2:])
        if code != grpc.StatusCode.OK and code not in PRECISE:
            raise AssertionError(f"{method} answered {code.name}")
        self.engine.verify()
        self.inputs += 1
        if self.inputs % CHECK_EVERY == 0:
            self.check_reference()

    def seeds(self) -> list[bytes]:
        """A valid request of every method, about the stored chain."""
        play, keys = self.play_id, self.play_keys
        fresh = chain_keys(b"fresh", 3)
        from kvd.client._wire import spec_message

        requests = {
            "RegisterNamespace": kvd_pb2.RegisterNamespaceRequest(spec=spec_message(SPEC)),
            "ArenaInfo": kvd_pb2.ArenaInfoRequest(),
            "Lookup": kvd_pb2.LookupRequest(namespace_id=play, keys=keys),
            "Reserve": kvd_pb2.ReserveRequest(namespace_id=play, client_id="a", parent_key=keys[-1], keys=fresh),
            "Commit": kvd_pb2.CommitRequest(namespace_id=play, client_id="a", lease_id=3, ack=kvd_pb2.ACK_HOST),
            "PutInline": kvd_pb2.PutInlineRequest(namespace_id=play, client_id="a", keys=fresh,
                                                  blocks=[block(key, SPEC.block_bytes) for key in fresh]),
            "Get": kvd_pb2.GetRequest(namespace_id=play, client_id="a", keys=keys, lease_ms=1000),
            "GetLayers": kvd_pb2.GetRequest(namespace_id=play, client_id="b", keys=keys[:4]),
            "GetBlocks": kvd_pb2.GetRequest(namespace_id=play, client_id="c", keys=keys[:6]),
            "Release": kvd_pb2.ReleaseRequest(client_id="a", lease_ids=[3, 4]),
            "Renew": kvd_pb2.RenewRequest(client_id="a", lease_id=3, lease_ms=500),
            "Delete": kvd_pb2.DeleteRequest(namespace_id=play, keys=[keys[5]]),
            "Stats": kvd_pb2.StatsRequest(include_metrics=True),
            "WatchEvents": kvd_pb2.WatchEventsRequest(namespace_id=play, from_sequence=1),
            "EventSnapshot": kvd_pb2.EventSnapshotRequest(namespace_id=play),
            "Prefetch": kvd_pb2.PrefetchRequest(namespace_id=play, keys=keys, wait=True),
        }
        return [bytes([METHODS.index(method), 0]) + request.SerializeToString() for method, request in requests.items()]


def main(argv: list[str]) -> None:
    harness = Harness()
    corpus = [Path(arg) for arg in argv[1:] if not arg.startswith("-")]
    for directory in corpus[:1]:
        directory.mkdir(parents=True, exist_ok=True)
        if not any(directory.iterdir()):
            for number, seed in enumerate(harness.seeds()):
                (directory / f"seed-{number:02}").write_bytes(seed)
    atheris.Setup(argv, harness.one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
