"""The step watchdog: no engine step may run without end (issue 38, "no silent hang").

The engine loop marks when a step's work begins (once a plan has its requests: waiting idle
for work never counts) and when its hand-off is done. A watchdog thread checks that no step
runs past a bound derived from the steps measured so far: the longest one times `factor`,
and never less than `floor_s` (`--step-timeout`). A step past it is a stall: the engine
reports it through the fatal path (every stream ends with UNAVAILABLE, health goes
NOT_SERVING, the worker exits non-zero).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)
STALL_FACTOR = 8.0  # a step this many times the longest seen so far has stalled


class StepWatch:
    """When the current step began, and the longest step so far (written by the engine
    thread, read by the watchdog: single float assignments, no lock needed)."""

    def __init__(self, floor_s: float, factor: float = STALL_FACTOR) -> None:
        self.floor_s = floor_s
        self.factor = factor
        self.longest_s = 0.0
        self._began: float | None = None

    def begin(self) -> None:
        """A step's work begins (a second call within the same step changes nothing)."""
        if self._began is None:
            self._began = time.monotonic()

    def end(self) -> None:
        began, self._began = self._began, None
        if began is not None:
            self.longest_s = max(self.longest_s, time.monotonic() - began)

    @property
    def bound_s(self) -> float:
        return max(self.floor_s, self.factor * self.longest_s)

    def overdue(self) -> str | None:
        """Why the current step has stalled, or None while it is within the bound."""
        began = self._began
        if began is None:
            return None
        elapsed, bound = time.monotonic() - began, self.bound_s
        if elapsed <= bound:
            return None
        return (
            f"an engine step made no progress for {elapsed:.1f} s (the bound is {bound:.1f} s: "
            f"--step-timeout {self.floor_s:g} s, or {self.factor:g}x the longest step so far, "
            f"{self.longest_s:.2f} s)"
        )

    def watch(self, alive: Callable[[], bool], on_stall: Callable[[str], None]) -> None:
        """Start the watchdog thread: `on_stall(reason)` once a step overruns the bound; it
        ends with the engine thread (`alive`)."""
        if self.floor_s <= 0:
            return
        thread = threading.Thread(
            target=self._run, args=(alive, on_stall), name="mlx-step-watchdog", daemon=True
        )
        thread.start()

    def _run(self, alive: Callable[[], bool], on_stall: Callable[[str], None]) -> None:
        period = min(1.0, self.floor_s / 10)
        while alive():
            time.sleep(period)
            reason = self.overdue()
            if reason is not None:
                log.critical("%s; the engine is stuck", reason)
                on_stall(reason)
                return
