"""GLM-4V's images (GLM-4.1V / 4.5V style: `<|begin_of_image|><|image|><|end_of_image|>` per
image, `<|image|>` repeated once per merged 28x28 patch, 3-D rotary positions for the image
tokens as Qwen2-VL's, here in even/odd pairs over half the head): through the real server each
answer equals mlx-vlm's own greedy generation, its processor expanding the prompt and making
the pixels, for images of different sizes, two in one prompt, batched with a text request and
from a cached prefix past the image; and through the real smg router, which sends the image as
a media reference (smg 1.13's GLM preprocessor is GLM-5.3-Flash's: it has no spec for GLM-4V,
its `--mm-processing router` answers 400 "no media spec for its family"), the chat answer
equals mlx-vlm's text. tests/test_images_glm4v_moe.py runs the same checks on the MoE family."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
from conftest import demo_config
from support import SMG, Router, ServerThread
from test_images import complete, data_url, image_request, needs_vlm, png
from vlm_support import processed_chat, routed_image_chat, router_ids, served

from servicer.proto import vllm_engine_pb2_grpc as vgrpc
from servicer.server import ModelSpec

pytestmark = needs_vlm
FAMILY = "glm4v"
QUESTION = "What do bees make?"
EOS = 1  # the text demo's <|end|>


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
    """mlx-vlm's greedy tokens up to its EOS (kept, as the worker does), its processor
    expanding the prompt and making the pixels and patch grids; and the expanded prompt."""
    import mlx.core as mx
    import numpy as np
    from mlx_vlm.generate import generate_step

    model, out = processed_chat(vlm_dir, question, raws)
    ids = mx.array(np.asarray(out["input_ids"]))
    pixels, extra = None, {}
    if raws:
        pixels = mx.array(np.asarray(out["pixel_values"]))
        extra = {"image_grid_thw": mx.array(np.asarray(out["image_grid_thw"]))}
    steps = generate_step(ids, model, pixels, mx.ones_like(ids), max_tokens=n, **extra)
    tokens = []
    for token, _ in steps:
        tokens.append(int(token))
        if tokens[-1] == EOS:
            break
    return tokens, ids[0].tolist()


def check_images_alone(stub, vlm_dir) -> None:
    answers = []
    for raw in (png(1, (64, 48)), png(2, (112, 84)), png(3, (30, 90))):
        done = complete(stub, image_request(router_ids(vlm_dir, QUESTION), [data_url(raw)]))
        want, prompt = reference(vlm_dir, QUESTION, [raw])
        assert done.prompt_tokens == len(prompt)
        assert list(done.output_ids) == want
        answers.append(want)
    assert len({tuple(a) for a in answers}) > 1  # the image counts
    both = [png(4, (84, 56)), png(3, (30, 90))]  # two images: the second's ids follow the first's
    prompt = router_ids(vlm_dir, QUESTION, images=2)
    done = complete(stub, image_request(prompt, [data_url(raw) for raw in both]))
    want, expanded = reference(vlm_dir, QUESTION, both)
    assert done.prompt_tokens == len(expanded)
    assert list(done.output_ids) == want


def check_batched_with_text_and_a_prefix_hit(stub, vlm_dir) -> None:
    question = "Describe a quiet place."
    raws = [png(5, (112, 84)), png(6, (30, 90)), png(7, (64, 48))]
    jobs = [image_request(router_ids(vlm_dir, question), [data_url(r)]) for r in raws]
    jobs.append(image_request(router_ids(vlm_dir, "Hello there.", images=0), []))
    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(lambda job: complete(stub, job), jobs))
    for raw, answer in zip(raws, answers, strict=False):
        assert list(answer.output_ids) == reference(vlm_dir, question, [raw])[0]
    assert list(answers[3].output_ids) == reference(vlm_dir, "Hello there.", [])[0]
    _, prompt = reference(vlm_dir, question, [raws[0]], 1)
    again = complete(stub, jobs[0])
    image_end = len(prompt) - prompt[::-1].index(image_token(vlm_dir))
    assert again.cached_tokens >= image_end
    assert list(again.output_ids) == list(answers[0].output_ids)


def image_token(vlm_dir) -> int:
    import json

    return json.loads((vlm_dir / "config.json").read_text())["image_token_id"]


def check_through_the_router(vlm_dir, tmp_path, family: str) -> None:
    """Under demo:vlm:FAMILY's served name the router sends the image as a media reference,
    one anchor in the prompt, and the answer is mlx-vlm's, decoded as the router does."""
    from transformers import AutoTokenizer

    raw = png(46, (64, 48))
    model = ModelSpec(str(vlm_dir), f"mlx-grpc-worker-demo-vlm-{family}")
    config = dataclasses.replace(demo_config(vlm_dir), protocols=("vllm",), model=model)
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
            response = routed_image_chat(router, QUESTION, data_url(raw))
        finally:
            router.close()
    assert response.status_code == 200, response.text
    assert sent == [(1, 0)]  # one media reference, no mm_inputs
    tokens, _ = reference(vlm_dir, QUESTION, [raw])
    text = AutoTokenizer.from_pretrained(str(vlm_dir)).decode(tokens, skip_special_tokens=True)
    reply = response.json()
    assert reply["choices"][0]["message"]["content"] == text
    assert reply["usage"]["completion_tokens"] == len(tokens)


@pytest.mark.parametrize("family", ["glm4v", "glm4v_moe"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_partial_rotation_equals_mlx_vlm(family: str, dtype: str) -> None:
    """GLM-4V's multimodal RoPE over half the head (mlx-lm's glm4 rope: even/odd pairs;
    glm4_moe's: half-split) as the engine's MRoPE applies it equals mlx-vlm's, bit for bit,
    for a row of 3-D ids and a row of cache offset + delta; the other half passes through."""
    import importlib

    import mlx.core as mx
    import mlx.nn as nn
    import numpy as np

    from servicer.engine.mrope import MRoPE, RopePositions

    language = importlib.import_module(f"mlx_vlm.models.{family}.language")
    head, section = 32, [2, 3, 3]
    config = SimpleNamespace(rope_theta=10000.0, partial_rotary_factor=0.5, head_dim=head)
    config.__dict__.update(max_position_embeddings=4096, rope_scaling=None)
    vlm_rope = language.GLM4VRotaryEmbedding(config)
    plain = nn.RoPE(head // 2, traditional=family == "glm4v", base=10000.0)
    positions = RopePositions(head // 2, 10000.0, section)
    rope = MRoPE(plain, positions)
    kind = getattr(mx, dtype)
    q = mx.random.normal((2, 4, 7, head), key=mx.random.key(1)).astype(kind)
    k = mx.random.normal((2, 2, 7, head), key=mx.random.key(2)).astype(kind)
    ids = np.random.default_rng(0).integers(0, 300, (3, 7))
    with positions.forward([ids, -40]):
        got_q, got_k = rope(q, offset=mx.array([0, 57])), rope(k, offset=mx.array([0, 57]))
    counted = np.broadcast_to(np.arange(7) + 57 - 40, (3, 7))
    for row, row_ids in enumerate((ids, counted)):
        cos, sin = vlm_rope(q, mx.array(row_ids)[:, None])
        want_q, want_k = language.apply_multimodal_rotary_pos_emb(
            q[row : row + 1], k[row : row + 1], cos, sin, section
        )
        assert mx.array_equal(got_q[row : row + 1], want_q)
        assert mx.array_equal(got_k[row : row + 1], want_k)


def test_images_alone_and_two_in_a_prompt_answer_as_mlx_vlm_does(stub, vlm_dir):
    check_images_alone(stub, vlm_dir)


def test_images_batched_with_text_and_from_a_cached_prefix(stub, vlm_dir):
    check_batched_with_text_and_a_prefix_hit(stub, vlm_dir)


@pytest.mark.skipif(SMG is None, reason="the smg router is a dev dependency")
def test_through_the_router_as_media_references_answers_as_mlx_vlm_does(vlm_dir, tmp_path):
    check_through_the_router(vlm_dir, tmp_path, FAMILY)
