"""The BatchGenerator and the requests in it: a plan's removals and inserts, one step, and the
events each row produced (engine thread only)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mlx_lm.generate import BatchGenerator

from ..faults import FaultPlan
from ..handoff import handoff_due
from ..messages import FINISH_ABORT, FINISH_STOP, FailureKind, RowEvent, RowFailure, StepOutput
from .constraints import GrammarProcessor
from .lockstep import LockstepBroken
from .prefix_cache import PrefixCache
from .sampling import SamplingFactory, gather_logprobs
from .scheduler import Admit, BatchView, Plan

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Row:
    """A request admitted into the BatchGenerator."""

    admit: Admit
    uid: int
    generated: int = 0
    handed: int = 0  # tokens handed to the handlers so far
    unsent: int = 0  # events produced since the last hand-off
    prefilled: bool = False  # its prompt is in; its first token comes with the next step
    grammar: GrammarProcessor | None = None  # its structured-output processor, if any

    @property
    def ticket(self) -> int:
        return self.admit.request.ticket

    def handoff_due(self, finished: bool) -> bool:
        return handoff_due(
            started=self.handed > 0,
            pending=self.unsent,
            per_handoff=self.admit.request.tokens_per_handoff,
            finished=finished,
        )


class Batch:
    """Rows by uid, and the generator that steps them. `on_leave` hears of every row that
    leaves (its reservation is released)."""

    def __init__(
        self,
        new_generator: Callable[[], BatchGenerator],
        sampling: SamplingFactory,
        prefix: PrefixCache | None,
        on_leave: Callable[[Admit], None],
        faults: FaultPlan | None = None,
        wants_logprobs: bool = True,
    ) -> None:
        self._new_generator = new_generator
        self._generator = new_generator()
        self._sampling = sampling
        self._prefix = prefix
        self._on_leave = on_leave
        self._faults = faults
        self._wants_logprobs = wants_logprobs  # only rank 0 sends them anywhere
        self._errors = ErrorLog()
        self.rows: dict[int, Row] = {}
        self.steps = 0
        self.check = 0  # a running sum of the tokens produced, for lockstep comparison

    @property
    def generator(self) -> BatchGenerator:
        return self._generator

    def view(self) -> BatchView:
        due = any(row.prefilled and not row.generated for row in self.rows.values())
        return BatchView(rows=len(self.rows), first_tokens_due=due)

    def tickets(self) -> set[int]:
        return {row.ticket for row in self.rows.values()}

    def lookup(self, prompt: list[int]) -> tuple[list[Any] | None, int]:
        """The longest reusable prefix's cache (a private copy) and its length."""
        if self._prefix is None:
            return None, 0
        return self._prefix.lookup(prompt)

    # ----- applying a plan -----

    def remove(self, tickets: list[int], out: StepOutput) -> None:
        aborted = set(tickets)
        removed = [row for row in self.rows.values() if row.ticket in aborted]
        self._generator.remove([row.uid for row in removed])
        for row in removed:
            self._drop(row)
            out.events.append(RowEvent(row.ticket, None, FINISH_ABORT))

    def insert(self, admits: list[Admit], caches: list[list[Any] | None]) -> None:
        requests = [admit.request for admit in admits]
        sampling = self._sampling
        chains = [sampling.processors(r) for r in requests]
        uids = self._generator.insert(
            [a.request.prompt[a.cached_tokens :] for a in admits],
            max_tokens=[r.max_tokens for r in requests],
            caches=caches,
            all_tokens=[a.request.prompt[: a.cached_tokens] for a in admits],
            samplers=[sampling.sampler(r.sampling) for r in requests],
            logits_processors=chains,
            stop_sequences=[sampling.stop_sequences(r.stop_token_ids) for r in requests],
        )
        for uid, admit, chain in zip(uids, admits, chains, strict=True):
            grammar = next((p for p in chain if isinstance(p, GrammarProcessor)), None)
            self.rows[uid] = Row(admit, uid, grammar=grammar)

    def _drop(self, row: Row) -> None:
        del self.rows[row.uid]
        self._on_leave(row.admit)

    # ----- stepping -----

    def step(self, out: StepOutput) -> bool:
        """One generator step; its events go to `out`. True when some handler needs them."""
        self.steps += 1
        if self._faults is not None:
            self._faults.before_step(self.steps)
        prompt_progress, responses = self._generator.next()
        for progress in prompt_progress:
            if progress.end_of_prompt and (row := self.rows.get(progress.uid)) is not None:
                row.prefilled = True
        if self._prefix is not None:
            self._snapshot_prefills(prompt_progress)
        due, broken, wanted = False, [], []
        for response in responses:
            row = self.rows.get(response.uid)
            if row is None:  # removed earlier in this step
                continue
            row.generated += 1
            if row.grammar is not None and row.grammar.error is not None:
                self._fail_grammar(row, out)
                if response.finish_reason is None:
                    broken.append(row.uid)  # still in the batch
                continue
            event = self._event(row, response)
            out.events.append(event)
            row.unsent += 1
            due = due or row.handoff_due(event.finish_reason is not None)
            if row.admit.request.top_logprobs is not None and self._wants_logprobs:
                wanted.append((event, response.logprobs, row.admit.request.top_logprobs))
            if event.finish_reason is not None:
                self._finish(row, response)
        if broken:
            self._generator.remove(broken)
        if wanted:
            _attach_logprobs(wanted)
        self.check = (self.check + sum(e.token or 0 for e in out.events)) % (1 << 31)
        return due

    @staticmethod
    def _event(row: Row, response: Any) -> RowEvent:
        finish = response.finish_reason
        return RowEvent(
            row.ticket,
            response.token,
            finish,
            response.token if finish == FINISH_STOP else None,
            None,
            row.admit.cached_tokens,
        )

    def _fail_grammar(self, row: Row, out: StepOutput) -> None:
        assert row.grammar is not None
        message = f"the request's grammar failed while generating: {row.grammar.error}"
        out.failures.append(RowFailure(row.ticket, FailureKind.INVALID_ARGUMENT, message))
        self._drop(row)

    def _finish(self, row: Row, response: Any) -> None:
        self._drop(row)
        if self._prefix is not None and response.prompt_cache is not None:
            self._prefix.store(response.all_tokens, response.prompt_cache)

    def _snapshot_prefills(self, progress: list[Any]) -> None:
        """Keep the state of prompts whose prefill just reached their last token."""
        assert self._prefix is not None
        done = [p.uid for p in progress if p.end_of_segment and not p.end_of_prompt]
        if done:
            for cache, tokens in self._generator.extract_cache(done).values():
                self._prefix.store(tokens, cache)

    def handed_over(self) -> None:
        """Every row's events so far went to the handlers."""
        for row in self.rows.values():
            row.handed += row.unsent
            row.unsent = 0

    # ----- failures and the end -----

    def recover(self, exc: Exception, plan: Plan, out: StepOutput) -> None:
        """A failed step fails the requests in the batch; a fresh generator serves the rest."""
        failed = self.tickets() | {admit.request.ticket for admit in plan.admits}
        self._errors.report(exc, len(failed))
        message = f"engine step failed: {type(exc).__name__}: {exc}"
        # Events already produced this step are void: those requests end with the error.
        out.events[:] = [e for e in out.events if e.ticket not in failed]
        out.failures.extend(RowFailure(t, FailureKind.INTERNAL, message) for t in sorted(failed))
        for row in list(self.rows.values()):
            self._drop(row)
        self._generator.close()
        self._generator = self._new_generator()

    def end_all(self, out: StepOutput) -> None:
        """Every row ends with `abort` (shutdown)."""
        for row in list(self.rows.values()):
            self._drop(row)
            out.events.append(RowEvent(row.ticket, None, FINISH_ABORT))

    def close(self) -> None:
        self._generator.close()


def _attach_logprobs(wanted: list[tuple[RowEvent, Any, int]]) -> None:
    results = gather_logprobs(
        [event.token for event, _, _ in wanted],  # type: ignore[misc]
        [logprobs for _, logprobs, _ in wanted],
        [n for _, _, n in wanted],
    )
    for (event, _, _), result in zip(wanted, results, strict=True):
        event.logprob = result


def check_same_prefix(cached: int, expected: int) -> None:
    """A follower's prefix lookup must agree with rank 0's."""
    if cached != expected:
        raise LockstepBroken("the ranks' prefix caches disagree")


class ErrorLog:
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
