"""The worker's load as a router reads it (VllmEngine.GetLoads): from the figures the engine
published with its last output (`EngineFigures.load`), answered at once, never waiting for an
engine step."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .admission import Admission
    from .messages import EngineFigures

THROUGHPUT_WINDOW_S = 10.0  # generation throughput: tokens over about this long


@dataclass(frozen=True, slots=True)
class LoadFigures:
    running: int  # requests decoding
    waiting: int  # requests waiting for their first token
    waiting_tokens: int  # prompt tokens of the waiting requests (none served from cache yet)
    used_tokens: int  # tokens the requests in flight hold in the KV cache
    capacity_tokens: int  # tokens the KV budget holds (0: unknown)
    gen_throughput: float  # tokens per second, lately
    cache_hit_rate: float  # prompt tokens served from the prefix store, of all prompt tokens
    max_running: int  # rows the engine decodes at once

    @property
    def token_usage(self) -> float:
        if not self.capacity_tokens:
            return 0.0
        return min(1.0, self.used_tokens / self.capacity_tokens)

    @property
    def utilization(self) -> float:
        return min(1.0, self.running / self.max_running) if self.max_running else 0.0


class Throughput:
    """Tokens per second over the last THROUGHPUT_WINDOW_S, from a running total."""

    def __init__(self) -> None:
        self._samples: deque[tuple[float, int]] = deque()

    def rate(self, total: int, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        samples = self._samples
        samples.append((now, total))
        while len(samples) > 2 and now - samples[1][0] >= THROUGHPUT_WINDOW_S:
            samples.popleft()
        start, first = samples[0]
        return (total - first) / (now - start) if now > start else 0.0


def load_figures(
    figures: EngineFigures,
    admission: Admission | None,
    throughput: Throughput,
    max_running: int,
) -> LoadFigures:
    """The load from the engine's last published figures (no engine step is waited for)."""
    load, prefix = figures.load, figures.prefix
    reused = prefix.ram_tokens + prefix.disk_tokens if prefix is not None else 0
    prompt_tokens = load.prompt_tokens
    return LoadFigures(
        running=load.running,
        waiting=load.waiting,
        waiting_tokens=load.waiting_tokens,
        used_tokens=load.used_tokens,
        capacity_tokens=admission.token_capacity() if admission is not None else 0,
        gen_throughput=throughput.rate(load.generated),
        cache_hit_rate=min(1.0, reused / prompt_tokens) if prompt_tokens else 0.0,
        max_running=max_running,
    )
