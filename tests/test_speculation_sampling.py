"""Speculation keeps the sampling distribution: the accept/reject rules on synthetic
distributions, and thousands of sampled continuations with and without speculation."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import greedy_sampler
from spec_support import goodness_of_fit, passages, replicated_batch, two_sample_chi_square

from servicer.demo_model import demo_model_path
from servicer.engine.sampling import RandomKeys, _Sampler
from servicer.engine.speculation import PromptLookup, SpeculationConfig, Speculator
from servicer.engine.speculation.batch import SpeculativeGenerationBatch
from servicer.engine.speculation.draft_model import DraftModel
from servicer.engine.speculation.verify import accept_sampled, choose
from servicer.messages import SamplingSpec

SAMPLES = 2000
SPEC = SamplingSpec(temperature=0.9, top_p=0.95)


@pytest.fixture(scope="module")
def demo() -> tuple[Any, Any]:
    from mlx_lm import load

    return load(str(demo_model_path("llama")))


def first_tokens(model: Any, prompt: list[int], source: Any, seed: int) -> tuple[list, Any]:
    """The first three tokens of SAMPLES rows sharing one unseeded sampler."""
    sampler = _Sampler(SPEC, 512, RandomKeys(seed))
    batch = replicated_batch(model, prompt, SAMPLES, sampler, max_tokens=3)
    if source is not None:
        speculator = Speculator(source, SpeculationConfig(max_rows=SAMPLES, k_max=2, costed=False))
        spec = SpeculativeGenerationBatch.start(model, greedy_sampler, speculator)
        spec.extend(batch)
        batch = spec
    tokens: dict[int, list[int]] = {}
    while len(batch):
        for response in batch.next():
            tokens.setdefault(response.uid, []).append(response.token)
    return [tokens[uid] for uid in sorted(tokens)], source and speculator.counters


@pytest.fixture(scope="module")
def prompts(demo) -> dict[str, list[int]]:
    """For prompt lookup, text that repeats (so drafts exist); for the draft model, a short
    prompt (the draft prefills every row: keep that cheap)."""
    ids = list(demo[1].encode(passages()[1], add_special_tokens=False))
    return {"ngram": ids[:6] + ids[:3], "draft": ids[:3]}


@pytest.fixture(scope="module")
def plain(demo, prompts) -> dict[str, list[list[int]]]:
    return {name: first_tokens(demo[0], p, None, seed=3)[0] for name, p in prompts.items()}


@pytest.mark.parametrize("source", ["ngram", "draft"])
def test_sampled_tokens_keep_their_distribution(demo, prompts, plain, source):
    model, _ = demo
    draft = PromptLookup((3, 2, 1)) if source == "ngram" else DraftModel(model)
    spec, counters = first_tokens(model, prompts[source], draft, seed=2)
    assert counters.drafted > 100 and 0 < counters.accepted < counters.drafted
    for position in range(3):
        want = [t[position] for t in plain[source]]
        p = two_sample_chi_square(want, [t[position] for t in spec])
        assert p > 0.01, (position, p)


def _synthetic(vocab: int, rows: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(rows, vocab)) * 1.5
    return np.exp(logits) / np.exp(logits).sum(axis=-1, keepdims=True)


def test_one_hot_draft_rule_reproduces_p():
    """A deterministic draft d is accepted with probability p(d); after a rejection the
    token is distributed as p without d, renormalised; so emitted tokens follow p."""
    vocab, trials, draft = 8, 20000, 3
    p = _synthetic(vocab, 1, seed=0)[0]
    logprobs = mx.broadcast_to(mx.log(mx.array(p, dtype=mx.float32)), (trials, 1, vocab))
    sampler = _Sampler(SamplingSpec(temperature=1.0), vocab, RandomKeys(5))
    (draws,) = [mx.stack(choose(logprobs, [sampler] * trials, [1] * trials))]
    draws = draws[:, 0].tolist()
    accepted = sum(d == draft for d in draws)
    assert abs(accepted / trials - p[draft]) < 4 * np.sqrt(p[draft] * (1 - p[draft]) / trials)
    rejected = [d for d in draws if d != draft]
    without = p.copy()
    without[draft] = 0
    assert goodness_of_fit(rejected, without / without.sum()) > 0.01
    assert goodness_of_fit(draws, p) > 0.01


def test_sampled_draft_rule_reproduces_p():
    """min(1, p/q) acceptance and the max(0, p - q) residual: the first emitted token
    follows p whatever q is, and the first draft is accepted with sum(min(p, q))."""
    vocab, k, trials = 6, 2, 3000
    p = _synthetic(vocab, k + 1, seed=1)
    q = _synthetic(vocab, k, seed=2)
    rng = np.random.default_rng(3)
    p_mx, q_mx = mx.array(p, dtype=mx.float32), mx.array(q, dtype=mx.float32)
    first, accepted = [], 0
    for trial in range(trials):
        drafts = [int(rng.choice(vocab, p=q[j])) for j in range(k)]
        n, token = accept_sampled(p_mx, q_mx, drafts, mx.random.key(trial))
        first.append(drafts[0] if n > 0 else int(token.item()))
        accepted += n > 0
    assert goodness_of_fit(first, p[0]) > 0.01
    expected = np.minimum(p[0], q[0]).sum()
    assert abs(accepted / trials - expected) < 4 * np.sqrt(expected * (1 - expected) / trials)
