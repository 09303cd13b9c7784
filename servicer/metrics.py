"""Prometheus metrics, one registry per worker (two workers in a process do not mix)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from functools import partial
from threading import Thread
from types import MappingProxyType
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from .messages import (
    EngineFigures,
    EngineLoad,
    FailureKind,
    PrefixCacheStats,
    SpeculationFigures,
    StepOutput,
)

_FAILURE_METRIC = MappingProxyType(
    {
        FailureKind.INTERNAL: "engine_step",
        FailureKind.UNAVAILABLE: "engine_step",
        FailureKind.INVALID_ARGUMENT: "grammar",
    }
)
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5)
_PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# The prefix store's figures: (name, help, field); counters only ever grow.
_PREFIX_COUNTERS = (
    ("hits", "Requests that reused a kept prefix", "hits"),
    ("misses", "Requests that found no prefix to reuse", "misses"),
    ("evictions", "Prompt blocks that left RAM (to the disk tier when there is one)", "evictions"),
    ("faults", "Lookups served cold and blocks not kept because something failed", "faults"),
    (
        "snapshot_hits",
        "Hits that resumed from a snapshot of recurrent or sliding-window state",
        "snapshot_hits",
    ),
    ("dropped_writes", "Disk writes dropped because the write queue was full", "dropped_writes"),
    (
        "disk_faults",
        "Unreadable, corrupt or foreign files, failed writes, a bad directory",
        "disk_faults",
    ),
)
_PREFIX_GAUGES = (
    ("entries", "Prompt blocks kept in RAM", "entries"),
    ("bytes", "Bytes of the prompt blocks kept in RAM", "bytes"),
    ("pinned_blocks", "Prompt blocks held by running requests (never evicted)", "pinned_blocks"),
)
# By tier: (name, help, (RAM field, disk field), counter?)
_PREFIX_BY_TIER = (
    (
        "hits_by_tier",
        "Requests that reused a prefix, by where it came from",
        ("ram_hits", "disk_hits"),
        True,
    ),
    (
        "tokens_reused",
        "Prompt tokens reused, by where they came from",
        ("ram_tokens", "disk_tokens"),
        True,
    ),
    ("blocks", "Prompt blocks kept, by tier", ("entries", "disk_blocks"), False),
    ("tier_bytes", "Bytes of the prompt blocks kept, by tier", ("bytes", "disk_bytes"), False),
)


class PrefixCacheCollector:
    """The prefix store's latest published figures as Prometheus families: its monotonic
    counts as counters (so `rate()` works), its levels as gauges."""

    def __init__(self, stats: Callable[[], PrefixCacheStats | None]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats() or PrefixCacheStats()
        prefix = "mlx_worker_prompt_cache_"
        for name, doc, field in _PREFIX_COUNTERS:
            yield CounterMetricFamily(prefix + name, doc, value=getattr(stats, field))
        for name, doc, field in _PREFIX_GAUGES:
            yield GaugeMetricFamily(prefix + name, doc, value=getattr(stats, field))
        for name, doc, (ram, disk), counter in _PREFIX_BY_TIER:
            family_type = CounterMetricFamily if counter else GaugeMetricFamily
            family = family_type(prefix + name, doc, labels=["tier"])
            family.add_metric(["ram"], getattr(stats, ram))
            family.add_metric(["disk"], getattr(stats, disk))
            yield family


class SpeculationCollector:
    """Speculative decoding's published figures: drafts, acceptance, tokens a row gets per
    step, and steps that ran without drafts because too many rows would have drafted."""

    def __init__(self, figures: Callable[[], SpeculationFigures | None]) -> None:
        self._figures = figures

    def collect(self) -> Iterator[Metric]:
        spec = self._figures()
        if spec is None:
            return
        prefix = "mlx_worker_speculation_"
        yield CounterMetricFamily(
            prefix + "drafted_tokens", "Draft tokens verified by the target", value=spec.drafted
        )
        yield CounterMetricFamily(
            prefix + "accepted_tokens", "Draft tokens the target accepted", value=spec.accepted
        )
        rate = spec.accepted / spec.drafted if spec.drafted else 0.0
        yield GaugeMetricFamily(
            prefix + "acceptance_rate", "Accepted ÷ drafted tokens, since start", value=rate
        )
        yield CounterMetricFamily(
            prefix + "steps_off",
            "Decode steps run without drafts because more rows would draft than pays",
            value=spec.cutoff_steps,
        )
        yield _tokens_per_row_step(prefix + "tokens_per_row_step", spec.per_row_step)


def _tokens_per_row_step(name: str, counts: dict[int, int]) -> HistogramMetricFamily:
    """How many tokens one row got from one decode step, as a histogram."""
    bounds = range(1, max(counts, default=1) + 1)
    buckets = [(str(float(b)), sum(n for k, n in counts.items() if k <= b)) for b in bounds]
    total = sum(counts.values())
    family = HistogramMetricFamily(name, "Tokens one row got from one decode step")
    family.add_metric(
        [], [*buckets, ("+Inf", total)], sum_value=sum(k * n for k, n in counts.items())
    )
    return family


def _registering(registry: CollectorRegistry) -> tuple[Any, Any, Any]:
    """Makers of Counters, Gauges and Histograms registering in `registry`: (name, help,
    labels) for the first two, (name, help, buckets) for a histogram."""

    def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
        return Histogram(name, doc, buckets=buckets, registry=registry)

    return partial(Counter, registry=registry), partial(Gauge, registry=registry), histogram


class WorkerMetrics:
    def __init__(
        self,
        load: Callable[[], EngineLoad],
        figures: Callable[[], EngineFigures] = EngineFigures,
    ) -> None:
        """`load` and `figures` are read when metrics are collected (from the HTTP thread):
        plain counts, and the engine's last published figures."""
        self.registry = CollectorRegistry()
        self._requests()
        self._engine(load, figures)
        self._prefix_cache(lambda: figures().prefix)
        self.registry.register(SpeculationCollector(lambda: figures().speculation))
        self._http: Any = None

    def _requests(self) -> None:
        counter, _, histogram = _registering(self.registry)
        self.requests = counter(
            "mlx_worker_requests",
            "Generate calls by how they ended: a finish reason, 'cancelled', or a gRPC status",
            ["outcome"],
        )
        self.ttft = histogram(
            "mlx_worker_time_to_first_token_seconds",
            "From accepting a request to its first token",
            _LATENCY_BUCKETS,
        )
        self.inter_token = histogram(
            "mlx_worker_inter_token_latency_seconds",
            "Time between a request's successive tokens",
            _LATENCY_BUCKETS,
        )
        self.prompt_tokens = counter(
            "mlx_worker_prompt_tokens", "Prompt tokens of accepted requests"
        )
        self.bos_added = counter(
            "mlx_worker_bos_added",
            "Prompts that lacked the BOS their model's tokenizer puts first, which the worker "
            "put before them",
        )
        self.generated_tokens = counter("mlx_worker_generated_tokens", "Tokens generated")
        self.adapter_requests = counter(
            "mlx_worker_adapter_requests",
            "Generate calls for a served adapter (--adapter), by how they ended",
            ["adapter", "outcome"],
        )
        self.adapter_tokens = counter(
            "mlx_worker_adapter_generated_tokens",
            "Tokens generated for a served adapter",
            ["adapter"],
        )
        self.image_requests = counter(
            "mlx_worker_image_requests",
            "Requests with images, by who processed them: 'router' (mm_inputs) or 'worker' "
            "(media references the worker fetched)",
            ["processed_by"],
        )
        self.errors = counter(
            "mlx_worker_errors",
            "Errors by kind: invalid_request, duplicate_request, queue_full, kv_memory, "
            "grammar, engine_step, engine_death",
            ["kind"],
        )

    def count_request(self, outcome: str, adapter: str = "") -> None:
        """A Generate call ended: by outcome, and by adapter for a served adapter's."""
        self.requests.labels(outcome).inc()
        if adapter:
            self.adapter_requests.labels(adapter, outcome).inc()

    def _engine(self, load: Callable[[], EngineLoad], figures: Callable[[], EngineFigures]) -> None:
        counter, gauge, histogram = _registering(self.registry)
        self.waiting = gauge(
            "mlx_worker_waiting_requests", "Requests accepted but not yet decoding"
        )
        self.load_waiting = gauge(
            "mlx_worker_load_waiting_requests",
            "Requests that arrived while the model loads, waiting for it",
        )
        self.running = gauge("mlx_worker_running_requests", "Requests decoding")
        self.waiting.set_function(lambda: load().waiting)
        self.running.set_function(lambda: load().running)
        self.step_time = histogram(
            "mlx_worker_engine_step_seconds",
            "Duration of one engine step (admission, one batch step, hand-off)",
            _STEP_BUCKETS,
        )
        self.prefill_tokens = histogram(
            "mlx_worker_prefill_tokens_per_step",
            "Prompt tokens one engine step put through the model (steps that prefilled)",
            _PREFILL_BUCKETS,
        )
        self.over_budget = counter(
            "mlx_worker_prefill_steps_over_budget",
            "Steps whose prefill held decoding rows up longer than the budget in force",
        )
        budget = gauge(
            "mlx_worker_prefill_budget_seconds",
            "The prefill budget in force: --max-prefill-stall-ms, widened while prompts queue",
        )
        budget.set_function(lambda: figures().prefill_budget_s)
        self.widened = counter(
            "mlx_worker_prefill_steps_widened",
            "Steps whose prefill ran with the budget widened because prompts were queueing",
        )
        self.fused = counter(
            "mlx_worker_prefill_steps_fused",
            "Steps whose prefill chunk went through the decoding rows' forward (--fuse-prefill)",
        )
        self.images_encoded = counter(
            "mlx_worker_images_encoded",
            "Images put through the vision encoder (an image whose features or prefix were "
            "cached is not)",
        )

    def _prefix_cache(self, stats: Callable[[], PrefixCacheStats | None]) -> None:
        self.registry.register(PrefixCacheCollector(stats))
        _, _, histogram = _registering(self.registry)
        self.disk_load = histogram(
            "mlx_worker_prompt_cache_disk_load_seconds",
            "Reading one prompt block back from the disk tier",
            _STEP_BUCKETS,
        )

    def observe_output(self, out: StepOutput) -> None:
        """What one engine hand-off says about the engine's steps and failures."""
        for seconds in out.step_seconds:
            self.step_time.observe(seconds)
        for tokens in out.prefill_tokens:
            self.prefill_tokens.observe(tokens)
        for seconds in out.disk_load_seconds:
            self.disk_load.observe(seconds)
        if out.over_budget:
            self.over_budget.inc(out.over_budget)
        if out.widened_steps:
            self.widened.inc(out.widened_steps)
        if out.fused_steps:
            self.fused.inc(out.fused_steps)
        if out.images_encoded:
            self.images_encoded.inc(out.images_encoded)
        for kind in {failure.kind for failure in out.failures}:  # once per step and kind
            self.errors.labels(_FAILURE_METRIC[kind]).inc()
        if out.fatal is not None:
            self.errors.labels("engine_death").inc()

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
