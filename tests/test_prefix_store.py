"""Prefix reuse in blocks, for every model family: shared system prompts, diverging prompts
and chat turns reuse what they share; a shared prefix is stored once; greedy output with a
hit equals a cold run. Blocks and snapshots every 256 tokens here."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import replace

import pytest
from conftest import Reference, demo_config
from support import ServerThread, generate

from servicer.demos.text import TEST_PROMPTS, demo_model_path
from servicer.kv_events import TIERS

BLOCK = 256
N = 12
KINDS = ["llama", "hybrid", "gemma3"]


def store_config(model_dir, **engine):
    """Thread mode: these tests look into the engine's prefix store."""
    config = demo_config(
        model_dir,
        prompt_cache_block=BLOCK,
        prompt_cache_snapshot_interval=BLOCK,
        **engine,
    )
    return replace(config, engine_mode="thread")


def text_tokens(reference: Reference, tokens: int, salt: int = 0) -> list[int]:
    """`tokens` tokens of demo text; each salt gives another text."""
    rng = random.Random(salt)
    text = " ".join(rng.choice(TEST_PROMPTS) for _ in range(tokens))
    ids = reference.encode(text)
    assert len(ids) >= tokens
    return ids[:tokens]


@pytest.fixture(scope="module", params=KINDS)
def kind(request) -> Iterator[tuple[str, Reference, ServerThread]]:
    model_dir = demo_model_path(request.param)
    reference = Reference(model_dir)
    with ServerThread(store_config(model_dir)) as running:
        yield request.param, reference, running


def _run(running: ServerThread, prompt: list[int], max_tokens: int = N):
    with running.channel() as chan:
        outcome = generate(chan, prompt, temperature=0, max_tokens=max_tokens, ignore_eos=True)
    assert outcome.error is None, outcome.error
    return outcome


def test_a_shared_system_prompt_with_a_new_turn_is_reused(kind):
    name, reference, running = kind
    system = text_tokens(reference, 1500, salt=1)
    _run(running, system + text_tokens(reference, 20, salt=2))
    prompt = system + text_tokens(reference, 20, salt=3)
    second = _run(running, prompt)
    assert second.complete.cached_tokens >= 1280, name
    assert second.tokens == reference.greedy(prompt, N), name


def test_prompts_diverging_at_token_1000_share_what_they_share(kind):
    name, reference, running = kind
    first = text_tokens(reference, 1500, salt=4)
    _run(running, first)
    prompt = first[:1000] + text_tokens(reference, 500, salt=5)
    second = _run(running, prompt)
    assert second.complete.cached_tokens >= 768, name
    assert second.tokens == reference.greedy(prompt, N), name


def test_the_next_chat_turn_reuses_the_previous_prompt_and_output(kind):
    name, reference, running = kind
    prompt = text_tokens(reference, 700, salt=6)
    first = _run(running, prompt, max_tokens=40)
    follow = prompt + first.tokens + text_tokens(reference, 30, salt=7)
    second = _run(running, follow)
    # Everything but the last generated token, which never went through the model.
    assert second.complete.cached_tokens >= len(prompt) + len(first.tokens) - 1, name
    assert second.tokens == reference.greedy(follow, N), name


def test_a_shared_prefix_is_stored_once(kind):
    name, reference, running = kind
    prefix = text_tokens(reference, 1024, salt=8)
    prompts = [prefix + text_tokens(reference, 40, salt=20 + i) for i in range(8)]
    outputs = [_run(running, prompt) for prompt in prompts]
    assert [o.tokens for o in outputs] == [reference.greedy(p, N) for p in prompts]
    assert all(o.complete.cached_tokens >= 1024 for o in outputs[1:]), name
    # The full blocks the store holds, as its block events tell a router (read on the
    # server's loop, which applies them).
    live = running.run(_live_blocks(running))
    pieces = [tuple(prefix[start : start + BLOCK]) for start in range(0, 1024, BLOCK)]
    blocks = [tokens for tokens in live if tokens in pieces]
    assert sorted(blocks) == sorted(pieces), name  # the prefix's 4, once, not once per request


async def _live_blocks(running: ServerThread) -> list[tuple[int, ...]]:
    """The tokens of every block in RAM now (the worker's live blocks, as a router's first
    subscription gets them)."""
    snapshot = running.server.servicer.kv_events.snapshot()  # type: ignore[union-attr]
    return [
        tuple(block.token_ids)
        for event in snapshot.events
        if event.HasField("stored") and event.stored.tier == TIERS["ram"]
        for block in event.stored.blocks
    ]
