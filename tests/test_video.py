"""Video (Qwen3-VL, Qwen2.5-VL demos): a data: mp4 built here in memory (PyAV) reaches the real
worker as a media reference; the worker samples its frames as the checkpoint's processor does
and its answer equals mlx-vlm's greedy generation on the same frames (mlx-vlm's own video
processor and prompt expansion, Qwen3-VL's timestamps included); a repeated request reuses its
prompt past the video; bad videos are refused cleanly; and through the real smg router a
video_url chat answers as mlx-vlm does, on both of the router's paths for Qwen3-VL."""

from __future__ import annotations

import base64
import dataclasses
import importlib.util
import io
import shutil
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import numpy as np
import pytest
from conftest import demo_config
from support import SMG, Router, ServerThread
from test_images import complete, data_url, png
from vlm_support import served

from servicer.proto import vllm_engine_pb2 as vpb
from servicer.proto import vllm_engine_pb2_grpc as vgrpc

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("mlx_vlm") is None, reason="mlx-vlm (the vision extra) is absent"
    ),
    pytest.mark.skipif(importlib.util.find_spec("av") is None, reason="PyAV (av) is absent"),
]

QUESTION = "What do bees make?"


def mp4(seed: int, frames: int = 8, size: tuple[int, int] = (64, 64), fps: int = 4) -> bytes:
    """A short clip of seeded noise sliding sideways, encoded to mp4 in memory."""
    import av

    base = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(np.roll(base, 4 * i, axis=1), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()


def video_url(raw: bytes) -> str:
    return "data:video/mp4;base64," + base64.b64encode(raw).decode()


_ids = iter(range(1_000_000))


def media_request(prompt: list[int], refs: list[tuple[int, str]], **params) -> vpb.GenerateRequest:
    params.setdefault("temperature", 0.0)
    params.setdefault("max_tokens", 12)
    items = [vpb.MediaRef(modality=modality, url=url) for modality, url in refs]
    return vpb.GenerateRequest(
        request_id=f"video-{next(_ids)}",
        tokenized=vpb.TokenizedInput(input_ids=prompt),
        sampling_params=vpb.SamplingParams(**params),
        media_refs=vpb.MediaRefs(items=items),
        stream=False,
    )


class VideoReference:
    """mlx-vlm's model and processor on a demo checkpoint: the chat (parts in order) rendered
    by its template, its processor expanding it over the frames the worker samples (their
    source indices and the clip's fps as metadata: Qwen3-VL's timestamps), `generate_step`."""

    def __init__(self, family: str) -> None:
        from vlm_support import loaded

        from servicer.demos.vision import demo_vlm_path

        self.dir = demo_vlm_path(family=family)
        self.model, self.processor = loaded(str(self.dir))
        self.layout = "timestamped" if family == "qwen3_vl" else "contiguous"

    def chat(self, question: str, parts: list[str]) -> str:
        content = [{"type": kind} for kind in parts] + [{"type": "text", "text": question}]
        messages = [{"role": "user", "content": content}]
        return self.processor.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )

    def router_ids(self, question: str, parts: list[str]) -> list[int]:
        text = self.chat(question, parts)
        return list(self.processor.tokenizer.encode(text, add_special_tokens=False))

    def frames(self, raw: bytes):
        from servicer.media import MediaPolicy
        from servicer.video import VideoSettings, decode_video

        settings = VideoSettings.from_dir(self.dir)
        return decode_video(raw, MediaPolicy(), settings, self.layout)

    def answer(
        self, question: str, videos: list[bytes], images: list[bytes] = (), n: int = 12
    ) -> tuple[list[int], list[int]]:
        """Greedy tokens up to the end of sequence, and the expanded prompt."""
        import mlx.core as mx
        from mlx_vlm.generate import generate_step
        from PIL import Image

        sampled = [self.frames(raw) for raw in videos]
        parts = ["image"] * len(images) + ["video"] * len(videos)
        kwargs: dict = {"text": self.chat(question, parts), "return_tensors": "np"}
        kwargs["add_special_tokens"] = False
        if images:
            kwargs["images"] = [Image.open(io.BytesIO(r)).convert("RGB") for r in images]
        if sampled:
            kwargs["videos"] = [s.frames for s in sampled]
            if self.layout == "timestamped":
                meta = [{"frames_indices": list(s.indices), "fps": s.fps} for s in sampled]
                kwargs["video_metadata"] = meta
        out = self.processor(**kwargs)
        extra = {
            k: mx.array(np.asarray(out[k]))
            for k in ("image_grid_thw", "pixel_values_videos", "video_grid_thw")
            if k in out
        }
        pixels = mx.array(np.asarray(out["pixel_values"])) if "pixel_values" in out else None
        ids = mx.array(np.asarray(out["input_ids"]))
        steps = generate_step(ids, self.model, pixels, mx.ones_like(ids), max_tokens=n, **extra)
        eos = self.model.config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [eos])
        tokens: list[int] = []
        for token, _ in steps:
            tokens.append(int(token))
            if tokens[-1] in eos:
                break
        return tokens, np.asarray(out["input_ids"])[0].tolist()

    def text(self, tokens: list[int]) -> str:
        return self.processor.tokenizer.decode(tokens, skip_special_tokens=True)


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen2_5_vl"])
def family(request) -> Iterator[tuple[VideoReference, vgrpc.VllmEngineStub]]:
    ref = VideoReference(request.param)
    with served(ref.dir) as stub:
        yield ref, stub


def test_the_worker_samples_and_patches_as_mlx_vlms_processor(family):
    """The worker's frames, patches and grid equal mlx-vlm's processor's on the same frames."""
    from mlx_vlm.models.qwen3_vl.processing_qwen3_vl import (
        Qwen3VLVideoProcessor,
        _qwen_vl_video_kwargs,
    )

    from servicer.video import VideoSettings, video_patches

    ref, _ = family
    theirs = Qwen3VLVideoProcessor(**_qwen_vl_video_kwargs(str(ref.dir)))
    for raw in (mp4(1), mp4(2, frames=13, size=(96, 64), fps=6), mp4(3, frames=40, fps=10)):
        sampled = ref.frames(raw)
        pixels, grid = video_patches(sampled.frames, VideoSettings.from_dir(ref.dir))
        out = theirs(videos=[sampled.frames])
        assert np.array_equal(out["pixel_values_videos"], pixels)
        assert out["video_grid_thw"].tolist() == [list(grid)]


def test_a_video_answer_equals_mlx_vlms_and_a_repeat_hits_past_the_video(family):
    ref, stub = family
    raw = mp4(5)
    job = media_request(ref.router_ids(QUESTION, ["video"]), [(3, video_url(raw))])
    done = complete(stub, job)
    want, prompt = ref.answer(QUESTION, [raw])
    assert done.prompt_tokens == len(prompt)
    assert list(done.output_ids) == want
    other = ref.answer(QUESTION, [mp4(6)])[0]
    assert other != want  # the answer depends on the video
    again = complete(stub, job)
    video_end = len(prompt) - prompt[::-1].index(ref.model.config.video_token_id)
    assert again.cached_tokens >= video_end - 4 and list(again.output_ids) == want


def test_a_video_and_an_image_in_one_request(family):
    ref, stub = family
    if ref.layout == "contiguous":
        pytest.skip("mlx-vlm 0.7.10's Qwen2.5-VL takes images or a video, not both at once")
    raw, picture = mp4(7), png(8, (64, 64))
    refs = [(1, data_url(picture)), (3, video_url(raw))]
    done = complete(stub, media_request(ref.router_ids(QUESTION, ["image", "video"]), refs))
    want, prompt = ref.answer(QUESTION, [raw], [picture])
    assert done.prompt_tokens == len(prompt)
    assert list(done.output_ids) == want


def test_bad_videos_are_refused_cleanly(family, tmp_path):
    ref, stub = family
    prompt = ref.router_ids(QUESTION, ["video"])
    cases = [
        ("data:video/mp4;base64," + base64.b64encode(b"not a video at all").decode(), "video 0"),
        (data_url(png(1)), "not a video"),  # an image's data: URL as a video
        (video_url(mp4(9, frames=1)), "too short"),  # Qwen2.5-VL: under one patch; Qwen3 pads
    ]
    for url, says in cases:
        job = media_request(prompt, [(3, url)])
        try:
            complete(stub, job)
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
            assert says in error.details()
        else:
            assert says == "too short" and ref.layout == "timestamped"


@contextmanager
def recorded(running) -> Iterator[list]:
    """Each media request the worker prepares while the block runs (a copy)."""
    preparer = running.server.servicer.images
    prepare = preparer.prepare
    sent: list = []

    async def spy(request, *known):
        sent.append(type(request).FromString(request.SerializeToString()))
        return await prepare(request, *known)

    preparer.prepare = spy
    try:
        yield sent
    finally:
        preparer.prepare = prepare


def routed_video_chat(
    router, model: str, raw: bytes, fps: float | None = None, picture: bytes | None = None
):
    video = {"url": video_url(raw)} | ({"fps": fps} if fps is not None else {})
    content = [{"type": "video_url", "video_url": video}, {"type": "text", "text": QUESTION}]
    if picture is not None:
        content.insert(0, {"type": "image_url", "image_url": {"url": data_url(picture)}})
    body = {"model": model, "messages": [{"role": "user", "content": content}]}
    body |= {"max_tokens": 12, "temperature": 0}
    return router.client.post("/v1/chat/completions", json=body)


def mlx_vlm_on_the_routers_tensors(ref: VideoReference, request) -> list[int]:
    """mlx-vlm's greedy tokens on exactly what the router sent: its expanded prompt, its
    frames' pixel values and grids (mm_inputs and extra_mm_inputs)."""
    import mlx.core as mx
    from mlx_vlm.generate import generate_step

    kinds = {"float32": "<f4", "int64": "<i8"}
    kwargs: dict = {}
    for mm in [request.mm_inputs, *request.extra_mm_inputs]:
        pixels = mm.pixel_values
        values = np.frombuffer(pixels.inline, kinds[pixels.dtype]).reshape(tuple(pixels.shape))
        kwargs["pixel_values_videos" if mm.modality == 3 else "pixel_values"] = mx.array(values)
        for name, t in mm.model_specific_tensors.items():
            if name.endswith("grid_thw"):
                grid = np.frombuffer(t.inline, kinds[t.dtype]).reshape(tuple(t.shape))
                kwargs[name] = mx.array(grid)
    ids = mx.array([list(request.tokenized.input_ids)])
    pixels = kwargs.pop("pixel_values", None)
    steps = generate_step(ids, ref.model, pixels, mx.ones_like(ids), max_tokens=12, **kwargs)
    tokens: list[int] = []
    for token, _ in steps:
        tokens.append(int(token))
        if tokens[-1] == ref.model.config.eos_token_id:
            break
    return tokens


@pytest.mark.skipif(SMG is None, reason="the smg router is a dev dependency")
@pytest.mark.skipif(shutil.which("ffmpeg") is None, reason="the router samples frames with ffmpeg")
def test_through_the_router_a_video_answers_as_mlx_vlm_on_both_paths(tmp_path):
    """qwen3_vl behind the real smg router: a video_url goes to the worker as a media
    reference (it advertises mm_processor); with a `fps` hint the router samples the frames
    itself and sends their pixel values (mm_inputs, modality VIDEO, its prompt expanded
    with timestamps; beside an image, extra_mm_inputs): each answer is mlx-vlm's on the
    same frames."""
    ref = VideoReference("qwen3_vl")
    raw = mp4(5)
    config = dataclasses.replace(demo_config(ref.dir, prompt_cache_block=4), protocols=("vllm",))
    with ServerThread(config) as running, recorded(running) as sent:
        router = Router([running.address], tmp_path / "smg.log")
        try:
            model = router.wait_until_serving()
            by_reference = routed_video_chat(router, model, raw)
            by_router = routed_video_chat(router, model, raw, fps=2.0)
            both = routed_video_chat(router, model, raw, fps=2.0, picture=png(8, (64, 64)))
        finally:
            router.close()
    assert by_reference.status_code == 200, by_reference.text
    assert by_router.status_code == 200, by_router.text
    assert both.status_code == 200, both.text
    worker_side, router_side, image_and_video = sent
    assert [r.modality for r in worker_side.media_refs.items] == [3]
    assert router_side.mm_inputs.modality == 3 and not router_side.media_refs.items
    answer = ref.text(ref.answer(QUESTION, [raw])[0])
    assert by_reference.json()["choices"][0]["message"]["content"] == answer
    answer = ref.text(mlx_vlm_on_the_routers_tensors(ref, router_side))
    assert by_router.json()["choices"][0]["message"]["content"] == answer
    # An image too: the image in mm_inputs, the video in extra_mm_inputs.
    assert image_and_video.mm_inputs.modality == 1
    assert [mm.modality for mm in image_and_video.extra_mm_inputs] == [3]
    answer = ref.text(mlx_vlm_on_the_routers_tensors(ref, image_and_video))
    assert both.json()["choices"][0]["message"]["content"] == answer


def test_video_limits_are_refused_with_what_and_the_limit(tmp_path):
    """Bytes, length and sampled frames, each past a small limit: RESOURCE_EXHAUSTED naming
    the limit (as an image's limits are); the worker serves on."""
    from servicer.media import MediaPolicy

    ref = VideoReference("qwen3_vl")
    config = demo_config(ref.dir, prompt_cache_block=4)
    policy = MediaPolicy(max_video_bytes=40_000, max_video_frames=4, max_video_seconds=3.0)
    handlers = dataclasses.replace(config.handlers, media=policy)
    config = dataclasses.replace(config, protocols=("vllm",), handlers=handlers)
    prompt = ref.router_ids(QUESTION, ["video"])
    cases = [
        (mp4(10, frames=8, size=(256, 256)), "too many bytes"),  # ~170 kB
        (mp4(11, frames=16, fps=4), "too long: 4.0 s"),
        (mp4(12, frames=28, fps=10), "too many frames: 5"),  # 2.8 s at 2 fps
        (mp4(13, frames=2, size=(16, 16)), "under 32 pixels a side"),
    ]
    with ServerThread(config) as running, running.channel() as channel:
        stub = vgrpc.VllmEngineStub(channel)
        for raw, says in cases:
            with pytest.raises(grpc.RpcError) as refused:
                complete(stub, media_request(prompt, [(3, video_url(raw))]))
            code = refused.value.code()
            want = grpc.StatusCode.INVALID_ARGUMENT if "pixels" in says else None
            assert code == (want or grpc.StatusCode.RESOURCE_EXHAUSTED), refused.value.details()
            assert says in refused.value.details() and "video 0" in refused.value.details()
        done = complete(stub, media_request(prompt, [(3, video_url(mp4(14)))]))
        assert len(done.output_ids) > 0
