"""What a GPU engine's DevicePool hands the daemon (kvd.client.device), on a stand-in for cuda-bindings:
its layers as CUDA IPC handles and its flag words as a descriptor over the arena socket (never by pid
through /proc, which a daemon in another pid namespace or container cannot open), the flag words
registered with the engine's device so its stream can store to them, and both undone at close."""

from __future__ import annotations

import os
from types import SimpleNamespace

import kvd.client.device as client_device
from kvd.client.device import DevicePool
from kvd.device import IpcHandle
from kvd.device.cpu import CpuDevice
from kvd.device.cuda import CudaDevice
from tests.device.fake_cuda import FakeCuda


class _Client:
    """Records RegisterPool's arguments."""

    def __init__(self) -> None:
        self.registered = None

    def register_pool(self, namespace, handles, num_blocks, flags, lease_ms, page_stride, v_offset, io_ring):
        self.registered = SimpleNamespace(handles=handles, flags=flags, num_blocks=num_blocks)
        return SimpleNamespace(pool_id=7, lease_deadline_ms=1)

    def unregister_pool(self, pool_id: int) -> None:
        pass


def test_a_cuda_pool_sends_ipc_handles_for_its_layers_and_its_flags_by_descriptor(monkeypatch, tmp_path):
    fake = FakeCuda(allocation_bytes=1 << 24)
    fake.install(monkeypatch)
    device = CudaDevice(0)
    deposited = []

    def deposit(path, token, fds):
        deposited.append((path, [os.readlink(f"/proc/self/fd/{fd}") for fd in fds]))
        return "ticket"
    monkeypatch.setattr(client_device, "deposit_fds", deposit)
    fake.allocations.add(0x10_0000)  # the engine's KV allocation, as cuMemGetAddressRange sees it
    layers = [device.wrap(0x10_0000 + layer * (1 << 20), 1 << 20) for layer in range(3)]
    client, host = _Client(), CpuDevice(0)
    pool = DevicePool(client, "namespace", device, layers, 16, flag_words=4096, host=host,
                      arena_socket=tmp_path / "kvd.sock.arena")

    handles = [IpcHandle.from_bytes(data) for data in client.registered.handles]
    assert [(h.kind, h.device_uuid, h.offset) for h in handles] == [
        ("cuda", device.uuid, layer * (1 << 20)) for layer in range(3)]
    flags = IpcHandle.from_bytes(client.registered.flags)
    assert (flags.kind, flags.device_uuid, flags.handle, flags.nbytes) == ("cpu", host.uuid, b"deposit:ticket:0",
                                                                          4096 * 8)
    [(path, targets)] = deposited
    assert path == tmp_path / "kvd.sock.arena" and len(targets) == 1
    assert targets[0].startswith("/memfd:kvd-cpu-device-")  # the flag memory itself, one descriptor
    assert fake.registered == {pool.flags.address: 4096 * 8}  # so the engine's stream can store to it
    assert pool.flags_on_device.address == pool.flags.address + (1 << 56)

    pool.close()
    assert fake.registered == {}
