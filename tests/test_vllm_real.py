"""The vLLM face on a real chat model (HuggingFaceTB/SmolLM2-135M-Instruct, built by
../shared/tools/real_model.sh; skipped where ../shared is absent): the worker with
`--protocols mlx,vllm` behind the real smg router answers tool_choice "required" with a parsed
tool call, keeps to a json_schema, and ends its generation at a stop string. A token costs
~65 ms here: a few short generations."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import real_model_env
from support import SMG, Router, WorkerProcess

pytestmark = pytest.mark.skipif(SMG is None, reason="the smg router is a dev dependency")


@pytest.fixture(scope="module")
def routed(real_chat_model_dir: Path, tmp_path_factory) -> Iterator[tuple[Router, str]]:
    args = ("--model", str(real_chat_model_dir), "--protocols", "mlx,vllm")
    with WorkerProcess(*args, env=real_model_env()) as worker:
        worker.wait_ready(300)
        router = Router([worker.address], tmp_path_factory.mktemp("router") / "smg.log")
        try:
            yield router, router.wait_until_serving(300)
        finally:
            router.close()


def _chat(routed: tuple[Router, str], content: str, **body) -> dict:
    router, model = routed
    messages = [{"role": "user", "content": content}]
    request = {"model": model, "messages": messages, "temperature": 0, **body}
    response = router.client.post("/v1/chat/completions", json=request, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def test_the_router_takes_the_worker_for_vllm(routed):
    router, _ = routed
    assert "vllm" in router.log_tail(200_000).lower()


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def test_tool_choice_required_comes_back_as_a_parsed_tool_call(routed):
    reply = _chat(
        routed,
        "What is the weather like in Paris today?",
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=48,
    )
    message = reply["choices"][0]["message"]
    calls = message.get("tool_calls")
    assert calls, reply
    assert calls[0]["function"]["name"] == "get_weather"
    arguments = json.loads(calls[0]["function"]["arguments"])
    assert isinstance(arguments["city"], str) and arguments["city"].strip(), arguments


CAPITAL = {
    "type": "object",
    "properties": {"country": {"type": "string"}, "capital": {"type": "string"}},
    "required": ["country", "capital"],
    "additionalProperties": False,
}


def test_json_schema_output_parses_and_validates(routed):
    response_format = {"type": "json_schema", "json_schema": {"name": "capital", "schema": CAPITAL}}
    reply = _chat(
        routed,
        "What is the capital of France? Answer in JSON.",
        response_format=response_format,
        max_tokens=40,
    )
    value = json.loads(reply["choices"][0]["message"]["content"])
    assert set(value) == {"country", "capital"}, value
    assert all(isinstance(v, str) for v in value.values()), value


def test_a_stop_string_ends_generation(routed):
    max_tokens = 48
    free = _chat(routed, "List five fruits, one per line.", max_tokens=max_tokens)
    text = free["choices"][0]["message"]["content"]
    assert "\n" in text.strip(), text  # the list goes on past its first line
    reply = _chat(routed, "List five fruits, one per line.", max_tokens=max_tokens, stop=["\n"])
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "stop", reply
    assert "\n" not in choice["message"]["content"]
    assert reply["usage"]["completion_tokens"] < max_tokens
    assert reply["usage"]["completion_tokens"] < free["usage"]["completion_tokens"]
