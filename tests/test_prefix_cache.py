"""Prefix reuse: cached_tokens, identical greedy output with and without a hit, the cache shapes
that crash other MLX servers, and the admission guard."""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from conftest import demo_config
from support import ServerThread, generate, server_info, wait_until

from servicer.demos.text import TEST_PROMPTS
from servicer.messages import PrefixCacheStats as Stats

N = 24


def _long_prompt(reference, tokens: int, salt: int = 0) -> list[int]:
    text = " ".join(TEST_PROMPTS[(i + salt) % len(TEST_PROMPTS)] for i in range(400))
    ids = reference.encode(text)
    assert len(ids) >= tokens
    return ids[:tokens]


@pytest.fixture
def fresh(demo_dir) -> Iterator[ServerThread]:
    """A server with an empty prefix cache."""
    with ServerThread(demo_config(demo_dir)) as running:
        yield running


def test_shared_prefix_is_reused_and_output_is_unchanged(fresh, reference):
    first_prompt = _long_prompt(reference, 1500)
    second_prompt = first_prompt + _long_prompt(reference, 20, salt=3)
    with fresh.channel() as chan:
        first = generate(chan, first_prompt, temperature=0, max_tokens=N, ignore_eos=True)
        second = generate(chan, second_prompt, temperature=0, max_tokens=N, ignore_eos=True)
    assert first.complete.cached_tokens == 0
    assert second.complete.cached_tokens >= 1400
    assert all(c.cached_tokens == second.complete.cached_tokens for c in second.chunks)
    assert first.tokens == reference.greedy(first_prompt, N)
    assert second.tokens == reference.greedy(second_prompt, N)  # what a cold server gives
    assert wait_until(lambda: (fresh.server.prefix_stats() or Stats()).hits >= 1)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "unary"])
def test_the_exact_same_prompt_twice(fresh, reference, stream):
    prompt = _long_prompt(reference, 300, salt=1)
    with fresh.channel() as chan:
        runs = [
            generate(chan, prompt, stream=stream, temperature=0, max_tokens=N, ignore_eos=True)
            for _ in range(3)
        ]
    assert [r.error for r in runs] == [None] * 3
    assert runs[0].complete.cached_tokens == 0
    assert [r.complete.cached_tokens for r in runs[1:]] == [len(prompt) - 1] * 2
    assert [r.tokens for r in runs] == [reference.greedy(prompt, N)] * 3


def test_concurrent_hits_and_misses_with_different_lengths(fresh, reference):
    """32+ concurrent requests, different prompt lengths, some sharing cached prefixes."""
    rng = random.Random(3)
    bases = [_long_prompt(reference, n, salt=i) for i, n in enumerate((40, 130, 260, 520))]
    with fresh.channel() as chan:
        for base in bases[:2]:  # warm two of the four prefixes
            generate(chan, base, temperature=0, max_tokens=2, ignore_eos=True)
        prompts = []
        for i in range(40):
            base = bases[i % 4]
            prompts.append([*base[: rng.randrange(len(base) // 2, len(base))], 10 + i, 20 + i])

        def run(prompt):
            return generate(chan, prompt, temperature=0, max_tokens=12, ignore_eos=True)

        with ThreadPoolExecutor(40) as pool:
            outcomes = list(pool.map(run, prompts))
    assert [o.error for o in outcomes] == [None] * 40
    assert sum(o.complete.cached_tokens > 0 for o in outcomes) >= 10
    assert sum(o.complete.cached_tokens == 0 for o in outcomes) >= 1
    for prompt, outcome in zip(prompts, outcomes, strict=True):
        assert outcome.tokens == reference.greedy(prompt, 12)


def test_prefix_reuse_can_be_turned_off(demo_dir, reference):
    config = demo_config(demo_dir, prompt_cache_size=0)
    prompt = _long_prompt(reference, 200, salt=2)
    with ServerThread(config) as running, running.channel() as chan:
        runs = [generate(chan, prompt, temperature=0, max_tokens=4) for _ in range(2)]
    assert [r.complete.cached_tokens for r in runs] == [0, 0]


def test_admission_guard_refuses_what_cannot_fit_and_queues_what_can_later(demo_dir, reference):
    # The demo model's cache costs 2 layers x 2 kv heads x 32 dims x (K+V): 512 B/token in
    # bf16 (1 KiB in fp32), allocated 256 tokens at a time. 1 MiB fits one request of up to
    # 1024-2048 tokens, never one of 4096.
    config = demo_config(demo_dir, max_kv_memory=1 << 20, prompt_cache_size=0)
    prompt = reference.encode(TEST_PROMPTS[0])
    with ServerThread(config) as running, running.channel() as chan:
        too_big = generate(chan, prompt, max_tokens=4000)
        assert too_big.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        details = too_big.error.details()
        assert "MiB of KV cache" in details and "allows 1.0 MiB" in details
        assert f"{len(prompt)} prompt + 4000 new tokens" in details
        errors = running.server.metrics.registry.get_sample_value(
            "mlx_worker_errors_total", {"kind": "kv_memory"}
        )
        assert errors == 1

        def run(i):
            return generate(chan, prompt, temperature=0, max_tokens=700, ignore_eos=True)

        with ThreadPoolExecutor(3) as pool:  # each fits alone; together they take turns
            outcomes = list(pool.map(run, range(3)))
        expected = reference.greedy(prompt, 700)
        assert [o.tokens for o in outcomes] == [expected] * 3
        assert wait_until(lambda: server_info(chan).active_requests == 0)
