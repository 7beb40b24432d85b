"""The GPU-initiated I/O ring's header (native/gpu/io_ring.h): its host side under real threads, built
by gcc as C and by g++ as C++, against a real file, with the wait kernel's bounded wait (OK, FAILED,
TIMEOUT, INVALID); and its kernels built by nvcc for sm_80 and sm_90."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "native" / "gpu"
COMPILERS = {
    "c": ["gcc", "-std=c11", "-D_GNU_SOURCE"],
    "c++": ["g++", "-x", "c++", "-std=c++17"],
}


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ring") / "blocks"
    path.write_bytes(os.urandom(4096 * 512))
    return path


@pytest.fixture(scope="module", params=sorted(COMPILERS))
def ring_test(request, tmp_path_factory) -> Path:
    binary = tmp_path_factory.mktemp("ring-bin") / f"io_ring_test-{request.param}"
    subprocess.run([*COMPILERS[request.param], "-O2", "-Wall", "-Wextra", "-Werror", "-pthread", f"-I{GPU}",
                    str(GPU / "io_ring_test.c"), "-o", str(binary)], check=True, capture_output=True)
    return binary


# (producers, reads each, ring capacity, faults): wrap-around thousands of times, one producer
# and many, a ring of 2, and reads made to fail (past the end of the file).
@pytest.mark.parametrize("producers, reads, capacity, faults", [(1, 20000, 4, 0), (8, 3000, 8, 0), (4, 2000, 2, 0),
                                                               (8, 3000, 64, 1)])
def test_reads_published_by_threads_land_exactly_and_complete_per_layer(ring_test, data_file, producers, reads,
                                                                        capacity, faults):
    run = subprocess.run([str(ring_test), str(data_file), str(producers), str(reads), str(capacity), str(faults)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    total = producers * reads
    failed = sum(1 for n in range(total) if n % 97 == 0) if faults else 0
    assert run.stdout.startswith(f"ok {total} reads, {failed} failed as made to"), run.stdout


def nvcc() -> str:
    found = os.environ.get("KVD_NVCC") or shutil.which("nvcc")
    if not found:
        pytest.fail("no nvcc: `make test` provides one (the machine's, or the CUDA compiler wheels in .venv-cuda)")
    return found


def test_the_kernel_compiles_for_sm80_and_sm90(tmp_path):
    out = tmp_path / "io_ring_kernel.o"
    build = subprocess.run([nvcc(), "-c", "-O2", "-gencode", "arch=compute_80,code=sm_80",
                            "-gencode", "arch=compute_90,code=sm_90", "-o", str(out), str(GPU / "io_ring_kernel.cu")],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    symbols = subprocess.run(["nm", str(out)], capture_output=True, text=True, check=True).stdout
    assert "kvd_io_ring_submit_layer" in symbols and "kvd_io_ring_wait_layer" in symbols


def test_the_kernels_bound_their_waits_with_the_global_nanosecond_timer(tmp_path):
    """Both kernels read %globaltimer for their deadlines (not clock64, whose cycles are one SM's at a
    varying frequency) and sleep between looks at host memory; the wait kernel takes six parameters."""
    out = tmp_path / "io_ring_kernel.ptx"
    build = subprocess.run([nvcc(), "-ptx", "-O2", "-arch=compute_90", "-o", str(out), str(GPU / "io_ring_kernel.cu")],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    ptx = out.read_text()
    for kernel in ("kvd_io_ring_submit_layer", "kvd_io_ring_wait_layer"):
        body = ptx[ptx.index(f".entry {kernel}"):]
        body = body[:body.index("\n}\n")]
        assert "%globaltimer" in body and "nanosleep" in body, kernel
        assert "clock64" not in body and "%clock64" not in body
    wait = ptx[ptx.index(".entry kvd_io_ring_wait_layer"):]
    assert wait[:wait.index(")")].count(".param .u64") == 6
