"""Decoding rows of very different lengths in attention groups (servicer/engine/row_groups.py):
the same tokens as mlx-lm's one padded batch, on every covered demo kind (llama; gemma3 with
its sliding windows), greedy and seeded, long prompts joining short streams and leaving again,
speculation drafting across groups, `--kv-bits 8`; and the choice of group on its own."""

from __future__ import annotations

import itertools
import random
from typing import Any

import mlx.core as mx
import pytest
from conftest import KIND_MODEL_KINDS, kind_model_kinds
from spec_support import (
    Job,
    draft_three_steps_then_stop_three,
    drive,
    passages,
    plain_generator,
    runner_kwargs,
)
from support import SLOW

from servicer.demos.text import demo_model_path
from servicer.engine import fused_prefill
from servicer.engine.cache_kinds import grouped, make_row_cache
from servicer.engine.row_groups import MAX_GROUPS, MIN_SPLIT_SLOTS, RowGroups, choose_group
from servicer.engine.runner import BatchRunner
from servicer.engine.sampling import SeededSampler
from servicer.engine.speculation import PromptLookup, SpeculationConfig, SpeculativeRunner
from servicer.messages import SamplingSpec


def mixed_jobs(tokenizer: Any, seed: int, seeded: bool = False) -> list[Job]:
    """Three to five short rows decoding from the start, then prompts long enough for a group
    of their own (1,200-2,000 tokens) arriving while they decode, and short ones after them
    that join the short rows' group; random lengths."""
    rng = random.Random(seed)
    ids = [t for text in passages() for t in tokenizer.encode(text, add_special_tokens=False)]
    ids = ids * (1 + 2_100 // len(ids))

    def prompt(length: int) -> list[int]:
        start = rng.randrange(len(ids) - length)
        return ids[start : start + length]

    jobs = [
        Job(f"s{i}", prompt(rng.randint(5, 40)), rng.randint(30, 70))
        for i in range(rng.randint(3, 5))
    ]
    step = rng.randint(1, 4)
    for i in range(rng.randint(1, 2)):
        jobs.append(
            Job(f"long{i}", prompt(rng.randint(1_200, 2_000)), rng.randint(4, 16), join_at=step)
        )
        step += rng.randint(2, 10)
    jobs.append(Job("late", prompt(rng.randint(5, 40)), rng.randint(5, 20), join_at=step))
    if seeded:
        for i, job in enumerate(jobs):
            spec = SamplingSpec(temperature=0.9, seed=seed * 100 + i, top_k=40)
            job.sampler = SeededSampler(spec, 512)
    return jobs


def grouping_runner(model: Any, **overrides: Any) -> BatchRunner:
    return BatchRunner(model, grouping=grouped, **{**runner_kwargs(), **overrides})


def most_groups(runner: BatchRunner) -> list[int]:
    """A probe for `drive`'s on_step: records the groups of the batch's grouped layers."""
    seen: list[int] = []

    def probe(_: int) -> None:
        layers = [c for c in runner.decoding.prompt_cache if isinstance(c, RowGroups)]
        seen.append(max((len(c.groups) for c in layers), default=0))

    probe.seen = seen  # type: ignore[attr-defined]
    return probe  # type: ignore[return-value]


# make test's slice of test_groups_give_the_same_tokens: (kind, seeded, seed).
SAME_TOKENS_FAST = {("llama", False, 0), ("gemma3", True, 0)}


@pytest.mark.parametrize(
    ("kind_model", "seeded", "seed"),
    [
        pytest.param(
            kind,
            seeded,
            seed,
            id=f"{kind}-{'seeded' if seeded else 'greedy'}-{seed}",
            marks=() if (kind, seeded, seed) in SAME_TOKENS_FAST else SLOW,
        )
        for kind in KIND_MODEL_KINDS
        for seeded in (False, True)
        for seed in range(2)
    ],
    indirect=["kind_model"],
)
def test_groups_give_the_same_tokens(kind_model, seeded, seed):
    _, model, tokenizer = kind_model
    plain = drive(plain_generator(model), mixed_jobs(tokenizer, seed, seeded))
    runner = grouping_runner(model)
    probe = most_groups(runner)
    got = drive(runner, mixed_jobs(tokenizer, seed, seeded), probe)
    assert max(probe.seen) >= 2, "no step ran with its rows in two groups"
    for name, want in plain.items():
        assert got[name].tokens == want.tokens, name
        assert got[name].finish == want.finish, name
        assert got[name].all_tokens == want.all_tokens, name


def repeating_jobs(tokenizer: Any, seed: int) -> list[Job]:
    """`mixed_jobs` whose first three prompts repeat (something for prompt lookup to find)."""
    out = mixed_jobs(tokenizer, seed)
    for job in out[:3]:
        job.prompt = job.prompt + job.prompt
    return out


def speculating_in_groups(model: Any, costed: bool) -> SpeculativeRunner:
    return SpeculativeRunner(
        model,
        source=PromptLookup(),
        speculation=SpeculationConfig(costed=costed, max_rows=16),
        grouping=grouped,
        **runner_kwargs(),
    )


@kind_model_kinds("gemma3")
def test_groups_beside_speculation(kind_model):
    """Rows drafting in both groups: verify forwards of several tokens, per-row rollback."""
    _, model, tokenizer = kind_model
    plain = drive(plain_generator(model), repeating_jobs(tokenizer, 7))
    runner = speculating_in_groups(model, costed=False)
    probe = most_groups(runner)
    speculated = drive(runner, repeating_jobs(tokenizer, 7), probe)
    assert max(probe.seen) >= 2 and runner.speculation.drafted > 0
    for name, want in plain.items():
        assert speculated[name].tokens == want.tokens, name


@kind_model_kinds("gemma3")
def test_groups_beside_speculation_that_stops_and_starts(kind_model, monkeypatch):
    """The mode clock switching drafting off and on (three steps each): each time it stops,
    every group's caches that roll back become mlx-lm's again, group by group, and the
    groups stay as they were."""
    from mlx_lm.models.cache import BatchKVCache

    _, model, tokenizer = kind_model
    draft_three_steps_then_stop_three(monkeypatch)
    plain = drive(plain_generator(model), repeating_jobs(tokenizer, 9))
    runner = speculating_in_groups(model, costed=True)
    released_in_groups = []

    def probe(_: int) -> None:
        layers = [c for c in runner.decoding.prompt_cache if isinstance(c, RowGroups)]
        if layers and len(layers[0].groups) >= 2:
            released_in_groups.append(all(type(g) is BatchKVCache for g in layers[0].groups))

    speculated = drive(runner, repeating_jobs(tokenizer, 9), probe)
    assert runner.speculation.drafted > 0
    pairs = itertools.pairwise(released_in_groups)
    assert any(not before and after for before, after in pairs)  # released, in two groups
    for name, want in plain.items():
        assert speculated[name].tokens == want.tokens, name


@kind_model_kinds("llama")
def test_groups_beside_fused_prefill(kind_model):
    """A prompt's chunk packed into the forward of decoding rows that are in groups."""
    _, model, tokenizer = kind_model

    def jobs() -> list[Job]:
        """Short rows, a long one decoding in its own group, then another long prompt whose
        chunks are packed into the forward of the two groups."""
        rng = random.Random(5)
        ids = [t for text in passages() for t in tokenizer.encode(text, add_special_tokens=False)]
        ids = ids * (1 + 1_600 // len(ids))
        out = [Job(f"s{i}", ids[i * 50 : i * 50 + 20], 80) for i in range(3)]
        start = rng.randrange(len(ids) - 1_500)
        out.append(Job("long0", ids[start : start + 1_500], 60, join_at=1))
        out.append(Job("long1", ids[start + 7 : start + 1_407], 6, join_at=14))
        return out

    plain = drive(plain_generator(model, prefill_step_size=256), jobs())
    runner = grouping_runner(model, prefill_step_size=256, fuse_prefill=True)
    fused_in_groups = []
    groups = most_groups(runner)

    def probe(step: int) -> None:
        before = runner.fused_steps
        groups(step)
        fused_in_groups.append((before, groups.seen[-1]))  # type: ignore[attr-defined]

    got = drive(runner, jobs(), probe)
    counts = [f for f, _ in fused_in_groups]
    grouped_fused = [
        g for (f, g), prev in zip(fused_in_groups[1:], counts, strict=False) if f > prev
    ]
    assert any(g >= 2 for g in grouped_fused), fused_in_groups
    for name, want in plain.items():
        assert got[name].tokens == want.tokens, name


@SLOW  # ~12 s; quantized caches in groups: also test_speculation_kinds, test_kv_quant_server
def test_groups_with_a_quantized_cache():
    from mlx_lm import load

    model, tokenizer = load(str(demo_model_path("llama")))
    assert fused_prefill.enable_fused_prefill(model)

    def rows(jobs: list[Job]) -> list[Job]:
        for job in jobs:
            job.caches = lambda: make_row_cache(model, 8, 32)
        return jobs

    plain = drive(plain_generator(model), rows(mixed_jobs(tokenizer, 3)))
    runner = grouping_runner(model)
    probe = most_groups(runner)
    got = drive(runner, rows(mixed_jobs(tokenizer, 3)), probe)
    assert max(probe.seen) >= 2
    for name, want in plain.items():
        assert got[name].tokens == want.tokens, name


def test_a_long_row_joins_without_padding_the_others(kind_model):
    """The short rows' attention keys stay their own length while a long row decodes."""
    _, model, tokenizer = kind_model
    runner = grouping_runner(model)
    widths: list[list[int]] = []

    def probe(_: int) -> None:
        layers = [c for c in runner.decoding.prompt_cache if isinstance(c, RowGroups)]
        if layers:
            widths.append(sorted(g.size() for g in layers[0].groups))

    drive(runner, mixed_jobs(tokenizer, 1), probe)
    two = [w for w in widths if len(w) == 2]
    assert two and all(w[0] < 200 for w in two), widths


def test_the_choice_of_group():
    # Nothing yet: a group of its own.
    assert choose_group([], 1, 8_000) is None
    # A long prompt beside short streams: its own group.
    assert choose_group([(8, 300)], 1, 8_000) is None
    # Rows of about the same length join.
    assert choose_group([(8, 300)], 1, 280) == 0
    assert choose_group([(8, 300), (1, 8_000)], 1, 7_000) == 1
    # Little padding in all (below MIN_SPLIT_SLOTS) joins, whatever the ratio.
    assert choose_group([(1, 10)], 1, MIN_SPLIT_SLOTS // 4) == 0
    # At the cap, rows join where they cost least.
    groups = [(1, 100 * 4**g) for g in range(MAX_GROUPS)]
    assert choose_group(groups, 1, 30_000) == MAX_GROUPS - 1


@kind_model_kinds("gemma3")
def test_filter_and_extract_follow_the_rows(kind_model):
    """Rows leaving from either group keep every other row's cache as it was."""
    _, model, tokenizer = kind_model
    runner = grouping_runner(model)
    jobs = mixed_jobs(tokenizer, 2)
    results = drive(runner, jobs)
    plain = drive(plain_generator(model), mixed_jobs(tokenizer, 2))
    for name, want in plain.items():
        got = results[name].cache
        assert [c.offset for c in got] == [c.offset for c in want.cache], name
        for a, b in zip(got, want.cache, strict=True):
            if getattr(a, "keys", None) is not None and not isinstance(a.keys, tuple):
                n = a.offset if isinstance(a.offset, int) else None
                assert mx.allclose(a.keys[..., :n, :], b.keys[..., :n, :], atol=1e-5).item(), name


def test_groups_are_on_by_default_and_can_be_turned_off():
    from servicer.cli import config_from_args, parse_args

    assert config_from_args(parse_args([])).engine.group_rows
    assert not config_from_args(parse_args(["--no-group-rows"])).engine.group_rows


@pytest.mark.parametrize("on", [True, False], ids=["default", "off"])
def test_the_engine_groups_rows_unless_told_not_to(demo_dir, on):
    from servicer.engine import Engine, EngineConfig
    from servicer.model_files import ModelSpec, prepare_model_files
    from servicer.outbox import Outbox

    engine = Engine(EngineConfig(prompt_cache_size=0, group_rows=on), Outbox(lambda: None))
    engine.start(prepare_model_files(ModelSpec(str(demo_dir))).info)
    try:
        engine.wait_ready(120)
        loop = engine._loop
        assert loop is not None and loop.parts.group_rows is on
        batch = loop.batch.runner.decoding
        assert (getattr(batch, "grouping", None) is not None) is on
    finally:
        engine.shutdown(30)
