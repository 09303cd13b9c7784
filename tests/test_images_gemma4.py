"""Gemma 4's images (the tiny gemma4 demo: its processor expands `<|image|>` into as many soft
tokens as the image's aspect-ratio-preserving resize makes; its text model takes per-layer
inputs, of token 0 at an image's positions, and embeddings mlx-vlm has already scaled): through
the real server each answer equals mlx-vlm's own greedy generation, with the prompt expanded
and the pixels made by mlx-vlm's processor, alone, batched with text and from a cached prefix;
and through the real smg router."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import demo_config
from support import SMG, Router, ServerThread
from test_images import complete, data_url, image_request, needs_vlm, png
from vlm_support import processed_chat, routed_image_chat, router_ids, served

from servicer.model_files import ModelSpec
from servicer.proto import vllm_engine_pb2_grpc as vgrpc

pytestmark = needs_vlm

FAMILY = "gemma4"


@pytest.fixture(scope="module")
def vlm_dir() -> Path:
    from servicer.demos.vision import demo_vlm_path

    return demo_vlm_path(family=FAMILY)


@pytest.fixture(scope="module")
def stub(vlm_dir) -> Iterator[vgrpc.VllmEngineStub]:
    with served(vlm_dir) as running:
        yield running


def reference(vlm_dir, question: str, raws: list[bytes], n: int = 12) -> tuple[list[int], int]:
    """mlx-vlm's greedy tokens up to its end of sequence (kept: where the worker stops), its
    own processor expanding the prompt and making the pixels; and the expanded prompt's
    length."""
    import mlx.core as mx
    import numpy as np
    from mlx_vlm.generate import generate_step

    model, out = processed_chat(vlm_dir, question, raws)
    ids = mx.array(np.asarray(out["input_ids"]))
    skip = ("input_ids", "attention_mask", "pixel_values")
    extra = {k: mx.array(np.asarray(v)) for k, v in out.items() if k not in skip}
    pixels = mx.array(np.asarray(out["pixel_values"])) if raws else None
    steps = generate_step(ids, model, pixels, mx.ones_like(ids), max_tokens=n, **extra)
    tokens = [int(token) for token, _ in steps]
    eos = model.config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    end = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
    return tokens[:end], ids.shape[1]


def test_a_checkpoint_whose_images_attend_both_ways_is_served_as_text(vlm_dir):
    """Google's Gemma 4 checkpoints set text_config.use_bidirectional_attention "vision"
    (mlx-vlm then lets an image's tokens attend to each other both ways): the worker's prefill
    is causal, so such a checkpoint is served as text, the reason logged; the demo is causal."""
    import json

    from servicer.vision_families import vision_refusal

    config = json.loads((vlm_dir / "config.json").read_text())
    assert vision_refusal(config) is None
    config["text_config"]["use_bidirectional_attention"] = "vision"
    assert "attend both ways" in (vision_refusal(config) or "")


@pytest.mark.parametrize("size", [(64, 48), (30, 90)])
def test_an_image_answer_equals_mlx_vlms(stub, vlm_dir, size):
    """Two images of other sizes (other soft-token counts), each its own answer."""
    raw = png(60 + size[0], size)
    question = "Describe a quiet place."
    done = complete(stub, image_request(router_ids(vlm_dir, question), [data_url(raw)]))
    want, length = reference(vlm_dir, question, [raw])
    assert done.prompt_tokens == length
    assert list(done.output_ids) == want


def test_image_and_text_rows_batched_and_a_prefix_hit(stub, vlm_dir):
    """Two image rows and a text row at once, each its own single-sequence answer; the first
    again reuses its prompt past the image."""
    question = "What do bees make?"
    raws = [png(90, (64, 48)), png(91, (56, 56))]
    jobs = [image_request(router_ids(vlm_dir, question), [data_url(r)]) for r in raws]
    jobs.append(image_request(router_ids(vlm_dir, "Hello there.", 0), []))
    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(lambda job: complete(stub, job), jobs))
    wants = [reference(vlm_dir, question, [raw])[0] for raw in raws]
    wants.append(reference(vlm_dir, "Hello there.", [])[0])
    assert [list(a.output_ids) for a in answers] == wants
    assert wants[0] != wants[1]  # the image decides the answer
    again = complete(stub, jobs[0])
    assert again.cached_tokens > 48  # past the image's run
    assert list(again.output_ids) == wants[0]


@pytest.mark.skipif(SMG is None, reason="the smg router is a dev dependency")
def test_through_the_router_answers_as_mlx_vlm_does(vlm_dir, tmp_path):
    """On the vLLM face behind the real router: what the router sends (media references or
    its own mm_inputs) is recorded, and the answer is mlx-vlm's."""
    from transformers import AutoTokenizer

    raw, question = png(46, (64, 48)), "What do bees make?"
    config = dataclasses.replace(
        demo_config(vlm_dir), protocols=("vllm",), model=ModelSpec(str(vlm_dir), "demo-model")
    )
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
    text = AutoTokenizer.from_pretrained(str(vlm_dir)).decode(tokens, skip_special_tokens=True)
    assert response.json()["choices"][0]["message"]["content"] == text
