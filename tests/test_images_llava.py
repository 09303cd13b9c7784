"""LLaVA's images (a fixed run of `<image>` tokens per image, CLIP features from the
next-to-last layer): through the real server each answer equals mlx-vlm's own greedy generation,
with the prompt expanded and the pixels made by mlx-vlm's processor, alone, batched with text
and from a cached prefix."""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import demo_config
from support import SMG, ServerThread
from test_images import complete, data_url, image_request, needs_vlm, png
from vlm_support import chat_text, chat_through_a_router, loaded, router_ids, served

from servicer.demos.llava import TOKENS_PER_IMAGE
from servicer.proto import vllm_engine_pb2_grpc as vgrpc
from servicer.server import ModelSpec

IMAGE_TOKEN_ID = 512  # <image>, appended to the llama demo's vocabulary

pytestmark = needs_vlm


@pytest.fixture(scope="module")
def vlm_dir():
    from servicer.demos.vision import demo_vlm_path

    return demo_vlm_path(family="llava")


@pytest.fixture(scope="module")
def stub(vlm_dir) -> Iterator[vgrpc.VllmEngineStub]:
    with served(vlm_dir) as running:
        yield running


def reference(vlm_dir, question: str, raws: list[bytes], n: int) -> tuple[list[int], int]:
    """mlx-vlm's greedy tokens, its processor expanding the prompt and making the pixels; and
    the expanded prompt's length."""
    import mlx.core as mx
    from mlx_vlm.generate import generate_step
    from PIL import Image

    model, processor = loaded(str(vlm_dir))
    text = chat_text(vlm_dir, question, len(raws))
    pictures = [Image.open(io.BytesIO(raw)).convert("RGB") for raw in raws]
    # (mlx-vlm's LlavaProcessor hands its keyword arguments to the image processor.)
    out = processor(text=text, images=pictures or None)
    ids = mx.array(out["input_ids"])
    if raws:
        count = int(mx.sum(ids == model.config.image_token_index).item())
        assert count == TOKENS_PER_IMAGE * len(raws)
    pixels = mx.array(out["pixel_values"]) if raws else None
    steps = generate_step(ids, model, pixels, mx.ones_like(ids), max_tokens=n)
    return [int(token) for token, _ in steps], ids.shape[1]


@pytest.mark.parametrize("size", [(64, 48), (56, 56), (30, 90)])
def test_an_image_answer_equals_mlx_vlms(stub, vlm_dir, size):
    raw = png(80 + size[0], size)
    question = "What do bees make?"
    done = complete(stub, image_request(router_ids(vlm_dir, question), [data_url(raw)]))
    want, length = reference(vlm_dir, question, [raw], 12)
    assert done.prompt_tokens == length
    assert list(done.output_ids) == want


def test_image_and_text_rows_batched_and_a_prefix_hit(stub, vlm_dir):
    question = "Describe a quiet place."
    raws = [png(90, (64, 48)), png(91, (84, 56)), png(90, (64, 48))]
    jobs = [image_request(router_ids(vlm_dir, question), [data_url(r)]) for r in raws]
    jobs.append(image_request(router_ids(vlm_dir, "Hello there.", images=0), []))
    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(lambda job: complete(stub, job), jobs))
    for raw, answer in zip(raws, answers, strict=False):
        assert list(answer.output_ids) == reference(vlm_dir, question, [raw], 12)[0]
    assert list(answers[3].output_ids) == reference(vlm_dir, "Hello there.", [], 12)[0]
    # The two images make two answers (the image counts), the same image the same one.
    assert list(answers[0].output_ids) != list(answers[1].output_ids)
    again = complete(stub, jobs[0])
    assert again.cached_tokens > 8 and list(again.output_ids) == list(answers[0].output_ids)


def test_two_images_in_one_prompt(stub, vlm_dir):
    question = "What do bees make?"
    raws = [png(92, (64, 48)), png(93, (48, 64))]
    urls = [data_url(raw) for raw in raws]
    done = complete(stub, image_request(router_ids(vlm_dir, question, images=2), urls))
    want, length = reference(vlm_dir, question, raws, 12)
    assert done.prompt_tokens == length
    assert list(done.output_ids) == want


def test_the_routers_own_mm_inputs_answer_as_mlx_vlm_does(stub, vlm_dir):
    """What smg sends for a llava it processes itself: pixel values [images, 3, h, w] and the
    placeholders already expanded (filled with the image token)."""
    import numpy as np
    from PIL import Image
    from transformers import AutoImageProcessor

    from servicer.proto import vllm_engine_pb2 as vpb

    raw = png(95, (64, 48))
    processor = AutoImageProcessor.from_pretrained(str(vlm_dir), backend="pil")
    picture = Image.open(io.BytesIO(raw)).convert("RGB")
    pixels = np.asarray(
        processor(images=[picture], return_tensors="np")["pixel_values"], np.float32
    )
    prompt = router_ids(vlm_dir, "What do bees make?")
    anchor = prompt.index(IMAGE_TOKEN_ID)
    ids = prompt[:anchor] + [IMAGE_TOKEN_ID] * TOKENS_PER_IMAGE + prompt[anchor + 1 :]
    mm = vpb.MultimodalInputs(
        pixel_values=vpb.TensorData(
            shape=list(pixels.shape), dtype="float32", inline=pixels.tobytes()
        ),
        im_token_id=IMAGE_TOKEN_ID,
        mm_placeholders=[vpb.PlaceholderRange(offset=anchor, length=TOKENS_PER_IMAGE)],
        modality=1,
    )
    job = vpb.GenerateRequest(
        request_id="llava-mm-1",
        tokenized=vpb.TokenizedInput(input_ids=ids),
        sampling_params=vpb.SamplingParams(temperature=0.0, max_tokens=12),
        mm_inputs=mm,
    )
    done = complete(stub, job)
    want, length = reference(vlm_dir, "What do bees make?", [raw], 12)
    assert done.prompt_tokens == length
    got = list(done.output_ids)
    assert got == want[: len(got)]  # mlx-vlm's steps run past the EOS the worker stops at
    assert len(got) == len(want) or done.finish_reason == "stop"


@pytest.mark.skipif(SMG is None, reason="the smg router is a dev dependency")
def test_through_the_router_as_llava_1_5_answers_as_mlx_vlm_does(vlm_dir, tmp_path):
    """smg processes LLaVA images itself when the served name names a LLaVA version it has a
    vision processor for ("llava-1.5"; plain "llava" finds none and answers 400): it sends
    mm_inputs, and the answer equals mlx-vlm's greedy generation."""
    from transformers import AutoTokenizer

    raw, question = png(46, (64, 48)), "What do bees make?"
    model = ModelSpec(str(vlm_dir), "llava-1.5-demo")
    config = dataclasses.replace(demo_config(vlm_dir), protocols=("vllm",), model=model)
    with ServerThread(config) as running:
        response = chat_through_a_router(running, tmp_path / "smg.log", question, data_url(raw))
        registry = running.server.metrics.registry
        by_router = registry.get_sample_value(
            "mlx_worker_image_requests_total", {"processed_by": "router"}
        )
    assert response.status_code == 200, response.text
    assert by_router == 1
    tokens, _ = reference(vlm_dir, question, [raw], 12)
    tokenizer = AutoTokenizer.from_pretrained(str(vlm_dir))
    eos = tokenizer.eos_token_id
    tokens = tokens[: tokens.index(eos) + 1] if eos in tokens else tokens  # the worker stops
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    reply = response.json()
    assert reply["choices"][0]["message"]["content"] == text
    assert reply["usage"]["completion_tokens"] == len(tokens)
