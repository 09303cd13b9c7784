"""A prefill chunk and the decoding rows in one forward (servicer/engine/fused_prefill.py): the
same tokens and log-probabilities as mlx-lm's separate forwards, on every covered demo kind
(llama; gemma3 with its sliding windows), greedy and seeded, with long prompts arriving while
rows decode, rows finishing and joining, speculation drafting beside it; and the architectures
it does not cover are left as they are."""

from __future__ import annotations

import random
from typing import Any

import mlx.core as mx
import pytest
from spec_support import Job, drive, passages, plain_generator, runner_kwargs

from servicer.demos.text import demo_model_path
from servicer.engine import fused_prefill
from servicer.engine.cache_kinds import make_row_cache
from servicer.engine.runner import BatchRunner
from servicer.engine.sampling import SeededSampler
from servicer.engine.speculation import PromptLookup, SpeculationConfig, SpeculativeRunner
from servicer.messages import SamplingSpec


def arrival_jobs(tokenizer: Any, seed: int, seeded: bool = False) -> list[Job]:
    """Two to four rows decoding from the start, then long prompts (150-400 tokens) arriving
    one at a time while they decode; random lengths."""
    rng = random.Random(seed)
    ids = [t for text in passages() for t in tokenizer.encode(text, add_special_tokens=False)]

    def prompt(length: int) -> list[int]:
        start = rng.randrange(len(ids) - length)
        return ids[start : start + length]

    jobs = [
        Job(f"s{i}", prompt(rng.randint(5, 30)), rng.randint(30, 80))
        for i in range(rng.randint(2, 4))
    ]
    step = rng.randint(1, 4)
    for i in range(rng.randint(1, 3)):
        jobs.append(
            Job(f"long{i}", prompt(rng.randint(150, 400)), rng.randint(4, 20), join_at=step)
        )
        step += rng.randint(8, 30)
    if seeded:
        for i, job in enumerate(jobs):
            spec = SamplingSpec(temperature=0.9, seed=seed * 100 + i, top_k=40)
            job.sampler = SeededSampler(spec, 512)
    return jobs


def fused_runner(model: Any, step: int) -> BatchRunner:
    return BatchRunner(model, fuse_prefill=True, **{**runner_kwargs(), "prefill_step_size": step})


def assert_same(want: dict, got: dict) -> None:
    for name, expected in want.items():
        result = got[name]
        assert result.tokens == expected.tokens, name
        assert (result.finish, result.all_tokens) == (expected.finish, expected.all_tokens), name
        for a, b in zip(expected.logprobs, result.logprobs, strict=True):
            assert mx.array_equal(a, b).item(), name


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_fused_steps_give_the_same_output(kind_model, seed, seeded):
    _, model, tokenizer = kind_model
    step = random.Random(seed).choice([16, 32, 48, 64])
    plain = drive(
        plain_generator(model, prefill_step_size=step), arrival_jobs(tokenizer, seed, seeded)
    )
    runner = fused_runner(model, step)
    fused = drive(runner, arrival_jobs(tokenizer, seed, seeded))
    assert runner.fused_steps > 0
    assert_same(plain, fused)


def test_fused_steps_beside_speculation(kind_model):
    """Speculation drafting in the decoding rows: verify forwards carry the chunk too."""
    _, model, tokenizer = kind_model

    def jobs() -> list[Job]:
        out = arrival_jobs(tokenizer, 11)
        for job in out[:2]:
            job.prompt = job.prompt + job.prompt  # something for prompt lookup to find
        return out

    plain = drive(plain_generator(model, prefill_step_size=32), jobs())
    runner = SpeculativeRunner(
        model,
        source=PromptLookup(),
        speculation=SpeculationConfig(costed=False, max_rows=16),
        fuse_prefill=True,
        **{**runner_kwargs(), "prefill_step_size": 32},
    )
    speculated = drive(runner, jobs())
    assert runner.fused_steps > 0 and runner.speculation.drafted > 0
    for name, want in plain.items():
        assert speculated[name].tokens == want.tokens, name


def test_uncovered_architectures_are_left_alone():
    from mlx_lm import load

    model, _ = load(str(demo_model_path("hybrid")))
    classes = [type(layer) for layer in model.layers]
    assert not fused_prefill.enable_fused_prefill(model)
    assert [type(layer) for layer in model.layers] == classes


@pytest.mark.parametrize("dequantize", [False, True], ids=["quantized", "dequantizing"])
def test_fused_steps_with_a_quantized_kv_cache(kind_model, dequantize):
    """--kv-bits 8: each segment's attention reads its own quantized cache, as unfused."""
    _, model, tokenizer = kind_model

    def jobs() -> list[Job]:
        out = arrival_jobs(tokenizer, 21)
        for job in out:
            job.caches = lambda: make_row_cache(model, 8, 32, dequantize)
        return out

    plain = drive(plain_generator(model, prefill_step_size=32), jobs())
    runner = fused_runner(model, 32)
    fused = drive(runner, jobs())
    assert runner.fused_steps > 0
    assert_same(plain, fused)
