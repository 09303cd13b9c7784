"""Prometheus metrics, one registry per worker (two workers in a process do not mix)."""

from __future__ import annotations

from collections.abc import Callable
from threading import Thread
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from .messages import EngineLoad, PrefixCacheStats

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5)
_PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_PREFIX_GAUGES = (
    ("entries", "Prompt blocks kept in RAM", "entries"),
    ("bytes", "Bytes of the prompt blocks kept in RAM", "bytes"),
    ("hits", "Requests that reused a kept prefix", "hits"),
    ("misses", "Requests that found no prefix to reuse", "misses"),
    ("evictions", "Prompt blocks that left RAM (to the disk tier when there is one)", "evictions"),
    ("faults", "Lookups served cold and blocks not kept because something failed", "faults"),
    (
        "snapshot_hits",
        "Hits that resumed from a snapshot of recurrent or sliding-window state",
        "snapshot_hits",
    ),
    ("pinned_blocks", "Prompt blocks held by running requests (never evicted)", "pinned_blocks"),
    ("dropped_writes", "Disk writes dropped because the write queue was full", "dropped_writes"),
    (
        "disk_faults",
        "Unreadable, corrupt or foreign files, failed writes, a bad directory",
        "disk_faults",
    ),
)
_PREFIX_TIER_GAUGES = (
    (
        "hits_by_tier",
        "Requests that reused a prefix, by where it came from",
        ("ram_hits", "disk_hits"),
    ),
    (
        "tokens_reused",
        "Prompt tokens reused, by where they came from",
        ("ram_tokens", "disk_tokens"),
    ),
    ("blocks", "Prompt blocks kept, by tier", ("entries", "disk_blocks")),
    ("tier_bytes", "Bytes of the prompt blocks kept, by tier", ("bytes", "disk_bytes")),
)


class WorkerMetrics:
    def __init__(
        self,
        load: Callable[[], EngineLoad],
        prefix_cache: Callable[[], PrefixCacheStats | None] = lambda: None,
    ) -> None:
        self.registry = CollectorRegistry()
        self._requests()
        self._engine(load)
        self._prefix_cache(prefix_cache)
        self._http: Any = None

    def _requests(self) -> None:
        reg = self.registry
        self.requests = Counter(
            "mlx_worker_requests",
            "Generate calls by how they ended: a finish reason, 'cancelled', or a gRPC status",
            ["outcome"],
            registry=reg,
        )
        self.ttft = Histogram(
            "mlx_worker_time_to_first_token_seconds",
            "From accepting a request to its first token",
            buckets=_LATENCY_BUCKETS,
            registry=reg,
        )
        self.inter_token = Histogram(
            "mlx_worker_inter_token_latency_seconds",
            "Time between a request's successive tokens",
            buckets=_LATENCY_BUCKETS,
            registry=reg,
        )
        self.prompt_tokens = Counter(
            "mlx_worker_prompt_tokens", "Prompt tokens of accepted requests", registry=reg
        )
        self.generated_tokens = Counter(
            "mlx_worker_generated_tokens", "Tokens generated", registry=reg
        )
        self.errors = Counter(
            "mlx_worker_errors",
            "Errors by kind: invalid_request, duplicate_request, queue_full, kv_memory, "
            "grammar, engine_step, engine_death",
            ["kind"],
            registry=reg,
        )

    def _engine(self, load: Callable[[], EngineLoad]) -> None:
        reg = self.registry
        self.waiting = Gauge(
            "mlx_worker_waiting_requests", "Requests accepted but not yet decoding", registry=reg
        )
        self.running = Gauge("mlx_worker_running_requests", "Requests decoding", registry=reg)
        self.waiting.set_function(lambda: load().waiting)
        self.running.set_function(lambda: load().running)
        self.step_time = Histogram(
            "mlx_worker_engine_step_seconds",
            "Duration of one engine step (admission, one batch step, hand-off)",
            buckets=_STEP_BUCKETS,
            registry=reg,
        )
        self.prefill_tokens = Histogram(
            "mlx_worker_prefill_tokens_per_step",
            "Prompt tokens one engine step put through the model (steps that prefilled)",
            buckets=_PREFILL_BUCKETS,
            registry=reg,
        )
        self.over_budget = Counter(
            "mlx_worker_prefill_steps_over_budget",
            "Steps whose prefill held decoding rows up longer than --max-prefill-stall-ms",
            registry=reg,
        )

    def _prefix_cache(self, stats: Callable[[], PrefixCacheStats | None]) -> None:
        def read(field: str) -> Callable[[], float]:
            return lambda: getattr(stats() or PrefixCacheStats(), field)

        for name, doc, field in _PREFIX_GAUGES:
            gauge = Gauge(f"mlx_worker_prompt_cache_{name}", doc, registry=self.registry)
            gauge.set_function(read(field))
        for name, doc, (ram, disk) in _PREFIX_TIER_GAUGES:
            gauge = Gauge(f"mlx_worker_prompt_cache_{name}", doc, ["tier"], registry=self.registry)
            gauge.labels("ram").set_function(read(ram))
            gauge.labels("disk").set_function(read(disk))
        self.disk_load = Histogram(
            "mlx_worker_prompt_cache_disk_load_seconds",
            "Reading one prompt block back from the disk tier",
            buckets=_STEP_BUCKETS,
            registry=self.registry,
        )

    def serve(self, host: str, port: int) -> int:
        """Expose /metrics over HTTP; returns the bound port."""
        server, thread = start_http_server(port, addr=host, registry=self.registry)
        self._http = (server, thread)
        return server.server_port

    def close(self) -> None:
        if self._http is not None:
            server, thread = self._http
            server.shutdown()
            server.server_close()
            assert isinstance(thread, Thread)
            thread.join(5)
            self._http = None
