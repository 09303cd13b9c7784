"""Bad input is refused before it reaches MLX, with the right status and a clear message; the
same server then still answers a normal request correctly."""

from __future__ import annotations

import math
from collections.abc import Iterator

import grpc
import pytest
from conftest import demo_config
from support import (
    BackgroundGenerate,
    ServerThread,
    generate,
    make_request,
    server_info,
    wait_until,
)

from servicer.handlers import HandlerOptions
from servicer.proto import mlx_engine_pb2 as pb
from servicer.proto import mlx_engine_pb2_grpc as pb_grpc

INVALID = grpc.StatusCode.INVALID_ARGUMENT
VOCAB = 512
NAN, INF = math.nan, math.inf

# (case id, prompt (None: use a good one), sampling params, message fragment)
CASES = [
    ("empty-prompt", [], {}, "prompt is empty"),
    ("token-at-vocab-size", [5, VOCAB], {}, "token id 512 is outside the vocabulary (size 512)"),
    ("huge-token-id", [2**32 - 1], {}, "outside the vocabulary"),
    ("prompt-longer-than-context", [7] * 4096, {}, "at most 4095"),
    ("negative-temperature", None, {"temperature": -0.5}, "temperature must be >= 0"),
    ("nan-temperature", None, {"temperature": NAN}, "temperature must be a finite number"),
    ("inf-temperature", None, {"temperature": INF}, "temperature must be a finite number"),
    ("top-p-above-one", None, {"top_p": 1.5}, "top_p must be in (0, 1]"),
    ("negative-top-p", None, {"top_p": -0.1}, "top_p must be in (0, 1]"),
    ("nan-top-p", None, {"top_p": NAN}, "top_p must be a finite number"),
    ("min-p-above-one", None, {"min_p": 1.01}, "min_p must be in [0, 1]"),
    ("negative-min-p", None, {"min_p": -0.1}, "min_p must be in [0, 1]"),
    ("negative-repetition", None, {"repetition_penalty": -1.0}, "repetition_penalty must be > 0"),
    ("nan-repetition", None, {"repetition_penalty": NAN}, "repetition_penalty must be a finite"),
    ("inf-frequency", None, {"frequency_penalty": INF}, "frequency_penalty must be a finite"),
    ("nan-presence", None, {"presence_penalty": NAN}, "presence_penalty must be a finite"),
    ("negative-logprobs", None, {"logprobs": -1}, "logprobs must be in [0, 20]"),
    ("too-many-logprobs", None, {"logprobs": 21}, "logprobs must be in [0, 20]"),
    ("bias-key-past-vocab", None, {"logit_bias": {VOCAB: 1.0}}, "logit_bias token 512"),
    ("negative-bias-key", None, {"logit_bias": {-1: 1.0}}, "logit_bias token -1"),
    ("nan-bias-value", None, {"logit_bias": {3: NAN}}, "logit_bias[3] must be a finite"),
    ("zero-max-tokens", None, {"max_tokens": 0}, "max_tokens must be at least 1"),
]


@pytest.mark.parametrize(
    ("prompt", "params", "fragment"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_bad_input_is_invalid_argument_and_the_server_keeps_serving(
    channel, reference, prompts, prompt, params, fragment
):
    bad = generate(channel, prompts[0] if prompt is None else prompt, **{"max_tokens": 4, **params})
    assert bad.code == INVALID, bad.error
    assert fragment in bad.error.details()
    assert bad.chunks == [] and bad.complete is None
    good = generate(channel, prompts[1], temperature=0, max_tokens=8, ignore_eos=True)
    assert good.tokens == reference.greedy(prompts[1], 8)


def test_missing_input_and_request_id_are_invalid(channel, prompts):
    stub = pb_grpc.MlxEngineStub(channel)
    no_input = pb.GenerateRequest(request_id="no-input", stream=True)
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.Generate(no_input, timeout=10))
    assert caught.value.code() == INVALID and "prompt is empty" in caught.value.details()
    no_id = generate(channel, prompts[0], request_id="", max_tokens=2)
    assert no_id.code == INVALID
    assert "request_id is empty" in no_id.error.details()


def test_empty_text_input_is_invalid(channel):
    stub = pb_grpc.MlxEngineStub(channel)
    request = pb.GenerateRequest(request_id="text-in", text="", stream=True)
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.Generate(request, timeout=10))
    assert caught.value.code() == INVALID and "prompt is empty" in caught.value.details()


@pytest.mark.parametrize("top_k", [VOCAB - 1, VOCAB, VOCAB + 1, 10**6, 2**32 - 1])
def test_top_k_up_to_and_past_the_vocabulary_never_hangs(channel, prompts, top_k):
    outcome = generate(
        channel, prompts[2], temperature=0.7, top_k=top_k, max_tokens=6, ignore_eos=True
    )
    assert outcome.error is None and len(outcome.tokens) == 6


def test_proto_zero_values_mean_unset(channel, reference, prompts):
    """A client that sets nothing gets neutral sampling, not an error."""
    outcome = generate(
        channel, prompts[3], temperature=0, top_p=0, repetition_penalty=0, max_tokens=6,
        ignore_eos=True,
    )  # fmt: skip
    assert outcome.tokens == reference.greedy(prompts[3], 6)


@pytest.mark.parametrize("seed", [None, 5])
def test_a_vanishing_temperature_is_greedy_not_noise(channel, reference, prompts, seed):
    # 1 / 1e-39 overflows float32: sampled "almost greedy" would come out uniform.
    params = {"seed": seed} if seed is not None else {}
    outcome = generate(
        channel, prompts[4], temperature=1e-39, max_tokens=6, ignore_eos=True, **params
    )
    assert outcome.tokens == reference.greedy(prompts[4], 6)


@pytest.mark.parametrize(
    "params",
    [
        {"repetition_penalty": 1e-38},
        {"repetition_penalty": 0.5, "logit_bias": {511: 3.4e38}},
        {"frequency_penalty": -3.4e38},
    ],
    ids=["tiny-repetition", "huge-bias", "huge-negative-frequency"],
)
def test_penalties_at_the_extremes_never_give_nan_logprobs(channel, prompts, params):
    """Accepted but extreme penalties overflowed the logits to inf, and every logprob of the
    request read NaN. Found by request_fuzz.py."""
    outcome = generate(
        channel, [5, 6, 7], temperature=0, max_tokens=6, ignore_eos=True, logprobs=1,
        **params,
    )  # fmt: skip
    assert outcome.error is None and len(outcome.tokens) == 6
    values = [v for c in outcome.chunks for v in c.output_logprobs.token_logprobs]
    values += [
        v for c in outcome.chunks for top in c.output_logprobs.top_logprobs for v in top.values
    ]
    assert values and not any(math.isnan(v) for v in values)


def test_a_bias_past_the_openai_range_is_clamped_to_it(channel, reference, prompts):
    """A bias is clamped to [-100, 100], as vLLM's server does: 1e30 and 100 agree."""
    clamped = {"logit_bias": {7: 100.0, 9: -100.0}}
    huge = {"logit_bias": {7: 1e30, 9: -1e30}}
    # Unary: how a stream groups its tokens into chunks follows timing, not the request.
    runs = [
        generate(channel, prompts[2], stream=False, temperature=0, max_tokens=4, logprobs=2, **bias)
        for bias in (clamped, huge)
    ]
    assert runs[0].tokens == runs[1].tokens
    assert runs[0].complete.output_logprobs == runs[1].complete.output_logprobs


def test_max_tokens_past_the_context_is_clamped_and_ends_with_length(channel, prompts):
    prompt = (prompts[4] * 1000)[:4090]
    outcome = generate(channel, prompt, temperature=0, max_tokens=500, ignore_eos=True)
    assert outcome.error is None
    assert outcome.complete.finish_reason == "length"
    assert outcome.complete.completion_tokens == 4096 - 4090


def test_duplicate_request_id_in_flight_is_already_exists(server, channel, prompts):
    first = BackgroundGenerate(
        channel, prompts[0], request_id="dup", temperature=0, max_tokens=3000, ignore_eos=True
    )
    assert first.started.wait(30)
    second = generate(channel, prompts[1], request_id="dup", max_tokens=2)
    assert second.code == grpc.StatusCode.ALREADY_EXISTS
    assert "'dup' is already in flight" in second.error.details()
    pb_grpc.MlxEngineStub(channel).Abort(pb.AbortRequest(request_ids=["dup"]), timeout=10)
    first.join(60)
    assert first.outcome.complete.finish_reason == "abort"
    reused = generate(channel, prompts[1], request_id="dup", max_tokens=2, ignore_eos=True)
    assert reused.error is None  # a finished id may be used again


@pytest.fixture(scope="module")
def tight_server(demo_dir) -> Iterator[ServerThread]:
    """One decoding row, two waiting places, 10-token prompts, 64 KiB messages."""
    config = demo_config(demo_dir, completion_batch_size=1, prefill_batch_size=1)
    config = type(config)(
        engine=config.engine,
        handlers=HandlerOptions(max_prompt_tokens=10, max_queued_requests=2),
        port=0,
        max_message_bytes=64 * 1024,
    )
    with ServerThread(config) as running:
        yield running


def test_max_prompt_tokens_flag_is_enforced(tight_server, prompts):
    with tight_server.channel() as channel:
        long = generate(channel, [5] * 11, max_tokens=2)
        assert long.code == INVALID and "at most 10" in long.error.details()
        assert generate(channel, [5] * 10, max_tokens=2, ignore_eos=True).error is None


def test_oversized_messages_are_refused_by_grpc(tight_server, reference):
    with tight_server.channel() as channel:
        huge = generate(channel, [5] * 100_000, max_tokens=2)
        assert huge.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        ok = generate(channel, [5, 6, 7], temperature=0, max_tokens=4, ignore_eos=True)
        assert ok.tokens == reference.greedy([5, 6, 7], 4)


def test_too_many_waiting_requests_is_resource_exhausted(tight_server, reference):
    with tight_server.channel() as channel:
        stub = pb_grpc.MlxEngineStub(channel)
        worker = tight_server.server

        def start(i: int):
            request = make_request([5, 6], request_id=f"q{i}", max_tokens=3000, ignore_eos=True)
            return stub.Generate(request, timeout=120)

        calls = [start(0)]
        assert wait_until(lambda: worker.load().running == 1)
        calls += [start(1), start(2)]
        assert wait_until(lambda: worker.load().waiting == 2)
        refused = generate(channel, [5, 6], max_tokens=2)
        assert refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "2 requests are already waiting for the engine (limit 2)" in refused.error.details()
        stub.Abort(pb.AbortRequest(request_ids=["q0", "q1", "q2"]), timeout=10)
        finishes = [
            [r.complete.finish_reason for r in call if r.HasField("complete")] for call in calls
        ]
        assert finishes == [["abort"]] * 3
        assert wait_until(lambda: server_info(channel).active_requests == 0)
        ok = generate(channel, [5, 6, 7], temperature=0, max_tokens=4, ignore_eos=True)
        assert ok.tokens == reference.greedy([5, 6, 7], 4)
