"""Images encoded before their requests join the batch, a few vision layers a step (engine
thread only).

One image's encoder pass can take seconds (Gemma 3's SigLIP at 224 px: 27 layers, ~3.6 s on a
2-core CPU), far past the prefill budget the decoding rows are promised. MLX builds the whole
pass as a lazy graph at once; `StagedEncode` keeps the vision tower's per-layer outputs from
that graph and evaluates them one after another, so each step computes only the layers its
budget has room for, and the finished features are exactly the single pass's (the same graph).
`ImageEncodes` runs the waiting requests' images this way, oldest first; the scheduler admits
an image request once every image past its reusable prefix has its features.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from ..messages import GenerationRequest, ImageInput
from .vision import VisionEncoder, placeholder_run

log = logging.getLogger(__name__)
_LAYER_LISTS = ("layers", "blocks")  # the vision towers' transformer layer lists, by name


class _Recorder:
    """A tower layer that also hands its output to `sink` (while the graph is built)."""

    def __init__(self, layer: Any, sink: list[Any]) -> None:
        self._layer, self._sink = layer, sink

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self._layer(*args, **kwargs)
        self._sink.append(out)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._layer, name)


def layer_list(tower: Any) -> list[Any] | None:
    """The vision tower's longest list of transformer layers (None: it has none)."""
    best: list[Any] | None = None
    for _, module in tower.named_modules():
        for attr in _LAYER_LISTS:
            found = module.get(attr)
            if isinstance(found, list) and len(found) > len(best or ()):
                best = found
    return best


@contextmanager
def recording(tower: Any, sink: list[Any]):
    """Within: each layer of the tower's layer list also appends its output to `sink`."""
    layers = layer_list(tower) if tower is not None else None
    if not layers:
        yield
        return
    originals = list(layers)
    layers[:] = [_Recorder(layer, sink) for layer in originals]
    try:
        yield
    finally:
        layers[:] = originals


def _arrays(tree: Any) -> list[mx.array]:
    if isinstance(tree, mx.array):
        return [tree]
    return [leaf for _, leaf in tree_flatten(tree) if isinstance(leaf, mx.array)]


class StagedEncode:
    """One image's encoder pass as a lazy graph, evaluated a stage (a layer) at a time."""

    def __init__(self, encoder: VisionEncoder, image: ImageInput, run: list[int]) -> None:
        self.image = image
        outputs: list[Any] = []
        with recording(encoder.tower, outputs):
            self.features = encoder.lazy_features(image, run)
        self._stages: list[list[mx.array]] = [_arrays(o) for o in outputs] + [[self.features]]
        self._next = 0
        self._stage_s = 0.0  # the slowest stage so far

    @property
    def done(self) -> bool:
        return self._next >= len(self._stages)

    @property
    def stages(self) -> int:
        return len(self._stages)

    def advance(self, budget_s: float | None) -> None:
        """Evaluate stages while the next one is expected to fit `budget_s` (None: all of
        them); at least one, so every call makes progress."""
        started = time.perf_counter()
        first = self._next
        while not self.done:
            spent = time.perf_counter() - started
            if budget_s is not None and self._next > first and spent + self._stage_s > budget_s:
                break
            began = time.perf_counter()
            mx.eval(self._stages[self._next])
            self._stages[self._next] = []  # computed; the graph past it holds what it needs
            self._next += 1
            self._stage_s = max(self._stage_s, time.perf_counter() - began)


class ImageEncodes:
    """The waiting requests' images, encoded ahead of their admission under each step's
    leftover budget; their features wait in the encoder until the request joins."""

    def __init__(
        self, encoder: VisionEncoder, reusable: Callable[[GenerationRequest], int]
    ) -> None:
        self._encoder = encoder
        self._reusable = reusable
        self._running: StagedEncode | None = None

    def _missing(self, request: GenerationRequest) -> list[ImageInput]:
        if not request.images:
            return []
        covered = self._reusable(request)
        encoder = self._encoder
        return [i for i in request.images if i.end > covered and not encoder.has(i.key)]

    def ready(self, request: GenerationRequest) -> bool:
        """Every image past the request's reusable prefix has its features."""
        return not self._missing(request)

    def pending(self, waiting: Iterable[GenerationRequest]) -> bool:
        """Some waiting request has an image to encode (one whose lookup fails counts not:
        its planning fails it)."""
        for request in waiting:
            try:
                if self._missing(request):
                    return True
            except Exception:
                continue
        return False

    def advance(
        self, waiting: Iterable[GenerationRequest], budget_s: float | None
    ) -> list[tuple[GenerationRequest, str]]:
        """Encode the oldest waiting requests' missing images for up to `budget_s` (None: all
        of them), at least one stage of one image a call; returns the requests whose image
        failed to encode, and why (each fails alone, its encode inside the budget)."""
        spent, failed = 0.0, []
        for request in waiting:
            try:
                missing = self._missing(request)
            except Exception:  # looking up its prefix failed: its own planning fails it alone
                continue
            for image in missing:
                if budget_s is not None and spent > 0 and spent >= budget_s:
                    return failed
                left = None if budget_s is None else budget_s - spent
                started = time.perf_counter()
                error = self._step(request, image, left)
                spent += time.perf_counter() - started
                if error is not None:
                    failed.append((request, error))
                    break
                if self._running is not None:  # unfinished: the budget is spent
                    return failed
        return failed

    def _step(
        self, request: GenerationRequest, image: ImageInput, budget_s: float | None
    ) -> str | None:
        """A few stages of `image`'s encode; why it failed (None: it did not)."""
        running = self._running
        try:
            if running is None or running.image.key != image.key:
                run = placeholder_run(request, image)
                running = self._running = StagedEncode(self._encoder, image, run)
            running.advance(budget_s)
        except Exception as exc:
            log.warning("encoding an image failed; its request fails: %s", exc)
            self._running = None
            return f"the vision encoder failed on the request's image: {exc}"
        if running.done:
            self._encoder.keep(image, running.features)
            self._running = None
        return None

    def forget_all_but(self, waiting: Iterable[GenerationRequest]) -> None:
        """Drop what was encoded for requests no longer waiting."""
        keys = {image.key for request in waiting for image in request.images}
        self._encoder.drop_ahead(keys)
        if self._running is not None and self._running.image.key not in keys:
            self._running = None
