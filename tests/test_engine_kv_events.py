"""The prefix store's block events, as the engine hands them out: every full block that enters
or leaves RAM or the disk tier, named as the router names it (chained keys), and nothing for
tails."""

from __future__ import annotations

import pytest
from test_engine_embed import MODES, Collected, greedy_request, start_engine
from test_prefix_store import text_tokens

from servicer.engine import EngineConfig
from servicer.engine.prefix.keys import ROOT, block_key, block_keys
from servicer.messages import KvBlockEvent

BLOCK = 64


def _config(**engine) -> EngineConfig:
    return EngineConfig(prompt_cache_block=BLOCK, **engine)


def _serve(engine, collected: Collected, ticket: int, prompt: list[int], max_tokens: int = 4):
    engine.submit(greedy_request(ticket, prompt, max_tokens, BLOCK))
    collected.wait_finished({ticket})


def _events(collected: Collected, kind: str, tier: str) -> list[KvBlockEvent]:
    with collected._cond:
        return [e for e in collected.kv_events if e.kind == kind and e.tier == tier]


def _check_named(event: KvBlockEvent) -> None:
    """A full block, named by its parent's key and its tokens."""
    assert len(event.tokens) == BLOCK
    assert event.block_key == block_key(event.parent_key or ROOT, event.tokens)


@pytest.mark.parametrize("mode", MODES)
def test_a_served_prompt_reports_its_blocks_stored_in_ram_as_a_chain(mode, demo_dir, reference):
    engine, collected = start_engine(mode, demo_dir, _config())
    try:
        prompt = text_tokens(reference, 5 * BLOCK + 20, salt=21)
        _serve(engine, collected, 1, prompt)
        keys = block_keys(prompt, BLOCK)
        collected.wait(lambda: len(_events(collected, "stored", "ram")) >= len(keys))
    finally:
        engine.shutdown(30)
    stored = _events(collected, "stored", "ram")
    for event in stored:
        _check_named(event)
    # The prompt's blocks first, in order, each chained to the one before.
    assert [e.block_key for e in stored[: len(keys)]] == list(keys)
    assert [e.parent_key for e in stored[: len(keys)]] == [b"", *keys[:-1]]
    for i, event in enumerate(stored[: len(keys)]):
        assert list(event.tokens) == prompt[i * BLOCK : (i + 1) * BLOCK]
    assert not [e for e in collected.kv_events if e.kind != "stored"]


def test_blocks_evicted_from_ram_are_reported_removed(demo_dir, reference):
    engine, collected = start_engine("thread", demo_dir, _config(prompt_cache_size=4))
    try:
        first = text_tokens(reference, 4 * BLOCK + 10, salt=22)
        second = text_tokens(reference, 4 * BLOCK + 10, salt=23)
        _serve(engine, collected, 1, first)
        _serve(engine, collected, 2, second)
        collected.wait(lambda: len(_events(collected, "removed", "ram")) >= 3)
    finally:
        engine.shutdown(30)
    stored = {e.block_key for e in _events(collected, "stored", "ram")}
    removed = _events(collected, "removed", "ram")
    assert {e.block_key for e in removed} <= stored
    assert set(block_keys(first, BLOCK)) & {e.block_key for e in removed}
    for event in removed:
        assert event.tokens == () and event.block_key == block_key(
            event.parent_key or ROOT, _tokens_of(collected, event.block_key)
        )
    assert not _events(collected, "stored", "disk")


def _tokens_of(collected: Collected, key: bytes) -> tuple[int, ...]:
    return next(e.tokens for e in collected.kv_events if e.kind == "stored" and e.block_key == key)


@pytest.mark.parametrize("mode", MODES)
def test_blocks_written_to_the_disk_tier_are_reported_on_disk(mode, demo_dir, reference, tmp_path):
    config = _config(prompt_cache_size=4, prompt_cache_dir=str(tmp_path))
    engine, collected = start_engine(mode, demo_dir, config)
    try:
        first = text_tokens(reference, 4 * BLOCK + 10, salt=24)
        _serve(engine, collected, 1, first)
        _serve(engine, collected, 2, text_tokens(reference, 4 * BLOCK + 10, salt=25))
        collected.wait(lambda: len(_events(collected, "stored", "disk")) >= 2)
    finally:
        engine.shutdown(30)
    on_disk = _events(collected, "stored", "disk")
    for event in on_disk:
        _check_named(event)
    by_key = {e.block_key: e for e in on_disk}
    spilled = [key for key in block_keys(first, BLOCK) if key in by_key]
    assert spilled
    left_ram = {e.block_key for e in _events(collected, "removed", "ram")}
    assert set(spilled) <= left_ram


def test_blocks_leaving_the_disk_tier_are_reported_removed_from_disk(demo_dir, reference, tmp_path):
    # A disk tier of one byte keeps nothing: each written block leaves it at once.
    config = _config(prompt_cache_size=2, prompt_cache_dir=str(tmp_path), prompt_cache_disk_bytes=1)
    engine, collected = start_engine("thread", demo_dir, config)
    try:
        _serve(engine, collected, 1, text_tokens(reference, 4 * BLOCK + 10, salt=26))
        collected.wait(lambda: len(_events(collected, "removed", "disk")) >= 1)
    finally:
        engine.shutdown(30)
    stored = {e.block_key for e in _events(collected, "stored", "disk")}
    assert {e.block_key for e in _events(collected, "removed", "disk")} <= stored
