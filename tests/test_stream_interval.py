"""`--stream-interval N`: the first token alone, then chunks of at least N tokens, same output."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from conftest import demo_config
from support import ServerThread, generate
from test_extensions import _spanning_stop

from servicer.cli import config_from_args, parse_args
from servicer.handlers import HandlerOptions

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
            assert sizes[0] == 1
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


def test_the_flag_reaches_the_handlers():
    assert config_from_args(parse_args([])).handlers.stream_interval == 1
    args = parse_args(["--stream-interval", "8"])
    assert config_from_args(args).handlers.stream_interval == 8
    with pytest.raises(SystemExit):
        parse_args(["--stream-interval", "0"])
