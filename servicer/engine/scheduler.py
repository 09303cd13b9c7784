"""Which waiting requests join the batch at each step: the waiting line, the memory they
reserve, and when admitting would hold back a first token. Pure policy over plain data (no
MLX), decided on rank 0 and shared with the other ranks as a `Plan`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..messages import Admission, GenerationRequest


@dataclass(frozen=True, slots=True)
class Admit:
    request: GenerationRequest
    reserved: int  # bytes of cache state set aside for it
    cached_tokens: int = 0  # prompt tokens covered by a reused prefix (filled in on rank 0)


@dataclass(slots=True)
class Plan:
    """The next step's changes to the batch, decided on rank 0 and applied by every rank."""

    aborts: list[int] = field(default_factory=list)  # tickets of admitted rows to remove
    admits: list[Admit] = field(default_factory=list)
    stop: bool = False
    check: int = 0  # what the previous step produced, so the ranks can compare notes


@dataclass(frozen=True, slots=True)
class BatchView:
    """What the scheduler needs to know about the batch as it stands."""

    rows: int  # requests in the batch (prefilling or decoding)
    first_tokens_due: bool  # some row finished its prefill; its first token comes next step


class Scheduler:
    """The waiting line, in arrival order, and the cache memory reserved by admitted requests.

    A request that cannot fit beside the running ones waits until they finish; one that could
    never fit was refused before it got here.
    """

    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self._waiting: deque[GenerationRequest] = deque()
        self._reserved = 0

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def reserved(self) -> int:
        return self._reserved

    def enqueue(self, requests: Iterable[GenerationRequest]) -> None:
        self._waiting.extend(requests)

    def withdraw(self, tickets: set[int]) -> list[int]:
        """Take aborted requests out of the waiting line; returns those found there."""
        found = [r.ticket for r in self._waiting if r.ticket in tickets]
        if found:
            self._waiting = deque(r for r in self._waiting if r.ticket not in tickets)
        return found

    def admit(self, batch: BatchView) -> list[Admit]:
        """The waiting requests that join the batch now, oldest first, with their memory
        reserved. None while a first token is due: mlx-lm returns a step's tokens only after
        that step's prefill work, so a new prompt now would hold that token back."""
        if batch.first_tokens_due:
            return []
        admits: list[Admit] = []
        limit = self._admission.limit_bytes
        while self._waiting:
            need = self._admission.estimate(self._waiting[0])
            if (batch.rows or admits) and self._reserved + need > limit:
                break  # it waits for running requests to finish
            self._reserved += need
            admits.append(Admit(self._waiting.popleft(), need))
        return admits

    def release(self, reserved: int) -> None:
        """An admitted request left the batch."""
        self._reserved -= reserved

    def drain(self) -> list[int]:
        """Empty the waiting line (shutdown); returns the tickets that were in it."""
        tickets = [r.ticket for r in self._waiting]
        self._waiting.clear()
        return tickets

    def forget_reservations(self) -> None:
        """The batch was rebuilt empty: nothing is reserved any more."""
        self._reserved = 0
