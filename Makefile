# attnserve: `make serve` and `make test` set up everything they need on a fresh clone.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# The CPU build of torch that lies on these machines' disk; the CUDA image brings its own.
TORCH_PIN ?= torch==2.13.0

.PHONY: help install serve test test-gpu lint proto loadtest bench clean

help:
	@echo "make serve   - install, then run the service (HTTP :8000, gRPC :8001) on every GPU, else the CPU"
	@echo "make test    - install, then run the whole test suite (CPU; GPU tests skip without CUDA)"
	@echo "make lint    - ruff"
	@echo "make proto   - regenerate the gRPC stubs from proto/"
	@echo "make loadtest URL=http://host:8000 ARGS='--users 64 --run-time 60s' - headless Locust run"

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed proto

proto: $(VENV)/.installed
	$(PY) -m service.grpc.protogen

serve: install
	$(PY) -m service $(ARGS)

test: install
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-gpu: install
	$(PY) -m pytest -q -m gpu $(PYTEST_ARGS)

URL ?= http://127.0.0.1:8000
loadtest: install
	$(PY) -m loadtest.run --host $(URL) $(ARGS)

lint: $(VENV)/.installed
	$(PY) -m ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
