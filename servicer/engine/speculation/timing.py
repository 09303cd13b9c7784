"""When a speculating batch's steps begin and end, for the two clocks that decide its drafting:
the verify width a step costs (`StepClock`) and what drafting delivers against not drafting
(`ModeClock`)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from .config import ModeClock, StepClock


@dataclass(slots=True)
class StepTimer:
    width_clock: StepClock
    mode_clock: ModeClock
    _started: float | None = None  # when the last step began (for the width clock)
    _last: tuple[int, int] | None = None  # its rows, and its verify width
    _drained: bool = True  # whether nothing was running when the last step began
    _began: tuple[float, int, bool] | None = None  # the last step: start, rows, no prefill
    _gave: int = 0  # tokens the last step gave

    def step_begins(self, rows: int, shares_step_with_prefill: bool) -> None:
        """The mode clock learns what the last step gave, and in how long."""
        now = time.perf_counter()
        if self._began is not None:
            began, last_rows, clean = self._began
            self.mode_clock.record(last_rows, self._gave, now - began, clean)
        self._began = (now, rows, not shares_step_with_prefill)
        self._gave = 0

    def restart(self) -> None:
        """The batch ran empty and rows join again: the last step's span reaches across the
        idle time and the joining prompts' prefill, so neither clock counts it."""
        self._started, self._last, self._drained = None, None, True
        self._began, self._gave = None, 0

    def step_gave(self, tokens: int) -> None:
        self._gave = tokens

    def step_ran(self, rows: int, width: int) -> None:
        """This step verifies `width` tokens a row (1: no drafts)."""
        self._last = (rows, width)

    def forward_begins(self, waited: bool) -> None:
        """The width clock learns what the last step cost: the time from its start to this
        one's, the engine's own work between steps included.

        A step without drafts (mlx-lm's) leaves its forward running; the next step waits for
        it, inside its own time if it is plain too, before its time starts if it drafts
        (`waited`: it read its pending tokens first). So a plain step's time is one forward
        when it began with nothing running and a drafting step followed (its launch and its
        wait), or when it began with one running and a plain step followed (the wait for
        its predecessor's and its launch, steady state); otherwise it held half of one
        forward or one and a half, and is not counted."""
        now = time.perf_counter()
        last = self._last
        if last is not None and self._started is not None:
            rows, width = last
            if width > 1 or waited == self._drained:
                self.width_clock.record(rows, width, now - self._started)
        self._drained = waited or last is None or last[1] > 1
        self._started, self._last = now, None
