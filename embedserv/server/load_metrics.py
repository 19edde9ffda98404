"""The load gauges routers and autoscalers read from /metrics, per served model, at scrape time: our own names and
the vLLM names the Gateway API Inference Extension's endpoint picker reads by default (its model-server
protocol), so a pool of embedserv pods works with it unchanged. The engine counts (scheduler/prefill_only.py,
engine/core/dispatch.py); this only reads."""

from __future__ import annotations

import time

from prometheus_client.core import GaugeMetricFamily

from embedserv.engine.core.local_core import CoreStats
from embedserv.types import ModelInfo


def load_families(models: list[tuple[ModelInfo, CoreStats]]):
    """The families of ServerCollector's load gauges, for every model of this process."""
    ours = {
        "requests_waiting": GaugeMetricFamily(
            "embedserv_requests_waiting",
            "API calls admitted whose sequences have not started a batch yet",
            labels=["model"],
        ),
        "requests_running": GaugeMetricFamily(
            "embedserv_requests_running",
            "API calls with a sequence in or through a batch, not answered yet (generation: streams stepping)",
            labels=["model"],
        ),
        "waiting_tokens": GaugeMetricFamily(
            "embedserv_waiting_tokens", "Tokens of the sequences waiting for a batch", labels=["model"]
        ),
        "worker_busy_ratio": GaugeMetricFamily(
            "embedserv_worker_busy_ratio",
            "Share of the last 10 s the model's workers had a batch in flight, averaged over its workers",
            labels=["model"],
        ),
    }
    by_class = {
        "waiting_by_class": GaugeMetricFamily(
            "embedserv_sequences_waiting",
            "Inputs (and generation streams) waiting for a batch, per priority and tenant (API key name)",
            labels=["model", "priority", "tenant"],
        ),
        "running_by_class": GaugeMetricFamily(
            "embedserv_sequences_running",
            "Inputs in a batch on a worker (and generation streams stepping), per priority and tenant",
            labels=["model", "priority", "tenant"],
        ),
    }
    waiting = GaugeMetricFamily(
        "vllm:num_requests_waiting", "embedserv_requests_waiting under vLLM's name", labels=["model_name"]
    )
    running = GaugeMetricFamily(
        "vllm:num_requests_running", "embedserv_requests_running under vLLM's name", labels=["model_name"]
    )
    kv_usage = GaugeMetricFamily(
        "vllm:kv_cache_usage_perc",
        "Share of the KV cache blocks in use, 0..1 (0: the model keeps no KV cache)",
        labels=["model_name"],
    )
    cache_config = GaugeMetricFamily(
        "vllm:cache_config_info",
        "The KV cache's size (generating models; value 1, the labels tell)",
        labels=["model_name", "block_size", "num_gpu_blocks"],
    )
    lora = GaugeMetricFamily(
        "vllm:lora_requests_info",
        "LoRA adapters a model serves (all always loaded); the value is the scrape's Unix time",
        labels=["model_name", "max_lora", "running_lora_adapters", "waiting_lora_adapters"],
    )
    for info, stats in models:
        load = stats.load
        name = info.name
        for field, family in ours.items():
            family.add_metric([name], getattr(load, field))
        for field, family in by_class.items():
            for (priority, tenant), count in getattr(load, field).items():
                family.add_metric([name, str(priority), tenant], count)
        waiting.add_metric([name], load.requests_waiting)
        running.add_metric([name], load.requests_running)
        usage = stats.kv_cache
        kv_usage.add_metric([name], usage.used_blocks / usage.total_blocks if usage and usage.total_blocks else 0.0)
        if usage is not None:
            cache_config.add_metric([name, str(usage.block_size), str(usage.total_blocks)], 1)
        adapters = info.lora_adapters
        if adapters:
            lora.add_metric([name, str(len(adapters)), ",".join(adapters), ""], time.time())
    yield from ours.values()
    yield from by_class.values()
    yield from (waiting, running, kv_usage, cache_config, lora)
