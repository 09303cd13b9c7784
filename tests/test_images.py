"""Images on the vLLM face: the anchors expanded as the model's processor does, image blocks named
by what the image is, and through the real server the same tokens as mlx-vlm's own generation."""

from __future__ import annotations

import base64
import dataclasses
import functools
import importlib.util
import io
import re
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from conftest import demo_config
from support import ServerThread

from servicer.engine.prefix.keys import IMAGE_ID_BASE, block_keys, image_keyed
from servicer.images import ProcessedImage, expand, image_key, tensor
from servicer.proto import vllm_engine_pb2 as vpb
from servicer.proto import vllm_engine_pb2_grpc as vgrpc
from servicer.validation import RequestError
from servicer.vision_families import VisionSpec

SPEC = VisionSpec("gemma3", 9, anchor=(7,), before=(5, 7), after=(8, 5), tokens_per_image=3)


def _image(seed: int, tokens: int = 3) -> ProcessedImage:
    pixels = tensor(np.random.default_rng(seed).random((1, 3, 4, 4), dtype=np.float32))
    return ProcessedImage(tokens, image_key(pixels), pixels)


def test_each_anchor_becomes_its_images_placeholder_run():
    first, second = _image(0), _image(1)
    prompt, images = expand([1, 2, 7, 3, 7, 4], SPEC, [first, second])
    assert prompt == [1, 2, 5, 7, 9, 9, 9, 8, 5, 3, 5, 7, 9, 9, 9, 8, 5, 4]
    assert [(i.offset, i.length) for i in images] == [(4, 3), (12, 3)]
    assert all(prompt[i.offset : i.end] == [9, 9, 9] for i in images)
    assert [i.key for i in images] == [first.key, second.key]


@pytest.mark.parametrize(
    ("prompt", "count", "says"),
    [
        ([1, 7, 2], 2, "1 image anchors for 2 images"),
        ([1, 7, 2, 7, 3], 1, "more image anchors"),
        ([1, 2, 3], 1, "0 image anchors for 1 images"),
    ],
)
def test_anchors_and_images_must_pair_up(prompt, count, says):
    with pytest.raises(RequestError) as caught:
        expand(prompt, SPEC, [_image(i) for i in range(count)])
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert says in caught.value.message


def test_a_prompt_may_not_end_inside_an_image():
    spec = dataclasses.replace(SPEC, after=())
    with pytest.raises(RequestError, match="ends inside an image"):
        expand([1, 7], spec, [_image(0)])


def test_image_key_is_what_the_encoder_gets():
    assert _image(0).key == _image(0).key
    assert _image(0).key != _image(1).key
    same = tensor(np.zeros((1, 3, 4, 4), np.float32))
    other_shape = tensor(np.zeros((1, 3, 2, 8), np.float32))
    assert image_key(same) != image_key(other_shape)


def test_blocks_are_named_by_the_image_from_the_image_on():
    """The same prompt with another image shares the blocks before the image only; the same
    image names the same blocks."""
    prompt = list(range(20)) + [9] * 8 + list(range(20, 40))
    a, b = _image(0, 8), _image(1, 8)
    keyed_a = image_keyed(prompt, [(20, 8, a.key)])
    keyed_a2 = image_keyed(prompt, [(20, 8, a.key)])
    keyed_b = image_keyed(prompt, [(20, 8, b.key)])
    assert keyed_a == keyed_a2
    assert all(t >= IMAGE_ID_BASE and t < 1 << 31 for t in keyed_a[20:28])
    assert keyed_a[:20] == prompt[:20] and keyed_a[28:] == prompt[28:]
    blocks_a, blocks_b = block_keys(keyed_a, 4), block_keys(keyed_b, 4)
    assert blocks_a[:5] == blocks_b[:5]
    assert all(x != y for x, y in zip(blocks_a[5:], blocks_b[5:], strict=True))


# ----- through the real server (mlx-vlm and the tiny gemma3 VLM) -----

needs_vlm = pytest.mark.skipif(
    importlib.util.find_spec("mlx_vlm") is None,
    reason="mlx-vlm is not installed (the vision extra)",
)


@pytest.fixture(scope="module")
def vlm_dir():
    from servicer.demos.vision import demo_vlm_path

    return demo_vlm_path(family="gemma3")


@pytest.fixture(scope="module")
def vlm_face(vlm_dir) -> Iterator[vgrpc.VllmEngineStub]:
    config = dataclasses.replace(demo_config(vlm_dir, prompt_cache_block=4), protocols=("vllm",))
    with ServerThread(config) as running, running.channel() as channel:
        yield vgrpc.VllmEngineStub(channel)


def png(seed: int, size: tuple[int, int] = (64, 48)) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def data_url(raw: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(raw).decode()


_ids = iter(range(1_000_000))


def image_request(prompt: list[int], urls: list[str], **params) -> vpb.GenerateRequest:
    params.setdefault("temperature", 0.0)
    params.setdefault("max_tokens", 12)
    refs = [vpb.MediaRef(modality=1, url=u) for u in urls]
    return vpb.GenerateRequest(
        request_id=f"img-{next(_ids)}",
        tokenized=vpb.TokenizedInput(input_ids=prompt),
        sampling_params=vpb.SamplingParams(**params),
        media_refs=vpb.MediaRefs(items=refs),
        stream=False,
    )


def complete(stub, message) -> vpb.GenerateComplete:
    (response,) = list(stub.Generate(message, timeout=120))
    return response.complete


def _tokenizer(vlm_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(vlm_dir))


def chat_ids(vlm_dir, question: str, images: int = 1) -> list[int]:
    """The prompt as the router sends it: the chat template rendered, one anchor per image."""
    tokenizer = _tokenizer(vlm_dir)
    content = [{"type": "image"}] * images + [{"type": "text", "text": question}]
    messages = [{"role": "user", "content": content}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def expanded(vlm_dir, prompt: list[int]) -> list[int]:
    """The prompt with each anchor replaced as Gemma 3's processor does, independently of the
    worker: the processor's own image sequence, tokenized."""
    from servicer.demos.gemma3 import IMAGE_ANCHOR, IMAGE_SEQUENCE

    tokenizer = _tokenizer(vlm_dir)
    (anchor,) = tokenizer.encode(IMAGE_ANCHOR, add_special_tokens=False)
    run = tokenizer.encode(IMAGE_SEQUENCE, add_special_tokens=False)
    out: list[int] = []
    for token in prompt:
        out += run if token == anchor else [token]
    return out


@functools.cache
def _loaded(path: str):
    from mlx_vlm import load

    return load(path)


def mlx_vlm_greedy(vlm_dir, prompt: list[int], raw_images: list[bytes], n: int) -> list[int]:
    """mlx-vlm's own single-sequence greedy generation on the worker's expanded prompt, with the
    pixel values its own processor makes."""
    import mlx.core as mx
    from mlx_vlm.generate import generate_step
    from PIL import Image

    model, processor = _loaded(str(vlm_dir))
    pixels = None
    if raw_images:
        pictures = [Image.open(io.BytesIO(raw)).convert("RGB") for raw in raw_images]
        found = processor.image_processor(images=pictures, return_tensors="np")["pixel_values"]
        pixels = mx.array(found)
    ids = mx.array([prompt])
    steps = generate_step(ids, model, pixels, mx.ones_like(ids), max_tokens=n)
    return [int(token) for token, _ in steps]


@needs_vlm
def test_model_info_and_server_info_say_images(vlm_face):
    info = vlm_face.GetModelInfo(vpb.GetModelInfoRequest(), timeout=30)
    assert info.supports_vision
    server = vlm_face.GetServerInfo(vpb.GetServerInfoRequest(), timeout=30)
    assert server.mm_processor
    assert server.mm_media_ref_schemes == "data"
    assert server.mm_item_limits == "image=8"


@needs_vlm
def test_an_image_answer_equals_mlx_vlms_and_depends_on_the_image(vlm_face, vlm_dir):
    prompt = chat_ids(vlm_dir, "Describe a quiet place.")
    outputs = []
    for seed in (1, 2):
        raw = png(seed)
        done = complete(vlm_face, image_request(prompt, [data_url(raw)]))
        full = expanded(vlm_dir, prompt)
        assert done.prompt_tokens == len(full)
        assert list(done.output_ids) == mlx_vlm_greedy(vlm_dir, full, [raw], 12)
        outputs.append(list(done.output_ids))
    assert outputs[0] != outputs[1]


@needs_vlm
def test_image_and_text_rows_batched_each_equal_their_own_generation(vlm_face, vlm_dir):
    """Three image requests (two images alike) and two text requests at once: each answer is
    mlx-vlm's single-sequence one."""
    from concurrent.futures import ThreadPoolExecutor

    question = chat_ids(vlm_dir, "What do bees make?")
    texts = [chat_ids(vlm_dir, q, images=0) for q in ("Describe a quiet place.", "Hello there.")]
    raws = [png(10), png(11), png(10)]
    jobs = [image_request(question, [data_url(raw)], max_tokens=10) for raw in raws]
    jobs += [image_request(t, [], max_tokens=10) for t in texts]
    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(lambda job: complete(vlm_face, job), jobs))
    for raw, answer in zip(raws, answers, strict=False):
        want = mlx_vlm_greedy(vlm_dir, expanded(vlm_dir, question), [raw], 10)
        assert list(answer.output_ids) == want
    for text, answer in zip(texts, answers[3:], strict=True):
        assert list(answer.output_ids) == mlx_vlm_greedy(vlm_dir, text, [], 10)


@needs_vlm
def test_another_image_misses_from_the_image_on_and_the_same_image_hits_past_it(vlm_face, vlm_dir):
    """Blocks of 4 tokens: the second image's request reuses only what precedes the image;
    the first image again reuses the prompt past it, and the answers stay mlx-vlm's."""
    prompt = chat_ids(vlm_dir, "Tell me about the sea and the sky.")
    full = expanded(vlm_dir, prompt)
    image_at = full.index(514)
    first, second = png(20), png(21)
    cold = complete(vlm_face, image_request(prompt, [data_url(first)]))
    other = complete(vlm_face, image_request(prompt, [data_url(second)]))
    again = complete(vlm_face, image_request(prompt, [data_url(first)]))
    assert other.cached_tokens <= image_at
    assert again.cached_tokens > image_at + 4
    assert list(again.output_ids) == list(cold.output_ids)
    assert list(cold.output_ids) == mlx_vlm_greedy(vlm_dir, full, [first], 12)
    assert list(other.output_ids) == mlx_vlm_greedy(vlm_dir, full, [second], 12)


@needs_vlm
def test_n_seeds_stop_strings_and_logprobs_work_on_an_image_request(vlm_face, vlm_dir):
    prompt = chat_ids(vlm_dir, "Describe a quiet place.")
    url = data_url(png(30))
    job = image_request(prompt, [url], n=2, temperature=0.8, seed=7, max_tokens=8, logprobs=2)
    responses = list(vlm_face.Generate(job, timeout=120))
    completes = {r.complete.index: r.complete for r in responses}
    assert sorted(completes) == [0, 1]
    again = list(
        vlm_face.Generate(
            image_request(prompt, [url], n=2, temperature=0.8, seed=7, max_tokens=8, logprobs=2),
            timeout=120,
        )
    )
    assert [list(r.complete.output_ids) for r in again] == [
        list(completes[r.complete.index].output_ids) for r in again
    ]
    assert all(
        len(c.output_logprobs.token_logprobs) == len(c.output_ids) for c in completes.values()
    )


@needs_vlm
def test_stop_strings_and_structured_output_work_on_an_image_request(vlm_face, vlm_dir):
    """A stop string cuts the image request's greedy answer where the text holds it; a regex
    and a choice constrain it as they do a text request."""
    prompt, url = chat_ids(vlm_dir, "What do bees make?"), data_url(png(31))
    whole = complete(vlm_face, image_request(prompt, [url], max_tokens=16, ignore_eos=True))
    text = _decoded(vlm_dir, whole)
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = complete(vlm_face, image_request(prompt, [url], max_tokens=16, stop=[stop]))
    # The ids run through the token that completed the stop string (the router trims text).
    cut_ids = list(cut.output_ids)
    assert cut.finish_reason == "stop" and cut_ids == list(whole.output_ids)[: len(cut_ids)]
    assert stop in _decoded(vlm_dir, cut) and stop not in _decoded(vlm_dir, cut, cut_ids[:-1])
    regex = complete(vlm_face, image_request(prompt, [url], max_tokens=8, regex="[ab]{3}"))
    assert re.fullmatch("[ab]{3}", _decoded(vlm_dir, regex))
    choice = vpb.ChoiceConstraint(choices=["honey", "wax"])
    chosen = complete(vlm_face, image_request(prompt, [url], max_tokens=8, choice=choice))
    assert _decoded(vlm_dir, chosen) in ("honey", "wax")


def _decoded(vlm_dir, done, ids: list[int] | None = None) -> str:
    ids = list(done.output_ids) if ids is None else ids
    return _tokenizer(vlm_dir).decode(ids, skip_special_tokens=True)


@needs_vlm
@pytest.mark.parametrize(
    ("urls", "code", "says"),
    [
        (["data:image/png;base64,AAAA"], grpc.StatusCode.INVALID_ARGUMENT, "image 0"),
        (["http://127.0.0.1:1/x.png"], grpc.StatusCode.INVALID_ARGUMENT, "image 0"),
        (["file:///etc/passwd"], grpc.StatusCode.INVALID_ARGUMENT, "image 0"),
        ([data_url(png(1))] * 9, grpc.StatusCode.RESOURCE_EXHAUSTED, "too many images"),
    ],
)
def test_bad_images_are_refused_before_the_first_message(vlm_face, vlm_dir, urls, code, says):
    prompt = chat_ids(vlm_dir, "Hi.", images=len(urls))
    with pytest.raises(grpc.RpcError) as caught:
        complete(vlm_face, image_request(prompt, urls))
    assert caught.value.code() == code
    assert says in caught.value.details()
    # the worker goes on serving
    ok = complete(vlm_face, image_request(prompt[:1] + prompt[-3:], [], max_tokens=2))
    assert ok.output_ids


@needs_vlm
def test_anchor_and_image_counts_must_agree(vlm_face, vlm_dir):
    prompt = chat_ids(vlm_dir, "Hi.", images=2)
    with pytest.raises(grpc.RpcError) as caught:
        complete(vlm_face, image_request(prompt, [data_url(png(1))]))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "more image anchors than its 1 images" in caught.value.details()


@needs_vlm
def test_kv_events_never_name_an_image_block_by_its_placeholder_ids(vlm_face, vlm_dir):
    """The router hashes a request's token ids, in which every image's placeholders look alike:
    the worker's events name image blocks by ids drawn from the image (above any vocabulary),
    so no request's ids can match them, while blocks before the image stay routable."""
    from servicer.proto import common_pb2

    prompt = chat_ids(vlm_dir, "A question about a picture.")
    full = expanded(vlm_dir, prompt)
    image_at = full.index(514)
    complete(vlm_face, image_request(prompt, [data_url(png(50))], max_tokens=2))
    events = vlm_face.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), timeout=30)
    snapshot = next(events)
    events.cancel()
    blocks = [b for e in snapshot.events if e.HasField("stored") for b in e.stored.blocks]
    image_blocks = [b for b in blocks if any(t >= IMAGE_ID_BASE for t in b.token_ids)]
    assert image_blocks
    assert all(514 not in b.token_ids for b in blocks)
    assert any(list(b.token_ids) == full[:4] for b in blocks)
    assert image_at >= 4
