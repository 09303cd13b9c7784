"""The engine: one thread that owns every MLX object and steps a BatchGenerator.

Handlers talk to it only through `submit`, `abort` and the `deliver` callback: requests
go into the inbox, and each step hands every row's events back in one `StepOutput`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator

from ..faults import FaultPlan
from ..messages import (
    FINISH_ABORT,
    FINISH_STOP,
    Admission,
    EngineLoad,
    FailureKind,
    GenerationRequest,
    ModelInfo,
    RowEvent,
    RowFailure,
    StepOutput,
)
from .constraints import GrammarFactory, GrammarProcessor
from .lockstep import Lockstep, LockstepBroken
from .memory import device_memory_bytes, measure, weights_bytes
from .model import LoadedModel, load_model, log_blas_hint
from .prefix_cache import PrefixCache
from .sampling import SamplingFactory, gather_logprobs

log = logging.getLogger(__name__)

Deliver = Callable[[StepOutput], None]


@dataclass(frozen=True)
class EngineConfig:
    adapter_path: str | None = None
    completion_batch_size: int = 32
    prefill_batch_size: int = 8
    prefill_step_size: int = 2048
    # A burst that is still arriving while nothing generates is admitted together:
    # wait while new requests keep coming `coalesce_quiet_s` apart, at most `coalesce_max_s`.
    coalesce_quiet_s: float = 0.002
    coalesce_max_s: float = 0.010
    warmup: bool = True
    # Prompt-prefix reuse: entries kept, and their bytes (None: a quarter of max_kv_memory,
    # at most 1 GiB). 0 entries turns it off.
    prompt_cache_size: int = 64
    prompt_cache_bytes: int | None = None
    # KV and recurrent state the running requests may reserve (None: half the device's
    # memory less the weights). A request that cannot fit alone is refused; one that cannot
    # fit beside the others waits.
    max_kv_memory: int | None = None
    # One model over several processes: rank 0 plans every step and shares the plan.
    lockstep: Lockstep | None = None
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

    def take(
        self,
        *,
        idle: bool,
        quiet_s: float,
        max_s: float,
        burst_size: int,
        timeout_s: float | None = None,
    ) -> _InboxTake:
        """Everything waiting. When idle, block for work (at most `timeout_s`), then let a
        burst finish arriving."""
        with self.cond:
            if idle:
                deadline = None if timeout_s is None else time.monotonic() + timeout_s
                while not (self.requests or self.aborts or self.stopping):
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        break
                    self.cond.wait(remaining)
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
    reserved: int  # bytes of cache state set aside for it
    cached_tokens: int = 0
    generated: int = 0
    unsent: int = 0  # tokens held back from the handlers (see `tokens_per_handoff`)
    prefilled: bool = False  # its prompt is in; its first token comes with the next step
    grammar: GrammarProcessor | None = None  # its structured-output processor, if any


@dataclass(frozen=True, slots=True)
class _Admit:
    request: GenerationRequest
    reserved: int  # bytes of cache state set aside for it
    cached_tokens: int  # prompt tokens covered by a reused prefix


@dataclass(slots=True)
class _Plan:
    """The next step's changes to the batch, decided on rank 0 and applied by every rank."""

    aborts: list[int] = field(default_factory=list)  # tickets of admitted rows to remove
    admits: list[_Admit] = field(default_factory=list)
    stop: bool = False
    check: int = 0  # what the previous step produced, so the ranks can compare notes


class Engine:
    """Owns one generation thread; construct, `start()`, then `wait_ready()`."""

    def __init__(self, config: EngineConfig, deliver: Deliver) -> None:
        """Nothing starts until `start(info)` names the model's (resolved) files."""
        self.config = config
        self._deliver = deliver
        self._inbox = _Inbox()
        self._thread = threading.Thread(target=self._run, name="mlx-engine", daemon=True)
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._info: ModelInfo | None = None
        # Read by other threads for load reports; written only by the engine thread.
        self._rows: dict[int, _Row] = {}
        self._deferred: deque[GenerationRequest] = deque()  # waiting for memory to free up
        self._reserved = 0
        self._prefix: PrefixCache | None = None
        self._admission: Admission | None = None
        self._generator: BatchGenerator | None = None
        self._loaded: LoadedModel | None = None
        self._errors = _ErrorLog()
        self._steps = 0
        self._lockstep = config.lockstep
        self._leads = self._lockstep is None or self._lockstep.leads
        self._fetched: dict[int, list[Any] | None] = {}  # prefixes rank 0 found while planning
        self._check = 0
        self._held: StepOutput | None = None  # steps' output no handler needs yet
        self._due = False  # some row reached its `tokens_per_handoff`
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
    def started(self) -> bool:
        return self._thread.ident is not None

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def info(self) -> ModelInfo | None:
        return self._info

    @property
    def admission(self) -> Admission:
        """The cache-memory model and limit (after `wait_ready`)."""
        assert self._admission is not None
        return self._admission

    @property
    def prefix_cache(self) -> PrefixCache | None:
        return self._prefix

    @property
    def grammar_check(self) -> Callable[[str], str | None]:
        """Checks a grammar against the model's vocabulary (any thread, after `wait_ready`)."""
        assert self._sampling is not None
        return self._sampling.check_grammar

    @property
    def has_thinking(self) -> bool:
        """The tokenizer marks a reasoning section (after `wait_ready`)."""
        assert self._loaded is not None
        tokenizer = self._loaded.tokenizer
        return bool(tokenizer.think_start_tokens and tokenizer.think_end_tokens)

    def submit(self, request: GenerationRequest) -> None:
        self._inbox.put(request)

    def abort(self, tickets: Iterable[int]) -> None:
        self._inbox.abort(tickets)

    def load(self) -> EngineLoad:
        rows = list(self._rows.values())
        running = sum(1 for row in rows if row.generated)
        waiting = len(self._inbox) + len(self._deferred) + len(rows) - running
        return EngineLoad(waiting=waiting, running=running)

    def shutdown(self, timeout: float | None = None) -> None:
        """End every request with `abort`, release MLX objects and join the thread."""
        self._inbox.stop()
        self.join(timeout)

    def join(self, timeout: float | None = None) -> None:
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # ----- the engine thread -----

    def _run(self) -> None:
        self._stream = mx.new_stream(mx.default_device())
        with mx.stream(self._stream):
            try:
                self._loaded = self._load()
                if self._lockstep is not None:
                    self._lockstep.sync_seed()
                self._sampling = self._sampling_factory(self._loaded)
                self._admission = self._admission_limits(self._loaded)
                self._prefix = self._new_prefix_cache(self._admission)
                self._generator = self._new_generator()
                if self.config.warmup:
                    self._warm_up()
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
                self._deliver_fatal(self.failure)
            finally:
                if self._generator is not None:
                    self._generator.close()
                self._generator = None

    def _load(self) -> LoadedModel:
        assert self._info is not None
        group = self._lockstep.group if self._lockstep is not None else None
        log_blas_hint()
        if self.config.faults is not None:
            self.config.faults.before_load()
        return load_model(Path(self._info.model_dir), self.config.adapter_path, group)

    def _sampling_factory(self, loaded: LoadedModel) -> SamplingFactory:
        tokenizer, info = loaded.tokenizer, self._info
        assert info is not None
        eos = info.eos_token_ids[0] if info.eos_token_ids else 0
        return SamplingFactory(
            info.vocab_size,
            GrammarFactory(tokenizer._tokenizer, info.vocab_size, eos),
            think_start=tokenizer.think_start_tokens,
            think_end=tokenizer.think_end_tokens,
        )

    def _admission_limits(self, loaded: LoadedModel) -> Admission:
        limit = self.config.max_kv_memory
        if limit is None:
            limit = max(device_memory_bytes() // 2 - weights_bytes(loaded.model), 64 << 20)
        return Admission(measure(loaded.model), limit)

    def _new_prefix_cache(self, admission: Admission) -> PrefixCache | None:
        if self.config.prompt_cache_size <= 0:
            return None
        max_bytes = self.config.prompt_cache_bytes
        if max_bytes is None:
            # Ranks must evict alike, so a distributed engine does not size it per machine.
            shared = self._lockstep is not None
            max_bytes = 1 << 30 if shared else min(admission.limit_bytes // 4, 1 << 30)
        return PrefixCache(self.config.prompt_cache_size, max_bytes)

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
        assert self._info is not None
        prompt = [self._info.bos_token_id or 0] * 4
        (uid,) = self._generator.insert([prompt], max_tokens=[2])
        for _ in range(16):
            _, responses = self._generator.next()
            if any(r.uid == uid and r.finish_reason for r in responses):
                return
        self._generator.remove([uid])

    def _loop(self) -> None:
        lockstep = self._lockstep
        while True:
            out = StepOutput()
            plan = self._plan(out) if self._leads else None
            if lockstep is not None:
                plan = lockstep.share(plan)
                if plan.check != self._check:
                    raise LockstepBroken(f"the ranks disagree on the last step ({plan.check})")
            assert plan is not None
            if plan.stop:
                self._end_all(out)
                self._send(out)
                return
            started = time.perf_counter()
            try:
                self._apply(plan, out)
                if self._rows:
                    self._step(out)
                    out.step_seconds.append(time.perf_counter() - started)
            except Exception as exc:
                if lockstep is not None:
                    raise  # the ranks may no longer hold the same batch: nothing to recover
                self._recover(exc, plan, out)
            if lockstep is not None:
                lockstep.progress()
            self._send(out)

    def _send(self, out: StepOutput) -> None:
        """Hand the output to the loop once a handler needs it: a row's first token, enough
        tokens for a row's `tokens_per_handoff`, a finish or a failure. Until then it waits
        here, so a request that takes its tokens several at a time costs no loop wake for
        the steps in between."""
        if self._held is not None:
            self._held.merge(out)
            out = self._held
        if not out:
            return
        due = self._due or out.failures or out.fatal
        if not due and not any(event.finish_reason is not None for event in out.events):
            self._held = out
            return
        for row in self._rows.values():
            row.unsent = 0
        self._held, self._due = None, False
        self._deliver(out)

    def _plan(self, out: StepOutput) -> _Plan:
        """Rank 0's decisions: aborts, and which waiting requests fit in memory now."""
        lockstep = self._lockstep
        take = self._inbox.take(
            idle=not self._rows and not self._deferred,
            quiet_s=self.config.coalesce_quiet_s,
            max_s=self.config.coalesce_max_s,
            burst_size=self.config.prefill_batch_size,
            timeout_s=lockstep.heartbeat_s if lockstep is not None else None,
        )
        plan = _Plan(stop=take.stopping, check=self._check)
        if take.aborts:  # requests not admitted yet end here; admitted rows end on every rank
            for waiting in (take.requests, self._deferred):
                for request in [r for r in waiting if r.ticket in take.aborts]:
                    waiting.remove(request)
                    out.events.append(RowEvent(request.ticket, None, FINISH_ABORT))
            running = {row.request.ticket for row in self._rows.values()}
            plan.aborts = sorted(take.aborts & running)
        self._deferred.extend(take.requests)
        admission = self._admission
        assert admission is not None
        reserved = self._reserved
        # mlx-lm returns a step's tokens only after that step's prefill work: a new prompt
        # admitted now would hold back the first token of one that just finished its prefill.
        first_tokens_due = any(row.prefilled and not row.generated for row in self._rows.values())
        while self._deferred and not plan.stop and not first_tokens_due:
            request = self._deferred[0]
            need = admission.estimate(request)
            busy = self._rows or plan.admits
            if busy and reserved + need > admission.limit_bytes:
                break  # it waits for running requests to finish
            self._deferred.popleft()
            reserved += need
            cache, cached = self._lookup(request.prompt)
            self._fetched[request.ticket] = cache
            plan.admits.append(_Admit(request, need, cached))
        return plan

    def _apply(self, plan: _Plan, out: StepOutput) -> None:
        """Remove aborted rows and insert admitted requests: the same on every rank."""
        assert self._generator is not None
        if plan.aborts:
            aborted = set(plan.aborts)
            removed = [row for row in self._rows.values() if row.request.ticket in aborted]
            self._generator.remove([row.uid for row in removed])
            for row in removed:
                self._drop(row)
                out.events.append(RowEvent(row.request.ticket, None, FINISH_ABORT))
        if not plan.admits:
            return
        caches = []
        for admit in plan.admits:
            if self._leads:
                cache = self._fetched.pop(admit.request.ticket)
            else:
                cache, cached = self._lookup(admit.request.prompt)
                if cached != admit.cached_tokens:
                    raise LockstepBroken("the ranks' prefix caches disagree")
            caches.append(cache)
        requests = [admit.request for admit in plan.admits]
        sampling = self._sampling
        chains = [sampling.processors(r) for r in requests]
        uids = self._generator.insert(
            [a.request.prompt[a.cached_tokens :] for a in plan.admits],
            max_tokens=[r.max_tokens for r in requests],
            caches=caches,
            all_tokens=[a.request.prompt[: a.cached_tokens] for a in plan.admits],
            samplers=[sampling.sampler(r.sampling) for r in requests],
            logits_processors=chains,
            stop_sequences=[sampling.stop_sequences(r.stop_token_ids) for r in requests],
        )
        for uid, admit, chain in zip(uids, plan.admits, chains, strict=True):
            row = _Row(admit.request, uid, admit.reserved, admit.cached_tokens)
            row.grammar = next((p for p in chain if isinstance(p, GrammarProcessor)), None)
            self._rows[uid] = row
            self._reserved += admit.reserved

    def _drop(self, row: _Row) -> None:
        del self._rows[row.uid]
        self._reserved -= row.reserved

    def _lookup(self, prompt: list[int]) -> tuple[list[Any] | None, int]:
        if self._prefix is None:
            return None, 0
        return self._prefix.lookup(prompt)

    def _step(self, out: StepOutput) -> None:
        assert self._generator is not None
        self._steps += 1
        if self.config.faults is not None:
            self.config.faults.before_step(self._steps)
        prompt_progress, responses = self._generator.next()
        for progress in prompt_progress:
            if progress.end_of_prompt and (row := self._rows.get(progress.uid)) is not None:
                row.prefilled = True
        if self._prefix is not None:
            self._snapshot_prefills(prompt_progress)
        rows = self._rows
        wants_logprobs = []
        broken = []  # rows whose grammar failed and that are still in the batch
        for response in responses:
            row = rows.get(response.uid)
            if row is None:  # removed earlier in this step
                continue
            row.generated += 1
            finish = response.finish_reason
            if row.grammar is not None and row.grammar.error is not None:
                message = f"the request's grammar failed while generating: {row.grammar.error}"
                out.failures.append(
                    RowFailure(row.request.ticket, FailureKind.INVALID_ARGUMENT, message)
                )
                if finish is None:
                    broken.append(row.uid)
                self._drop(row)
                continue
            event = RowEvent(
                row.request.ticket,
                response.token,
                finish,
                response.token if finish == FINISH_STOP else None,
                None,
                row.cached_tokens,
            )
            out.events.append(event)
            row.unsent += 1
            if row.generated == 1 or row.unsent >= row.request.tokens_per_handoff:
                self._due = True
            if row.request.top_logprobs is not None and self._leads:
                wants_logprobs.append((event, response.logprobs, row.request.top_logprobs))
            if finish is not None:
                self._drop(row)
                if self._prefix is not None and response.prompt_cache is not None:
                    self._prefix.store(response.all_tokens, response.prompt_cache)
        if broken:
            self._generator.remove(broken)
        if wants_logprobs:
            self._attach_logprobs(wants_logprobs)
        if self._lockstep is not None:
            self._check = (self._check + sum(e.token or 0 for e in out.events)) % (1 << 31)

    def _snapshot_prefills(self, progress: list[Any]) -> None:
        """Keep the state of prompts whose prefill just reached their last token."""
        assert self._generator is not None and self._prefix is not None
        done = [p.uid for p in progress if p.end_of_segment and not p.end_of_prompt]
        if done:
            for cache, tokens in self._generator.extract_cache(done).values():
                self._prefix.store(tokens, cache)

    @staticmethod
    def _attach_logprobs(wanted: list[tuple[RowEvent, Any, int]]) -> None:
        results = gather_logprobs(
            [event.token for event, _, _ in wanted],  # type: ignore[misc]
            [logprobs for _, logprobs, _ in wanted],
            [n for _, _, n in wanted],
        )
        for (event, _, _), result in zip(wanted, results, strict=True):
            event.logprob = result

    def _recover(self, exc: Exception, plan: _Plan, out: StepOutput) -> None:
        """A failed step fails the requests in the batch; a fresh generator serves the rest."""
        failed = {row.request.ticket for row in self._rows.values()}
        failed.update(admit.request.ticket for admit in plan.admits)
        self._errors.report(exc, len(failed))
        message = f"engine step failed: {type(exc).__name__}: {exc}"
        # Events already produced this step are void: those requests end with the error.
        out.events[:] = [e for e in out.events if e.ticket not in failed]
        out.failures.extend(RowFailure(t, FailureKind.INTERNAL, message) for t in sorted(failed))
        self._rows.clear()
        self._reserved = 0
        if self._generator is not None:
            self._generator.close()
        self._generator = self._new_generator()

    def _end_all(self, out: StepOutput) -> None:
        tickets = [r.ticket for r in self._deferred] + [
            row.request.ticket for row in self._rows.values()
        ]
        out.events.extend(RowEvent(ticket, None, FINISH_ABORT) for ticket in tickets)
        self._rows.clear()
        self._deferred.clear()
        self._reserved = 0

    def _deliver_fatal(self, reason: str) -> None:
        try:
            self._deliver(StepOutput(fatal=reason))
        except Exception:
            log.exception("could not report the engine's death")

    def _on_stall(self, reason: str) -> None:
        """The watchdog's last words (from its thread): tell the handlers, give them a moment."""
        self.failure = reason
        self._deliver_fatal(reason)
        time.sleep(1.0)


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
