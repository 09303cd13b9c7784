"""The batch runner and the requests in it: a plan's removals and inserts, one step, and the
events each row produced (engine thread only)."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..faults import FaultPlan
from ..messages import (
    FINISH_ABORT,
    FINISH_STOP,
    FailureKind,
    GenerationRequest,
    RowEvent,
    RowFailure,
    StepOutput,
)
from ..ratelimit import RateLimitedLog
from ..text import TextTracker
from .adapters import AdapterSet
from .constraints import GrammarProcessor
from .parts import EngineParts
from .prefill import PrefillSample, StepCost
from .prefix.store import Hit
from .row_inputs import RowInputs
from .rows import Row, RowBook
from .runner import BatchRunner
from .sampling import gather_logprobs
from .scheduler import Admit, BatchView, Plan
from .vision import ImageWork


@dataclass(frozen=True, slots=True)
class StepReport:
    """What one step did besides its events."""

    due: bool  # some handler needs the output now
    prefill: PrefillSample | None  # the step's prefill, measured, if it had any
    prefill_tokens: int = 0  # prompt tokens it put through the model
    fused: bool = False  # its prefill chunk rode in the decoding rows' forward
    catch_up: tuple[int, float] = (0, 0.0)  # a draft model's catch-up: tokens, seconds


log = logging.getLogger(__name__)


class Batch:
    """Rows by uid, and the runner that steps them. Each row holds its admission (the
    memory it reserved, which `view` sums) and its prefix pins until it leaves."""

    def __init__(
        self,
        new_runner: Callable[[], BatchRunner],
        parts: EngineParts,
        faults: FaultPlan | None = None,
        wants_logprobs: bool = True,
        cost: StepCost | None = None,
    ) -> None:
        """`parts`: the model's sampling, prefix store, a request's empty caches (`new_row`:
        quantized ones with --kv-bits; None: the runner makes mlx-lm's), its vision encoder
        and the LoRA adapters requests name (by name)."""
        self._new_row = parts.new_row
        self._adapters = parts.adapters
        self._images = ImageWork(parts.vision)  # a vision model's images, encoded as rows join
        self._new_runner = new_runner
        self._runner = new_runner()
        self._sampling = parts.sampling
        self._prefix = parts.prefix
        self._faults = faults
        self._wants_logprobs = wants_logprobs  # only rank 0 sends them anywhere
        self._errors = RateLimitedLog(log, 10.0)
        self._book = RowBook()
        self.rows = self._book.rows  # the same dict, by uid
        self._chunk: int | None = None  # prompt tokens a row the next step prefills
        self._catch_up: int | None = None  # a draft model's catch-up tokens the next step
        self.cost = cost or StepCost()  # the decode steps' part is learned here
        self.steps = 0
        self.check = 0  # a running sum of the tokens produced, for lockstep comparison
        self.generated = 0  # tokens produced since the batch began (the load figures)

    @property
    def runner(self) -> BatchRunner:
        return self._runner

    @property
    def decode_step_s(self) -> float:
        """How long the next step takes without prefill, for the rows decoding now."""
        return self.cost.decode.seconds(max(self._book.decoding, 1))

    def view(self) -> BatchView:
        return self._book.view(self.decode_step_s)

    # ----- what the rows' bookkeeping says (the figures, the planner, the hand-off) -----

    @property
    def starting(self) -> int:
        return self._book.starting

    @property
    def admitted_prompt(self) -> int:
        return self._book.admitted_prompt

    def tickets(self) -> set[int]:
        return self._book.tickets()

    def handed_over(self) -> None:
        self._book.handed_over()

    def set_plan(self, plan: Plan) -> None:
        """The next step's work: prompt tokens a row, a draft model's catch-up."""
        self._chunk, self._catch_up = plan.chunk, plan.catch_up_tokens

    # ----- applying a plan -----

    def remove(self, tickets: list[int], out: StepOutput) -> None:
        aborted = set(tickets)
        removed = [row for row in self.rows.values() if row.ticket in aborted]
        self._runner.remove([row.uid for row in removed])
        for row in removed:
            self._book.drop(row)
            out.events.append(RowEvent(row.ticket, None, FINISH_ABORT))

    def insert(self, admits: list[Admit], hits: list[Hit | None], out: StepOutput) -> None:
        """Admitted requests into the runner, with their reused prefixes (whose pins their
        rows take over). A request whose own parts cannot be built fails alone."""
        parts = []
        for admit, hit in zip(admits, hits, strict=True):
            try:
                parts.append(self._prepare(admit, hit))
            except Exception as exc:
                out.failures.append(_unprepared(admit.request.ticket, exc))
                if hit is not None:
                    hit.release()
        if not parts:
            return
        sampling = self._sampling
        requests = [part.admit.request for part in parts]
        try:
            uids = self._runner.insert_segments(
                [part.segments for part in parts],
                max_tokens=[r.max_tokens for r in requests],
                caches=[_cache_for(part.hit, self._new_row) for part in parts],
                all_tokens=[p.admit.request.prompt[: p.admit.cached_tokens] for p in parts],
                samplers=[sampling.sampler(r.sampling) for r in requests],
                logits_processors=[part.chain for part in parts],
                stop_sequences=[sampling.stop_sequences(r.stop_token_ids) for r in requests],
                inputs=[part.inputs for part in parts],
            )
        except BaseException:
            for part in parts:
                if part.hit is not None:
                    part.hit.release()
            raise
        for uid, part in zip(uids, parts, strict=True):
            admit = part.admit
            grammar = next((p for p in part.chain if isinstance(p, GrammarProcessor)), None)
            left = len(admit.request.prompt) - admit.cached_tokens
            pins = part.hit.pins if part.hit is not None else None
            row = Row(admit, uid, left, admit.cached_tokens, grammar=grammar, pins=pins)
            row.text = sampling.stop_text(admit.request)
            self._book.add(row)

    def _prepare(self, admit: Admit, hit: Hit | None) -> _Prepared:
        request, cached = admit.request, admit.cached_tokens
        adapter = adapter_index(self._adapters, request.adapter)
        chain = self._sampling.processors(request)
        segments = self._segments(request, cached)
        images, rope = self._images.spans(request, cached), self._images.rope(request)
        return _Prepared(admit, hit, chain, segments, RowInputs(adapter, rope, images))

    def _segments(self, request: GenerationRequest, cached: int) -> list[list[int]]:
        """The prompt past its reused prefix, cut where the prefix store wants a snapshot."""
        prompt = request.prompt
        points = self._prefix.snapshot_points(request, cached)
        cuts = [cached, *points, len(prompt)]
        return [prompt[a:b] for a, b in itertools.pairwise(cuts) if b > a]

    # ----- stepping -----

    def step(self, out: StepOutput) -> StepReport:
        """One runner step; its events go to `out`. A step with prefill work (a chunk, or
        the first tokens of prompts that are through) reports what that work added to it."""
        self.steps += 1
        if self._faults is not None:
            self._faults.before_step(self.steps)
        decoding = self._book.decoding
        started = time.perf_counter()
        runner = self._runner
        if not self._book.prefilling:
            prompt_progress, responses = runner.next(self._chunk, self._catch_up)
            catch_up = runner.caught_up
            self.cost.decode.observe(decoding, time.perf_counter() - started - catch_up[1])
            self._track_prefill(prompt_progress)
            events = self._collect(responses, out)
            return StepReport(events, None, catch_up=catch_up)
        fused_before, prompt_before = runner.fused_steps, runner.prompt_tokens
        prompt_progress, responses = runner.next(self._chunk, self._catch_up)
        fused = runner.fused_steps > fused_before
        prompt_tokens = runner.prompt_tokens - prompt_before
        # What the prefill added: the step less a decode step, or all of it with none.
        decode_s = self.cost.decode.seconds(decoding) if decoding else 0.0
        added = time.perf_counter() - started - decode_s
        self._track_prefill(prompt_progress)
        work = runner.prefilled
        sample = work.took(max(added, 0.0)) if work.any else None
        events = self._collect(responses, out)
        return StepReport(events, sample, prompt_tokens, fused)

    def _track_prefill(self, prompt_progress: list[Any]) -> None:
        self._book.track_prefill(prompt_progress)
        self._snapshot_prefills(prompt_progress)

    def _collect(self, responses: list[Any], out: StepOutput) -> bool:
        """The step's tokens as events in `out`; True when some handler needs them now."""
        due, broken, wanted = False, [], []
        rows, events, first_due = self.rows, out.events, self._book.first_due
        logprobs_wanted = self._wants_logprobs
        now = time.perf_counter()
        horizon = now + self.decode_step_s  # the end of the next step
        check, produced = self.check, 0
        for response in responses:
            row = rows.get(response.uid)
            if row is None:  # removed earlier in this step
                continue
            row.generated += 1
            if row.grammar is not None and row.grammar.error is not None:
                self._fail_grammar(row, out)
                if response.finish_reason is None:
                    broken.append(row.uid)  # still in the batch
                continue
            if row.generated == 1:
                first_due.discard(row.uid)
            token, finish = response.token, response.finish_reason
            stop_token = token if finish == FINISH_STOP else None
            if row.text is not None and _stop_string(row.text, token):
                if finish is None:  # it leaves here, its cache not kept (as an abort's)
                    broken.append(row.uid)
                    self._book.drop(row)
                finish, stop_token = FINISH_STOP, None
            event = RowEvent(row.ticket, token, finish, stop_token, None, row.admit.cached_tokens)
            events.append(event)
            check += token
            produced += 1
            row.produced(now)
            due = due or row.handoff_due(finish is not None, horizon)
            top = row.admit.request.top_logprobs
            if top is not None and logprobs_wanted:
                wanted.append((event, response.logprobs, top))
            if finish is not None and row.uid in rows:
                self._finish(row, response)
        if broken:
            self._runner.remove(broken)
        if wanted:
            _attach_logprobs(wanted)
        self.check = check % (1 << 31)
        self.generated += produced
        return due

    def _fail_grammar(self, row: Row, out: StepOutput) -> None:
        assert row.grammar is not None
        message = f"the request's grammar failed while generating: {row.grammar.error}"
        out.failures.append(RowFailure(row.ticket, FailureKind.INVALID_ARGUMENT, message))
        self._book.drop(row)

    def _finish(self, row: Row, response: Any) -> None:
        self._book.drop(row)
        if response.prompt_cache is not None:
            tokens = store_tokens(row, response.all_tokens)
            self._prefix.keep_later(tokens, response.prompt_cache, snapshot=True)

    def _snapshot_prefills(self, progress: list[Any]) -> None:
        """Keep the blocks of prompts whose prefill reached a snapshot point or their last token."""
        done = [p.uid for p in progress if p.end_of_segment and not p.end_of_prompt]
        if done:
            for uid, (cache, tokens) in self._runner.extract_cache(done).items():
                tokens = store_tokens(self.rows[uid], tokens)
                self._prefix.keep_later(tokens, cache, snapshot=True)

    # ----- failures and the end -----

    def recover(self, exc: Exception, plan: Plan, out: StepOutput) -> None:
        """A failed step fails the requests in the batch; a fresh runner serves the rest."""
        already = {failure.ticket for failure in out.failures}
        failed = (self._book.tickets() | {admit.request.ticket for admit in plan.admits}) - already
        self._errors.error(
            "step", "engine step failed (%d requests failed)", len(failed), exc_info=exc
        )
        message = f"engine step failed: {type(exc).__name__}: {exc}"
        # Events already produced this step are void: those requests end with the error.
        out.events[:] = [e for e in out.events if e.ticket not in failed]
        out.failures.extend(RowFailure(t, FailureKind.INTERNAL, message) for t in sorted(failed))
        for row in list(self.rows.values()):
            self._book.drop(row)
        self._runner.close()
        self._runner = self._new_runner()

    def end_all(self, out: StepOutput) -> None:
        """Every row ends with `abort` (shutdown)."""
        for row in list(self.rows.values()):
            self._book.drop(row)
            out.events.append(RowEvent(row.ticket, None, FINISH_ABORT))

    def close(self) -> None:
        self._runner.close()


def _attach_logprobs(wanted: list[tuple[RowEvent, Any, int]]) -> None:
    events, logprobs, top = zip(*wanted, strict=True)
    results = gather_logprobs([e.token for e in events], logprobs, top)  # type: ignore[misc]
    for event, result in zip(events, results, strict=True):
        event.logprob = result


def _stop_string(text: TextTracker, token: int) -> bool:
    """Whether `token` completes one of the row's stop strings."""
    text.add((token,))
    return text.matched is not None


@dataclass(slots=True)
class _Prepared:
    """An admitted request's parts, built before it joins the runner."""

    admit: Admit
    hit: Hit | None
    chain: list[Any]
    segments: list[list[int]]
    inputs: RowInputs  # beside its tokens: images, multimodal RoPE, LoRA adapter


def _cache_for(hit: Hit | None, new_row: Callable[[], list[Any]] | None) -> list[Any] | None:
    """A joining request's caches: its reused prefix's, or empty ones (None: the runner
    makes mlx-lm's)."""
    if hit is not None:
        return hit.cache
    return new_row() if new_row is not None else None


class UnknownAdapter(ValueError):
    """A request names an adapter this engine does not serve."""


def adapter_index(adapters: AdapterSet | None, name: str) -> int:
    """The row index of the adapter a request names ("": the base model, 0)."""
    if not name:
        return 0
    if adapters is None:
        raise UnknownAdapter(f"adapter {name!r} is not served here (no adapters are loaded)")
    if name not in adapters.names:
        served = ", ".join(sorted(adapters.names))
        raise UnknownAdapter(f"adapter {name!r} is not served here (served: {served})")
    return adapters.index(name)


def _unprepared(ticket: int, exc: Exception) -> RowFailure:
    """How a request whose parts could not be built fails: a request for an adapter that is
    not served is the client's error, anything else the engine's."""
    if isinstance(exc, UnknownAdapter):
        return RowFailure(ticket, FailureKind.INVALID_ARGUMENT, str(exc))
    message = f"preparing the request failed: {type(exc).__name__}: {exc}"
    return RowFailure(ticket, FailureKind.INTERNAL, message)


def store_tokens(row: Row, tokens: list[int]) -> list[int]:
    """A row's tokens as the prefix store names them (its image tokens keyed by image)."""
    request = row.admit.request
    if not request.keyed_prompt:
        return tokens
    n = len(request.prompt)
    return request.keyed_prompt[: len(tokens)] + tokens[n:]
