"""Several fine-tunes on one engine, through the real SMG router: the worker serves the base
model and three adapters (LoRA and DoRA, different ranks and target layers), each on an
address of its own answering its name; one router in front of the four addresses routes by
`model`. Each answer equals mlx-lm's own generation with that adapter loaded alone, alone and
in a batch mixing all four, on the float32 base and a 4-bit copy; the same prompt under two
adapters never shares a block."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from conftest import demo_config
from support import SMG, Router, ServerThread
from test_adapters import RANDOM_ADAPTERS, References, write_random_adapter

from servicer.demos.text import demo_model_path
from servicer.proto import vllm_engine_pb2 as vpb
from servicer.proto import vllm_engine_pb2_grpc as vgrpc

QUESTIONS = ("Tell me about the river.", "What do bees make?", "Describe a quiet place.")
BASE = "base-llama"


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory) -> dict[str, Path]:
    from mlx_lm import load

    root = tmp_path_factory.mktemp("adapters")
    dirs = {}
    for seed, (name, options) in enumerate(RANDOM_ADAPTERS.items()):
        model, _ = load(str(demo_model_path("llama")))
        dirs[name] = write_random_adapter(root / name, model, seed=seed, **options)
    return dirs


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    """The demo llama (float32) and its 4-bit copy (mlx_lm.convert)."""
    from mlx_lm import convert

    quantized = tmp_path_factory.mktemp("q4") / "llama-4bit"
    convert(str(demo_model_path("llama")), str(quantized), quantize=True, q_bits=4)
    return {"float32": demo_model_path("llama"), "4-bit": quantized}


@pytest.fixture(scope="module", params=["float32", "4-bit"])
def kind(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def worker(adapter_dirs, bases, kind) -> Iterator[ServerThread]:
    config = demo_config(
        bases[kind],
        adapters=tuple((name, str(path)) for name, path in adapter_dirs.items()),
        prompt_cache_block=4,
    )
    config = dataclasses.replace(
        config,
        protocols=("mlx", "vllm"),
        adapter_ports=tuple((name, 0) for name in adapter_dirs),
        model=dataclasses.replace(config.model, served_model_name=BASE),
    )
    with ServerThread(config) as running:
        yield running


@pytest.fixture(scope="module")
def references(adapter_dirs, bases) -> References:
    return References(bases, adapter_dirs)


def _address(worker: ServerThread, name: str) -> str:
    if name == BASE:
        return worker.address
    return f"127.0.0.1:{worker.server.adapter_ports[name]}"


def _chat_ids(question: str) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(demo_model_path("llama")))
    messages = [{"role": "user", "content": question}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def _generate(worker: ServerThread, name: str, prompt: list[int], n: int = 16):
    with grpc.insecure_channel(_address(worker, name)) as channel:
        stub = vgrpc.VllmEngineStub(channel)
        request = vpb.GenerateRequest(
            request_id=f"{name}-{len(prompt)}-{id(prompt)}",
            tokenized=vpb.TokenizedInput(input_ids=prompt),
            sampling_params=vpb.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
        )
        (response,) = list(stub.Generate(request, timeout=120))
        return response.complete


def test_each_address_answers_its_own_name(worker, adapter_dirs):
    for name in (BASE, *adapter_dirs):
        with grpc.insecure_channel(_address(worker, name)) as channel:
            info = vgrpc.VllmEngineStub(channel).GetModelInfo(vpb.GetModelInfoRequest())
        assert info.served_model_name == name


def test_mixed_adapters_in_one_batch_each_equal_mlx_lms_own(worker, adapter_dirs, references, kind):
    names = [BASE, *adapter_dirs]
    jobs = [(name, _chat_ids(q)) for q in QUESTIONS for name in names]
    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(lambda job: _generate(worker, *job), jobs))
    outputs = {}
    for (name, prompt), answer in zip(jobs, answers, strict=True):
        adapter = None if name == BASE else name
        assert list(answer.output_ids) == references.greedy(kind, adapter, prompt, 16), name
        outputs.setdefault(tuple(prompt), set()).add(tuple(answer.output_ids))
    assert all(len(seen) >= 3 for seen in outputs.values())  # the adapters change the text


def test_the_same_prompt_under_another_adapter_shares_no_block(
    worker, adapter_dirs, references, kind
):
    prompt = [300 + (i * 37) % 200 for i in range(29)]  # no other test's prefix
    first = _generate(worker, "attn", prompt)
    again = _generate(worker, "attn", prompt)
    other = _generate(worker, "all", prompt)
    base = _generate(worker, BASE, prompt)
    assert first.cached_tokens == 0
    assert again.cached_tokens > 0 and list(again.output_ids) == list(first.output_ids)
    assert other.cached_tokens == 0 and base.cached_tokens == 0
    assert list(other.output_ids) == references.greedy(kind, "all", prompt, 16)


@pytest.mark.skipif(SMG is None, reason="the smg router is a dev dependency")
def test_one_router_in_front_routes_each_name_to_its_adapter(
    worker, adapter_dirs, references, kind, tmp_path
):
    from transformers import AutoTokenizer

    names = [BASE, *adapter_dirs]
    router = Router([_address(worker, name) for name in names], tmp_path / "smg.log")
    try:
        router.wait_until_serving()
        listed = {m["id"] for m in router.client.get("/v1/models").json()["data"]}
        assert listed >= set(names)
        tokenizer = AutoTokenizer.from_pretrained(str(demo_model_path("llama")))

        def chat(name: str) -> str:
            body = {
                "model": name,
                "messages": [{"role": "user", "content": QUESTIONS[1]}],
                "max_tokens": 12,
                "temperature": 0,
            }
            response = router.client.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["message"]["content"]

        with ThreadPoolExecutor(len(names)) as pool:
            replies = dict(zip(names, pool.map(chat, names), strict=True))
        prompt = _chat_ids(QUESTIONS[1])
        for name in names:
            tokens = references.greedy(kind, None if name == BASE else name, prompt, 12)
            eos = tokenizer.eos_token_id
            tokens = tokens[: tokens.index(eos)] if eos in tokens else tokens
            assert (replies[name] or "") == tokenizer.decode(tokens, skip_special_tokens=True), name
    finally:
        router.close()


def test_metrics_count_each_adapters_requests_and_tokens(worker, adapter_dirs):
    registry = worker.server.metrics.registry
    before = registry.get_sample_value(
        "mlx_worker_adapter_generated_tokens_total", {"adapter": "attn"}
    )
    _generate(worker, "attn", [301, 302, 303, 304, 305], n=5)
    _generate(worker, BASE, [301, 302, 303, 304, 305], n=5)
    after = registry.get_sample_value(
        "mlx_worker_adapter_generated_tokens_total", {"adapter": "attn"}
    )
    assert after - (before or 0) == 5
    ended = {"adapter": "attn", "outcome": "length"}
    assert registry.get_sample_value("mlx_worker_adapter_requests_total", ended) >= 1
    assert (
        registry.get_sample_value(
            "mlx_worker_adapter_requests_total", {"adapter": BASE, "outcome": "length"}
        )
        is None
    )  # the base model is not an adapter


def test_structured_output_and_n_on_an_adapters_address(worker):
    """The vLLM face's features hold on an adapter's address: a JSON schema, n = 2."""
    import json

    schema = {
        "type": "object",
        "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    with grpc.insecure_channel(_address(worker, "all")) as channel:
        request = vpb.GenerateRequest(
            request_id="all-json",
            tokenized=vpb.TokenizedInput(input_ids=_chat_ids(QUESTIONS[0])),
            sampling_params=vpb.SamplingParams(
                temperature=0.0, max_tokens=32, json_schema=json.dumps(schema), n=2
            ),
        )
        completes = [
            r.complete for r in vgrpc.VllmEngineStub(channel).Generate(request, timeout=120)
        ]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(demo_model_path("llama")))
    assert sorted(c.index for c in completes) == [0, 1]
    for complete in completes:
        text = tokenizer.decode(list(complete.output_ids), skip_special_tokens=True)
        assert set(json.loads(text)) == {"answer"}


def test_get_loads_on_an_adapters_address_counts_its_own_requests(worker, kind):
    """GetLoads: the engine's capacity on every address, each adapter's own running requests."""
    import time

    if kind != "float32":
        pytest.skip("one base is enough")
    with grpc.insecure_channel(_address(worker, "attn")) as channel:
        stub = vgrpc.VllmEngineStub(channel)
        request = vpb.GenerateRequest(
            request_id="attn-long",
            tokenized=vpb.TokenizedInput(input_ids=[301, 302, 303]),
            sampling_params=vpb.SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True),
            stream=True,
        )
        calls = stub.Generate(request, timeout=120)
        next(calls)  # it is decoding
        loads = {}
        for name in ("attn", "all", BASE):
            with grpc.insecure_channel(_address(worker, name)) as other:
                answer = vgrpc.VllmEngineStub(other).GetLoads(vpb.GetLoadsRequest(), timeout=10)
            loads[name] = answer.loads[0]
        calls.cancel()
        time.sleep(0.2)
    assert loads["attn"].num_running_reqs + loads["attn"].num_waiting_reqs == 1
    assert loads["all"].num_running_reqs + loads["all"].num_waiting_reqs == 0
    assert loads["all"].max_total_num_tokens == loads[BASE].max_total_num_tokens > 0
