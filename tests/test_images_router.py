"""Images end to end through the real SMG router: OpenAI chat requests with image_url parts
(data: URLs, and http URLs from a local server the worker is allowed to fetch from) reach the
worker as media references; each answer equals mlx-vlm's own greedy generation."""

from __future__ import annotations

import dataclasses
import http.server
import importlib.util
import threading
import time
from collections.abc import Iterator

import pytest
from conftest import demo_config
from support import SMG, Router, ServerThread
from test_images import chat_ids, data_url, expanded, mlx_vlm_greedy, png

from servicer.media import MediaPolicy
from servicer.proto import mlx_engine_pb2

pytestmark = [
    pytest.mark.skipif(SMG is None, reason="the smg router is a dev dependency"),
    pytest.mark.skipif(
        importlib.util.find_spec("mlx_vlm") is None, reason="mlx-vlm (the vision extra) is absent"
    ),
]

QUESTION = "What do bees make?"


@pytest.fixture(scope="module")
def vlm_dir():
    from servicer.demos.vision import demo_vlm_path

    return demo_vlm_path(family="gemma3")


@pytest.fixture(scope="module")
def images_site() -> Iterator[tuple[str, dict[str, bytes]]]:
    """A local HTTP server holding two PNGs: its base URL and the files."""
    files = {"/a.png": png(41), "/b.png": png(42)}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.startswith("/slow"):
                time.sleep(1.5)
            body = files.get(self.path.removeprefix("/slow"))
            self.send_response(200 if body else 404)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", files
    finally:
        server.shutdown()


@pytest.fixture(scope="module")
def worker(vlm_dir) -> Iterator[ServerThread]:
    config = demo_config(vlm_dir, prompt_cache_block=4)
    handlers = dataclasses.replace(config.handlers, media=MediaPolicy(allowed_hosts=("127.0.0.1",)))
    config = dataclasses.replace(config, protocols=("mlx", "vllm"), handlers=handlers)
    with ServerThread(config) as running:
        yield running


@pytest.fixture(scope="module")
def router(worker, tmp_path_factory) -> Iterator[tuple[Router, str]]:
    running = Router([worker.address], tmp_path_factory.mktemp("router") / "smg.log")
    try:
        yield running, running.wait_until_serving()
    finally:
        running.close()


def _chat(router: tuple[Router, str], url: str, **body) -> dict:
    running, model = router
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION}]
    request = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 12,
        "temperature": 0,
        **body,
    }
    response = running.client.post("/v1/chat/completions", json=request)
    assert response.status_code == 200, response.text
    return response.json()


def _expected_text(vlm_dir, raw: bytes) -> str:
    from transformers import AutoTokenizer

    tokens = mlx_vlm_greedy(vlm_dir, expanded(vlm_dir, chat_ids(vlm_dir, QUESTION)), [raw], 12)
    return AutoTokenizer.from_pretrained(str(vlm_dir)).decode(tokens, skip_special_tokens=True)


def test_a_data_url_image_answers_as_mlx_vlm_does(router, vlm_dir):
    raw = png(40)
    reply = _chat(router, data_url(raw))
    assert reply["choices"][0]["message"]["content"] == _expected_text(vlm_dir, raw)


def test_an_http_image_from_an_allowed_host_answers_as_mlx_vlm_does(router, vlm_dir, images_site):
    base, files = images_site
    answers = {
        name: _chat(router, base + name)["choices"][0]["message"]["content"] for name in files
    }
    for name, raw in files.items():
        assert answers[name] == _expected_text(vlm_dir, raw)


def _encoded(worker: ServerThread) -> float:
    registry = worker.server.metrics.registry
    return registry.get_sample_value("mlx_worker_images_encoded_total") or 0.0


def test_the_same_image_again_is_a_hit_past_the_image(router, worker, vlm_dir):
    """...with no encoder run: the image's prefix is reused whole."""
    url = data_url(png(43))
    before = _encoded(worker)
    first = _chat(router, url)
    encoded = _encoded(worker)
    again = _chat(router, url)
    assert encoded == before + 1 and _encoded(worker) == encoded
    image_end = expanded(vlm_dir, chat_ids(vlm_dir, QUESTION)).index(514) + 4
    cached = (again["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    assert cached > image_end
    assert again["choices"][0]["message"] == first["choices"][0]["message"]


def test_the_mlx_face_stays_text_only(vlm_dir, tmp_path):
    """Behind a worker answering MlxEngine only, the router refuses an image itself: the MLX
    wire has no field for one."""
    assert "media_refs" not in mlx_engine_pb2.GenerateRequest.DESCRIPTOR.fields_by_name
    with ServerThread(demo_config(vlm_dir)) as mlx_only:
        running = Router([mlx_only.address], tmp_path / "smg.log")
        try:
            model = running.wait_until_serving()
            content = [{"type": "image_url", "image_url": {"url": data_url(png(44))}}]
            body = {"model": model, "messages": [{"role": "user", "content": content}]}
            response = running.client.post("/v1/chat/completions", json=body)
            assert response.status_code == 400, response.text
        finally:
            running.close()


def _routed_answer(model_dir, protocols: tuple[str, ...], tmp_path, url: str) -> dict:
    """One worker of `model_dir` and a router in front: the reply to a chat with one image."""
    config = dataclasses.replace(demo_config(model_dir), protocols=protocols)
    with ServerThread(config) as running:
        router = Router([running.address], tmp_path / "smg.log")
        try:
            return _chat((router, router.wait_until_serving()), url)
        finally:
            router.close()


def test_mistral3_through_the_router_answers_as_mlx_vlm_does(tmp_path):
    from test_images_mistral3 import reference
    from transformers import AutoTokenizer

    from servicer.demos.vision import demo_vlm_path

    model_dir = demo_vlm_path(family="mistral3")
    raw = png(46, (64, 48))
    reply = _routed_answer(model_dir, ("vllm",), tmp_path, data_url(raw))
    tokens, _ = reference(model_dir, QUESTION, [raw], 12)
    text = AutoTokenizer.from_pretrained(str(model_dir)).decode(tokens, skip_special_tokens=True)
    assert reply["choices"][0]["message"]["content"] == text


def test_an_abort_while_its_images_are_fetched_ends_the_request_as_aborted(
    worker, images_site, vlm_dir
):
    """The request is not in flight until its images are ready: an Abort of its id before
    then still ends it, as an Abort of a request in flight does (finish reason "abort", no
    token), not as a failed call."""
    from test_images import image_request

    from servicer.proto import vllm_engine_pb2 as vpb
    from servicer.proto import vllm_engine_pb2_grpc as vgrpc

    base, _ = images_site
    job = image_request(chat_ids(vlm_dir, QUESTION), [base + "/slow/a.png"], max_tokens=64)
    with worker.channel() as channel:
        stub = vgrpc.VllmEngineStub(channel)
        calls = stub.Generate(job, timeout=60)
        time.sleep(0.5)
        stub.Abort(vpb.AbortRequest(request_ids=[job.request_id]), timeout=10)
        (done,) = [response.complete for response in calls]
    assert done.finish_reason == "abort"
    assert list(done.output_ids) == []


def test_two_images_with_the_same_text_each_answer_as_mlx_vlm_does(router, vlm_dir):
    """The same question with two different images: each answer is mlx-vlm's for its own
    image (the second reuses only what precedes the image)."""
    first, second = png(48), png(49)
    replies = [_chat(router, data_url(raw)) for raw in (first, second)]
    for raw, reply in zip((first, second), replies, strict=True):
        assert reply["choices"][0]["message"]["content"] == _expected_text(vlm_dir, raw)
    image_at = expanded(vlm_dir, chat_ids(vlm_dir, QUESTION)).index(514)
    cached = (replies[1]["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    assert cached <= image_at


def test_a_bad_image_through_the_router_is_a_client_error(router):
    running, model = router
    content = [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "text", "text": QUESTION},
    ]
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    response = running.client.post("/v1/chat/completions", json=body)
    assert 400 <= response.status_code < 500, response.text
    assert _chat(router, data_url(png(50)))["choices"]  # the worker goes on serving
