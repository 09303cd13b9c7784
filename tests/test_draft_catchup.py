"""A draft model's catch-up respects the prefill budget: 4 streams decode, a 4,000-token prompt
arrives, and with `--draft-model` each step runs the draft over the arrival's context only as
far as the plan's share for the step allows (a budget's worth per step, not all of it in one
step). What that does to the streams' gaps is speed, not asserted here (bench/RESULTS.md has
the figures). Outputs stay exact."""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any

import pytest
from conftest import demo_config
from spec_support import Job, drive, passages, plain_generator, repeat_prompt, runner_kwargs
from support import BackgroundGenerate, ServerThread, generate

from servicer.demos.text import TEST_PROMPTS, demo_model_path
from servicer.engine.speculation import SpeculationConfig, SpeculativeRunner
from servicer.engine.speculation.draft_model import DraftModel

STREAMS = 4
ARRIVAL = 4000  # prompt tokens
ARRIVAL_TOKENS = 48  # enough steps after its join for the draft to start catching up
MIN_CHUNK = 16  # a lagging row's catch-up moves at least this much in a step with a share


def _arrival(reference: Any) -> list[int]:
    text = " ".join(TEST_PROMPTS[i % len(TEST_PROMPTS)] for i in range(800))
    ids = reference.encode(text)
    assert len(ids) >= ARRIVAL
    return ids[:ARRIVAL]


def _record_catch_up(monkeypatch: pytest.MonkeyPatch) -> list[list[Any]]:
    """[the plan's catch-up share, the catch-up tokens the draft ran] for every step of a
    draft model in this process (the engine in a thread): the share is what the step begins
    with, the tokens what the draft counted by the next step's beginning."""
    steps: list[list[Any]] = []
    begin = DraftModel.begin_step

    def begin_step(self: DraftModel, tokens: int | None) -> None:
        if steps:
            steps[-1][1] = self.catch_up_tokens
        steps.append([tokens, 0])
        begin(self, tokens)

    monkeypatch.setattr(DraftModel, "begin_step", begin_step)
    return steps


def test_a_draft_models_catch_up_keeps_the_streams_within_the_budget(
    demo_dir, reference, prompts, monkeypatch
):
    steps = _record_catch_up(monkeypatch)
    arriving = _arrival(reference)
    config = demo_config(
        demo_dir,
        prompt_cache_size=0,
        speculate="draft",
        draft_model=str(demo_dir),
        # draft at every step, so the catch-up comes when it would; 5 rows still draft
        speculation=SpeculationConfig(costed=False, max_rows=8),
    )
    with ServerThread(replace(config, engine_mode="thread")) as running, running.channel() as chan:
        streams = [
            BackgroundGenerate(chan, prompt, temperature=0, max_tokens=3000, ignore_eos=True)
            for prompt in prompts[:STREAMS]
        ]
        assert all(stream.started.wait(60) for stream in streams)
        done = generate(chan, arriving, temperature=0, max_tokens=ARRIVAL_TOKENS, ignore_eos=True)
        assert all(stream.is_alive() for stream in streams)  # they decoded all along
        running.server.servicer.abort_all()
        for stream in streams:
            stream.join(60)
        figures = running.server.servicer.figures().speculation
    assert done.error is None, done.error
    assert done.tokens == reference.greedy(arriving, ARRIVAL_TOKENS)
    assert figures is not None and figures.accepted > 0
    # While the streams decode every step has a share (None: no bound); a step runs at most
    # its share, or the minimum chunk where the share is smaller, and nothing with none.
    bounded = [(share, ran) for share, ran in steps if share is not None]
    assert any(ran for _, ran in bounded), steps  # the catch-up ran, under a bound
    over = [(share, ran) for share, ran in bounded if ran > max(share, MIN_CHUNK if share else 0)]
    assert not over, over


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
