"""kvd._native.cuda_copy_batch against a stand-in libcuda.so.1 (tests/native/fake/libcuda.c, built here):
the entry point it picks for each driver version (cuMemcpyBatchAsync_v2 from CUDA 13, 12.8's
cuMemcpyBatchAsync on 12.8 and 12.9, a C loop of cuMemcpyAsync below), the bytes it moves, the
stream order it asks for, and a failing copy's CUresult. Each case runs in a process of its own:
the driver is loaded once per process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

FAKE = Path(__file__).parent / "fake" / "libcuda.c"

PROBE = r"""
import ctypes, sys
import numpy as np
import kvd._native as native
fake = ctypes.CDLL("libcuda.so.1")
fake.kvd_fake_calls.restype = ctypes.c_uint64
source = np.random.default_rng(1).integers(0, 256, 64 * 4096, dtype=np.uint8)
target = np.zeros_like(source)
order = np.random.default_rng(2).permutation(64).astype(np.uint64) * np.uint64(4096)
dst = np.uint64(target.ctypes.data) + order
src = np.uint64(source.ctypes.data) + np.arange(64, dtype=np.uint64) * np.uint64(4096)
result, api = native.cuda_copy_batch(0x5000, dst, src, 4096)
landed = all(np.array_equal(target[int(o):int(o) + 4096], source[i * 4096:(i + 1) * 4096])
             for i, o in enumerate(order.tolist()))
print(native.cuda_driver_version(), result, api, landed, [fake.kvd_fake_calls(i) for i in range(3)])
"""


@pytest.fixture(scope="module")
def fake_driver(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("fake-cuda")
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-o", str(directory / "libcuda.so.1"),
                    str(FAKE)], check=True)
    return directory


def probe(fake_driver: Path, version: int, fail_at: int = -1) -> list[str]:
    env = dict(os.environ, LD_LIBRARY_PATH=str(fake_driver), KVD_FAKE_DRIVER_VERSION=str(version),
               KVD_FAKE_FAIL_AT=str(fail_at))
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.split(maxsplit=4)


@pytest.mark.parametrize("version, api, calls", [(13000, "2", "[0, 0, 1]"), (12090, "1", "[0, 1, 0]"),
                                                 (12080, "1", "[0, 1, 0]"), (12040, "0", "[64, 0, 0]")])
def test_each_driver_gets_its_entry_point_and_every_block_lands(fake_driver, version, api, calls):
    assert probe(fake_driver, version) == [str(version), "0", api, "True", calls + "\n"]


@pytest.mark.parametrize("version", [13000, 12040])
def test_a_failing_copy_returns_the_drivers_result(fake_driver, version):
    driver, result, _, landed, _ = probe(fake_driver, version, fail_at=5)
    assert (driver, result, landed) == (str(version), "1", "False")
