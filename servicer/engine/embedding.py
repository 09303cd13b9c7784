"""Embeddings: a prompt's pooled final hidden state, from the loaded model's inner transformer
(the final norm's output), on the engine thread beside generation. A forward here uses no
cache at all, so the BatchGenerator's caches are never touched.

Prompts of one step go through together, right-padded: in a causal model a real position
never sees the padding after it, so its hidden state is exact. A long prompt goes through in
chunks with a cache of its own (as a prefill does), so its attention never spans it whole.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from ..messages import EmbedRequest, EmbedResult
from ..ratelimit import RateLimitedLog

log = logging.getLogger(__name__)

POOLINGS = ("last", "mean")
BATCH_TOKENS = 8192  # padded tokens in one forward at most (a longer prompt goes alone)
PAD = 0  # any id will do: a causal model's real positions never see it
CHUNK = 2048  # tokens a row goes through in one forward at most

Inner = Callable[..., mx.array]  # (ids (B, T), cache=...) -> hidden (B, T, H)


def inner_module(model: nn.Module) -> tuple[Inner | None, int, str]:
    """The module whose output is the final-norm hidden state (inputs (B, T) -> (B, T, H)),
    its H, or None, 0 and why none works. Tried on a 2-token input."""
    reasons = []
    for path in ("model", "language_model.model"):
        module: Any = model
        for name in path.split("."):
            module = getattr(module, name, None)
        if module is None or not callable(module):
            reasons.append(f"no {path}")
            continue
        try:
            hidden = module(mx.array([[PAD, PAD]]), cache=None)
            mx.eval(hidden)
        except Exception as exc:
            reasons.append(f"{path} failed: {type(exc).__name__}: {exc}")
            continue
        shape = getattr(hidden, "shape", ())
        if len(shape) == 3 and tuple(shape[:2]) == (1, 2) and shape[2] > 0:
            return module, int(shape[2]), ""
        reasons.append(f"{path} gives shape {shape}")
    return None, 0, "; ".join(reasons)


class Embedder:
    """Answers embed requests with the model's pooled hidden states (`size` 0: it cannot,
    and every request gets an error saying why)."""

    def __init__(
        self,
        inner: Inner | None,
        size: int,
        why: str,
        new_cache: Callable[[], list[Any]] | None = None,
        chunk: int = CHUNK,
    ) -> None:
        """`new_cache`: fresh caches for the inner module, for prompts longer than `chunk`
        (None: any prompt goes through whole)."""
        self._inner = inner
        self.size = size if inner is not None else 0
        self._why = why
        self._new_cache = new_cache
        self._chunk = max(1, chunk)
        self._errors = RateLimitedLog(log, 30.0)

    @classmethod
    def of(cls, model: nn.Module, distributed: bool, chunk: int = CHUNK) -> Embedder:
        """What `model` can do; a distributed model cannot embed (a forward on one rank
        alone would stall its collectives)."""
        if distributed:
            return cls(None, 0, "embedding is not supported with --distributed")
        inner, size, why = inner_module(model)
        if inner is None:
            log.info("this model cannot embed: %s", why)
        return cls(inner, size, why, lambda: make_prompt_cache(model), chunk)

    def refuse(self, requests: list[EmbedRequest], why: str) -> list[EmbedResult]:
        return [EmbedResult(r.ticket, error=why) for r in requests]

    def run(self, requests: list[EmbedRequest]) -> list[EmbedResult]:
        """Every request's result, in order; a failure fails its own request only."""
        if self._inner is None:
            return self.refuse(requests, f"this model cannot embed: {self._why}")
        results: dict[int, EmbedResult] = {}
        valid = []
        for request in requests:
            error = _invalid(request)
            if error is not None:
                results[request.ticket] = EmbedResult(request.ticket, error=error)
            else:
                valid.append(request)
        for group in _groups(valid):
            for result in self._group(group):
                results[result.ticket] = result
        return [results[r.ticket] for r in requests]

    def _group(self, group: list[EmbedRequest]) -> list[EmbedResult]:
        """One forward for the group; should it fail, each request alone, so that the
        failure lands on the request that caused it."""
        try:
            return self._forward(group)
        except Exception as exc:
            if len(group) > 1:
                return [result for request in group for result in self._group([request])]
            self._errors.warning("embed", "an embedding failed: %s", exc, exc_info=exc)
            return [EmbedResult(group[0].ticket, error=f"{type(exc).__name__}: {exc}")]

    def _forward(self, group: list[EmbedRequest]) -> list[EmbedResult]:
        width = max(len(r.prompt) for r in group)
        ids = mx.array([r.prompt + [PAD] * (width - len(r.prompt)) for r in group])
        lengths = mx.array([len(r.prompt) for r in group])
        total, last = self._pool(ids, lengths)
        mean = total / lengths[:, None].astype(mx.float32)
        by_mean = mx.array([r.pooling == "mean" for r in group])[:, None]
        pooled = mx.where(by_mean, mean, last)
        norm = mx.linalg.norm(pooled, axis=-1, keepdims=True)
        normed = pooled / mx.maximum(norm, 1e-12)
        finite = mx.isfinite(normed).all(axis=-1)
        mx.eval(normed, finite)
        results = []
        for request, row, ok in zip(group, normed.tolist(), finite.tolist(), strict=True):
            if ok:
                results.append(EmbedResult(request.ticket, row))
            else:
                results.append(EmbedResult(request.ticket, error="the hidden state is not finite"))
        return results

    def _pool(self, ids: mx.array, lengths: mx.array) -> tuple[mx.array, mx.array]:
        """Each row's sum of hidden states over its real positions, and its last one, with
        `ids` through the model a chunk at a time (one chunk: no cache at all)."""
        assert self._inner is not None
        width = ids.shape[1]
        chunk = self._chunk if self._new_cache is not None else width
        cache = self._new_cache() if self._new_cache is not None and width > chunk else None
        total = last = mx.zeros((ids.shape[0], self.size), dtype=mx.float32)
        for start in range(0, width, chunk):
            hidden = self._inner(ids[:, start : start + chunk], cache=cache).astype(mx.float32)
            positions = mx.arange(start, start + hidden.shape[1])[None, :, None]
            real = positions < lengths[:, None, None]
            ends = positions == (lengths - 1)[:, None, None]
            total = total + mx.where(real, hidden, 0.0).sum(axis=1)
            last = last + mx.where(ends, hidden, 0.0).sum(axis=1)
            mx.eval(total, last)  # one chunk's graph at a time
        return total, last


def _invalid(request: EmbedRequest) -> str | None:
    if not request.prompt:
        return "an empty prompt has no embedding"
    if request.pooling not in POOLINGS:
        return f"unknown pooling {request.pooling!r} (use {' or '.join(POOLINGS)})"
    return None


def _groups(requests: list[EmbedRequest]) -> list[list[EmbedRequest]]:
    """Requests in forwards of at most BATCH_TOKENS padded tokens, similar lengths together."""
    groups: list[list[EmbedRequest]] = []
    current: list[EmbedRequest] = []
    for request in sorted(requests, key=lambda r: len(r.prompt)):
        # Sorted: this request is the longest so far, so it sets the padded width.
        if current and len(request.prompt) * (len(current) + 1) > BATCH_TOKENS:
            groups.append(current)
            current = []
        current.append(request)
    if current:
        groups.append(current)
    return groups
