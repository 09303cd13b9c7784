"""Rank 0's decisions for each step, and a follower's copy of them (engine thread only).

The planner takes what the inbox holds (requests, aborts, embeds, flushes), lets the
scheduler choose the step's admissions and its work under one budget, fetches the admitted
requests' cached prefixes, and returns the `Plan` the loop runs: with `--distributed`, rank 0
shares it and every other rank fetches its own copy of the same prefixes.
"""

from __future__ import annotations

import time

from ..engine_config import EngineConfig
from ..messages import (
    FINISH_ABORT,
    EmbedRequest,
    FailureKind,
    GenerationRequest,
    RowEvent,
    RowFailure,
    StepOutput,
)
from .batch import Batch
from .embedding import Embedder
from .encoding import ImageEncodes
from .inbox import Inbox, InboxTake
from .lockstep import Lockstep, LockstepBroken
from .prefix.store import AnyPrefixStore, Hit
from .scheduler import Admit, Plan, Scheduler
from .watchdog import StepWatch


class Planner:
    """Plans each step: rank 0 decides, followers receive (lockstep)."""

    def __init__(
        self,
        config: EngineConfig,
        scheduler: Scheduler,
        batch: Batch,
        store: AnyPrefixStore,
        inbox: Inbox,
        embedder: Embedder,
        watch: StepWatch,
        lookups: PrefixLookups,
        encodes: ImageEncodes | None = None,
        lockstep: Lockstep | None = None,
    ) -> None:
        self._config, self._scheduler, self._batch = config, scheduler, batch
        self._store, self._inbox, self._embedder = store, inbox, embedder
        self._watch, self._lookups, self._encodes = watch, lookups, encodes
        self._lockstep = lockstep
        self._leads = lockstep is None or lockstep.leads
        self._embeds: list[EmbedRequest] = []  # taken while planning, run after the step

    def take_embeds(self) -> list[EmbedRequest]:
        """The embeds taken while planning, to run after the step (the planner keeps none)."""
        embeds, self._embeds = self._embeds, []
        return embeds

    def plan(self, out: StepOutput) -> tuple[Plan, list[Hit | None]]:
        """Rank 0's plan, the same on every rank, and this rank's cached prefix for each of
        its admissions (pinned until the loop hands them to their rows)."""
        if self._leads:
            plan, hits = self._plan(out)
            if self._lockstep is not None:
                self._lockstep.share(plan, Plan)
            return plan, hits
        assert self._lockstep is not None
        plan = self._lockstep.share(None, Plan)
        if plan.check != self._batch.check:
            raise LockstepBroken(f"the ranks disagree on the last step ({plan.check})")
        return plan, [self._follower_hit(admit) for admit in plan.admits]

    def _plan(self, out: StepOutput) -> tuple[Plan, list[Hit | None]]:
        """Rank 0's decisions: aborts, and which waiting requests join the batch now."""
        scheduler, batch, lockstep = self._scheduler, self._batch, self._lockstep
        # Requests that only wait for their blocks from disk leave the engine idle: a finished
        # load wakes it (or a timeout, should the wake be lost).
        loading = self._store.loading and not batch.rows
        take = self._inbox.take(
            idle=not batch.rows and (not scheduler.waiting or loading) and not self._embedder.busy,
            quiet_s=self._config.coalesce_quiet_s,
            max_s=self._config.coalesce_max_s,
            burst_size=scheduler.burst,
            timeout_s=lockstep.heartbeat_s if lockstep is not None else (0.1 if loading else None),
        )
        self._watch.begin()  # the wait for work is over: planning counts from here
        now = time.monotonic()
        self._lookups.new_step()
        scheduler.enqueue(take.requests, now)
        out.disk_load_seconds.extend(self._store.collect())
        plan = Plan(stop=take.stopping, check=batch.check)
        hits: list[Hit | None] = []
        self._commands(take, out)
        if take.aborts:  # requests not admitted yet end here; admitted rows end on every rank
            for ticket in scheduler.withdraw(take.aborts):
                out.events.append(RowEvent(ticket, None, FINISH_ABORT))
                self._store.forget(ticket)
            plan.aborts = sorted(take.aborts & batch.tickets())
        if plan.stop:
            return plan, hits
        view = batch.view()
        choice = scheduler.schedule(view, now)
        plan.chunk, plan.widened = choice.chunk, choice.widened
        plan.budget_s, plan.bulk = choice.budget_s, choice.bulk
        embeds = bool(self._embeds or self._embedder.busy)
        running = bool(view.rows or choice.admits)
        encodes = self._encodes
        images = encodes is not None and encodes.pending(scheduler.waiting_requests())
        shares = scheduler.share(choice, running, embeds, images)
        plan.embed_tokens, plan.encode_s, plan.catch_up_tokens = shares
        for request, reason in choice.failed:
            out.failures.append(RowFailure(request.ticket, FailureKind.INTERNAL, reason))
            self._store.forget(request.ticket)
        for admit in choice.admits:
            # The store turns its own faults into a miss.
            hit = self._store.fetch_admitted(admit.request)
            hits.append(hit)
            plan.admits.append(Admit(admit.request, admit.reserved, _length(hit)))
        return plan, hits

    def _commands(self, take: InboxTake, out: StepOutput) -> None:
        """Flushes now, before this step's lookups; embeds after the step (the loop runs
        `take_embeds`). Neither happens where every rank must do the same (lockstep): they are
        refused there."""
        if self._lockstep is not None:
            why = "not supported with --distributed"
            out.embeddings.extend(self._embedder.refuse(take.embeds, f"embedding is {why}"))
            out.failures.extend(
                RowFailure(t, FailureKind.INVALID_ARGUMENT, f"flushing the prompt cache is {why}")
                for t in take.flushes
            )
            return
        if take.flushes:
            self._store.flush()
            out.flushed.extend(take.flushes)
        if take.stopping:
            out.embeddings.extend(self._embedder.refuse(take.embeds, "the engine is stopping"))
        else:
            self._embeds.extend(take.embeds)

    def _follower_hit(self, admit: Admit) -> Hit | None:
        """A follower's own copy of the prefix rank 0 found for `admit`."""
        hit = self._store.fetch(admit.request)
        if _length(hit) != admit.cached_tokens:
            raise LockstepBroken("the ranks' prefix caches disagree")
        return hit


class PrefixLookups:
    """How much of each waiting request's prompt a cached prefix would cover, looked up once a
    step: the scheduler's estimate and the image encoder read the same answer."""

    def __init__(self, store: AnyPrefixStore, config: EngineConfig) -> None:
        self._store, self._config = store, config
        self._found: dict[int, int] = {}  # ticket -> covered tokens, this step

    def new_step(self) -> None:
        self._found.clear()

    def __call__(self, request: GenerationRequest) -> int:
        found = self._found.get(request.ticket)
        if found is None:
            if self._config.faults is not None:
                self._config.faults.before_call("plan")
            found = self._found[request.ticket] = self._store.match(request).length
        return found


def _length(hit: Hit | None) -> int:
    return hit.length if hit is not None else 0
