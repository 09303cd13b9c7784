"""Speculative decoding through the real server: outputs exactly as without it (greedy, seeded,
stop tokens and strings, max_tokens, grammars, aborts), rows joining while others speculate,
a draft model that must share the tokenizer, and sliding-window and recurrent models."""

from __future__ import annotations

import json
import logging
import shutil
import threading
from collections.abc import Iterator
from dataclasses import replace

import grpc
import httpx
import pytest
from conftest import DRAFT_EVERY_STEP, Reference, demo_config
from prometheus_client.parser import text_string_to_metric_families
from spec_support import passages, repeat_prompt
from support import (
    BackgroundGenerate,
    ServerThread,
    WorkerProcess,
    free_port,
    generate,
    wait_until,
)

from servicer.demos.text import demo_model_path
from servicer.engine import EngineStartupError
from servicer.proto import mlx_engine_pb2 as pb
from servicer.proto import mlx_engine_pb2_grpc as pb_grpc

N = 40


def _copying_prompts(reference: Reference) -> list[list[int]]:
    """Passages, then their first half again: prompt lookup has something to find."""
    return [repeat_prompt(reference.tokenizer, p, 100) for p in passages()[:6]]


@pytest.fixture(scope="module")
def ngram(demo_dir) -> Iterator[ServerThread]:
    with ServerThread(
        demo_config(demo_dir, speculate="ngram", speculation=DRAFT_EVERY_STEP)
    ) as running:
        yield running


@pytest.fixture(scope="module")
def copying(reference) -> list[list[int]]:
    return _copying_prompts(reference)


def _greedy(chan, prompt: list[int], **params):
    return generate(chan, prompt, temperature=0, max_tokens=N, ignore_eos=True, **params)


def test_greedy_output_is_identical_and_drafts_are_accepted(ngram, reference, copying):
    with ngram.channel() as chan:
        outcomes = [_greedy(chan, prompt) for prompt in copying[:3]]
    assert [o.tokens for o in outcomes] == [reference.greedy(p, N) for p in copying[:3]]
    figures = ngram.server.servicer.figures().speculation
    assert figures is not None and figures.drafted > 0 and figures.accepted > 0
    assert max(figures.per_row_step) >= 2  # some step gave a row several tokens


def test_rows_join_while_others_speculate_and_outputs_stay_identical(ngram, reference, copying):
    with ngram.channel() as chan:
        first = [
            BackgroundGenerate(chan, p, temperature=0, max_tokens=N, ignore_eos=True)
            for p in copying[:2]
        ]
        assert all(call.started.wait(60) for call in first)
        later = [
            BackgroundGenerate(chan, p, temperature=0, max_tokens=N, ignore_eos=True)
            for p in copying[2:6]
        ]
        for call in first + later:
            call.join(120)
    for call, prompt in zip(first + later, copying[:6], strict=True):
        assert call.outcome.error is None
        assert call.outcome.tokens == reference.greedy(prompt, N)


def test_seeded_sampling_draws_what_it_draws_without_speculation(ngram, server, copying):
    params = {"temperature": 0.8, "top_p": 0.9, "max_tokens": N, "ignore_eos": True}
    with ngram.channel() as fast, server.channel() as plain:
        for seed, prompt in enumerate(copying[:3]):
            assert (
                generate(fast, prompt, seed=seed, **params).tokens
                == generate(plain, prompt, seed=seed, **params).tokens
            )


def test_stop_tokens_stop_strings_and_max_tokens_cut_where_they_do_without(
    ngram, reference, copying
):
    prompt = copying[0]
    expected = reference.greedy(prompt, N)
    stop_token = next(t for t in expected[7:] if t > 1)  # not EOS: ignore_eos is on
    cut = expected[: expected.index(stop_token) + 1]
    text = reference.tokenizer.decode(expected, skip_special_tokens=True)
    stop_string = text[len(text) // 2 : len(text) // 2 + 4]
    with ngram.channel() as chan:
        by_token = _greedy(chan, prompt, stop_token_ids=[stop_token])
        short = generate(chan, prompt, temperature=0, max_tokens=5, ignore_eos=True)
        by_string = _greedy(chan, prompt, stop=[stop_string])
    assert by_token.tokens == cut and by_token.complete.finish_reason == "stop"
    assert short.tokens == expected[:5] and short.complete.finish_reason == "length"
    assert by_string.complete.finish_reason == "stop"
    decode = reference.tokenizer.decode
    assert stop_string in decode(by_string.tokens, skip_special_tokens=True)
    assert stop_string not in decode(by_string.tokens[:-1], skip_special_tokens=True)
    assert by_string.tokens == expected[: len(by_string.tokens)]


def test_a_grammar_and_penalties_behave_as_without_speculation(ngram, server, copying):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    params = {"temperature": 1.0, "seed": 3, "max_tokens": 32}
    with ngram.channel() as fast, server.channel() as plain:
        for extra in ({"json_schema": json.dumps(schema)}, {"repetition_penalty": 1.3}):
            ours = generate(fast, copying[1], **params, **extra)
            theirs = generate(plain, copying[1], **params, **extra)
            assert ours.error is None and ours.tokens == theirs.tokens


def test_an_abort_ends_a_speculating_stream(ngram, copying):
    with ngram.channel() as chan:
        call = BackgroundGenerate(
            chan, copying[2], request_id="spec-abort", temperature=0, max_tokens=3000
        )
        assert call.started.wait(60)
        stub = pb_grpc.MlxEngineStub(chan)
        stub.Abort(pb.AbortRequest(request_ids=["spec-abort"]), timeout=10)
        call.join(60)
    assert call.outcome.complete.finish_reason == "abort"
    assert call.outcome.complete.completion_tokens < 3000
    assert wait_until(lambda: ngram.server.load().running == 0)


def test_a_draft_model_gives_identical_greedy_output(demo_dir, reference, copying):
    config = demo_config(
        demo_dir, speculate="draft", draft_model=str(demo_dir), speculation=DRAFT_EVERY_STEP
    )
    with ServerThread(config) as running, running.channel() as chan:
        outcomes = [_greedy(chan, prompt) for prompt in copying[:3]]
        figures = running.server.servicer.figures().speculation
    assert [o.tokens for o in outcomes] == [reference.greedy(p, N) for p in copying[:3]]
    assert figures is not None and figures.accepted > 0


def test_a_draft_model_with_another_tokenizer_is_refused_at_startup(demo_dir, tmp_path):
    other = tmp_path / "other-draft"
    shutil.copytree(demo_dir, other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[100:102]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = demo_config(demo_dir, speculate="draft", draft_model=str(other))
    running = ServerThread(config, wait_ready=False).start()
    try:
        with pytest.raises(EngineStartupError, match="does not share the target's tokenizer"):
            running.run(running.server.wait_ready(120))
    finally:
        running.stop()


@pytest.mark.parametrize("kind", ["hybrid", "gemma3"])
def test_sliding_window_and_recurrent_models_speculate_with_identical_output(kind, caplog):
    """No startup refusal: the demo gemma3 (window 16, crossed by every prompt) and hybrid
    speculate through the server, the same prompt twice (the second a prefix-cache hit
    with the window's and the recurrent state's snapshots), as without speculation."""
    model_dir = demo_model_path(kind)
    reference = Reference(model_dir)
    prompts = _copying_prompts(reference)[:2]
    caplog.set_level(logging.WARNING, logger="servicer.engine")
    config = replace(
        demo_config(model_dir, speculate="ngram", speculation=DRAFT_EVERY_STEP),
        engine_mode="thread",
    )
    with ServerThread(config) as running, running.channel() as chan:
        outcomes = [_greedy(chan, p) for p in (*prompts, prompts[0])]
        figures = running.server.servicer.figures().speculation
    assert [o.tokens for o in outcomes] == [reference.greedy(p, N) for p in (*prompts, prompts[0])]
    assert figures is not None and figures.drafted > 0
    assert not any("stays off" in r.getMessage() for r in caplog.records)


def test_stream_interval_and_concurrency_with_speculation(demo_dir, reference, copying):
    config = demo_config(demo_dir, speculate="ngram", speculation=DRAFT_EVERY_STEP)
    config = replace(config, handlers=replace(config.handlers, stream_interval=4))
    with ServerThread(config) as running, running.channel() as chan:
        results: dict[int, list[int]] = {}
        threads = [
            threading.Thread(target=lambda i=i, p=p: results.update({i: _greedy(chan, p).tokens}))
            for i, p in enumerate(copying[:4])
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
    assert [results[i] for i in range(4)] == [reference.greedy(p, N) for p in copying[:4]]


def test_the_engine_in_its_own_process_speculates_with_identical_output(
    demo_dir, reference, copying
):
    metrics_port = free_port()
    args = ["--model", str(demo_dir), "--speculate", "ngram", "--stream-interval", "3"]
    with WorkerProcess(*args, "--metrics-port", str(metrics_port)) as worker:
        worker.wait_ready()
        with grpc.insecure_channel(worker.address) as chan:
            calls = [
                BackgroundGenerate(chan, p, temperature=0, max_tokens=N, ignore_eos=True)
                for p in copying[:3]
            ]
            for call in calls:
                call.join(120)
        body = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    assert [c.outcome.tokens for c in calls] == [reference.greedy(p, N) for p in copying[:3]]
    drafted = [
        sample.value
        for family in text_string_to_metric_families(body)
        for sample in family.samples
        if sample.name == "mlx_worker_speculation_drafted_tokens_total"
    ]
    assert drafted and drafted[0] > 0  # the costed choice drafts before it has measured
