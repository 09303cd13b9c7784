"""Mistral 3's images (Pixtral's rows of image tokens, each ending in a break): through the real
server each answer equals mlx-vlm's own greedy generation, with the prompt expanded and the
pixels made by mlx-vlm's processor, alone, batched with text and from a cached prefix."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from test_images import complete, data_url, image_request, needs_vlm, png
from vlm_support import processed_chat, router_ids, served

from servicer.proto import vllm_engine_pb2_grpc as vgrpc

pytestmark = needs_vlm


@pytest.fixture(scope="module")
def vlm_dir():
    from servicer.demos.vision import demo_vlm_path

    return demo_vlm_path(family="mistral3")


@pytest.fixture(scope="module")
def stub(vlm_dir) -> Iterator[vgrpc.VllmEngineStub]:
    with served(vlm_dir) as running:
        yield running


def reference(vlm_dir, question: str, raws: list[bytes], n: int) -> tuple[list[int], int]:
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


@pytest.mark.parametrize("size", [(64, 48), (112, 112), (30, 90)])
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
    again = complete(stub, jobs[0])
    assert again.cached_tokens > 8 and list(again.output_ids) == list(answers[0].output_ids)
