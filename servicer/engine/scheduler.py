"""Which waiting requests join the batch at each step, and how much prompt the step prefills:
the waiting line, the memory requests reserve, and the prefill budget. Pure policy over plain
data (no MLX), decided on rank 0 and shared with the other ranks as a `Plan`.

Order: the oldest waiting prompt starts its prefill as soon as no other prompt is in prefill;
every prompt that can finish within its share of the step (a short one, or a prefix hit)
starts beside it, in the same prefill call, as long as a long one keeps at least half of the
step. While rows decode, a step prefills only what its learned cost says fits the budget in
force: `max_stall_s`, widened while prompts queue up (see `prefill.Widening`); in bulk, or with
no row decoding, up to `prefill.BULK_DECODE_STEPS` decode steps (at least a second when idle).
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
    PrefillPolicy,
    PrefillRow,
    PrefillSample,
    StepCost,
    Widening,
    bulk_budget,
    can_join,
    chunk_for,
    finish_budget,
    finishes_within,
    idle_budget,
    step_budget,
    step_capacity,
)

_MEMORY_FULL = object()
BULK_MIN_WAITING = 2  # a lone arrival never stalls the decoding rows past the budget


class Admit(Wire, frozen=True):
    request: GenerationRequest
    reserved: int  # bytes of cache state set aside for it
    cached_tokens: int = 0  # prompt tokens covered by a reused prefix (filled in on rank 0)


class Plan(Wire):
    """Everything the next step does, decided on rank 0 and run by every rank: the batch's
    changes, and the work of the step under its one budget (the prefill's chunk, an embed's
    chunk, the vision encoder's work for waiting images, a draft model's catch-up)."""

    aborts: list[int] = msgspec.field(default_factory=list)  # admitted rows to remove
    admits: list[Admit] = msgspec.field(default_factory=list)
    chunk: int = DEFAULT_PREFILL_STEP  # prompt tokens per row this step prefills
    embed_tokens: int | None = None  # an embed's chunk beside decoding rows (None: whole)
    catch_up_tokens: int | None = None  # a draft model's catch-up (None: no bound)
    encode_s: float | None = None  # the vision encoder's, for waiting images (None: no bound)
    stop: bool = False
    check: int = 0  # what the previous step produced, so the ranks can compare notes
    # Rank 0's own: the prefill budget this step was planned with, whether it was widened
    # (prompts queue) and whether it prefills in bulk (`Scheduler._bulk`).
    budget_s: float = 0.0
    widened: bool = False
    bulk: bool = False


@dataclass(frozen=True, slots=True)
class BatchView:
    """What the scheduler needs to know about the batch as it stands."""

    rows: int  # requests in the batch (prefilling or decoding)
    first_tokens_due: bool  # some row finished its prefill; its first token comes next step
    prefilling: tuple[PrefillRow, ...] = ()  # rows with prompt chunks still to process
    decode_step_s: float = 0.0  # how long a step without prefill takes lately
    starting: int = 0  # rows whose prompt is through: the next step runs their first token
    reserved: int = 0  # bytes of cache state the rows set aside when they were admitted

    @property
    def decoding(self) -> bool:
        """Some row gets tokens from the coming step, which its prefill would hold up."""
        return self.rows > len(self.prefilling)


@dataclass(frozen=True, slots=True)
class StepChoice:
    admits: list[Admit]
    chunk: int
    widened: bool = False  # planned with a budget wider than the base
    # Requests whose own planning failed (a cache or disk fault while looking at them): they
    # fail alone, with the reason.
    failed: list[tuple[GenerationRequest, str]] = field(default_factory=list)
    budget_s: float = 0.0  # the prefill budget the step is planned with
    bulk: bool = False  # it prefills in bulk (`Scheduler._bulk`)
    prefill_s: float = 0.0  # what its prefill is expected to take of the budget


class Scheduler:
    """The waiting line, in arrival order, and which requests join the batch: those whose cache
    memory fits beside what the batch's rows reserved (the batch says how much). A request that
    cannot fit beside the running ones waits until they finish; one that could never fit was
    refused before it got here."""

    def __init__(
        self,
        admission: Admission,
        policy: PrefillPolicy | None = None,
        reusable: Callable[[GenerationRequest], int] = lambda request: 0,
        ready: Callable[[GenerationRequest], bool] = lambda request: True,
        max_rows: int = 32,
        cost: StepCost | None = None,
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
        self._arrived: dict[int, float] = {}  # ticket -> when it joined the line
        self.cost = cost or StepCost()
        self.widening = Widening()
        self._returning = self._policy.max_rows  # a first wave: a prefill batch

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def waiting_tokens(self) -> int:
        """Prompt tokens of the requests in line (the load figures)."""
        return sum(len(request.prompt) for request in self._waiting)

    @property
    def burst(self) -> int:
        """The requests an idle engine waits for before admitting the first: as many as ended
        with the step that emptied the batch (their clients come back together), a prefill
        batch before anything ran, never more than one prefill takes."""
        return min(self._returning, self._policy.max_rows)

    def emptied(self, ended: int) -> None:
        """The last step emptied the batch; `ended` requests ended with it."""
        self._returning = ended

    def enqueue(self, requests: Iterable[GenerationRequest], now: float = 0.0) -> None:
        for request in requests:
            self._waiting.append(request)
            self._arrived[request.ticket] = now

    def withdraw(self, tickets: set[int]) -> list[int]:
        """Take aborted requests out of the waiting line; returns those found there."""
        found = [r.ticket for r in self._waiting if r.ticket in tickets]
        if found:
            self._waiting = deque(r for r in self._waiting if r.ticket not in tickets)
            for ticket in found:
                del self._arrived[ticket]
        return found

    def _leave_line(self, request: GenerationRequest) -> None:
        self._waiting.remove(request)
        del self._arrived[request.ticket]

    def schedule(self, batch: BatchView, now: float = 0.0) -> StepChoice:
        """Who joins now (oldest first, memory reserved) and the step's prefill chunk."""
        policy = self._policy
        if not policy.budgeted and batch.first_tokens_due:  # a prompt would hold that token back
            return StepChoice([], policy.step_tokens)
        widen = self._widen(batch, now)
        budget_s = step_budget(policy, widen, batch.decode_step_s)
        if not self._waiting and not batch.prefilling and not batch.starting:
            return self._decode_only(batch, widen, budget_s)
        context = max((row.context for row in batch.prefilling), default=0)
        budget_s, bulk, bounded = self._bound(batch, budget_s)
        capacity = step_capacity(policy, self.cost, bounded, context, budget_s, batch.starting)
        finish_s, finish = self._finishing(batch, bounded, context, budget_s, capacity)
        min_chunk, rows = policy.min_chunk, [row.remaining for row in batch.prefilling]
        admits: list[Admit] = []
        failed: list[tuple[GenerationRequest, str]] = []
        reserved = batch.reserved
        # Widened: new prompts wait out a step whose first tokens are due (then twice as many).
        hold = widen > 1.0 and (batch.first_tokens_due or batch.starting > 0)
        for request in [] if hold else list(self._waiting):
            # The one gate, budget or not: the runner admits whatever the plan says.
            if len(rows) >= policy.max_rows or batch.rows + len(admits) >= self._max_rows:
                break
            try:
                looked = self._look(request, reserved, occupied=bool(batch.rows or admits))
            except Exception as exc:  # planning this one request failed: it fails alone
                self._leave_line(request)
                why = f"planning the request failed: {type(exc).__name__}: {exc}"
                failed.append((request, why))
                continue
            if looked is _MEMORY_FULL:
                break  # it waits for running requests to finish; so do the ones behind it
            if looked is None:
                continue  # its prefix is still being read from disk
            need, remaining = looked
            joins = finishes_within([*rows, remaining], finish) or can_join(
                rows, remaining, capacity, min_chunk
            )
            if policy.budgeted and rows and not joins:
                continue  # too long to start beside the prompts in prefill now
            self._leave_line(request)
            reserved += need
            admits.append(Admit(request, need))
            rows.append(remaining)
        if not policy.budgeted:
            return StepChoice(admits, policy.step_tokens, False, failed, budget_s)
        left = [r for r in rows if r > 0]
        if left and finishes_within(left, finish):  # past the base budget, on purpose
            chunk, budget_s = max(left), finish_s if bounded else budget_s
        else:
            chunk = chunk_for(left, capacity, min_chunk)
        spent = self._prefill_s(len(left), chunk, context, batch.starting)
        widened = widen > 1.0 and batch.decoding and not bulk
        return StepChoice(admits, chunk, widened, failed, budget_s, bulk, spent)

    def _prefill_s(self, rows: int, chunk: int, context: int, starting: int) -> float:
        """What the step's prefill is expected to take (none without any)."""
        return self.cost.seconds(rows, chunk, context, starting) if rows or starting else 0.0

    def _bound(self, batch: BatchView, budget_s: float) -> tuple[float, bool, bool]:
        """The step's prefill budget, whether it prefills in bulk, and whether its prefill is
        bounded in time at all: while rows decode (the budget, or in bulk up to
        `BULK_DECODE_STEPS` decode steps), and with none decoding once a decode step was timed
        (`idle_budget`); before that there is nothing to size by, and chunks are full."""
        if batch.decoding:
            if self._bulk(batch):
                return bulk_budget(budget_s, batch.decode_step_s), True, True
            return budget_s, False, True
        if self._policy.budgeted and batch.decode_step_s > 0:
            return idle_budget(batch.decode_step_s), False, True
        return budget_s, False, False

    def _decode_only(self, batch: BatchView, widen: float, budget_s: float) -> StepChoice:
        """A step with nothing to admit or prefill (most decode steps): no chunk to size."""
        widened = self._policy.budgeted and widen > 1.0 and batch.decoding
        return StepChoice([], self._policy.step_tokens, widened, [], budget_s)

    def _finishing(
        self, batch: BatchView, bounded: bool, context: int, budget_s: float, capacity: int
    ) -> tuple[float, int]:
        """(seconds, tokens) a step may take to finish every prompt in one call: more than
        the budget (prefill.FINISH_DECODE_STEPS), unless one is a long prompt under way."""
        if any(row.progressed for row in batch.prefilling):
            return budget_s, capacity
        finish_s = finish_budget(budget_s, batch.decode_step_s)
        return finish_s, step_capacity(
            self._policy, self.cost, bounded, context, finish_s, batch.starting
        )

    def _bulk(self, batch: BatchView) -> bool:
        """Whether this step prefills in bulk, up to `BULK_DECODE_STEPS` decode steps rather
        than the budget: on a model whose decode step outlasts the budget (memory-bound: a
        step takes about as long for 1 row as for 32, so the budget bounds no stall there
        anyway) while at least as many prompts wait as rows decode. Every split then costs
        another read of the weights, and every step a prompt waits costs it a token the step
        would have made for nothing; the stall the decoding rows take is the same prefill
        work either way, only in fewer, longer gaps."""
        policy = self._policy
        decoding_rows = batch.rows - len(batch.prefilling)
        slow = batch.decode_step_s >= policy.max_stall_s
        return policy.budgeted and slow and self.waiting >= max(BULK_MIN_WAITING, decoding_rows)

    def _look(
        self, request: GenerationRequest, reserved: int, occupied: bool
    ) -> tuple[int, int] | object | None:
        """(bytes it reserves, prompt tokens it must prefill) for a request that may join;
        None while its prefix is loading; `_MEMORY_FULL` when it does not fit beside the
        `reserved` bytes of the running requests (`occupied`)."""
        need = self._admission.estimate(request.cache_tokens)
        if occupied and reserved + need > self._admission.limit_bytes:
            return _MEMORY_FULL
        if not self._ready(request):
            return None
        return need, max(1, len(request.prompt) - self._reusable(request)) - 1

    def _widen(self, batch: BatchView, now: float) -> float:
        """The budget's widening this step: none without a budget, and a line that waits
        for memory counts as none (a wider budget cannot let it in sooner)."""
        if not self._policy.budgeted:
            return 1.0
        waiting = 0 if self._held_by_memory(batch) else len(self._waiting)
        oldest = min(self._arrived.values(), default=now) if waiting else now
        return self.widening.update(self._policy, waiting, now - oldest)

    def _held_by_memory(self, batch: BatchView) -> bool:
        """The oldest waiting request does not fit beside the running ones."""
        if not self._waiting or not batch.rows:
            return False
        need = self._admission.estimate(self._waiting[0].cache_tokens)
        return batch.reserved + need > self._admission.limit_bytes

    def share(
        self, choice: StepChoice, decoding: bool, embeds: bool, images: bool
    ) -> tuple[int | None, float | None, int | None]:
        """What the step's budget leaves, after its prefill, to an embed's chunk (tokens, first),
        the vision encoder for waiting images (seconds, next) and a draft model's catch-up
        (tokens, last): each spends what the one before left, so the budget is spent once.
        With none decoding or no budget nothing is bounded; a step that prefills prompts or
        encodes leaves the catch-up nothing."""
        if not (decoding and self._policy.budgeted):
            return None, None, None
        left_s = choice.budget_s - choice.prefill_s
        embed = None
        if embeds:
            embed = self.cost.tokens_within(max(left_s, 0.0), 0)
            left_s -= self.cost.seconds(1, embed, 0)
        encode_s = max(left_s, 0.0) if images else None
        busy = choice.prefill_s > 0 or bool(choice.admits) or images
        catch_up = 0 if busy else self.cost.catch_up_within(max(left_s, 0.0))
        return embed, encode_s, catch_up

    def waiting_requests(self) -> list[GenerationRequest]:
        """The requests in line, oldest first."""
        return list(self._waiting)

    def over_budget(self, sample: PrefillSample, plan: Plan | StepChoice) -> bool:
        """Whether a step's prefill took longer than the budget it was planned with."""
        return self._policy.budgeted and not plan.bulk and sample.seconds > plan.budget_s

    def drain(self) -> list[int]:
        """Empty the waiting line (shutdown); returns the tickets that were in it."""
        tickets = [r.ticket for r in self._waiting]
        self._waiting.clear()
        self._arrived.clear()
        return tickets
