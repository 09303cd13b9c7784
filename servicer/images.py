"""Images of a request, handler side (no MLX): what a vision model's prompt looks like around
an image (`VisionSpec`, from its files), the fetch and the model's own image processor in a
thread pool (`ImagePreparer`), and the prompt with each image's anchor expanded into its
placeholder run (`expand`), each image named by a hash of exactly what the encoder gets.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from .media import POOL_SIZE, MediaError, MediaPolicy, fetch_images
from .messages import ImageInput, Tensor
from .validation import RequestError

log = logging.getLogger(__name__)

IMAGE_MODALITY = 1  # smg.grpc.common.Modality.IMAGE
KEY_BYTES = 16


def _invalid(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


@dataclass(frozen=True)
class VisionSpec:
    """How one image sits in a prompt of this model: the chat template renders `anchor` for
    it; the model's processor replaces that with `before` + `image_token_id` x n + `after`
    (n: `tokens_per_image`, fixed by the model)."""

    family: str
    image_token_id: int
    anchor: tuple[int, ...]
    before: tuple[int, ...]
    after: tuple[int, ...]
    tokens_per_image: int

    def run(self, n: int) -> list[int]:
        return [*self.before, *([self.image_token_id] * n), *self.after]


def vision_spec(config: dict[str, Any], tokenizer: Any) -> VisionSpec | None:
    """The spec of a vision-language checkpoint this worker can serve images for (None: a
    text model, or a family it cannot; `vision_refusal` says why)."""
    if not isinstance(config.get("vision_config"), dict):
        return None
    family = config.get("model_type", "")
    if family == "gemma3":
        return _gemma3_spec(config, tokenizer)
    return None


def vision_refusal(config: dict[str, Any]) -> str | None:
    """Why a checkpoint with a vision tower is served as text only (None: it is not)."""
    if not isinstance(config.get("vision_config"), dict):
        return None
    family = config.get("model_type", "")
    if family != "gemma3":
        return f"images are not supported for model type {family!r} yet; serving text only"
    import importlib.util

    if importlib.util.find_spec("mlx_vlm") is None:
        return "serving images needs mlx-vlm (pip install 'mlx-grpc-worker[vision]')"
    return None


def _gemma3_spec(config: dict[str, Any], tokenizer: Any) -> VisionSpec | None:
    boi = _token_id(tokenizer, "<start_of_image>", config.get("boi_token_index"))
    eoi = _token_id(tokenizer, "<end_of_image>", config.get("eoi_token_index"))
    image = config.get("image_token_index")
    count = config.get("mm_tokens_per_image") or (config.get("text_config") or {}).get(
        "mm_tokens_per_image"
    )
    if not all(isinstance(v, int) for v in (boi, eoi, image, count)):
        return None
    gap = tuple(tokenizer.encode("\n\n", add_special_tokens=False))
    return VisionSpec("gemma3", image, (boi,), (*gap, boi), (eoi, *gap), count)


def _token_id(tokenizer: Any, token: str, fallback: Any) -> int | None:
    found = tokenizer.convert_tokens_to_ids(token)
    if isinstance(found, int) and found != tokenizer.unk_token_id:
        return found
    return fallback if isinstance(fallback, int) else None


@dataclass(frozen=True)
class ProcessedImage:
    """One image as the encoder takes it, and how many placeholder tokens it fills."""

    tokens: int
    key: bytes
    pixel_values: Tensor
    extra: tuple[tuple[str, Tensor], ...] = ()


def tensor(array: np.ndarray) -> Tensor:
    array = np.ascontiguousarray(array)
    return Tensor(array.tobytes(), tuple(array.shape), array.dtype.name)


def image_key(pixel_values: Tensor, extra: Sequence[tuple[str, Tensor]] = ()) -> bytes:
    """What the encoder gets, hashed: equal keys give equal features."""
    digest = hashlib.blake2b(digest_size=KEY_BYTES)
    for name, t in (("pixel_values", pixel_values), *extra):
        digest.update(f"{name}:{t.dtype}:{t.shape};".encode())
        digest.update(t.data)
    return digest.digest()


def expand(
    prompt: list[int], spec: VisionSpec, images: Sequence[ProcessedImage]
) -> tuple[list[int], tuple[ImageInput, ...]]:
    """`prompt` with its image anchors, in order, replaced by the images' placeholder runs;
    the images with their offsets there. One anchor per image, or INVALID_ARGUMENT."""
    anchor, width = list(spec.anchor), len(spec.anchor)
    out: list[int] = []
    placed: list[ImageInput] = []
    i = 0
    while i < len(prompt):
        if prompt[i : i + width] == anchor:
            if len(placed) == len(images):
                raise _invalid(f"the prompt has more image anchors than its {len(images)} images")
            image = images[len(placed)]
            offset = len(out) + len(spec.before)
            out += spec.run(image.tokens)
            placed.append(
                ImageInput(offset, image.tokens, image.key, image.pixel_values, image.extra)
            )
            i += width
        else:
            out.append(prompt[i])
            i += 1
    if len(placed) != len(images):
        raise _invalid(
            f"the prompt has {len(placed)} image anchors for {len(images)} images; "
            "each image needs its own in the prompt, where the chat template puts it"
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
    return {
        "mm_processor": MM_PROCESSOR,
        "mm_media_ref_schemes": ",".join(schemes),
        "mm_item_limits": f"image={policy.max_images}",
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
        self._processor = _image_processor(model_dir)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def prepare(self, request: Any) -> list[ProcessedImage]:
        """The request's images (its media references), ready for `expand`."""
        if request.mm_inputs.ByteSize() or request.extra_mm_inputs:
            raise _invalid(
                "this worker processes images itself: it takes them as media references "
                "(the router's --mm-processing auto or worker), not as mm_inputs"
            )
        refs = list(request.media_refs.items)
        for i, ref in enumerate(refs):
            if ref.modality != IMAGE_MODALITY:
                raise _invalid(f"media {i}: only images are served (modality {ref.modality})")
        try:
            decoded = await fetch_images([r.url for r in refs], self.policy, executor=self._pool)
        except MediaError as error:
            raise RequestError(error.status, str(error)) from None
        loop = asyncio.get_running_loop()
        jobs = [
            loop.run_in_executor(self._pool, self._process, i, d.image)
            for i, d in enumerate(decoded)
        ]
        return list(await asyncio.gather(*jobs))

    def _process(self, index: int, image: Any) -> ProcessedImage:
        try:
            out = self._processor(images=[image], return_tensors="np")
        except Exception as exc:
            raise _invalid(f"image {index}: the model's processor refused it: {exc}") from None
        pixels = tensor(np.asarray(out["pixel_values"]))
        return ProcessedImage(self.spec.tokens_per_image, image_key(pixels), pixels)


def _image_processor(model_dir: Path) -> Any:
    """The checkpoint's own image processor, its numpy/PIL build (no torch, no MLX)."""
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(str(model_dir), backend="pil")
