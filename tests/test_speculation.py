"""Speculative decoding in the continuous batch: the same tokens as without it (real MLX, the
demo llama; differential against mlx-lm's own BatchGenerator)."""

from __future__ import annotations

from typing import Any
from unittest.mock import patch

import mlx.core as mx
import pytest
from mlx_lm.generate import StopSequences
from mlx_lm.models.cache import ChunkedKVCache
from mlx_lm.sample_utils import make_logits_processors
from spec_support import (
    Job,
    drive,
    passages,
    perturbed_copy,
    plain_generator,
    repeat_prompt,
    runner_kwargs,
)

from servicer.demos.text import demo_model_path
from servicer.engine.sampling import SeededSampler
from servicer.engine.speculation import (
    PromptLookup,
    SpeculationConfig,
    SpeculativeRunner,
    speculation_supported,
)
from servicer.engine.speculation.draft_model import DraftModel, check_draft_compatible
from servicer.messages import SamplingSpec


@pytest.fixture(scope="module")
def demo() -> tuple[Any, Any]:
    from mlx_lm import load

    return load(str(demo_model_path("llama")))


@pytest.fixture(scope="module")
def prompts(demo) -> list[list[int]]:
    _, tokenizer = demo
    return [repeat_prompt(tokenizer, text) for text in passages()[:6]]


@pytest.fixture(scope="module")
def other_draft() -> Any:
    return perturbed_copy(demo_model_path("llama"))


def speculating(model: Any, source: str | Any, **config: Any) -> SpeculativeRunner:
    if source == "ngram":
        source = PromptLookup()
    elif source == "self":
        source = DraftModel(model)
    config.setdefault("costed", False)  # draft whenever a row can: these test exactness
    return SpeculativeRunner(
        model, source=source, speculation=SpeculationConfig(**config), **runner_kwargs()
    )


def schedule(prompts: list[list[int]], batch: int) -> list[Job]:
    """`batch` rows from the start; at batch 4 two more join mid-speculation and one leaves
    early. Odd max_tokens so the length cut lands inside accepted drafts."""
    lengths = [41, 36, 47, 29, 38, 33]
    jobs = [Job(f"r{i}", prompts[i], lengths[i]) for i in range(batch)]
    if batch > 1:
        jobs[1].remove_after = 9
        jobs += [Job("late0", prompts[4], 35, join_at=4), Job("late1", prompts[5], 26, join_at=7)]
    return jobs


def assert_same(plain: dict, spec: dict) -> None:
    for name, want in plain.items():
        got = spec[name]
        if want.removed:  # removed after a number of steps: spec may have gone further
            n = min(len(want.tokens), len(got.tokens))
            assert n >= 9 and got.tokens[:n] == want.tokens[:n], name
            continue
        assert got.tokens == want.tokens, name
        assert (got.finish, got.all_tokens) == (want.finish, want.all_tokens), name


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("source", ["ngram", "self", "other"])
def test_greedy_equals_no_speculation(demo, prompts, other_draft, source, batch):
    model, _ = demo
    jobs = schedule(prompts, batch)
    plain = drive(plain_generator(model), jobs)
    draft = DraftModel(other_draft) if source == "other" else source
    runner = speculating(model, draft)
    spec = drive(runner, schedule(prompts, batch))
    assert_same(plain, spec)
    stats = runner.speculation
    assert stats.drafted > 0 and stats.accepted > 0
    assert stats.emitted == sum(len(r.tokens) for r in spec.values())
    if source == "self":  # a model agrees with itself
        assert stats.accepted == stats.drafted
    if source == "other":  # a different draft: some rejected, so rollback is exercised
        assert 0 < stats.accepted < stats.drafted
    assert max(stats.per_row_step) > 1


def test_finished_rows_carry_exactly_their_tokens(demo, prompts):
    """all_tokens and prompt_cache hold the prompt and every emitted token, nothing drafted
    past a stop or max_tokens."""
    model, _ = demo
    reference = drive(plain_generator(model), [Job("a", prompts[0], 40)])["a"].tokens
    stop = reference[17]
    cut = reference.index(stop) + 1
    jobs = [
        Job("stop", prompts[0], 40, stop=StopSequences([[stop]])),
        Job("length", prompts[0], 23),
    ]
    plain = drive(plain_generator(model), jobs)
    spec = drive(speculating(model, "self", k_max=6), jobs)
    assert_same(plain, spec)
    assert spec["stop"].finish == "stop" and len(spec["stop"].tokens) == cut
    assert spec["length"].finish == "length" and len(spec["length"].tokens) == 23
    for name in ("stop", "length"):
        want, got = plain[name], spec[name]
        assert got.all_tokens == prompts[0] + got.tokens
        for a, b in zip(want.cache, got.cache, strict=True):
            assert a.offset == b.offset == len(got.all_tokens)
            assert mx.allclose(a.keys[..., : a.offset, :], b.keys[..., : b.offset, :], atol=1e-4)


def test_logprobs_are_the_targets(demo, prompts):
    model, _ = demo
    jobs = schedule(prompts, 4)
    plain = drive(plain_generator(model), jobs)
    spec = drive(speculating(model, "self"), schedule(prompts, 4))
    for name, want in plain.items():
        got = spec[name]
        n = min(len(want.logprobs), len(got.logprobs))
        assert mx.allclose(mx.stack(want.logprobs[:n]), mx.stack(got.logprobs[:n]), atol=1e-4)


def seeded_jobs(prompts: list[list[int]]) -> list[Job]:
    specs = [
        SamplingSpec(temperature=0.7, seed=11),
        SamplingSpec(temperature=1.0, top_p=0.9, seed=12),
        SamplingSpec(temperature=0.9, top_k=20, min_p=0.05, seed=13),
    ]
    return [
        Job(f"s{i}", prompts[i], 40, join_at=2 * i, sampler=SeededSampler(spec, 512))
        for i, spec in enumerate(specs)
    ]


@pytest.mark.parametrize("source", ["ngram", "self"])
def test_seeded_rows_reproduce_and_match_no_speculation(demo, prompts, source):
    """A seeded row draws each position with its own next key, whatever was drafted, so it
    reproduces run to run and emits what it emits without speculation."""
    model, _ = demo
    plain = drive(plain_generator(model), seeded_jobs(prompts))
    runner = speculating(model, source, max_rows=8)
    first = drive(runner, seeded_jobs(prompts))
    again = drive(speculating(model, source, max_rows=8), seeded_jobs(prompts))
    assert {n: r.tokens for n, r in first.items()} == {n: r.tokens for n, r in again.items()}
    assert_same(plain, first)
    stats = runner.speculation  # drafts were verified, and sampling rejected some
    assert stats.drafted > 0 and 0 < stats.accepted < stats.drafted


def test_rows_with_logits_processors_do_not_draft(demo, prompts):
    model, _ = demo
    penalty = make_logits_processors(repetition_penalty=1.3)
    jobs = [Job("p", prompts[0], 30, processors=penalty), Job("q", prompts[1], 30)]
    plain = drive(plain_generator(model), jobs)
    penalty = make_logits_processors(repetition_penalty=1.3)  # processors keep state
    jobs = [Job("p", prompts[0], 30, processors=penalty), Job("q", prompts[1], 30)]
    runner = speculating(model, "self")
    spec = drive(runner, jobs)
    assert_same(plain, spec)
    stats = runner.speculation
    assert 0 < stats.accepted == stats.drafted  # the other row still speculated


def test_batch_cutoff_runs_steps_without_drafts(demo, prompts):
    model, _ = demo
    jobs = schedule(prompts, 4)
    plain = drive(plain_generator(model), jobs)
    runner = speculating(model, "self", max_rows=2)
    spec = drive(runner, schedule(prompts, 4))
    assert_same(plain, spec)
    stats = runner.speculation
    assert stats.cutoff_steps > 0 and stats.speculative_steps > 0
    # The draft caught up on the steps it skipped: a model still agrees with itself.
    assert stats.accepted == stats.drafted


def test_every_cache_kind_is_supported_and_others_are_named():
    from mlx_lm import load

    for kind in ("llama", "hybrid", "gemma3"):
        assert speculation_supported(load(str(demo_model_path(kind)))[0]) == (True, "")
    model, _ = load(str(demo_model_path("llama")))
    chunked = ChunkedKVCache(64)
    with patch.object(type(model), "make_cache", lambda self: [chunked, chunked], create=True):
        supported, reason = speculation_supported(model)
        assert not supported and "ChunkedKVCache" in reason
        with pytest.raises(ValueError, match="ChunkedKVCache"):
            SpeculativeRunner(model, source=PromptLookup())
    hybrid, _ = load(str(demo_model_path("hybrid")))
    with pytest.raises(ValueError, match="ArraysCache"):
        DraftModel(hybrid)


def test_draft_tokenizer_must_match(demo):
    from mlx_lm import load

    _, tokenizer = demo
    _, same = load(str(demo_model_path("llama")))
    check_draft_compatible(tokenizer, same)
    same._tokenizer.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
    with pytest.raises(ValueError, match="vocabularies differ"):
        check_draft_compatible(tokenizer, same)
