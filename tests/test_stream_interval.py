"""`--stream-interval N` and `--stream-window-ms MS`: the first token alone, then chunks of at
least N tokens that waited up to MS for company; the same output either way."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest
from conftest import demo_config
from support import ServerThread, generate
from test_extensions import _spanning_stop

from servicer.cli import config_from_args, parse_args
from servicer.handlers import HandlerOptions
from servicer.outbox import handoff_due

INTERVAL = 4


@pytest.fixture(scope="module")
def interval_server(demo_dir) -> Iterator[ServerThread]:
    config = demo_config(demo_dir)
    config = type(config)(
        engine=config.engine, handlers=HandlerOptions(stream_interval=INTERVAL), port=0
    )
    with ServerThread(config) as running:
        yield running


def test_chunks_hold_the_interval_after_a_first_token_alone(interval_server, reference, prompts):
    with interval_server.channel() as channel:
        for prompt in prompts[:3]:
            outcome = generate(
                channel, prompt, temperature=0, max_tokens=18, ignore_eos=True, logprobs=2
            )
            assert outcome.error is None
            assert outcome.tokens == reference.greedy(prompt, 18)
            sizes = [len(chunk.token_ids) for chunk in outcome.chunks]
            # Alone, unless the handler had not taken it when the next steps ended; held for
            # the interval, it would carry INTERVAL tokens.
            assert sizes[0] < INTERVAL, sizes
            assert all(size >= INTERVAL for size in sizes[1:-1]), sizes
            assert len(sizes) <= 1 + -(-17 // INTERVAL)
            running = 0
            for chunk in outcome.chunks:
                running += len(chunk.token_ids)
                assert chunk.completion_tokens == running
                assert list(chunk.output_logprobs.token_ids) == list(chunk.token_ids)
            assert outcome.complete.finish_reason == "length"
            assert outcome.complete.completion_tokens == 18


def test_a_stop_token_inside_a_chunk_still_ends_there(interval_server, reference, prompts):
    prompt = prompts[1]
    expected = reference.greedy(prompt, 24)
    stop_token = expected[9]
    cut = expected.index(stop_token) + 1
    with interval_server.channel() as channel:
        outcome = generate(
            channel, prompt, temperature=0, max_tokens=24, ignore_eos=True,
            stop_token_ids=[stop_token],
        )  # fmt: skip
    assert outcome.tokens == expected[:cut]
    assert outcome.complete.finish_reason == "stop"
    assert outcome.complete.matched_stop_token_id == stop_token


def test_a_stop_string_is_cut_out_as_with_every_token_sent(interval_server, reference, prompts):
    stop, tokens, full = _spanning_stop(reference, prompts[6])
    with interval_server.channel() as channel:
        outcome = generate(
            channel, prompts[6], temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]
        )
    assert outcome.complete.finish_reason == "stop"
    assert outcome.complete.matched_stop == stop
    assert "".join(c.text for c in outcome.chunks) == full[: full.find(stop)]
    assert outcome.tokens == tokens[: len(outcome.tokens)]
    assert outcome.complete.completion_tokens == len(outcome.tokens)


def test_unary_calls_are_unchanged(interval_server, reference, prompts):
    with interval_server.channel() as channel:
        outcome = generate(
            channel, prompts[2], stream=False, temperature=0, max_tokens=13, ignore_eos=True
        )
    assert list(outcome.complete.output_ids) == reference.greedy(prompts[2], 13)
    assert outcome.complete.finish_reason == "length"


def test_the_flags_reach_the_handlers():
    defaults = config_from_args(parse_args([])).handlers
    assert (defaults.stream_interval, defaults.stream_window_ms) == (1, 10.0)
    args = parse_args(["--stream-interval", "8", "--stream-window-ms", "0"])
    handlers = config_from_args(args).handlers
    assert (handlers.stream_interval, handlers.stream_window_ms) == (8, 0.0)
    for bad in (["--stream-interval", "0"], ["--stream-window-ms", "-1"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_the_window_holds_tokens_back_only_after_the_first_and_never_a_finish():
    rule = {"per_handoff": 1, "window": 0.01}
    assert handoff_due(started=False, pending=1, finished=False, waited=0.0, **rule)
    assert not handoff_due(started=True, pending=3, finished=False, waited=0.005, **rule)
    assert handoff_due(started=True, pending=1, finished=False, waited=0.01, **rule)
    assert handoff_due(started=True, pending=1, finished=True, waited=0.0, **rule)
    assert not handoff_due(started=True, pending=0, finished=False, waited=1.0, **rule)
    counted = {"per_handoff": 4, "window": 0.01}  # both: at least 4 tokens and 10 ms
    assert not handoff_due(started=True, pending=3, finished=False, waited=1.0, **counted)
    assert handoff_due(started=True, pending=4, finished=False, waited=0.01, **counted)


def test_the_window_bounds_each_tokens_wait_not_the_time_since_the_last_message():
    """Steps of 6.4 ms, a 10 ms window: a token held for one more step waits 6.4 ms, so two
    tokens share a message (counting from the last message would send each alone)."""
    from servicer.engine.batch import Row
    from servicer.engine.scheduler import Admit
    from servicer.messages import GenerationRequest

    request = GenerationRequest(1, "r", [1, 2], 64, handoff_window_s=0.010)
    row = Row(Admit(request, 0), uid=0, handed=1)  # its first token went at t = 0
    step = 0.0064
    row.produced(step)
    assert not row.handoff_due(False, horizon=2 * step)
    row.produced(2 * step)
    assert row.handoff_due(False, horizon=3 * step)  # the oldest would wait 12.8 ms


def _server(demo_dir, window_ms: float) -> ServerThread:
    """Without speculation: a step gives one token, so a message with several waited."""
    config = demo_config(demo_dir)
    options = HandlerOptions(stream_window_ms=window_ms)
    engine = replace(config.engine, speculate=None)
    return ServerThread(type(config)(engine=engine, handlers=options, port=0))


def test_a_fast_model_streams_several_tokens_a_message(demo_dir, reference, prompts):
    """The demo's decode step takes milliseconds: with a 200 ms window the tokens after the
    first share messages; with none, every token goes out at once (two share a message only
    when the handler had not yet taken the first). The tokens are the same."""
    sizes = {}
    for window in (200.0, 0.0):
        with _server(demo_dir, window) as running, running.channel() as channel:
            outcome = generate(channel, prompts[3], temperature=0, max_tokens=24, ignore_eos=True)
        assert outcome.error is None
        assert outcome.tokens == reference.greedy(prompts[3], 24)
        sizes[window] = [len(chunk.token_ids) for chunk in outcome.chunks]
    # The first token is handed over alone, but a handler that has not taken it yet when the
    # next steps end gets them in one message too (the outbox merges what waits for its
    # reader): held for the window, the first message would carry all 24 tokens. How many
    # messages each run sends depends on how fast its steps and its handler ran; what holds
    # is the order: a window only merges, so it never sends more messages than none.
    assert sizes[200.0][0] < 8 and len(sizes[200.0]) <= len(sizes[0.0]), sizes
