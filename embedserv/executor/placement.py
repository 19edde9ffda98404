"""Where each worker of a model runs: its device, and on CPU its share of the cores."""

from __future__ import annotations

import os
from dataclasses import dataclass

from embedserv.config import ModelConfig
from embedserv.errors import ConfigError


@dataclass(frozen=True)
class Placement:
    device: str
    # Intra-op threads of the worker's torch.
    threads: int
    # CPUs the worker is pinned to; None leaves the affinity alone.
    cores: tuple[int, ...] | None


def available_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def place_workers(config: ModelConfig, num_gpus: int, cores: list[int]) -> list[Placement]:
    """One placement per worker.

    CUDA: `cuda` spreads the replicas round-robin over the first ceil(N / replicas_per_device) GPUs;
    `cuda:K` puts them all on GPU K. CPU: each worker gets an equal share of the cores, pinned to its own
    cores when they divide evenly, so the replicas' thread teams do not fight over one core.
    """
    n = config.data_parallel_size
    if config.device == "cpu":
        share = max(1, len(cores) // n)
        pin = n > 1 and len(cores) % n == 0
        return [Placement("cpu", share, tuple(cores[i * share : (i + 1) * share]) if pin else None) for i in range(n)]
    threads = max(1, len(cores) // n)
    if ":" in config.device:
        if n > config.replicas_per_device:
            raise ConfigError(
                f"--device {config.device} puts all {n} replicas on one GPU; raise --replicas-per-device to {n} "
                "or use --device cuda to spread them"
            )
        return [Placement(config.device, threads, None) for _ in range(n)]
    needed = -(-n // config.replicas_per_device)
    if needed > num_gpus:
        raise ConfigError(
            f"--data-parallel-size {n} with --replicas-per-device {config.replicas_per_device} needs {needed} GPUs; "
            f"{num_gpus} visible. Raise --replicas-per-device or lower --data-parallel-size"
        )
    return [Placement(f"cuda:{i % needed}", threads, None) for i in range(n)]
