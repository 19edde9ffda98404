"""place_workers: devices, threads and core pinning per worker; ModelConfig checks of the worker flags."""

from __future__ import annotations

import math

import pytest

from embedserv.config import ModelConfig
from embedserv.errors import ConfigError
from embedserv.executor.placement import Placement, place_workers


def config(device: str = "cpu", n: int = 1, rpd: int = 1) -> ModelConfig:
    return ModelConfig(path="x", served_name="m", device=device, data_parallel_size=n, replicas_per_device=rpd)


# --- CPU ---------------------------------------------------------------------------------------------


def test_cpu_one_worker_takes_all_cores_unpinned():
    assert place_workers(config("cpu", 1), 0, [0, 1]) == [Placement("cpu", 2, None)]


def test_cpu_two_workers_on_two_cores_are_pinned_one_core_each():
    assert place_workers(config("cpu", 2), 0, [0, 1]) == [Placement("cpu", 1, (0,)), Placement("cpu", 1, (1,))]


def test_cpu_more_workers_than_cores_get_one_thread_unpinned():
    placements = place_workers(config("cpu", 3), 0, [0, 1])
    assert placements == [Placement("cpu", 1, None)] * 3


def test_cpu_two_workers_on_four_cores_are_pinned_to_halves():
    placements = place_workers(config("cpu", 2), 0, [0, 1, 2, 3])
    assert placements == [Placement("cpu", 2, (0, 1)), Placement("cpu", 2, (2, 3))]


def test_cpu_pins_the_given_core_ids_not_their_positions():
    placements = place_workers(config("cpu", 2), 0, [2, 5, 7, 9])
    assert [p.cores for p in placements] == [(2, 5), (7, 9)]


def test_cpu_uneven_share_is_not_pinned():
    # 3 cores over 2 workers do not divide evenly: one thread each, no pinning.
    placements = place_workers(config("cpu", 2), 0, [0, 1, 2])
    assert placements == [Placement("cpu", 1, None)] * 2


def test_cpu_ignores_gpu_count_and_replicas_per_device():
    assert place_workers(config("cpu", 2, rpd=1), 0, [0, 1]) == place_workers(config("cpu", 2, rpd=5), 8, [0, 1])


# --- CUDA --------------------------------------------------------------------------------------------


def test_cuda_round_robin_over_needed_gpus():
    placements = place_workers(config("cuda", 4, rpd=2), 2, [0, 1, 2, 3])
    assert [p.device for p in placements] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    assert all(p.cores is None for p in placements)
    assert all(p.threads == 1 for p in placements)


def test_cuda_uses_only_the_first_ceil_n_over_rpd_gpus():
    placements = place_workers(config("cuda", 4, rpd=2), 4, [0, 1])
    assert [p.device for p in placements] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]


def test_cuda_two_replicas_share_one_gpu():
    placements = place_workers(config("cuda", 2, rpd=2), 2, [0, 1, 2, 3])
    assert [p.device for p in placements] == ["cuda:0", "cuda:0"]
    assert [p.threads for p in placements] == [2, 2]


def test_cuda_single_replica():
    assert place_workers(config("cuda", 1), 1, [0, 1]) == [Placement("cuda:0", 2, None)]


def test_cuda_too_few_gpus_is_a_config_error_naming_the_flags():
    with pytest.raises(ConfigError) as info:
        place_workers(config("cuda", 3, rpd=1), 2, [0, 1])
    message = str(info.value)
    assert "--data-parallel-size" in message
    assert "--replicas-per-device" in message
    assert "3 GPUs" in message and "2 visible" in message


def test_cuda_without_gpus_is_a_config_error():
    with pytest.raises(ConfigError, match="--replicas-per-device"):
        place_workers(config("cuda", 1), 0, [0, 1])


def test_cuda_k_with_more_replicas_than_allowed_is_a_config_error():
    with pytest.raises(ConfigError) as info:
        place_workers(config("cuda:1", 2, rpd=1), 2, [0, 1])
    message = str(info.value)
    assert "--replicas-per-device" in message
    assert "--device cuda" in message


def test_cuda_k_puts_all_replicas_on_that_gpu():
    placements = place_workers(config("cuda:1", 2, rpd=2), 2, [0, 1])
    assert placements == [Placement("cuda:1", 1, None), Placement("cuda:1", 1, None)]


# --- ModelConfig checks --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "flag"),
    [
        ("data_parallel_size", 0, "--data-parallel-size"),
        ("data_parallel_size", -1, "--data-parallel-size"),
        ("pipeline_depth", 0, "--pipeline-depth"),
        ("replicas_per_device", 0, "--replicas-per-device"),
        ("worker_timeout", 0, "--worker-timeout"),
        ("worker_timeout", -1.5, "--worker-timeout"),
        ("worker_timeout", math.nan, "--worker-timeout"),
    ],
)
def test_model_config_rejects_bad_worker_flags(field, value, flag):
    with pytest.raises(ConfigError, match=flag):
        ModelConfig(path="x", served_name="m", **{field: value})


def test_model_config_worker_defaults():
    cfg = ModelConfig(path="x", served_name="m")
    assert (cfg.data_parallel_size, cfg.replicas_per_device, cfg.pipeline_depth) == (1, 1, 2)
    assert cfg.worker_timeout > 0


def test_model_config_accepts_valid_worker_flags():
    cfg = ModelConfig(
        path="x",
        served_name="m",
        device="cuda",
        data_parallel_size=4,
        replicas_per_device=2,
        pipeline_depth=1,
        worker_timeout=0.5,
    )
    assert cfg.data_parallel_size == 4 and cfg.pipeline_depth == 1
