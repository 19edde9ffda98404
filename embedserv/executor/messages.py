"""The messages between the engine and a worker process, all sent through one codec (codec.py). No pickle.

engine -> worker: RunStep. worker -> engine: StepDone or StepFailed per step, Ready once loaded, LoadFailed
when it cannot load.
"""

from __future__ import annotations

from dataclasses import dataclass

from embedserv.executor.codec import Codec
from embedserv.scheduler.kv_cache_manager import KvCacheLayout
from embedserv.types import StepBatch, StepOutput


@dataclass(frozen=True)
class RunStep:
    step_id: int
    batch: StepBatch


@dataclass(frozen=True)
class StepDone:
    step_id: int
    output: StepOutput
    # The worker's cumulative seconds spent running steps.
    busy_seconds: float


@dataclass(frozen=True)
class StepFailed:
    step_id: int
    message: str
    busy_seconds: float


@dataclass(frozen=True)
class Ready:
    pid: int
    # The worker's KV cache (None for a model that keeps none): blocks and groups the scheduler manages.
    kv_cache: KvCacheLayout | None


@dataclass(frozen=True)
class LoadFailed:
    message: str


CODEC = Codec([RunStep, StepDone, StepFailed, Ready, LoadFailed])
