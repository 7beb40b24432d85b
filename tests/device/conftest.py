"""The `device` fixture: every device this machine can open (the CPU one always, in its synchronous and
its asynchronous mode, where every stream operation lands 2 ms after it is issued, as on a GPU).

KVD_REQUIRE_GPU=1 (`make gpu-check`) fails the tests where CUDA cannot be opened.
"""

from __future__ import annotations

import os

import pytest

from kvd.device import NoDevice, open_device
from kvd.device.cpu import CpuDevice


ASYNC_DELAY_S = 0.002


def _kinds() -> list[str]:
    kinds = ["cpu", "cpu-async"]
    try:
        open_device("cuda")
        kinds.append("cuda")
    except NoDevice as error:
        if os.environ.get("KVD_REQUIRE_GPU"):
            raise AssertionError(f"KVD_REQUIRE_GPU is set and CUDA does not open: {error}") from None
    return kinds


@pytest.fixture(params=_kinds())
def device(request):
    if request.param == "cpu-async":
        return CpuDevice(0, delay_s=ASYNC_DELAY_S)
    return open_device(request.param, 0)
