# `make serve` and `make test` set everything up on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The torch to install when .venv has none. From a normal package index (PyPI) `torch==2.13.0` on Linux is the
# CUDA build (gigabytes); TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu takes the CPU wheel from PyTorch's
# own index instead. Empty (the default): the configured index, as on machines with a local CPU wheel.
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX_URL ?=
HOST ?= 127.0.0.1
PORT ?= 50051
# The HTTP APIs (OpenAI, Cohere/Jina rerank, TEI); 0 turns them off.
HTTP_PORT ?= 8000
# Prometheus /metrics (the chart's metrics port too); 0 turns it off.
METRICS_PORT ?= 9090
PYTEST_ARGS ?=
# pip compiles every module it installs (22,000 files, most never imported: 50 s of a clean `make test` on two
# cores); installed without that, Python compiles each module the first time one imports it, and keeps it, as
# long as bytecode may be written. So it may, under make, even where the environment says otherwise.
PIP_INSTALL := $(BIN)/pip install --no-compile
unexport PYTHONDONTWRITEBYTECODE
# What installs the project and its extras once torch is in: uv (the default; pip puts it into .venv first) or pip.
# The test set-up of a clean clone took 139 s through pip and 19 s through uv on 2 cores (docs/performance-history.md).
# torch stays pip's (the configured index, TORCH_INDEX_URL) and uv is held to the build installed, so it never swaps
# it for another (PyPI's CUDA build). uv reads PyPI or UV_INDEX_URL, not pip's configuration: where it cannot
# install, pip does. INSTALLER=pip installs with pip alone.
INSTALLER ?= uv
USE_UV := $(filter uv,$(INSTALLER))
TORCH_PIN := $(VENV)/torch-pin.txt
UV_INSTALL := $(BIN)/uv pip install --python $(BIN)/python --constraint $(TORCH_PIN)
# $(call install,ARGS): ARGS installed into .venv by INSTALLER.
install = $(if $(USE_UV),$(UV_INSTALL) $(1) || { echo "uv could not install; pip will"; \
	$(PIP_INSTALL) $(1); },$(PIP_INSTALL) $(1))

.PHONY: serve test test-all lint format proto models-doc docs bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.torch: | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(PIP_INSTALL) $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL) )$(TORCH_SPEC)
	touch $@

# The torch build uv must keep, and uv itself (without it, the installs below fall back to pip).
$(TORCH_PIN): $(VENV)/.torch
	$(BIN)/python -c "import torch; print('torch==' + torch.__version__)" > $@
	$(if $(USE_UV),$(PIP_INSTALL) -q uv || true)

$(VENV)/.installed: pyproject.toml $(TORCH_PIN)
	$(call install,-e .)
	touch $@

# The client package (clients/python) is tested against live servers, so tests install it too.
# '.[test]' installs all that `make serve` needs too: mark that done, so that test_make_serve after
# `make test` serves at once instead of installing the project again.
$(VENV)/.installed-test: pyproject.toml clients/python/pyproject.toml $(TORCH_PIN)
	$(call install,-e '.[test]' -e clients/python)
	touch $@ $(VENV)/.installed

$(VENV)/.installed-lint: pyproject.toml $(VENV)/.installed-test
	$(call install,-e '.[lint]')
	touch $@

# ruff (lint and format, configured in pyproject.toml) on the whole tree; mypy on the torch-free core.
lint: $(VENV)/.installed-lint
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# Fixes what ruff can fix by itself and formats the tree.
format: $(VENV)/.installed-lint
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

serve: $(VENV)/.installed
	$(BIN)/embedserv serve --host $(HOST) --port $(PORT) --http-port $(HTTP_PORT) \
		$(if $(filter-out 0,$(METRICS_PORT)),--metrics-port $(METRICS_PORT))

# Two pytest workers, each test module on one of them (its module-scoped servers start once).
TEST_WORKERS ?= 2

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

test-all: $(VENV)/.installed-test
	$(BIN)/python -m pytest --run-slow $(PYTEST_ARGS)

proto: $(VENV)/.installed-test
	$(BIN)/python proto/generate.py

# docs/MODELS.md from the model registry (a test fails when it is stale).
models-doc: $(VENV)/.installed-test
	$(BIN)/python docs/models_table.py

# The docs site: the generated pages (reference, models, performance and its charts), then the site into site/,
# strictly (a broken link or anchor, or a page outside the nav, fails). `$(BIN)/mkdocs serve` previews it.
docs: $(VENV)/.installed-test
	$(BIN)/python docs/reference.py
	$(BIN)/python docs/models_table.py
	$(BIN)/python benchmarks/performance_page.py
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

bench: $(VENV)/.installed-test
	$(BIN)/python benchmarks/embed_throughput.py

clean:
	rm -rf $(VENV) build *.egg-info

# A lent GPU machine (docs/GPU.md) has no network and its own torch. `make gpu-wheels`, here, packs .gpu/:
# the bundled model in float16 (small enough to travel) and the wheels that machine lacks. `make gpu-check`,
# there, installs those (no index, no deps: its torch stays) and runs the CUDA tests and the GPU benchmarks.
GPU_PYTHON ?= python3
GPU_DIR ?= .gpu
GPU_INSTALL ?= $(if $(wildcard $(GPU_DIR)/wheels/requirements.txt),--install-wheels $(GPU_DIR)/wheels)
GPU_CHECK_ARGS ?=

.PHONY: gpu-wheels gpu-check

gpu-wheels: $(VENV)/.installed-test
	$(BIN)/python benchmarks/gpu_prepare.py --out $(GPU_DIR)

gpu-check:
	PYTHONUNBUFFERED=1 $(GPU_PYTHON) benchmarks/gpu_check.py $(GPU_INSTALL) $(GPU_CHECK_ARGS)
