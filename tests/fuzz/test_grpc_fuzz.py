"""Fuzzed requests to every RPC of one real daemon with tenants: a precise status for each, nothing altered.

Three fuzzers share the daemon of conftest.py (auth.mode = "token"):

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
    INTERNAL or UNKNOWN, every refused call counted; and that tenant
    owner's blocks are all there, and none of them reachable for fuzz.

Each call carries a credential drawn from conftest.CREDENTIALS. Every call
must end within its deadline with a status from PRECISE (or OK), never OK
for a request `certainly_invalid` refuses, and with details that are not an
internal error; and precisely (`expected_code`): UNAUTHENTICATED without a
token the daemon knows, NOT_FOUND for another tenant's namespace,
PERMISSION_DENIED for an administrative method (ADMIN_METHODS) of a tenant
that is not an admin. No inline Get ever serves a block of owner's. After every example the reference
blocks are checked bit-exact (conftest.FuzzTarget.check_reference).

KVD_FUZZ_EXAMPLES raises the number of examples of each fuzzer (`make
fuzz-long`); the defaults keep `make test` near half a minute.
"""

from __future__ import annotations

import time

import grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvd.server.auth import ADMIN_METHODS
from kvd.v1 import kvd_pb2
from tests.fuzz.conftest import (
    CALL_TIMEOUT_S,
    EXAMPLES,
    MAX_MESSAGE_BYTES,
    TOKENS,
    Credential,
    FuzzTarget,
    pick_credential,
    stub_of,
)
from tests.fuzz.strategies import (
    KEY_BYTES,
    METHODS,
    SERVICE,
    Pools,
    below,
    certainly_invalid,
    foreign_leases,
    foreign_namespace,
    request,
    summary,
)

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


def credential(data, label: str = "credential") -> Credential:
    return pick_credential(data.draw(st.integers(0, 99), label=label))


def invoke(target: FuzzTarget, method: str, message, credential_: Credential) -> tuple[grpc.StatusCode, str, list]:
    """Call `method` through its generated stub; (status, details, responses)."""
    callable_ = getattr(target.raw_stub, method)
    started = time.perf_counter()
    try:
        if SERVICE.methods_by_name[method].server_streaming:
            return grpc.StatusCode.OK, "", _stream(
                callable_(message, timeout=CALL_TIMEOUT_S, metadata=credential_.metadata), method)
        return grpc.StatusCode.OK, "", [callable_(message, timeout=CALL_TIMEOUT_S, metadata=credential_.metadata)]
    except grpc.RpcError as error:
        return error.code(), error.details() or "", []
    finally:
        target.seconds[method] += time.perf_counter() - started


def expected_code(method: str, message, credential_: Credential,
                  pools: Pools) -> tuple[grpc.StatusCode | None, str | None]:
    """The one status the call must end with (None: any precise one), and the refusal it counts."""
    if credential_.tenant is None:
        return grpc.StatusCode.UNAUTHENTICATED, credential_.reason
    if method in ADMIN_METHODS and credential_.tenant != "ops":
        return grpc.StatusCode.PERMISSION_DENIED, "not_admin"
    if message is not None and "namespace_id" in message.DESCRIPTOR.fields_by_name:
        # ops (an admin with no model) has no namespace at all.
        if credential_.tenant == "ops" and len(message.namespace_id) == KEY_BYTES:
            return grpc.StatusCode.NOT_FOUND, None
        if foreign_namespace(message, pools):
            return grpc.StatusCode.NOT_FOUND, None
    return None, None


def _oversized(request_bytes: int, code: grpc.StatusCode, details: str) -> bool:
    """gRPC refused the request message for its size, before kvd saw it (whoever sent it)."""
    return (code == grpc.StatusCode.RESOURCE_EXHAUSTED and request_bytes > MAX_MESSAGE_BYTES
            and "Received message larger than max" in details)


def check_status(target: FuzzTarget, method: str, message, code: grpc.StatusCode, details: str,
                 credential_: Credential, raw_bytes: int = 0) -> None:
    """raw_bytes: the size of a request sent as raw bytes (message None)."""
    target.outcomes[(method, code.name)] += 1
    described = f"{method}: {summary(message)} as {credential_.name} -> {code.name}: {details[:300]!r}"
    assert code != grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {CALL_TIMEOUT_S}s: {described}"
    expected, refusal = expected_code(method, message, credential_, target.pools)
    if refusal is not None:
        # Counted by the daemon whether or not the message turns out too large.
        target.refused[refusal] += 1
    request_bytes = message.ByteSize() if message is not None else raw_bytes
    if expected is not None and not _oversized(request_bytes, code, details):
        assert code == expected, f"not {expected.name}: {described}"
        if code == grpc.StatusCode.UNAUTHENTICATED:
            assert not any(token in details for token in TOKENS.values()), described
            return
    durable = method == "MakeDurable" or (
        method in ("Commit", "PutInline") and message is not None and message.ack == kvd_pb2.ACK_DURABLE)
    if durable and code != grpc.StatusCode.OK and ("asked to make durable" in details or "not durable" in details):
        # Committed, but not every block made durable: the message names which
        # (documented in the proto, MakeDurableRequest).
        assert code in PRECISE | {grpc.StatusCode.DEADLINE_EXCEEDED}, described
        return
    assert code == grpc.StatusCode.OK or code in PRECISE, f"imprecise status: {described}"
    if code != grpc.StatusCode.OK:
        assert details and "internal error" not in details and "Unexpected <class" not in details, described
        if code == grpc.StatusCode.PERMISSION_DENIED and message is not None:
            # "belongs to another client" would say that another tenant's lease exists.
            assert not any(f"lease {lease_id} " in details
                           for lease_id in foreign_leases(method, message, target.pools)), described
    elif message is not None:
        reason = certainly_invalid(method, message, target.pools)
        assert reason is None, f"accepted a request with {reason}: {described}"


def learn(target: FuzzTarget, method: str, message, responses: list, credential_: Credential) -> None:
    """Add what a successful call revealed to the pools; remember leases to release.

    Checks first that it revealed none of owner's blocks."""
    pools = target.pools
    if not responses:
        return
    first = responses[0]
    if method == "Get":
        assert not target.owner.revealed(first.blocks), f"{credential_.name} got owner's bytes: {summary(message)}"
    if credential_.tenant != "fuzz":
        return
    if method in ("Reserve", "Get", "GetLayers", "GetBlocks") and first.lease_id:
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
        calls.append((method, data.draw(strategies[method], label=method).message, credential(data)))
    if concurrent_:
        # All at once, unary ones as futures: the daemon sees them interleaved, tenants mixed.
        pending = []
        for method, message, credential_ in calls:
            if SERVICE.methods_by_name[method].server_streaming:
                pending.append((method, message, credential_, invoke(fuzz_target, method, message, credential_)))
            else:
                pending.append((method, message, credential_, getattr(fuzz_target.raw_stub, method).future(
                    message, timeout=CALL_TIMEOUT_S, metadata=credential_.metadata)))
        for method, message, credential_, outcome in pending:
            if isinstance(outcome, tuple):
                code, details, responses = outcome
            else:
                try:
                    code, details, responses = grpc.StatusCode.OK, "", [outcome.result()]
                except grpc.RpcError as error:
                    code, details, responses = error.code(), error.details() or "", []
            check_status(fuzz_target, method, message, code, details, credential_)
            learn(fuzz_target, method, message, responses, credential_)
    else:
        for method, message, credential_ in calls:
            code, details, responses = invoke(fuzz_target, method, message, credential_)
            check_status(fuzz_target, method, message, code, details, credential_)
            learn(fuzz_target, method, message, responses, credential_)
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
    credential_ = credential(data)
    streaming = SERVICE.methods_by_name[method].server_streaming
    make = fuzz_target.channel.unary_stream if streaming else fuzz_target.channel.unary_unary
    # Identity serializers: the bytes go out as they are, replies come back raw.
    call = make(_path(method), request_serializer=None, response_deserializer=None)
    started = time.perf_counter()
    try:
        if streaming:
            # Parsed here only to see WatchEvents' first message and stop.
            output_class = getattr(kvd_pb2, SERVICE.methods_by_name[method].output_type.name)
            stream = call(payload, timeout=CALL_TIMEOUT_S, metadata=credential_.metadata)
            for count, raw in enumerate(stream):
                if method == "WatchEvents" or count > STREAM_MESSAGES_MAX:
                    stream.cancel()
                    break
                output_class.FromString(raw)
        else:
            call(payload, timeout=CALL_TIMEOUT_S, metadata=credential_.metadata)
        code, details = grpc.StatusCode.OK, ""
    except grpc.RpcError as error:
        code, details = error.code(), error.details() or ""
    fuzz_target.seconds[method] += time.perf_counter() - started
    if code == grpc.StatusCode.CANCELLED and streaming:
        code = grpc.StatusCode.OK  # cancelled by us, above
    check_status(fuzz_target, method, None, code, details, credential_, raw_bytes=len(payload))
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
    """Run last in this module: every lease released, nothing pinned, no internal error,
    every refusal counted, owner's blocks intact and out of fuzz's reach."""
    fuzz_target.check_reference()
    owner = fuzz_target.owner
    check_tenants_apart(fuzz_target)
    calls = sum(fuzz_target.outcomes.values())
    methods = {method for method, _ in fuzz_target.outcomes}
    if EXAMPLES is None or EXAMPLES >= 100:
        assert methods == set(METHODS), f"never fuzzed: {set(METHODS) - methods}"
        assert calls >= 1000, f"only {calls} fuzzed calls"
    stub = fuzz_target.stub
    fuzz_target.opened.add((fuzz_target.holder, fuzz_target.holder_lease))
    # Owner's lease outlived every Release and Renew of fuzz's that named it.
    released = owner.stub.Release(kvd_pb2.ReleaseRequest(client_id=owner.client_id, lease_ids=[owner.lease_id]))
    assert released.released == 1
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
    # Every call refused for its credential, and only those, counted by reason.
    failures = {key.split('"')[1]: value for key, value in
                fuzz_target.daemon.metric_samples("kvd_auth_failures_total").items()}
    reasons = set(failures) | set(fuzz_target.refused)
    assert failures == {reason: float(fuzz_target.refused[reason]) for reason in reasons}, (
        failures, fuzz_target.refused)
    if EXAMPLES is None or EXAMPLES >= 100:
        assert all(failures.values()), failures
    # Unpinned now, and still bit-exact.
    fuzz_target.pinned.check(stub)
    owner.check(settled=True)


def check_tenants_apart(target: FuzzTarget) -> None:
    """fuzz's and ops's Lookups and Gets of owner's keys in owner's namespaces (its id or the
    daemon's) are NOT_FOUND; under the id and keys both have, fuzz gets only its own blocks."""
    owner, pools = target.owner, target.pools
    private = owner.private
    for tenant in ("fuzz", "ops"):
        stub = stub_of(target.channel, tenant)
        for namespace_id in pools.foreign_namespace_ids:
            for call, message in (
                    (stub.Lookup, kvd_pb2.LookupRequest(namespace_id=namespace_id, keys=private.keys)),
                    (stub.Get, kvd_pb2.GetRequest(namespace_id=namespace_id, client_id="fuzz-checker",
                                                  keys=private.keys, inline=True)),
                    (stub.Get, kvd_pb2.GetRequest(namespace_id=namespace_id, client_id=owner.client_id,
                                                  keys=private.keys))):
                try:
                    call(message)
                except grpc.RpcError as error:
                    assert error.code() == grpc.StatusCode.NOT_FOUND, (tenant, error.details())
                else:
                    raise AssertionError(f"{tenant} reached owner's namespace {namespace_id.hex()[:16]}")
    got = target.stub.Get(kvd_pb2.GetRequest(namespace_id=owner.aliased.namespace_id, client_id="fuzz-checker",
                                             keys=owner.aliased.keys, inline=True))
    assert not owner.revealed(got.blocks), "fuzz's Get of its own play chain served owner's bytes"
    assert not target.fuzz_arena.rows_holding(owner.secrets)
