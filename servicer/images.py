"""Images of a request, handler side (no MLX): what a vision model's prompt looks like around
an image (`VisionSpec`, from its files), the fetch and the model's own image processor in a
thread pool (`ImagePreparer`), and the prompt with each image's anchor expanded into its
placeholder run (`expand`), each image named by a hash of exactly what the encoder gets.

For a family the router processes itself (Qwen2-VL, Qwen2.5-VL, LLaVA: docs/images.md, "The
router's two paths") the images come as the router's `mm_inputs` instead: pixel values, patch
grids and their placeholder runs already in the prompt (`router_images`, then `place`, which
checks them).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import importlib
import itertools
import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from .media import POOL_SIZE, MediaError, MediaPolicy, fetch_images, grpc_status
from .messages import ImageInput, Tensor
from .validation import ExpandImages, RequestError
from .video import (
    VideoRefused,
    VideoSettings,
    decode_video,
    group_seconds,
    timestamp_text,
    video_patches,
    video_run,
)
from .vision_families import VideoSpec, VisionSpec

log = logging.getLogger(__name__)

IMAGE_MODALITY = 1  # smg.grpc.common.Modality.IMAGE
VIDEO_MODALITY = 3  # smg.grpc.common.Modality.VIDEO
KEY_BYTES = 16


def _invalid(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


@dataclass(frozen=True)
class ProcessedImage:
    """One image (or video) as the encoder takes it, and how many placeholder tokens it
    fills."""

    tokens: int
    key: bytes
    pixel_values: Tensor | None  # None: a video's, in `extra`
    extra: tuple[tuple[str, Tensor], ...] = ()
    run: tuple[int, ...] = ()  # its placeholder run when not image tokens alone (Pixtral's)
    # A video: its run replaces its whole anchor; its blocks of video tokens (ImageInput's).
    spans: tuple[tuple[int, int, int, int, int], ...] = ()
    video: bool = False
    grid: tuple[int, int, int] = (0, 0, 0)  # a video's (t, h, w)

    def input(self, offset: int, length: int) -> ImageInput:
        return ImageInput(offset, length, self.key, self.pixel_values, self.extra, self.spans)


def tensor(array: np.ndarray) -> Tensor:
    array = np.ascontiguousarray(array)
    return Tensor(array.tobytes(), tuple(array.shape), array.dtype.name)


def image_key(pixel_values: Tensor | None, extra: Sequence[tuple[str, Tensor]] = ()) -> bytes:
    """What the encoder gets, hashed: equal keys give equal features."""
    digest = hashlib.blake2b(digest_size=KEY_BYTES)
    given = (("pixel_values", pixel_values),) if pixel_values is not None else ()
    for name, t in (*given, *extra):
        digest.update(f"{name}:{t.dtype}:{t.shape};".encode())
        digest.update(t.data)
    return digest.digest()


def expand(
    prompt: list[int], spec: VisionSpec, images: Sequence[ProcessedImage]
) -> tuple[list[int], tuple[ImageInput, ...]]:
    """`prompt` with its image (and video) anchors, in order, replaced by the items'
    placeholder runs; the items with their offsets there. One anchor per item, of its kind,
    or INVALID_ARGUMENT."""
    anchors = {False: list(spec.anchor)}
    if spec.video is not None:
        anchors[True] = list(spec.video.anchor)
    media, items = ("media", "items") if spec.video is not None else ("image", "images")
    out: list[int] = []
    placed: list[ImageInput] = []
    i = 0
    while i < len(prompt):
        video = next((v for v, a in anchors.items() if prompt[i : i + len(a)] == a), None)
        if video is not None:
            if len(placed) == len(images):
                raise _invalid(
                    f"the prompt has more {media} anchors than its {len(images)} {items}"
                )
            image = images[len(placed)]
            if image.video != video:
                kinds = ("an image", "a video")
                raise _invalid(
                    f"media {len(placed)} is {kinds[image.video]}, but its anchor in the "
                    f"prompt is {kinds[video]}'s"
                )
            run = image.run or (spec.image_token_id,) * image.tokens
            before, after = ((), ()) if video else (spec.before, spec.after)
            placed.append(image.input(len(out) + len(before), len(run)))
            out += [*before, *run, *after]
            i += len(anchors[video])
        else:
            out.append(prompt[i])
            i += 1
    if len(placed) != len(images):
        raise _invalid(
            f"the prompt has {len(placed)} {media} anchors for {len(images)} {items}; "
            "each needs its own in the prompt, where the chat template puts it"
        )
    if placed and placed[-1].end >= len(out):
        raise _invalid("the prompt ends inside an image: put text after the last image")
    return out, tuple(placed)


MM_PROCESSOR = "mlx-grpc-worker"  # any non-empty name: the router then sends media references


def media_info(preparer: ImagePreparer | None) -> dict[str, str]:
    """GetServerInfo's media fields: the worker processes images itself, from these URL
    schemes, this many a request (empty for a text model)."""
    if preparer is None:
        return {}
    policy = preparer.policy
    schemes = ["data"]
    if policy.allowed_hosts:
        schemes += ["http", "https"]
    if policy.media_dir is not None:
        schemes.append("file")
    limits = f"image={policy.max_images}"
    if preparer.spec.video is not None:
        limits += f",video={policy.max_videos}"
    return {
        "mm_processor": MM_PROCESSOR,
        "mm_media_ref_schemes": ",".join(schemes),
        "mm_item_limits": limits,
    }


def has_media(request: Any) -> bool:
    """Whether a vLLM-face request carries images (the MLX face has no media fields)."""
    if "media_refs" not in request.DESCRIPTOR.fields_by_name:
        return False
    return bool(request.media_refs.items or request.mm_inputs.ByteSize())


class ImagePreparer:
    """Fetches and processes a request's images off the event loop (its own small pool)."""

    def __init__(self, model_dir: Path, spec: VisionSpec, policy: MediaPolicy) -> None:
        self.spec = spec
        self.policy = policy
        self._pool = ThreadPoolExecutor(POOL_SIZE, thread_name_prefix="images")
        self._processor = _processor(model_dir, spec)
        self.patch_width = _patch_width(self._processor)  # a flattened patch's values
        self._videos = VideoPreparer(model_dir, spec.video, policy) if spec.video else None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def prepare(self, request: Any, known: Mapping[str, bytes] | None = None) -> ExpandImages:
        """The request's images, ready to go into its prompt: its media references fetched
        and processed here (their anchors to `expand`), or the router's mm_inputs (their
        runs already in the prompt, to `place`) where the family is the router's to process.
        `known`: keys of images by the router's hash, for mm_inputs without pixels (a PD
        decode, whose prefill worker encoded them)."""
        if request.mm_inputs.ByteSize() or request.extra_mm_inputs:
            groups = [request.mm_inputs, *request.extra_mm_inputs]
            video = self.spec.video is not None and any(
                g.modality == VIDEO_MODALITY for g in groups
            )
            if not self.spec.router_processed and not video:
                raise _invalid(
                    "this worker processes images itself: it takes them as media references "
                    "(the router's --mm-processing auto or worker), not as mm_inputs"
                )
            if request.media_refs.items or (request.extra_mm_inputs and not video):
                raise _invalid(
                    "a request's images come as one mm_inputs or as media references, not both"
                )
            sent = await asyncio.get_running_loop().run_in_executor(
                self._pool, self.router_media, groups, known or {}
            )
            return functools.partial(place, sent=sent, image_token=self.spec.image_token_id)
        images = await self._media(request)
        return functools.partial(expand, spec=self.spec, images=images)

    def router_images(self, mm: Any, known: Mapping[str, bytes] | None = None) -> RouterImages:
        if not mm.HasField("pixel_values") and known:
            return _encoded_images(mm, self.spec, known, self.policy.max_images)
        return router_images(mm, self.spec, self.patch_width, self.policy.max_images)

    def router_media(
        self, groups: list[Any], known: Mapping[str, bytes] | None = None
    ) -> tuple[RouterImages, ...]:
        """The router's mm_inputs (and extra_mm_inputs: a video beside images), each group
        images or videos."""
        return tuple(
            router_videos(mm, self.spec.video, self.policy)
            if mm.modality == VIDEO_MODALITY and self.spec.video is not None
            else self.router_images(mm, known)
            for mm in groups
        )

    async def _media(self, request: Any) -> list[ProcessedImage]:
        refs = list(request.media_refs.items)
        served = (IMAGE_MODALITY, VIDEO_MODALITY) if self._videos else (IMAGE_MODALITY,)
        for i, ref in enumerate(refs):
            if ref.modality not in served:
                what = "images and videos are" if self._videos else "only images are"
                raise _invalid(f"media {i}: {what} served (modality {ref.modality})")
        videos = frozenset(i for i, r in enumerate(refs) if r.modality == VIDEO_MODALITY)
        try:
            decoded = await fetch_images(
                [r.url for r in refs], self.policy, executor=self._pool, videos=videos
            )
        except MediaError as error:
            raise RequestError(error.status, str(error)) from None
        loop = asyncio.get_running_loop()
        jobs = [
            loop.run_in_executor(self._pool, self._videos.process, i, d)
            if isinstance(d, bytes) and self._videos is not None
            else loop.run_in_executor(self._pool, self._process, i, d.image)
            for i, d in enumerate(decoded)
        ]
        return list(await asyncio.gather(*jobs))

    def _process(self, index: int, image: Any) -> ProcessedImage:
        spec = self.spec
        if spec.anchor_text is not None:
            return self._expanded_by_processor(index, image, spec.anchor_text)
        try:
            if spec.cell:  # sized to whole cells of merged patches, as Pixtral's processor does
                cell = {"height": spec.cell, "width": spec.cell}
                out = self._processor(images=[image], return_tensors="np", patch_size=cell)
            else:
                out = self._processor(images=[image], return_tensors="np")
            extra: tuple[tuple[str, Tensor], ...] = ()
            run: tuple[int, ...] = ()
            grid = out.get("image_grid_thw")
            if grid is not None:
                grid = np.asarray(grid, dtype=np.int64).reshape(1, 3)
                extra = (("image_grid_thw", tensor(grid)),)
            sizes = out.get("image_sizes")
            if spec.cell and sizes is not None:
                sizes = np.asarray(sizes, dtype=np.int64).reshape(1, 2)
                extra = (("image_sizes", tensor(sizes)),)
                run = spec.rows_run(int(sizes[0, 0]), int(sizes[0, 1]))
            tokens = len(run) if run else spec.tokens(None if grid is None else grid[0].tolist())
        except Exception as exc:
            raise _invalid(f"image {index}: the model's processor refused it: {exc}") from None
        pixels = tensor(np.asarray(out["pixel_values"]))
        return ProcessedImage(tokens, image_key(pixels, extra), pixels, extra, run)

    def _expanded_by_processor(self, index: int, image: Any, anchor: str) -> ProcessedImage:
        """The image as the processor expands one anchor for it: the ids it makes are the
        image's run; every tensor it makes but the ids and mask goes to the encoder."""
        try:
            out = self._processor(
                text=anchor, images=[image], return_tensors="np", add_special_tokens=False
            )
            run = tuple(int(t) for t in np.asarray(out["input_ids"]).reshape(-1))
            if self.spec.image_token_id not in run:
                raise ValueError("the processor put no image token in its expansion")
            extra = tuple(
                (name, tensor(np.asarray(value)))
                for name, value in sorted(out.items())
                if name not in ("input_ids", "attention_mask", "pixel_values")
            )
            pixels = tensor(np.asarray(out["pixel_values"]))
        except Exception as exc:
            raise _invalid(f"image {index}: the model's processor refused it: {exc}") from None
        return ProcessedImage(len(run), image_key(pixels, extra), pixels, extra, run)


class VideoPreparer:
    """A request's videos as the encoder takes them (servicer/video.py), in the handler's
    pool: decoded within the policy's bounds, sampled and patched as the checkpoint's video
    processor does, and their runs (Qwen3-VL's timestamps tokenized by the checkpoint's
    tokenizer)."""

    def __init__(self, model_dir: Path, spec: VideoSpec, policy: MediaPolicy) -> None:
        self.spec, self.policy = spec, policy
        self.settings = VideoSettings.from_dir(model_dir)
        self._tokenizer = None
        if spec.layout == "timestamped":
            import transformers

            self._tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))

    @functools.lru_cache(maxsize=4096)  # noqa: B019 (one preparer a worker)
    def label(self, seconds: float) -> tuple[int, ...]:
        text = timestamp_text(seconds)
        return tuple(self._tokenizer.encode(text, add_special_tokens=False))

    def process(self, index: int, raw: bytes) -> ProcessedImage:
        settings, spec = self.settings, self.spec
        try:
            sampled = decode_video(raw, self.policy, settings, spec.layout)
            pixels, grid = video_patches(sampled.frames, settings)
        except VideoRefused as refused:
            status = grpc_status("limit" if refused.code == "limit" else "invalid")
            raise RequestError(status, f"video {index}: {refused}") from None
        labels = []
        if spec.layout == "timestamped":
            seconds = group_seconds(sampled.indices, sampled.fps, settings.temporal_patch_size)
            labels = [list(self.label(s)) for s in seconds]
        return processed_video(spec, pixels, grid, labels)


def processed_video(
    spec: VideoSpec, pixels: np.ndarray, grid: tuple[int, int, int], labels: list[list[int]]
) -> ProcessedImage:
    """A video's patches and grid as the encoder takes them, named by their hash."""
    extra = (
        ("pixel_values_videos", tensor(pixels)),
        ("video_grid_thw", tensor(np.asarray([grid], dtype=np.int64))),
    )
    run, spans = video_run(spec, grid, labels)
    key = image_key(None, extra)
    return ProcessedImage(len(run), key, None, extra, run, spans, True, tuple(grid))


def _processor(model_dir: Path, spec: VisionSpec) -> Any:
    """The checkpoint's own image processor (a spec with `anchor_text`: its processor,
    tokenizer included, or the class the spec names), the numpy/PIL build (no torch, no MLX)."""
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    import transformers

    if spec.anchor_text is None:
        return transformers.AutoImageProcessor.from_pretrained(str(model_dir), backend="pil")
    return spec.fixed(_expanding_processor(model_dir, spec))


def _expanding_processor(model_dir: Path, spec: VisionSpec) -> Any:
    """The processor that expands the anchor, before the spec's `processor_fix`."""
    import transformers

    if spec.processor_class is not None:  # a transformers class, or "module:Class"
        module, _, name = spec.processor_class.rpartition(":")
        if module.startswith("mlx_vlm."):  # mlx-vlm's own, run without MLX
            from .vlm_modules import mlx_vlm_module

            kind = getattr(mlx_vlm_module(module), name)
        else:
            kind = getattr(importlib.import_module(module) if module else transformers, name)
        return kind.from_pretrained(str(model_dir), backend="pil")
    try:
        return transformers.AutoProcessor.from_pretrained(str(model_dir), backend="pil")
    except ImportError:  # a part needs torch (a video processor): the rest, without it
        return _processor_without_torch(model_dir)


def _processor_without_torch(model_dir: Path) -> Any:
    """The checkpoint's processor with the parts that need torch left out (None): its image
    processor the PIL one, its tokenizer, and any other part that loads without torch."""
    import transformers
    from transformers.models.auto import processing_auto

    config = json.loads((model_dir / "processor_config.json").read_text(encoding="utf-8"))
    base = processing_auto.processor_class_from_name(config.get("processor_class", ""))
    if base is None:
        raise ImportError("the checkpoint's processor_config.json names no known processor")

    class Partial(base):
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if argument is not None:
                return super().check_argument_for_proper_class(argument_name, argument)
            return None

    autos = {"image_processor": "AutoImageProcessor", "tokenizer": "AutoTokenizer"}
    autos |= {"feature_extractor": "AutoFeatureExtractor", "video_processor": "AutoVideoProcessor"}
    parts: dict[str, Any] = {}
    for attribute in base.get_attributes():
        backend = {"backend": "pil"} if attribute == "image_processor" else {}
        try:
            auto = getattr(transformers, autos[attribute])
            parts[attribute] = auto.from_pretrained(str(model_dir), **backend)
        except (ImportError, KeyError, ValueError, OSError):
            parts[attribute] = None
    if parts.get("tokenizer") is None or parts.get("image_processor") is None:
        raise ImportError(f"{base.__name__}'s tokenizer or image processor needs torch")
    fields = {k: v for k, v in config.items() if k not in parts and not isinstance(v, dict)}
    fields.pop("processor_class", None)
    return Partial(**parts, **fields)


def _patch_width(processor: Any) -> int | None:
    """The values of one flattened patch a patch-grid processor makes (channels x frames x
    patch x patch, Qwen2-VL's), None for other processors."""
    sizes = [getattr(processor, n, None) for n in ("temporal_patch_size", "patch_size")]
    if not all(isinstance(v, int) for v in sizes):
        return None
    frames, patch = sizes
    return 3 * frames * patch * patch


# ----- the router's mm_inputs -----

# TensorData dtype names (as the router writes them, or numpy's) -> what the bytes are.
_FLOATS = {"float32": "<f4", "fp32": "<f4", "f32": "<f4", "float16": "<f2", "fp16": "<f2"}
_FLOATS |= {"f16": "<f2", "half": "<f2", "bfloat16": "bf16", "bf16": "bf16"}
_INTS = {"int64": "<i8", "i64": "<i8", "long": "<i8", "int32": "<i4", "i32": "<i4"}


@dataclass(frozen=True)
class RouterImages:
    """A request's images as the router sent them: processed, and where their placeholder
    runs are in its prompt, filled with `token_id`."""

    images: tuple[ProcessedImage, ...]
    placeholders: tuple[tuple[int, int], ...]  # (offset, length) per image
    token_id: int
    # Videos: each placeholder holds the video's blocks of `token_id` with text between
    # (Qwen3-VL's timestamps), `merge` the tower's spatial merge.
    video_merge: int = 0


def _array(name: str, data: Any, kinds: dict[str, str]) -> np.ndarray:
    """A TensorData's array: inline bytes only (the worker reads no shared memory or remote
    handle), of a dtype in `kinds`, as many bytes as its shape says (bfloat16 as float32,
    exactly)."""
    payload = data.WhichOneof("payload")
    if payload != "inline":
        raise _invalid(
            f"mm_inputs {name}: only inline tensors are accepted, not "
            f"{payload or 'no payload'} (turn off the router's shared-memory transfer)"
        )
    dtype = kinds.get(data.dtype.lower().removeprefix("torch."))
    if dtype is None:
        raise _invalid(f"mm_inputs {name}: dtype {data.dtype!r} is not one of {sorted(kinds)}")
    shape = tuple(int(n) for n in data.shape)
    size = 2 if dtype == "bf16" else np.dtype(dtype).itemsize
    if len(data.inline) != math.prod(shape) * size:
        raise _invalid(
            f"mm_inputs {name}: {len(data.inline)} bytes for shape {list(shape)} of {data.dtype}"
        )
    if dtype == "bf16":
        bits = np.frombuffer(data.inline, "<u2").astype(np.uint32) << 16
        return bits.view(np.float32).reshape(shape)
    return np.frombuffer(data.inline, dtype).reshape(shape)


def router_images(
    mm: Any, spec: VisionSpec, patch_width: int | None, max_images: int
) -> RouterImages:
    """The images of the router's `mm_inputs`: the concatenated pixel values (a row a patch)
    split per image by its patch grid (`image_grid_thw`), each image's key our own hash of
    its inputs; anything that does not add up is INVALID_ARGUMENT naming the image."""
    if mm.modality not in (0, IMAGE_MODALITY):
        raise _invalid(f"mm_inputs: only images are served (modality {mm.modality})")
    if spec.tokens_per_image is not None:
        return _whole_images(mm, spec, max_images)
    if not mm.HasField("pixel_values") or "image_grid_thw" not in mm.model_specific_tensors:
        raise _invalid("mm_inputs needs pixel_values and model_specific_tensors image_grid_thw")
    pixels = _array("pixel_values", mm.pixel_values, _FLOATS)
    grids = _array("image_grid_thw", mm.model_specific_tensors["image_grid_thw"], _INTS)
    if grids.ndim != 2 or grids.shape[1] != 3:
        raise _invalid(f"mm_inputs image_grid_thw: shape {list(grids.shape)}, not [images, 3]")
    count = grids.shape[0]
    _check_count(mm, count, max_images)
    patches = [int(np.prod(g)) for g in grids]
    width = patch_width if patch_width is not None else (pixels.shape[-1] if pixels.ndim else 0)
    if pixels.ndim != 2 or pixels.shape != (sum(patches), width):
        raise _invalid(
            f"mm_inputs pixel_values: shape {list(pixels.shape)}, not [{sum(patches)}, {width}] "
            "(the patches of every image's grid, a row each)"
        )
    token = _image_token(mm, spec)
    images, start = [], 0
    for i, (grid, n) in enumerate(zip(grids, patches, strict=True)):
        try:
            tokens = spec.tokens(grid.tolist())
        except ValueError as exc:
            raise _invalid(f"image {i}: {exc}") from None
        values = tensor(pixels[start : start + n].astype(pixels.dtype, copy=False))
        extra = (("image_grid_thw", tensor(grid.astype(np.int64).reshape(1, 3))),)
        images.append(ProcessedImage(tokens, image_key(values, extra), values, extra))
        start += n
    placeholders = tuple((int(p.offset), int(p.length)) for p in mm.mm_placeholders)
    return RouterImages(tuple(images), placeholders, token)


def _encoded_images(
    mm: Any, spec: VisionSpec, known: Mapping[str, bytes], max_images: int
) -> RouterImages:
    """The router's images without their pixels (its PD decode leg): each one's key as the
    prefill worker named it (`known`, by the router's hash), its run from its grid. The
    engine can only serve them from the prefill's blocks, which run past them."""
    hashes = list(mm.mm_hashes)
    _check_count(mm, len(hashes), max_images)
    if any(h not in known for h in hashes):
        raise _invalid("mm_inputs without pixel_values, of images the prefill did not name")
    grids = None
    if "image_grid_thw" in mm.model_specific_tensors:
        grids = _array("image_grid_thw", mm.model_specific_tensors["image_grid_thw"], _INTS)
        if grids.shape != (len(hashes), 3):
            raise _invalid(f"mm_inputs image_grid_thw: shape {list(grids.shape)}")
    images = []
    for i, mm_hash in enumerate(hashes):
        try:
            tokens = spec.tokens_per_image or spec.tokens(grids[i].tolist())  # type: ignore[index]
        except (ValueError, TypeError) as exc:
            raise _invalid(f"image {i}: {exc}") from None
        extra = () if grids is None else (("image_grid_thw", tensor(grids[i].reshape(1, 3))),)
        images.append(ProcessedImage(tokens, known[mm_hash], None, extra))
    placeholders = tuple((int(p.offset), int(p.length)) for p in mm.mm_placeholders)
    return RouterImages(tuple(images), placeholders, _image_token(mm, spec))


def _check_count(mm: Any, count: int, max_images: int) -> None:
    """`mm_inputs` holds `count` images: at most `max_images`, a placeholder each."""
    if count > max_images:
        too_many = f"too many images: {count} in the request, limit {max_images}"
        raise RequestError(grpc_status("limit"), too_many)
    if len(mm.mm_placeholders) != count:
        raise _invalid(f"mm_inputs has {len(mm.mm_placeholders)} placeholders for {count} images")


def _image_token(mm: Any, spec: VisionSpec) -> int:
    """The image token `mm_inputs` names (the model's own by default): one of the model's."""
    token = mm.im_token_id if mm.HasField("im_token_id") else spec.image_token_id
    if token not in (spec.image_token_id, *spec.placeholder_ids):
        raise _invalid(f"mm_inputs im_token_id {token} is not this model's image token")
    return token


def _whole_images(mm: Any, spec: VisionSpec, max_images: int) -> RouterImages:
    """The router's images for a family of fixed-size images (LLaVA's): pixel values
    [images, channels, height, width], a run of `tokens_per_image` each."""
    if not mm.HasField("pixel_values"):
        raise _invalid("mm_inputs needs pixel_values")
    pixels = _array("pixel_values", mm.pixel_values, _FLOATS)
    if pixels.ndim != 4 or pixels.shape[1] != 3:
        raise _invalid(f"mm_inputs pixel_values: shape {list(pixels.shape)}, not [images, 3, h, w]")
    count = pixels.shape[0]
    _check_count(mm, count, max_images)
    token = _image_token(mm, spec)
    images = []
    for i in range(count):
        values = tensor(pixels[i : i + 1])
        images.append(ProcessedImage(spec.tokens_per_image or 0, image_key(values), values))
    placeholders = tuple((int(p.offset), int(p.length)) for p in mm.mm_placeholders)
    return RouterImages(tuple(images), placeholders, token)


def place(
    prompt: list[int], sent: Sequence[RouterImages], image_token: int
) -> tuple[list[int], tuple[ImageInput, ...]]:
    """The router's images (and videos) at their placeholders in `prompt` (already
    expanded): each image's placeholder a run of exactly its image's tokens, each video's
    blocks of video tokens its grid's, in order, and no such token elsewhere; otherwise
    INVALID_ARGUMENT naming the item. The image runs come back filled with the model's
    `image_token` whatever the router filled them with: the model's merge looks for it."""
    placed: list[ImageInput] = []
    for group in sent:
        placed += _placed(prompt, group)
    placed.sort(key=lambda item: item.offset)
    for before, after in itertools.pairwise(placed):
        if after.offset < before.end:
            raise _invalid(
                f"placeholders ({before.offset}, {before.length}) and "
                f"({after.offset}, {after.length}) overlap"
            )
    if placed and placed[-1].end >= len(prompt):
        raise _invalid("the prompt ends inside an image: put text after the last image")
    fills = {g.token_id for g in sent if not g.video_merge and g.token_id != image_token}
    if fills:
        prompt = [image_token if t in fills else t for t in prompt]
    return prompt, tuple(placed)


def _placed(prompt: list[int], sent: RouterImages) -> list[ImageInput]:
    kind = "video" if sent.video_merge else "image"
    placed: list[ImageInput] = []
    end = counted = 0
    for i, ((offset, length), image) in enumerate(zip(sent.placeholders, sent.images, strict=True)):
        if offset < end or offset + length > len(prompt) or length < 1:
            raise _invalid(
                f"{kind} {i}: placeholder ({offset}, {length}) overlaps the one before or runs "
                f"past the prompt's {len(prompt)} tokens"
            )
        run = prompt[offset : offset + length]
        if sent.video_merge:
            spans = _video_blocks(i, run, sent.token_id, image, sent.video_merge)
            placed.append(replace(image, spans=spans).input(offset, length))
            counted += sum(n for _, n, *_ in spans)
        else:
            if length != image.tokens:
                raise _invalid(
                    f"image {i}: its placeholder has {length} tokens, its patch grid makes "
                    f"{image.tokens}"
                )
            if any(t != sent.token_id for t in run):
                raise _invalid(
                    f"image {i}: placeholder ({offset}, {length}) is not a run of image tokens "
                    f"({sent.token_id}) in the prompt"
                )
            placed.append(image.input(offset, length))
            counted += length
        end = offset + length
    if prompt.count(sent.token_id) != counted:
        raise _invalid(f"the prompt has {kind} tokens ({sent.token_id}) outside its placeholders")
    return placed


def _video_blocks(
    index: int, run: list[int], token: int, video: ProcessedImage, merge: int
) -> tuple[tuple[int, int, int, int, int], ...]:
    """The blocks of video tokens in a video's placeholder run: one per temporal patch
    (Qwen3-VL's, a grid (1, h, w) each) or one for the whole grid (t, h, w)."""
    t, h, w = video.grid
    flags = np.asarray(run) == token
    edges = np.flatnonzero(np.diff(np.concatenate([[0], flags.astype(np.int8), [0]])))
    blocks = [(int(a), int(b - a)) for a, b in zip(edges[::2], edges[1::2], strict=True)]
    per_frame = h * w // merge**2
    if len(blocks) == t and all(n == per_frame for _, n in blocks):
        return tuple((at, n, 1, h, w) for at, n in blocks)
    if len(blocks) == 1 and blocks[0][1] == t * per_frame:
        return ((blocks[0][0], blocks[0][1], t, h, w),)
    raise _invalid(
        f"video {index}: its placeholder holds blocks of {[n for _, n in blocks]} video tokens; "
        f"its grid {(t, h, w)} makes {t} of {per_frame}"
    )


def router_videos(mm: Any, spec: VideoSpec, policy: MediaPolicy) -> RouterImages:
    """The videos of the router's `mm_inputs` (modality VIDEO: Qwen3-VL's frames as the
    router sampled them): pixel values a row a patch, split per video by `video_grid_thw`,
    each video's key our own hash of them; frames counted against the policy."""
    if not mm.HasField("pixel_values") or "video_grid_thw" not in mm.model_specific_tensors:
        raise _invalid(
            "video mm_inputs needs pixel_values and model_specific_tensors video_grid_thw"
        )
    pixels = _array("pixel_values", mm.pixel_values, _FLOATS)
    grids = _array("video_grid_thw", mm.model_specific_tensors["video_grid_thw"], _INTS)
    if grids.ndim != 2 or grids.shape[1] != 3 or min(grids.shape) < 1 or grids.min() < 1:
        raise _invalid(f"mm_inputs video_grid_thw: shape {list(grids.shape)}, not [videos, 3]")
    if grids.shape[0] > policy.max_videos:
        too_many = f"too many videos: {grids.shape[0]} in the request, limit {policy.max_videos}"
        raise RequestError(grpc_status("limit"), too_many)
    if len(mm.mm_placeholders) != grids.shape[0]:
        raise _invalid(
            f"mm_inputs has {len(mm.mm_placeholders)} placeholders for {grids.shape[0]} videos"
        )
    patches = [int(np.prod(g)) for g in grids]
    if pixels.ndim != 2 or pixels.shape[0] != sum(patches):
        raise _invalid(
            f"mm_inputs pixel_values: shape {list(pixels.shape)}, not [{sum(patches)}, width] "
            "(the patches of every video's grid, a row each)"
        )
    token = mm.im_token_id if mm.HasField("im_token_id") else spec.video_token_id
    if token != spec.video_token_id:
        raise _invalid(f"mm_inputs im_token_id {token} is not this model's video token")
    videos, start = [], 0
    for i, (grid, n) in enumerate(zip(grids, patches, strict=True)):
        t, h, w = (int(v) for v in grid)
        if h % spec.merge or w % spec.merge:
            raise _invalid(
                f"video {i}: the patch grid {(t, h, w)} does not fit a {spec.merge}x merge"
            )
        if 2 * t > policy.max_video_frames:  # two frames a temporal patch
            raise RequestError(
                grpc_status("limit"),
                f"video {i}: too many frames: {2 * t}, limit {policy.max_video_frames}",
            )
        values = pixels[start : start + n].astype(np.float32, copy=False)
        videos.append(processed_video(spec, values, (t, h, w), []))
        start += n
    placeholders = tuple((int(p.offset), int(p.length)) for p in mm.mm_placeholders)
    return RouterImages(tuple(videos), placeholders, token, spec.merge)
