"""Flushing the prefix store with requests in flight: both tiers empty at once, one "cleared"
event, the running requests' output unchanged (greedy, as a cold run), and the next repeat of
a prompt a miss, then a hit again."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from test_engine_embed import MODES, Collected, greedy_request, start_engine
from test_prefix_store import text_tokens

from servicer.engine import EngineConfig
from servicer.engine.embedding import Embedder
from servicer.engine.inbox import InboxTake
from servicer.engine.planner import Planner
from servicer.messages import EmbedRequest, FailureKind, StepOutput

BLOCK = 64
LONG = 200  # tokens the in-flight requests generate: they outlive the flush


def _serve(engine, collected: Collected, ticket: int, prompt: list[int], max_tokens: int = 4):
    engine.submit(greedy_request(ticket, prompt, max_tokens, BLOCK))
    collected.wait_finished({ticket})
    return collected.cached[ticket]


def _stats(collected: Collected):
    with collected._cond:
        assert collected.figures is not None and collected.figures.prefix is not None
        return collected.figures.prefix


@pytest.mark.parametrize("mode", MODES)
def test_a_flush_with_requests_in_flight(mode, demo_dir, reference, tmp_path):
    config = EngineConfig(
        prompt_cache_block=BLOCK, prompt_cache_size=6, prompt_cache_dir=str(tmp_path)
    )
    repeat, held, fresh = (text_tokens(reference, 4 * BLOCK + 10, salt=s) for s in (31, 32, 33))
    assert len({tuple(p[:BLOCK]) for p in (repeat, held, fresh)}) == 3
    engine, collected = start_engine(mode, demo_dir, config)
    try:
        _serve(engine, collected, 1, repeat)
        _serve(engine, collected, 2, held)
        collected.wait(lambda: _stats(collected).disk_blocks > 0)  # some went to disk
        in_flight = {3: held + text_tokens(reference, 30, salt=34), 4: fresh}
        for ticket, prompt in in_flight.items():
            engine.submit(greedy_request(ticket, prompt, LONG, BLOCK))
        collected.wait(lambda: all(collected.tokens.get(t) for t in in_flight))
        assert collected.cached[3] >= 4 * BLOCK  # it holds blocks of the store
        engine.flush_cache(99)
        collected.wait(lambda: any(t == 99 for t, _ in collected.flushed))
        (figures,) = [f for t, f in collected.flushed if t == 99]
        assert figures is not None and figures.prefix is not None
        assert figures.prefix.entries == 0 and figures.prefix.disk_blocks == 0
        assert figures.prefix.pinned_blocks == 0
        assert any(e.kind == "cleared" for e in collected.kv_events)  # in the same output
        collected.wait_finished(set(in_flight))
        for ticket, prompt in in_flight.items():
            assert collected.tokens[ticket] == reference.greedy(prompt, LONG)
        assert _serve(engine, collected, 5, repeat) == 0  # flushed: a miss
        assert _serve(engine, collected, 6, repeat) > 0  # and kept again: a hit
        assert collected.tokens[5] == collected.tokens[6] == reference.greedy(repeat, 4)
    finally:
        engine.shutdown(30)
    cleared = [e for e in collected.kv_events if e.kind == "cleared"]
    assert len(cleared) == 1 and cleared[0].block_key == b""


@pytest.mark.parametrize("mode", MODES)
def test_a_flush_without_a_prefix_store_just_reports_done(mode, demo_dir):
    engine, collected = start_engine(mode, demo_dir, EngineConfig(prompt_cache_size=0))
    try:
        engine.flush_cache(7)
        collected.wait(lambda: any(t == 7 for t, _ in collected.flushed))
    finally:
        engine.shutdown(30)
    assert not collected.kv_events and not collected.failures


def test_a_distributed_engine_refuses_embeds_and_flushes():
    """Every rank must do the same at each step, and neither is planned for them: both are
    refused with an answer, and nothing is flushed."""
    flushed = []
    planner = SimpleNamespace(
        _lockstep=object(),
        _embedder=Embedder.of(object(), distributed=True),  # type: ignore[arg-type]
        _store=SimpleNamespace(flush=lambda: flushed.append(True)),
        _embeds=[],
    )
    take = InboxTake([], set(), False, [EmbedRequest(1, [1, 2])], [2])
    out = StepOutput()
    Planner._commands(planner, take, out)  # type: ignore[arg-type]
    assert not flushed and not planner._embeds and not out.flushed
    (embedded,) = out.embeddings
    assert embedded.ticket == 1 and "--distributed" in embedded.error
    (failure,) = out.failures
    assert failure.ticket == 2 and failure.kind == FailureKind.INVALID_ARGUMENT
    assert "--distributed" in failure.message
