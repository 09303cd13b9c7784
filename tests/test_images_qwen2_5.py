"""Qwen2.5-VL's images (the tiny qwen2_5_vl demo: Qwen2-VL's prompt, processor and multimodal
RoPE, a vision tower with windowed attention): through the real server each answer equals
mlx-vlm's own greedy generation, the prompt expanded and the pixels made by mlx-vlm's processor,
alone, sent as the router's mm_inputs, batched with text and from a cached prefix; and through
the real smg router, which leaves this family's images to the worker under a served name
without "qwen" and "vl" (media references)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import demo_config
from support import SMG, ServerThread
from test_images import complete, data_url, image_request, needs_vlm, png
from test_images_qwen2 import router_request
from vlm_support import (
    chat_through_a_router,
    processed_chat,
    router_ids,
    served,
    what_the_worker_gets,
)

from servicer.model_files import ModelSpec
from servicer.proto import vllm_engine_pb2_grpc as vgrpc

pytestmark = needs_vlm

FAMILY = "qwen2_5_vl"


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
    own processor expanding the prompt and making the pixels and grids; and the expanded
    prompt's length."""
    import mlx.core as mx
    from mlx_vlm.generate import generate_step

    model, out = processed_chat(vlm_dir, question, raws)
    ids = mx.array(out["input_ids"])
    extra = {"image_grid_thw": mx.array(out["image_grid_thw"])} if raws else {}
    pixels = mx.array(out["pixel_values"]) if raws else None
    steps = generate_step(ids, model, pixels, mx.ones_like(ids), max_tokens=n, **extra)
    tokens = [int(token) for token, _ in steps]
    eos = model.config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    end = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
    return tokens[:end], ids.shape[1]


def test_the_demo_is_qwen2_5_vl_with_qwen2_vls_prompt(vlm_dir, tmp_path):
    """Deterministic; Qwen2.5-VL's tower (windowed and full blocks); the worker's spec is
    Qwen2-VL's under this family's name; mlx-vlm's answers vary with the image."""
    from transformers import AutoTokenizer

    from servicer.demos.vision import build_vlm
    from servicer.vision_families import vision_spec

    rebuilt = build_vlm(tmp_path / "again", family=FAMILY)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        digests = {hashlib.sha256((d / name).read_bytes()).digest() for d in (vlm_dir, rebuilt)}
        assert len(digests) == 1, name
    config = json.loads((vlm_dir / "config.json").read_text())
    assert config["model_type"] == config["vision_config"]["model_type"] == FAMILY
    assert config["vision_config"]["fullatt_block_indexes"] == [1]
    spec = vision_spec(config, AutoTokenizer.from_pretrained(str(vlm_dir)))
    assert spec is not None and spec.family == FAMILY and spec.router_processed
    assert spec.anchor == (512, 515, 513) and spec.merge == 2
    question = "What do bees make?"
    answers = {tuple(reference(vlm_dir, question, [png(s, (112, 84))])[0]) for s in (1, 3, 5)}
    assert len(answers) >= 2 and all(len(set(a)) >= 3 for a in answers)


@pytest.mark.parametrize("size", [(112, 84), (56, 56), (30, 90), (250, 120)])
def test_an_image_answer_equals_mlx_vlms(stub, vlm_dir, size):
    """Sizes: 3x4 merged tokens over 2x3 windows, one window, resized up, resized down."""
    raw = png(60 + size[0], size)
    question = "Describe a quiet place."
    done = complete(stub, image_request(router_ids(vlm_dir, question), [data_url(raw)]))
    want, length = reference(vlm_dir, question, [raw])
    assert done.prompt_tokens == length
    assert list(done.output_ids) == want


def test_the_routers_mm_inputs_equal_mlx_vlm(stub, vlm_dir):
    """As smg's Qwen-VL spec sends a qwen-vl name's images: pixels and grids, the runs in the
    prompt filled with the vision token."""
    question = "What do bees make?"
    raws = [png(71, (84, 112)), png(72, (56, 84))]
    fill = json.loads((vlm_dir / "config.json").read_text())["vision_token_id"]
    job = router_request(vlm_dir, router_ids(vlm_dir, question, 2), raws, fill=fill)[0]
    want, length = reference(vlm_dir, question, raws)
    done = complete(stub, job)
    assert done.prompt_tokens == length
    assert list(done.output_ids) == want


def test_image_and_text_rows_batched_and_a_prefix_hit(stub, vlm_dir):
    """Two image rows (grids of different sizes) and a text row at once, each its own
    single-sequence answer; the first again reuses its prompt past the image."""
    question = "Tell me about the sea."
    raws = [png(90, (112, 84)), png(91, (56, 56))]
    jobs = [
        image_request(router_ids(vlm_dir, question), [data_url(r)], max_tokens=16) for r in raws
    ]
    jobs.append(image_request(router_ids(vlm_dir, "Hello there.", 0), [], max_tokens=16))
    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(lambda job: complete(stub, job), jobs))
    wants = [reference(vlm_dir, question, [raw], 16)[0] for raw in raws]
    wants.append(reference(vlm_dir, "Hello there.", [], 16)[0])
    assert [list(a.output_ids) for a in answers] == wants
    again = complete(stub, jobs[0])
    assert again.cached_tokens > 3 + (112 // 28) * (84 // 28)  # past the image's run
    assert list(again.output_ids) == wants[0]


@pytest.mark.skipif(SMG is None, reason="the smg router is a dev dependency")
def test_through_the_router_answers_as_mlx_vlm_does(vlm_dir, tmp_path):
    """Served as "demo-model" (no "qwen" and "vl": a family the router does not know) on the
    vLLM face: the router sends the image as a media reference, one anchor in the prompt, and
    the answer is mlx-vlm's."""
    from transformers import AutoTokenizer

    raw, question = png(46, (64, 48)), "What do bees make?"
    config = demo_config(vlm_dir)
    config = dataclasses.replace(
        config, protocols=("vllm",), model=ModelSpec(str(vlm_dir), "demo-model")
    )
    with ServerThread(config) as running, what_the_worker_gets(running) as sent:
        response = chat_through_a_router(running, tmp_path / "smg.log", question, data_url(raw))
    assert response.status_code == 200, response.text
    assert sent == [(1, 0)]  # one media reference, no mm_inputs
    tokens, _ = reference(vlm_dir, question, [raw])
    text = AutoTokenizer.from_pretrained(str(vlm_dir)).decode(tokens, skip_special_tokens=True)
    assert response.json()["choices"][0]["message"]["content"] == text
