"""Kimi-VL's images (MoonViT on native-resolution patches, 2x2 merged; `<|media_pad|>` once per
merged block; a DeepSeek-V3 text model, which the worker builds from text_config): through the
real server each answer equals mlx-vlm's own greedy generation, with the prompt expanded and
the pixels made by mlx-vlm's processor (the worker's is servicer.numpy_processors, the same
arithmetic without MLX, bit for bit on many images), for images of different sizes, batched
with text and from a cached prefix; and through the real smg router. smg 1.13 knows Kimi-VL
and processes its images itself only where no worker advertises a processor: to this worker
it sends them as media references, one unexpanded anchor each."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import demo_config
from support import SMG, Router, ServerThread
from test_images import complete, data_url, image_request, needs_vlm, png
from vlm_support import loaded, processed_chat, routed_image_chat, router_ids, served

from servicer.proto import vllm_engine_pb2_grpc as vgrpc
from servicer.server import ModelSpec

# mlx-vlm's Kimi-VL processor reads pixels with Pillow's deprecated getdata.
pytestmark = [needs_vlm, pytest.mark.filterwarnings("ignore:Image.Image.getdata")]
SERVED_NAME = "mlx-grpc-worker-demo-vlm-kimi_vl"  # --model demo:vlm:kimi_vl's


@pytest.fixture(scope="module")
def vlm_dir():
    from servicer.demos.vision import demo_vlm_path

    return demo_vlm_path(family="kimi_vl")


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
    kwargs = {"image_grid_hws": mx.array(np.asarray(out["image_grid_hws"]))} if raws else {}
    pixels = mx.array(np.asarray(out["pixel_values"])) if raws else None
    steps = generate_step(ids, model, pixels, mx.ones_like(ids), max_tokens=n, **kwargs)
    tokens = [int(token) for token, _ in steps]
    eos = model.config.eos_token_id
    eos = eos if isinstance(eos, int) else 1
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens, ids.shape[1]


def test_the_workers_processor_is_mlx_vlms_bit_for_bit(vlm_dir):
    """servicer.numpy_processors' patches, grid and expansion equal mlx-vlm's processor's
    (which computes with MLX) on images of many sizes, some past the patch limit."""
    import numpy as np
    from PIL import Image

    from servicer.numpy_processors import NativePatchesProcessor

    _, processor = loaded(str(vlm_dir))
    mine = NativePatchesProcessor.from_pretrained(vlm_dir)
    rng = np.random.default_rng(0)
    text = "<|media_start|>image<|media_content|><|media_pad|><|media_end|>Hi"
    for i in range(16):
        w, h = (int(v) for v in rng.integers(28, 300, 2)) if i else (1500, 1200)
        image = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        want, got = processor(text=text, images=[image]), mine(text=text, images=[image])
        pixels = np.asarray(want["pixel_values"])
        assert pixels.dtype == got["pixel_values"].dtype == np.float32
        assert np.array_equal(pixels.view(np.uint32), got["pixel_values"].view(np.uint32))
        assert np.asarray(want["image_grid_hws"]).tolist() == got["image_grid_hws"].tolist()
        assert np.asarray(want["input_ids"]).tolist() == got["input_ids"].tolist()


def test_two_images_of_different_sizes_answer_as_mlx_vlm_does(stub, vlm_dir):
    question = "What do bees make?"
    answers = []
    for raw, tokens in ((png(80, (120, 90)), 12), (png(81, (60, 150)), 10)):
        done = complete(stub, image_request(router_ids(vlm_dir, question), [data_url(raw)]))
        want, length = reference(vlm_dir, question, [raw])
        # The anchor's one <|media_pad|> becomes one a 2x2 block of 14-pixel patches.
        assert done.prompt_tokens == length == len(router_ids(vlm_dir, question)) - 1 + tokens
        assert list(done.output_ids) == want
        answers.append(want)
    assert answers[0] != answers[1]  # the image counts


def test_image_and_text_rows_batched_and_a_prefix_hit(stub, vlm_dir):
    question = "Describe a quiet place."
    raws = [png(90, (84, 84)), png(91, (150, 60))]
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
    """smg knows Kimi-VL, yet with a worker that advertises its own processor it sends the
    image as a media reference, one anchor in the prompt; the answer is mlx-vlm's."""
    from transformers import AutoTokenizer

    raw, question = png(46, (120, 90)), "What do bees make?"
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
