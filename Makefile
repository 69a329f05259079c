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

.PHONY: help test test-all fuzz pocs figures readme planes clean setup lock models $(addprefix poc-,$(POCS))

help:
	@echo "make poc-01 .. poc-19   run one PoC (writes results/NN_*.csv and figures/NN_*.png); ARGS=--quick for a small run"
	@echo "make pocs               every PoC that runs on this machine"
	@echo "make figures            redraw every figure from its CSV (no rerun)"
	@echo "make lock               re-pin requirements.txt (with hashes) from requirements.in"
	@echo "make readme             rewrite the results tables (docs/results.md, docs/decoder-checks.md) from results/*.csv"
	@echo "make planes             export real quantized PCA planes for the GPU benchmarks (data/planes/)"
	@echo "make test               the fast tests, about 1-2.5 min on 2 CPU cores (not the ones marked slow)"
	@echo "make test-all           every test, the slow ones too, about 15 min (what CI runs; GPU tests skip without a GPU)"
	@echo "make fuzz               20,000 mutated bitstreams over every CPU backend (writes results/fuzz_summary.csv)"
	@echo "make models             retrain the embedded diffusion model"
	@echo "make clean              remove caches and captured activations (keeps results/ and figures/)"

setup: $(SETUP)

# requirements.txt is the lock file (exact versions and hashes), made from requirements.in by `make lock`.
$(VENV)/.installed: requirements.txt requirements-nodeps.txt
	@echo ">> creating $(VENV) and installing the pinned requirements (first run only; about 5 minutes)"
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install --progress-bar on --require-hashes -r requirements.txt
	$(VENV)/bin/pip install --progress-bar on --no-deps -r requirements-nodeps.txt
	touch $@

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
# version with its hashes; commit both files.
PIP_TOOLS := pip-tools==7.5.3
lock:
	@py=$(PYTHON); [ -x "$$py" ] || py=python3; \
	$$py -m piptools --version >/dev/null 2>&1 || $$py -m pip install --quiet $(PIP_TOOLS); \
	echo ">> $$py -m piptools compile requirements.in -> requirements.txt (a few minutes)"; \
	CUSTOM_COMPILE_COMMAND="make lock" $$py -m piptools compile --quiet --generate-hashes --strip-extras \
	  --allow-unsafe --no-emit-index-url --no-emit-find-links -o requirements.txt requirements.in

readme: $(SETUP)
	$(PYTHON) -m shared.report

planes: $(SETUP)
	$(PYTHON) -m shared.sources export

# make test leaves out the tests marked slow (Triton-interpreter and compile runs, whole quick PoC runs);
# each family keeps a fast test in it. make test-all runs every test, as CI does.
test: $(SETUP)
	$(PYTHON) -m pytest -m "not slow"

test-all: $(SETUP)
	$(PYTHON) -m pytest

# The decoder against hostile bitstreams; FUZZ_CASES mutants per backend (5 backends).
FUZZ_CASES ?= 4000
fuzz: $(SETUP)
	OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 $(PYTHON) -m shared.fuzz --cases $(FUZZ_CASES) $(ARGS)

models: $(SETUP)
	$(PYTHON) models/train_tiny_flux.py

clean:
	rm -rf .pytest_cache data/captures
	find . -name __pycache__ -type d -prune -not -path "./$(VENV)/*" -exec rm -rf {} +
