"""Videos of a request, handler side (no MLX, no torch): a video file decoded with PyAV within
the media policy's bounds, frames sampled and made into the vision tower's patches in numpy
exactly as the checkpoint's Qwen-VL video processor does (mlx-vlm's numpy port of it, which
tests/test_video.py checks bit for bit), and the video's run of prompt tokens.

- Sampling (`sample_indices`): Qwen3-VL's processor ("timestamped" layout) takes
  int(frames / fps * 2) frames, at least `min_frames`, evenly over the clip; Qwen2-VL's
  (Qwen2.5-VL's, "contiguous") the same count rounded down to whole temporal patches.
- Patches (`video_patches`): the frames resized (PIL bicubic) to a multiple of the merged
  patch, the budget `max_pixels` over all frames; scaled and normalised in float32; the last
  frame repeated to fill the last temporal patch; cut into [t * h * w, 3 * 2 * p * p].
- The run (`video_run`): per temporal patch `<t.t seconds>` (the mean time of its frames)
  then `<|vision_start|>`, h * w / 4 `<|video_pad|>`, `<|vision_end|>` (Qwen3-VL); or one
  `<|vision_start|>`, every pad, `<|vision_end|>` (Qwen2.5-VL).
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .media import MediaPolicy
from .vision_families import VideoSpec

# Decoding work is bounded by frames as well as seconds: a clip claiming a huge frame rate.
MOST_FRAMES_PER_SECOND = 60


class VideoRefused(Exception):
    """A video refused: code "invalid" (INVALID_ARGUMENT) or "limit" (RESOURCE_EXHAUSTED)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class VideoSettings:
    """The checkpoint's video processor settings, read as mlx-vlm reads them."""

    patch_size: int
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 128 * 32 * 32
    max_pixels: int = 32 * 32 * 768
    do_rescale: bool = True
    rescale_factor: float = 1 / 255.0
    do_normalize: bool = True
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768

    @classmethod
    def from_dir(cls, model_dir: Path) -> VideoSettings:
        """video_preprocessor_config.json (older checkpoints: preprocessor_config.json)."""
        found = model_dir / "video_preprocessor_config.json"
        if not found.exists():
            found = model_dir / "preprocessor_config.json"
        raw = json.loads(found.read_text(encoding="utf-8")) if found.exists() else {}
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
        patch = (config.get("vision_config") or {}).get("patch_size", 14)
        fields: dict[str, Any] = {"patch_size": raw.get("patch_size", patch)}
        names = ("temporal_patch_size", "merge_size", "do_rescale", "rescale_factor")
        names += ("do_normalize", "fps", "min_frames", "max_frames")
        fields |= {name: raw[name] for name in names if raw.get(name) is not None}
        fields |= {n: tuple(raw[n]) for n in ("image_mean", "image_std") if raw.get(n)}
        size = raw.get("size") or {}
        for key, name in (("shortest_edge", "min_pixels"), ("longest_edge", "max_pixels")):
            if size.get(key) is not None:
                fields[name] = size[key]
            if raw.get(name) is not None:
                fields[name] = raw[name]
        return cls(**fields)


@dataclass(frozen=True)
class SampledVideo:
    frames: np.ndarray  # [T, H, W, 3] uint8, the sampled frames in order
    indices: tuple[int, ...]  # their indices among the clip's frames
    fps: float  # the clip's frame rate


def sample_indices(total: int, fps: float, settings: VideoSettings, layout: str) -> np.ndarray:
    """The frames the checkpoint's processor samples from a clip of `total` frames at `fps`:
    Qwen3-VL's `sample_frames` ("timestamped") or Qwen2-VL's ("contiguous")."""
    per_patch = settings.temporal_patch_size
    if layout == "timestamped":
        count = int(total / fps * settings.fps)
        count = min(max(count, settings.min_frames), settings.max_frames, total)
    else:
        most = math.floor(min(settings.max_frames, total) / per_patch) * per_patch
        wanted = min(max(total / fps * settings.fps, settings.min_frames), most, total)
        count = math.floor(wanted / per_patch) * per_patch
    if count < 1:
        raise VideoRefused("invalid", f"too short: {total} frames make no {per_patch}-frame patch")
    return np.linspace(0, total - 1, count).round().astype(int)


def decode_video(
    raw: bytes, policy: MediaPolicy, settings: VideoSettings, layout: str
) -> SampledVideo:
    """The clip's sampled frames, decoded with PyAV; refused past the policy's bounds (frame
    size, length in seconds and frames, frames sampled) before its frames are decoded."""
    try:
        import av
    except ImportError:
        raise VideoRefused("invalid", "serving video needs PyAV (pip install av)") from None
    try:
        with av.open(io.BytesIO(raw), mode="r") as container:
            if not container.streams.video:
                raise VideoRefused("invalid", "not a video: the file has no video stream")
            stream = container.streams.video[0]
            width, height = stream.codec_context.width, stream.codec_context.height
            rate = stream.average_rate or stream.guessed_rate
            total = stream.frames or sum(1 for p in container.demux(stream) if p.size)
        fps = float(rate) if rate else 0.0
        if width * height > policy.max_pixels:
            pixels = f"{width}x{height} = {width * height}"
            raise VideoRefused(
                "limit", f"too many pixels a frame: {pixels}, limit {policy.max_pixels}"
            )
        if total < 1 or not fps > 0:
            raise VideoRefused("invalid", f"not a video: {total} frames at {fps} fps")
        seconds = total / fps
        if (
            seconds > policy.max_video_seconds
            or total > MOST_FRAMES_PER_SECOND * policy.max_video_seconds
        ):
            raise VideoRefused(
                "limit",
                f"too long: {seconds:.1f} s ({total} frames), limit {policy.max_video_seconds:g} s",
            )
        indices = sample_indices(total, fps, settings, layout)
        if len(indices) > policy.max_video_frames:
            raise VideoRefused(
                "limit",
                f"too many frames: {len(indices)} sampled at {settings.fps:g} fps, "
                f"limit {policy.max_video_frames}",
            )
        wanted, kept = set(indices.tolist()), {}
        with av.open(io.BytesIO(raw), mode="r") as container:
            for i, frame in enumerate(container.decode(container.streams.video[0])):
                if i in wanted:
                    kept[i] = frame.to_ndarray(format="rgb24")
                if i >= indices[-1]:
                    break
    except VideoRefused:
        raise
    except Exception as exc:  # any decoder failure is the video's fault, not ours
        raise VideoRefused("invalid", f"undecodable video ({type(exc).__name__}: {exc})") from None
    if len(kept) != len(wanted):
        raise VideoRefused("invalid", f"the video has fewer frames than the {total} it declares")
    frames = np.stack([kept[i] for i in indices.tolist()])
    return SampledVideo(frames, tuple(indices.tolist()), fps)


def smart_resize(frames: int, height: int, width: int, s: VideoSettings) -> tuple[int, int]:
    """The frames' size for the vision tower (mlx-vlm's `_smart_resize_video`): whole merged
    patches, all frames together within [min_pixels, max_pixels]."""
    factor = s.patch_size * s.merge_size
    if height < factor or width < factor:
        raise VideoRefused(
            "invalid", f"frames of {width}x{height} are under {factor} pixels a side"
        )
    if max(height, width) / min(height, width) > 200:
        raise VideoRefused("invalid", f"frames of {width}x{height}: aspect ratio over 200")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = math.ceil(frames / s.temporal_patch_size) * s.temporal_patch_size
    if t_bar * h_bar * w_bar > s.max_pixels:
        beta = math.sqrt((frames * height * width) / s.max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < s.min_pixels:
        beta = math.sqrt(s.min_pixels / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def video_patches(frames: np.ndarray, s: VideoSettings) -> tuple[np.ndarray, tuple[int, int, int]]:
    """pixel_values_videos [t * h * w, 3 * tps * p * p] (float32) and the grid (t, h, w) of
    uint8 frames [T, H, W, 3], as mlx-vlm's Qwen3VLVideoProcessor makes them."""
    from PIL import Image

    count, height, width, channels = frames.shape
    resized_h, resized_w = smart_resize(count, height, width, s)
    if (resized_h, resized_w) != (height, width):
        frames = np.stack(
            [
                np.asarray(Image.fromarray(f).resize((resized_w, resized_h), Image.BICUBIC))
                for f in frames
            ]
        )
    video = frames.transpose(0, 3, 1, 2).astype(np.float32)
    if s.do_rescale:
        video = video * np.float32(s.rescale_factor)
    if s.do_normalize:
        mean = np.array(s.image_mean, dtype=np.float32)[None, :, None, None]
        std = np.array(s.image_std, dtype=np.float32)[None, :, None, None]
        video = (video - mean) / std
    tps, ps, ms = s.temporal_patch_size, s.patch_size, s.merge_size
    pad = -count % tps
    if pad:
        video = np.concatenate([video, np.repeat(video[-1:], pad, axis=0)])
    grid_t, grid_h, grid_w = video.shape[0] // tps, resized_h // ps, resized_w // ps
    patches = video.reshape(
        grid_t, tps, channels, grid_h // ms, ms, ps, grid_w // ms, ms, ps
    ).transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    flat = patches.reshape(grid_t * grid_h * grid_w, channels * tps * ps * ps)
    return np.ascontiguousarray(flat), (grid_t, grid_h, grid_w)


def group_seconds(indices: tuple[int, ...], fps: float, per_patch: int) -> list[float]:
    """Each temporal patch's time: the mean of its first and last frame's (the last frame
    repeated to fill the last patch), as Qwen3-VL's processor labels them."""
    padded = list(indices) + list(indices[-1:]) * (-len(indices) % per_patch)
    times = [i / fps for i in padded]
    return [(times[i] + times[i + per_patch - 1]) / 2 for i in range(0, len(times), per_patch)]


def video_run(
    spec: VideoSpec, grid: tuple[int, int, int], labels: list[list[int]]
) -> tuple[tuple[int, ...], tuple[tuple[int, int, int, int, int], ...]]:
    """The video's run of tokens (replacing its whole anchor) and its blocks of video tokens
    (offset in the run, length, t, h, w); `labels`: each temporal patch's timestamp tokens
    (the "timestamped" layout)."""
    t, h, w = grid
    block = h * w // spec.merge**2
    if spec.layout == "contiguous":
        run = (spec.start, *([spec.video_token_id] * (t * block)), spec.end)
        return run, ((1, t * block, t, h, w),)
    run: list[int] = []
    spans = []
    for label in labels:
        run += [*label, spec.start]
        spans.append((len(run), block, 1, h, w))
        run += [*([spec.video_token_id] * block), spec.end]
    return tuple(run), tuple(spans)


def timestamp_text(seconds: float) -> str:
    return f"<{seconds:.1f} seconds>"
