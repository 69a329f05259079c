# Two commands from a fresh clone:  make poc-01   and   make test   (make test-all: every test, as CI)
# On a machine whose Python already has the packages (the GPU machine):  make poc-09 PYTHON=python3
VENV    := .venv
PYTHON  ?= $(VENV)/bin/python
ARGS    ?=
export PYTHONUNBUFFERED := 1
# No model hub is needed: weights ship inside packages or the repo; a missing model fails fast and clearly.
export HF_HUB_OFFLINE := 1

# The virtualenv is built only when we run on its Python; PYTHON=python3 skips it.
ifeq ($(PYTHON),$(VENV)/bin/python)
SETUP := $(VENV)/.installed
else
SETUP :=
endif

POCS := 01 02 03 04 05 06 07 08 09 10 11 12 13 14 15 16 17 18 19
RESULTS := $(wildcard results/[0-9][0-9]_*.csv)

.PHONY: help test test-all test-gpu fuzz pocs figures readme planes kv-codec clean setup lock lock-cpu lock-cuda models $(addprefix poc-,$(POCS))

help:
	@echo "make poc-01 .. poc-19   run one PoC (writes results/NN_*.csv and figures/NN_*.png); ARGS=--quick for a small run"
	@echo "make pocs               every PoC that runs on this machine"
	@echo "make figures            redraw every figure from its CSV (no rerun)"
	@echo "make setup              make .venv: the CUDA torch lock where nvidia-smi lists a GPU, else the CPU one (TORCH=cpu|cuda overrides)"
	@echo "make lock               re-pin requirements.txt and requirements-cuda.txt (with hashes) from requirements.in"
	@echo "make readme             rewrite the results tables (docs/results.md, docs/decoder-checks.md) from results/*.csv"
	@echo "make planes             export real PCA planes and SmolLM2 hidden states for the GPU benchmarks (data/planes/)"
	@echo "make kv-codec           rebuild the shipped SmolLM2 KV codec files (artifacts/kv_codec/) through PoC 05, 43 min on 2 CPU cores (+25 for the keys-after-RoPE file)"
	@echo "make test               the fast tests, about 1-2.5 min on 2 CPU cores (not the ones marked slow)"
	@echo "make test-all           every test, the slow ones too, about 15 min (what CI runs; GPU tests skip without a GPU)"
	@echo "make test-gpu           the tests marked gpu alone, on a machine with a CUDA GPU (PYTHON=python3 without a virtualenv)"
	@echo "make fuzz               20,000 mutated bitstreams over every CPU backend (writes results/fuzz_summary.csv)"
	@echo "make models             retrain the embedded diffusion model"
	@echo "make clean              remove caches and captured activations (keeps results/ and figures/)"

setup: $(SETUP)

# Which torch build the virtualenv gets: cuda where `nvidia-smi -L` lists a GPU, else cpu.
# Override with  make setup TORCH=cpu  or  make setup TORCH=cuda  (every target takes it).
#   cpu:  requirements.txt       (torch 2.13.0+cpu; triton 3.6.0 for its interpreter)
#   cuda: requirements-cuda.txt  (torch 2.11.0 from PyPI, the CUDA 13.0 build, and its nvidia-* wheels; triton 3.6.0)
ifndef TORCH
TORCH := $(shell nvidia-smi -L 2>/dev/null | grep -q '^GPU ' && echo cuda || echo cpu)
endif
ifeq ($(TORCH),cuda)
LOCK := requirements-cuda.txt
else ifeq ($(TORCH),cpu)
LOCK := requirements.txt
else
$(error TORCH=$(TORCH): use TORCH=cpu or TORCH=cuda)
endif

# requirements.txt and requirements-cuda.txt are lock files (exact versions and hashes), made from
# requirements.in by `make lock`. The stamp .venv/.installed holds the build it installed (cpu or cuda):
# asking for the other one rebuilds the virtualenv from scratch.
ifneq ($(SETUP),)
ifneq ($(shell cat $(SETUP) 2>/dev/null),$(TORCH))
.PHONY: $(SETUP)
endif
endif
$(VENV)/.installed: $(LOCK) requirements-nodeps.txt
	@if [ -s $@ ] && [ "$$(cat $@)" != "$(TORCH)" ]; then \
	  echo ">> $(VENV) holds the $$(cat $@) build of torch; TORCH=$(TORCH) asked: recreating it"; rm -rf $(VENV); fi
	@echo ">> creating $(VENV) and installing $(LOCK) (TORCH=$(TORCH); first run only; about 5 minutes)"
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install --progress-bar on --require-hashes -r $(LOCK)
	$(VENV)/bin/pip install --progress-bar on --no-deps -r requirements-nodeps.txt
	echo $(TORCH) > $@

# poc-NN runs pocs/NN_<name>.py; a PoC not built yet says so and fails.
$(addprefix poc-,$(POCS)): poc-%: $(SETUP)
	@script=$$(ls pocs/$*_*.py 2>/dev/null | head -n 1); \
	if [ -z "$$script" ]; then echo "PoC $* is not built yet: see the PoC table in README.md"; exit 2; fi; \
	echo ">> $(PYTHON) $$script $(ARGS)"; $(PYTHON) $$script $(ARGS)

pocs: $(SETUP)
	@for n in $(POCS); do script=$$(ls pocs/$${n}_*.py 2>/dev/null | head -n 1); \
	  [ -n "$$script" ] || { echo ">> PoC $$n not built yet, skipped"; continue; }; \
	  echo ">> $$script"; $(PYTHON) $$script $(ARGS) || exit $$?; done

# Figures are redrawn from the committed CSVs alone, every time it is asked for (no rerun).
figures: $(SETUP)
	@for csv in $(RESULTS); do n=$$(basename $$csv .csv); \
	  echo ">> $(PYTHON) pocs/$$n.py --plot-only"; $(PYTHON) pocs/$$n.py --plot-only || exit $$?; done

# pip-tools resolves requirements.in on this machine (Python 3.11, Linux x86_64) and writes every
# version with its hashes; commit both files. `make lock` re-pins both locks: requirements.txt here,
# requirements-cuda.txt through lock-cuda.
PIP_TOOLS := pip-tools==7.5.3
lock:
	$(MAKE) lock-cpu
	$(MAKE) lock-cuda

lock-cpu:
	@py=$(PYTHON); [ -x "$$py" ] || py=python3; \
	$$py -m piptools compile --version >/dev/null 2>&1 || $$py -m pip install --quiet $(PIP_TOOLS); \
	echo ">> $$py -m piptools compile requirements.in -> requirements.txt (a few minutes)"; \
	CUSTOM_COMPILE_COMMAND="make lock" $$py -m piptools compile --quiet --generate-hashes --strip-extras \
	  --allow-unsafe --no-emit-index-url --no-emit-find-links -o requirements.txt requirements.in

# The CUDA lock: requirements.in with torch at $(TORCH_CUDA) (PyPI's Linux x86_64 torch wheel is the
# CUDA build and pulls the nvidia-* / cuda-toolkit wheels it needs). PyPI's torch 2.13.0 needs
# triton 3.7.1, not the triton==3.6.0 that requirements.in pins (the Triton the GPU results and the
# kernel tests were made with); torch 2.11.0 is the newest PyPI torch that needs triton 3.6.0, and is
# the torch that measured the committed GPU results. Resolved on Python $(LOCK_CUDA_PY_VERSION) (the GPU
# machine's), from PyPI alone (this machine's pip config and local wheels are left out), in a
# throwaway virtualenv; it holds every wheel of each pinned release, so it installs on cp311 and cp312.
# It starts from requirements.txt's pins (less torch), so both locks hold the same versions wherever
# the CUDA torch allows.
TORCH_CUDA := 2.11.0
LOCK_CUDA_PY_VERSION := 3.12
# Where python3.12 is not on PATH: make lock-cuda LOCK_CUDA_PYTHON=/path/to/python3.12
LOCK_CUDA_PYTHON ?= python$(LOCK_CUDA_PY_VERSION)
lock-cuda:
	@set -e; tmp=$$(mktemp -d); trap 'rm -rf $$tmp' EXIT; \
	{ echo "# Generated by make lock-cuda from requirements.in (edit that file, not this one): torch==$(TORCH_CUDA),"; \
	  echo "# the CUDA build that PyPI serves for Linux x86_64. requirements-cuda.txt is its lock."; \
	  sed 's/^torch==.*/torch==$(TORCH_CUDA)/' requirements.in; } > requirements-cuda.in; \
	awk '/^torch==/{skip=1; next} /^[a-z]/{skip=0} !skip' requirements.txt > requirements-cuda.txt; \
	$(LOCK_CUDA_PYTHON) -m venv $$tmp/venv; \
	export PIP_CONFIG_FILE=/dev/null; unset PIP_FIND_LINKS PIP_EXTRA_INDEX_URL PIP_INDEX_URL PIP_CONSTRAINT; \
	$$tmp/venv/bin/pip install --quiet --index-url https://pypi.org/simple $(PIP_TOOLS); \
	echo ">> piptools compile requirements-cuda.in -> requirements-cuda.txt on $$($$tmp/venv/bin/python -V), PyPI only (a few minutes)"; \
	CUSTOM_COMPILE_COMMAND="make lock-cuda" $$tmp/venv/bin/python -m piptools compile --quiet --generate-hashes \
	  --strip-extras --allow-unsafe --no-emit-index-url --no-emit-find-links --index-url https://pypi.org/simple \
	  -o requirements-cuda.txt requirements-cuda.in

readme: $(SETUP)
	$(PYTHON) -m shared.report

planes: $(SETUP)
	$(PYTHON) -m shared.sources export

# The KV codec files the repository ships (artifacts/kv_codec/, what shared.kvcodec.load_shipped reads):
# PoC 05's codec with all ideas, fitted and calibrated at the 512-token prefix (it writes the full files
# to data/kv_codec/, its rows to results/05_downstream_quality.csv and redraws its figure), then reduced
# to the analysis matrices (the decoder inverts them) after a check on the captured KV that they code it
# as the full files do. 43 minutes on a 2-core CPU (the +0.3% file is written after 28). Then the variant
# with keys coded after RoPE (the one PoC 17 runs attention on), for +0.3%: 25 more minutes.
# KV_CODEC_TARGETS: the perplexity targets (percent) shipped, of PoC 05's 0.3, 1 and 5.
KV_CODEC_TARGETS ?= 0.3 1
KV_CODEC_AFTER_ROPE_TARGETS ?= 0.3
KV_CODEC_DTYPE ?= float32
kv-codec: $(SETUP)
	$(PYTHON) pocs/05_downstream_quality.py --only llm --prefixes 512 --part best $(ARGS)
	$(PYTHON) -m shared.kvcodec ship --model smollm2 --prefix 512 --targets $(KV_CODEC_TARGETS) --dtype $(KV_CODEC_DTYPE)
	$(PYTHON) pocs/05_downstream_quality.py --only llm --prefixes 512 --part after_rope --targets $(KV_CODEC_AFTER_ROPE_TARGETS) $(ARGS)
	$(PYTHON) -m shared.kvcodec ship --model smollm2 --prefix 512 --targets $(KV_CODEC_AFTER_ROPE_TARGETS) \
		--dtype $(KV_CODEC_DTYPE) --keys-after-rope

# make test leaves out the tests marked slow (Triton-interpreter and compile runs, whole quick PoC runs);
# each family keeps a fast test in it. make test-all runs every test, as CI does.
test: $(SETUP)
	$(PYTHON) -m pytest -m "not slow"

test-all: $(SETUP)
	$(PYTHON) -m pytest

# The tests marked gpu alone (they skip without a CUDA GPU): on the GPU machine, make test-gpu PYTHON=python3.
test-gpu: $(SETUP)
	$(PYTHON) -m pytest -m gpu -p no:cacheprovider

# The decoder against hostile bitstreams; FUZZ_CASES mutants per backend (5 backends).
FUZZ_CASES ?= 4000
fuzz: $(SETUP)
	OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 $(PYTHON) -m shared.fuzz --cases $(FUZZ_CASES) $(ARGS)

models: $(SETUP)
	$(PYTHON) models/train_tiny_flux.py

clean:
	rm -rf .pytest_cache data/captures
	find . -name __pycache__ -type d -prune -not -path "./$(VENV)/*" -exec rm -rf {} +
