"""A log that says each kind of trouble at most once per interval, so a fault that repeats on
every request cannot flood the worker's log; what it held back is counted in the next line."""

from __future__ import annotations

import logging
import time
from typing import Any


class RateLimitedLog:
    """Not thread-safe: each owner (one thread) has its own."""

    def __init__(self, logger: logging.Logger, interval_s: float) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def warning(self, kind: str, message: str, *args: Any, exc_info: Any = None) -> None:
        self.log(logging.WARNING, kind, message, *args, exc_info=exc_info)

    def error(self, kind: str, message: str, *args: Any, exc_info: Any = None) -> None:
        self.log(logging.ERROR, kind, message, *args, exc_info=exc_info)

    def log(self, level: int, kind: str, message: str, *args: Any, exc_info: Any = None) -> None:
        now = time.monotonic()
        if now - self._last.get(kind, float("-inf")) < self._interval_s:
            self._held[kind] = self._held.get(kind, 0) + 1
            return
        self._last[kind] = now
        held = self._held.pop(kind, 0)
        if held:
            message, args = f"{message} (%d more since the last report)", (*args, held)
        self._logger.log(level, message, *args, exc_info=exc_info)
