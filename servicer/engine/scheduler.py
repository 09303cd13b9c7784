"""Which waiting requests join the batch at each step, and how much prompt the step prefills:
the waiting line, the memory requests reserve, and the prefill budget. Pure policy over plain
data (no MLX), decided on rank 0 and shared with the other ranks as a `Plan`.

Order: the oldest waiting prompt starts its prefill as soon as no other prompt is in prefill;
a prompt that can finish within its share of the step (a short one, or a prefix hit) may
start beside others, as long as a long one keeps at least half of the step. While rows
decode, a step prefills only what its learned cost says fits `max_stall_s`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import msgspec

from ..admission import Admission
from ..engine_config import DEFAULT_PREFILL_STEP
from ..messages import GenerationRequest, Wire
from .prefill import (
    PrefillCost,
    PrefillPolicy,
    PrefillRow,
    PrefillSample,
    can_join,
    chunk_for,
    step_capacity,
)


class Admit(Wire, frozen=True):
    request: GenerationRequest
    reserved: int  # bytes of cache state set aside for it
    cached_tokens: int = 0  # prompt tokens covered by a reused prefix (filled in on rank 0)


class Plan(Wire):
    """The next step's changes to the batch, decided on rank 0 and applied by every rank."""

    aborts: list[int] = msgspec.field(default_factory=list)  # admitted rows to remove
    admits: list[Admit] = msgspec.field(default_factory=list)
    chunk: int = DEFAULT_PREFILL_STEP  # prompt tokens per row this step prefills
    stop: bool = False
    check: int = 0  # what the previous step produced, so the ranks can compare notes


@dataclass(frozen=True, slots=True)
class BatchView:
    """What the scheduler needs to know about the batch as it stands."""

    rows: int  # requests in the batch (prefilling or decoding)
    first_tokens_due: bool  # some row finished its prefill; its first token comes next step
    prefilling: tuple[PrefillRow, ...] = ()  # rows with prompt chunks still to process
    decode_step_s: float = 0.0  # how long a step without prefill takes lately

    @property
    def decoding(self) -> bool:
        """Some row gets tokens from the coming step, which its prefill would hold up."""
        return self.rows > len(self.prefilling)


@dataclass(frozen=True, slots=True)
class StepChoice:
    admits: list[Admit]
    chunk: int
    # Requests whose own planning failed (a cache or disk fault while looking at them): they
    # fail alone, with the reason.
    failed: list[tuple[GenerationRequest, str]] = field(default_factory=list)


class Scheduler:
    """The waiting line, in arrival order, and the cache memory reserved by admitted requests.

    A request that cannot fit beside the running ones waits until they finish; one that could
    never fit was refused before it got here.
    """

    def __init__(
        self,
        admission: Admission,
        policy: PrefillPolicy | None = None,
        reusable: Callable[[GenerationRequest], int] = lambda request: 0,
        ready: Callable[[GenerationRequest], bool] = lambda request: True,
        max_rows: int = 32,
    ) -> None:
        """`reusable(request)`: how many prompt tokens a cached prefix would cover (a cheap
        estimate); `ready(request)`: False while its prefix is still being read from disk
        (it waits; the others go ahead); `max_rows`: the most requests in the batch at once."""
        self._admission = admission
        self._policy = policy or PrefillPolicy(max_stall_s=0)
        self._reusable = reusable
        self._ready = ready
        self._max_rows = max_rows
        self._waiting: deque[GenerationRequest] = deque()
        self._reserved = 0
        self.cost = PrefillCost()

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

    def schedule(self, batch: BatchView) -> StepChoice:
        """The waiting requests that join the batch now, oldest first, with their memory
        reserved, and the step's prefill chunk. Without a budget, every request that fits
        memory joins, but none while a first token is due (mlx-lm returns a step's tokens
        only after that step's prefill, so a new prompt now would hold that token back)."""
        policy = self._policy
        if not policy.budgeted and batch.first_tokens_due:
            return StepChoice([], policy.step_tokens)
        context = max((row.context for row in batch.prefilling), default=0)
        capacity = step_capacity(policy, self.cost, batch.decoding, context, batch.decode_step_s)
        rows = [row.remaining for row in batch.prefilling]
        admits: list[Admit] = []
        failed: list[tuple[GenerationRequest, str]] = []
        for request in list(self._waiting):
            full = len(rows) >= policy.max_rows or batch.rows + len(admits) >= self._max_rows
            if policy.budgeted and full:
                break
            try:
                need = self._admission.estimate(request)
                if (batch.rows or admits) and self._reserved + need > self._admission.limit_bytes:
                    break  # it waits for running requests to finish; so do the ones behind it
                if not self._ready(request):
                    continue
                remaining = max(1, len(request.prompt) - self._reusable(request)) - 1
            except Exception as exc:  # planning this one request failed: it fails alone
                self._waiting.remove(request)
                failed.append(
                    (request, f"planning the request failed: {type(exc).__name__}: {exc}")
                )
                continue
            if (
                policy.budgeted
                and rows
                and not can_join(rows, remaining, capacity, policy.min_chunk)
            ):
                continue  # too long to start beside the prompts in prefill now
            self._waiting.remove(request)
            self._reserved += need
            admits.append(Admit(request, need))
            rows.append(remaining)
        if not policy.budgeted:
            return StepChoice(admits, policy.step_tokens, failed)
        chunk = chunk_for([r for r in rows if r > 0], capacity, policy.min_chunk)
        return StepChoice(admits, chunk, failed)

    def over_budget(self, sample: PrefillSample) -> bool:
        """Whether a step's prefill took longer than the budget allows (while rows decode)."""
        policy = self._policy
        return policy.budgeted and sample.seconds > policy.max_stall_s

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
