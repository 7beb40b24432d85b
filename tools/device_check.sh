#!/usr/bin/env bash
# The one command for the offline GPU machine (docs/GPU.md, "Running the device check"):
#
#   bash tools/device_check.sh RESULTS_DIR
#
# with .device-bundle/ (make device-bundle) beside the working tree. Without a network and within
# the visit's time (KVD_DEVICE_CHECK_BUDGET_S, 480 s by default) it installs what the image lacks
# from the bundle into a venv over the image's packages, builds kvd._native against the bundle's
# static liburing and ISA-L, builds the I/O ring's fatbin for sm_90 with the machine's nvcc, then
# hands over to `python -m tools.device_check` (steps a-e, each in its own time limit). Every step
# reports ok, failed (why) or skipped (why), and the rest still run. RESULTS_DIR gets
# device_check.json, device_check.log and the steps' own JSON files.
#
# PYTHON3 names the image's Python (default python3); KVD_DEVICE_CHECK_SCALE=small runs the smaller
# sizes the simulated image uses (make device-check-sim).
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
RESULTS=$(mkdir -p "${1:?usage: tools/device_check.sh RESULTS_DIR}" && cd "$1" && pwd)
BUNDLE=${KVD_DEVICE_BUNDLE:-$ROOT/.device-bundle}
PYTHON3=${PYTHON3:-python3}
VENV=$ROOT/build/device-venv
SCALE=${KVD_DEVICE_CHECK_SCALE:-full}
STARTED=$(date +%s)
DEADLINE=$((STARTED + ${KVD_DEVICE_CHECK_BUDGET_S:-480}))
LOG=$RESULTS/device_check.log
PRIOR=$RESULTS/setup.jsonl
: > "$LOG"
: > "$PRIOR"
cd "$ROOT" || exit 2

# The machine has no index: pip sees the bundle and nothing else (no config file, no find-links).
export PIP_CONFIG_FILE=/dev/null PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
unset PIP_FIND_LINKS PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_CONSTRAINT

say() { printf '[device-check %(%H:%M:%S)T] %s\n' -1 "$*" | tee -a "$LOG"; }

# record NAME STATUS SECONDS WHY [FIGURES_JSON]: one row for the driver's table.
record() {
    local seconds
    seconds=$("$PYTHON3" -c 'import sys; print(round(float(sys.argv[1]), 1))' "$3")
    "$PYTHON3" -c 'import json, sys; print(json.dumps({"step": sys.argv[1], "status": sys.argv[2],
        "seconds": float(sys.argv[3]), "why": sys.argv[4], "figures": json.loads(sys.argv[5])}))' \
        "$1" "$2" "$seconds" "$4" "${5:-{\}}" >> "$PRIOR"
    say "$1: $2${4:+ ($4)} in $seconds s"
}

# step NAME LIMIT_S FUNCTION: runs FUNCTION under a time limit, its output into the log.
step() {
    local name=$1 limit=$2 function=$3 began code why=""
    began=$(date +%s%N)
    say "$name (limit $limit s)"
    echo "===== $name" >> "$LOG"
    timeout "$limit" bash -c "$(declare -f "$function"); $(declare -p ROOT BUNDLE PYTHON3 VENV); $function" >> "$LOG" 2>&1
    code=$?
    [ $code = 124 ] && why="timed out after $limit s"
    [ $code != 0 ] && [ -z "$why" ] && why="exit $code: $(grep -v '^\s*$' "$LOG" | tail -n1 | cut -c1-160)"
    record "$name" "$([ $code = 0 ] && echo ok || echo failed)" "$((($(date +%s%N) - began) / 1000000))e-3" "$why"
    return $code
}

# The image's Python is itself a venv (/opt/torch/.venv): a venv made from it sees the base
# interpreter's packages, not the image venv's, so a .pth file adds those (torch, cuda-bindings, ...).
make_venv() {
    rm -rf "$VENV"
    "$PYTHON3" -m venv --system-site-packages "$VENV" || "$PYTHON3" -m venv --system-site-packages --without-pip "$VENV" || exit 1
    local image own
    image=$("$PYTHON3" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    own=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    [ "$image" != "$own" ] && echo "$image" > "$own/kvd-image-packages.pth"
    local pip=("$VENV/bin/python" -m pip)
    [ -x "$VENV/bin/pip" ] || pip=("$PYTHON3" -m pip --python "$VENV/bin/python")
    # == in the bundle's list becomes >=: the image's copy stays when it is new enough.
    sed 's/==/>=/' "$BUNDLE/requirements.txt" > "$VENV/requirements.txt"
    "${pip[@]}" install --no-index --find-links "$BUNDLE/wheels" -r "$VENV/requirements.txt"
    "${pip[@]}" list 2>/dev/null | grep -i -E '^(torch|grpcio|protobuf|numpy|transformers|cuda-bindings|crc32c|aetcd|pytest) '
}

build_native() {
    local pip=("$VENV/bin/python" -m pip)
    [ -x "$VENV/bin/pip" ] || pip=("$PYTHON3" -m pip --python "$VENV/bin/python")
    rm -f kvd/_native*.so
    KVD_NATIVE_PREFIX="$BUNDLE/prefix" "${pip[@]}" install --no-index --no-deps --no-build-isolation -e . || exit 1
    "$VENV/bin/python" -c 'import kvd._native as n; print("kvd._native:", n.__file__)' || exit 1
    # Linked statically: the machine has neither library.
    ! ldd kvd/_native*.so | grep -E 'liburing|libisal'
}

build_fatbin() {
    local archs="-gencode arch=compute_90,code=sm_90"
    command -v nvcc >/dev/null || { echo "no nvcc on this machine"; exit 1; }
    if command -v make >/dev/null; then
        make --no-print-directory build/cuda/io_ring_kernel.fatbin NVCC="$(command -v nvcc)" CUDA_ARCHS="$archs"
    else  # the Makefile's rule, by hand
        mkdir -p build/cuda
        nvcc -fatbin -O2 $archs -gencode arch=compute_90,code=compute_90 -o build/cuda/io_ring_kernel.fatbin \
            native/gpu/io_ring_kernel.cu
    fi
}

main() {
    say "kvd device check: tree $ROOT, bundle $BUNDLE ($(du -sh "$BUNDLE" 2>/dev/null | cut -f1)), Python $("$PYTHON3" --version 2>&1), deadline in $((DEADLINE - STARTED)) s"
    local python="$VENV/bin/python"
    if [ ! -d "$BUNDLE/wheels" ]; then
        record "install bundle" failed 0 "no $BUNDLE/wheels: run make device-bundle where a registry answers"
        python=$PYTHON3
    elif ! step "install bundle into a venv" 120 make_venv; then
        python=$PYTHON3
    fi
    if [ -x "$VENV/bin/python" ]; then
        step "build kvd._native (static liburing, ISA-L)" 180 build_native
    else
        record "build kvd._native (static liburing, ISA-L)" skipped 0 "no venv"
    fi
    step "build the ring's fatbin for sm_90" 120 build_fatbin
    "$python" -m tools.device_check "$RESULTS" --prior "$PRIOR" --deadline "$DEADLINE" --scale "$SCALE" \
        --work "$ROOT/build/device-check-work" 2>&1 | tee -a "$LOG.driver"
    local code=${PIPESTATUS[0]}
    cat "$LOG.driver" >> "$LOG" && rm -f "$LOG.driver"
    say "done in $(($(date +%s) - STARTED)) s"
    return "$code"
}

main
