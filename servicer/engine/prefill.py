"""How much prompt to prefill in one step: a time budget while rows decode, full chunks when
nothing does, and a cost model of prefill learned as the engine runs. Pure (no MLX).

A prefill chunk of `n` tokens for `r` rows (mlx-lm pads the rows to one length) whose caches
already hold `c` tokens costs about `k0 + k1·r·n + k2·r·n·(c + n/2)` seconds: a fixed part,
the projections and MLP per token, and attention over the context so far. The three
coefficients are fitted by least squares over recent steps (older ones fade), so the model
follows the machine as it warms up, throttles or shares its cores.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..engine_config import DEFAULT_PREFILL_STEP

_DECAY = 0.97  # weight of older samples per new one: about the last 30 steps count
# Features are scaled to similar sizes; the ridge term keeps a fit with few or alike samples
# near the prior instead of letting it run off.
_SCALE = np.array([1.0, 1e-3, 1e-6])
_RIDGE = 1e-4


@dataclass(frozen=True, slots=True)
class PrefillSample:
    """One step's prefill, as measured: rows, tokens per row (padded), their context before."""

    rows: int
    chunk: int
    context: int
    seconds: float


def _features(rows: int, chunk: int, context: int) -> tuple[float, float, float]:
    tokens = rows * chunk
    return 1.0, float(tokens), tokens * (context + chunk / 2)


class PrefillCost:
    """Seconds a prefill chunk takes, learned online: exponentially weighted least squares,
    pulled gently toward the prior while samples are few."""

    def __init__(self, per_token_s: float = 5e-4, fixed_s: float = 1e-3) -> None:
        self._prior = np.array([fixed_s / _SCALE[0], per_token_s / _SCALE[1], 0.0])
        self._xx = np.zeros((3, 3))
        self._xy = np.zeros(3)
        self._theta = self._prior.copy()
        self.samples = 0

    @property
    def coefficients(self) -> tuple[float, float, float]:
        """(fixed seconds, seconds per token, seconds per token per context token), each >= 0."""
        k0, k1, k2 = (float(t) * s for t, s in zip(self._theta, _SCALE, strict=True))
        return max(k0, 0.0), max(k1, 1e-9), max(k2, 0.0)

    def observe(self, sample: PrefillSample) -> None:
        if sample.rows <= 0 or sample.chunk <= 0 or not math.isfinite(sample.seconds):
            return
        x = np.array(_features(sample.rows, sample.chunk, sample.context)) * _SCALE
        self._xx = _DECAY * self._xx + np.outer(x, x)
        self._xy = _DECAY * self._xy + x * sample.seconds
        a = self._xx + _RIDGE * np.eye(3)
        b = self._xy + _RIDGE * self._prior
        try:
            solved = np.linalg.solve(a, b)
        except np.linalg.LinAlgError:
            solved = None
        if solved is not None and np.all(np.isfinite(solved)):
            self._theta = solved
        self.samples += 1

    def seconds(self, rows: int, chunk: int, context: int) -> float:
        k0, k1, k2 = self.coefficients
        _, tokens, attention = _features(rows, chunk, context)
        return k0 + k1 * tokens + k2 * attention

    def tokens_within(self, budget_s: float, context: int) -> int:
        """The most prompt tokens one row can prefill within `budget_s` at `context`."""
        k0, k1, k2 = self.coefficients
        room = budget_s - k0
        if room <= 0:
            return 0
        # k2/2·n² + (k1 + k2·c)·n - room = 0
        a, b = k2 / 2, k1 + k2 * context
        if a <= 1e-18:
            return int(room / b)
        return int((-b + math.sqrt(b * b + 4 * a * room)) / (2 * a))


@dataclass(frozen=True, slots=True)
class PrefillPolicy:
    """`max_stall_s`: the most one step's prefill may hold up decoding rows (0: no budget,
    every step prefills up to `step_tokens` per row, as mlx-lm does by default)."""

    max_stall_s: float = 0.05
    step_tokens: int = DEFAULT_PREFILL_STEP  # a full chunk
    max_rows: int = 8  # prompts prefilled together at most
    min_chunk: int = 32  # every prompt in prefill progresses at least this much per step

    @property
    def budgeted(self) -> bool:
        return self.max_stall_s > 0


@dataclass(frozen=True, slots=True)
class PrefillRow:
    """A prompt in prefill: tokens still to process in chunks, tokens already in its cache."""

    remaining: int
    context: int


def step_capacity(
    policy: PrefillPolicy,
    cost: PrefillCost,
    decoding: bool,
    context: int,
    decode_step_s: float = 0.0,
) -> int:
    """Prompt tokens (summed over rows, padding included) the next step may prefill. With
    rows decoding, what fits the stall budget, never less than the decode step itself takes
    (so prefill keeps at least half of each step on a slow model); otherwise a full chunk."""
    if not decoding or not policy.budgeted:
        return policy.step_tokens
    budget = max(policy.max_stall_s, decode_step_s)
    tokens = cost.tokens_within(budget, context)
    return max(policy.min_chunk, min(policy.step_tokens, tokens))


def can_join(rows: list[int], remaining: int, capacity: int, min_chunk: int) -> bool:
    """Whether a prompt needing `remaining` tokens may start its prefill beside `rows` (the
    remaining tokens of those already in prefill) this step: it finishes within its share of
    the step, and any row that does not keeps at least half of the step."""
    share = max(min_chunk, capacity // (len(rows) + 1))
    if remaining > share:
        return False
    return all(left <= share for left in rows) or len(rows) + 1 <= 2


def chunk_for(rows: list[int], capacity: int, min_chunk: int) -> int:
    """Tokens per row for this step (mlx-lm's `prefill_step_size`): the capacity shared."""
    if not rows:
        return capacity
    return max(min_chunk, min(capacity // len(rows), max(rows)))
