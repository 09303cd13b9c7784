"""The one place where the handler side and the engine thread meet: requests, aborts, embeds,
cache flushes, stop."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..messages import EmbedRequest, GenerationRequest


@dataclass
class InboxTake:
    """Everything that arrived since the last take."""

    requests: list[GenerationRequest]
    aborts: set[int]
    stopping: bool
    embeds: list[EmbedRequest] = field(default_factory=list)
    flushes: list[int] = field(default_factory=list)  # tickets of prefix-store flushes


class Inbox:
    """Filled from any thread, emptied by the engine thread once per step."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._requests: list[GenerationRequest] = []
        self._aborts: set[int] = set()
        self._embeds: list[EmbedRequest] = []
        self._flushes: list[int] = []
        self._stopping = False
        self._nudged = False

    def put(self, request: GenerationRequest) -> None:
        with self._cond:
            self._requests.append(request)
            self._cond.notify()

    def abort(self, tickets: Iterable[int]) -> None:
        with self._cond:
            self._aborts.update(tickets)
            self._cond.notify()

    def embed(self, request: EmbedRequest) -> None:
        with self._cond:
            self._embeds.append(request)
            self._cond.notify()

    def flush(self, ticket: int) -> None:
        with self._cond:
            self._flushes.append(ticket)
            self._cond.notify()

    def nudge(self) -> None:
        """Wake an idle engine with nothing new in the inbox (a disk load finished)."""
        with self._cond:
            self._nudged = True
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()

    def __len__(self) -> int:
        return len(self._requests)

    def take(
        self,
        *,
        idle: bool,
        quiet_s: float,
        max_s: float,
        burst_size: int,
        timeout_s: float | None = None,
    ) -> InboxTake:
        """Everything waiting. When idle, block for work (at most `timeout_s`), then let a
        burst finish arriving: wait while requests keep coming `quiet_s` apart, at most
        `max_s`, or until `burst_size` are here."""
        with self._cond:
            if idle:
                self._wait_for_work(timeout_s)
                self._wait_for_burst(quiet_s, max_s, burst_size)
            taken = InboxTake(
                self._requests, self._aborts, self._stopping, self._embeds, self._flushes
            )
            self._requests, self._aborts, self._nudged = [], set(), False
            self._embeds, self._flushes = [], []
            return taken

    def _wait_for_work(self, timeout_s: float | None) -> None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not (
            self._requests
            or self._aborts
            or self._stopping
            or self._nudged
            or self._embeds
            or self._flushes
        ):
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return
            self._cond.wait(remaining)

    def _wait_for_burst(self, quiet_s: float, max_s: float, burst_size: int) -> None:
        deadline = time.monotonic() + max_s
        seen = len(self._requests)
        while 0 < seen < burst_size and not self._stopping:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self._cond.wait(min(quiet_s, remaining))
            if len(self._requests) == seen:
                return
            seen = len(self._requests)
