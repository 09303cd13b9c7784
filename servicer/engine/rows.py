"""The requests in the engine's batch, by uid, and the bookkeeping a step reads (engine
thread only): which rows are still in prefill, whose first token is due, the memory they
reserved, and what the scheduler sees of them (`BatchView`)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..outbox import handoff_due
from ..text import TextTracker
from .constraints import GrammarProcessor
from .prefill import PrefillRow
from .prefix.store import Pins
from .scheduler import Admit, BatchView


@dataclass(slots=True)
class Row:
    """A request admitted into the batch runner."""

    admit: Admit
    uid: int
    prefill_left: int = 0  # prompt tokens not yet through the model (the last one included)
    context: int = 0  # tokens in its cache
    generated: int = 0
    handed: int = 0  # tokens handed to the handlers so far
    unsent: int = 0  # events produced since the last hand-off
    waiting_since: float = 0.0  # when the oldest of them was produced (perf_counter)
    prefilled: bool = False  # its prompt is in; its first token comes with the next step
    grammar: GrammarProcessor | None = None  # its structured-output processor, if any
    pins: Pins | None = None  # the blocks of the prefix it reused, pinned while it runs
    text: TextTracker | None = None  # its decoded text, when it has stop strings
    ticket: int = field(init=False)  # its request's (read for every event)

    def __post_init__(self) -> None:
        self.ticket = self.admit.request.ticket

    def produced(self, now: float) -> None:
        """One more event for the next hand-off."""
        if self.unsent == 0:
            self.waiting_since = now
        self.unsent += 1

    def handoff_due(self, finished: bool, horizon: float) -> bool:
        """Whether its events go now: holding them means until `horizon`, the end of the next
        step, and no token waits longer than the request's window."""
        request = self.admit.request
        return handoff_due(
            started=self.handed > 0,
            pending=self.unsent,
            per_handoff=request.tokens_per_handoff,
            finished=finished,
            waited=horizon - self.waiting_since,
            window=request.handoff_window_s,
        )


class RowBook:
    """Rows by uid. Kept as rows change, so a step's bookkeeping reads only the rows it
    concerns: the rows whose prompt is not all through the model, the rows whose prompt is
    through and whose first token is not out yet, and the memory all rows reserved."""

    def __init__(self) -> None:
        self.rows: dict[int, Row] = {}
        self.prefilling: dict[int, Row] = {}
        self.first_due: set[int] = set()
        self.reserved = 0
        self.admitted_prompt = 0  # prompt tokens of every row admitted so far

    @property
    def starting(self) -> int:
        """Rows whose first token is not out yet."""
        return len(self.prefilling) + len(self.first_due)

    @property
    def decoding(self) -> int:
        return len(self.rows) - len(self.prefilling)

    def add(self, row: Row) -> None:
        self.rows[row.uid] = row
        self.reserved += row.admit.reserved
        self.admitted_prompt += len(row.admit.request.prompt)
        if row.prefill_left > 0:
            self.prefilling[row.uid] = row

    def drop(self, row: Row) -> None:
        del self.rows[row.uid]
        self.prefilling.pop(row.uid, None)
        self.first_due.discard(row.uid)
        self.reserved -= row.admit.reserved
        if row.pins is not None:
            row.pins.release()

    def view(self, decode_step_s: float) -> BatchView:
        rows = self.prefilling.values()
        prefilling = tuple(
            PrefillRow(row.prefill_left - 1, row.context, row.context > row.admit.cached_tokens)
            for row in rows
            if row.prefill_left > 1
        )
        starting = sum(1 for row in rows if row.prefill_left == 1)
        return BatchView(
            len(self.rows), bool(self.first_due), prefilling, decode_step_s, starting, self.reserved
        )

    def track_prefill(self, progress: Iterable[Any]) -> None:
        """What a step's prefill did for each prompt (the runner's `PromptProgress`)."""
        for step in progress:
            row = self.rows.get(step.uid)
            if row is None:
                continue
            if step.end_of_prompt:
                row.prefilled, row.prefill_left = True, 0
                if not row.generated:
                    self.first_due.add(row.uid)
            else:
                done, total = step.progress
                row.prefill_left = total - done
                row.context = row.admit.cached_tokens + done
            if row.prefill_left == 0:
                self.prefilling.pop(row.uid, None)

    def tickets(self) -> set[int]:
        return {row.ticket for row in self.rows.values()}

    def handed_over(self) -> None:
        """Every row's events so far went to the handlers."""
        for row in self.rows.values():
            row.handed += row.unsent
            row.unsent = 0
