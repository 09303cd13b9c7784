"""Request building and validation: a GenerateRequest -> a GenerationRequest or a clear error
(pure, no server)."""

from __future__ import annotations

import math
import sys

import grpc
import pytest

from servicer.proto import mlx_engine_pb2 as pb
from servicer.validation import Handoff, Limits, RequestContext, RequestError, build_request

LIMITS = Limits(vocab_size=100, context_length=64, eos_token_ids=(1,), max_prompt_tokens=50)


def _build(prompt=(5, 6, 7), stream=True, **params):
    request = pb.GenerateRequest(
        request_id="r1",
        tokenized=pb.TokenizedInput(input_ids=list(prompt)),
        sampling_params=pb.SamplingParams(**params),
        stream=stream,
    )
    return build_request(request, RequestContext(ticket=7), LIMITS, Handoff(stream_interval=4))


def _refused(**kwargs) -> RequestError:
    with pytest.raises(RequestError) as caught:
        _build(**kwargs)
    return caught.value


def test_defaults_and_normalisation():
    job, text = _build()
    assert (job.ticket, job.request_id, job.prompt) == (7, "r1", [5, 6, 7])
    assert job.max_tokens == 64 - 3  # unset: the rest of the context
    assert job.sampling.temperature == 1.0 and job.sampling.top_p == 1.0
    assert not job.penalties.active  # the router's neutral defaults build no processor
    assert job.stop_token_ids == frozenset({1})  # EOS unless ignore_eos
    assert text is None


def test_tokens_per_handoff_is_set_when_the_request_is_built():
    assert _build(stream=True)[0].tokens_per_handoff == 4  # the stream interval
    assert _build(stream=False)[0].tokens_per_handoff == sys.maxsize  # first token and finish
    # a unary call watching stop strings needs every token
    assert _build(stream=False, stop=["x"])[0].tokens_per_handoff == 4


def test_max_tokens_is_clamped_to_the_context_and_greedy_below_a_tiny_temperature():
    job, _ = _build(max_tokens=1000, temperature=1e-9, top_k=5)
    assert job.max_tokens == 61
    assert job.sampling.greedy and job.sampling.top_k == 0
    assert _build(ignore_eos=True, stop_token_ids=[3, 500])[0].stop_token_ids == frozenset({3})


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"prompt": ()}, "the prompt is empty"),
        ({"prompt": (5, 100)}, "token id 100 is outside the vocabulary (size 100)"),
        ({"prompt": tuple(range(51))}, "at most 50"),
        ({"temperature": -0.5}, "temperature must be >= 0"),
        ({"temperature": math.nan}, "temperature must be a finite number"),
        ({"top_p": 1.5}, "top_p must be in (0, 1]"),
        ({"min_p": -0.1}, "min_p must be in [0, 1]"),
        ({"repetition_penalty": -1.0}, "repetition_penalty must be > 0"),
        ({"logprobs": 21}, "logprobs must be in [0, 20]"),
        ({"logit_bias": {100: 1.0}}, "logit_bias token 100 is outside the vocabulary"),
        ({"max_tokens": 0}, "max_tokens must be at least 1"),
        ({"stop": [""]}, "each stop string needs 1 to 256 characters"),
        ({"thinking_budget": 8}, "no reasoning-section markers"),
    ],
)
def test_bad_input_is_invalid_argument_with_a_message(params, message):
    error = _refused(**params)
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert message in error.message


def test_an_empty_request_id_is_refused():
    request = pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=[5]))
    with pytest.raises(RequestError, match="request_id is empty"):
        build_request(request, RequestContext(ticket=1), LIMITS)
