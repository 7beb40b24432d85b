"""The `device` fixture: every device this machine can open (the CPU one always).

KVD_REQUIRE_GPU=1 (`make gpu-check`) fails the tests where CUDA cannot be opened.
"""

from __future__ import annotations

import os

import pytest

from kvd.device import NoDevice, open_device


def _kinds() -> list[str]:
    kinds = ["cpu"]
    try:
        open_device("cuda")
        kinds.append("cuda")
    except NoDevice as error:
        if os.environ.get("KVD_REQUIRE_GPU"):
            raise AssertionError(f"KVD_REQUIRE_GPU is set and CUDA does not open: {error}") from None
    return kinds


@pytest.fixture(params=_kinds())
def device(request):
    return open_device(request.param)
