"""How often a request crosses kvd's layers (issue 36 item 5), measured on a real daemon.

A whole daemon runs in-process (gRPC server, disk plane on real files, the real client
over shared memory). Every method of every class in kvd.core and kvd.planes is wrapped
to note the calls that come from another layer: edge (kvd.server) into plane
(kvd.planes), and edge or plane into core (kvd.core). A call counts for a request when
it runs in that RPC's context (its handler and the tasks it starts); the background
loops (writer, committer, sweeper) and the I/O thread are not the request's crossings.

What holds, for a Get served from disk and for a durable Put:
- the edge enters the plane once (the Get's start_get; the Put's wait_durable);
- after the tenant scope every RPC takes before its handler (service._resolve_tenant_ids),
  the Get enters core exactly three times, its life's steps: plan, loads landed (which hands
  back the removals its failed reads queued), settle (GetLife); the durable Commit three
  times too: commit (which answers the blocks it sealed), the durable wait's start (which
  says whether a commit is due) and its finish;
- nothing crosses once per block: 4 blocks and 16 cross the same number of times;
- the Reserve stays within what kvd/README.md states, so a new hop shows up here.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import functools
import importlib
import inspect
import pkgutil
import sys

import numpy as np
import pytest

import kvd.core
import kvd.planes
from kvd.client import Client
from kvd.daemon.lifecycle import Daemon
from kvd.server.service import KvdService
from kvd.testing.put_stream import SPEC, blocks_for
from tests.integration.test_supervision import config

# The RPC a call runs for (None: a background task or thread).
RPC: contextvars.ContextVar[str | None] = contextvars.ContextVar("rpc", default=None)
LAYERS = (("kvd.server", "edge"), ("kvd.planes", "plane"), ("kvd.core", "core"))
# Every RPC's first call into core: its namespace resolved within the caller's tenant.
TENANT_SCOPE = "Engine.tenant_namespace"
# What kvd/README.md states ("Measured, not claimed"): the calls into core after the tenant scope.
INTO_CORE = {
    "Get": ["GetLife.begin", "GetLife.loads_done", "GetLife.settle"],
    "Commit": ["Engine.commit", "DurableWaits.start", "DurableWaits.finish"],
    "Reserve": ["Engine.reserve", "SlotPool.offsets_of"],
}
# GetLife's transitions (its other calls only read).
GET_STEPS = {"begin", "cancel", "loads_done", "wait_done", "settle", "drop", "abandon"}


def layer_of(module: str) -> str | None:
    return next((name for prefix, name in LAYERS if module == prefix or module.startswith(prefix + ".")), None)


class Crossings:
    """Calls between layers, by RPC: (caller layer, callee layer, Class.method)."""

    def __init__(self) -> None:
        self.calls: dict[str, list[tuple[str, str, str]]] = collections.defaultdict(list)

    def note(self, callee_layer: str, name: str) -> None:
        rpc = RPC.get()
        caller = layer_of(sys._getframe(2).f_globals.get("__name__", ""))
        if rpc is not None and caller is not None and caller != callee_layer:
            self.calls[rpc].append((caller, callee_layer, name))

    def wrap(self, cls: type, name: str, function, callee_layer: str):
        label = f"{cls.__name__}.{name}"
        if inspect.iscoroutinefunction(function):
            @functools.wraps(function)
            async def noted_async(*args, **kwargs):
                self.note(callee_layer, label)
                return await function(*args, **kwargs)
            return noted_async

        @functools.wraps(function)
        def noted(*args, **kwargs):
            self.note(callee_layer, label)
            return function(*args, **kwargs)
        return noted

    def instrument(self, monkeypatch, package, callee_layer: str) -> None:
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            module = importlib.import_module(info.name)
            for cls in [value for value in vars(module).values()
                        if inspect.isclass(value) and value.__module__ == module.__name__]:
                for name, function in list(vars(cls).items()):
                    if inspect.isfunction(function) and not name.startswith("__"):
                        monkeypatch.setattr(cls, name, self.wrap(cls, name, function, callee_layer))

    def into(self, rpc: str, callee_layer: str) -> list[str]:
        return [name for _, callee, name in self.calls[rpc] if callee == callee_layer]


def attribute_rpcs(monkeypatch, names: tuple[str, ...]) -> None:
    """Run each named handler in a context that says which RPC it serves."""
    for name in names:
        handler = getattr(KvdService, name)

        @functools.wraps(handler)
        async def attributed(self, request, context, _handler=handler, _name=name):
            RPC.set(_name)  # the handler's own task: its context ends with it
            return await _handler(self, request, context)
        monkeypatch.setattr(KvdService, name, attributed)


def put_demote_get(target: str, blocks: int) -> None:
    """A durable Put, every host copy demoted, a Get that reads them back from disk (a real
    client, over shared memory; in a thread: it is synchronous, the daemon runs on the loop)."""
    with Client(target) as client:
        assert client.uses_shared_memory
        namespace = client.register_namespace(SPEC)
        keys = namespace.keys(np.arange(blocks * SPEC.block_tokens))
        assert client.put(namespace, keys, blocks_for(keys), durable=True) == blocks
        assert client.demote().blocks_demoted == blocks
        got = client.get(namespace, keys)
        assert len(got.blocks) == blocks and got.blocks.tobytes() == blocks_for(keys).tobytes()


async def crossings_of(tmp_path, monkeypatch, blocks: int) -> Crossings:
    crossings = Crossings()
    crossings.instrument(monkeypatch, kvd.core, "core")
    crossings.instrument(monkeypatch, kvd.planes, "plane")
    attribute_rpcs(monkeypatch, ("Reserve", "Commit", "Get"))
    daemon = Daemon(config(tmp_path, fsync="strict"))
    await daemon.start()
    try:
        await asyncio.to_thread(put_demote_get, f"unix://{daemon.config.unix_socket_path.resolve()}", blocks)
    finally:
        await daemon.shutdown()
    return crossings


@pytest.fixture
def measured(tmp_path, monkeypatch):
    def measure(blocks: int) -> Crossings:
        with monkeypatch.context() as patch:
            return asyncio.run(crossings_of(tmp_path / str(blocks), patch, blocks))
    return measure


def test_a_get_from_disk_and_a_durable_put_cross_the_layers_a_fixed_few_times(measured):
    few, many = measured(4), measured(16)
    for rpc in ("Reserve", "Commit", "Get"):
        print(rpc, collections.Counter(few.calls[rpc]))
    # The edge enters the plane once per request that needs the disk.
    assert few.into("Get", "plane") == ["DiskReads.start_get"]
    assert few.into("Commit", "plane") == ["DiskWrites.wait_durable"]
    assert few.into("Reserve", "plane") == []
    # The Get's life in core: plan, loads landed, settle, each once (kvd.core.get_life).
    lives = [name for name in few.into("Get", "core") if name.removeprefix("GetLife.") in GET_STEPS]
    assert lives == ["GetLife.begin", "GetLife.loads_done", "GetLife.settle"]
    # No crossing per block, and exactly what is stated.
    for rpc, steps in INTO_CORE.items():
        assert collections.Counter(few.calls[rpc]) == collections.Counter(many.calls[rpc]), rpc
        assert few.into(rpc, "core") == [TENANT_SCOPE, *steps], rpc
