"""LFM2-VL's images (a SigLIP2 NaFlex tower on packed patches; an image past a tile's size cut
into 2 to 10 marked tiles plus a thumbnail, a smaller one resized to whole patches): through
the real server each answer equals mlx-vlm's own greedy generation, with the prompt expanded
and the pixels made by mlx-vlm's processor (which the worker runs itself, without MLX:
servicer.vlm_modules), for images tiled differently, batched with text and from a cached
prefix; and through the real smg router, which has no spec for the family and sends its
images as media references."""

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

pytestmark = needs_vlm
SERVED_NAME = "mlx-grpc-worker-demo-vlm-lfm2_vl"  # --model demo:vlm:lfm2_vl's


@pytest.fixture(scope="module")
def vlm_dir():
    from servicer.demos.vision import demo_vlm_path

    return demo_vlm_path(family="lfm2_vl")


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
    else:  # a text prompt: the router's ids as they are
        model, out = loaded(str(vlm_dir))[0], {"input_ids": [router_ids(vlm_dir, question, 0)]}
    ids = mx.array(np.asarray(out["input_ids"]))
    names = ("spatial_shapes", "pixel_attention_mask")
    kwargs = {name: mx.array(np.asarray(out[name])) for name in names} if raws else {}
    pixels = mx.array(np.asarray(out["pixel_values"])) if raws else None
    steps = generate_step(ids, model, pixels, mx.ones_like(ids), max_tokens=n, **kwargs)
    tokens = [int(token) for token, _ in steps]
    eos = model.config.eos_token_id
    eos = eos if isinstance(eos, int) else 1
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens, ids.shape[1]


def _views(vlm_dir, raw: bytes) -> int:
    """How many tower inputs (tiles and thumbnail, or the image alone) mlx-vlm's processor
    makes of the image."""
    return processed_chat(vlm_dir, "", [raw])[1]["pixel_values"].shape[0]


def test_two_images_tiled_differently_answer_as_mlx_vlm_does(stub, vlm_dir):
    question = "What do bees make?"
    raws = [png(80, (64, 48)), png(81, (20, 20))]
    assert [_views(vlm_dir, raw) for raw in raws] == [7, 1]  # 3x2 tiles and the thumbnail; whole
    answers = []
    for raw in raws:
        done = complete(stub, image_request(router_ids(vlm_dir, question), [data_url(raw)]))
        want, length = reference(vlm_dir, question, [raw])
        assert done.prompt_tokens == length > len(router_ids(vlm_dir, question)) + 2
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
    """Under demo:vlm:lfm2_vl's served name the router has no spec for the family: it
    sends the image as a media reference, one anchor in the prompt, and the answer is
    mlx-vlm's."""
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


def test_the_handler_runs_mlx_vlms_processor_without_mlx(vlm_dir):
    """The worker's processor is mlx-vlm's module, loaded without the mlx_vlm package: a
    process that builds it and expands an image imports no MLX."""
    import subprocess
    import sys

    probe = (
        "import sys, json, pathlib\n"
        "from PIL import Image\n"
        "from transformers import AutoTokenizer\n"
        "from servicer.images import _processor\n"
        "from servicer.vision_families import vision_spec\n"
        f"path = pathlib.Path({str(vlm_dir)!r})\n"
        "spec = vision_spec(json.loads((path / 'config.json').read_text()),"
        " AutoTokenizer.from_pretrained(str(path)))\n"
        "out = _processor(path, spec)(text='<image>', images=[Image.new('RGB', (64, 48))],"
        " return_tensors='np', add_special_tokens=False)\n"
        "print(out['pixel_values'].shape[0], sorted(m for m in sys.modules"
        " if m == 'mlx' or m.startswith(('mlx.', 'mlx_vlm', 'mlx_lm'))))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.split("\n")[-2] == "7 []"


def test_the_dashed_model_type_answers_as_mlx_vlm_does():
    """Older LFM2-VL checkpoints say "lfm2-vl": mlx-lm loads their text model itself (the
    "lfm2_vl" ones: its lfm2 from text_config), and the answers are mlx-vlm's all the same."""
    from servicer.demos.vision import demo_vlm_path

    vlm_dir = demo_vlm_path(family="lfm2-vl")
    question, raw = "What do bees make?", png(80, (64, 48))
    with served(vlm_dir) as stub:
        done = complete(stub, image_request(router_ids(vlm_dir, question), [data_url(raw)]))
    want, length = reference(vlm_dir, question, [raw])
    assert done.prompt_tokens == length and list(done.output_ids) == want
