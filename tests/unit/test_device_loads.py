"""A load from disk sent to an engine's pages as its layers land (kvd.planes.device_loads), on the
CPU device in asynchronous mode: every copy and flag store lands 20 ms after it is issued, as on a
GPU. A layer is issued only once the reads report it; FAILED is stored only after every copy issued
has landed, so the engine never reads FAILED while a copy may still write its pages. The same holds
for a load the engine cancels through its cancel word."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from kvd.core.get_life import Served
from kvd.core.reads import GetCut
from kvd.device.cpu import CpuDevice, read_flag, store_flag
from kvd.device.transfer import FAILED, PoolLayout
from kvd.planes.device_loads import LayerLoad, cancel_word

LAYERS, PAGE, BLOCKS = 3, 4096, 2
DELAY_S = 0.02


class Rig:
    """An engine pool of BLOCKS pages per layer, an arena holding BLOCKS blocks, one stream."""

    def __init__(self) -> None:
        self.device = CpuDevice(delay_s=DELAY_S)
        self.layers = [self.device.alloc(BLOCKS * PAGE) for _ in range(LAYERS)]
        self.arena = self.device.alloc(BLOCKS * LAYERS * PAGE)
        self.flags = self.device.alloc(4096)
        self.stream = self.device.stream()
        self.ended = 0
        self.pool = SimpleNamespace(layout=PoolLayout(tuple(self.layers), PAGE, BLOCKS), stream=self.stream,
                                    flags=self.flags, flags_on_device=self.flags, pool_id=1, end=self.end,
                                    closing=False)
        self.data = np.random.default_rng(0).integers(0, 255, BLOCKS * LAYERS * PAGE, dtype=np.uint8)
        self.view(self.arena)[:] = self.data

    def end(self) -> None:
        self.ended += 1

    @staticmethod
    def view(memory) -> np.ndarray:
        return np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * memory.nbytes).from_address(memory.address))

    def page(self, layer: int, page: int) -> bytes:
        return self.view(self.layers[layer])[page * PAGE:(page + 1) * PAGE].tobytes()

    def stored(self, block: int, layer: int) -> bytes:
        start = (block * LAYERS + layer) * PAGE
        return self.data[start:start + PAGE].tobytes()

    def load(self, steps: asyncio.Queue, getting: asyncio.Future, cancel_flag: int | None = None) -> LayerLoad:
        sources = [(self.arena, np.arange(BLOCKS), np.arange(BLOCKS) * LAYERS * PAGE)]
        return LayerLoad(self.pool, sources, 0, 100, BLOCKS, steps, getting,
                         cancelled=cancel_word(self.pool, cancel_flag, 100))

    def close(self) -> None:
        self.stream.close()


@pytest.fixture
def rig():
    rig = Rig()
    yield rig
    rig.close()


def served(blocks: int = BLOCKS) -> Served:
    return Served([object()] * blocks, GetCut.NONE)


def test_each_layer_goes_out_only_once_the_reads_report_it(rig):
    async def scenario():
        steps, getting = asyncio.Queue(), asyncio.get_running_loop().create_future()
        load = rig.load(steps, getting)
        running = asyncio.ensure_future(load.run(lambda: None))
        await asyncio.sleep(3 * DELAY_S)
        assert read_flag(rig.flags, 0) == 0  # nothing reported: nothing issued
        steps.put_nowait((0, [True, True]))
        while read_flag(rig.flags, 0) < 101:
            await asyncio.sleep(DELAY_S / 4)
        assert rig.page(0, 1) == rig.stored(1, 0) and rig.page(1, 1) == bytes(PAGE)  # layer 1 not yet
        steps.put_nowait((2, [True, True]))  # layers 1 and 2 at once (one read extent)
        getting.set_result(served())
        assert await running is True
        assert read_flag(rig.flags, 0) == load.done == 100 + LAYERS and rig.ended == 1
        assert all(rig.page(layer, block) == rig.stored(block, layer)
                   for layer in range(LAYERS) for block in range(BLOCKS))

    asyncio.run(scenario())


def test_a_failed_read_stops_the_issuing_and_fails_the_flag_after_the_copies_landed(rig):
    async def scenario():
        steps, getting = asyncio.Queue(), asyncio.get_running_loop().create_future()
        load = rig.load(steps, getting)
        landed = []
        running = asyncio.ensure_future(load.run(lambda: landed.append(read_flag(rig.flags, 0))))
        steps.put_nowait((0, [True, True]))
        steps.put_nowait((1, [True, False]))  # block 1's layer 1 failed its check
        getting.set_result(served(1))
        assert await running is False
        # Layer 0's copies landed before FAILED was stored; layer 1 was never issued.
        assert landed == [FAILED | load.done] and rig.page(0, 1) == rig.stored(1, 0)
        assert rig.page(1, 0) == bytes(PAGE)

    asyncio.run(scenario())


@pytest.mark.parametrize("end", ["cancelled", "raised"])
def test_a_get_that_ends_early_fails_the_flag(rig, end):
    async def scenario():
        steps, getting = asyncio.Queue(), asyncio.get_running_loop().create_future()
        load = rig.load(steps, getting)
        running = asyncio.ensure_future(load.run(lambda: None))
        steps.put_nowait((0, [True, True]))
        await asyncio.sleep(0)
        getting.cancel() if end == "cancelled" else getting.set_exception(RuntimeError("the daemon stops"))
        assert await running is False
        assert read_flag(rig.flags, 0) == FAILED | load.done and rig.ended == 1

    asyncio.run(scenario())


def test_a_cancel_while_waiting_for_a_layer_ends_the_load_after_the_issued_copies_landed(rig):
    async def scenario():
        steps, getting = asyncio.Queue(), asyncio.get_running_loop().create_future()
        load = rig.load(steps, getting, cancel_flag=1)
        landed = []
        running = asyncio.ensure_future(load.run(lambda: landed.append(read_flag(rig.flags, 0))))
        steps.put_nowait((0, [True, True]))
        while read_flag(rig.flags, 0) < 101:
            await asyncio.sleep(DELAY_S / 4)
        store_flag(rig.flags, 1, 99)  # an older load's cancel: not this one's
        await asyncio.sleep(3 * DELAY_S)
        assert not running.done()
        store_flag(rig.flags, 1, 100)  # the engine cancels; no layer will ever be reported again
        assert await asyncio.wait_for(running, 5) is False
        assert getting.cancelled()  # the Get is let go: its reads finish into kvd's slots
        steps.put_nowait((2, [True, True]))  # a late report is not issued
        await asyncio.sleep(3 * DELAY_S)
        assert landed == [FAILED | load.done] and read_flag(rig.flags, 0) == FAILED | load.done
        assert rig.page(0, 1) == rig.stored(1, 0) and rig.page(1, 0) == bytes(PAGE) and rig.page(2, 1) == bytes(PAGE)

    asyncio.run(scenario())


def test_a_layer_reported_after_the_cancel_is_not_issued(rig):
    async def scenario():
        steps, getting = asyncio.Queue(), asyncio.get_running_loop().create_future()
        load = rig.load(steps, getting, cancel_flag=1)
        store_flag(rig.flags, 1, 100)
        steps.put_nowait((0, [True, True]))
        assert await asyncio.wait_for(load.run(lambda: None), 5) is False
        assert read_flag(rig.flags, 0) == FAILED | load.done and rig.page(0, 0) == bytes(PAGE)

    asyncio.run(scenario())
