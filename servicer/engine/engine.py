"""The engine: one thread that owns every MLX object and steps a BatchGenerator.

Handlers talk to it only through `submit`, `abort` and the `deliver` callback: requests
go into the inbox, and each step hands every row's events back in one `StepOutput`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator

from ..messages import (
    FINISH_ABORT,
    FINISH_STOP,
    EngineLoad,
    FailureKind,
    GenerationRequest,
    ModelInfo,
    RowEvent,
    RowFailure,
    StepOutput,
)
from .constraints import GrammarFactory
from .faults import FaultPlan
from .model import LoadedModel, load_model
from .sampling import SamplingFactory, gather_logprobs
from .text import TextCodec

log = logging.getLogger(__name__)

Deliver = Callable[[StepOutput], None]


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # None: the built-in demo model
    adapter_path: str | None = None
    served_model_name: str | None = None
    completion_batch_size: int = 32
    prefill_batch_size: int = 8
    prefill_step_size: int = 2048
    # A burst that is still arriving while nothing generates is admitted together:
    # wait while new requests keep coming `coalesce_quiet_s` apart, at most `coalesce_max_s`.
    coalesce_quiet_s: float = 0.002
    coalesce_max_s: float = 0.010
    warmup: bool = True
    faults: FaultPlan | None = None  # testing only


class EngineStartupError(RuntimeError):
    """The engine could not load its model or build its generator."""


@dataclass
class _InboxTake:
    requests: list[GenerationRequest]
    aborts: set[int]
    stopping: bool


@dataclass
class _Inbox:
    """The one place the handler threads and the engine thread meet."""

    cond: threading.Condition = field(default_factory=threading.Condition)
    requests: list[GenerationRequest] = field(default_factory=list)
    aborts: set[int] = field(default_factory=set)
    stopping: bool = False

    def put(self, request: GenerationRequest) -> None:
        with self.cond:
            self.requests.append(request)
            self.cond.notify()

    def abort(self, tickets: Iterable[int]) -> None:
        with self.cond:
            self.aborts.update(tickets)
            self.cond.notify()

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify()

    def take(self, *, idle: bool, quiet_s: float, max_s: float, burst_size: int) -> _InboxTake:
        """Everything waiting. When idle, block for work, then let a burst finish arriving."""
        with self.cond:
            if idle:
                while not (self.requests or self.aborts or self.stopping):
                    self.cond.wait()
                deadline = time.monotonic() + max_s
                seen = len(self.requests)
                while 0 < seen < burst_size and not self.stopping:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    self.cond.wait(min(quiet_s, remaining))
                    if len(self.requests) == seen:
                        break
                    seen = len(self.requests)
            taken = _InboxTake(self.requests, self.aborts, self.stopping)
            self.requests, self.aborts = [], set()
            return taken

    def __len__(self) -> int:
        return len(self.requests)


@dataclass(slots=True)
class _Row:
    """A request admitted into the BatchGenerator."""

    request: GenerationRequest
    uid: int
    cached_tokens: int = 0
    generated: int = 0


class Engine:
    """Owns one generation thread; construct, `start()`, then `wait_ready()`."""

    def __init__(self, config: EngineConfig, deliver: Deliver) -> None:
        self.config = config
        self._deliver = deliver
        self._inbox = _Inbox()
        self._thread = threading.Thread(target=self._run, name="mlx-engine", daemon=True)
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._info: ModelInfo | None = None
        # Read by other threads for load reports; written only by the engine thread.
        self._rows: dict[int, _Row] = {}
        self._generator: BatchGenerator | None = None
        self._loaded: LoadedModel | None = None
        self._errors = _ErrorLog()
        self._steps = 0

    # ----- called from any thread -----

    def start(self) -> None:
        self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> ModelInfo:
        if not self._ready.wait(timeout):
            raise EngineStartupError("the engine did not become ready in time")
        if self._startup_error is not None:
            raise EngineStartupError(str(self._startup_error)) from self._startup_error
        assert self._info is not None
        return self._info

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self._startup_error is None and self.alive

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def info(self) -> ModelInfo | None:
        return self._info

    @property
    def codec(self) -> TextCodec:
        """The model's tokenizer for text work off the engine thread (after `wait_ready`)."""
        assert self._loaded is not None
        return TextCodec(self._loaded.tokenizer._tokenizer)

    def submit(self, request: GenerationRequest) -> None:
        self._inbox.put(request)

    def abort(self, tickets: Iterable[int]) -> None:
        self._inbox.abort(tickets)

    def load(self) -> EngineLoad:
        rows = list(self._rows.values())
        running = sum(1 for row in rows if row.generated)
        return EngineLoad(waiting=len(self._inbox) + len(rows) - running, running=running)

    def shutdown(self, timeout: float | None = None) -> None:
        """End every request with `abort`, release MLX objects and join the thread."""
        self._inbox.stop()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # ----- the engine thread -----

    def _run(self) -> None:
        self._stream = mx.new_stream(mx.default_device())
        with mx.stream(self._stream):
            try:
                self._loaded = self._load()
                self._sampling = self._sampling_factory(self._loaded)
                self._generator = self._new_generator()
                if self.config.warmup:
                    self._warm_up()
            except BaseException as exc:
                log.error("engine startup failed: %s", exc)
                self._startup_error = exc
                self._ready.set()
                return
            self._info = self._loaded.info
            self._ready.set()
            try:
                self._loop()
            except BaseException as exc:
                log.exception("engine thread died")
                self._deliver_fatal(f"engine thread died: {exc}")
            finally:
                if self._generator is not None:
                    self._generator.close()
                self._generator = None

    def _load(self) -> LoadedModel:
        model = self.config.model
        served = self.config.served_model_name
        if model is None:
            from ..demo_model import DEMO_MODEL_KIND, demo_model_path

            model = str(demo_model_path(DEMO_MODEL_KIND))
            served = served or f"mlx-grpc-worker-demo-{DEMO_MODEL_KIND}"
        return load_model(model, self.config.adapter_path, served)

    @staticmethod
    def _sampling_factory(loaded: LoadedModel) -> SamplingFactory:
        tokenizer, info = loaded.tokenizer, loaded.info
        eos = info.eos_token_ids[0] if info.eos_token_ids else 0
        return SamplingFactory(
            info.vocab_size,
            GrammarFactory(tokenizer._tokenizer, info.vocab_size, eos),
            think_start=tokenizer.think_start_tokens,
            think_end=tokenizer.think_end_tokens,
        )

    def _new_generator(self) -> BatchGenerator:
        assert self._loaded is not None
        return BatchGenerator(
            self._loaded.model,
            completion_batch_size=self.config.completion_batch_size,
            prefill_batch_size=self.config.prefill_batch_size,
            prefill_step_size=self.config.prefill_step_size,
            stream=self._stream,
        )

    def _warm_up(self) -> None:
        """One short request through the whole path, so the first real one pays no JIT."""
        assert self._generator is not None and self._loaded is not None
        prompt = [self._loaded.info.bos_token_id or 0] * 4
        (uid,) = self._generator.insert([prompt], max_tokens=[2])
        for _ in range(16):
            _, responses = self._generator.next()
            if any(r.uid == uid and r.finish_reason for r in responses):
                return
        self._generator.remove([uid])

    def _loop(self) -> None:
        while True:
            take = self._inbox.take(
                idle=not self._rows,
                quiet_s=self.config.coalesce_quiet_s,
                max_s=self.config.coalesce_max_s,
                burst_size=self.config.prefill_batch_size,
            )
            out = StepOutput()
            if take.stopping:
                self._end_all(take.requests, out)
                self._send(out)
                return
            started = time.perf_counter()
            try:
                self._apply_aborts(take, out)
                self._admit(take.requests, out)
                if self._rows:
                    self._step(out)
                    out.step_seconds = time.perf_counter() - started
            except Exception as exc:
                self._recover(exc, out)
            self._send(out)

    def _send(self, out: StepOutput) -> None:
        if out:
            self._deliver(out)

    def _apply_aborts(self, take: _InboxTake, out: StepOutput) -> None:
        if not take.aborts:
            return
        kept = []
        for request in take.requests:
            if request.ticket in take.aborts:
                out.events.append(RowEvent(request.ticket, None, FINISH_ABORT))
            else:
                kept.append(request)
        take.requests[:] = kept
        removed = [row for row in self._rows.values() if row.request.ticket in take.aborts]
        if removed:
            assert self._generator is not None
            self._generator.remove([row.uid for row in removed])
            for row in removed:
                del self._rows[row.uid]
                out.events.append(RowEvent(row.request.ticket, None, FINISH_ABORT))

    def _admit(self, requests: list[GenerationRequest], out: StepOutput) -> None:
        if not requests:
            return
        assert self._generator is not None
        sampling = self._sampling
        try:
            uids = self._generator.insert(
                [r.prompt for r in requests],
                max_tokens=[r.max_tokens for r in requests],
                samplers=[sampling.sampler(r.sampling) for r in requests],
                logits_processors=[sampling.processors(r) for r in requests],
                stop_sequences=[sampling.stop_sequences(r.stop_token_ids) for r in requests],
            )
        except Exception as exc:  # validation upstream should make this unreachable
            log.exception("could not admit %d requests", len(requests))
            out.failures.extend(
                RowFailure(r.ticket, FailureKind.INTERNAL, f"could not admit request: {exc}")
                for r in requests
            )
            return
        for uid, request in zip(uids, requests, strict=True):
            self._rows[uid] = _Row(request=request, uid=uid)

    def _step(self, out: StepOutput) -> None:
        assert self._generator is not None
        self._steps += 1
        if self.config.faults is not None:
            self.config.faults.before_step(self._steps)
        _, responses = self._generator.next()
        rows = self._rows
        wants_logprobs = []
        for response in responses:
            row = rows.get(response.uid)
            if row is None:  # removed earlier in this step
                continue
            row.generated += 1
            finish = response.finish_reason
            event = RowEvent(
                row.request.ticket,
                response.token,
                finish,
                response.token if finish == FINISH_STOP else None,
                None,
                row.cached_tokens,
            )
            out.events.append(event)
            if row.request.top_logprobs is not None:
                wants_logprobs.append((event, response.logprobs, row.request.top_logprobs))
            if finish is not None:
                del rows[response.uid]
        if wants_logprobs:
            self._attach_logprobs(wants_logprobs)

    @staticmethod
    def _attach_logprobs(wanted: list[tuple[RowEvent, Any, int]]) -> None:
        results = gather_logprobs(
            [event.token for event, _, _ in wanted],  # type: ignore[misc]
            [logprobs for _, logprobs, _ in wanted],
            [n for _, _, n in wanted],
        )
        for (event, _, _), result in zip(wanted, results, strict=True):
            event.logprob = result

    def _recover(self, exc: Exception, out: StepOutput) -> None:
        """A failed step fails the requests in the batch; a fresh generator serves the rest."""
        self._errors.report(exc, len(self._rows))
        message = f"engine step failed: {type(exc).__name__}: {exc}"
        failed = {row.request.ticket for row in self._rows.values()}
        # Events already produced this step are void: those requests end with the error.
        out.events[:] = [e for e in out.events if e.ticket not in failed]
        out.failures.extend(RowFailure(t, FailureKind.INTERNAL, message) for t in failed)
        self._rows.clear()
        if self._generator is not None:
            self._generator.close()
        self._generator = self._new_generator()

    def _end_all(self, pending: list[GenerationRequest], out: StepOutput) -> None:
        tickets = [r.ticket for r in pending] + [row.request.ticket for row in self._rows.values()]
        out.events.extend(RowEvent(ticket, None, FINISH_ABORT) for ticket in tickets)
        self._rows.clear()

    def _deliver_fatal(self, reason: str) -> None:
        try:
            self._deliver(StepOutput(fatal=reason))
        except Exception:
            log.exception("could not report the engine's death")


class _ErrorLog:
    """Logs step failures with a traceback at most once per interval, counting the rest."""

    def __init__(self, interval_s: float = 10.0) -> None:
        self._interval_s = interval_s
        self._last = float("-inf")
        self._suppressed = 0

    def report(self, exc: Exception, failed: int) -> None:
        now = time.monotonic()
        if now - self._last < self._interval_s:
            self._suppressed += 1
            return
        log.error(
            "engine step failed (%d requests failed; %d similar errors since the last report)",
            failed,
            self._suppressed,
            exc_info=exc,
        )
        self._last = now
        self._suppressed = 0
