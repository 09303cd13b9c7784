"""Pixtral's images (Pixtral-12B's layout: a patch an image token, no merger, rows of `[IMG]`
each ending `[IMG_BREAK]`, the last `[IMG_END]`): through the real server each answer equals
mlx-vlm's own greedy generation, with the prompt expanded and the pixels made by mlx-vlm's
processor, for images of different sizes, batched with text and from a cached prefix; and
through the real smg router, which has no spec for Pixtral and sends its images as media
references."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import demo_config
from support import SMG, Router, ServerThread
from test_images import complete, data_url, image_request, needs_vlm, png
from vlm_support import processed_chat, routed_image_chat, router_ids, served

from servicer.proto import vllm_engine_pb2_grpc as vgrpc
from servicer.server import ModelSpec

pytestmark = needs_vlm
SERVED_NAME = "mlx-grpc-worker-demo-vlm-pixtral"  # --model demo:vlm:pixtral's


@pytest.fixture(scope="module")
def vlm_dir():
    from servicer.demos.vision import demo_vlm_path

    return demo_vlm_path(family="pixtral")


@pytest.fixture(scope="module")
def stub(vlm_dir) -> Iterator[vgrpc.VllmEngineStub]:
    with served(vlm_dir) as running:
        yield running


def reference(vlm_dir, question: str, raws: list[bytes], n: int = 12) -> tuple[list[int], int]:
    """mlx-vlm's greedy tokens, its processor expanding the prompt and making the pixels; and
    the expanded prompt's length."""
    import mlx.core as mx
    from mlx_vlm.generate import generate_step

    model, out = processed_chat(vlm_dir, question, raws)
    ids = mx.array(out["input_ids"])
    kwargs = {"image_sizes": out["image_sizes"].tolist()} if raws else {}
    pixels = mx.array(out["pixel_values"]) if raws else None
    steps = generate_step(ids, model, pixels, mx.ones_like(ids), max_tokens=n, **kwargs)
    return [int(token) for token, _ in steps], ids.shape[1]


def test_two_images_of_different_sizes_answer_as_mlx_vlm_does(stub, vlm_dir):
    question = "What do bees make?"
    answers = []
    for seed, size in ((80, (64, 48)), (81, (30, 90))):
        raw = png(seed, size)
        done = complete(stub, image_request(router_ids(vlm_dir, question), [data_url(raw)]))
        want, length = reference(vlm_dir, question, [raw])
        assert done.prompt_tokens == length
        assert list(done.output_ids) == want
        answers.append(want)
    assert answers[0] != answers[1]  # the image counts


def test_image_and_text_rows_batched_and_a_prefix_hit(stub, vlm_dir):
    question = "Describe a quiet place."
    raws = [png(90, (64, 48)), png(91, (96, 64))]
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
    """Under demo:vlm:pixtral's served name the router has no spec for the family: it sends
    the image as a media reference, one anchor in the prompt, and the answer is mlx-vlm's."""
    from transformers import AutoTokenizer

    raw, question = png(46, (64, 48)), "What do bees make?"
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
    tokens, _ = reference(vlm_dir, question, [raw])
    tokenizer = AutoTokenizer.from_pretrained(str(vlm_dir))
    eos = tokenizer.eos_token_id
    tokens = tokens[: tokens.index(eos) + 1] if eos in tokens else tokens  # the worker stops
    reply = response.json()
    assert reply["choices"][0]["message"]["content"] == tokenizer.decode(
        tokens, skip_special_tokens=True
    )
    assert reply["usage"]["completion_tokens"] == len(tokens)
