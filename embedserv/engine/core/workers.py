"""The workers of one served model: one model thread in this process, or worker processes placed on the
machine's devices and cores."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import torch

from embedserv.config import ModelConfig
from embedserv.executor.local_worker import LocalWorker
from embedserv.executor.placement import available_cores, place_workers
from embedserv.executor.process_worker import ProcessWorker
from embedserv.models.loading.model_spec import ModelSpec
from embedserv.worker.replica import build_runner


def load_local_worker(config: ModelConfig, spec: ModelSpec, warm_up: bool) -> LocalWorker:
    """The model in this process on one model thread (blocking; call it off the event loop); one replica.

    Every torch call of a model runs on its one model thread, loading included: OpenMP keeps a thread
    team per calling thread, and a second team's idle spinning slows the first by 15-30% on 2 cores.
    """
    model_thread = ThreadPoolExecutor(1, thread_name_prefix=f"model-{config.served_name}")
    try:
        runner = model_thread.submit(build_runner, config, spec).result()
        if warm_up:
            model_thread.submit(runner.warm_up, spec.info.max_input_tokens, config.batch_token_budget).result()
    except BaseException:
        model_thread.shutdown(wait=False)
        raise
    return LocalWorker(runner, model_thread)


def worker_processes(config: ModelConfig) -> list[ProcessWorker]:
    """`config.data_parallel_size` worker processes, placed (started later, by the engine's start())."""
    num_gpus = torch.cuda.device_count() if config.device != "cpu" else 0
    placements = place_workers(config, num_gpus, available_cores())
    return [
        ProcessWorker(index, replace(config, device=placement.device), placement)
        for index, placement in enumerate(placements)
    ]
