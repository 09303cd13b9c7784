"""Qwen2-VL and Qwen2.5-VL images through the real SMG router on its own path: the router
finds `<image>` in the worker's respelled tokenizer copy, processes each image itself and sends
mm_inputs (its runs already in the prompt); each answer equals mlx-vlm's greedy generation."""

from __future__ import annotations

import dataclasses
import importlib.util
import io
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import demo_config
from support import SMG, Router, ServerThread
from test_images import chat_ids, data_url, png
from test_images_qwen2 import expanded, mlx_vlm_greedy, processed

from servicer.proto import common_pb2
from servicer.proto import vllm_engine_pb2 as vpb
from servicer.proto import vllm_engine_pb2_grpc as vgrpc

pytestmark = [
    pytest.mark.skipif(SMG is None, reason="the smg router is a dev dependency"),
    pytest.mark.skipif(
        importlib.util.find_spec("mlx_vlm") is None, reason="mlx-vlm (the vision extra) is absent"
    ),
]

QUESTION = "What do bees make?"
IMAGES = "mlx_worker_image_requests_total"


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def vlm_dir(request):
    """Qwen2.5-VL too, served by its path (it holds "qwen" and "vl": the router's own path)."""
    from servicer.demos.vision import demo_vlm_path

    return demo_vlm_path(family=request.param)


@pytest.fixture(scope="module")
def worker(vlm_dir) -> Iterator[ServerThread]:
    config = dataclasses.replace(demo_config(vlm_dir, prompt_cache_block=4), protocols=("vllm",))
    with ServerThread(config) as running:
        yield running


@pytest.fixture(scope="module")
def router(worker, tmp_path_factory) -> Iterator[tuple[Router, str]]:
    running = Router([worker.address], tmp_path_factory.mktemp("router") / "smg.log")
    try:
        yield running, running.wait_until_serving()
    finally:
        running.close()


def _images(worker: ServerThread, by: str) -> float:
    value = worker.server.metrics.registry.get_sample_value(IMAGES, {"processed_by": by})
    return value or 0.0


def _chat(router: tuple[Router, str], raw: bytes) -> dict:
    running, model = router
    content = [
        {"type": "image_url", "image_url": {"url": data_url(raw)}},
        {"type": "text", "text": QUESTION},
    ]
    body = {"model": model, "messages": [{"role": "user", "content": content}]}
    response = running.client.post(
        "/v1/chat/completions", json={**body, "max_tokens": 12, "temperature": 0}
    )
    assert response.status_code == 200, f"{response.text}\n{running.log_tail()}"
    return response.json()


def _expected(vlm_dir, raw: bytes) -> tuple[str, int]:
    """mlx-vlm's greedy answer to the chat, decoded, and the expanded prompt's length."""
    from transformers import AutoTokenizer

    pixels, grids = processed(vlm_dir, [raw])
    ids, _ = expanded(vlm_dir, chat_ids(vlm_dir, QUESTION), grids)
    tokens = mlx_vlm_greedy(vlm_dir, ids, pixels, grids)
    text = AutoTokenizer.from_pretrained(str(vlm_dir)).decode(tokens, skip_special_tokens=True)
    return text, len(ids)


def test_the_router_gets_a_respelled_copy_and_the_checkpoint_keeps_its_own(worker, vlm_dir):
    with worker.channel() as channel:
        stub = vgrpc.VllmEngineStub(channel)
        path = Path(stub.GetModelInfo(vpb.GetModelInfoRequest(), timeout=30).tokenizer_path)
        chunks = stub.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=30)
        archive = zipfile.ZipFile(io.BytesIO(b"".join(c.data for c in chunks)))
    assert (
        path != vlm_dir
        and (path / "config.json").read_bytes() == (vlm_dir / "config.json").read_bytes()
    )
    for tokenizer_json in ((path / "tokenizer.json").read_text(), archive.read("tokenizer.json")):
        assert '"<image>"' in str(tokenizer_json) and "<|image_pad|>" not in str(tokenizer_json)
    assert "<|image_pad|>" in (vlm_dir / "tokenizer.json").read_text()


def test_a_data_url_image_comes_as_mm_inputs_and_answers_as_mlx_vlm_does(router, worker, vlm_dir):
    before = _images(worker, "router"), _images(worker, "worker")
    raw = png(60, (112, 84))
    reply = _chat(router, raw)
    text, prompt_tokens = _expected(vlm_dir, raw)
    assert reply["choices"][0]["message"]["content"] == text
    assert reply["usage"]["prompt_tokens"] == prompt_tokens
    assert (_images(worker, "router"), _images(worker, "worker")) == (before[0] + 1, before[1])


def test_two_images_with_the_same_text_each_answer_as_mlx_vlm_does(router, worker, vlm_dir):
    """The same question with two different images, one after the other (vllm-mlx #718's bug
    class): each answer is mlx-vlm's for its own image, and the two differ."""
    raws = png(61, (84, 112)), png(64, (56, 140))
    before = _images(worker, "router")
    replies = [_chat(router, raw)["choices"][0]["message"]["content"] for raw in raws]
    wants = [_expected(vlm_dir, raw)[0] for raw in raws]
    assert replies == wants and wants[0] != wants[1]
    assert _images(worker, "router") == before + 2
