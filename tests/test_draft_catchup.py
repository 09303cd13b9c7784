"""A draft model's catch-up respects the prefill budget: 4 streams decode, a 4,000-token prompt
arrives, and with `--draft-model` the streams' longest gap stays within the bound they keep
without one (the draft runs over the arrival's context a budget's worth per step, not all of it
in one step). Outputs stay exact."""

from __future__ import annotations

import functools
import itertools
import threading
import time
from typing import Any

from conftest import demo_config
from spec_support import Job, drive, passages, plain_generator, repeat_prompt, runner_kwargs
from support import ServerThread, generate, wait_until

from servicer.demos.text import TEST_PROMPTS, demo_model_path
from servicer.engine.speculation import SpeculationConfig, SpeculativeRunner
from servicer.engine.speculation.draft_model import DraftModel

STREAMS = 4
ARRIVAL = 4000  # prompt tokens
ARRIVAL_TOKENS = 48  # enough steps after its join for the draft to start catching up
BASELINE_S = 0.3  # decoding alone before the arrival


def _arrival(reference: Any) -> list[int]:
    text = " ".join(TEST_PROMPTS[i % len(TEST_PROMPTS)] for i in range(800))
    ids = reference.encode(text)
    assert len(ids) >= ARRIVAL
    return ids[:ARRIVAL]


def _run(demo_dir: Any, streams: list[list[int]], arriving: list[int], **engine: Any):
    """(the streams' longest gap from the arrival's send to its end, the arrival's tokens,
    the speculation figures)."""
    config = demo_config(demo_dir, prompt_cache_size=0, **engine)
    times: list[list[float]] = [[] for _ in streams]
    with ServerThread(config) as running, running.channel() as chan:
        callers = [
            threading.Thread(
                target=generate,
                args=(chan, prompt),
                kwargs={
                    "temperature": 0,
                    "max_tokens": 3000,
                    "ignore_eos": True,
                    "on_chunk": lambda _, t=t: t.append(time.perf_counter()),
                },
            )
            for prompt, t in zip(streams, times, strict=True)
        ]
        for caller in callers:
            caller.start()
        assert wait_until(lambda: all(times), timeout=60)
        time.sleep(BASELINE_S)
        sent = time.perf_counter()
        done = generate(chan, arriving, temperature=0, max_tokens=ARRIVAL_TOKENS, ignore_eos=True)
        ended = time.perf_counter()
        assert all(caller.is_alive() for caller in callers)  # they decoded all along
        running.server.servicer.abort_all()
        for caller in callers:
            caller.join(60)
        figures = running.server.servicer.figures().speculation
    gaps = [b - a for t in times for a, b in itertools.pairwise(t) if b > sent and a < ended]
    assert done.error is None, done.error
    return max(gaps), done.tokens, figures


def test_a_draft_models_catch_up_keeps_the_streams_within_the_budget(demo_dir, reference, prompts):
    streams, arriving = prompts[:STREAMS], _arrival(reference)
    plain_gap, plain, _ = _run(demo_dir, streams, arriving)
    draft_gap, drafted, figures = _run(
        demo_dir,
        streams,
        arriving,
        speculate="draft",
        draft_model=str(demo_dir),
        # draft at every step, so the catch-up comes when it would; 5 rows still draft
        speculation=SpeculationConfig(costed=False, max_rows=8),
    )
    assert drafted == plain == reference.greedy(arriving, ARRIVAL_TOKENS)
    assert figures is not None and figures.accepted > 0
    # The gaps themselves are speed: bench/bench.py --only arrival measures them.
    print(f"longest gap: {plain_gap * 1000:.0f} ms without a draft, {draft_gap * 1000:.0f} ms with")


def test_a_lagging_row_catches_up_a_chunk_a_step_then_drafts():
    """With a plan's share too small for any chunk, each step's catch-up runs the minimum (16
    tokens) for one row; rows behind do not draft until through, and the output is exact."""
    from mlx_lm import load

    model, tokenizer = load(str(demo_model_path("llama")))
    texts = passages()
    long = [t for text in texts for t in tokenizer.encode(text, add_special_tokens=False)][:600]
    jobs = [
        Job("short0", repeat_prompt(tokenizer, texts[0], 40), 70),
        Job("short1", repeat_prompt(tokenizer, texts[1], 40), 90),
        Job("long", long, 110, join_at=3),
    ]
    plain = drive(plain_generator(model), jobs)
    source = DraftModel(model)
    runner = SpeculativeRunner(
        model,
        source=source,
        speculation=SpeculationConfig(costed=False),
        **runner_kwargs(),
    )
    per_step: list[int] = []
    # A plan whose share for the catch-up is one token a step: the minimum chunk runs.
    runner.next = functools.partial(runner.next, catch_up=1)  # type: ignore[method-assign]
    spec = drive(runner, jobs, on_step=lambda _: per_step.append(source.catch_up_tokens))
    for name, want in plain.items():
        assert spec[name].tokens == want.tokens, name
    assert max(per_step) == 16  # never more than the minimum chunk in a step
    assert sum(per_step) >= 600 + 2 * 60  # every row caught up...
    stats = runner.speculation
    assert stats.accepted > 0 and max(stats.per_row_step) > 1  # ...and then drafted
