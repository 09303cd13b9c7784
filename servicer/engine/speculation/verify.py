"""The target's choice at every verified position, and which drafts it accepts.

A draft source here is deterministic (prompt lookup, or a draft model drafting its argmax),
so speculative sampling needs no separate rule: the target draws each position exactly as
it would without speculation (greedy: argmax; sampled: its sampler's filters, temperature
and the row's next key), and a draft is accepted while it equals that draw. The accepted
draft d then has probability p(d), and after a rejection the draw is distributed as p with
d removed and renormalised: the speculative-sampling rule for a one-hot draft distribution.
Because the draws use the row's keys in order (`keys_ahead`, then `consume` of only what was
kept), a seeded row emits the very tokens it emits without speculation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import greedy_sampler


def can_speculate(sampler: Any) -> bool:
    """Greedy, or a sampler that exposes its distribution and keys (sampling.py's)."""
    return sampler is greedy_sampler or all(
        hasattr(sampler, name) for name in ("log_probs", "keys_ahead", "consume")
    )


def choose(logprobs: mx.array, samplers: Sequence[Any], widths: Sequence[int]) -> list[mx.array]:
    """Row i's draw at each of its first `widths[i]` positions of `logprobs` (B, S, V).

    Rows sharing a sampler object draw together, one key per position, as mlx-lm draws a
    batch that shares one (a seeded sampler belongs to one request, so it draws alone)."""
    chosen: list[mx.array | None] = [None] * len(samplers)
    groups: dict[int, list[int]] = {}
    for i, sampler in enumerate(samplers):
        groups.setdefault(id(sampler), []).append(i)
    for rows in groups.values():
        sampler, width = samplers[rows[0]], max(widths[i] for i in rows)
        picked = logprobs[mx.array(rows), :width] if len(rows) < len(samplers) else logprobs
        draws = _draw(sampler, picked[:, :width])
        for n, i in enumerate(rows):
            chosen[i] = draws[n, : widths[i]]
    return [c for c in chosen if c is not None]


def _draw(sampler: Any, logprobs: mx.array) -> mx.array:
    """Draws (rows, width) from `logprobs` (rows, width, V) with one sampler."""
    if sampler is greedy_sampler:
        return mx.argmax(logprobs, axis=-1)
    width = logprobs.shape[1]
    if can_speculate(sampler):
        scaled = sampler.log_probs(logprobs)
        keys = sampler.keys_ahead(width)
        draws = [mx.random.categorical(scaled[:, j], key=keys[j]) for j in range(width)]
        return mx.stack(draws, axis=1)
    if width != 1:
        raise ValueError("a sampler that cannot speculate verifies no drafts")
    return sampler(logprobs[:, 0])[:, None]
