"""The engine: one thread that owns every MLX object and steps a BatchGenerator.

`Engine` is the handle other threads hold: requests and aborts go into its inbox, and each
hand-off comes back through its sink (the handler side's `Outbox`) as one `StepOutput`. The
engine thread owns an `EngineLoop`, which reads plan -> apply -> step -> send: the scheduler
plans, the batch applies and steps, the sink hands the output over. Nothing in the loop is read
by another thread: it publishes its figures (`EngineFigures`) with its output instead.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx

from ..engine_config import EngineConfig
from ..messages import (
    FINISH_ABORT,
    EmbedRequest,
    EngineCapabilities,
    EngineFigures,
    EngineStartupError,
    FailureKind,
    GenerationRequest,
    LoadCounts,
    ModelInfo,
    RowEvent,
    RowFailure,
    SpeculationFigures,
    StepOutput,
)
from ..outbox import output_due
from ..sysinfo import freeze_startup_heap, thaw_startup_heap
from .arch_fixes import prefill_rows
from .batch import Batch, check_same_prefix
from .embedding import Embedder
from .inbox import Inbox, InboxTake
from .lockstep import Lockstep, LockstepBroken
from .parts import build_parts, new_generator, warm_up
from .prefill import PrefillPolicy
from .prefix.store import AnyPrefixStore, Hit
from .scheduler import Admit, Plan, Scheduler
from .speculation import SpeculationCounters
from .watchdog import StepWatch

log = logging.getLogger(__name__)
FATAL_DELIVERY_S = 5.0  # how long a dying engine waits for the handlers to take its last words
# While rows run, the figures go out at most this often (building and comparing them every
# step of a fast model is a measurable share of its step); an idle batch sends them at once.
FIGURES_INTERVAL_S = 0.05


class Sink(Protocol):
    """Where the engine's output goes (the handler side's `Outbox`)."""

    def put(self, out: StepOutput, due: bool) -> None: ...

    def delivered(self, timeout: float) -> bool:
        """Wait until everything put so far has been taken (False: `timeout` passed)."""
        ...


class Engine:
    """Owns one generation thread; construct, `start(info)`, then `wait_ready()`."""

    def __init__(
        self,
        config: EngineConfig,
        sink: Sink,
        exit_on_stall: bool = False,
        lockstep: Lockstep | None = None,
    ) -> None:
        """`exit_on_stall`: a stalled step ends the process once the stall is reported (the
        engine process: its server learns of it from the report and the exit); otherwise
        the server's fatal path ends it. `lockstep`: one model over several processes
        (--distributed), rank 0 planning every step and sharing the plan."""
        self.config = config
        self._sink = sink
        self._lockstep = lockstep
        self._exit_on_stall = exit_on_stall
        self._watch = StepWatch(config.step_timeout_s)
        self._stalled = False
        self._inbox = Inbox()
        self._thread = threading.Thread(target=self._run, name="mlx-engine", daemon=True)
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._info: ModelInfo | None = None
        self._capabilities: EngineCapabilities | None = None  # set once, before ready
        self._loop: EngineLoop | None = None  # the engine thread's
        self.failure: str | None = None  # why the engine thread ended, when it failed

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
        assert self._capabilities is not None
        return self._capabilities

    @property
    def prefix_cache(self) -> AnyPrefixStore | None:
        """The engine thread's prefix store, for tests that look inside an idle engine."""
        return self._loop.store if self._loop is not None else None

    def submit(self, request: GenerationRequest) -> None:
        self._inbox.put(request)

    def abort(self, tickets: Iterable[int]) -> None:
        self._inbox.abort(tickets)

    def embed(self, request: EmbedRequest) -> None:
        self._inbox.embed(request)

    def flush_cache(self, ticket: int) -> None:
        self._inbox.flush(ticket)

    def shutdown(self, timeout: float | None = None) -> None:
        """End every request with `abort`, release MLX objects and join the thread (not
        for long once a step stalled: that thread may never come back)."""
        self._inbox.stop()
        self.join(min(timeout, 1.0) if self._stalled and timeout is not None else timeout)

    def join(self, timeout: float | None = None) -> None:
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # ----- the engine thread -----

    def _run(self) -> None:
        stream = mx.new_stream(mx.default_device())
        with mx.stream(stream):
            try:
                assert self._info is not None
                loop = EngineLoop(
                    self.config,
                    self._info,
                    self._sink,
                    self._inbox,
                    stream,
                    self._watch,
                    self._lockstep,
                )
            except BaseException as exc:
                log.error("engine startup failed: %s", exc, exc_info=exc)
                self._startup_error = exc
                self._ready.set()
                return
            self._loop, self._capabilities = loop, loop.capabilities
            if self._lockstep is not None:
                self._lockstep.watch(self._on_stall)
            self._watch.watch(lambda: self._thread.is_alive(), self._on_step_stall)
            freeze_startup_heap()  # the model is loaded and warm
            self._ready.set()
            try:
                loop.run()
            except BaseException as exc:
                log.exception("engine thread died")
                self.failure = f"engine thread died: {exc}"
                _send_fatal(self._sink, self.failure)
            finally:
                loop.close()
                thaw_startup_heap()

    def _on_stall(self, reason: str) -> None:
        """The watchdog's last words (from its thread): tell the handlers, and wait until
        they have taken it before the process goes."""
        self.failure = reason
        _send_fatal(self._sink, reason)
        self._sink.delivered(FATAL_DELIVERY_S)

    def _on_step_stall(self, reason: str) -> None:
        """The step watchdog's finding (from its thread): the fatal path; in the engine
        process, then the exit (its server hears both)."""
        self._stalled = True
        self._on_stall(reason)
        if self._exit_on_stall:
            logging.shutdown()
            os._exit(1)


def _send_fatal(sink: Sink, reason: str) -> None:
    try:
        sink.put(StepOutput(fatal=reason), due=True)
    except Exception:
        log.exception("could not report the engine's death")


class EngineLoop:
    """Everything the engine thread owns: the model's parts, the batch, the scheduler and the
    prefix store; one `run` of plan -> apply -> step -> send until told to stop."""

    def __init__(
        self,
        config: EngineConfig,
        info: ModelInfo,
        sink: Sink,
        inbox: Inbox,
        stream: mx.Stream,
        watch: StepWatch | None = None,
        lockstep: Lockstep | None = None,
    ) -> None:
        self.config = config
        self._watch = watch or StepWatch(0.0)  # marks each step for the watchdog
        self._sink = sink
        self._inbox = inbox
        self._lockstep = lockstep
        self._leads = self._lockstep is None or self._lockstep.leads
        self._published = Published()
        self._embeds: list[EmbedRequest] = []  # taken while planning, run after the step
        parts = build_parts(config, info, lockstep)
        self.parts = parts
        self.store = parts.prefix
        self.speculation = SpeculationCounters()  # across generators, should one be replaced
        self.batch = Batch(
            lambda: new_generator(
                parts.loaded.model,
                config,
                stream,
                parts.speculation,
                self.speculation,
                parts.fused_prefill,
                parts.group_rows,
            ),
            parts.sampling,
            parts.prefix,
            config.faults,
            wants_logprobs=self._leads,
            new_row=parts.new_row,
        )
        if config.warmup:
            warm_up(self.batch.generator, info.bos_token_id or 0, parts.new_row)
        self.store.on_disk_done(inbox.nudge)
        policy = PrefillPolicy(
            max_stall_s=config.max_prefill_stall_ms / 1000,
            step_tokens=config.prefill_step_size,
            max_rows=prefill_rows(info.model_type, config.prefill_batch_size),
            max_widen=config.max_prefill_stall_widen,
        )
        self.scheduler = Scheduler(
            parts.admission,
            policy,
            reusable=self._reusable,
            ready=self.store.ready,
            max_rows=config.completion_batch_size,
        )
        self.embedder = Embedder.of(
            parts.loaded.model, self._lockstep is not None, config.prefill_step_size
        )
        self.capabilities = EngineCapabilities(
            parts.admission, parts.has_thinking, self.store.block_size, self.embedder.size
        )

    def close(self) -> None:
        self.batch.close()
        self.store.close()

    def run(self) -> None:
        self._publish_now()
        while True:
            out = StepOutput()
            plan, hits = self._shared_plan(out)
            if plan.stop:
                self._end_all(out)
                out.embeddings.extend(self.embedder.cancel("the engine is stopping"))
                out.kv_events.extend(self.store.take_events())
                self._sink.put(out, due=True)
                return
            self._watch.begin()  # rank 0 began at its plan; a follower's share just ended
            due = self._apply_and_step(plan, hits, out)
            self._inbox.fan_out(out)
            if self._embeds or self.embedder.busy:
                self._embed(out, plan.budget_s)
            if self._lockstep is not None:
                self._lockstep.progress()
            out.kv_events.extend(self.store.take_events())
            self._publish(out, plan.budget_s)
            self._send(out, due)
            self._watch.end()

    def _apply_and_step(self, plan: Plan, hits: list[Hit | None], out: StepOutput) -> bool:
        """The plan applied and one step run (a failure fails the batch's requests, and a fresh
        generator serves on); True when some handler needs the output now."""
        batch = self.batch
        started = time.perf_counter()
        due = False
        running = bool(batch.rows or plan.admits)
        try:
            self._apply(plan, hits, out)
            if batch.rows:
                admitted = time.perf_counter()
                due = self._step(out, plan)
                ended = time.perf_counter()
                out.step_seconds.append(ended - started)
                if (plan.admits or out.prefill_tokens) and log.isEnabledFor(logging.DEBUG):
                    took = (ended - started, len(plan.admits), admitted - started)
                    log.debug("step: %.3fs, of which admitting %d took %.3fs", *took)
        except Exception as exc:
            if self._lockstep is not None:
                raise  # the ranks may no longer hold the same batch: nothing to recover
            batch.recover(exc, plan, out)
        if running and not batch.rows:
            self.scheduler.emptied(sum(1 for event in out.events if event.finish_reason))
        return due

    # ----- planning (rank 0) -----

    def _reusable(self, request: GenerationRequest) -> int:
        """How much of its prompt a cached prefix would cover, for planning."""
        if self.config.faults is not None:
            self.config.faults.before_call("plan")
        return self.store.match(request).length

    def _shared_plan(self, out: StepOutput) -> tuple[Plan, list[Hit | None]]:
        """Rank 0's plan, the same on every rank, and this rank's cached prefix for each of
        its admissions (pinned until `_apply` hands them to their rows)."""
        if self._leads:
            plan, hits = self._plan(out)
            if self._lockstep is not None:
                self._lockstep.share(plan, Plan)
            return plan, hits
        assert self._lockstep is not None
        plan = self._lockstep.share(None, Plan)
        if plan.check != self.batch.check:
            raise LockstepBroken(f"the ranks disagree on the last step ({plan.check})")
        return plan, [self._follower_hit(admit) for admit in plan.admits]

    def _plan(self, out: StepOutput) -> tuple[Plan, list[Hit | None]]:
        """Rank 0's decisions: aborts, and which waiting requests join the batch now."""
        scheduler, batch, lockstep = self.scheduler, self.batch, self._lockstep
        # Requests that only wait for their blocks from disk leave the engine idle: a finished
        # load wakes it (or a timeout, should the wake be lost).
        loading = self.store.loading and not batch.rows
        take = self._inbox.take(
            idle=not batch.rows and (not scheduler.waiting or loading) and not self.embedder.busy,
            quiet_s=self.config.coalesce_quiet_s,
            max_s=self.config.coalesce_max_s,
            burst_size=scheduler.burst,
            timeout_s=lockstep.heartbeat_s if lockstep is not None else (0.1 if loading else None),
        )
        self._watch.begin()  # the wait for work is over: planning counts from here
        now = time.monotonic()
        scheduler.enqueue(take.requests, now)
        out.disk_load_seconds.extend(self.store.collect())
        plan = Plan(stop=take.stopping, check=batch.check)
        hits: list[Hit | None] = []
        self._commands(take, out)
        if take.aborts:  # requests not admitted yet end here; admitted rows end on every rank
            for ticket in scheduler.withdraw(take.aborts):
                out.events.append(RowEvent(ticket, None, FINISH_ABORT))
                self.store.forget(ticket)
            plan.aborts = sorted(take.aborts & batch.tickets())
        if plan.stop:
            return plan, hits
        choice = scheduler.schedule(batch.view(), now)
        plan.chunk, plan.widened = choice.chunk, choice.widened
        plan.budget_s, plan.bulk = choice.budget_s, choice.bulk
        for request, reason in choice.failed:
            out.failures.append(RowFailure(request.ticket, FailureKind.INTERNAL, reason))
            self.store.forget(request.ticket)
        for admit in choice.admits:
            # The store turns its own faults into a miss.
            hit = self.store.fetch_admitted(admit.request)
            hits.append(hit)
            plan.admits.append(Admit(admit.request, admit.reserved, _length(hit)))
        return plan, hits

    def _commands(self, take: InboxTake, out: StepOutput) -> None:
        """Flushes now, before this step's lookups; embeds after the step (`_embed`). Neither
        happens where every rank must do the same (lockstep): they are refused there."""
        if self._lockstep is not None:
            why = "not supported with --distributed"
            out.embeddings.extend(self.embedder.refuse(take.embeds, f"embedding is {why}"))
            out.failures.extend(
                RowFailure(t, FailureKind.INVALID_ARGUMENT, f"flushing the prompt cache is {why}")
                for t in take.flushes
            )
            return
        if take.flushes:
            self.store.flush()
            out.flushed.extend(take.flushes)
        if take.stopping:
            out.embeddings.extend(self.embedder.refuse(take.embeds, "the engine is stopping"))
        else:
            self._embeds.extend(take.embeds)

    # ----- applying, stepping, sending (every rank) -----

    def _apply(self, plan: Plan, hits: list[Hit | None], out: StepOutput) -> None:
        """Remove aborted rows and insert admitted requests: the same on every rank. The
        prefixes fetched for the plan are pinned until their rows own them; whatever goes
        wrong before that releases them."""
        batch = self.batch
        try:
            batch.set_chunk(plan.chunk)
            if plan.aborts:
                batch.remove(plan.aborts, out)
        except BaseException:
            for hit in hits:
                if hit is not None:
                    hit.release()
            raise
        if plan.admits:
            batch.insert(plan.admits, hits, out)  # it owns the pins from here

    def _follower_hit(self, admit: Admit) -> Hit | None:
        """A follower's own copy of the prefix rank 0 found for `admit`."""
        hit = self.store.fetch(admit.request)
        check_same_prefix(_length(hit), admit.cached_tokens)
        return hit

    def _step(self, out: StepOutput, plan: Plan) -> bool:
        """One step; what it prefilled teaches the scheduler's cost model (rank 0 plans)."""
        batch, scheduler = self.batch, self.scheduler
        decoding = batch.view().decoding
        report = batch.step(out)
        if report.prefill_tokens:
            out.prefill_tokens.append(report.prefill_tokens)
        out.fused_steps += report.fused
        sample = report.prefill
        if sample is not None and self._leads:
            if log.isEnabledFor(logging.DEBUG):
                log.debug(
                    "step: prefill %s, planned chunk %d budget %.3fs, decode step %.3fs",
                    sample,
                    plan.chunk,
                    plan.budget_s,
                    batch.decode_step_s,
                )
            scheduler.cost.observe(sample)
            if decoding and scheduler.over_budget(sample, plan):
                out.over_budget += 1
            out.widened_steps += plan.widened
        return report.due

    def _embed(self, out: StepOutput, budget_s: float) -> None:
        """Embeds run in forwards of their own after the step (no cache of the generator's is
        touched): while rows decode, one chunk a step within the prefill budget."""
        embeds, self._embeds = self._embeds, []
        tokens = self.scheduler.beside_decoding(bool(self.batch.rows), budget_s)
        out.embeddings.extend(self.embedder.take(embeds, tokens))

    def _publish(self, out: StepOutput, budget_s: float) -> None:
        """The figures go out with this output when they changed (`budget_s`: the prefill
        budget the step was planned with): at once when no row runs or the output answers a
        flush (its caller reads them), otherwise at most every `FIGURES_INTERVAL_S`."""
        now, published, batch = time.monotonic(), self._published, self.batch
        counts = len(batch.rows), batch.starting_rows, self.scheduler.waiting
        recent = now - published.at < FIGURES_INTERVAL_S and counts == published.counts
        if batch.rows and not out.flushed and recent:
            return
        published.at, published.counts = now, counts
        budget = budget_s if self.config.max_prefill_stall_ms > 0 else 0.0
        load = load_counts(batch, self.scheduler, self._inbox)
        figures = EngineFigures(self.store.stats(), budget, self._speculation_figures(), load)
        if figures != published.figures:
            out.figures = published.figures = figures

    def _speculation_figures(self) -> SpeculationFigures | None:
        if self.parts.speculation is None:
            return None
        return self.speculation.snapshot()

    def _publish_now(self) -> None:
        out = StepOutput()
        self._publish(out, self.config.max_prefill_stall_ms / 1000)
        self._sink.put(out, due=True)

    def _send(self, out: StepOutput, due: bool) -> None:
        """Hand the output over; the loop wakes only once the output rule
        (`outbox.output_due`) says some handler needs it. Then the step's
        finished and prefilled blocks are kept (their block events go with the next output,
        at once when nothing runs)."""
        if out:
            due = output_due(out, due, bool(self.batch.rows))
            if due:
                self.batch.handed_over()
            self._sink.put(out, due)
        if self.store.keep_pending() and not self.batch.rows:
            self._sink.put(StepOutput(kv_events=self.store.take_events()), due=True)

    def _end_all(self, out: StepOutput) -> None:
        tickets = self.scheduler.drain() + [r.ticket for r in self._inbox.drop_samples()]
        out.events.extend(RowEvent(ticket, None, FINISH_ABORT) for ticket in tickets)
        self.batch.end_all(out)


@dataclass(slots=True)
class Published:
    """The figures the engine last sent, and when it last looked (time.monotonic())."""

    figures: EngineFigures | None = None
    at: float = 0.0
    counts: tuple[int, int, int] = (0, 0, 0)


def load_counts(batch: Batch, scheduler: Scheduler, inbox: Inbox) -> LoadCounts:
    """The load a router reads (GetLoads), as a step left it: the batch's rows, the requests
    in the scheduler's line and the samples the inbox holds."""
    starting, held = batch.starting_rows, inbox.held_samples()
    return LoadCounts(
        running=len(batch.rows) - starting,
        waiting=starting + scheduler.waiting + len(held),
        waiting_tokens=scheduler.waiting_tokens() + sum(held),
        used_tokens=sum(
            len(row.admit.request.prompt) + row.generated for row in batch.rows.values()
        ),
        generated=batch.generated,
        prompt_tokens=batch.admitted_prompt,
    )


def _length(hit: Hit | None) -> int:
    return hit.length if hit is not None else 0
