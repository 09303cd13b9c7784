"""A vision-language model's image side (engine thread only): mlx-vlm's vision tower and
projector compute each image's features, kept by image key in a bounded cache, and a prefill
chunk's input embeddings carry them in the images' placeholder runs.

The language model stays mlx-lm's (it loads a VLM checkpoint's text stack for the families
here), so an image row prefills and decodes in the same batch, caches and prefix store as a
text row: only its chunks that cover image tokens go in as embeddings. Qwen2-VL's text model
also needs its images' positions (multimodal RoPE, mrope): the encoder enables them on the
text model at load, and each image row carries its prompt's ids and rope delta (`RowRope`).
Qwen3-VL's tower also makes deepstack features, added after the text model's first layers at
the image positions: an image's features then hold them too ([run, 1 + layers, hidden]), and
the layers, wrapped at load (`enable_deepstack`), add a prefill chunk's (`Deepstack`).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from ..messages import GenerationRequest, ImageInput, Tensor
from ..vision_families import family_of, fixed_model, rope_spans
from .mrope import RopePositions, enable_mrope, rope_index

log = logging.getLogger(__name__)

DEFAULT_ENCODER_CACHE_BYTES = 256 << 20


class VisionUnavailable(ValueError):
    """The checkpoint's images cannot be served (why, for the start-up error)."""


def to_mx(tensor: Tensor | None) -> mx.array | None:
    if tensor is None:  # a video's: in its extra inputs
        return None
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
        deepstack: Deepstack | None = None,
    ) -> None:
        self._vlm = vlm
        self.image_token_id = image_token_id
        self.cache_bytes = cache_bytes
        self.rope = rope  # the text model's multimodal RoPE (None: standard positions)
        self.merge = merge  # the vision tower's spatial merge (image tokens per grid cell)
        self.deepstack = deepstack  # the text layers taking deepstack features (None: none)
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
            vlm = fixed_model(config, load_model(model_dir, lazy=True))
        except Exception as exc:
            raise VisionUnavailable(f"mlx-vlm could not load {model_dir}: {exc}") from exc
        vision_config = getattr(vlm.config, "vision_config", None)
        count = len(getattr(vision_config, "deepstack_visual_indexes", None) or ())
        deepstack = enable_deepstack(text_model, count) if count else None
        language = vlm.language_model
        stack = getattr(language, "model", language)  # mlx-vlm's flat stacks (Idefics3's)
        stack.layers = []  # the text model's own run; never loaded twice
        language.pop("lm_head", None)
        owner = _embedding_owner(text_model)
        for name in ("embed_tokens", "embed_tokens_per_layer"):  # shared, not loaded twice
            if getattr(owner, name, None) is not None and name in stack:
                stack[name] = getattr(owner, name)
        if owner is not None and getattr(owner, "embed_tokens", None) is not None:
            _take_embeddings(text_model, owner.embed_tokens)
        mx.eval(vlm.parameters())
        encoder = cls(vlm, image_token_id, cache_bytes, rope, merge, deepstack)
        if owner is not None and getattr(owner, "embed_scale", 1.0) != 1.0:
            _take_scaled_embeddings(owner, encoder)
        return encoder

    def row_rope(self, request: GenerationRequest) -> RowRope | None:
        """The request's multimodal RoPE, from its whole prompt (a row that starts from a
        cached prefix takes its ids from there on); None: standard positions (a model
        without mrope, or a prompt without images)."""
        if self.rope is None or not request.images:
            return None
        spans = [span for image in request.images for span in rope_spans(image)]
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
        deep = getattr(merged, "deepstack_visual_embeds", None)
        if self.deepstack is not None and deep is not None and len(deep):
            at = mx.array(np.flatnonzero(np.array(merged.visual_pos_masks[0])), dtype=mx.uint32)
            full = mx.zeros((len(deep), *features.shape), dtype=features.dtype)
            full[:, at] = mx.stack(list(deep)).astype(features.dtype)
            features = mx.concatenate([features[None], full]).transpose(1, 0, 2)
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

    def embed(self, inputs: mx.array) -> dict[str, mx.array]:
        """The model's inputs for ids `inputs` ([batch, length]) as mlx-vlm's merge starts
        them: token embeddings, and per-layer inputs where it makes them (Gemma 4's)."""
        out = self._vlm.get_input_embeddings(inputs)
        per_layer = {"per_layer_inputs": getattr(out, "per_layer_inputs", None)}
        return {"input_embeddings": out.inputs_embeds} | {
            k: v for k, v in per_layer.items() if v is not None
        }


def _embedding_owner(text_model: Any) -> Any:
    """The module of an mlx-lm text model holding its token embedding (None: not found)."""
    for path in (("language_model", "model"), ("model",)):
        module = text_model
        for name in path:
            module = getattr(module, name, None)
        if getattr(module, "embed_tokens", None) is not None:
            return module
    log.info("the text model's token embedding was not found; the encoder keeps its own")
    return None


def _take_scaled_embeddings(owner: Any, encoder: VisionEncoder) -> None:
    """Where mlx-vlm's merge makes embeddings scaled by `embed_scale` (Gemma 4's, image features
    unscaled beside them), the text model takes given ones as they are (x 1.0, exactly)."""
    probe = mx.arange(8)[None]
    given = encoder.embed(probe)["input_embeddings"]
    if mx.array_equal(given, owner.embed_tokens(probe)).item():
        return
    base = type(owner)

    class TakesScaled(base):
        def __call__(self, inputs: Any = None, cache: Any = None, input_embeddings=None, **kw):
            if input_embeddings is None:
                return base.__call__(self, inputs, cache, **kw)
            scale, self.embed_scale = self.embed_scale, 1.0
            try:
                return base.__call__(self, inputs, cache, input_embeddings, **kw)
            finally:
                self.embed_scale = scale

    owner.__class__ = TakesScaled


def _take_embeddings(model: Any, embed: Any) -> None:
    """Give an mlx-lm text model whose call takes no `input_embeddings` that argument (GLM-4's):
    in such a forward its token embedding `embed` returns them (both classes swapped)."""
    if "input_embeddings" in inspect.signature(model.__call__).parameters:
        return
    given: list[mx.array] = []

    class Embedding(type(embed)):
        def __call__(self, x: mx.array) -> mx.array:
            return given[0] if given else super().__call__(x)

    class Model(type(model)):
        def __call__(self, inputs: mx.array, cache: Any = None, input_embeddings: Any = None):
            given[:] = [] if input_embeddings is None else [input_embeddings]
            try:
                return super().__call__(inputs, cache)
            finally:
                given.clear()

    embed.__class__, model.__class__ = Embedding, Model


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
) -> tuple[dict[str, mx.array] | None, contextlib.AbstractContextManager[Any]]:
    """The model's inputs (`embed`'s) for a padded chunk whose row i covers prompt positions
    `starts[i]` to `starts[i] + lengths[i]` (None: no row's chunk touches an image), and the
    forward's deepstack (its features at the chunk's image positions, zero elsewhere)."""
    pieces = []
    for i, (start, n, spans) in enumerate(zip(starts, lengths, images, strict=True)):
        for span in spans:
            a, b = max(span.offset, start), min(span.end, start + n)
            if a < b:
                pieces.append((i, a - start, span.features[a - span.offset : b - span.offset]))
    if not pieces:
        return None, contextlib.nullcontext()
    given = encoder.embed(inputs)
    h, deep = given["input_embeddings"], None
    for i, at, features in pieces:
        if features.ndim == 3:  # with deepstack features
            deep = mx.zeros((features.shape[1] - 1, *h.shape), h.dtype) if deep is None else deep
            deep[:, i, at : at + features.shape[0]] = features[:, 1:].transpose(1, 0, 2)
            features = features[:, 0]
        h[i, at : at + features.shape[0]] = features.astype(h.dtype)
    # Features with deepstack ones come only from an encoder with its `Deepstack`.
    return given, contextlib.nullcontext() if deep is None else encoder.deepstack.forward(deep)


class Deepstack:
    """What the text layers wrapped by `enable_deepstack` add to their output in a forward run
    inside `forward(added)`: layer i its `added[i]` ([layers, batch, width, hidden])."""

    added: mx.array | None = None

    @contextlib.contextmanager
    def forward(self, added: mx.array) -> Any:
        self.added = added
        try:
            yield
        finally:
            self.added = None


class _DeepstackLayer:
    """Mixed into a text layer's class: its output plus its layer's share of the forward's
    deepstack, as mlx-vlm's text model adds it after each of its first layers."""

    def __call__(self, *args: Any, **kwargs: Any) -> mx.array:
        h, added = super().__call__(*args, **kwargs), self.deepstack.added  # type: ignore[misc]
        return h if added is None else h + added[self.deepstack_index]  # type: ignore[attr-defined]


def enable_deepstack(text_model: Any, count: int) -> Deepstack:
    """The first `count` layers of the mlx-lm text model add a shared `Deepstack`'s features
    (their class swapped for a subclass: the weights' tree is untouched)."""
    state = Deepstack()
    for i, layer in enumerate(text_model.layers[:count]):
        if not isinstance(layer, _DeepstackLayer):
            base = type(layer)
            layer.__class__ = type(f"Deepstack{base.__name__}", (_DeepstackLayer, base), {})
        layer.deepstack, layer.deepstack_index = state, i
    return state


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
