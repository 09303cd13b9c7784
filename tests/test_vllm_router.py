"""The router's whole feature set, end to end through the real SMG router: the worker answers
VllmEngine beside MlxEngine (--protocols mlx,vllm), so the router takes it for vLLM and sends it
n > 1, stop strings, structured output, tool_choice, embeddings, load polls and KV events."""

from __future__ import annotations

import dataclasses
import json
import re
import threading
from collections.abc import Iterator

import httpx
import mlx.core as mx
import pytest
from conftest import demo_config
from support import SMG, Router, ServerThread, wait_until

pytestmark = pytest.mark.skipif(SMG is None, reason="the smg router is a dev dependency")

STORY = [{"role": "user", "content": "Tell me about the river."}]


@pytest.fixture(scope="module")
def worker(demo_dir) -> Iterator[ServerThread]:
    config = dataclasses.replace(demo_config(demo_dir), protocols=("mlx", "vllm"))
    with ServerThread(config) as running:
        yield running


@pytest.fixture(scope="module")
def router(worker, tmp_path_factory) -> Iterator[tuple[Router, str]]:
    running = Router([worker.address], tmp_path_factory.mktemp("router") / "smg.log")
    try:
        yield running, running.wait_until_serving()
    finally:
        running.close()


def _chat(router: tuple[Router, str], **body) -> dict:
    running, model = router
    request = {"model": model, "messages": STORY, "max_tokens": 24, "temperature": 0, **body}
    response = running.client.post("/v1/chat/completions", json=request)
    assert response.status_code == 200, response.text
    return response.json()


def test_the_router_takes_the_worker_for_vllm(router):
    running, _ = router
    assert "vllm" in running.log_tail(200_000).lower()


def test_a_stop_string_ends_the_workers_generation_early(router, worker, reference):
    free = _chat(router, max_tokens=64)["choices"][0]["message"]["content"]
    assert len(free) > 12, free
    stop = free[8:10]  # a string the greedy answer reaches a few tokens in
    routed = worker.server.servicer._streams.generated_total
    reply = _chat(router, max_tokens=64, stop=[stop])
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == free[: free.index(stop)]
    assert reply["usage"]["completion_tokens"] < 64
    # The worker itself stopped: far fewer than 64 tokens left the engine for this request.
    assert worker.server.servicer._streams.generated_total - routed < 32


def test_n_2_with_a_seed_gives_two_answers_and_the_same_two_again(router):
    body = {"n": 2, "seed": 11, "temperature": 1.0, "max_tokens": 16}
    first = [c["message"]["content"] for c in _chat(router, **body)["choices"]]
    again = [c["message"]["content"] for c in _chat(router, **body)["choices"]]
    assert len(first) == 2 and first[0] != first[1]
    assert sorted(first) == sorted(again)


SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["answer"],
    "additionalProperties": False,
}


def test_json_schema_output_validates(router):
    response_format = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    reply = _chat(router, response_format=response_format)
    value = json.loads(reply["choices"][0]["message"]["content"])
    assert set(value) == {"answer"} and 0 <= value["answer"] <= 9


CITY = {"type": "string", "enum": ["Paris", "Rome"]}
WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {"type": "object", "properties": {"city": CITY}, "required": ["city"]},
    },
}


def test_a_named_tool_choice_comes_back_as_a_parsed_tool_call(router):
    """(tool_choice "required" lets the model call tools without end: the demo model never
    closes the array; tests/test_vllm_real.py asks the real chat model.)"""
    named = {"type": "function", "function": {"name": "weather"}}
    reply = _chat(router, tools=[WEATHER], tool_choice=named, max_tokens=48)
    calls = reply["choices"][0]["message"]["tool_calls"]
    assert calls and calls[0]["function"]["name"] == "weather"
    assert json.loads(calls[0]["function"]["arguments"])["city"] in ("Paris", "Rome")


def test_ebnf_and_regex_are_obeyed(router):
    yes_no = _chat(router, ebnf='root ::= "yes" | "no"')["choices"][0]["message"]["content"]
    assert yes_no in ("yes", "no")
    digits = _chat(router, regex="[0-9]{3}")["choices"][0]["message"]["content"]
    assert re.fullmatch("[0-9]{3}", digits), digits


def test_embeddings_equal_a_direct_computation(router, reference):
    running, model = router
    text = "The river runs to the sea."
    response = running.client.post("/v1/embeddings", json={"model": model, "input": text})
    assert response.status_code == 200, response.text
    body = response.json()
    got = mx.array(body["data"][0]["embedding"])
    ids = reference.tokenizer.encode(text)
    hidden = reference.model.model(mx.array([ids]))[0, -1].astype(mx.float32)
    expected = hidden / mx.linalg.norm(hidden)
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert mx.allclose(got, expected, atol=1e-4).item()


def test_the_router_subscribes_to_kv_events_and_routes_a_repeat_as_an_event_hit(
    router, worker, reference
):
    running, model = router
    hub = worker.server.servicer.kv_events
    assert wait_until(lambda: hub._subscribers, timeout=30), "the router never subscribed"
    sent = hub.sequence
    words = " ".join(f"river{i} stone{i * 7 % 13}" for i in range(400))
    messages = [{"role": "system", "content": words}, {"role": "user", "content": "Go on."}]
    body = {"model": model, "messages": messages, "max_tokens": 2, "temperature": 0}
    assert running.client.post("/v1/chat/completions", json=body).status_code == 200
    assert wait_until(lambda: hub.sequence > sent and hub.live_blocks() > 0, timeout=10)

    def a_repeat_is_an_event_hit() -> bool:
        hits_before = _event_hits(running)
        repeat = running.client.post("/v1/chat/completions", json=body)
        assert repeat.status_code == 200
        assert repeat.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 256
        return wait_until(lambda: _event_hits(running) > hits_before, timeout=2)

    # The worker has published the events; the router applies them on its own time.
    assert wait_until(a_repeat_is_an_event_hit, timeout=30, interval=0.5), running.log_tail()


def _event_hits(running: Router) -> float:
    text = running.metrics()
    pattern = r'smg_cache_aware_policy_branch_total\{[^}]*branch="event_hit"[^}]*\} (\S+)'
    found = re.findall(pattern, text)
    return sum(float(v) for v in found)


def _status(router: Router, body: dict, timeout: float) -> int:
    """The router's answer, or 0 when it does not come within `timeout`."""
    try:
        return router.client.post("/v1/chat/completions", json=body, timeout=timeout).status_code
    except httpx.TimeoutException:
        return 0


def test_overload_shedding_answers_503_while_the_worker_reports_a_queue(demo_dir, tmp_path):
    """A worker that decodes one row at a time, with a queue over the threshold, is shed (503
    at once); once its queue is gone, the router sends it requests again."""
    config = dataclasses.replace(demo_config(demo_dir), protocols=("mlx", "vllm"))
    config = dataclasses.replace(
        config, engine=dataclasses.replace(config.engine, completion_batch_size=1)
    )
    flags = ("--worker-overload-shed", "--load-monitor-interval", "1")
    with ServerThread(config) as running:
        router = Router([running.address], tmp_path / "smg.log", *flags)
        try:
            model = router.wait_until_serving()
            slow = {"model": model, "messages": STORY, "max_tokens": 400, "temperature": 0}
            slow["ignore_eos"] = True
            senders = [
                threading.Thread(target=_status, args=(router, slow, 300)) for _ in range(12)
            ]
            for sender in senders:
                sender.start()
            assert wait_until(lambda: running.server.load().waiting >= 10, timeout=30)
            quick = {"model": model, "messages": STORY, "max_tokens": 2}
            # Probes that the router does send to the worker wait behind the queue.
            shed = wait_until(lambda: _status(router, quick, 1.0) == 503, timeout=30)
            assert shed, router.log_tail()
            for sender in senders:
                sender.join(300)
            assert wait_until(lambda: _status(router, quick, 10) == 200, timeout=30)
        finally:
            router.close()
