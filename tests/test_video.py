"""Video (Qwen3-VL, Qwen2.5-VL demos): a data: mp4 built here in memory (PyAV) reaches the real
worker as a media reference; the worker samples its frames as the checkpoint's processor does
and its answer equals mlx-vlm's greedy generation on the same frames (mlx-vlm's own video
processor and prompt expansion, Qwen3-VL's timestamps included); a repeated request reuses its
prompt past the video; bad videos are refused cleanly; and through the real smg router a
video_url chat answers as mlx-vlm does, on both of the router's paths for Qwen3-VL."""

from __future__ import annotations

import base64
import importlib.util
import io
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
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
