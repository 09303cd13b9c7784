"""A vision-language model's image side (engine thread only): mlx-vlm's vision tower and
projector compute each image's features, kept by image key in a bounded cache, and a prefill
chunk's input embeddings carry them in the images' placeholder runs.

The language model stays mlx-lm's (it loads a VLM checkpoint's text stack for the families
here), so an image row prefills and decodes in the same batch, caches and prefix store as a
text row: only its chunks that cover image tokens go in as embeddings. Qwen2-VL's text model
also needs its images' positions (multimodal RoPE, mrope): the encoder enables them on the
text model at load, and each image row carries its prompt's ids and rope delta (`RowRope`).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from ..messages import GenerationRequest, ImageInput, Tensor
from ..vision_families import family_of
from .mrope import RopePositions, enable_mrope, rope_index

log = logging.getLogger(__name__)

DEFAULT_ENCODER_CACHE_BYTES = 256 << 20


class VisionUnavailable(ValueError):
    """The checkpoint's images cannot be served (why, for the start-up error)."""


def to_mx(tensor: Tensor) -> mx.array:
    array = np.frombuffer(tensor.data, dtype=np.dtype(tensor.dtype)).reshape(tensor.shape)
    return mx.array(array)


@dataclass(frozen=True, slots=True)
class RowRope:
    """An image row's multimodal RoPE: the (t, h, w) ids of its whole prompt [3, L] (a
    prefill chunk takes its columns) and its delta (the positions from the prompt's end on
    are the cache index plus it)."""

    ids: np.ndarray
    delta: int


@dataclass(slots=True)
class _Entry:
    features: mx.array
    nbytes: int


class VisionEncoder:
    """Image features by image key, and input embeddings with them in place."""

    def __init__(
        self,
        vlm: Any,
        image_token_id: int,
        cache_bytes: int = DEFAULT_ENCODER_CACHE_BYTES,
        rope: RopePositions | None = None,
        merge: int = 1,
    ) -> None:
        self._vlm = vlm
        self.image_token_id = image_token_id
        self.cache_bytes = cache_bytes
        self.rope = rope  # the text model's multimodal RoPE (None: standard positions)
        self.merge = merge  # the vision tower's spatial merge (image tokens per grid cell)
        self._cache: OrderedDict[bytes, _Entry] = OrderedDict()
        self._ahead: dict[bytes, mx.array] = {}  # encoded for a request not admitted yet
        self._held = 0
        self.encoded = 0  # images put through the encoder
        self._encoded_taken = 0  # of them, reported by `take_encoded`

    @classmethod
    def load(cls, model_dir: Path, text_model: Any, cache_bytes: int) -> VisionEncoder:
        """mlx-vlm's model of the checkpoint without its language layers (the text model,
        mlx-lm's, has them), its token embedding shared with `text_model`'s; for a family
        with multimodal RoPE, the text model's attentions take it from here on."""
        try:
            from mlx_vlm.utils import load_config, load_model
        except ImportError as exc:
            raise VisionUnavailable(
                "serving images needs mlx-vlm: pip install 'mlx-grpc-worker[vision]'"
            ) from exc
        config = load_config(model_dir)
        family = family_of(config)
        if family is None:
            model_type = config.get("model_type", "")
            raise VisionUnavailable(f"images are not supported for model type {model_type!r} yet")
        image_token_id = config.get("image_token_index", config.get("image_token_id"))
        if not isinstance(image_token_id, int):
            raise VisionUnavailable("the model's config names no image token")
        rope, merge = None, 1
        if family.positions == "mrope":
            merge = int((config.get("vision_config") or {}).get("spatial_merge_size", 2))
            try:
                rope = enable_mrope(text_model)
            except ValueError as exc:
                raise VisionUnavailable(str(exc)) from exc
        try:
            vlm = load_model(model_dir, lazy=True)
        except Exception as exc:
            raise VisionUnavailable(f"mlx-vlm could not load {model_dir}: {exc}") from exc
        language = vlm.language_model
        stack = getattr(language, "model", language)  # mlx-vlm's flat stacks (Idefics3's)
        stack.layers = []  # the text model's own run; never loaded twice
        language.pop("lm_head", None)
        embed = _embedding_of(text_model)
        if embed is not None:
            stack.embed_tokens = embed
        mx.eval(vlm.parameters())
        return cls(vlm, image_token_id, cache_bytes, rope, merge)

    def row_rope(self, request: GenerationRequest) -> RowRope | None:
        """The request's multimodal RoPE, from its whole prompt (a row that starts from a
        cached prefix takes its ids from there on); None: standard positions (a model
        without mrope, or a prompt without images)."""
        if self.rope is None or not request.images:
            return None
        spans = [(i.offset, i.length, image_grid(i)) for i in request.images]
        ids, delta = rope_index(request.prompt, spans, self.merge)
        return RowRope(ids, delta)

    @property
    def tower(self) -> Any:
        """mlx-vlm's vision tower (its transformer layers are what `encoding` stages)."""
        names = ("vision_tower", "visual", "vision_model")  # mlx-vlm's names for it
        return next((getattr(self._vlm, name) for name in names if name in self._vlm), None)

    def has(self, key: bytes) -> bool:
        """Whether the image's features are at hand (encoded ahead, or in the cache)."""
        return key in self._ahead or key in self._cache

    def features(self, image: ImageInput, run: list[int]) -> mx.array:
        """The embeddings of the image's placeholder run `run` ([length, hidden]), as the
        model's own merge puts them there (a run may hold more than image tokens: Pixtral's
        row breaks): encoded ahead, from the cache, or computed now."""
        ahead = self._ahead.pop(image.key, None)
        if ahead is not None:
            return ahead
        entry = self._cache.get(image.key)
        if entry is not None:
            self._cache.move_to_end(image.key)
            return entry.features
        features = self.lazy_features(image, run)
        mx.eval(features)
        self.keep(image, features, ahead=False)
        return features

    def lazy_features(self, image: ImageInput, run: list[int]) -> mx.array:
        """The image's features as a graph not yet evaluated (checked for their count)."""
        ids = mx.array([run], dtype=mx.int32)
        extra = {name: to_mx(tensor) for name, tensor in image.extra}
        merged = self._vlm.get_input_embeddings(
            ids, to_mx(image.pixel_values), mask=mx.ones((1, image.length)), **extra
        )
        features = merged.inputs_embeds[0]
        if features.shape[0] != image.length:
            raise ValueError(
                f"the encoder made {features.shape[0]} image embeddings for {image.length} tokens"
            )
        return features

    def keep(self, image: ImageInput, features: mx.array, ahead: bool = True) -> None:
        """Computed features, in the bounded cache; encoded `ahead` of their request's
        admission, also held for it until `features` hands them over."""
        self.encoded += 1
        if ahead:
            self._ahead[image.key] = features
        self._keep(image.key, features)

    def take_encoded(self) -> int:
        """Images put through the encoder since the last call."""
        fresh, self._encoded_taken = self.encoded - self._encoded_taken, self.encoded
        return fresh

    def drop_ahead(self, keep: set[bytes]) -> None:
        """Forget features encoded ahead for requests no longer waiting (not in `keep`)."""
        for key in [k for k in self._ahead if k not in keep]:
            del self._ahead[key]

    def _keep(self, key: bytes, features: mx.array) -> None:
        nbytes = features.nbytes
        if nbytes > self.cache_bytes:
            return
        self._cache[key] = _Entry(features, nbytes)
        self._held += nbytes
        while self._held > self.cache_bytes:
            _, gone = self._cache.popitem(last=False)
            self._held -= gone.nbytes

    def embed(self, inputs: mx.array) -> mx.array:
        """Token embeddings of `inputs` ([batch, length]) as the model's merge starts them."""
        return self._vlm.get_input_embeddings(inputs).inputs_embeds


def image_grid(image: ImageInput) -> tuple[int, int, int]:
    """An image's patch grid (t, h, w), from its `image_grid_thw`."""
    for name, value in image.extra:
        if name == "image_grid_thw":
            grid = np.frombuffer(value.data, dtype=np.dtype(value.dtype)).reshape(-1)
            if grid.size == 3:
                t, h, w = (int(v) for v in grid)
                return t, h, w
    raise ValueError("an image of this model needs its image_grid_thw (t, h, w)")


def _embedding_of(text_model: Any) -> Any:
    """The token embedding module of an mlx-lm text model (None: not found where expected)."""
    for path in (("language_model", "model"), ("model",)):
        module = text_model
        for name in path:
            module = getattr(module, name, None)
        embed = getattr(module, "embed_tokens", None)
        if embed is not None:
            return embed
    log.info("the text model's token embedding was not found; the encoder keeps its own")
    return None


class ImageSpan:
    """One image of a row's prompt, its features once computed (the row holds them until its
    prefill is past the image)."""

    __slots__ = ("end", "features", "offset")

    def __init__(self, offset: int, end: int, features: mx.array) -> None:
        self.offset, self.end, self.features = offset, end, features


def chunk_embeddings(
    encoder: VisionEncoder,
    inputs: mx.array,
    starts: list[int],
    lengths: list[int],
    images: list[list[ImageSpan]],
) -> mx.array | None:
    """The input embeddings of a padded chunk whose row i covers prompt positions
    `starts[i]` to `starts[i] + lengths[i]` (None: no row's chunk touches an image)."""
    pieces = []
    for i, (start, n, spans) in enumerate(zip(starts, lengths, images, strict=True)):
        for span in spans:
            a, b = max(span.offset, start), min(span.end, start + n)
            if a < b:
                pieces.append((i, a - start, span.features[a - span.offset : b - span.offset]))
    if not pieces:
        return None
    h = encoder.embed(inputs)
    for i, at, features in pieces:
        h[i, at : at + features.shape[0]] = features.astype(h.dtype)
    return h


class ImageWork:
    """The images of the requests joining the batch: their features (a failure fails that
    request alone)."""

    def __init__(self, vision: VisionEncoder | None) -> None:
        self.vision = vision

    def spans(self, request: GenerationRequest, cached: int) -> list[ImageSpan]:
        """The request's images past its reused prefix, with their features (encoded ahead,
        from the encoder cache, or computed now)."""
        if not request.images:
            return []
        vision = self.vision
        if vision is None:
            raise ValueError("this engine serves no images")
        return [
            ImageSpan(
                image.offset, image.end, vision.features(image, placeholder_run(request, image))
            )
            for image in request.images
            if image.end > cached
        ]

    def rope(self, request: GenerationRequest) -> RowRope | None:
        return self.vision.row_rope(request) if self.vision is not None else None


def placeholder_run(request: GenerationRequest, image: ImageInput) -> list[int]:
    """The image's placeholder run in the request's prompt (what the encoder's merge fills)."""
    return request.prompt[image.offset : image.end]
