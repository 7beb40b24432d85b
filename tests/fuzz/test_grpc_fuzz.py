"""Fuzzed requests to every RPC of one real daemon: a precise status for each, nothing altered.

Three fuzzers share the daemon of conftest.py:

  * sequences of requests built from the proto descriptors
    (strategies.py), sent through the generated stubs one after another or
    all at once, with lease ids, keys and namespaces taken from earlier
    responses (out-of-order commits, foreign and stale leases, chains
    reversed, keys of the wrong length, 65,537 keys, 5 MiB payloads,
    unknown enum values...);
  * raw bytes that are not a valid message, and valid messages with bytes
    flipped, cut or appended, through a generic channel call;
  * a last test that releases every lease the fuzzers were given and
    checks the daemon's books: no lease, pin or handle left, no RPC ended
    INTERNAL or UNKNOWN.

Every call must end within its deadline with a status from PRECISE (or OK),
never OK for a request `certainly_invalid` refuses, and with details that
are not an internal error. After every example the reference blocks are
checked bit-exact (conftest.FuzzTarget.check_reference).

KVD_FUZZ_EXAMPLES raises the number of examples of each fuzzer (`make
fuzz-long`); the defaults keep `make test` near half a minute.
"""

from __future__ import annotations

import time

import grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvd.v1 import kvd_pb2
from tests.fuzz.conftest import CALL_TIMEOUT_S, EXAMPLES, FuzzTarget
from tests.fuzz.strategies import METHODS, SERVICE, below, certainly_invalid, request, summary

PRECISE = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.ALREADY_EXISTS,
}
SEQUENCE_EXAMPLES = EXAMPLES or 400
RAW_EXAMPLES = EXAMPLES or 500
MAX_SEQUENCE_CALLS = 12
STREAM_MESSAGES_MAX = 64
FUZZ_SETTINGS = dict(
    deadline=None,
    # `make test` replays the same examples every run (a failure in CI can
    # be rerun as it was); with KVD_FUZZ_EXAMPLES each run draws new ones.
    derandomize=EXAMPLES is None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example,
                           HealthCheck.filter_too_much],
)


def _path(method: str) -> str:
    return f"/{SERVICE.full_name}/{method}"


def _stream(call, method: str) -> list:
    """Read a server stream: WatchEvents until its first message (it never ends by itself)."""
    messages = []
    for message in call:
        messages.append(message)
        if method == "WatchEvents" and message.kind == kvd_pb2.KV_EVENT_KIND_WATCHING:
            call.cancel()
            break
        assert len(messages) <= STREAM_MESSAGES_MAX, f"{method} sent more than {STREAM_MESSAGES_MAX} messages"
    return messages


def invoke(target: FuzzTarget, method: str, message) -> tuple[grpc.StatusCode, str, list]:
    """Call `method` through its generated stub; (status, details, responses)."""
    callable_ = getattr(target.stub, method)
    started = time.perf_counter()
    try:
        if SERVICE.methods_by_name[method].server_streaming:
            return grpc.StatusCode.OK, "", _stream(callable_(message, timeout=CALL_TIMEOUT_S), method)
        return grpc.StatusCode.OK, "", [callable_(message, timeout=CALL_TIMEOUT_S)]
    except grpc.RpcError as error:
        return error.code(), error.details() or "", []
    finally:
        target.seconds[method] += time.perf_counter() - started


def check_status(target: FuzzTarget, method: str, message, code: grpc.StatusCode, details: str) -> None:
    target.outcomes[(method, code.name)] += 1
    described = f"{method}: {summary(message)} -> {code.name}: {details[:300]!r}"
    assert code != grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {CALL_TIMEOUT_S}s: {described}"
    durable = method in ("Commit", "PutInline") and message is not None and message.ack == kvd_pb2.ACK_DURABLE
    if code == grpc.StatusCode.UNAVAILABLE and durable:
        # Committed, but not made durable in time (documented in the proto).
        assert "could not be made durable" in details, described
        return
    assert code == grpc.StatusCode.OK or code in PRECISE, f"imprecise status: {described}"
    if code != grpc.StatusCode.OK:
        assert details and "internal error" not in details and "Unexpected <class" not in details, described
    elif message is not None:
        reason = certainly_invalid(method, message, target.pools)
        assert reason is None, f"accepted a request with {reason}: {described}"


def learn(target: FuzzTarget, method: str, message, responses: list) -> None:
    """Add what a successful call revealed to the pools; remember leases to release."""
    pools = target.pools
    if not responses:
        return
    first = responses[0]
    if method in ("Reserve", "Get", "GetLayers") and first.lease_id:
        pools.saw_lease(first.lease_id)
        target.opened.add((message.client_id, first.lease_id))
    elif method == "PutInline" and first.sealed and message.namespace_id in pools.namespace_ids:
        pools.chains.append(list(message.keys))
        del pools.chains[3:-16]  # the fixture's chains stay, plus the newest fuzzed ones
    elif method == "RegisterNamespace" and first.namespace_id not in pools.namespace_ids:
        pools.namespace_ids.append(first.namespace_id)
        pools.other_block_bytes.append(first.block_bytes)
        del pools.namespace_ids[2:-6]
        del pools.other_block_bytes[1:-6]


REQUESTS: dict = {}


def _requests(target: FuzzTarget) -> dict:
    if not REQUESTS:
        REQUESTS.update({method: request(method, target.pools) for method in METHODS})
    return REQUESTS


@settings(max_examples=SEQUENCE_EXAMPLES, **FUZZ_SETTINGS)
@given(data=st.data())
def test_fuzzed_request_sequences(fuzz_target: FuzzTarget, data):
    strategies = _requests(fuzz_target)
    count = data.draw(st.integers(1, MAX_SEQUENCE_CALLS), label="calls")
    concurrent_ = data.draw(st.integers(0, 3), label="concurrent") == 0
    calls = []
    for _ in range(count):
        method = data.draw(st.sampled_from(METHODS), label="method")
        calls.append((method, data.draw(strategies[method], label=method).message))
    if concurrent_:
        # All at once, unary ones as futures: the daemon sees them interleaved.
        pending = []
        for method, message in calls:
            if SERVICE.methods_by_name[method].server_streaming:
                pending.append((method, message, invoke(fuzz_target, method, message)))
            else:
                pending.append((method, message, getattr(fuzz_target.stub, method).future(message,
                                                                                        timeout=CALL_TIMEOUT_S)))
        for method, message, outcome in pending:
            if isinstance(outcome, tuple):
                code, details, responses = outcome
            else:
                try:
                    code, details, responses = grpc.StatusCode.OK, "", [outcome.result()]
                except grpc.RpcError as error:
                    code, details, responses = error.code(), error.details() or "", []
            check_status(fuzz_target, method, message, code, details)
            learn(fuzz_target, method, message, responses)
    else:
        for method, message in calls:
            code, details, responses = invoke(fuzz_target, method, message)
            check_status(fuzz_target, method, message, code, details)
            learn(fuzz_target, method, message, responses)
    fuzz_target.check_reference()


def _mutated(method: str) -> st.SearchStrategy[bytes]:
    """A serialized request of `method` with bytes flipped, cut, or junk appended."""
    example = request(method, _POOLS_FOR_RAW[0])

    @st.composite
    def mutate(draw):
        data = bytearray(draw(example).message.SerializeToString())
        for _ in range(draw(st.integers(1, 4))):
            kind = draw(st.integers(0, 3))
            if kind == 0 and data:
                data[below(draw, len(data))] ^= 1 << draw(st.integers(0, 7))
            elif kind == 1 and data:
                del data[below(draw, len(data)):]
            elif kind == 2:
                data += draw(st.binary(min_size=1, max_size=16))
            else:
                data[0:0] = draw(st.sampled_from([b"\xff", b"\x0a\xff\xff\xff\xff\x0f", b"\x08", b"\x12\x80\x80\x80"]))
        return RawBytes(bytes(data))

    return mutate()


class RawBytes(bytes):
    """Bytes with a short repr (Hypothesis prints each draw as it is drawn)."""

    def __repr__(self) -> str:
        return f"<{len(self)} bytes {self[:24].hex()}{'...' if len(self) > 24 else ''}>"

    def _repr_pretty_(self, printer, cycle) -> None:
        printer.text(repr(self))


_POOLS_FOR_RAW: list = []


@settings(max_examples=RAW_EXAMPLES, **FUZZ_SETTINGS)
@given(data=st.data())
def test_raw_bytes_to_every_method(fuzz_target: FuzzTarget, data):
    if not _POOLS_FOR_RAW:
        _POOLS_FOR_RAW.append(fuzz_target.pools)
    method = data.draw(st.sampled_from(METHODS), label="method")
    payload = bytes(data.draw(st.one_of(st.binary(max_size=200), _mutated(method)), label="payload"))
    streaming = SERVICE.methods_by_name[method].server_streaming
    make = fuzz_target.channel.unary_stream if streaming else fuzz_target.channel.unary_unary
    # Identity serializers: the bytes go out as they are, replies come back raw.
    call = make(_path(method), request_serializer=None, response_deserializer=None)
    try:
        if streaming:
            # Parsed here only to see WatchEvents' first message and stop.
            output_class = getattr(kvd_pb2, SERVICE.methods_by_name[method].output_type.name)
            stream = call(payload, timeout=CALL_TIMEOUT_S)
            for count, raw in enumerate(stream):
                if method == "WatchEvents" or count > STREAM_MESSAGES_MAX:
                    stream.cancel()
                    break
                output_class.FromString(raw)
        else:
            call(payload, timeout=CALL_TIMEOUT_S)
        code, details = grpc.StatusCode.OK, ""
    except grpc.RpcError as error:
        code, details = error.code(), error.details() or ""
    if code == grpc.StatusCode.CANCELLED and streaming:
        code = grpc.StatusCode.OK  # cancelled by us, above
    check_status(fuzz_target, method, None, code, details)
    if data.draw(st.integers(0, 9), label="check") == 0:
        fuzz_target.check_reference()


def _wait_for_metric(target: FuzzTarget, name: str, value: float, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        current = sum(target.daemon.metric_samples(name).values())
        if current == value:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{name} is {current}, not {value}, {timeout_s}s after the fuzzers stopped")
        time.sleep(0.1)


def test_daemon_books_balance_after_fuzzing(fuzz_target: FuzzTarget):
    """Run last in this module: every lease released, nothing pinned, no internal error."""
    fuzz_target.check_reference()
    calls = sum(fuzz_target.outcomes.values())
    methods = {method for method, _ in fuzz_target.outcomes}
    if EXAMPLES is None or EXAMPLES >= 100:
        assert methods == set(METHODS), f"never fuzzed: {set(METHODS) - methods}"
        assert calls >= 1000, f"only {calls} fuzzed calls"
    stub = fuzz_target.stub
    fuzz_target.opened.add((fuzz_target.holder, fuzz_target.holder_lease))
    for client_id, lease_id in sorted(fuzz_target.opened):
        try:
            stub.Release(kvd_pb2.ReleaseRequest(client_id=client_id, lease_ids=[lease_id]), timeout=CALL_TIMEOUT_S)
        except grpc.RpcError as error:
            # Ended already: committed, expired, or released by a fuzzed call.
            assert error.code() == grpc.StatusCode.NOT_FOUND, error.details()
    for name in ("kvd_leases", "kvd_lease_pinned_blocks", "kvd_tier_pinned_blocks", "kvd_rpc_in_flight"):
        _wait_for_metric(fuzz_target, name, 0.0)
    rpcs = fuzz_target.daemon.metric_samples("kvd_rpc_total")
    bad = {key: value for key, value in rpcs.items() if 'code="INTERNAL"' in key or 'code="UNKNOWN"' in key}
    assert not bad, f"RPCs that ended in an internal error: {bad}"
    assert sum(fuzz_target.daemon.metric_samples("kvd_leaked_handles_total").values()) == 0
    # Unpinned now, and still bit-exact.
    pinned = fuzz_target.pinned
    got = stub.Get(kvd_pb2.GetRequest(namespace_id=pinned.namespace_id, client_id="fuzz-checker", keys=pinned.keys,
                                      inline=True), timeout=CALL_TIMEOUT_S)
    assert b"".join(got.blocks) == pinned.blocks
