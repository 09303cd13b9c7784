"""End to end through the real SMG router (PyPI `smg`), started without --model-path so it
fetches the tokenizer from the worker with GetTokenizer."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from support import SMG, Router

pytestmark = pytest.mark.skipif(SMG is None, reason="the smg router is a dev dependency")

MESSAGES = [{"role": "user", "content": "Tell me about the river."}]


@pytest.fixture(scope="module")
def router(server, tmp_path_factory) -> Iterator[tuple[Router, str]]:
    running = Router([server.address], tmp_path_factory.mktemp("router") / "smg.log")
    try:
        yield running, running.wait_until_serving()
    finally:
        running.close()


def _expected_chat(reference, max_tokens: int) -> tuple[list[int], str]:
    prompt = reference.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    tokens = reference.greedy(list(prompt), max_tokens)
    eos = reference.tokenizer.eos_token_id
    if eos in tokens:
        tokens = tokens[: tokens.index(eos) + 1]
    return list(prompt), tokens


def test_chat_completion_through_the_router(router, reference):
    running, model = router
    body = {"model": model, "messages": MESSAGES, "max_tokens": 12, "temperature": 0}
    response = running.client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    reply = response.json()
    prompt, tokens = _expected_chat(reference, 12)
    text = reference.tokenizer.decode(tokens, skip_special_tokens=True)
    assert reply["choices"][0]["message"]["content"] == text
    assert reply["usage"]["prompt_tokens"] == len(prompt)
    assert reply["usage"]["completion_tokens"] == len(tokens)
    assert reply["choices"][0]["finish_reason"] == ("stop" if len(tokens) < 12 else "length")


def test_streaming_chat_completion_through_the_router(router, reference):
    running, model = router
    body = {
        "model": model,
        "messages": MESSAGES,
        "max_tokens": 12,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    pieces, usage, finish = [], None, None
    with running.client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            for choice in event.get("choices", []):
                pieces.append(choice.get("delta", {}).get("content") or "")
                finish = choice.get("finish_reason") or finish
            usage = event.get("usage") or usage
    prompt, tokens = _expected_chat(reference, 12)
    assert "".join(pieces) == reference.tokenizer.decode(tokens, skip_special_tokens=True)
    assert usage["prompt_tokens"] == len(prompt)
    assert usage["completion_tokens"] == len(tokens)
    assert finish in ("stop", "length")


def test_text_completion_through_the_router(router, reference):
    running, model = router
    body = {"model": model, "prompt": "The river", "max_tokens": 10, "temperature": 0}
    response = running.client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    reply = response.json()
    prompt = reference.encode("The river")
    tokens = reference.greedy(prompt, 10)
    eos = reference.tokenizer.eos_token_id
    if eos in tokens:
        tokens = tokens[: tokens.index(eos) + 1]
    assert reply["choices"][0]["text"] == reference.tokenizer.decode(
        tokens, skip_special_tokens=True
    )
    assert reply["usage"]["prompt_tokens"] == len(prompt)
    assert reply["usage"]["completion_tokens"] == len(tokens)


def test_second_chat_turn_reports_cached_tokens(router):
    running, model = router
    first_turn = [{"role": "user", "content": "Where does the old road go after the bridge?"}]
    body = {"model": model, "messages": first_turn, "max_tokens": 12, "temperature": 0}
    first = running.client.post("/v1/chat/completions", json=body)
    assert first.status_code == 200, first.text
    reply = first.json()["choices"][0]["message"]["content"]
    second_turn = [
        *first_turn,
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "And then?"},
    ]
    second = running.client.post(
        "/v1/chat/completions",
        json={"model": model, "messages": second_turn, "max_tokens": 12, "temperature": 0},
    )
    assert second.status_code == 200, second.text
    usage = second.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0
    assert usage["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"]
