"""The one place where the handler side and the engine thread meet: requests, aborts, embeds,
cache flushes, stop."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..messages import (
    FINISH_ABORT,
    EmbedRequest,
    GenerationRequest,
    RowEvent,
    RowFailure,
    StepOutput,
)


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
        # n > 1: sample 0's ticket -> the other samples, held until the engine releases them
        self._held: dict[int, list[GenerationRequest]] = {}

    def put(self, request: GenerationRequest) -> None:
        """A request; one with n > 1 goes in as sample 0, its other samples held back until
        the engine `release`s them (sample 0's prompt is through) or `drop_samples` them."""
        with self._cond:
            if request.sample_tickets:
                first, *others = request.samples()
                self._held[first.ticket] = others
                request = first
            self._requests.append(request)
            self._cond.notify()

    def abort(self, tickets: Iterable[int]) -> None:
        """Aborts. Aborting sample 0 of a request aborts its held samples too; a held sample
        that is aborted goes in line with its abort, so the engine ends it as it ends any
        request aborted before its admission."""
        with self._cond:
            aborted = set(tickets)
            for first in aborted & self._held.keys():
                aborted.update(r.ticket for r in self._held[first])
            for first, others in list(self._held.items()):
                named = [r for r in others if r.ticket in aborted]
                if named:
                    self._requests.extend(named)
                    rest = [r for r in others if r.ticket not in aborted]
                    if rest:
                        self._held[first] = rest
                    else:
                        del self._held[first]
            self._aborts.update(aborted)
            self._cond.notify()

    # ----- the samples of n > 1, from the engine thread -----

    def release(self, first: int) -> None:
        """Sample 0's prompt is through: its other samples join the line at the next take."""
        with self._cond:
            self._requests.extend(self._held.pop(first, ()))
            self._cond.notify()

    def drop_samples(self, first: int | None = None) -> list[GenerationRequest]:
        """The held samples of sample 0 `first` (None: of every request), no longer held."""
        with self._cond:
            if first is None:
                dropped = [r for others in self._held.values() for r in others]
                self._held.clear()
                return dropped
            return self._held.pop(first, [])

    def fan_out(self, out: StepOutput) -> None:
        """From the engine thread, after a step: the other samples of an n > 1 request join the line
        once sample 0's prompt is through (its first token is out in `out`: they reuse its prefix
        from the store), or end with it when it ends without one (aborted or failed)."""
        if not self._held:
            return
        for event in list(out.events):
            if event.ticket in self._held:
                if event.token is not None:
                    self.release(event.ticket)
                elif event.finish_reason is not None:
                    ended = self.drop_samples(event.ticket)
                    out.events.extend(RowEvent(r.ticket, None, FINISH_ABORT) for r in ended)
        for failure in list(out.failures):
            if failure.ticket in self._held:
                out.failures.extend(
                    RowFailure(r.ticket, failure.kind, failure.message)
                    for r in self.drop_samples(failure.ticket)
                )

    def held_samples(self) -> list[int]:
        """The prompt lengths of the samples held (the load figures)."""
        with self._cond:
            return [len(r.prompt) for others in self._held.values() for r in others]

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
