"""The engine's generation batch evaluates each step's logprobs as one array (step_logprobs):
every token and every logprob it hands out is mlx-lm's, with rows joining, leaving, sampling
with seeds and running logits processors."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.sample_utils import make_sampler
from spec_support import Job, drive, generator_kwargs

from servicer.demo_model import demo_model_path
from servicer.engine.fused_prefill import FusedPrefill
from servicer.engine.step_logprobs import StepRows, WholeLogprobsBatch


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


def _run(model, engine_batch: bool, seed: int):
    generator = FusedPrefill(model, **generator_kwargs())
    if engine_batch:
        generator.use_engine_batch()
    mx.random.seed(seed)  # the seeded rows' draws
    try:
        return drive(generator, _schedule(seed))
    finally:
        generator.close()


@pytest.mark.parametrize("kind", ["llama", "gemma3", "hybrid"])
@pytest.mark.parametrize("seed", [0, 1])
def test_tokens_and_logprobs_are_mlx_lms(kind, seed):
    from mlx_lm import load

    model, _ = load(str(demo_model_path(kind)))
    want = _run(model, engine_batch=False, seed=seed)
    got = _run(model, engine_batch=True, seed=seed)
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
    generator = FusedPrefill(model, **generator_kwargs())
    batch = generator.use_engine_batch()
    assert isinstance(batch, WholeLogprobsBatch)
    generator.insert([[5, 6, 7, 8]] * 3, max_tokens=[10] * 3)
    for _ in range(3):
        generator.next()
    rows = generator._generation_batch._next_logprobs
    assert isinstance(rows, StepRows)
    assert rows.whole.shape[0] == len(rows) == 3
    # The rows are the array's rows, read as mlx-lm hands them out.
    for i, row in enumerate(rows):
        assert mx.array_equal(row, rows.whole[i])
    generator.close()


def test_mlx_lms_own_batch_is_untouched():
    from mlx_lm import load

    model, _ = load(str(demo_model_path("llama")))
    generator = BatchGenerator(model, **generator_kwargs())
    generator.insert([[5, 6, 7, 8]] * 3, max_tokens=[10] * 3)
    for _ in range(3):
        generator.next()
    rows = generator._generation_batch._next_logprobs
    assert type(rows) is list
    generator.close()
