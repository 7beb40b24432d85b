"""The cuFile engine (kvd/io/cufile.py, native/cufile_io.c) with the real libcufile (`make test` installs
the nvidia-cufile wheel and sets KVD_CUFILE_LIBRARY). Without a CUDA driver, as on every machine kvd has
had, the library loads and its driver refuses to open, which kvd must report precisely; with a GPU
(`make gpu-check`), bytes written from device memory through cuFile must read back exactly."""

from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest

from kvd.device import open_device
from kvd.io import Op
from kvd.io.cufile import LIBRARY_ENV, cufile_version, open_cufile_engine
from tests.device.staging import Staging


def _library() -> str:
    library = os.environ.get(LIBRARY_ENV)
    if not library:
        pytest.fail(f"{LIBRARY_ENV} is not set: `make test` installs libcufile and sets it")
    return library


def _cuda_driver() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def test_the_library_loads_and_says_its_version():
    assert cufile_version(_library()) >= 1150


def test_a_library_that_is_not_there_is_named():
    with pytest.raises(OSError, match="cuFile library: .*no-such-libcufile"):
        cufile_version("/nonexistent/no-such-libcufile.so.0")
    with pytest.raises(OSError, match="cuFile library: "):
        open_cufile_engine(library="/nonexistent/no-such-libcufile.so.0")


def test_the_engine_opens_only_with_a_cuda_driver_and_then_moves_bytes_exactly(tmp_path):
    """Without a CUDA driver (every kvd machine so far): cuFile's own error, named. With one (make
    gpu-check): a round trip from device memory to a file and back into other device memory."""
    if not _cuda_driver():
        with pytest.raises(OSError, match=r"cuFile's driver did not open: cuFile error 50\d\d"):
            open_cufile_engine(library=_library())
        return
    _round_trip(tmp_path)


def _round_trip(tmp_path) -> None:
    device = open_device("cuda")
    stream = device.stream()
    data = np.random.default_rng(5).integers(0, 256, 1 << 20, dtype=np.uint8)
    source, target = device.alloc(data.size), device.alloc(data.size)
    staging = Staging(device, data.size)
    staging.put(stream, source, 0, data)
    fd = os.open(tmp_path / "blocks", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    engine = open_cufile_engine(library=_library())
    try:
        engine.register_files([fd])
        count = data.size // (256 << 10)
        offsets = np.arange(count, dtype=np.int64) * (256 << 10)
        lengths = np.full(count, 256 << 10, dtype=np.uint32)
        written = engine.wait(engine.submit(Op.WRITE, np.zeros(count, dtype=np.int32), offsets, lengths,
                                            source.address + offsets.astype(np.uint64)))
        assert (written == 256 << 10).all(), written
        read = engine.wait(engine.submit(Op.READ, np.zeros(count, dtype=np.int32), offsets, lengths,
                                         target.address + offsets.astype(np.uint64)))
        assert (read == 256 << 10).all(), read
        np.testing.assert_array_equal(staging.get(stream, target, 0, data.size), data)
    finally:
        engine.close()
        os.close(fd)
