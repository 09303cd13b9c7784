"""Generate against the real worker: greedy equality with mlx-lm, counts, stops, logprobs."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from support import generate

from servicer.demos.text import EOS_TOKEN

N = 32


def test_demo_prompts_give_varied_greedy_output(reference, prompts):
    for prompt in prompts:
        assert len(set(reference.greedy(prompt, N))) >= 8


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "unary"])
def test_greedy_matches_mlx_lm_one_at_a_time(channel, reference, prompts, stream):
    for prompt in prompts:
        outcome = generate(
            channel, prompt, stream=stream, temperature=0, max_tokens=N, ignore_eos=True
        )
        assert outcome.error is None
        assert outcome.tokens == reference.greedy(prompt, N)


def test_greedy_matches_mlx_lm_when_run_concurrently(channel, reference, prompts):
    def run(i: int):
        return generate(
            channel, prompts[i], stream=i % 2 == 0, temperature=0, max_tokens=N, ignore_eos=True
        )

    with ThreadPoolExecutor(len(prompts)) as pool:
        outcomes = list(pool.map(run, range(len(prompts))))
    for prompt, outcome in zip(prompts, outcomes, strict=True):
        assert outcome.error is None
        assert outcome.tokens == reference.greedy(prompt, N)


def test_stream_chunks_and_complete_carry_counts(channel, prompts):
    prompt = prompts[0]
    outcome = generate(channel, prompt, temperature=0, max_tokens=12, ignore_eos=True)
    complete = outcome.complete
    running = 0
    for chunk in outcome.chunks:
        running += len(chunk.token_ids)
        assert chunk.completion_tokens == running
        assert chunk.prompt_tokens == len(prompt)
        assert chunk.cached_tokens == complete.cached_tokens < len(prompt)
    assert running == 12
    assert complete is not None
    assert complete.finish_reason == "length"
    assert complete.prompt_tokens == len(prompt)
    assert complete.completion_tokens == 12
    assert not complete.HasField("matched_stop_token_id")
    assert list(complete.output_ids) == []  # a stream's tokens travel in its chunks


def test_unary_returns_one_complete_with_output_ids(channel, reference, prompts):
    prompt = prompts[1]
    outcome = generate(channel, prompt, stream=False, temperature=0, max_tokens=9, ignore_eos=True)
    assert outcome.chunks == []
    complete = outcome.complete
    assert complete is not None
    assert list(complete.output_ids) == reference.greedy(prompt, 9)
    assert (complete.prompt_tokens, complete.completion_tokens) == (len(prompt), 9)
    assert complete.finish_reason == "length"


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "unary"])
def test_stop_token_id_ends_with_stop_and_names_the_token(channel, reference, prompts, stream):
    prompt = prompts[2]
    expected = reference.greedy(prompt, N)
    stop_token = expected[6]
    cut = expected.index(stop_token) + 1
    outcome = generate(
        channel,
        prompt,
        stream=stream,
        temperature=0,
        max_tokens=N,
        ignore_eos=True,
        stop_token_ids=[stop_token],
    )
    assert outcome.tokens == expected[:cut]  # the stop token itself is the last one sent
    assert outcome.complete.finish_reason == "stop"
    assert outcome.complete.matched_stop_token_id == stop_token
    assert outcome.complete.completion_tokens == cut


def test_eos_ends_generation_unless_ignored(channel, reference, prompts):
    eos = reference.tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    forced = {eos: 100.0}  # logit_bias makes EOS the certain next token
    outcome = generate(channel, prompts[3], temperature=0, max_tokens=8, logit_bias=forced)
    assert outcome.tokens == [eos]
    assert outcome.complete.finish_reason == "stop"
    assert outcome.complete.matched_stop_token_id == eos

    ignored = generate(
        channel, prompts[3], temperature=0, max_tokens=8, logit_bias=forced, ignore_eos=True
    )
    assert ignored.tokens == [eos] * 8
    assert ignored.complete.finish_reason == "length"


def test_logprobs_report_the_token_and_sorted_alternatives(channel, reference, prompts):
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    prompt = prompts[4]
    outcome = generate(channel, prompt, temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    expected = list(generate_step(mx.array(prompt), reference.model, max_tokens=6))
    # A chunk carries one entry per token it holds (several when they shared a message).
    entries = [
        (token, logprob, top)
        for chunk in outcome.chunks
        for token, logprob, top in zip(
            chunk.output_logprobs.token_ids,
            chunk.output_logprobs.token_logprobs,
            chunk.output_logprobs.top_logprobs,
            strict=True,
        )
    ]
    assert [t for chunk in outcome.chunks for t in chunk.token_ids] == [t for t, _, _ in entries]
    for (got, logprob, top), (token, logprobs) in zip(entries, expected, strict=True):
        assert got == int(token)
        assert math.isclose(logprob, logprobs[int(token)].item(), abs_tol=1e-4)
        assert len(top.values) == len(top.token_ids) == 3
        assert list(top.values) == sorted(top.values, reverse=True)
        assert top.token_ids[0] == int(token)  # greedy picks the most likely token
        best = sorted(range(logprobs.shape[0]), key=lambda i: -logprobs[i].item())[:3]
        assert list(top.token_ids) == best


def test_unary_logprobs_cover_every_token(channel, prompts):
    outcome = generate(
        channel, prompts[5], stream=False, temperature=0, max_tokens=5, ignore_eos=True, logprobs=0
    )
    lp = outcome.complete.output_logprobs
    assert list(lp.token_ids) == list(outcome.complete.output_ids)
    assert len(lp.token_logprobs) == 5
    assert all(len(top.values) == 0 for top in lp.top_logprobs)


def test_sampling_with_temperature_and_filters_stays_in_vocabulary(channel, prompts, reference):
    outcome = generate(
        channel,
        prompts[6],
        temperature=0.8,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        repetition_penalty=1.1,
        frequency_penalty=0.2,
        presence_penalty=0.1,
        max_tokens=16,
        ignore_eos=True,
    )
    assert outcome.error is None
    assert len(outcome.tokens) == 16
    assert all(0 <= t < len(reference.tokenizer) for t in outcome.tokens)


@pytest.mark.parametrize(
    "keep_one", [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}], ids=["top_k", "top_p", "min_p"]
)
def test_filters_take_effect_one_that_keeps_one_token_is_greedy(
    channel, prompts, reference, keep_one
):
    outcome = generate(
        channel, prompts[6], temperature=1.5, max_tokens=16, ignore_eos=True, **keep_one
    )
    assert outcome.tokens == reference.greedy(prompts[6], 16)


def test_penalties_take_effect_as_mlx_lm_applies_them(channel, prompts, reference):
    penalties = {"repetition_penalty": 1.6, "presence_penalty": 0.7, "frequency_penalty": 0.4}
    outcome = generate(
        channel, prompts[2], temperature=0, max_tokens=24, ignore_eos=True, **penalties
    )
    expected = reference.greedy(prompts[2], 24, **penalties)
    assert outcome.tokens == expected
    assert expected != reference.greedy(prompts[2], 24)  # the penalties change the output


def test_logit_bias_takes_effect(channel, prompts):
    outcome = generate(
        channel, prompts[3], temperature=0, max_tokens=6, ignore_eos=True, logit_bias={42: 100.0}
    )
    assert outcome.tokens == [42] * 6


def test_unset_temperature_means_sampling_not_greedy(channel, prompts, reference):
    """The router leaves temperature unset for "default" (1.0): outputs must vary."""
    runs = {
        tuple(generate(channel, prompts[7], max_tokens=16, ignore_eos=True).tokens)
        for _ in range(4)
    }
    assert len(runs) > 1


def test_rejected_request_leaves_the_server_serving(channel, reference, prompts):
    bad = generate(channel, [], temperature=0, max_tokens=4)
    assert bad.code == grpc.StatusCode.INVALID_ARGUMENT
    good = generate(channel, prompts[0], temperature=0, max_tokens=8, ignore_eos=True)
    assert good.tokens == reference.greedy(prompts[0], 8)
