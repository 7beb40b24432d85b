#!/usr/bin/env bash
# The device check in a simulated bare GPU image, on this machine (make device-check-sim):
#
# * an "image" venv with Python 3.12 holding only packages the GPU image has (shared/FIELD-NOTES.md),
#   installed once from the registry: torch 2.11.0 (the registry's CUDA build; no GPU here, so CUDA
#   never opens), cuda-bindings, cuda-core, grpcio, protobuf, ... and NOT what the
#   bundle brings (crc32c, grpcio-health-checking, aetcd);
# * a copy of the working tree as the machine gets it (tracked and untracked files git does not
#   ignore) with .device-bundle/ beside it;
# * tools/device_check.sh run there with that Python as python3, pip limited to the bundle
#   (no index, no config), and apt, apt-get and pip's executables shadowed by ones that refuse.
#
# The CUDA steps are skipped with the reason (no GPU); everything else runs end to end at the small
# scale. The run's table is kept in bench/results/device_check_sim.json.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
SIM_VENV=${KVD_SIM_VENV:-$ROOT/.venv-device-sim}
PYTHON312=${PYTHON312:-/root/.pyenv/versions/3.12.1/bin/python3.12}
SIM=${KVD_SIM_DIR:-/tmp/kvd-device-sim}
# Versions as close to the image's as the registry has (torch as on the machine; the rest current).
IMAGE_PACKAGES=(torch==2.11.0 numpy grpcio protobuf uvloop prometheus-client aiofiles pytest pytest-timeout
                hypothesis transformers safetensors cuda-bindings cuda-core cuda-pathfinder
                setuptools wheel)
say() { printf '[device-check-sim %(%H:%M:%S)T] %s\n' -1 "$*"; }

if [ ! -e "$SIM_VENV/.image-installed" ]; then
    say "the simulated image's Python: $SIM_VENV (${IMAGE_PACKAGES[*]}); minutes, once"
    rm -rf "$SIM_VENV"
    "$PYTHON312" -m venv "$SIM_VENV"
    "$SIM_VENV/bin/pip" install -q "${IMAGE_PACKAGES[@]}" 2> >(grep -v "is ignored: it is neither" >&2)
    touch "$SIM_VENV/.image-installed"
fi
[ -d "$ROOT/.device-bundle/wheels" ] || { say "no .device-bundle: run make device-bundle first"; exit 2; }

say "copying the working tree as the GPU machine gets it into $SIM/tree"
rm -rf "$SIM" && mkdir -p "$SIM/tree" "$SIM/shadow"
(cd "$ROOT" && git ls-files -co --exclude-standard -z | xargs -0 cp --parents -t "$SIM/tree" 2>/dev/null) || true
cp -r "$ROOT/.device-bundle" "$SIM/tree/.device-bundle"
tree_mib=$(du -sm "$SIM/tree" | cut -f1)
say "what travels: $tree_mib MiB (limit 64 MiB)"

for tool in apt apt-get pip pip3; do  # the machine has none of these that reach anything
    printf '#!/bin/sh\necho "%s: not available on the simulated GPU image" >&2\nexit 1\n' "$tool" > "$SIM/shadow/$tool"
    chmod +x "$SIM/shadow/$tool"
done

code=0
PATH="$SIM/shadow:$PATH" PYTHON3="$SIM_VENV/bin/python" KVD_DEVICE_CHECK_SCALE=small \
    bash "$SIM/tree/tools/device_check.sh" "$SIM/results" || code=$?

"$SIM_VENV/bin/python" - "$SIM/results/device_check.json" "$ROOT/bench/results/device_check_sim.json" \
    "$tree_mib" "$(du -sk "$ROOT/.device-bundle" | cut -f1)" <<'PY'
import json, sys
summary = json.load(open(sys.argv[1]))
summary["simulated"] = ("a bare GPU image simulated on a machine without a GPU: Python 3.12 with the image's "
                        "packages only, pip limited to .device-bundle, apt refused; CUDA steps skipped")
summary["bundle_kib"] = int(sys.argv[4])
summary["travelling_tree_mib"] = int(sys.argv[3])
open(sys.argv[2], "w").write(json.dumps(summary, indent=2) + "\n")
print(f"wrote {sys.argv[2]}")
PY
exit $code
