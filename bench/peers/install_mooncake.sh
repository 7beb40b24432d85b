#!/usr/bin/env bash
# Mooncake's store as a contender of bench_peers.py: its own virtual environment.
#
#     bash bench/peers/install_mooncake.sh
#
# Creates .venv-mooncake at the repository root with numpy and the non-CUDA
# Mooncake wheel (store client, mooncake_master and its HTTP metadata server;
# no CUDA, no torch: the wheel needs neither). Idempotent: skipped once
# .venv-mooncake/.installed exists.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="$ROOT/.venv-mooncake"
MOONCAKE_VERSION="${MOONCAKE_VERSION:-0.3.13.post1}"

if [[ -f "$VENV/.installed" ]]; then
    echo "mooncake: $VENV already installed, skipping"
    exit 0
fi

echo "mooncake: creating $VENV"
python3 -m venv "$VENV"

echo "mooncake: installing numpy"
"$VENV/bin/pip" install -q numpy

echo "mooncake: installing mooncake-transfer-engine-non-cuda==$MOONCAKE_VERSION"
"$VENV/bin/pip" install -q "mooncake-transfer-engine-non-cuda==$MOONCAKE_VERSION"

echo "mooncake: checking the store module and the master binary"
"$VENV/bin/python" -c "from mooncake.store import MooncakeDistributedStore; import mooncake, os; \
m = os.path.join(os.path.dirname(mooncake.__file__), 'mooncake_master'); \
assert os.access(m, os.X_OK), m"

touch "$VENV/.installed"
echo "mooncake: installed in $VENV ($(du -sh "$VENV" | cut -f1))"
