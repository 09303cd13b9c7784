"""Qwen3-VL's images (the tiny qwen3_vl demo: Qwen2-VL's prompt, interleaved multimodal RoPE
and deepstack features added after the first text layers): through the real server each answer
equals mlx-vlm's own greedy generation, the prompt expanded and the pixels made by mlx-vlm's
processor, for images of different sizes, batched with a text request and from a cached prefix;
and through the real smg router, which knows the family but leaves its images to a worker that
advertises an mm_processor (media references, one anchor each in the prompt).

The other Qwen3-VL-like families' files run these same tests on their demo (they override the
`family` fixture)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from conftest import demo_config
from support import SMG, Router, ServerThread
from test_images import complete, data_url, image_request, needs_vlm, png
from test_images_qwen2_5 import reference
from vlm_support import loaded, routed_image_chat, served

from servicer.proto import vllm_engine_pb2_grpc as vgrpc

pytestmark = needs_vlm


@pytest.fixture(scope="module")
def family() -> str:
    return "qwen3_vl"


@pytest.fixture(scope="module")
def image_last() -> bool:
    """Whether the image follows the question (a demo that heeds an image only near the end
    of its prompt), else it comes first."""
    return False


@pytest.fixture(scope="module")
def vlm_dir(family) -> Path:
    from servicer.demos.vision import demo_vlm_path

    return demo_vlm_path(family=family)


@pytest.fixture(scope="module")
def stub(vlm_dir) -> Iterator[vgrpc.VllmEngineStub]:
    with served(vlm_dir) as running:
        yield running


def chat(vlm_dir: Path, question: str, raws: list[bytes], last: bool) -> tuple[list[int], Any]:
    """The prompt as the router sends it (one anchor per image, the images before or after the
    question), and mlx-vlm's greedy generation for it (a function of the token count)."""
    import io

    import mlx.core as mx
    from mlx_vlm.generate import generate_step
    from PIL import Image

    model, processor = loaded(str(vlm_dir))
    images, words = [{"type": "image"}] * len(raws), [{"type": "text", "text": question}]
    content = words + images if last else images + words
    text = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    pictures = [Image.open(io.BytesIO(raw)).convert("RGB") for raw in raws]
    out = processor(
        text=text, images=pictures or None, return_tensors="np", add_special_tokens=False
    )
    ids = mx.array(out["input_ids"])

    def greedy(n: int) -> tuple[list[int], int]:
        extra = {"image_grid_thw": mx.array(out["image_grid_thw"])} if raws else {}
        pixels = mx.array(out["pixel_values"]) if raws else None
        steps = generate_step(ids, model, pixels, mx.ones_like(ids), max_tokens=n, **extra)
        tokens = [int(token) for token, _ in steps]
        end = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
        return tokens[:end], ids.shape[1]

    eos = model.config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    prompt = list(processor.tokenizer.encode(text, add_special_tokens=False))
    return prompt, greedy


def test_images_alone_batched_with_text_and_from_a_prefix_equal_mlx_vlm(stub, vlm_dir, image_last):
    """Two images of different sizes (3x2 and 2x3 merged tokens after resizing) asked alone,
    then both with a text request at once, each its own single-sequence answer; the first
    again reuses its prompt past the image."""
    question = "Describe a quiet place."
    raws = [png(92, (112, 84)), png(91, (64, 96))]
    chats = [chat(vlm_dir, question, [raw], image_last) for raw in raws]
    chats.append(chat(vlm_dir, "Hello there.", [], image_last))
    jobs = [
        image_request(ids, [data_url(r)], max_tokens=16)
        for (ids, _), r in zip(chats, raws, strict=False)
    ]
    jobs.append(image_request(chats[2][0], [], max_tokens=16))
    wants = [greedy(16) for _, greedy in chats]
    assert wants[0][0] != wants[1][0]  # the image matters
    for job, (want, length) in zip(jobs[:2], wants, strict=False):
        done = complete(stub, job)
        assert (list(done.output_ids), done.prompt_tokens) == (want, length)
    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(lambda job: complete(stub, job), jobs))
    assert [list(a.output_ids) for a in answers] == [want for want, _ in wants]
    again = complete(stub, jobs[0])
    assert again.cached_tokens >= 3 + 3 * 2  # past the image's run
    assert list(again.output_ids) == wants[0][0]


@pytest.mark.skipif(SMG is None, reason="the smg router is a dev dependency")
def test_through_the_router_answers_as_mlx_vlm_does(family, vlm_dir, tmp_path):
    """On the vLLM face under its demo name: the router sends the image as a media reference,
    one anchor in the prompt, and the answer is mlx-vlm's."""
    from transformers import AutoTokenizer

    raw, question = png(46, (64, 48)), "What do bees make?"
    config = json.loads((vlm_dir / "config.json").read_text())
    assert config["model_type"] == family
    sent = []
    with ServerThread(dataclasses.replace(demo_config(vlm_dir), protocols=("vllm",))) as running:
        preparer = running.server.servicer.images
        prepare = preparer.prepare

        async def spy(request):
            sent.append((len(request.media_refs.items), request.mm_inputs.ByteSize()))
            return await prepare(request)

        preparer.prepare = spy
        router = Router([running.address], tmp_path / "smg.log")
        try:
            response = routed_image_chat(router, question, data_url(raw))
        finally:
            router.close()
    assert response.status_code == 200, response.text
    assert sent == [(1, 0)]  # one media reference, no mm_inputs
    tokens, _ = reference(vlm_dir, question, [raw])
    text = AutoTokenizer.from_pretrained(str(vlm_dir)).decode(tokens, skip_special_tokens=True)
    assert response.json()["choices"][0]["message"]["content"] == text
