"""The engine: one thread that owns every MLX object and steps a BatchGenerator.

Handlers talk to it only through `submit`, `abort` and its outbox: requests go into the inbox,
and each step's events go out in one `StepOutput`. The loop reads plan -> apply -> step ->
send; the scheduler plans, the batch applies and steps, the outbox hands the output over.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from typing import Protocol

import mlx.core as mx

from ..engine_config import EngineConfig
from ..messages import (
    FINISH_ABORT,
    EngineCapabilities,
    EngineLoad,
    EngineStartupError,
    FailureKind,
    GenerationRequest,
    ModelInfo,
    PrefixCacheStats,
    RowEvent,
    RowFailure,
    StepOutput,
)
from .batch import Batch, check_same_prefix
from .inbox import Inbox
from .lockstep import LockstepBroken
from .prefill import PrefillPolicy
from .prefix_store import Hit, PrefixStore
from .provider import EngineParts, build_parts, new_generator, warm_up
from .scheduler import Admit, Plan, Scheduler

log = logging.getLogger(__name__)


class Sink(Protocol):
    """Where the engine's output goes (the handler side's `Outbox`)."""

    def put(self, out: StepOutput, due: bool) -> None: ...


class Engine:
    """Owns one generation thread; construct, `start(info)`, then `wait_ready()`."""

    def __init__(self, config: EngineConfig, sink: Sink) -> None:
        self.config = config
        self._sink = sink
        self._inbox = Inbox()
        self._thread = threading.Thread(target=self._run, name="mlx-engine", daemon=True)
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._info: ModelInfo | None = None
        self._parts: EngineParts | None = None
        # Written only by the engine thread; other threads read them for load reports.
        self._scheduler: Scheduler | None = None
        self._batch: Batch | None = None
        self._lockstep = config.lockstep
        self._leads = self._lockstep is None or self._lockstep.leads
        self._fetched: dict[int, Hit | None] = {}  # prefixes rank 0 found while planning
        self.failure: str | None = None  # why the engine thread ended, when it failed

    # ----- called from any thread -----

    def start(self, info: ModelInfo) -> None:
        """Load the model `info` describes and serve it, on the engine thread."""
        self._info = info
        self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> ModelInfo:
        if not self._ready.wait(timeout):
            raise EngineStartupError("the engine did not become ready in time")
        if self._startup_error is not None:
            raise EngineStartupError(str(self._startup_error)) from self._startup_error
        assert self._info is not None
        return self._info

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def capabilities(self) -> EngineCapabilities:
        """The admission guard's model and limit, and what the model supports (after
        `wait_ready`)."""
        parts = self._parts
        assert parts is not None
        block = parts.prefix.block_size if parts.prefix is not None else 0
        return EngineCapabilities(parts.admission, parts.has_thinking, block)

    @property
    def prefix_cache(self) -> PrefixStore | None:
        return self._parts.prefix if self._parts is not None else None

    def prefix_stats(self) -> PrefixCacheStats | None:
        store = self.prefix_cache
        return store.stats() if store is not None else None

    def submit(self, request: GenerationRequest) -> None:
        self._inbox.put(request)

    def abort(self, tickets: Iterable[int]) -> None:
        self._inbox.abort(tickets)

    def load(self) -> EngineLoad:
        batch, scheduler = self._batch, self._scheduler
        rows = list(batch.rows.values()) if batch is not None else []
        running = sum(1 for row in rows if row.generated)
        queued = scheduler.waiting if scheduler is not None else 0
        return EngineLoad(waiting=len(self._inbox) + queued + len(rows) - running, running=running)

    def shutdown(self, timeout: float | None = None) -> None:
        """End every request with `abort`, release MLX objects and join the thread."""
        self._inbox.stop()
        self.join(timeout)

    def join(self, timeout: float | None = None) -> None:
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # ----- the engine thread -----

    def _run(self) -> None:
        stream = mx.new_stream(mx.default_device())
        with mx.stream(stream):
            try:
                self._start_up(stream)
            except BaseException as exc:
                log.error("engine startup failed: %s", exc)
                self._startup_error = exc
                self._ready.set()
                return
            if self._lockstep is not None:
                self._lockstep.watch(self._on_stall)
            self._ready.set()
            try:
                self._loop()
            except BaseException as exc:
                log.exception("engine thread died")
                self.failure = f"engine thread died: {exc}"
                self._send_fatal(self.failure)
            finally:
                assert self._batch is not None
                self._batch.close()
                if self.prefix_cache is not None:
                    self.prefix_cache.close()

    def _start_up(self, stream: mx.Stream) -> None:
        assert self._info is not None
        config = self.config
        parts = build_parts(config, self._info)
        batch = Batch(
            lambda: new_generator(config, parts, stream),
            parts.sampling,
            parts.prefix,
            self._left,
            config.faults,
            wants_logprobs=self._leads,
        )
        if config.warmup:
            warm_up(batch.generator, self._info.bos_token_id or 0)
        self._parts, self._batch = parts, batch
        policy = PrefillPolicy(
            max_stall_s=config.max_prefill_stall_ms / 1000,
            step_tokens=config.prefill_step_size,
            max_rows=config.prefill_batch_size,
        )
        store = parts.prefix
        if store is not None and store.disk is not None:
            store.disk.disk.on_done = self._inbox.nudge
        self._scheduler = Scheduler(
            parts.admission,
            policy,
            reusable=self._reusable,
            ready=store.ready if store is not None else lambda r: True,
            max_rows=config.completion_batch_size,
        )

    def _reusable(self, request: GenerationRequest) -> int:
        """How much of its prompt a cached prefix would cover, for planning."""
        if self.config.faults is not None:
            self.config.faults.before_call("plan")
        store = self.prefix_cache
        return store.match(request).length if store is not None else 0

    def _left(self, admit: Admit) -> None:
        assert self._scheduler is not None
        self._scheduler.release(admit.reserved)

    def _loop(self) -> None:
        batch = self._batch
        assert batch is not None
        while True:
            out = StepOutput()
            plan = self._shared_plan(out)
            if plan.stop:
                self._end_all(out)
                self._sink.put(out, due=True)
                return
            started = time.perf_counter()
            due = False
            try:
                self._apply(plan, out)
                if batch.rows:
                    due = self._step(batch, out)
                    out.step_seconds.append(time.perf_counter() - started)
            except Exception as exc:
                if self._lockstep is not None:
                    raise  # the ranks may no longer hold the same batch: nothing to recover
                batch.recover(exc, plan, out)
                self._scheduler.forget_reservations()  # type: ignore[union-attr]
            if self._lockstep is not None:
                self._lockstep.progress()
            self._send(out, due)

    def _step(self, batch: Batch, out: StepOutput) -> bool:
        """One step; what it prefilled teaches the scheduler's cost model (rank 0 plans)."""
        decoding = batch.view().decoding
        report = batch.step(out)
        if report.prefill_tokens:
            out.prefill_tokens.append(report.prefill_tokens)
        sample = report.prefill
        if sample is not None and self._leads:
            assert self._scheduler is not None
            self._scheduler.observe(sample)
            if decoding and self._scheduler.over_budget(sample):
                out.over_budget += 1
        return report.due

    def _send(self, out: StepOutput, due: bool) -> None:
        """Hand the output over; the loop wakes only once some handler needs it (a first
        token, a full `tokens_per_handoff`, a finish or a failure)."""
        if not out:
            return
        due = due or bool(out.failures) or any(e.finish_reason for e in out.events)
        if due:
            assert self._batch is not None
            self._batch.handed_over()
        self._sink.put(out, due)

    def _shared_plan(self, out: StepOutput) -> Plan:
        """Rank 0's plan, the same on every rank."""
        plan = self._plan(out) if self._leads else None
        if self._lockstep is not None:
            plan = self._lockstep.share(plan)
            assert self._batch is not None
            if plan.check != self._batch.check:
                raise LockstepBroken(f"the ranks disagree on the last step ({plan.check})")
        assert plan is not None
        return plan

    def _plan(self, out: StepOutput) -> Plan:
        """Rank 0's decisions: aborts, and which waiting requests join the batch now."""
        scheduler, batch = self._scheduler, self._batch
        assert scheduler is not None and batch is not None
        lockstep = self._lockstep
        store = self.prefix_cache
        # Requests that only wait for their blocks from disk leave the engine idle: a finished
        # load wakes it (or a timeout, should the wake be lost).
        loading = store is not None and store.loading and not batch.rows
        take = self._inbox.take(
            idle=not batch.rows and (not scheduler.waiting or loading),
            quiet_s=self.config.coalesce_quiet_s,
            max_s=self.config.coalesce_max_s,
            burst_size=self.config.prefill_batch_size,
            timeout_s=lockstep.heartbeat_s if lockstep is not None else (0.1 if loading else None),
        )
        scheduler.enqueue(take.requests)
        if store is not None:
            out.disk_load_seconds.extend(store.collect())
        plan = Plan(stop=take.stopping, check=batch.check)
        if take.aborts:  # requests not admitted yet end here; admitted rows end on every rank
            for ticket in scheduler.withdraw(take.aborts):
                out.events.append(RowEvent(ticket, None, FINISH_ABORT))
                if store is not None:
                    store.forget(ticket)
            plan.aborts = sorted(take.aborts & batch.tickets())
        if plan.stop:
            return plan
        choice = scheduler.schedule(batch.view())
        plan.chunk = choice.chunk
        for request, reason in choice.failed:
            self._fail_alone(request.ticket, reason, out)
        for admit in choice.admits:
            plan.admits.append(self._with_prefix(admit, out))
        return plan

    def _with_prefix(self, admit: Admit, out: StepOutput) -> Admit:
        """`admit` with its cached prefix fetched (kept for `_apply`); the store turns its own
        faults into a miss."""
        store = self.prefix_cache
        ticket = admit.request.ticket
        hit = None
        if store is not None:
            from_disk = store.admitted(ticket)
            hit = store.fetch(admit.request, from_disk)
        self._fetched[ticket] = hit
        return Admit(admit.request, admit.reserved, hit.length if hit is not None else 0)

    def _fail_alone(self, ticket: int, reason: str, out: StepOutput) -> None:
        out.failures.append(RowFailure(ticket, FailureKind.INTERNAL, reason))
        if self.prefix_cache is not None:
            self.prefix_cache.forget(ticket)

    def _apply(self, plan: Plan, out: StepOutput) -> None:
        """Remove aborted rows and insert admitted requests: the same on every rank. The
        prefixes fetched for the plan are pinned until their rows own them; whatever goes
        wrong before that releases them."""
        batch = self._batch
        assert batch is not None
        hits = [self._take_fetched(admit) for admit in plan.admits]
        try:
            batch.set_chunk(plan.chunk)
            if plan.aborts:
                batch.remove(plan.aborts, out)
        except BaseException:
            if self.prefix_cache is not None:
                for hit in hits:
                    if hit is not None:
                        self.prefix_cache.release(hit.nodes)
            raise
        if plan.admits:
            batch.insert(plan.admits, hits, out)  # it owns the pins from here

    def _take_fetched(self, admit: Admit) -> Hit | None:
        if self._leads:
            return self._fetched.pop(admit.request.ticket)
        assert self._batch is not None
        hit = self._batch.lookup(admit.request)
        check_same_prefix(hit.length if hit is not None else 0, admit.cached_tokens)
        return hit

    def _end_all(self, out: StepOutput) -> None:
        assert self._batch is not None and self._scheduler is not None
        tickets = self._scheduler.drain()
        out.events.extend(RowEvent(ticket, None, FINISH_ABORT) for ticket in tickets)
        self._batch.end_all(out)

    def _send_fatal(self, reason: str) -> None:
        try:
            self._sink.put(StepOutput(fatal=reason), due=True)
        except Exception:
            log.exception("could not report the engine's death")

    def _on_stall(self, reason: str) -> None:
        """The watchdog's last words (from its thread): tell the handlers, give them a moment."""
        self.failure = reason
        self._send_fatal(reason)
        time.sleep(1.0)
