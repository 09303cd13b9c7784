"""The engine: one thread that owns every MLX object and steps its own batch.

`Engine` is the handle other threads hold: requests and aborts go into its inbox, and each
hand-off comes back through its sink (the handler side's `Outbox`) as one `StepOutput`. The
engine thread owns an `EngineLoop`, which reads plan -> apply -> step -> send: the scheduler
plans, the batch applies and steps, the sink hands the output over. Nothing in the loop is read
by another thread: it publishes its figures (`EngineFigures`) with its output instead.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Iterable
from typing import Protocol

import mlx.core as mx

from ..engine_config import EngineConfig
from ..messages import (
    FINISH_ABORT,
    EmbedRequest,
    EngineCapabilities,
    EngineStartupError,
    FailureKind,
    GenerationRequest,
    ModelInfo,
    RowEvent,
    RowFailure,
    SpeculationFigures,
    StepOutput,
)
from ..outbox import output_due
from ..sysinfo import freeze_startup_heap, thaw_startup_heap
from .arch_fixes import prefill_rows
from .batch import Batch
from .embedding import Embedder
from .encoding import ImageEncodes
from .figures import FiguresPublisher
from .inbox import Inbox
from .lockstep import Lockstep
from .parts import build_parts, new_runner, warm_up
from .planner import Planner, PrefixLookups
from .prefill import PrefillPolicy, StepCost
from .prefix.store import Hit
from .scheduler import Plan, Scheduler
from .speculation import SpeculationCounters
from .watchdog import StepWatch

log = logging.getLogger(__name__)
FATAL_DELIVERY_S = 5.0  # how long a dying engine waits for the handlers to take its last words


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
        crossed: bool = False,
    ) -> None:
        """`exit_on_stall`: a stalled step ends the process once the stall is reported (the
        engine process: its server learns of it from the report and the exit); otherwise
        the server's fatal path ends it. `lockstep`: one model over several processes
        (--distributed), rank 0 planning every step and sharing the plan. `crossed`: every
        request comes over a process boundary (the engine process), its grammar uncompiled."""
        self.config = config
        self._crossed = crossed
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
                    self._crossed,
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
        crossed: bool = False,
    ) -> None:
        self.config = config
        self._watch = watch or StepWatch(0.0)  # marks each step for the watchdog
        self._sink = sink
        self._inbox = inbox
        self._lockstep = lockstep
        self._leads = self._lockstep is None or self._lockstep.leads
        parts = build_parts(config, info, lockstep, crossed)
        self.parts = parts
        self.store = parts.prefix
        self.speculation = SpeculationCounters()  # across runners, should one be replaced
        self.cost = StepCost()  # every part of a step, learned: the scheduler plans with it
        # The runner is built anew should a step fail (speculation's counters go on across
        # runners); only rank 0 (`leads`) sends logprobs anywhere.
        runner = functools.partial(new_runner, parts, config, stream, self.speculation)
        self.batch = Batch(runner, parts, config.faults, self._leads, self.cost)
        if config.warmup:
            warm_up(self.batch.runner, info.bos_token_id or 0, parts.new_row)
        self.store.on_disk_done(inbox.nudge)
        lookups = PrefixLookups(self.store, config)
        self.encodes = ImageEncodes(parts.vision, lookups) if parts.vision is not None else None
        self.scheduler = self._new_scheduler(info.model_type, lookups)
        self.embedder = Embedder.of(
            parts.loaded.model, self._lockstep is not None, config.prefill_step_size
        )
        self.capabilities = EngineCapabilities(
            parts.admission, parts.has_thinking, self.embedder.size, self.store.shared_dir
        )
        self.planner = Planner(
            config,
            self.scheduler,
            self.batch,
            self.store,
            inbox,
            self.embedder,
            self._watch,
            lookups,
            self.encodes,
            lockstep,
        )
        self._figures = FiguresPublisher(
            self.batch,
            self.scheduler,
            inbox,
            self.store,
            self._speculation_figures,
            config.max_prefill_stall_ms > 0,
        )

    def close(self) -> None:
        self.batch.close()
        self.store.close()

    def run(self) -> None:
        self._publish_now()
        while True:
            out = StepOutput()
            plan, hits = self.planner.plan(out)
            if plan.stop:
                self._end_all(out)
                out.embeddings.extend(self.embedder.cancel("the engine is stopping"))
                out.kv_events.extend(self.store.take_events())
                self._sink.put(out, due=True)
                return
            self._watch.begin()  # rank 0 began at its plan; a follower's share just ended
            due = self._apply_and_step(plan, hits, out)
            self._inbox.fan_out(out)
            self._embed(out, plan.embed_tokens)
            if self.encodes is not None and self.scheduler.waiting:
                self._encode_ahead(plan.encode_s, out)
            if self.parts.vision is not None:
                out.images_encoded = self.parts.vision.take_encoded()
            if self._lockstep is not None:
                self._lockstep.progress()
            out.kv_events.extend(self.store.take_events())
            self._figures.publish(out, plan.budget_s)
            self._send(out, due)
            self._watch.end()

    def _apply_and_step(self, plan: Plan, hits: list[Hit | None], out: StepOutput) -> bool:
        """The plan applied and one step run (a failure fails the batch's requests, and a fresh
        runner serves on); True when some handler needs the output now."""
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

    # ----- applying, stepping, sending (every rank) -----

    def _apply(self, plan: Plan, hits: list[Hit | None], out: StepOutput) -> None:
        """Remove aborted rows and insert admitted requests: the same on every rank. The
        prefixes fetched for the plan are pinned until their rows own them; whatever goes
        wrong before that releases them."""
        batch = self.batch
        try:
            batch.set_plan(plan)
            if plan.aborts:
                batch.remove(plan.aborts, out)
        except BaseException:
            for hit in hits:
                if hit is not None:
                    hit.release()
            raise
        if plan.admits:
            batch.insert(plan.admits, hits, out)  # it owns the pins from here

    def _step(self, out: StepOutput, plan: Plan) -> bool:
        """One step; what it prefilled teaches the scheduler's cost model (rank 0 plans)."""
        batch, scheduler = self.batch, self.scheduler
        decoding = batch.view().decoding
        report = batch.step(out)
        if report.prefill_tokens:
            out.prefill_tokens.append(report.prefill_tokens)
        out.fused_steps += report.fused
        self.cost.observe_catch_up(*report.catch_up)
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
            self.cost.prefill.observe(sample)
            if decoding and scheduler.over_budget(sample, plan):
                out.over_budget += 1
            out.widened_steps += plan.widened
        return report.due

    def _embed(self, out: StepOutput, tokens: int | None) -> None:
        """Embeds run in forwards of their own after the step (no cache of the batch's is
        touched): while rows decode, one chunk of the plan's `tokens` a step."""
        embeds = self.planner.take_embeds()
        if embeds or self.embedder.busy:
            out.embeddings.extend(self.embedder.take(embeds, tokens))

    def _encode_ahead(self, budget_s: float | None, out: StepOutput) -> None:
        """Waiting requests' images, a few tower modules within the encoder's share of the
        step; a request whose image fails to encode fails alone, now."""
        assert self.encodes is not None
        for request, reason in self.encodes.advance(self.scheduler.waiting_requests(), budget_s):
            self.scheduler.withdraw({request.ticket})
            self.store.forget(request.ticket)
            out.failures.append(RowFailure(request.ticket, FailureKind.INVALID_ARGUMENT, reason))
        self.encodes.forget_all_but(self.scheduler.waiting_requests())

    def _speculation_figures(self) -> SpeculationFigures | None:
        return None if self.parts.speculation is None else self.speculation.snapshot()

    def _publish_now(self) -> None:
        out = StepOutput()
        self._figures.publish(out, self.config.max_prefill_stall_ms / 1000)
        self._sink.put(out, due=True)

    def _send(self, out: StepOutput, due: bool) -> None:
        """Hand the output over; the loop wakes only once the output rule (`outbox.output_due`)
        says some handler needs it. Then the step's finished and prefilled blocks are kept
        (their block events go with the next output, at once when nothing runs)."""
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

    def _new_scheduler(self, model_type: str, lookups: PrefixLookups) -> Scheduler:
        config, store, encodes = self.config, self.store, self.encodes
        policy = PrefillPolicy(
            max_stall_s=config.max_prefill_stall_ms / 1000,
            step_tokens=config.prefill_step_size,
            max_rows=prefill_rows(model_type, config.prefill_batch_size),
            max_widen=config.max_prefill_stall_widen,
        )

        def ready(request: GenerationRequest) -> bool:
            """Its prefix is read (from disk, if it was there) and its images are encoded."""
            return store.ready(request) and (encodes is None or encodes.ready(request))

        return Scheduler(
            self.parts.admission,
            policy,
            reusable=lookups,
            ready=ready,
            max_rows=config.completion_batch_size,
            cost=self.cost,
        )
