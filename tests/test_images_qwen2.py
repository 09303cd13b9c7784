"""Qwen2-VL images (the tiny qwen2_vl demo): each anchor expanded by its image's patch grid, the
router's mm_inputs split, placed and checked, and through the real server the same tokens as
mlx-vlm's own generation, sent either way: multimodal RoPE in the batch beside text rows, and
from a cached prefix."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import importlib.util
import io
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from conftest import DRAFT_EVERY_STEP, demo_config
from support import ServerThread
from test_images import chat_ids, complete, data_url, image_request, png

from servicer.images import ImagePreparer
from servicer.media import MediaPolicy
from servicer.proto import vllm_engine_pb2 as vpb
from servicer.proto import vllm_engine_pb2_grpc as vgrpc
from servicer.validation import RequestError
from servicer.vision_families import vision_spec

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("mlx_vlm") is None,
    reason="mlx-vlm is not installed (the vision extra)",
)


@pytest.fixture(scope="module")
def vlm_dir():
    from servicer.demos.vision import demo_vlm_path

    return demo_vlm_path(family="qwen2_vl")


@functools.cache
def _config(path: str) -> dict:
    import json
    from pathlib import Path

    return json.loads((Path(path) / "config.json").read_text())


@functools.cache
def _processor(path: str):
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(path, backend="pil")


def processed(vlm_dir, raws: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """The checkpoint's processor on the images at once, as the router's preprocessor gives
    them: pixel values (a row a patch, every image's in order) and each image's grid."""
    from PIL import Image

    pictures = [Image.open(io.BytesIO(raw)).convert("RGB") for raw in raws]
    out = _processor(str(vlm_dir))(images=pictures, return_tensors="np")
    return np.asarray(out["pixel_values"], np.float32), np.asarray(out["image_grid_thw"], np.int64)


def expanded(vlm_dir, prompt: list[int], grids: np.ndarray, fill: int | None = None):
    """The prompt with each anchor's image pad repeated once per merged patch of its image's
    grid (Qwen2-VL's processor), its runs filled with `fill` (the image token by default);
    and each run's (offset, length)."""
    config = _config(str(vlm_dir))
    pad, merge = config["image_token_id"], config["vision_config"]["spatial_merge_size"]
    out: list[int] = []
    runs = []
    for token in prompt:
        if token != pad:
            out.append(token)
            continue
        t, h, w = grids[len(runs)].tolist()
        n = t * h * w // merge**2
        runs.append((len(out), n))
        out += [pad if fill is None else fill] * n
    assert len(runs) == len(grids)
    return out, runs


def inline(array: np.ndarray) -> vpb.TensorData:
    array = np.ascontiguousarray(array)
    return vpb.TensorData(shape=list(array.shape), dtype=array.dtype.name, inline=array.tobytes())


def mm_inputs(pixels: np.ndarray, grids: np.ndarray, runs, token: int) -> vpb.MultimodalInputs:
    """What the router sends for images it processed (DESIGN.md, "Images through the router")."""
    return vpb.MultimodalInputs(
        pixel_values=inline(pixels),
        model_specific_tensors={"image_grid_thw": inline(grids)},
        im_token_id=token,
        mm_placeholders=[vpb.PlaceholderRange(offset=o, length=n) for o, n in runs],
        mm_hashes=["0" * 64 for _ in runs],
        modality=1,
    )


_ids = iter(range(1_000_000))


def mm_request(ids: list[int], mm: vpb.MultimodalInputs, **params) -> vpb.GenerateRequest:
    params.setdefault("temperature", 0.0)
    params.setdefault("max_tokens", 12)
    return vpb.GenerateRequest(
        request_id=f"qwen-{next(_ids)}",
        tokenized=vpb.TokenizedInput(input_ids=ids),
        sampling_params=vpb.SamplingParams(**params),
        mm_inputs=mm,
        stream=False,
    )


def router_request(vlm_dir, prompt: list[int], raws: list[bytes], fill=None, **params):
    """The request the router makes of a chat prompt (one anchor per image) and its images;
    the expanded prompt and the pixel values and grids with it."""
    pixels, grids = processed(vlm_dir, raws)
    ids, runs = expanded(vlm_dir, prompt, grids, fill)
    token = _config(str(vlm_dir))["image_token_id"] if fill is None else fill
    return mm_request(ids, mm_inputs(pixels, grids, runs, token), **params), ids, pixels, grids


@functools.cache
def _loaded(path: str):
    from mlx_vlm import load

    return load(path)


def mlx_vlm_greedy(
    vlm_dir, ids: list[int], pixels, grids, n: int = 12, stop: bool = True
) -> list[int]:
    """mlx-vlm's own single-sequence greedy generation on the expanded prompt, with these
    pixel values and grids (none: a text prompt), up to its end of sequence with `stop` (the
    worker's stop)."""
    import mlx.core as mx
    from mlx_vlm.generate import generate_step

    model, _ = _loaded(str(vlm_dir))
    inputs = mx.array([ids])
    extra = {} if grids is None else {"image_grid_thw": mx.array(grids)}
    pixel_values = None if pixels is None else mx.array(pixels)
    steps = generate_step(
        inputs, model, pixel_values, mx.ones_like(inputs), max_tokens=n, temperature=0.0, **extra
    )
    tokens = [int(token) for token, _ in steps]
    eos = _config(str(vlm_dir))["eos_token_id"]
    return tokens[: tokens.index(eos) + 1] if stop and eos in tokens else tokens


# ----- handler side -----


def _preparer(vlm_dir, **changes) -> ImagePreparer:
    from transformers import AutoTokenizer

    spec = vision_spec(_config(str(vlm_dir)), AutoTokenizer.from_pretrained(str(vlm_dir)))
    assert spec is not None and spec.family == "qwen2_vl" and spec.router_processed
    return ImagePreparer(vlm_dir, dataclasses.replace(spec, **changes), MediaPolicy())


def test_each_anchor_becomes_a_run_as_long_as_its_grid_makes(vlm_dir):
    """Media references: each anchor expanded by its own image's grid, as the processor does;
    the router's mm_inputs for the same images: the same images at the same places (the same
    inputs, so the same keys)."""
    preparer = _preparer(vlm_dir)
    try:
        raws = [png(1, (64, 48)), png(2, (150, 100))]
        prompt = chat_ids(vlm_dir, "What is this?", images=2)
        media = image_request(prompt, [data_url(raw) for raw in raws])
        ids, placed = asyncio.run(preparer.prepare(media))(prompt)
        job, want, _, _ = router_request(vlm_dir, prompt, raws)
        assert ids == want
        assert [(i.offset, i.length) for i in placed] == [(3, 4), (9, 20)]  # (1, 4, 4), (1, 8, 10)
        assert asyncio.run(preparer.prepare(job))(want) == (want, placed)
    finally:
        preparer.close()


def test_bfloat16_pixel_values_are_taken_exactly(vlm_dir):
    preparer = _preparer(vlm_dir)
    try:
        prompt = chat_ids(vlm_dir, "Hi.")
        message = router_request(vlm_dir, prompt, [png(3)])[0].mm_inputs
        values = np.frombuffer(message.pixel_values.inline, np.float32)
        halves = (values.view(np.uint32) >> 16).astype(np.uint16)  # bfloat16, truncated
        message.pixel_values.CopyFrom(
            vpb.TensorData(
                shape=message.pixel_values.shape, dtype="bfloat16", inline=halves.tobytes()
            )
        )
        (image,) = preparer.router_images(message).images
        got = np.frombuffer(image.pixel_values.data, np.float32)
        assert np.array_equal(got.view(np.uint32), halves.astype(np.uint32) << 16)
    finally:
        preparer.close()


# ----- through the real server -----


@pytest.fixture(scope="module")
def vlm_face(vlm_dir) -> Iterator[vgrpc.VllmEngineStub]:
    config = dataclasses.replace(demo_config(vlm_dir, prompt_cache_block=4), protocols=("vllm",))
    with ServerThread(config) as running, running.channel() as channel:
        yield vgrpc.VllmEngineStub(channel)


def test_model_info_says_images(vlm_face):
    assert vlm_face.GetModelInfo(vpb.GetModelInfoRequest(), timeout=30).supports_vision
    assert vlm_face.GetServerInfo(vpb.GetServerInfoRequest(), timeout=30).mm_processor


def test_the_router_way_and_the_media_way_equal_mlx_vlm(vlm_face, vlm_dir):
    """One image sent as the router's mm_inputs (its runs filled with the image token, or
    with the vision token as smg's Qwen-VL spec does) and as a media reference: mlx-vlm's
    greedy tokens each time, and another image says something else."""
    prompt = chat_ids(vlm_dir, "Describe a quiet place.")
    raw = png(1, (112, 84))
    job, ids, pixels, grids = router_request(vlm_dir, prompt, [raw])
    want = mlx_vlm_greedy(vlm_dir, ids, pixels, grids)
    assert len(set(want)) >= 3
    routed = complete(vlm_face, job)
    assert routed.prompt_tokens == len(ids)
    assert list(routed.output_ids) == want
    vision_pad = _config(str(vlm_dir))["vision_token_id"]
    padded = complete(vlm_face, router_request(vlm_dir, prompt, [raw], fill=vision_pad)[0])
    assert list(padded.output_ids) == want
    fetched = complete(vlm_face, image_request(prompt, [data_url(raw)]))
    assert fetched.prompt_tokens == len(ids)
    assert list(fetched.output_ids) == want
    other = complete(vlm_face, router_request(vlm_dir, prompt, [png(2, (112, 84))])[0])
    assert list(other.output_ids) != want


def test_runs_filled_with_the_vision_token_carry_the_image(vlm_face, vlm_dir):
    """smg's Qwen-VL spec fills the runs with vision_token_id: an image the worker has not
    seen before still answers as mlx-vlm does (the image is not dropped)."""
    prompt = chat_ids(vlm_dir, "What do bees make?")
    raw = png(3, (84, 112))
    vision_pad = _config(str(vlm_dir))["vision_token_id"]
    job, _, pixels, grids = router_request(vlm_dir, prompt, [raw], fill=vision_pad)
    image_ids, _ = expanded(vlm_dir, prompt, grids)
    assert list(complete(vlm_face, job).output_ids) == mlx_vlm_greedy(
        vlm_dir, image_ids, pixels, grids
    )


def test_two_images_in_one_prompt_equal_mlx_vlm(vlm_face, vlm_dir):
    prompt = chat_ids(vlm_dir, "What do bees make?", images=2)
    raws = [png(4, (64, 48)), png(5, (84, 140))]
    job, ids, pixels, grids = router_request(vlm_dir, prompt, raws)
    want = mlx_vlm_greedy(vlm_dir, ids, pixels, grids)
    assert list(complete(vlm_face, job).output_ids) == want
    fetched = complete(vlm_face, image_request(prompt, [data_url(r) for r in raws]))
    assert list(fetched.output_ids) == want


def test_image_rows_beside_a_text_row_each_equal_their_own_generation(vlm_face, vlm_dir):
    """Two image requests (prompts and grids of different lengths) and a text request at
    once: each answer is its single-sequence reference."""
    jobs, wants = [], []
    for seed, size, question in ((6, (112, 84), "Describe a quiet place."), (7, (56, 56), "Hi.")):
        job, ids, pixels, grids = router_request(
            vlm_dir, chat_ids(vlm_dir, question), [png(seed, size)], max_tokens=16
        )
        jobs.append(job)
        wants.append(mlx_vlm_greedy(vlm_dir, ids, pixels, grids, 16))
    text = chat_ids(vlm_dir, "Tell me about the sea.", images=0)
    jobs.append(image_request(text, [], max_tokens=16))
    wants.append(mlx_vlm_greedy(vlm_dir, text, None, None, 16))
    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(lambda job: complete(vlm_face, job), jobs))
    assert [list(a.output_ids) for a in answers] == wants


@pytest.fixture(scope="module")
def small_chunks(vlm_dir) -> Iterator[tuple[ServerThread, vgrpc.VllmEngineStub]]:
    engine = dict(prefill_step_size=5, speculation=DRAFT_EVERY_STEP, prompt_cache_block=4)
    config = dataclasses.replace(demo_config(vlm_dir, **engine), protocols=("vllm",))
    with ServerThread(config) as running, running.channel() as channel:
        yield running, vgrpc.VllmEngineStub(channel)


def test_image_rows_in_small_chunks_and_verifying_drafts_stay_mlx_vlms(small_chunks, vlm_dir):
    """Prefill 5 tokens a row a step (an image's run over several chunks, rows of different
    lengths padded to each other) and drafts verified every step (prompt lookup): each answer
    is still its single-sequence reference, and drafts were accepted."""
    running, stub = small_chunks
    n = 32
    jobs, wants = [], []
    for seed, size, question in ((10, (112, 84), "Describe a quiet place."), (11, (56, 84), "Hi.")):
        job, ids, pixels, grids = router_request(
            vlm_dir, chat_ids(vlm_dir, question), [png(seed, size)], max_tokens=n, ignore_eos=True
        )
        jobs.append(job)
        wants.append(mlx_vlm_greedy(vlm_dir, ids, pixels, grids, n, stop=False))
    text = chat_ids(vlm_dir, "Tell me about the sea.", images=0)
    jobs.append(image_request(text, [], max_tokens=n, ignore_eos=True))
    wants.append(mlx_vlm_greedy(vlm_dir, text, None, None, n, stop=False))
    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(lambda job: complete(stub, job), jobs))
    assert [list(a.output_ids) for a in answers] == wants
    figures = running.server.servicer.figures().speculation
    assert figures is not None and figures.drafted > 0 and figures.accepted > 0


def test_a_row_from_a_cached_prefix_takes_its_positions_from_the_whole_prompt(vlm_face, vlm_dir):
    """Blocks of 4: the same image and prompt again reuse the prompt past the image; the same
    image with another question reuses the image's blocks and prefills only text after it;
    each answer stays mlx-vlm's."""
    raw = png(8, (112, 84))
    first = chat_ids(vlm_dir, "Describe a quiet place and the sea.")
    job, ids, pixels, grids = router_request(vlm_dir, first, [raw])
    want = mlx_vlm_greedy(vlm_dir, ids, pixels, grids)
    image_end = ids.index(_config(str(vlm_dir))["vision_end_token_id"])
    cold = complete(vlm_face, job)
    again = complete(vlm_face, router_request(vlm_dir, first, [raw])[0])
    fetched = complete(vlm_face, image_request(first, [data_url(raw)]))
    assert list(cold.output_ids) == list(again.output_ids) == list(fetched.output_ids) == want
    assert again.cached_tokens > image_end + 4 and fetched.cached_tokens > image_end + 4
    second = chat_ids(vlm_dir, "Describe a bee.")
    job, ids, pixels, grids = router_request(vlm_dir, second, [raw])
    other = complete(vlm_face, job)
    assert image_end < other.cached_tokens < len(ids) - 4
    assert list(other.output_ids) == mlx_vlm_greedy(vlm_dir, ids, pixels, grids)


def _shm(job: vpb.GenerateRequest) -> None:
    job.mm_inputs.pixel_values.shm.name = "/smg-mm-0"


def _drop_a_patch(job: vpb.GenerateRequest) -> None:
    pixels = job.mm_inputs.pixel_values
    width = pixels.shape[1]
    pixels.shape[0] -= 1
    pixels.inline = pixels.inline[: -width * 4]


def _shift_placeholder(job: vpb.GenerateRequest) -> None:
    job.mm_inputs.mm_placeholders[0].offset -= 1


def _short_placeholder(job: vpb.GenerateRequest) -> None:
    job.mm_inputs.mm_placeholders[0].length -= 1


def _bytes_short(job: vpb.GenerateRequest) -> None:
    job.mm_inputs.pixel_values.inline = job.mm_inputs.pixel_values.inline[:-4]


def _foreign_token(job: vpb.GenerateRequest) -> None:
    job.mm_inputs.im_token_id = 5


def _stray_image_token(job: vpb.GenerateRequest) -> None:
    ids = job.tokenized.input_ids
    ids[1] = job.mm_inputs.im_token_id


def _uint8(job: vpb.GenerateRequest) -> None:
    job.mm_inputs.pixel_values.dtype = "uint8"


@pytest.mark.parametrize(
    ("spoil", "says"),
    [
        (_shm, "only inline tensors"),
        (_drop_a_patch, "pixel_values: shape"),
        (_bytes_short, "bytes for shape"),
        (_shift_placeholder, "image 0: placeholder"),
        (_short_placeholder, "image 0: its placeholder has"),
        (_foreign_token, "not this model's image token"),
        (_stray_image_token, "outside its placeholders"),
        (_uint8, "dtype 'uint8'"),
    ],
)
def test_bad_mm_inputs_are_invalid_arguments(vlm_face, vlm_dir, spoil, says):
    job = router_request(vlm_dir, chat_ids(vlm_dir, "Hi."), [png(9)], max_tokens=2)[0]
    spoil(job)
    with pytest.raises(grpc.RpcError) as caught:
        complete(vlm_face, job)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert says in caught.value.details()
    ok = complete(vlm_face, router_request(vlm_dir, chat_ids(vlm_dir, "Hi."), [png(9)])[0])
    assert ok.output_ids


def test_mm_inputs_are_refused_where_the_worker_processes_images_itself(vlm_dir):
    """A family the router does not process (gemma3's) takes its images as media references."""
    preparer = _preparer(vlm_dir, router_processed=False)
    job = router_request(vlm_dir, chat_ids(vlm_dir, "Hi."), [png(9)])[0]
    try:
        with pytest.raises(RequestError, match="not as mm_inputs"):
            asyncio.run(preparer.prepare(job))
    finally:
        preparer.close()
