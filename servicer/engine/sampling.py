"""Samplers, logits processors, stop matchers and logprobs, built with mlx-lm's helpers.

BatchGenerator samples the whole batch in one call only when every row holds the same
sampler object, and runs logits processors row by row as soon as any row has one. So
equal sampling settings share one sampler object, and neutral penalties build nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Generic, TypeVar

import mlx.core as mx
from mlx_lm.generate import StopSequences
from mlx_lm.sample_utils import greedy_sampler, make_logits_processors, make_sampler

from ..messages import PenaltySpec, SamplingSpec, TokenLogprob

Sampler = Callable[[mx.array], mx.array]
K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


class _BoundedCache(Generic[K, V]):
    """A small LRU map; requests may carry arbitrary floats, so the key space is open."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._items: OrderedDict[K, V] = OrderedDict()

    def get_or_build(self, key: K, build: Callable[[], V]) -> V:
        value = self._items.get(key)
        if value is None:
            value = build()
            self._items[key] = value
            if len(self._items) > self._capacity:
                self._items.popitem(last=False)
        else:
            self._items.move_to_end(key)
        return value


class SamplingFactory:
    """Per-engine builder of per-request sampling objects, sharing what can be shared."""

    def __init__(self, vocab_size: int, cache_capacity: int = 128) -> None:
        self._vocab_size = vocab_size
        self._samplers: _BoundedCache[SamplingSpec, Sampler] = _BoundedCache(cache_capacity)
        self._stops: _BoundedCache[frozenset[int], StopSequences] = _BoundedCache(cache_capacity)

    def sampler(self, spec: SamplingSpec) -> Sampler:
        if spec.greedy:
            return greedy_sampler
        return self._samplers.get_or_build(spec, lambda: self._build_sampler(spec))

    def _build_sampler(self, spec: SamplingSpec) -> Sampler:
        # A top_k that keeps the whole vocabulary is no top_k at all (mlx-lm rejects it).
        top_k = spec.top_k if 0 < spec.top_k < self._vocab_size else 0
        return make_sampler(
            temp=spec.temperature,
            top_p=spec.top_p if spec.top_p < 1.0 else 0.0,
            min_p=spec.min_p,
            top_k=top_k,
        )

    @staticmethod
    def processors(spec: PenaltySpec) -> list[LogitsProcessor]:
        if not spec.active:
            return []
        return make_logits_processors(
            logit_bias=dict(spec.logit_bias) or None,
            repetition_penalty=spec.repetition_penalty if spec.repetition_penalty != 1.0 else None,
            frequency_penalty=spec.frequency_penalty or None,
            presence_penalty=spec.presence_penalty or None,
        )

    def stop_sequences(self, stop_token_ids: frozenset[int]) -> StopSequences:
        return self._stops.get_or_build(
            stop_token_ids, lambda: StopSequences([[t] for t in sorted(stop_token_ids)])
        )


def gather_logprobs(
    tokens: Sequence[int], rows: Sequence[mx.array], top_n: Sequence[int]
) -> list[TokenLogprob]:
    """Token logprob and top-N for several rows, pulled to Python in one evaluation."""
    logprobs = mx.stack(list(rows)).astype(mx.float32)
    chosen = mx.take_along_axis(logprobs, mx.array(tokens)[:, None], axis=-1)[:, 0]
    k = min(max(top_n), logprobs.shape[-1])
    if k > 0:
        top_ids = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[:, :k]
        top_values = mx.take_along_axis(logprobs, top_ids, axis=-1)
        order = mx.argsort(-top_values, axis=-1)
        top_ids = mx.take_along_axis(top_ids, order, axis=-1)
        top_values = mx.take_along_axis(top_values, order, axis=-1)
        mx.eval(chosen, top_ids, top_values)
        ids_list, values_list = top_ids.tolist(), top_values.tolist()
    else:
        mx.eval(chosen)
        ids_list = values_list = [[] for _ in tokens]
    return [
        TokenLogprob(logprob=lp, top_ids=tuple(ids[:n]), top_logprobs=tuple(vals[:n]))
        for lp, ids, vals, n in zip(chosen.tolist(), ids_list, values_list, top_n, strict=True)
    ]
