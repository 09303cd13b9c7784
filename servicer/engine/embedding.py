"""Embeddings: a prompt's pooled final hidden state, from the loaded model's inner transformer
(the final norm's output), on the engine thread beside generation. A forward here uses no
cache at all, so the batch's caches are never touched.

Prompts of one step go through together, right-padded: in a causal model a real position
never sees the padding after it, so its hidden state is exact. A long prompt goes through in
chunks with a cache of its own (as a prefill does), so its attention never spans it whole;
beside decoding rows, one chunk a step, sized by the prefill budget, so that an embed of a
whole context does not stall the streams for seconds.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
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
MIN_CHUNK = 16  # beside decoding rows, a forward's width however small the prefill budget

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
        self._jobs: deque[_Job] = deque()

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

    @property
    def busy(self) -> bool:
        """Whether forwards of taken requests are still to run (`advance`)."""
        return bool(self._jobs)

    def run(self, requests: list[EmbedRequest]) -> list[EmbedResult]:
        """Every request's result, in order; a failure fails its own request only."""
        done = {r.ticket: r for r in self.take(requests, None)}
        return [done[r.ticket] for r in requests]

    def take(self, requests: list[EmbedRequest], tokens: int | None) -> list[EmbedResult]:
        """`start`, then `advance`; a fault that escapes them (a last guard: each answers its
        own) fails every request held, never the engine."""
        try:
            refused = self.start(requests)
        except Exception as exc:
            log.exception("embedding failed")
            return self.refuse(requests, f"embedding failed: {exc}")
        try:
            return [*refused, *self.advance(tokens)]
        except Exception as exc:
            log.exception("embedding failed")
            return [*refused, *self.cancel(f"embedding failed: {exc}")]

    def start(self, requests: list[EmbedRequest]) -> list[EmbedResult]:
        """The requests queued for `advance`, in forwards of similar lengths; the results of
        those refused at once."""
        if self._inner is None:
            return self.refuse(requests, f"this model cannot embed: {self._why}")
        refused, valid = [], []
        for request in requests:
            error = _invalid(request)
            if error is not None:
                refused.append(EmbedResult(request.ticket, error=error))
            else:
                valid.append(request)
        jobs = [self._job(group) for group in _groups(valid)]  # all queued, or none
        self._jobs.extend(jobs)
        return refused

    def advance(self, tokens: int | None) -> list[EmbedResult]:
        """Queued forwards: one chunk of about `tokens` padded tokens (summed over the rows of
        a forward; beside decoding rows, what the prefill budget allows a step), or every one
        (None); the results of the requests this finished."""
        results: list[EmbedResult] = []
        while self._jobs and (tokens is None or not results):
            job = self._jobs[0]
            width = self._chunk if tokens is None else tokens // len(job.group)
            try:
                finished = self._step(job, min(self._chunk, max(MIN_CHUNK, width)))
            except Exception as exc:
                self._jobs.popleft()
                results.extend(self._failed(job.group, exc))
                continue
            if finished:
                self._jobs.popleft()
                results.extend(self._pooled(job))
            if tokens is not None:
                break  # one chunk a step
        return results

    def cancel(self, why: str) -> list[EmbedResult]:
        """Every queued request, refused (the engine stops)."""
        jobs, self._jobs = self._jobs, deque()
        return self.refuse([r for job in jobs for r in job.group], why)

    def _failed(self, group: list[EmbedRequest], exc: Exception) -> list[EmbedResult]:
        """A forward of `group` failed: each request again alone, so that the failure lands
        on the request that caused it."""
        if len(group) > 1:
            self._jobs.extendleft(self._job([r]) for r in reversed(group))
            return []
        self._errors.warning("embed", "an embedding failed: %s", exc, exc_info=exc)
        return [EmbedResult(group[0].ticket, error=f"{type(exc).__name__}: {exc}")]

    def _job(self, group: list[EmbedRequest]) -> _Job:
        width = max(len(r.prompt) for r in group)
        zeros = mx.zeros((len(group), self.size), dtype=mx.float32)
        return _Job(
            group,
            mx.array([r.prompt + [PAD] * (width - len(r.prompt)) for r in group]),
            mx.array([len(r.prompt) for r in group]),
            zeros,
            zeros,
        )

    def _step(self, job: _Job, chunk: int) -> bool:
        """`job`'s next `chunk` positions through the model (a forward that takes the prompts
        whole needs no cache); whether that was the last."""
        assert self._inner is not None
        width = job.ids.shape[1]
        if job.start == 0 and job.cache is None and width > chunk:
            job.cache = self._new_cache() if self._new_cache is not None else None
            chunk = chunk if job.cache is not None else width
        end = min(width, job.start + chunk)
        hidden = self._inner(job.ids[:, job.start : end], cache=job.cache).astype(mx.float32)
        positions = mx.arange(job.start, end)[None, :, None]
        real = positions < job.lengths[:, None, None]
        ends = positions == (job.lengths - 1)[:, None, None]
        job.total = job.total + mx.where(real, hidden, 0.0).sum(axis=1)
        job.last = job.last + mx.where(ends, hidden, 0.0).sum(axis=1)
        mx.eval(job.total, job.last)  # one chunk's graph at a time
        job.start = end
        return end >= width

    def _pooled(self, job: _Job) -> list[EmbedResult]:
        mean = job.total / job.lengths[:, None].astype(mx.float32)
        by_mean = mx.array([r.pooling == "mean" for r in job.group])[:, None]
        pooled = mx.where(by_mean, mean, job.last)
        norm = mx.linalg.norm(pooled, axis=-1, keepdims=True)
        normed = pooled / mx.maximum(norm, 1e-12)
        finite = mx.isfinite(normed).all(axis=-1)
        mx.eval(normed, finite)
        results = []
        for request, row, ok in zip(job.group, normed.tolist(), finite.tolist(), strict=True):
            if ok:
                results.append(EmbedResult(request.ticket, row))
            else:
                results.append(EmbedResult(request.ticket, error="the hidden state is not finite"))
        return results


@dataclass(slots=True)
class _Job:
    """One forward's requests, right-padded, and their pooled sums so far."""

    group: list[EmbedRequest]
    ids: mx.array
    lengths: mx.array
    total: mx.array
    last: mx.array
    cache: list[Any] | None = None
    start: int = 0  # positions [0, start) went through


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
