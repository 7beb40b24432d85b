"""The device plane against a real daemon in another process ([device] kind = "cpu"): this test
process plays the engine, with its paged KV pool in CPU-device memory (memfd) that the daemon maps
through IPC handles. Saves and loads are driven by kvd layer by layer through flag words; the
bytes must match what the ordinary Get returns; bad registrations get precise errors; mappings are
counted and closed on unregister and on lease expiry. Every test runs twice: against a daemon whose
CPU device is synchronous, and against one in asynchronous mode, whose copies and flag stores land
later than it issues them, as a GPU's do."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from kvd import arena_protocol
from kvd.client import Client
from kvd.client.device import FAILED, DevicePool
from kvd.core.keys import DType, NamespaceSpec, chain_keys
from kvd.device import IpcHandle, open_device
from kvd.device.cpu import DELAY_ENV
from kvd.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from kvd.testing.daemon import run_daemon

SPEC = NamespaceSpec(model_id="device-plane-model", num_layers=4, num_kv_heads=2, head_dim=16, block_tokens=16,
                     kv_dtype=DType.FLOAT32)
PAGES = 32
ENGINE, KVD = 0, 1


@pytest.fixture(scope="module", params=["synchronous", "asynchronous"])
def daemon(tmp_path_factory, request):
    config = {"host": {"capacity_bytes": 16 << 20, "slot_bytes": 64 << 10},
              "device": {"kind": "cpu", "flag_timeout_ms": 400, "pool_lease_ms": 1000},
              "leases": {"sweep_interval_ms": 50}}
    env = {DELAY_ENV: "5" if request.param == "asynchronous" else "0"}
    with run_daemon(tmp_path_factory.mktemp("kvd"), config=config, env=env) as process:
        yield process


@pytest.fixture
def client(daemon):
    with Client(daemon.unix_target) as client:
        yield client


class Engine:
    """A paged KV pool of PAGES pages per layer in CPU-device memory, and a view to fill and read it."""

    def __init__(self, client, device=None, arena_socket: Path | None = None, own_memory: bool = False,
                 io_ring: bool = False) -> None:
        """own_memory: the pool is ordinary memory of this process (as a CPU engine's tensors),
        shared as process memory over the arena socket; io_ring: disk hits come through its I/O ring."""
        self.device = device or open_device("cpu")
        self.namespace = client.register_namespace(SPEC)
        if own_memory:
            self.arrays = [np.zeros((PAGES, SPEC.layer_bytes // 4), dtype=np.float32) for _ in range(SPEC.num_layers)]
            self.layers = [self.device.wrap(array.ctypes.data, array.nbytes) for array in self.arrays]
        else:
            self.layers = [self.device.alloc(PAGES * SPEC.layer_bytes) for _ in range(SPEC.num_layers)]
        self.views = [np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * memory.nbytes).from_address(
            memory.address)).view(np.float32).reshape(PAGES, -1) for memory in self.layers]
        self.pool = DevicePool(client, self.namespace, self.device, self.layers, PAGES, arena_socket=arena_socket,
                               io_ring=io_ring)

    def write(self, page: int, block: np.ndarray) -> None:
        """Every layer of one page (the block's layer l in layer l's memory)."""
        for layer in range(SPEC.num_layers):
            self.views[layer][page] = block[layer].reshape(-1)

    def read(self, page: int) -> np.ndarray:
        return np.stack([self.views[layer][page].reshape(SPEC.block_shape[1:]) for layer in range(SPEC.num_layers)])

    def close(self) -> None:
        self.pool.close()


def blocks(count: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((count, *SPEC.block_shape), dtype=np.float32)


def keys_for(seed: int, count: int) -> list[bytes]:
    return chain_keys(SPEC, np.arange(count * SPEC.block_tokens) + seed * 100_000)


def save_as_engine(engine: Engine, keys, pages, data: np.ndarray, base: int, **options):
    """Save while computing: layer l of every page is written only once kvd has taken layer l - 1 out
    (its flag), then marked written. A kvd that copied a layer before its mark would store the page's
    old bytes for it."""
    result = {}
    saving = threading.Thread(target=lambda: result.update(response=engine.pool.save(keys, pages, ENGINE, KVD, base,
                                                                                     **options)))
    saving.start()
    for layer in range(SPEC.num_layers):
        for page, block in zip(pages, data):
            engine.views[layer][page] = block[layer].reshape(-1)
        engine.pool.mark(ENGINE, base + layer + 1)
        wait_for(lambda: engine.pool.flag(KVD) >= base + layer + 1 or not saving.is_alive())
    saving.join(timeout=30)
    assert not saving.is_alive()
    return result["response"]


def test_a_save_follows_the_engines_layers_and_a_load_brings_the_same_bytes_back(client):
    engine = Engine(client)
    data, keys = blocks(6, seed=1), keys_for(1, 6)
    pages = [3, 7, 0, 31, 12, 5]
    for page in pages:
        engine.write(page, np.full(SPEC.block_shape, -1.0, dtype=np.float32))  # what a layer held before
    base = engine.pool.flag(ENGINE)
    response = save_as_engine(engine, keys, pages, data, base)
    assert response.stored == 6 and response.done_value == base + SPEC.num_layers
    assert engine.pool.flag(KVD) == response.done_value
    np.testing.assert_array_equal(client.get_numpy(engine.namespace, keys), data)

    target_pages = [20, 21, 22, 23, 24, 25]
    base = engine.pool.flag(KVD)
    loaded = engine.pool.load(keys + keys_for(99, 2)[:1], target_pages + [26], KVD, base)
    assert loaded.matched == 6 and loaded.done_value == base + SPEC.num_layers
    wait_for(lambda: engine.pool.flag(KVD) >= loaded.done_value)
    for page, block in zip(target_pages, data):
        np.testing.assert_array_equal(engine.read(page), block)
    assert not engine.read(26).any(), "a page past the matched prefix was written"
    engine.close()


def test_a_pool_that_keeps_k_and_v_apart_as_vllm_does_saves_and_loads_the_same_blocks(client):
    """vLLM's layer is [2, num_blocks, block_size, heads, head_dim]: a page's K half and V half are
    num_blocks half-pages apart. kvd's blocks are [layers, 2, ...]: the bytes must end up the same."""
    device = open_device("cpu")
    namespace = client.register_namespace(SPEC)
    half = SPEC.layer_bytes // 2
    layers = [device.alloc(2 * PAGES * half) for _ in range(SPEC.num_layers)]
    kv = [np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * memory.nbytes).from_address(memory.address))
          .view(np.float32).reshape(2, PAGES, -1) for memory in layers]
    pool = DevicePool(client, namespace, device, layers, PAGES, page_stride=half, v_offset=PAGES * half)
    data, keys, pages = blocks(3, seed=8), keys_for(8, 3), [30, 1, 17]
    for layer in range(SPEC.num_layers):
        for page, block in zip(pages, data):
            kv[layer][0, page] = block[layer, 0].reshape(-1)
            kv[layer][1, page] = block[layer, 1].reshape(-1)
    base = pool.flag(ENGINE)
    pool.mark(ENGINE, base + SPEC.num_layers)  # every layer written already
    assert pool.save(keys, pages, ENGINE, KVD, base).stored == 3
    np.testing.assert_array_equal(client.get_numpy(namespace, keys), data)
    loaded = pool.load(keys, [2, 3, 4], KVD, pool.flag(KVD))
    wait_for(lambda: pool.flag(KVD) >= loaded.done_value)
    for page, block in zip([2, 3, 4], data):
        for layer in range(SPEC.num_layers):
            np.testing.assert_array_equal(kv[layer][0, page], block[layer, 0].reshape(-1))
            np.testing.assert_array_equal(kv[layer][1, page], block[layer, 1].reshape(-1))
    assert not kv[0][:, 5:16].any(), "pages that were not loaded were written"
    pool.close()
    with pytest.raises(grpc.RpcError) as error:  # a V offset that runs past the memory
        DevicePool(client, namespace, device, layers, PAGES, page_stride=half, v_offset=PAGES * half + 4096)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "layers[0] holds" in error.value.details()


def test_a_load_of_nothing_stored_still_releases_every_layer(client):
    engine = Engine(client)
    loaded = engine.pool.load(keys_for(50, 3), [0, 1, 2], KVD, 40)
    assert loaded.matched == 0 and loaded.done_value == 40 + SPEC.num_layers
    wait_for(lambda: engine.pool.flag(KVD) == loaded.done_value)
    assert not any(engine.read(page).any() for page in range(3))
    engine.close()


def test_a_load_cancelled_before_kvd_issues_it_writes_no_page_and_fails_its_flag(client):
    engine = Engine(client)
    data, keys = blocks(3, 61), keys_for(61, 3)
    assert client.put(engine.namespace, keys, data) == 3  # in host memory: all would be issued at once
    engine.pool.mark(5, 70)  # the engine gave up on the load of base 70 before asking
    loaded = engine.pool.load(keys, [0, 1, 2], KVD, 70, cancel_flag=5)
    assert loaded.matched == 3 and loaded.done_value == 70 + SPEC.num_layers
    wait_for(lambda: engine.pool.flag(KVD) & FAILED)
    assert engine.pool.flag(KVD) == FAILED | loaded.done_value
    assert not any(engine.read(page).any() for page in range(3))
    # A cancel word holding an older load's cancel does not stop this one.
    again = engine.pool.load(keys, [3, 4, 5], KVD, 80, cancel_flag=5)
    wait_for(lambda: engine.pool.flag(KVD) == again.done_value)
    for page, block in zip([3, 4, 5], data):
        np.testing.assert_array_equal(engine.read(page), block)
    engine.close()


def test_an_engine_that_never_writes_its_layer_gets_deadline_exceeded_and_nothing_is_stored(client):
    engine = Engine(client)
    keys = keys_for(2, 3)
    engine.pool.mark(ENGINE, 1)  # layer 0 written, never layer 1
    with pytest.raises(grpc.RpcError) as error:
        engine.pool.save(keys, [0, 1, 2], ENGINE, KVD, 0)
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "flag word 0 did not reach 2" in error.value.details()
    assert engine.pool.flag(KVD) == FAILED | SPEC.num_layers  # kvd reads the pages no more
    assert client.lookup(engine.namespace, keys).matched == 0
    # The same blocks save fine afterwards (their reservation was given back).
    response = save_as_engine(engine, keys, [0, 1, 2], blocks(3, seed=2), 10)
    assert response.stored == 3
    engine.close()


def test_unregistering_a_pool_while_a_save_is_still_copying_waits_for_the_save(client, daemon):
    """The save's worker is waiting for layer 1 when the engine unregisters: the mappings must stay
    until the save has ended (here by its deadline), and the daemon serves on."""
    engine = Engine(client)
    keys = keys_for(7, 2)
    engine.pool.mark(ENGINE, 1)
    outcome = {}

    def save() -> None:
        try:
            engine.pool.save(keys, [0, 1], ENGINE, KVD, 0)
        except grpc.RpcError as error:
            outcome["code"] = error.code()

    saving = threading.Thread(target=save)
    saving.start()
    wait_for(lambda: engine.pool.flag(KVD) >= 1)  # layer 0 is out: the save is past its reservation
    engine.close()  # answers once the save ended and the pool's mappings are closed
    saving.join(timeout=30)
    assert outcome == {"code": grpc.StatusCode.DEADLINE_EXCEEDED}
    assert _mapped_allocations(daemon.process.pid) == set()
    assert client.lookup(engine.namespace, keys).matched == 0


def codes_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as error:
        call()
    return error.value.code(), error.value.details()


def test_registrations_kvd_cannot_use_are_refused_precisely(client, tmp_path):
    device = open_device("cpu")
    namespace = client.register_namespace(SPEC)
    layers = [device.alloc(PAGES * SPEC.layer_bytes) for _ in range(SPEC.num_layers)]
    handles = [device.export(memory).to_bytes() for memory in layers]
    flags = device.export(device.alloc(512)).to_bytes()
    register = client.register_pool
    cases = {
        "too few layers": (lambda: register(namespace, handles[:3], PAGES, flags),
                           grpc.StatusCode.INVALID_ARGUMENT, "3 IPC handles for a namespace of 4 layers"),
        "garbage handle": (lambda: register(namespace, [b"junk", *handles[1:]], PAGES, flags),
                           grpc.StatusCode.INVALID_ARGUMENT, "layers[0]: not a kvd IPC handle"),
        "pages past the memory": (lambda: register(namespace, handles, PAGES + 1, flags),
                                  grpc.StatusCode.INVALID_ARGUMENT, "layers[0] holds"),
        "another device": (lambda: register(namespace, [_with(handles[0], device_uuid="0" * 36), *handles[1:]],
                                            PAGES, flags), grpc.StatusCode.FAILED_PRECONDITION, "not of this kvd's"),
        "another kind": (lambda: register(namespace, [_with(handles[0], kind="cuda"), *handles[1:]], PAGES, flags),
                         grpc.StatusCode.FAILED_PRECONDITION, "memory of a 'cuda' device"),
        "not device memory": (lambda: register(namespace, [_file_handle(device, tmp_path), *handles[1:]], PAGES,
                                               flags), grpc.StatusCode.FAILED_PRECONDITION, "is not CPU device memory"),
        "a process that is gone": (lambda: register(namespace, [_with(handles[0], pid=2 ** 22 + 7), *handles[1:]],
                                                    PAGES, flags), grpc.StatusCode.FAILED_PRECONDITION, "cannot open"),
        "no pages": (lambda: register(namespace, handles, 0, flags), grpc.StatusCode.INVALID_ARGUMENT,
                     "num_blocks must be"),
    }
    for name, (call, code, words) in cases.items():
        got_code, details = codes_of(call)
        assert (got_code, words in details) == (code, True), (name, got_code, details)
    # Nothing stayed mapped from the refused registrations, and the daemon serves on.
    assert client.lookup(namespace, keys_for(3, 1)).matched == 0


def test_transfers_on_a_pool_kvd_does_not_know_or_out_of_its_bounds_are_refused(client, daemon):
    engine = Engine(client)
    keys = keys_for(4, 2)
    cases = {
        "page past the pool": (lambda: engine.pool.load(keys, [0, PAGES], KVD, 0), grpc.StatusCode.INVALID_ARGUMENT,
                               f"pages must be in [0, {PAGES})"),
        "fewer pages than keys": (lambda: engine.pool.load(keys, [0], KVD, 0), grpc.StatusCode.INVALID_ARGUMENT,
                                  "pages: 1 for 2 keys"),
        "flag past the words": (lambda: engine.pool.save(keys, [0, 1], 64, KVD, 0), grpc.StatusCode.INVALID_ARGUMENT,
                                "engine_flag 64 is past the pool's 64 flag words"),
        "base at the top bit": (lambda: engine.pool.load(keys, [0, 1], KVD, 2 ** 63 - 2),
                                grpc.StatusCode.INVALID_ARGUMENT, "base must be below 2**63"),
        "unknown pool": (lambda: client.load_layers(engine.namespace, engine.pool.pool_id + 1000, keys, [0, 1], KVD,
                                                    0), grpc.StatusCode.NOT_FOUND, "no pool"),
        "cancel word past the words": (lambda: engine.pool.load(keys, [0, 1], KVD, 0, cancel_flag=64),
                                       grpc.StatusCode.INVALID_ARGUMENT, "cancel_flag 64 is past the pool's 64"),
        "cancel word is the flag": (lambda: engine.pool.load(keys, [0, 1], KVD, 0, cancel_flag=KVD),
                                    grpc.StatusCode.INVALID_ARGUMENT, "cancel_flag must be a word other than kvd_flag"),
    }
    for name, (call, code, words) in cases.items():
        got_code, details = codes_of(call)
        assert (got_code, words in details) == (code, True), (name, got_code, details)
    with Client(daemon.unix_target) as other:  # another client cannot use this one's pool
        got_code, _ = codes_of(lambda: other.load_layers(engine.namespace, engine.pool.pool_id, keys, [0, 1], KVD, 0))
        assert got_code == grpc.StatusCode.NOT_FOUND
    engine.close()
    got_code, _ = codes_of(lambda: engine.pool.load(keys, [0, 1], KVD, 0))
    assert got_code == grpc.StatusCode.NOT_FOUND


def test_mappings_are_shared_counted_and_closed_on_unregister_and_on_lease_expiry(client, daemon):
    device = open_device("cpu")
    engine = Engine(client, device)
    pid = daemon.process.pid
    first = _mapped_allocations(pid)
    assert len(first) == SPEC.num_layers + 1  # each layer and the flag words
    second = DevicePool(client, engine.namespace, device, engine.layers, PAGES)
    assert len(_mapped_allocations(pid)) == SPEC.num_layers + 2  # the layers mapped once; two flag memories
    second.close()
    assert _mapped_allocations(pid) == first
    engine.close()
    assert _mapped_allocations(pid) == set()
    # A pool nobody uses for its lease (1 s here) is unregistered and unmapped by the daemon's sweep.
    abandoned = Engine(client, device)
    assert len(_mapped_allocations(pid)) == SPEC.num_layers + 1
    wait_for(lambda: not _mapped_allocations(pid), timeout_s=20)
    got_code, _ = codes_of(lambda: abandoned.pool.load(keys_for(5, 1), [0], KVD, 0))
    assert got_code == grpc.StatusCode.NOT_FOUND


def test_a_pool_passed_as_descriptors_over_the_arena_socket_saves_and_loads(client, daemon):
    """The path for an engine the daemon cannot reach by pid (another container): no /proc involved."""
    socket_path = arena_protocol.socket_path_for_target(daemon.unix_target)
    client.register_namespace(SPEC)  # the client's connection is open before the count
    descriptors = _open_descriptors(daemon.process.pid)
    engine = Engine(client, arena_socket=socket_path)
    data, keys, pages = blocks(4, seed=6), keys_for(6, 4), [9, 2, 30, 4]
    response = save_as_engine(engine, keys, pages, data, engine.pool.flag(ENGINE))
    assert response.stored == 4
    np.testing.assert_array_equal(client.get_numpy(engine.namespace, keys), data)
    loaded = engine.pool.load(keys, [10, 11, 12, 13], KVD, engine.pool.flag(KVD))
    wait_for(lambda: engine.pool.flag(KVD) >= loaded.done_value)
    for page, block in zip([10, 11, 12, 13], data):
        np.testing.assert_array_equal(engine.read(page), block)
    engine.close()
    assert _mapped_allocations(daemon.process.pid) == set()
    assert _open_descriptors(daemon.process.pid) == descriptors  # the deposit's copies were all closed


def test_a_pool_in_the_engines_own_memory_is_shared_as_process_memory(client, daemon):
    """A CPU engine's KV tensors are ordinary memory: it passes a descriptor of its own /proc/self/mem,
    and kvd's copies read and write the pages through it, bit-exact, nothing else touched."""
    socket_path = arena_protocol.socket_path_for_target(daemon.unix_target)
    client.register_namespace(SPEC)
    descriptors = _open_descriptors(daemon.process.pid)
    engine = Engine(client, arena_socket=socket_path, own_memory=True)
    data, keys, pages = blocks(5, seed=7), keys_for(7, 5), [1, 30, 4, 17, 8]
    response = save_as_engine(engine, keys, pages, data, engine.pool.flag(ENGINE))
    assert response.stored == 5
    np.testing.assert_array_equal(client.get_numpy(engine.namespace, keys), data)
    before = [array.copy() for array in engine.arrays]
    target = [11, 12, 13, 14, 15]
    loaded = engine.pool.load(keys, target, KVD, engine.pool.flag(KVD))
    assert loaded.matched == 5
    wait_for(lambda: engine.pool.flag(KVD) >= loaded.done_value)
    for page, block in zip(target, data):
        np.testing.assert_array_equal(engine.read(page), block)
    others = [page for page in range(PAGES) if page not in target]
    for array, old in zip(engine.arrays, before):
        np.testing.assert_array_equal(array[others], old[others])
    engine.close()
    assert _open_descriptors(daemon.process.pid) == descriptors


def test_process_memory_kvd_cannot_use_is_refused_precisely(client, daemon):
    socket_path = arena_protocol.socket_path_for_target(daemon.unix_target)
    device = open_device("cpu")
    namespace = client.register_namespace(SPEC)
    flags = device.alloc(512)
    mine = os.open("/proc/self/mem", os.O_RDWR)
    ticket = arena_protocol.deposit_fds(socket_path, None, [mine] * SPEC.num_layers + [device.export_fd(flags)])
    flags_handle = IpcHandle("cpu", device.uuid, f"deposit:{ticket}:{SPEC.num_layers}".encode(), 0, 512).to_bytes()
    # Address 4096 is never mapped: the registration is refused before any copy.
    layers = [IpcHandle("cpu", device.uuid, f"deposit:{ticket}:{i}".encode(), 4096, PAGES * SPEC.layer_bytes)
              .to_bytes() for i in range(SPEC.num_layers)]
    got_code, details = codes_of(lambda: client.register_pool(namespace, layers, PAGES, flags_handle))
    assert got_code == grpc.StatusCode.FAILED_PRECONDITION and "not readable memory" in details, details
    # Shared process memory goes by descriptor only: no handle by pid.
    with pytest.raises(Exception, match="shared as a descriptor"):
        device.export(device.wrap(flags.address, 512))
    os.close(mine)
    device.free(flags)


def test_deposits_kvd_cannot_use_are_refused_precisely(client, daemon, tmp_path):
    socket_path = arena_protocol.socket_path_for_target(daemon.unix_target)
    device = open_device("cpu")
    namespace = client.register_namespace(SPEC)
    layers = [device.alloc(PAGES * SPEC.layer_bytes) for _ in range(SPEC.num_layers)]
    flags = device.alloc(512)
    fds = [device.export_fd(memory) for memory in [*layers, flags]]
    ticket = arena_protocol.deposit_fds(socket_path, None, fds)

    def handle(index: int, nbytes: int, name: str = ticket) -> bytes:
        return IpcHandle("cpu", device.uuid, f"deposit:{name}:{index}".encode(), 0, nbytes).to_bytes()

    layer_handles = [handle(i, PAGES * SPEC.layer_bytes) for i in range(SPEC.num_layers)]
    pool = client.register_pool(namespace, layer_handles, PAGES, handle(SPEC.num_layers, 512))
    # A deposit serves one registration.
    got_code, details = codes_of(lambda: client.register_pool(namespace, layer_handles, PAGES,
                                                              handle(SPEC.num_layers, 512)))
    assert got_code == grpc.StatusCode.FAILED_PRECONDITION and "no deposit" in details, details
    client.unregister_pool(pool.pool_id)
    # A descriptor that is not CPU device memory is refused when named, not mapped.
    path = tmp_path / "plain-file"
    path.write_bytes(bytes(PAGES * SPEC.layer_bytes))
    plain = os.open(path, os.O_RDWR)
    other = arena_protocol.deposit_fds(socket_path, None, [plain, *fds[1:]])
    got_code, details = codes_of(lambda: client.register_pool(
        namespace, [handle(i, PAGES * SPEC.layer_bytes, other) for i in range(SPEC.num_layers)], PAGES,
        handle(SPEC.num_layers, 512, other)))
    assert got_code == grpc.StatusCode.FAILED_PRECONDITION and "not CPU device memory" in details, details
    with pytest.raises(InvalidArgument, match="says 9 descriptors and 5 came"):
        _deposit_claiming(socket_path, fds, 9)
    # Deposits nobody registers cannot run the daemon out of descriptors.
    descriptors = _open_descriptors(daemon.process.pid)
    with pytest.raises(ResourceExhausted, match="at most 256 and 4096 descriptors"):
        for _ in range(4096 // len(fds) + 1):
            arena_protocol.deposit_fds(socket_path, None, fds)
    assert _open_descriptors(daemon.process.pid) - descriptors <= 4096
    for fd in [*fds, plain]:
        os.close(fd)


def test_a_daemon_without_a_device_plane_says_so(tmp_path):
    with run_daemon(tmp_path / "off") as process, Client(process.unix_target) as client:
        namespace = client.register_namespace(SPEC)
        got_code, details = codes_of(lambda: client.register_pool(namespace, [b""] * 4, 1, b""))
        assert got_code == grpc.StatusCode.FAILED_PRECONDITION and "[device] kind" in details
        fd = os.memfd_create("kvd-cpu-device-0")
        with pytest.raises(FailedPrecondition, match="no device plane"):
            arena_protocol.deposit_fds(arena_protocol.socket_path_for_target(process.unix_target), None, [fd])
        os.close(fd)


def _deposit_claiming(path: Path, fds: list[int], count: int) -> None:
    """A deposit whose request names another count than it passes."""
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.connect(str(path))
        socket.send_fds(connection, [arena_protocol.encode({"op": "deposit", "count": count})], fds)
        reply = json.loads(connection.recv(4096))
    assert not reply["ok"]
    raise InvalidArgument(reply["message"])


def _open_descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _with(handle: bytes, **changes) -> bytes:
    parsed = IpcHandle.from_bytes(handle)
    if "pid" in changes:
        _, fd, size = parsed.handle.decode().split(":")
        changes = {"handle": f"{changes['pid']}:{fd}:{size}".encode()}
    fields = {"kind": parsed.kind, "device_uuid": parsed.device_uuid, "handle": parsed.handle,
              "offset": parsed.offset, "nbytes": parsed.nbytes, **changes}
    return IpcHandle(**fields).to_bytes()


def _file_handle(device, tmp_path: Path) -> bytes:
    """A handle naming an ordinary file this process has open, of the right size."""
    path = tmp_path / "not-device-memory"
    path.write_bytes(bytes(PAGES * SPEC.layer_bytes))
    fd = os.open(path, os.O_RDWR)
    _file_handle.keep = fd  # open for the length of the test
    handle = f"{os.getpid()}:{fd}:{PAGES * SPEC.layer_bytes}".encode()
    return IpcHandle("cpu", device.uuid, handle, 0, PAGES * SPEC.layer_bytes).to_bytes()


def _mapped_allocations(pid: int) -> set[str]:
    """The CPU-device memories (memfds) process `pid` has mapped, by inode."""
    found = set()
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        if "/memfd:kvd-cpu-device-" in line:
            found.add(line.split()[4])
    return found


def wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_a_clients_arena_mapping_is_pinned_once_per_device_and_unpinned_when_it_closes(daemon):
    """What a GPU client does with cudaHostRegister (the vLLM connector's ordinary path), on the CPU
    device, which records its registrations: one per mapping and device, undone before the unmap."""
    device = open_device("cpu")
    client = Client(daemon.unix_target)
    client.register_namespace(SPEC)
    client.arena_info()
    arena = client.session.arena
    arena.pin(device)
    arena.pin(device)
    assert set(device._registered) == {arena.slots.ctypes.data}
    client.close()
    assert not device._registered


def test_one_daemon_serves_a_pool_on_each_of_its_devices_and_refuses_another(tmp_path):
    """With [device] count = 2 the daemon serves devices 0 and 1 (an engine with TP = 2 registers a
    pool on each GPU): each pool's blocks are saved and loaded through its own device's plane, and
    they meet in the same arena. A pool on device 2 is refused, naming the devices it serves."""
    config = {"host": {"capacity_bytes": 16 << 20, "slot_bytes": 64 << 10},
              "device": {"kind": "cpu", "index": 0, "count": 2}}
    with run_daemon(tmp_path / "kvd", config=config) as daemon, Client(daemon.unix_target) as client:
        engines = [Engine(client, open_device("cpu", index)) for index in (0, 1)]
        data, keys = blocks(4, seed=40), keys_for(40, 4)
        first, second = engines
        for page, block in zip([0, 1], data[:2]):
            first.write(page, block)
        for page, block in zip([2, 3], data[2:]):
            second.write(page, block)
        for engine, part, pages in ((first, slice(0, 2), [0, 1]), (second, slice(2, 4), [2, 3])):
            base = engine.pool.flag(ENGINE)
            engine.pool.mark(ENGINE, base + SPEC.num_layers)
            parent = keys[part.start - 1] if part.start else b""
            assert engine.pool.save(keys[part], pages, ENGINE, KVD, base, parent_key=parent).stored == 2
        np.testing.assert_array_equal(client.get_numpy(first.namespace, keys), data)
        loaded = second.pool.load(keys, [10, 11, 12, 13], KVD, second.pool.flag(KVD))  # device 0's blocks too
        wait_for(lambda: second.pool.flag(KVD) >= loaded.done_value)
        for page, block in zip([10, 11, 12, 13], data):
            np.testing.assert_array_equal(second.read(page), block)
        with pytest.raises(grpc.RpcError) as error:
            Engine(client, open_device("cpu", 2))
        assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert first.device.uuid in error.value.details() and second.device.uuid in error.value.details()
        for engine in engines:
            engine.close()
