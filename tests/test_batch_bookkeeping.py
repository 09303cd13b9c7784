"""The batch keeps its per-step figures (rows in prefill, first tokens due, memory reserved) as
rows change instead of recounting every row each step: after every step of a busy engine they
must equal a recount. Prompts are chunked (a small prefill step), reuse prefixes, join while
others decode, are aborted mid-prefill and mid-decode, and finish."""

from __future__ import annotations

import random
import threading

from servicer.engine import Engine, EngineConfig
from servicer.engine.batch import Batch
from servicer.engine.scheduler import BatchView
from servicer.messages import GenerationRequest, SamplingSpec
from servicer.model_files import ModelSpec, prepare_model_files
from servicer.outbox import Outbox


def recount(batch: Batch) -> BatchView:
    """The view as the rows say, counted from scratch."""
    from servicer.engine.prefill import PrefillRow

    rows = list(batch.rows.values())
    prefilling = tuple(
        PrefillRow(r.prefill_left - 1, r.context, r.context > r.admit.cached_tokens)
        for r in rows
        if r.prefill_left > 1
    )
    decoding = sum(1 for r in rows if r.prefill_left == 0)
    return BatchView(
        len(rows),
        any(r.prefilled and not r.generated for r in rows),
        prefilling,
        batch.cost.decode.seconds(max(decoding, 1)),
        sum(1 for r in rows if r.prefill_left == 1),
        sum(r.admit.reserved for r in rows),
    )


def test_kept_figures_match_a_recount_after_every_step(demo_dir, monkeypatch):
    mismatches: list[str] = []
    checked = [0]
    step = Batch.step

    def checking_step(self: Batch, out):  # type: ignore[no-untyped-def]
        report = step(self, out)
        view = recount(self)
        if self.view() != view:
            mismatches.append(f"step {self.steps}: kept {self.view()}, recounted {view}")
        checked[0] += 1
        return report

    monkeypatch.setattr(Batch, "step", checking_step)
    finished: set[int] = set()
    cond = threading.Condition()

    def woken() -> None:
        out = outbox.take()
        if out is None:
            return
        with cond:
            finished.update(e.ticket for e in out.events if e.finish_reason is not None)
            finished.update(f.ticket for f in out.failures)
            cond.notify_all()

    outbox = Outbox(woken)
    config = EngineConfig(prefill_step_size=32, prompt_cache_block=16, max_prefill_stall_ms=5)
    engine = Engine(config, outbox)
    engine.start(prepare_model_files(ModelSpec(str(demo_dir))).info)
    engine.wait_ready(120)
    rng = random.Random(7)
    shared = [rng.randrange(5, 500) for _ in range(80)]
    tickets = []
    try:
        for wave in range(4):
            for i in range(6):
                ticket = 1000 + 10 * wave + i
                head = shared if i % 2 else []
                prompt = head + [rng.randrange(5, 500) for _ in range(rng.randrange(3, 150))]
                engine.submit(
                    GenerationRequest(
                        ticket,
                        f"book-{ticket}",
                        prompt,
                        rng.randrange(1, 24),
                        SamplingSpec(temperature=0.0),
                    )
                )
                tickets.append(ticket)
            engine.abort([1000 + 10 * wave + 5])  # early: maybe still waiting or in prefill
            with cond:
                cond.wait_for(lambda w=wave: 1000 + 10 * w in finished, 60)
            engine.abort([1000 + 10 * wave + 3])  # later: maybe decoding
        with cond:
            assert cond.wait_for(lambda: set(tickets) <= finished, 120)
    finally:
        engine.shutdown(30)
    assert checked[0] > 50
    assert not mismatches, mismatches[:3]
