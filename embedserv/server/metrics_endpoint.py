"""The server's /metrics: embedserv.metrics' registry plus the state of the moment, read at scrape time."""

from __future__ import annotations

import logging
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Metric, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from embedserv import metrics
from embedserv.engine.core.local_core import LocalCore
from embedserv.errors import ConfigError
from embedserv.server.load_metrics import load_families

logger = logging.getLogger(__name__)


class ServerCollector(Collector):
    """Queue depth, inputs in flight, KV cache, workers and dropped sequences of every served model, and the load
    gauges routers and autoscalers read (load_metrics.py)."""

    def __init__(self, cores: Callable[[], list[LocalCore]], in_flight: Callable[[], int]) -> None:
        """`cores()`: the models' cores serving now; `in_flight()`: the inputs admitted now."""
        self.cores = cores
        self.in_flight = in_flight

    def collect(self):
        in_flight = GaugeMetricFamily(
            "embedserv_inputs_in_flight", "Inputs admitted and not yet answered (see --max-concurrent-requests)"
        )
        in_flight.add_metric([], self.in_flight())
        yield in_flight
        queue = GaugeMetricFamily("embedserv_queue_depth", "Sequences waiting for a batch", labels=["model"])
        dropped = CounterMetricFamily(
            "embedserv_dropped_sequences",
            "Queued sequences (and generation streams before their first step) dropped without running: "
            "their call was cancelled or its deadline passed",
            labels=["model"],
        )
        ready = GaugeMetricFamily("embedserv_workers_ready", "Worker processes ready to run", labels=["model"])
        restarts = CounterMetricFamily("embedserv_worker_restarts", "Worker processes replaced", labels=["model"])
        memory_restarts = CounterMetricFamily(
            "embedserv_worker_memory_restarts",
            "Worker processes replaced between steps past --worker-memory-limit",
            labels=["model"],
        )
        rss = GaugeMetricFamily(
            "embedserv_worker_resident_bytes",
            "A worker process's resident memory, as last read (with --worker-memory-limit)",
            labels=["model", "worker"],
        )
        busy = CounterMetricFamily(
            "embedserv_worker_busy_seconds", "Seconds a worker spent running batches", labels=["model", "worker"]
        )
        kv_usage = GaugeMetricFamily(
            "embedserv_kv_cache_usage_ratio",
            "Share of the KV cache blocks in use (generating models)",
            labels=["model"],
        )
        kv_blocks = GaugeMetricFamily("embedserv_kv_cache_blocks", "KV cache blocks", labels=["model", "state"])
        preemptions = CounterMetricFamily(
            "embedserv_kv_cache_preemptions", "Streams preempted for lack of KV cache blocks", labels=["model"]
        )
        cores = self.cores()
        stats = {core.info.name: core.stats() for core in cores}
        for name, core in stats.items():
            queue.add_metric([name], core.num_waiting)
            dropped.add_metric([name], core.num_dropped)
            ready.add_metric([name], sum(s.ready for s in core.workers))
            restarts.add_metric([name], sum(s.restarts for s in core.workers))
            memory_restarts.add_metric([name], sum(s.memory_restarts for s in core.workers))
            for s in core.workers:
                busy.add_metric([name, str(s.index)], s.busy_seconds)
                if s.rss_bytes:
                    rss.add_metric([name, str(s.index)], s.rss_bytes)
            usage = core.kv_cache
            if usage is not None:
                kv_usage.add_metric([name], usage.used_blocks / usage.total_blocks if usage.total_blocks else 0.0)
                kv_blocks.add_metric([name, "used"], usage.used_blocks)
                kv_blocks.add_metric([name, "total"], usage.total_blocks)
                preemptions.add_metric([name], usage.preemptions)
        yield from (queue, dropped, ready, restarts, memory_restarts, rss, busy, kv_usage, kv_blocks, preemptions)
        yield from self._embedding_caches(stats)
        yield from load_families([(core.info, stats[core.info.name]) for core in cores])

    def _embedding_caches(self, stats: dict):
        """Models served with --embedding-cache; counts read at scrape time like the rest here."""
        counters = {
            name: CounterMetricFamily(f"embedserv_embedding_cache_{name}", text, labels=["model"])
            for name, text in (
                ("hits", "Sequences answered by the embedding cache, or by an identical sequence in flight"),
                ("misses", "Sequences the embedding cache sent to the model"),
                ("evictions", "Embedding cache entries evicted to stay within its size"),
            )
        }
        gauges = {
            name: GaugeMetricFamily(f"embedserv_embedding_cache_{name}", text, labels=["model"])
            for name, text in (
                ("bytes", "Bytes the embedding cache holds (outputs, keys and per-entry overhead)"),
                ("capacity_bytes", "The embedding cache's size (--embedding-cache)"),
                ("entries", "Sequence outputs the embedding cache holds"),
            )
        }
        for model, core in stats.items():
            if core.cache is None:
                continue
            for name, family in {**counters, **gauges}.items():
                family.add_metric([model], getattr(core.cache, name))
        yield from counters.values()
        yield from gauges.values()


class _Summed(Collector):
    """The families of several collectors as one: samples with the same name and labels added up (the engine
    process's own batch counters, the front ends' call counters; a family may come from both)."""

    def __init__(self, sources: list) -> None:
        self.sources = sources

    def collect(self):
        families: dict[str, Metric] = {}
        for source in self.sources:
            for family in source.collect():
                merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                merged.samples.extend(family.samples)
        for family in families.values():
            sums: dict[tuple, Sample] = {}
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                known = sums.get(key)
                sums[key] = sample if known is None else known._replace(value=known.value + sample.value)
            family.samples = list(sums.values())
            yield family


class MetricsServer:
    """/metrics over HTTP in a thread of its own (prometheus-client's WSGI server)."""

    def __init__(
        self,
        host: str,
        port: int,
        cores: Callable[[], list[LocalCore]],
        in_flight: Callable[[], int],
        frontends_dir: str | None = None,
    ) -> None:
        """`frontends_dir`: where the front-end processes keep their counters and histograms (frontends.py);
        /metrics adds them to this process's own."""
        self.collector = ServerCollector(cores, in_flight)
        self.registry = metrics.REGISTRY
        if frontends_dir is not None:
            self.registry = CollectorRegistry()
            self.registry.register(_Summed([metrics.REGISTRY, MultiProcessCollector(None, frontends_dir)]))
        self.registry.register(self.collector)
        try:
            self._httpd, _ = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            self.registry.unregister(self.collector)
            raise ConfigError(
                f"cannot serve metrics on {host}:{port} ({exc.strerror}); pick another --metrics-port"
            ) from None
        self.port = self._httpd.server_port
        logger.info("metrics at http://%s:%d/metrics", host, self.port)

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self.registry.unregister(self.collector)
