# SGLang's venv for kvd's SGLang HiCache backend (kvd/connectors/sglang.py)
# and its test (tests/engines/test_sglang_backend.py). Included from the
# Makefile. `make sglang-venv` builds .venv-sglang once (a stamp inside the
# venv) and again only when the pinned lists change.
#
# Order matters: torch 2.13.0 first and alone (the CPU build; sglang 0.5.23
# asks for torch 2.14.1, so pip would otherwise fall back to sglang 0.5.22,
# whose cuda-tile does not install), then sglang with --no-deps, then its
# runtime dependencies (engines/sglang-requirements.txt) and kvd's client
# dependencies, all with --no-deps so nothing can bring in another torch,
# then kvd itself, editable. The last step fails if torch is a CUDA build.
# Measured on a 2-core VM from local wheels: 2 min 19 s, 2.5 GB (triton 1.0 GB, torch 0.75, sglang 0.22).
SGLANG_VENV ?= .venv-sglang
SGLANG_PIP := $(SGLANG_VENV)/bin/pip
SGLANG_STAMP := $(SGLANG_VENV)/.kvd-sglang-installed
SGLANG_VERSION := 0.5.23
SGLANG_TORCH := torch==2.13.0
SGLANG_KVD_DEPS := grpcio==1.85.1 grpcio-health-checking==1.85.1 protobuf==7.36.2 numpy==2.4.6 uvloop==0.23.0 \
	prometheus-client==0.26.0 crc32c==2.9.post0

.PHONY: sglang-venv

sglang-venv: $(SGLANG_STAMP)

$(SGLANG_STAMP): engines/sglang-requirements.txt mk/sglang.mk pyproject.toml $(NATIVE_SOURCES) | apt
	test -x $(SGLANG_VENV)/bin/python || python3 -m venv $(SGLANG_VENV)
	$(SGLANG_PIP) install -q $(SGLANG_TORCH)
	$(call share_files,$(SGLANG_VENV),$(wildcard $(VENV) $(VLLM_VENV)))
	$(SGLANG_PIP) install -q --no-deps sglang==$(SGLANG_VERSION)
	$(SGLANG_PIP) install -q --no-deps -r engines/sglang-requirements.txt
	$(SGLANG_PIP) install -q --no-deps $(SGLANG_KVD_DEPS)
	$(SGLANG_PIP) install -q --no-deps -e .
	$(SGLANG_VENV)/bin/python -c "import torch, sys; sys.exit('torch is a CUDA build' if torch.version.cuda else 0)"
	$(call share_files,$(SGLANG_VENV),$(wildcard $(VENV) $(VLLM_VENV)))
	touch $@
