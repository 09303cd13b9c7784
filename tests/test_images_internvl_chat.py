"""InternVL's images (mlx-vlm's internvl_chat: dynamic tiles, each 4 image tokens here, the
whole image as one more where there are several; `<image>` expanded into `<img>`, an
`<IMG_CONTEXT>` per image token, `</img>`): through the real server each answer equals
mlx-vlm's own greedy generation, with the prompt expanded and the pixels made by mlx-vlm's
processor (the worker's is servicer.numpy_processors, no MLX), for images tiled differently,
batched with text and from a cached prefix; and through the real smg router, which has no
spec for the family and sends its images as media references."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import demo_config
from support import SMG, Router, ServerThread
from test_images import complete, data_url, image_request, needs_vlm, png
from vlm_support import loaded, processed_chat, routed_image_chat, router_ids, served

from servicer.demos.internvl_chat import TOKENS_PER_TILE
from servicer.proto import vllm_engine_pb2_grpc as vgrpc
from servicer.server import ModelSpec

pytestmark = needs_vlm
SERVED_NAME = "mlx-grpc-worker-demo-vlm-internvl_chat"  # --model demo:vlm:internvl_chat's


@pytest.fixture(scope="module")
def vlm_dir():
    from servicer.demos.vision import demo_vlm_path

    return demo_vlm_path(family="internvl_chat")


@pytest.fixture(scope="module")
def stub(vlm_dir) -> Iterator[vgrpc.VllmEngineStub]:
    with served(vlm_dir) as running:
        yield running


def reference(vlm_dir, question: str, raws: list[bytes], n: int = 12) -> tuple[list[int], int]:
    """mlx-vlm's greedy tokens up to the EOS the worker stops at, its processor expanding the
    prompt and making the pixels; and the expanded prompt's length."""
    import mlx.core as mx
    import numpy as np
    from mlx_vlm.generate import generate_step

    if raws:
        model, out = processed_chat(vlm_dir, question, raws)
    else:  # mlx-vlm's processor takes no text without an image: the router's ids as they are
        model, out = loaded(str(vlm_dir))[0], {"input_ids": [router_ids(vlm_dir, question, 0)]}
    ids = mx.array(np.asarray(out["input_ids"]))
    kwargs = {"image_token_index": out["image_token_index"]} if raws else {}
    pixels = mx.array(np.asarray(out["pixel_values"])) if raws else None
    steps = generate_step(ids, model, pixels, mx.ones_like(ids), max_tokens=n, **kwargs)
    tokens = [int(token) for token, _ in steps]
    eos = model.config.eos_token_id
    eos = eos if isinstance(eos, int) else 1
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens, ids.shape[1]


def _tiles(vlm_dir, raw: bytes) -> int:
    """How many tiles (the thumbnail included) mlx-vlm's processor makes of the image."""
    return processed_chat(vlm_dir, "", [raw])[1]["pixel_values"].shape[1]


def test_the_workers_processor_is_mlx_vlms_bit_for_bit(vlm_dir):
    """servicer.numpy_processors' tiles and expansion equal mlx-vlm's processor's (which
    normalises with MLX) on images of many sizes and aspect ratios, squares (ties) included."""
    import numpy as np
    from PIL import Image

    from servicer.numpy_processors import DynamicTilesProcessor

    _, processor = loaded(str(vlm_dir))
    mine = DynamicTilesProcessor.from_pretrained(vlm_dir)
    rng = np.random.default_rng(0)
    text = "<|user|><image>Hi<|end|>"
    for i in range(24):
        w, h = (int(v) for v in rng.integers(8, 400, 2))
        w = h if i % 4 == 0 else w
        image = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        want = processor(text=text, images=[image], return_tensors="np")
        got = mine(text=text, images=[image], return_tensors="np")
        pixels = np.asarray(want["pixel_values"])
        assert pixels.dtype == got["pixel_values"].dtype == np.float32
        assert np.array_equal(pixels.view(np.uint32), got["pixel_values"].view(np.uint32))
        assert np.asarray(want["input_ids"]).tolist() == got["input_ids"].tolist()


def test_two_images_tiled_differently_answer_as_mlx_vlm_does(stub, vlm_dir):
    question = "What do bees make?"
    raws = [png(80, (64, 48)), png(81, (30, 90))]
    assert [_tiles(vlm_dir, raw) for raw in raws] == [1, 4]  # 1x1; 1x3 and the thumbnail
    answers = []
    for raw, tiles in zip(raws, (1, 4), strict=True):
        done = complete(stub, image_request(router_ids(vlm_dir, question), [data_url(raw)]))
        want, length = reference(vlm_dir, question, [raw])
        # The anchor gives way to <img>, the tiles' image tokens and </img>.
        assert (
            done.prompt_tokens
            == length
            == len(router_ids(vlm_dir, question)) + 1 + (tiles * TOKENS_PER_TILE)
        )
        assert list(done.output_ids) == want
        answers.append(want)
    assert answers[0] != answers[1]  # the image counts


def test_image_and_text_rows_batched_and_a_prefix_hit(stub, vlm_dir):
    question = "Describe a quiet place."
    raws = [png(90, (64, 64)), png(91, (96, 40))]
    jobs = [image_request(router_ids(vlm_dir, question), [data_url(r)]) for r in raws]
    jobs.append(image_request(router_ids(vlm_dir, "Hello there.", images=0), []))
    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(lambda job: complete(stub, job), jobs))
    for raw, answer in zip(raws, answers, strict=False):
        assert list(answer.output_ids) == reference(vlm_dir, question, [raw])[0]
    assert list(answers[2].output_ids) == reference(vlm_dir, "Hello there.", [])[0]
    again = complete(stub, jobs[0])
    assert again.cached_tokens > 8 and list(again.output_ids) == list(answers[0].output_ids)


@pytest.mark.skipif(SMG is None, reason="the smg router is a dev dependency")
def test_through_the_router_as_media_references_answers_as_mlx_vlm_does(vlm_dir, tmp_path):
    """Under demo:vlm:internvl_chat's served name the router has no spec for the family: it
    sends the image as a media reference, one anchor in the prompt, and the answer is
    mlx-vlm's."""
    from transformers import AutoTokenizer

    raw, question = png(46, (30, 90)), "What do bees make?"
    config = demo_config(vlm_dir)
    model = ModelSpec(str(vlm_dir), SERVED_NAME)
    config = dataclasses.replace(config, protocols=("vllm",), model=model)
    sent = []
    with ServerThread(config) as running:
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
    tokens, length = reference(vlm_dir, question, [raw])
    tokenizer = AutoTokenizer.from_pretrained(str(vlm_dir))
    reply = response.json()
    assert reply["choices"][0]["message"]["content"] == tokenizer.decode(
        tokens, skip_special_tokens=True
    )
    assert reply["usage"] == reply["usage"] | {
        "prompt_tokens": length,
        "completion_tokens": len(tokens),
    }
