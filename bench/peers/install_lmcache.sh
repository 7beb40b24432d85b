#!/usr/bin/env bash
# Build .venv-lmcache for bench/peers/lmcache_disk.py: CPU torch first and
# alone, then lmcache without its declared dependencies (they name
# cupy-cuda13x, cuda-python and cufile-python, none of which a CPU-only host
# can use), then by hand the packages its storage path imports. Idempotent:
# a finished venv carries .installed and is left alone.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="$ROOT/.venv-lmcache"
STAMP="$VENV/.installed"
LOG="$VENV/install.log"
TORCH_VERSION="2.13.0"
LMCACHE_VERSION="0.5.6"

if [[ -f "$STAMP" ]]; then
    echo "lmcache: $VENV already installed"
    exit 0
fi

step() { echo "lmcache: $*"; }
quiet() {  # run a step's command, its output to the log; show the log's tail if it fails
    if ! "$@" >>"$LOG" 2>&1; then
        echo "lmcache: failed: $*" >&2
        tail -n 30 "$LOG" >&2
        exit 1
    fi
}

step "creating $VENV"
python3 -m venv "$VENV"
: >"$LOG"
PY="$VENV/bin/python"
PIP=("$PY" -m pip --disable-pip-version-check)

# Hold torch at the CPU build for every later install, so nothing upgrades it
# to a CUDA build or pulls nvidia-* wheels.
CONSTRAINTS="$VENV/constraints.txt"
printf 'torch==%s\n' "$TORCH_VERSION" >"$CONSTRAINTS"

step "installing torch==$TORCH_VERSION (CPU build) alone"
quiet "${PIP[@]}" install -q "torch==$TORCH_VERSION"
if ! "$PY" -c 'import sys, torch; sys.exit(torch.version.cuda is not None)' 2>>"$LOG"; then
    echo "lmcache: torch in $VENV is a CUDA build; refusing to go on" >&2
    exit 1
fi

step "installing lmcache==$LMCACHE_VERSION --no-deps (its CUDA-only requirements left out)"
quiet "${PIP[@]}" install -q --no-deps "lmcache==$LMCACHE_VERSION"

# What `import lmcache.v1.storage_backend.storage_manager` and the disk
# backend's store and restore paths import on a CPU-only host, with
# lmcache's own version bounds where it states them.
step "installing lmcache's runtime dependencies for the CPU storage path, and numpy"
quiet "${PIP[@]}" install -q -c "$CONSTRAINTS" \
    "numpy<=2.2.6" \
    numba \
    pyyaml \
    psutil \
    py-cpuinfo \
    msgspec \
    "prometheus_client>=0.18.0,<=0.24.1" \
    sortedcontainers \
    requests \
    cachetools \
    aiohttp \
    aiofile \
    aiofiles \
    "pyzmq>=25.0.0" \
    cryptography \
    safetensors \
    "transformers>=5.4"

step "checking the venv (CPU torch, no nvidia packages, lmcache's storage manager imports)"
if "$PY" -m pip list 2>/dev/null | grep -qi '^nvidia-'; then
    echo "lmcache: nvidia-* packages found in $VENV; refusing to go on" >&2
    exit 1
fi
quiet env LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1 LMCACHE_LOG_LEVEL=WARNING "$PY" -c '
import sys, torch, lmcache
from lmcache.v1.storage_backend.storage_manager import StorageManager
from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend
assert torch.version.cuda is None, torch.__version__
print("torch", torch.__version__, "lmcache", lmcache.__version__)
'

touch "$STAMP"
step "done: $("$PY" -c 'import lmcache, torch; print("lmcache", lmcache.__version__, "torch", torch.__version__)' 2>/dev/null)"
