"""LLaVA-OneVision's images (anyres: the whole image, then tiles of the image resized to a
pinpoint resolution, unpadded, a newline a row; the count depends on the image's size, which
the checkpoint's own processor expands): through the real server each answer equals mlx-vlm's
own greedy generation, with the prompt expanded and the pixels made by mlx-vlm's processor,
for images tiled differently, batched with text and from a cached prefix. Through the real
smg router: under a served name holding "llava" but no LLaVA version it has a processor for
(demo:vlm:llava_onevision's) smg 1.13 refuses the image itself; under another name it sends
media references, and the answer is mlx-vlm's."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import demo_config
from support import SMG, Router, ServerThread
from test_images import complete, data_url, image_request, needs_vlm, png
from vlm_support import chat_text, loaded, routed_image_chat, router_ids, served

from servicer.demos.llava_onevision import TOKENS_PER_TILE
from servicer.proto import vllm_engine_pb2_grpc as vgrpc
from servicer.server import ModelSpec

pytestmark = needs_vlm
SERVED_NAME = "mlx-grpc-worker-demo-vlm-llava_onevision"  # --model demo:vlm:llava_onevision's


@pytest.fixture(scope="module")
def vlm_dir():
    from servicer.demos.vision import demo_vlm_path

    return demo_vlm_path(family="llava_onevision")


@pytest.fixture(scope="module")
def stub(vlm_dir) -> Iterator[vgrpc.VllmEngineStub]:
    with served(vlm_dir) as running:
        yield running


def processed_chat(vlm_dir, question: str, raws: list[bytes]) -> tuple[object, dict]:
    """mlx-vlm's model, and its processor's output for the chat with `raws` as the images
    (its LLaVA-OneVision processor hands every keyword argument to the image processor)."""
    import io

    from PIL import Image

    model, processor = loaded(str(vlm_dir))
    pictures = [Image.open(io.BytesIO(raw)).convert("RGB") for raw in raws]
    return model, processor(text=chat_text(vlm_dir, question, len(raws)), images=pictures or None)


def reference(vlm_dir, question: str, raws: list[bytes], n: int = 12) -> tuple[list[int], int]:
    """mlx-vlm's greedy tokens up to the EOS the worker stops at, its processor expanding the
    prompt and making the pixels; and the expanded prompt's length."""
    import mlx.core as mx
    from mlx_vlm.generate import generate_step

    model, out = processed_chat(vlm_dir, question, raws)
    ids = mx.array(out["input_ids"])
    kwargs = {"image_sizes": out["image_sizes"]} if raws else {}
    pixels = mx.array(out["pixel_values"]) if raws else None
    steps = generate_step(ids, model, pixels, mx.ones_like(ids), max_tokens=n, **kwargs)
    tokens = [int(token) for token, _ in steps]
    eos = model.config.eos_token_id
    eos = eos if isinstance(eos, int) else 1
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens, ids.shape[1]


def _tiles(vlm_dir, raw: bytes) -> int:
    """How many tower inputs (the whole image and its tiles) mlx-vlm's processor makes."""
    return processed_chat(vlm_dir, "", [raw])[1]["pixel_values"].shape[1]


def test_two_images_tiled_differently_answer_as_mlx_vlm_does(stub, vlm_dir):
    question = "What do bees make?"
    raws = [png(80, (64, 48)), png(81, (30, 90))]
    assert [_tiles(vlm_dir, raw) for raw in raws] == [5, 3]  # 2x2 tiles, 2x1 tiles
    answers = []
    for raw in raws:
        done = complete(stub, image_request(router_ids(vlm_dir, question), [data_url(raw)]))
        want, length = reference(vlm_dir, question, [raw])
        assert done.prompt_tokens == length > len(router_ids(vlm_dir, question)) + TOKENS_PER_TILE
        assert list(done.output_ids) == want
        answers.append(want)
    assert answers[0] != answers[1]  # the image counts


def test_image_and_text_rows_batched_and_a_prefix_hit(stub, vlm_dir):
    question = "Describe a quiet place."
    raws = [png(90, (64, 48)), png(91, (96, 40))]
    jobs = [image_request(router_ids(vlm_dir, question), [data_url(r)]) for r in raws]
    jobs.append(image_request(router_ids(vlm_dir, "Hello there.", images=0), []))
    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(lambda job: complete(stub, job), jobs))
    for raw, answer in zip(raws, answers, strict=False):
        assert list(answer.output_ids) == reference(vlm_dir, question, [raw])[0]
    assert list(answers[2].output_ids) == reference(vlm_dir, "Hello there.", [])[0]
    again = complete(stub, jobs[0])
    assert again.cached_tokens > 40 and list(again.output_ids) == list(answers[0].output_ids)


def _routed(vlm_dir, tmp_path, name: str, raw: bytes) -> tuple[object, list]:
    """The router's answer to one image chat, the worker served as `name`; and what the
    worker got: (media references, mm_inputs bytes) per request."""
    config = demo_config(vlm_dir)
    config = dataclasses.replace(config, protocols=("vllm",), model=ModelSpec(str(vlm_dir), name))
    sent = []
    with ServerThread(config) as running:
        preparer = running.server.servicer.images
        prepare = preparer.prepare

        async def spy(request):
            sent.append((len(request.media_refs.items), request.mm_inputs.ByteSize()))
            return await prepare(request)

        preparer.prepare = spy
        router = Router([running.address], tmp_path / f"smg-{name}.log")
        try:
            return routed_image_chat(router, "What do bees make?", data_url(raw)), sent
        finally:
            router.close()


@pytest.mark.skipif(SMG is None, reason="the smg router is a dev dependency")
def test_the_router_refuses_it_under_the_demo_name(vlm_dir, tmp_path):
    """smg 1.13 takes a served name holding "llava" for a LLaVA it processes itself, and
    finds no vision processor for this one: 400 before the worker sees anything."""
    response, sent = _routed(vlm_dir, tmp_path, SERVED_NAME, png(46, (64, 48)))
    assert response.status_code == 400, response.text
    assert "No vision processor found" in response.text
    assert sent == []


@pytest.mark.skipif(SMG is None, reason="the smg router is a dev dependency")
def test_through_the_router_as_media_references_answers_as_mlx_vlm_does(vlm_dir, tmp_path):
    """Under a name without "llava" the router has no spec for the family: it sends the
    image as a media reference, one anchor in the prompt, and the answer is mlx-vlm's."""
    from transformers import AutoTokenizer

    raw = png(46, (64, 48))
    response, sent = _routed(vlm_dir, tmp_path, "demo-model", raw)
    assert response.status_code == 200, response.text
    assert sent == [(1, 0)]  # one media reference, no mm_inputs
    tokens, length = reference(vlm_dir, "What do bees make?", [raw])
    tokenizer = AutoTokenizer.from_pretrained(str(vlm_dir))
    reply = response.json()
    assert reply["choices"][0]["message"]["content"] == tokenizer.decode(
        tokens, skip_special_tokens=True
    )
    assert reply["usage"] == reply["usage"] | {
        "prompt_tokens": length,
        "completion_tokens": len(tokens),
    }
