# Two commands on a fresh machine: `make demo` and `make test`.
# Each creates .venv if missing and installs what it needs. On a CPU-only
# machine torch==2.13.0 is the local CPU build (no multi-GB CUDA download).
PY ?= python3
VENV := .venv
PIP := $(VENV)/bin/python -m pip
STAMP := $(VENV)/.installed

.PHONY: demo test test-gpu test-multigpu clean

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/python -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/python -m weightstream demo

# Two pytest-xdist workers (CI's 2-core machine); --dist loadfile keeps each test
# file in one worker, so module-scoped fixtures are built once per file.
test: $(STAMP)
	$(VENV)/bin/python -m pytest -q -n 2 --dist loadfile -m "not gpu and not multigpu"

# On the device machine (no network): the image's python already has torch,
# triton and safetensors; diffusers and pytest-xdist travel as wheels, installed
# with --no-index (docs/performance.md, "Running the benchmarks on the device").
# These tests fail (never skip) where the GPUs they need are missing. Eight
# workers share the GPU(s); --dist load spreads a file's tests over them (the
# support-matrix file alone holds 45 CUDA-graph cells).
test-gpu:
	python3 -m pytest -q -n 8 --dist load -m gpu

test-multigpu:
	python3 -m pytest -q -m multigpu

clean:
	rm -rf $(VENV) build *.egg-info
