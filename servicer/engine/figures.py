"""The figures the engine publishes with its output (engine thread only): the prefix store's
counts, the prefill budget in force, speculation's counters and the load a router reads
(GetLoads). Everyone else reads the latest published ones."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from ..messages import EngineFigures, LoadCounts, SpeculationFigures, StepOutput
from .batch import Batch
from .inbox import Inbox
from .prefix.store import AnyPrefixStore
from .scheduler import Scheduler

# While rows run, the figures go out at most this often (building and comparing them every
# step of a fast model is a measurable share of its step); an idle batch sends them at once.
FIGURES_INTERVAL_S = 0.05


@dataclass(slots=True)
class Published:
    """The figures the engine last sent, and when it last looked (time.monotonic())."""

    figures: EngineFigures | None = None
    at: float = 0.0
    counts: tuple[int, int, int] = (0, 0, 0)


class FiguresPublisher:
    """Builds the figures after a step and puts them on its output when they changed."""

    def __init__(
        self,
        batch: Batch,
        scheduler: Scheduler,
        inbox: Inbox,
        store: AnyPrefixStore,
        speculation: Callable[[], SpeculationFigures | None],
        budgeted: bool,
    ) -> None:
        self._batch, self._scheduler, self._inbox = batch, scheduler, inbox
        self._store, self._speculation, self._budgeted = store, speculation, budgeted
        self._published = Published()

    def publish(self, out: StepOutput, budget_s: float) -> None:
        """The figures go out with this output when they changed (`budget_s`: the prefill
        budget the step was planned with): at once when no row runs, the counts of rows or
        waiting requests changed, or the output answers a flush (its caller reads them),
        otherwise at most every `FIGURES_INTERVAL_S`."""
        now, published, batch = time.monotonic(), self._published, self._batch
        counts = len(batch.rows), batch.starting, self._scheduler.waiting
        recent = now - published.at < FIGURES_INTERVAL_S and counts == published.counts
        if batch.rows and not out.flushed and recent:
            return
        published.at, published.counts = now, counts
        budget = budget_s if self._budgeted else 0.0
        load = load_counts(batch, self._scheduler, self._inbox)
        figures = EngineFigures(self._store.stats(), budget, self._speculation(), load)
        if figures != published.figures:
            out.figures = published.figures = figures


def load_counts(batch: Batch, scheduler: Scheduler, inbox: Inbox) -> LoadCounts:
    """The load a router reads (GetLoads), as a step left it: the batch's rows, the requests
    in the scheduler's line and the samples the inbox holds."""
    starting, held = batch.starting, inbox.held_samples()
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
