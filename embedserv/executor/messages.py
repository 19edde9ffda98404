"""The messages between the engine and a worker process, all sent through one codec (codec.py). No pickle.

engine -> worker: RunStep (a whole StepBatch: prefill-only work) or RunGenerationStep (a generation step as a
StepDelta against the worker's running batch, executor/step_delta.py). worker -> engine: StepDone or StepFailed per
step, Ready once loaded, LoadFailed when it cannot load.
"""

from __future__ import annotations

from dataclasses import dataclass

from embedserv.executor.codec import Codec
from embedserv.executor.step_delta import StepDelta
from embedserv.scheduler.kv_cache_manager import KvCacheLayout
from embedserv.steps import StepBatch, StepOutput


@dataclass(frozen=True)
class RunStep:
    step_id: int
    batch: StepBatch


@dataclass(frozen=True)
class RunGenerationStep:
    step_id: int
    delta: StepDelta


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


CODEC = Codec([RunStep, RunGenerationStep, StepDone, StepFailed, Ready, LoadFailed])
