"""Sampling fidelity and the extension fields: seeds, logprobs, text input, stop strings,
thinking budget, structured output."""

from __future__ import annotations

import json
import math
import re
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from support import generate

from servicer.proto import mlx_engine_pb2 as pb
from servicer.proto import mlx_engine_pb2_grpc as pb_grpc


def _text_request(text: str, **params) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=f"text-{abs(hash((text, str(params))))}",
        text=text,
        sampling_params=pb.SamplingParams(**params),
        stream=False,
    )


# ----- seeds -----


def test_a_seed_gives_the_same_tokens_whatever_else_runs(channel, prompts):
    seeded = {"temperature": 1.0, "top_p": 0.95, "seed": 1234, "max_tokens": 24, "ignore_eos": True}
    alone = generate(channel, prompts[0], **seeded).tokens
    assert alone == generate(channel, prompts[0], **seeded).tokens

    def noise(i: int):
        return generate(channel, prompts[i % 8], temperature=1.0, max_tokens=40, ignore_eos=True)

    with ThreadPoolExecutor(10) as pool:
        others = [pool.submit(noise, i) for i in range(8)]
        busy = [pool.submit(generate, channel, prompts[0], **seeded) for _ in range(2)]
        assert [f.result().tokens for f in busy] == [alone, alone]
        assert all(f.result().error is None for f in others)
    other_seed = generate(channel, prompts[0], **{**seeded, "seed": 99}).tokens
    assert other_seed != alone


# ----- logprobs -----


def test_logprobs_equal_log_softmax_of_the_models_logits(channel, reference, prompts):
    import mlx.core as mx

    prompt = prompts[5]
    outcome = generate(
        channel, prompt, stream=False, temperature=0, max_tokens=8, ignore_eos=True, logprobs=5
    )
    lp = outcome.complete.output_logprobs
    tokens = list(outcome.complete.output_ids)
    assert list(lp.token_ids) == tokens and len(lp.top_logprobs) == 8
    for i, token in enumerate(tokens):
        logits = reference.model(mx.array([prompt + tokens[:i]]))[0, -1].astype(mx.float32)
        expected = logits - mx.logsumexp(logits)
        assert math.isclose(lp.token_logprobs[i], expected[token].item(), abs_tol=2e-3)
        order = mx.argsort(-expected)[:5].tolist()
        top = lp.top_logprobs[i]
        assert list(top.token_ids) == order
        for value, token_id in zip(top.values, top.token_ids, strict=True):
            assert math.isclose(value, expected[token_id].item(), abs_tol=2e-3)


# ----- text input -----


def test_text_input_is_tokenized_by_the_worker(channel, reference):
    stub = pb_grpc.MlxEngineStub(channel)
    request = _text_request("The river", temperature=0, max_tokens=10, ignore_eos=True)
    (response,) = list(stub.Generate(request, timeout=60))
    ids = list(reference.tokenizer.encode("The river"))
    assert response.complete.prompt_tokens == len(ids)
    assert list(response.complete.output_ids) == reference.greedy(ids, 10)


# ----- stop strings -----


def _spanning_stop(reference, prompt: list[int]) -> tuple[str, list[int], str]:
    """A stop string that starts inside one token and ends inside a later one."""
    tokens = reference.greedy(prompt, 40)
    decode = lambda ids: reference.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    for first in range(3, 30):
        head, span = decode(tokens[:first]), decode(tokens[: first + 3])
        piece = span[len(head) - 1 : len(span) - 1]  # last char of one token .. into the third
        full = decode(tokens)
        if len(piece) >= 3 and full.count(piece) == 1 and full.find(piece) == len(head) - 1:
            return piece, tokens, full
    pytest.skip("no suitable multi-token stop string in this continuation")


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "unary"])
def test_stop_string_spanning_tokens_ends_generation_and_is_excluded(
    channel, reference, prompts, stream
):
    stop, tokens, full = _spanning_stop(reference, prompts[6])
    outcome = generate(
        channel, prompts[6], stream=stream, temperature=0, max_tokens=40, ignore_eos=True,
        stop=["never-in-output", stop],
    )  # fmt: skip
    complete = outcome.complete
    assert complete.finish_reason == "stop"
    assert complete.matched_stop == stop
    assert not complete.HasField("matched_stop_token_id")
    text = "".join(c.text for c in outcome.chunks) if stream else complete.output_text
    assert text == full[: full.find(stop)]
    # The tokens run up to the one that completed the stop string, no further.
    sent = outcome.tokens
    decode = reference.tokenizer.decode
    assert sent == tokens[: len(sent)]
    assert stop in decode(sent, skip_special_tokens=True)
    assert stop not in decode(sent[:-1], skip_special_tokens=True)
    assert complete.completion_tokens == len(sent) < 40


def test_return_text_streams_the_decoded_text(channel, reference, prompts):
    outcome = generate(
        channel, prompts[7], temperature=0, max_tokens=20, ignore_eos=True, return_text=True
    )
    expected = reference.tokenizer.decode(
        reference.greedy(prompts[7], 20), skip_special_tokens=True
    )
    assert "".join(c.text for c in outcome.chunks) == expected
    assert outcome.complete.finish_reason == "length"


def test_bad_stop_strings_are_invalid(channel, prompts):
    empty = generate(channel, prompts[0], max_tokens=2, stop=[""])
    assert empty.code == grpc.StatusCode.INVALID_ARGUMENT
    many = generate(channel, prompts[0], max_tokens=2, stop=[f"s{i}" for i in range(17)])
    assert many.code == grpc.StatusCode.INVALID_ARGUMENT


# ----- thinking budget -----


def test_thinking_budget_forces_the_end_of_reasoning(channel, reference):
    tokenizer = reference.tokenizer
    think, end_think = tokenizer.think_start_tokens[0], tokenizer.think_end_tokens[0]
    prompt = list(tokenizer.encode("<|user|>Why is the sky blue?<|end|><|assistant|><think>"))
    assert prompt[-1] == think
    never_close = {end_think: -100.0}  # left alone, the model would not close the section
    free = generate(
        channel, prompt, temperature=0, max_tokens=12, ignore_eos=True, logit_bias=never_close
    )
    assert end_think not in free.tokens
    budgeted = generate(
        channel, prompt, temperature=0, max_tokens=12, ignore_eos=True, logit_bias=never_close,
        thinking_budget=5,
    )  # fmt: skip
    assert budgeted.tokens[5] == end_think
    assert end_think not in budgeted.tokens[:5]
    assert budgeted.tokens[:5] == free.tokens[:5]


# ----- structured output -----

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["ada", "bob", "cy"]},
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["name", "ok", "n"],
    "additionalProperties": False,
}


def _decoded(reference, outcome) -> str:
    return reference.tokenizer.decode(outcome.tokens, skip_special_tokens=True)


@pytest.mark.parametrize("seed", range(4))
def test_json_schema_output_parses_and_validates(channel, reference, prompts, seed):
    outcome = generate(
        channel, prompts[seed], temperature=1.0, seed=seed, max_tokens=64,
        json_schema=json.dumps(SCHEMA),
    )  # fmt: skip
    assert outcome.complete.finish_reason == "stop"
    value = json.loads(_decoded(reference, outcome))
    assert set(value) == {"name", "ok", "n"}
    assert value["name"] in {"ada", "bob", "cy"} and isinstance(value["ok"], bool)
    assert isinstance(value["n"], int) and 0 <= value["n"] <= 9


@pytest.mark.parametrize("seed", range(3))
def test_regex_and_lark_outputs_match(channel, reference, prompts, seed):
    pattern = r"[a-c]{3}-[0-9]{2}"
    regex = generate(
        channel, prompts[seed], temperature=1.0, seed=seed, max_tokens=32, regex=pattern
    )
    assert re.fullmatch(pattern, _decoded(reference, regex))
    lark = generate(
        channel, prompts[seed], temperature=1.0, seed=seed, max_tokens=32,
        lark_grammar='start: "yes" | "no" | "maybe"',
    )  # fmt: skip
    assert _decoded(reference, lark) in {"yes", "no", "maybe"}


@pytest.mark.parametrize(
    "field, source",
    [
        ("json_schema", "{not json"),
        ("regex", "("),
        ("lark_grammar", "start: ("),
        # Valid syntax that only the model's vocabulary can refute:
        ("lark_grammar", "start: <|no-such-special-token|>"),
        ("lark_grammar", 'start: "x" <[99999]>'),
        # Valid, but matching no text: no first token can be drawn.
        ("lark_grammar", "start: start"),
    ],
)
def test_invalid_constraints_are_refused_before_generation(channel, prompts, field, source):
    outcome = generate(channel, prompts[0], max_tokens=4, **{field: source})
    assert outcome.code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"invalid {field}" in outcome.error.details()
    assert outcome.chunks == []


def test_a_grammar_that_fails_while_generating_ends_with_an_error(channel, prompts):
    # Valid up front, but the parser's item limit stops it after the first token: the
    # request must end with INVALID_ARGUMENT, not a `stop` whose output breaks the grammar.
    outcome = generate(
        channel, prompts[0], temperature=0.0, max_tokens=8, lark_grammar='start: "a"{100000}'
    )
    assert outcome.complete is None
    assert outcome.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "grammar failed while generating" in outcome.error.details()
    assert "\n" not in outcome.error.details()  # the reason, not llguidance's parser state
    after = generate(channel, prompts[1], temperature=0.0, max_tokens=4)
    assert after.complete.finish_reason == "length"


def test_a_matcher_error_without_a_message_reads_as_empty():
    from servicer.grammar import matcher_error

    class Silent:  # llguidance types get_error as Optional[str]
        def get_error(self):
            return None

    class Loud:
        def get_error(self):
            return "  NoExtensionBias\n<state>\n"

    assert matcher_error(Silent()) == ""
    assert matcher_error(Loud()).splitlines()[0] == "NoExtensionBias"
