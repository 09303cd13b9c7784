"""The per-row pace (adaptive K), the clocks that cost drafting, and the counters the engine
exports; the settings they read (`SpeculationConfig`) are plain data in `engine_config`."""

from __future__ import annotations

import math
import statistics
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ...engine_config import SpeculationConfig
from ...messages import SpeculationFigures


@dataclass(slots=True)
class RowPace:
    """A row's recent acceptance, and the draft length it earns.

    The estimate is per draft token: accepted / (accepted + rejected), each an EWMA. A step
    stops at its first rejection, so accepted/drafted would undercount every draft after
    it and make K oscillate; this is the geometric model's estimate instead."""

    accepted: float = 1.0
    rejected: float = 0.5
    idle: int = 0  # steps since the row last drafted while switched off

    @property
    def rate(self) -> float:
        return self.accepted / max(self.accepted + self.rejected, 1e-9)

    def expected(self, k: int) -> float:
        """Tokens a step with `k` drafts gives this row: its pending token, then each draft
        while the ones before it were accepted."""
        rate = self.rate
        return 1.0 + sum(rate**j for j in range(1, k + 1))

    def k(self, config: SpeculationConfig) -> int:
        rate = self.rate
        if rate < config.off_below:
            self.idle += 1
            return min(config.probe_k, config.k_max) if self.idle % config.probe_every == 0 else 0
        # Expected run of accepted tokens is r / (1 - r): draft about that many.
        run = min(rate, 0.95) / (1.0 - min(rate, 0.95))
        return max(1, min(config.k_max, math.floor(run + 0.5)))

    def update(self, drafted: int, accepted: int, config: SpeculationConfig) -> None:
        if drafted == 0:
            return
        w = config.ewma
        self.accepted += w * (accepted - self.accepted)
        self.rejected += w * (float(accepted < drafted) - self.rejected)
        if self.rate >= config.off_below:
            self.idle = 0


_PROMISE_EWMA = 0.4  # weight of one shadow lookup (every 16 steps) in a batch size's promise
_RECENT_WINDOWS = 3
# A look at the mode that lost costs about its shortfall over one window: the next look waits
# until that is at most this share of the windows in between.
_LOOK_COST = 0.01
# A mode takes the lead only by beating the other by this much: a window of 8 steps on a busy
# machine reads 10-20 % off, and a wrong lead costs far more where drafting loses (a verify
# of a few tokens costs 2x a step on a CPU) than it gains where the two are even.
_LEAD_MARGIN = 1.05


def _middle(windows: deque[float]) -> float:
    """The median of a mode's last windows: one window that a busy machine slowed, or that
    caught a copied span, moves it not at all."""
    return statistics.median(windows)


@dataclass(slots=True)
class _Window:
    """One batch size's measurement in progress: its mode, and what it counted so far."""

    drafting: bool
    probe: bool  # a re-measurement of the mode that measured worse
    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0


@dataclass(slots=True)
class ModeClock:
    """Whether a batch of this size drafts at all, judged by what it delivers: tokens a second over
    windows of decode steps with drafting allowed and without, every cost in (the wait for the
    pending tokens a drafting step needs, the lookups, verifies, rollbacks and replays). The better
    mode (the leader) runs; the other gets one window now and then to re-measure it, less often each
    time it loses again, and takes the lead only by winning such a window: rates drift as contexts
    grow, so a mode measured long ago is not compared with one measured now. Each batch size (in
    powers of two) keeps its own window open while the batch passes through other sizes. Steps that
    shared their time with a prefill are not counted, nor one that followed a step in the other mode
    (it carries its predecessor's forward)."""

    window: int = 8  # counted steps per measurement
    # Windows of the better mode before the other is measured again: one after the first
    # comparison (the first windows are a request's start, with the least to copy yet),
    # then doubling each time it loses again, or more where it lost by much (`_LOOK_COST`),
    # up to `most_gap`; `first_gap` once it wins.
    first_gap: int = 4
    most_gap: int = 64
    # While a batch size does not draft, how often its rows' lookups would have drafted the
    # token they got (`shadow`); drafting is tried only where this reaches `min_promise`.
    min_promise: float = 0.25
    promise: dict[int, float] = field(default_factory=dict)
    # A mode's rate is the median of its last few windows. Not their best: drafting's windows
    # vary with the text (a copied span, then none), plain ones hardly, so the best of a few
    # would favour drafting where it is even on average; nor their mean, which one window
    # slowed by a busy machine drags down.
    recent: dict[tuple[int, bool], deque[float]] = field(default_factory=dict)
    gaps: dict[int, int] = field(default_factory=dict)  # bucket -> windows between probes
    leaders: dict[int, bool] = field(default_factory=dict)  # bucket -> the mode that runs
    since: Counter[int] = field(default_factory=Counter)  # windows since the last probe
    _open: dict[int, _Window] = field(default_factory=dict)
    _last_mode: bool | None = None  # the mode of the last step recorded

    @property
    def rates(self) -> dict[tuple[int, bool], float]:
        """Tokens a second by (batch size, drafting)."""
        return {key: _middle(windows) for key, windows in self.recent.items()}

    def _rate(self, bucket: int, drafting: bool) -> float | None:
        windows = self.recent.get((bucket, drafting))
        return _middle(windows) if windows else None

    def drafting(self, rows: int) -> bool:
        """The mode of a step of `rows` rows: its batch size's open window's."""
        bucket = StepClock.bucket(rows)
        window = self._open.get(bucket)
        if window is None:
            window = self._open[bucket] = _Window(*self._choose(bucket))
        return window.drafting

    def shadow(self, rows: int, predicted: list[bool]) -> None:
        """A step without drafts: which rows' lookups would have drafted what they got."""
        if predicted:
            bucket = StepClock.bucket(rows)
            hits = sum(predicted) / len(predicted)
            old = self.promise.get(bucket, hits)
            self.promise[bucket] = old + _PROMISE_EWMA * (hits - old)

    def record(self, rows: int, tokens: int, seconds: float, clean: bool) -> None:
        """The last step (of `rows` rows): the tokens it gave and the time to the next step's
        start; `clean` when no prefill shared that time."""
        bucket = StepClock.bucket(rows)
        window = self._open.get(bucket)
        if window is None:
            return
        switched = self._last_mode is not None and self._last_mode != window.drafting
        self._last_mode = window.drafting
        if switched or not clean:
            return
        window.steps += 1
        window.tokens += tokens
        window.seconds += seconds
        if window.steps >= self.window and window.seconds > 0:
            self._close(bucket, window)

    def _close(self, bucket: int, window: _Window) -> None:
        key = (bucket, window.drafting)
        measured = window.tokens / window.seconds
        self.recent.setdefault(key, deque(maxlen=_RECENT_WINDOWS)).append(measured)
        other = self._rate(bucket, not window.drafting)
        if window.probe and other is not None:
            # It takes the lead by beating the leader's last few windows (which ran just
            # before it) both with this window and with its own last few: its older windows
            # ran at other contexts (alone, they would compare old speeds with new ones), and
            # one window alone may have caught a copied span (a lucky one).
            rate = min(measured, self._rate(bucket, window.drafting) or 0.0)
            gap = self.gaps.get(bucket, 1)
            if rate >= _LEAD_MARGIN * other:
                self.leaders[bucket] = window.drafting
                self.gaps[bucket] = self.first_gap
            else:
                due = math.ceil((1.0 - rate / other) / _LOOK_COST)
                self.gaps[bucket] = min(self.most_gap, max(gap * 2, due))
        del self._open[bucket]

    def _choose(self, bucket: int) -> tuple[bool, bool]:
        """(drafting, whether that is a probe of the mode that measured worse). Drafting is
        tried (first, or again) only where the lookups promise it (no shadow: always)."""
        promising = self.promise.get(bucket, 1.0) >= self.min_promise
        on, off = self._rate(bucket, True), self._rate(bucket, False)
        if on is None:
            return promising, False
        if off is None:
            return False, False
        leader = self.leaders.setdefault(bucket, on >= _LEAD_MARGIN * off)  # the first look
        # The other mode is measured again after its gap, or at once should the leader have
        # slowed clearly below the other's last window (the contexts it runs at have changed).
        other = self.recent.get((bucket, not leader))
        slowed = other is not None and _LEAD_MARGIN * (on if leader else off) < other[-1]
        if slowed or self.since[bucket] >= self.gaps.get(bucket, 1):
            self.since[bucket] = 0
            if not leader and not promising:
                return False, False  # nothing suggests drafting would do better now
            return not leader, True
        self.since[bucket] += 1
        return leader, False


@dataclass(slots=True)
class StepClock:
    """Seconds a decode step takes by batch size (in powers of two) and verify width (1: no drafts;
    w: up to w - 1 drafts per row), and the width that gives the most tokens a second now. A width's
    cost is the least of its last few steps: a one-off (a first compile at a new shape, a draft
    model catching up on a joining request) does not rule it out for long. Widths not yet measured
    are read off the line between measured ones (a verify forward grows about linearly with its
    width once it is compute-bound, and stays flat while it is memory-bound), and the widest is
    tried again now and then after the clock has chosen a narrower one."""

    window: int = 8
    probe_every: int = 16
    periods: dict[tuple[int, int], deque[float]] = field(default_factory=dict)
    narrowed: Counter[int] = field(default_factory=Counter)  # steps since the widest ran

    @staticmethod
    def bucket(rows: int) -> int:
        return 1 << max(rows - 1, 0).bit_length()

    def record(self, rows: int, width: int, seconds: float) -> None:
        key = (self.bucket(rows), width)
        periods = self.periods.get(key)
        if periods is None:  # (not setdefault: that would build a deque every step)
            periods = self.periods[key] = deque(maxlen=self.window)
        periods.append(seconds)

    def choose(self, rows: int, widest: int, tokens: Callable[[int], float]) -> tuple[int, bool]:
        """The verify width for a step that could verify up to `widest` (`tokens(w)` is what
        a step of width w is expected to give the batch), and whether it is a probe: now
        and then the widest, to re-measure it, where a narrower one is best."""
        key = self.bucket(rows)
        best = self.best(rows, widest, tokens)
        if best < widest and self.narrowed[key] < self.probe_every:
            self.narrowed[key] += 1
            return best, False
        self.narrowed[key] = 0
        return widest, best < widest

    def best(self, rows: int, widest: int, tokens: Callable[[int], float]) -> int:
        """The width that gives the most tokens a second by what is measured; the widest
        while it or a step without drafts is not measured yet (drafting is the default)."""
        key = self.bucket(rows)
        measured = {w: min(p) for (b, w), p in self.periods.items() if b == key and w <= widest}
        if widest <= 1 or widest not in measured:
            return widest
        if 1 not in measured:
            return 1
        return max(range(1, widest + 1), key=lambda w: tokens(w) / _read_off(measured, w))


def _read_off(measured: dict[int, float], width: int) -> float:
    """A width's cost: measured, or on the line between the nearest measured widths below
    and above it (both exist: width 1 and the widest are measured before this is asked)."""
    if width in measured:
        return measured[width]
    below = max(w for w in measured if w < width)
    above = min(w for w in measured if w > width)
    share = (width - below) / (above - below)
    return measured[below] + share * (measured[above] - measured[below])


@dataclass(slots=True)
class SpeculationCounters:
    """Running totals, updated by the generation batch at every step (engine thread)."""

    steps: int = 0
    speculative_steps: int = 0
    cutoff_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    per_row_step: Counter[int] = field(default_factory=Counter)

    def record(self, drafted: int, accepted: int, emitted: list[int]) -> None:
        self.steps += 1
        self.speculative_steps += drafted > 0
        self.drafted += drafted
        self.accepted += accepted
        self.emitted += sum(emitted)
        self.per_row_step.update(emitted)

    def record_plain(self, rows: int) -> None:
        """A step without drafts: one token for each of `rows` rows."""
        self.steps += 1
        self.emitted += rows
        self.per_row_step[1] += rows

    def record_cutoff(self) -> None:
        """A step that drafts nothing by decision: past the cap, or drafting does not pay."""
        self.cutoff_steps += 1

    def snapshot(self) -> SpeculationFigures:
        return SpeculationFigures(
            steps=self.steps,
            speculative_steps=self.speculative_steps,
            cutoff_steps=self.cutoff_steps,
            drafted=self.drafted,
            accepted=self.accepted,
            emitted=self.emitted,
            per_row_step=dict(self.per_row_step),
        )
