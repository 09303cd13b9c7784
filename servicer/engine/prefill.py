"""How much prompt to prefill in one step: a time budget while rows decode, full chunks when
nothing does, a cost model of prefill learned as the engine runs, and a budget that widens
while prompts queue up. Pure (no MLX).

What a step's prefill adds to it costs about `k0 + k1·r·n + k2·r·n·(c + n/2) + k3·f` seconds
for a chunk of `n` tokens for `r` rows (mlx-lm pads the rows to one length) whose caches hold
`c` tokens, and `f` rows that start decoding in it: a fixed part per step, the projections
and MLP per token, attention over the context so far, and for each prompt that finished its
prefill the forward of its first token and its join to the decoding batch. The coefficients
are fitted by least squares over recent steps (older ones fade), so the model follows the
machine as it warms up, throttles or shares its cores.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..engine_config import DEFAULT_PREFILL_STEP

_DECAY = 0.97  # weight of older samples per new one: about the last 30 steps count
# Features are scaled to similar sizes; the ridge term keeps a fit with few or alike samples
# near the prior instead of letting it run off.
_SCALE = np.array([1.0, 1e-3, 1e-6, 1.0])
_RIDGE = 1e-4


@dataclass(frozen=True, slots=True)
class PrefillWork:
    """What one step prefilled: rows in its prefill forward, tokens per row (padded), their
    longest context before it, and rows whose last prompt token ran (they started decoding)."""

    rows: int = 0
    chunk: int = 0
    context: int = 0
    starting: int = 0

    @property
    def any(self) -> bool:
        return self.rows * self.chunk > 0 or self.starting > 0

    def took(self, seconds: float) -> PrefillSample:
        return PrefillSample(self.rows, self.chunk, self.context, seconds, self.starting)


@dataclass(frozen=True, slots=True)
class PrefillSample:
    """One step's prefill, as measured: rows in its prefill call, tokens per row (padded),
    their longest context before, rows that started decoding, and the seconds it added."""

    rows: int
    chunk: int
    context: int
    seconds: float
    starting: int = 0
    any = PrefillWork.any  # the same rule as the work it measures


def _features(rows: int, chunk: int, context: int, starting: int) -> np.ndarray:
    tokens = rows * chunk
    return np.array([1.0, tokens, tokens * (context + chunk / 2), starting], dtype=float)


class PrefillCost:
    """Seconds a step's prefill takes, learned online: exponentially weighted least squares,
    pulled gently toward the prior while samples are few."""

    def __init__(
        self, per_token_s: float = 5e-4, fixed_s: float = 1e-3, per_start_s: float = 1e-3
    ) -> None:
        self._prior = np.array([fixed_s, per_token_s, 0.0, per_start_s]) / _SCALE
        self._xx = np.zeros((4, 4))
        self._xy = np.zeros(4)
        self._theta = self._prior.copy()
        self.samples = 0

    @property
    def coefficients(self) -> tuple[float, float, float, float]:
        """(fixed seconds, per token, per token per context token, per starting row), >= 0."""
        k0, k1, k2, k3 = (float(v) for v in self._theta * _SCALE)
        return max(k0, 0.0), max(k1, 1e-9), max(k2, 0.0), max(k3, 0.0)

    def observe(self, sample: PrefillSample) -> None:
        if not sample.any or not math.isfinite(sample.seconds):
            return
        x = _features(sample.rows, sample.chunk, sample.context, sample.starting) * _SCALE
        self._xx = _DECAY * self._xx + np.outer(x, x)
        self._xy = _DECAY * self._xy + x * sample.seconds
        try:
            solved = np.linalg.solve(self._xx + _RIDGE * np.eye(4), self._xy + _RIDGE * self._prior)
        except np.linalg.LinAlgError:
            solved = None
        if solved is not None and np.all(np.isfinite(solved)):
            self._theta = solved
        self.samples += 1

    def seconds(self, rows: int, chunk: int, context: int, starting: int = 0) -> float:
        features = _features(rows, chunk, context, starting)
        return float(np.dot(self.coefficients, features))

    def tokens_within(self, budget_s: float, context: int, starting: int = 0) -> int:
        """The most prompt tokens one row can prefill within `budget_s` at `context`, beside
        `starting` rows' first tokens."""
        k0, k1, k2, k3 = self.coefficients
        room = budget_s - k0 - k3 * starting
        if room <= 0:
            return 0
        # k2/2·n² + (k1 + k2·c)·n - room = 0
        a, b = k2 / 2, k1 + k2 * context
        if a <= 1e-18:
            return int(room / b)
        return int((-b + math.sqrt(b * b + 4 * a * room)) / (2 * a))


_DECODE_DECAY = 0.8  # weight of older decode steps per new one: about the last five count
# Pulls the slope toward zero while the steps seen are alike (one batch size: the fit is then
# their mean); small beside the weight of even one sample at a few rows.
_DECODE_RIDGE = 1e-3
# One step may count for at most this many times the estimate: a pause of the whole process
# (another process on the cores, a page fault storm) is not the batch's cost. A batch that
# truly got that much slower is followed within a few steps.
_DECODE_SPIKE = 3.0


class DecodeCost:
    """Seconds a step without prefill takes for `rows` decoding rows: `a + b·rows`, fitted by
    exponentially weighted least squares over the recent steps. On a compute-bound model (a CPU) 8
    rows take about twice as long as 1, so the estimate must follow the batch as it grows rather
    than lag it by several steps; the first step sets it (no climb from zero). Plain floats: it runs
    every step, and a 1 ms step has no room for numpy's overhead."""

    def __init__(self) -> None:
        # Decayed sums of w, w·r, w·r², w·s, w·r·s over the steps seen (r rows, s seconds).
        self._sums = [0.0] * 5
        self._fit = (0.0, 0.0)

    def observe(self, rows: int, seconds: float) -> None:
        if rows <= 0 or not math.isfinite(seconds) or seconds < 0:
            return
        expected = self.seconds(rows)
        if expected > 0:
            seconds = min(seconds, _DECODE_SPIKE * expected)
        r = float(rows)
        terms = (1.0, r, r * r, seconds, r * seconds)
        self._sums = [_DECODE_DECAY * old + t for old, t in zip(self._sums, terms, strict=True)]
        n, sr, srr, ss, srs = self._sums
        det = n * (srr + _DECODE_RIDGE) - sr * sr
        if det <= 0:
            return
        a = (ss * (srr + _DECODE_RIDGE) - sr * srs) / det
        b = (n * srs - sr * ss) / det
        if b < 0:  # noise: more rows never make a step cheaper; their mean instead
            a, b = ss / n, 0.0
        self._fit = (a, b)

    def seconds(self, rows: int) -> float:
        """The expected seconds of a step with `rows` decoding rows (0 before any step)."""
        a, b = self._fit
        return max(a + b * rows, 0.0)


MIN_CATCH_UP = 16  # a draft model's catch-up tokens before its rate is known


class StepCost:
    """The one cost model of a step: what its decoding rows, its prefill (prompt chunks and
    embeds: forwards of the model) and a draft model's catch-up take, each learned from the
    steps as they run. The scheduler plans every part of a step with it under one budget."""

    def __init__(self) -> None:
        self.prefill = PrefillCost()
        self.decode = DecodeCost()
        self._catch_up_rate = 0.0  # seconds a draft catch-up token, lately (0: not seen yet)

    def seconds(self, rows: int, chunk: int, context: int, starting: int = 0) -> float:
        """What a prefill of `rows` x `chunk` tokens at `context` adds to a step."""
        return self.prefill.seconds(rows, chunk, context, starting)

    def tokens_within(self, budget_s: float, context: int, starting: int = 0) -> int:
        return self.prefill.tokens_within(budget_s, context, starting)

    def catch_up_within(self, budget_s: float) -> int:
        """Draft catch-up tokens that fit `budget_s`."""
        if self._catch_up_rate == 0:
            return MIN_CATCH_UP
        return max(int(budget_s / self._catch_up_rate), 0)

    def observe_catch_up(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or not math.isfinite(seconds) or seconds < 0:
            return
        rate = seconds / tokens
        old = self._catch_up_rate
        self._catch_up_rate = rate if old == 0 else 0.5 * (old + rate)


@dataclass(frozen=True, slots=True)
class PrefillPolicy:
    """`max_stall_s`: the most one step's prefill may hold up decoding rows (0: no budget,
    every step prefills up to `step_tokens` per row, as mlx-lm does by default);
    `max_widen`: how far the budget may widen while prompts queue up (1: never)."""

    max_stall_s: float = 0.05
    step_tokens: int = DEFAULT_PREFILL_STEP  # a full chunk
    max_rows: int = 8  # prompts prefilled together at most
    # Every prompt in prefill progresses at least this much per step: each step has a fixed
    # cost (SmolLM2-135M at 8,000 tokens of context on a 2-core CPU: ~1.5 decode steps beside
    # ~40 ms a prompt token), so fewer tokens a step cost the prompt more than they spare the
    # streams (8 made its first token 1.7x later, the streams' longest gap the same).
    min_chunk: int = 32
    max_widen: float = 4.0

    @property
    def budgeted(self) -> bool:
        return self.max_stall_s > 0


@dataclass(frozen=True, slots=True)
class PrefillRow:
    """A prompt in prefill: tokens still to process in chunks, tokens already in its cache,
    and whether some of those came from its own earlier steps (not only a reused prefix)."""

    remaining: int
    context: int
    progressed: bool = False


# A step's prefill may always take this many decode steps. On a slow (memory-bound) model every
# prefill call adds about a decode step (the decode forward's weight read) to its chunk, so a
# chunk of one decode step spends half of the prompt's time on those reads. A chunk of three
# leaves the running streams a gap of about four of their steps, and the room up to five takes
# a step that runs 30 % over the cost model (the worst of a long prompt's ~100 steps on a busy
# 2-core VM); four planned the whole five, so such a step made a gap of six or seven. On a fast
# model (decode steps of a few ms) the budget in force is larger anyway.
STALL_DECODE_STEPS = 3.0


# A step that prefills in bulk (`Scheduler._bulk`: a slow model, prompts queueing) may take this
# many decode steps. Bulk saves the weight read a split adds, about a decode step, so past a
# chunk of 16 steps a split costs the prompts under 7 %; without a bound one call took a whole
# 2,048-token chunk of a long prompt (48 s beside 80 ms decode steps on a 2-core CPU), the
# streams and every abort waiting for it. A burst of short prompts (8 x 128 tokens on the real
# Gemma here: 13 decode steps) still goes in one call.
BULK_DECODE_STEPS = 16.0


def bulk_budget(budget_s: float, decode_step_s: float) -> float:
    """The seconds a bulk step's prefill may take."""
    return max(budget_s, BULK_DECODE_STEPS * decode_step_s)


# A step in which no row decodes (prompts only) may take as long as a bulk step, and never less
# than this. Nothing streams then, but a request that arrives or is aborted meanwhile waits for
# the step: a whole 2,048-token chunk of a long prompt held them 20-40 s on a 2-core CPU (seconds
# on a laptop); a fast machine's chunk stays whole.
IDLE_STEP_FLOOR_S = 1.0


def idle_budget(decode_step_s: float) -> float:
    """The seconds a step's prefill may take while no row decodes: a bulk step's."""
    return bulk_budget(IDLE_STEP_FLOOR_S, decode_step_s)


def step_budget(policy: PrefillPolicy, widen: float, decode_step_s: float) -> float:
    """The seconds a step's prefill may add while rows decode: the budget in force (widened
    by `widen`), and never less than `STALL_DECODE_STEPS` decode steps. Planning and the
    over-budget count both use this."""
    return max(policy.max_stall_s * widen, STALL_DECODE_STEPS * decode_step_s)


def step_capacity(
    policy: PrefillPolicy,
    cost: PrefillCost,
    bounded: bool,
    context: int,
    budget_s: float,
    starting: int = 0,
) -> int:
    """Prompt tokens (summed over rows, padding included) the next step may prefill: what
    fits `budget_s` beside the first tokens of `starting` rows in a `bounded` step (rows
    decode, or the idle bound), otherwise a full chunk."""
    if not bounded or not policy.budgeted:
        return policy.step_tokens
    tokens = cost.tokens_within(budget_s, context, starting)
    return max(policy.min_chunk, min(policy.step_tokens, tokens))


# A step may take this many decode steps' time past its budget to finish every prompt in its
# prefill call rather than split them: on a memory-bound model each further call reads all the
# weights again (about a decode step, for 1 row as for 8) and each prompt's first token waits
# a step longer. On a fast model (a decode step of a few ms) this barely moves the budget.
# Only prompts that have not begun take it: one more step is half a short prompt's wait but a
# few percent of a long one's, and a long prompt's last step would be the streams' longest gap.
# With the floor's three, a short prompt beside slow streams may take six decode steps.
FINISH_DECODE_STEPS = 3.0


def finish_budget(budget_s: float, decode_step_s: float) -> float:
    """The seconds a step's prefill may take when it finishes every prompt in it at once."""
    return budget_s + FINISH_DECODE_STEPS * decode_step_s


def finishes_within(rows: list[int], capacity: int) -> bool:
    """Whether prompts needing `rows` tokens each finish in one call of `capacity` tokens
    (summed over rows, padding included)."""
    return not rows or len(rows) * max(rows) <= capacity


def can_join(rows: list[int], remaining: int, capacity: int, min_chunk: int) -> bool:
    """Whether a prompt needing `remaining` tokens may start its prefill beside `rows` (the
    remaining tokens of those already in prefill) this step: it finishes within its share of
    the step, and any row that does not keeps at least half of the step. Prompts that all
    fit join together, so they also share the next step's first-token forward."""
    share = max(min_chunk, capacity // (len(rows) + 1))
    if remaining > share:
        return False
    return all(left <= share for left in rows) or len(rows) + 1 <= 2


def chunk_for(rows: list[int], capacity: int, min_chunk: int) -> int:
    """Tokens per row for this step (mlx-lm's `prefill_step_size`): the capacity shared."""
    if not rows:
        return capacity
    return max(min_chunk, min(capacity // len(rows), max(rows)))


WIDEN_STEP = 2.0  # how much the budget widens per step while prompts queue
NARROW_STEP = 1.25  # and narrows per step once the line is empty
QUEUE_BUDGETS = 4  # a prompt waiting this many budgets is a sign of queuing


@dataclass(slots=True)
class Widening:
    """How far the budget is widened now. While prompts queue faster than the budget lets
    them in (the line grows past one, or its oldest prompt has waited several budgets), it
    widens a step at a time up to the policy's `max_widen`; once the line is empty it
    narrows a step at a time back to the base."""

    factor: float = 1.0
    _last_waiting: int = 0

    def update(self, policy: PrefillPolicy, waiting: int, oldest_wait_s: float) -> float:
        growing = waiting > max(1, self._last_waiting)
        stuck = waiting > 0 and oldest_wait_s > QUEUE_BUDGETS * policy.max_stall_s * self.factor
        if growing or stuck:
            self.factor = min(policy.max_widen, self.factor * WIDEN_STEP)
        elif waiting == 0:
            self.factor = max(1.0, self.factor / NARROW_STEP)
        self._last_waiting = waiting
        return self.factor
