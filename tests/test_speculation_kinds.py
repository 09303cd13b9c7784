"""Speculation on every cache kind: sliding-window layers (demo gemma3, window 16), recurrent
layers (demo hybrid: Gated DeltaNet beside attention) and quantized KV. Randomized prompts
that cross the window, greedy and seeded, rows joining and leaving mid-speculation: the
same tokens as mlx-lm's own BatchGenerator without speculation."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from typing import Any

import pytest
from spec_support import (
    Job,
    Oracle,
    draft_three_steps_then_stop_three,
    drive,
    passages,
    plain_generator,
    runner_kwargs,
)
from support import slow

from servicer.demos.text import demo_model_path
from servicer.engine.cache_kinds import make_row_cache
from servicer.engine.sampling import SeededSampler
from servicer.engine.speculation import (
    PromptLookup,
    SpeculationConfig,
    SpeculativeRunner,
)
from servicer.messages import SamplingSpec

KINDS = ["gemma3", "hybrid"]


@pytest.fixture(scope="module", params=KINDS)
def kind_model(request) -> tuple[str, Any, Any]:
    from mlx_lm import load

    model, tokenizer = load(str(demo_model_path(request.param)))
    return request.param, model, tokenizer


def random_jobs(tokenizer: Any, seed: int, batch: int, **extra: Any) -> list[Job]:
    """`batch` rows from the start, more joining while others speculate, one removed early;
    prompts of random passages cut at random lengths (20-150 tokens: most cross the
    16-token window), random max_tokens."""
    rng = random.Random(seed)
    texts = passages()
    jobs = []
    for i in range(batch if batch == 1 else batch + 2):
        text = texts[rng.randrange(len(texts))]
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        start = rng.randrange(max(1, len(ids) - 150))
        prompt = ids[start : start + rng.randint(20, 150)]
        prompt = prompt + prompt[: len(prompt) // 2]  # something for prompt lookup to find
        join = 0 if i < batch else rng.randint(2, 9)
        jobs.append(Job(f"r{i}", prompt, rng.randint(12, 40), join_at=join, **extra))
    if batch > 1:
        jobs[1].remove_after = 7
    return jobs


def speculating(model: Any, source: Any, **config: Any) -> SpeculativeRunner:
    config.setdefault("costed", False)  # draft whenever a row can: these test exactness
    config.setdefault("max_rows", 16)
    return SpeculativeRunner(
        model, source=source, speculation=SpeculationConfig(**config), **runner_kwargs()
    )


def assert_same(plain: dict, spec: dict) -> None:
    for name, want in plain.items():
        got = spec[name]
        if want.removed:
            n = min(len(want.tokens), len(got.tokens))
            assert got.tokens[:n] == want.tokens[:n], name
            continue
        assert got.tokens == want.tokens, name
        assert (got.finish, got.all_tokens) == (want.finish, want.all_tokens), name


def references(jobs: list[Job], results: dict) -> list[list[int]]:
    return [job.prompt + results[job.name].tokens for job in jobs]


def check_oracle_identical(model: Any, make_jobs: Callable[[], list[Job]]) -> dict:
    """A source that knows the answers but spoils every third draft (so rows reject and
    roll back) gives the tokens of speculation off; those tokens."""
    plain = drive(plain_generator(model), make_jobs())
    oracle = speculating(model, Oracle(references(make_jobs(), plain)))
    assert_same(plain, drive(oracle, make_jobs()))
    stats = oracle.speculation
    assert stats.drafted > 0 and 0 < stats.accepted < stats.drafted  # rollbacks happened
    return plain


def check_greedy_identical(model: Any, make_jobs: Callable[[], list[Job]]) -> None:
    """The oracle's check, then prompt lookup's: the tokens of speculation off."""
    plain = check_oracle_identical(model, make_jobs)
    lookup = speculating(model, PromptLookup())
    assert_same(plain, drive(lookup, make_jobs()))
    assert lookup.speculation.drafted > 0


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("seed", [0, slow(1)])
def test_greedy_identical(kind_model, batch, seed):
    _, model, tokenizer = kind_model
    check_greedy_identical(model, lambda: random_jobs(tokenizer, seed, batch))


def test_seeded_identical_with_rows_joining(kind_model):
    """Seeded rows draw what they draw without speculation, rows joining mid-way."""
    _, model, tokenizer = kind_model

    def jobs() -> list[Job]:
        out = random_jobs(tokenizer, 5, 2)
        specs = [SamplingSpec(temperature=0.8, seed=20 + i, top_k=30) for i in range(len(out))]
        for job, spec in zip(out, specs, strict=True):
            job.sampler = SeededSampler(spec, 512)
        return out

    check_oracle_identical(model, jobs)


def test_finished_rows_carry_caches_that_continue_exactly(kind_model):
    """A finished row's cache (what the prefix store keeps) holds exactly its tokens: the
    same greedy continuation follows from it as from a cold prefill."""
    _, model, tokenizer = kind_model
    jobs = random_jobs(tokenizer, 3, 1)
    plain = drive(plain_generator(model), jobs)
    spec = drive(speculating(model, Oracle(references(jobs, plain))), random_jobs(tokenizer, 3, 1))
    done = spec["r0"]
    assert done.all_tokens == jobs[0].prompt + done.tokens
    extra = done.tokens[-1]
    more = [Job("more", [extra], 10, caches=lambda: done.cache)]
    cold = [Job("more", [*done.all_tokens, extra], 10)]
    assert drive(plain_generator(model), more)["more"].tokens == (
        drive(plain_generator(model), cold)["more"].tokens
    )


@pytest.mark.parametrize("dequantize", [False, True], ids=["quantized", "dequantizing"])
def test_quantized_kv_identical(kind_model, dequantize):
    """--kv-bits: quantized attention rows roll back like plain ones, whether attention gets
    them quantized or dequantized (RaggedDequantizingKVCache)."""
    _, model, tokenizer = kind_model

    def rows() -> list[Any]:
        return make_row_cache(model, 8, 32, dequantize)

    def jobs() -> list[Job]:
        return random_jobs(tokenizer, 7, 2, caches=rows)

    plain = drive(plain_generator(model), jobs())
    runner = speculating(model, Oracle(references(jobs(), plain)))
    assert_same(plain, drive(runner, jobs()))
    assert 0 < runner.speculation.accepted < runner.speculation.drafted


def test_a_batch_too_large_to_draft_steps_on_mlx_lm_caches(kind_model):
    """Past the row cap no step drafts, so the batch keeps mlx-lm's caches (a ring or a
    recurrent copy per row costs a copy to join and more work every step); once few enough
    rows are left to draft, they become caches that roll back, and the tokens stay exact."""
    from servicer.engine.speculation.caches import RaggedKVCache, RecurrentCache, RingKVCache

    _, model, tokenizer = kind_model

    def jobs() -> list[Job]:
        out = random_jobs(tokenizer, 7, 6)
        for i, job in enumerate(out):
            job.join_at, job.remove_after = 0, None
            job.max_tokens = 10 if i < 5 else 40  # three rows go on
        return out

    plain = drive(plain_generator(model), jobs())
    runner = speculating(model, Oracle(references(jobs(), plain)), max_rows=4)
    own = (RaggedKVCache, RingKVCache, RecurrentCache)
    kinds: list[tuple[int, bool]] = []

    def look(step: int) -> None:
        batch = runner.decoding
        kinds.append((len(batch.uids), any(isinstance(c, own) for c in batch.prompt_cache)))

    assert_same(plain, drive(runner, jobs(), on_step=look))
    assert runner.speculation.drafted > 0
    assert all(not rolls_back for rows, rolls_back in kinds if rows > 4)
    assert any(rolls_back for rows, rolls_back in kinds if rows <= 4)


def test_a_rows_first_token_waits_for_no_verify(kind_model):
    """The step that sends a row's first token is a plain one (its forward runs while the
    token goes out), never a verify of drafts that it would wait on: rows joining a batch
    that drafts at every step, the oracle drafting the right tokens. The tokens of off."""
    _, model, tokenizer = kind_model
    plain = drive(plain_generator(model), random_jobs(tokenizer, 17, 2))
    runner = speculating(model, Oracle(references(random_jobs(tokenizer, 17, 2), plain)))
    got: dict[str, Any] = {}
    sent: dict[str, int] = {}
    verified = [0]
    first_steps: list[tuple[int, int]] = []  # (tokens the row got, verifies run) that step

    def look(step: int) -> None:
        ran = runner.speculation.speculative_steps - verified[0]
        verified[0] += ran
        for name, result in got.items():
            if not sent.get(name) and result.tokens:
                first_steps.append((len(result.tokens), ran))
            sent[name] = len(result.tokens)

    assert_same(plain, drive(runner, random_jobs(tokenizer, 17, 2), look, results=got))
    assert verified[0] > 0 and len(first_steps) == len(plain)
    assert all(step == (1, 0) for step in first_steps), first_steps


@pytest.mark.parametrize("kind", ["llama", *KINDS])
def test_drafting_switched_on_and_off_by_the_clocks_changes_no_output(kind):
    """The default setting (costed: the mode clock and the width clock decide), with windows of
    two steps so the batch switches between drafting and plain steps all the time: greedy and
    seeded rows, rows joining, the tokens of speculation off."""
    from mlx_lm import load

    model, tokenizer = load(str(demo_model_path(kind)))

    def jobs(seeded: bool) -> list[Job]:
        out = random_jobs(tokenizer, 11, 3)
        if seeded:
            for i, job in enumerate(out):
                spec = SamplingSpec(temperature=0.7, seed=40 + i, top_k=20)
                job.sampler = SeededSampler(spec, 512)
        return out

    for seeded in (False, True):
        plain = drive(plain_generator(model), jobs(seeded))
        costed = speculating(model, PromptLookup(), costed=True, mode_window=2, mode_gap=1)
        assert_same(plain, drive(costed, jobs(seeded)))
        stats = costed.speculation
        assert stats.speculative_steps > 0 and stats.cutoff_steps > 0  # both modes ran


@pytest.mark.parametrize("quantized", [False, True], ids=["plain-kv", "kv-bits"])
@pytest.mark.parametrize("kind", ["llama", *KINDS])
def test_a_batch_that_stops_drafting_goes_back_to_mlx_lm_caches_exactly(
    kind, quantized, monkeypatch
):
    """Whenever the mode clock stops drafting, the batch's caches that roll back become
    mlx-lm's again (whose plain step is cheaper), and the next drafting step adopts them
    anew: rows joining and leaving across the switches, oracle drafts that get rejected,
    greedy and seeded rows, with and without --kv-bits: the tokens of speculation off."""
    from mlx_lm import load

    from servicer.engine.speculation.caches import RaggedKVCache, RingKVCache

    model, tokenizer = load(str(demo_model_path(kind)))
    draft_three_steps_then_stop_three(monkeypatch)

    def jobs(seeded: bool) -> list[Job]:
        rows = (lambda: make_row_cache(model, 8, 32)) if quantized else None
        out = random_jobs(tokenizer, 13, 3, caches=rows)
        if seeded:
            for i, job in enumerate(out):
                job.sampler = SeededSampler(SamplingSpec(temperature=0.7, seed=60 + i), 512)
        return out

    own = (RaggedKVCache, RingKVCache)  # recurrent state steps the same either way and stays

    def check(seeded: bool) -> None:
        plain = drive(plain_generator(model), jobs(seeded))
        runner = speculating(model, Oracle(references(jobs(seeded), plain)), costed=True)
        held: list[bool] = []

        def look(step: int) -> None:
            caches = runner.decoding.prompt_cache
            held.append(any(isinstance(c, own) for c in caches))

        assert_same(plain, drive(runner, jobs(seeded), on_step=look))
        assert runner.speculation.speculative_steps > 0
        released = [a and not b for a, b in itertools.pairwise(held)]
        assert sum(released) >= 2, held  # back to mlx-lm's caches, more than once

    check(seeded=False)
    check(seeded=True)
