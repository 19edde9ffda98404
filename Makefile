# `make serve` and `make test` set everything up on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build; a bare `torch` would pull the newest CUDA wheels.
TORCH_SPEC ?= torch==2.13.0
HOST ?= 127.0.0.1
PORT ?= 50051
PYTEST_ARGS ?=

.PHONY: serve test test-all proto bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.torch: | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install $(TORCH_SPEC)
	touch $@

$(VENV)/.installed: pyproject.toml $(VENV)/.torch
	$(BIN)/pip install -e .
	touch $@

# The client package (clients/python) is tested against live servers, so tests install it too.
$(VENV)/.installed-test: pyproject.toml clients/python/pyproject.toml $(VENV)/.torch
	$(BIN)/pip install -e '.[test]' -e clients/python
	touch $@

serve: $(VENV)/.installed
	$(BIN)/embedserv serve --host $(HOST) --port $(PORT)

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-all: $(VENV)/.installed-test
	$(BIN)/python -m pytest --run-slow $(PYTEST_ARGS)

proto: $(VENV)/.installed-test
	$(BIN)/python proto/generate.py

bench: $(VENV)/.installed-test
	$(BIN)/python benchmarks/embed_throughput.py

clean:
	rm -rf $(VENV) build *.egg-info
