"""Idefics3's images (tiles of the image, a row marker each, then the whole image shrunk to one
tile, all expanded by the model's own processor): through the real server each answer equals
mlx-vlm's own greedy generation, its processor expanding the prompt and making the pixels, for
images cut into 2x2 and 2x1 tiles, one or two a prompt, alone, batched with a text request and
from a cached prefix past the image; and through the real smg router (media references: smg
1.13 does not know the family) the chat answer equals mlx-vlm's text.
tests/test_images_smolvlm.py runs the same checks on SmolVLM (Idefics3's architecture and
expansion under another model type)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from support import SMG
from test_images import complete, data_url, image_request, needs_vlm, png
from vlm_support import processed_chat, router_ids, served

from servicer.proto import vllm_engine_pb2_grpc as vgrpc

pytestmark = needs_vlm
FAMILY = "idefics3"
QUESTION = "What do bees make?"
EOS = 1  # the text demo's <|end|>
# Two images of 2x2 tiles, and one of 2x1 (a tall one), each plus the whole image.
TILED = (png(1, (64, 48)), png(2, (112, 84)))
TALL = png(3, (30, 90))


def vlm_dir_of(family: str):
    from servicer.demos.vision import demo_vlm_path

    return demo_vlm_path(family=family)


@pytest.fixture(scope="module")
def vlm_dir():
    return vlm_dir_of(FAMILY)


@pytest.fixture(scope="module")
def stub(vlm_dir) -> Iterator[vgrpc.VllmEngineStub]:
    with served(vlm_dir) as running:
        yield running


def reference(vlm_dir, question: str, raws: list[bytes], n: int = 12) -> tuple[list[int], list]:
    """mlx-vlm's greedy tokens up to its EOS, its processor expanding the prompt and making
    the pixels (and the pixel mask); and the expanded prompt."""
    import mlx.core as mx
    import numpy as np
    from mlx_vlm.generate import generate_step

    model, out = processed_chat(vlm_dir, question, raws)
    ids = mx.array(np.asarray(out["input_ids"]))
    pixels, extra = None, {}
    if raws:
        pixels = mx.array(np.asarray(out["pixel_values"]))
        extra = {"pixel_attention_mask": mx.array(np.asarray(out["pixel_attention_mask"]))}
    steps = generate_step(ids, model, pixels, mx.ones_like(ids), max_tokens=n, **extra)
    tokens = []
    for token, _ in steps:
        tokens.append(int(token))
        if tokens[-1] == EOS:  # where the worker stops (it keeps the EOS)
            break
    return tokens, ids[0].tolist()


def tiles(vlm_dir, prompt: list[int]) -> int:
    """The image's tiles in an expanded prompt: its row markers."""
    from transformers import AutoTokenizer

    pieces = AutoTokenizer.from_pretrained(str(vlm_dir)).convert_ids_to_tokens(prompt)
    return sum(p.startswith("<row_") for p in pieces)


def check_tiled_images_alone(stub, vlm_dir) -> None:
    answers = []
    for raw, count in ((TILED[0], 4), (TILED[1], 4), (TALL, 2)):
        done = complete(stub, image_request(router_ids(vlm_dir, QUESTION), [data_url(raw)]))
        want, prompt = reference(vlm_dir, QUESTION, [raw])
        assert tiles(vlm_dir, prompt) == count
        assert done.prompt_tokens == len(prompt)
        assert list(done.output_ids) == want
        answers.append(want)
    assert answers[0] != answers[1]  # the image matters
    both = [TILED[0], TALL]  # two images in one prompt: 4 + 2 tiles
    prompt = router_ids(vlm_dir, QUESTION, images=2)
    done = complete(stub, image_request(prompt, [data_url(raw) for raw in both]))
    want, expanded = reference(vlm_dir, QUESTION, both)
    assert tiles(vlm_dir, expanded) == 6 and done.prompt_tokens == len(expanded)
    assert list(done.output_ids) == want


def check_batched_with_text_and_a_prefix_hit(stub, vlm_dir) -> None:
    question = "Describe a quiet place."
    raws = [TILED[1], TALL, TILED[0]]
    jobs = [image_request(router_ids(vlm_dir, question), [data_url(r)]) for r in raws]
    jobs.append(image_request(router_ids(vlm_dir, "Hello there.", images=0), []))
    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(lambda job: complete(stub, job), jobs))
    for raw, answer in zip(raws, answers, strict=False):
        assert list(answer.output_ids) == reference(vlm_dir, question, [raw])[0]
    assert list(answers[3].output_ids) == reference(vlm_dir, "Hello there.", [])[0]
    _, prompt = reference(vlm_dir, question, [raws[0]], 1)
    again = complete(stub, jobs[0])
    image_end = len(prompt) - prompt[::-1].index(vlm_image_token(vlm_dir))
    assert again.cached_tokens >= image_end
    assert list(again.output_ids) == list(answers[0].output_ids)


def vlm_image_token(vlm_dir) -> int:
    import json

    return json.loads((vlm_dir / "config.json").read_text())["image_token_id"]


def check_through_the_router(vlm_dir, tmp_path) -> None:
    from test_images_router import QUESTION as ROUTER_QUESTION
    from test_images_router import _routed_answer
    from transformers import AutoTokenizer

    raw = TILED[0]
    reply = _routed_answer(vlm_dir, ("vllm",), tmp_path, data_url(raw))
    tokens, _ = reference(vlm_dir, ROUTER_QUESTION, [raw])
    text = AutoTokenizer.from_pretrained(str(vlm_dir)).decode(tokens, skip_special_tokens=True)
    assert reply["choices"][0]["message"]["content"] == text


def test_tiled_images_alone_answer_as_mlx_vlm_does(stub, vlm_dir):
    check_tiled_images_alone(stub, vlm_dir)


def test_tiled_images_batched_with_text_and_from_a_cached_prefix(stub, vlm_dir):
    check_batched_with_text_and_a_prefix_hit(stub, vlm_dir)


@pytest.mark.skipif(SMG is None, reason="the smg router is a dev dependency")
def test_through_the_router_answers_as_mlx_vlm_does(vlm_dir, tmp_path):
    check_through_the_router(vlm_dir, tmp_path)
