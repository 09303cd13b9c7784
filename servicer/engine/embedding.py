"""Embeddings: a prompt's pooled final hidden state, from the loaded model's inner transformer
(the final norm's output), on the engine thread beside generation. A forward here uses no
cache at all, so the BatchGenerator's caches are never touched.

Prompts of one step go through together, right-padded: in a causal model a real position
never sees the padding after it, so its hidden state is exact.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..messages import EmbedRequest, EmbedResult
from ..ratelimit import RateLimitedLog

log = logging.getLogger(__name__)

POOLINGS = ("last", "mean")
BATCH_TOKENS = 8192  # padded tokens in one forward at most (a longer prompt goes alone)
PAD = 0  # any id will do: a causal model's real positions never see it


def inner_module(model: nn.Module) -> tuple[Callable[[mx.array], mx.array] | None, int, str]:
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
            hidden = module(mx.array([[PAD, PAD]]))
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

    def __init__(self, inner: Callable[[mx.array], mx.array] | None, size: int, why: str) -> None:
        self._inner = inner
        self.size = size if inner is not None else 0
        self._why = why
        self._errors = RateLimitedLog(log, 30.0)

    @classmethod
    def of(cls, model: nn.Module, distributed: bool) -> Embedder:
        """What `model` can do; a distributed model cannot embed (a forward on one rank
        alone would stall its collectives)."""
        if distributed:
            return cls(None, 0, "embedding is not supported with --distributed")
        inner, size, why = inner_module(model)
        if inner is None:
            log.info("this model cannot embed: %s", why)
        return cls(inner, size, why)

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
        assert self._inner is not None
        width = max(len(r.prompt) for r in group)
        ids = mx.array([r.prompt + [PAD] * (width - len(r.prompt)) for r in group])
        hidden = self._inner(ids).astype(mx.float32)  # (B, T, H)
        lengths = mx.array([len(r.prompt) for r in group])
        real = mx.arange(width)[None, :, None] < lengths[:, None, None]
        mean = mx.where(real, hidden, 0.0).sum(axis=1) / lengths[:, None].astype(mx.float32)
        last = hidden[mx.arange(len(group)), lengths - 1]
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
