"""The engine's own batch runner (runner, prompt_batch, decode_batch) against mlx-lm's
BatchGenerator: every token, finish and logprob it hands out is mlx-lm's, with rows joining,
leaving, sampling with seeds and running logits processors; and its decode step evaluates
each step's logprobs as one array."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from mlx_lm.sample_utils import make_sampler
from spec_support import Job, drive, plain_generator, runner_kwargs

from servicer.demos.text import demo_model_path
from servicer.engine.decode_batch import StepRows
from servicer.engine.runner import BatchRunner


def _schedule(seed: int) -> list[Job]:
    draw = random.Random(seed)
    jobs = []
    for n in range(7):
        prompt = [draw.randrange(3, 250) for _ in range(draw.randrange(4, 40))]
        sampler = None
        if n % 3 == 1:
            sampler = make_sampler(temp=0.8, top_p=0.9)
        processors = None
        if n % 3 == 2:
            processors = [lambda tokens, logits: logits * 0.5]
        jobs.append(
            Job(
                f"r{n}",
                prompt,
                max_tokens=draw.randrange(3, 30),
                join_at=draw.randrange(0, 25),
                remove_after=draw.randrange(2, 20) if n == 4 else None,
                sampler=sampler,
                processors=processors,
            )
        )
    return jobs


def _run(model, ours: bool, seed: int, **settings):
    if ours:
        runner = BatchRunner(model, **{**runner_kwargs(), **settings})
    else:
        runner = plain_generator(model, **settings)
    mx.random.seed(seed)  # the seeded rows' draws
    try:
        return drive(runner, _schedule(seed))
    finally:
        runner.close()


@pytest.mark.parametrize("kind", ["llama", "gemma3", "hybrid"])
@pytest.mark.parametrize(("seed", "step"), [(0, 2048), (1, 2048), (2, 8)])
def test_tokens_and_logprobs_are_mlx_lms(kind, seed, step):
    from mlx_lm import load

    model, _ = load(str(demo_model_path(kind)))
    want = _run(model, ours=False, seed=seed, prefill_step_size=step)
    got = _run(model, ours=True, seed=seed, prefill_step_size=step)
    assert want.keys() == got.keys()
    for name in want:
        assert got[name].tokens == want[name].tokens, name
        assert got[name].finish == want[name].finish, name
        assert len(got[name].logprobs) == len(want[name].logprobs)
        for a, b in zip(want[name].logprobs, got[name].logprobs, strict=True):
            assert mx.array_equal(a, b), name


def test_a_step_evaluates_its_logprobs_as_one_array(monkeypatch):
    from mlx_lm import load

    model, _ = load(str(demo_model_path("llama")))
    runner = BatchRunner(model, **runner_kwargs())
    runner.insert([[5, 6, 7, 8]] * 3, max_tokens=[10] * 3)
    for _ in range(3):
        runner.next()
    rows = runner.decoding._next_logprobs
    assert isinstance(rows, StepRows)
    assert rows.whole.shape[0] == len(rows) == 3
    # The rows are the array's rows, read as mlx-lm hands them out.
    for i, row in enumerate(rows):
        assert mx.array_equal(row, rows.whole[i])
    runner.close()


def test_segments_stop_the_prefill_at_their_ends():
    """Each segment's end is a step's end (the prefix store snapshots there), and the
    progress reported counts the prompt's tokens through the model."""
    from mlx_lm import load

    model, _ = load(str(demo_model_path("llama")))
    runner = BatchRunner(model, **{**runner_kwargs(), "prefill_step_size": 4})
    runner.insert_segments([[[3] * 6, [4] * 3, [5] * 2]], max_tokens=[2])
    seen = []
    for _ in range(8):
        progress, _ = runner.next()
        seen.extend((p.progress, p.end_of_segment, p.end_of_prompt) for p in progress)
    runner.close()
    assert seen == [
        ((4, 11), False, False),
        ((6, 11), True, False),
        ((9, 11), True, False),
        ((10, 11), True, False),
        ((11, 11), True, True),
    ]
