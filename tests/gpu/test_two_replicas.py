"""Two data-parallel replicas on one GPU: both worker processes come up on cuda:0, share the batches, and
embed as sentence-transformers does (float32, cosine >= 0.9999)."""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest
import torch

from embedserv.config import ModelConfig
from embedserv.engine.sync import SyncEngine
from embedserv.types import EmbedParams
from tests.helpers.compare import assert_cosine_at_least

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch sees none)"),
]

MIN_COSINE = 0.9999


def _pids_on_gpu(index: int) -> set[int] | None:
    """Processes holding memory on GPU `index` by NVML, or None where NVML cannot list them."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            pids = {p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return None
    return pids or None


def _placements_from_log(records) -> dict[int, str]:
    """pid -> device from the engine's `started worker ... (pid N) on DEVICE` lines."""
    found = {}
    for record in records:
        match = re.search(r"\(pid (\d+)\) on (\S+)", record.getMessage())
        if match:
            found[int(match.group(1))] = match.group(2)
    return found


def test_two_replicas_on_one_gpu_match_sentence_transformers(gpu_model_dir, reference, texts, caplog):
    # A small token budget makes many batches, so both replicas get some.
    config = ModelConfig(
        path=str(gpu_model_dir), served_name="minilm", device="cuda", dtype="float32", data_parallel_size=2,
        replicas_per_device=2, max_batch_tokens=512,
    )  # fmt: skip
    with caplog.at_level(logging.INFO, logger="embedserv"):
        with SyncEngine(config, worker_processes=True) as engine:
            ready = engine.worker_stats()
            results = engine.embed_concurrently([[t] for t in texts], EmbedParams(truncate=True))
            stats = engine.worker_stats()
            on_gpu = _pids_on_gpu(0)
    pids = [s.pid for s in ready]
    assert [s.index for s in ready] == [0, 1] and all(s.ready for s in ready), ready
    assert len(set(pids)) == 2, f"two worker processes expected: {ready}"
    assert all(s.batches > 0 for s in stats), f"both replicas should get batches: {stats}"
    # NVML shows which processes hold memory on GPU 0; where it lists none of ours (no process list in
    # this VM, another PID namespace), the engine's log must place both on cuda:0.
    if on_gpu is None or not set(pids) <= on_gpu:
        placements = _placements_from_log(caplog.records)
        assert {placements.get(pid) for pid in pids} == {"cuda:0"}, (
            f"workers {pids}: NVML lists {sorted(on_gpu) if on_gpu else 'no processes'} on GPU 0, and the log "
            f"places them at {placements}"
        )
    embeddings = np.concatenate([r.embeddings for r in results])
    expected = reference(gpu_model_dir).encode(texts, convert_to_numpy=True)
    assert_cosine_at_least(embeddings, expected, MIN_COSINE, texts, what="2 replicas on cuda:0, float32: ")
