"""`open_engine("auto")` must be the io_uring engine here.

Without this test a broken build, a missing liburing or a kernel refusing
io_uring would make every caller silently use the thread-pool fallback.
Machines that cannot run io_uring set KVD_IO_ALLOW_FALLBACK=1 (see conftest).
"""

from __future__ import annotations

import pytest

from kvd.io import open_engine, uring_unavailable_reason
from tests.native.conftest import allow_fallback


def test_auto_opens_the_uring_engine():
    reason = uring_unavailable_reason()
    if reason is not None and allow_fallback():
        pytest.skip(f"KVD_IO_ALLOW_FALLBACK is set and io_uring is unavailable: {reason}")
    with open_engine("auto") as engine:
        assert engine.kind == "uring", reason


def test_the_extension_is_importable():
    try:
        from kvd import _native
    except ImportError as error:
        if allow_fallback():
            pytest.skip(f"KVD_IO_ALLOW_FALLBACK is set and kvd._native cannot load: {error}")
        raise
    assert _native.Ring.__module__ == "kvd._native"
    assert callable(_native.crc32c_chunks)
