"""Images encoded before their requests join the batch, a few vision-tower modules a step
(engine thread only).

One image's encoder pass can take seconds (Gemma 3's SigLIP at 224 px: 27 layers, ~3.6 s on a
2-core CPU), and even one of its layers (~130 ms) can outlast the prefill budget the decoding
rows are promised. MLX builds the whole pass as a lazy graph at once; `StagedEncode` keeps the
output of every module the tower calls (each layer's norms, projections, attention, MLP) from
that graph and evaluates them in call order, so each step computes only the pieces its budget
has room for, and the finished features are exactly the single pass's (the same graph).
`ImageEncodes` runs the waiting requests' images this way, oldest first; the scheduler admits
an image request once every image past its reusable prefix has its features.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..messages import GenerationRequest, ImageInput
from .vision import VisionEncoder, placeholder_run

log = logging.getLogger(__name__)


@dataclass
class _Stage:
    """The output of one module call of the tower; `kind` (its class and output shapes) is
    what its cost is predicted by: the same module of the next layer costs about the same."""

    kind: tuple[Any, ...]
    arrays: list[mx.array]


class _Recorder:
    """A tower module that also hands its output to `sink` (while the graph is built)."""

    def __init__(self, module: nn.Module, sink: list[_Stage]) -> None:
        self._module, self._sink = module, sink

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self._module(*args, **kwargs)
        arrays = _arrays(out)
        if arrays:
            kind = (type(self._module).__name__, *(tuple(a.shape) for a in arrays))
            self._sink.append(_Stage(kind, arrays))
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


@contextmanager
def recording(tower: nn.Module | None, sink: list[_Stage]):
    """Within: every module inside the tower (held as an attribute or in a list) also appends
    its output to `sink`, in call order; afterwards the tower is as it was."""
    undo: list[Callable[[], None]] = []
    for _, module in tower.named_modules() if tower is not None else ():
        for name, child in module.children().items():
            if isinstance(child, nn.Module):
                object.__setattr__(module, name, _Recorder(child, sink))
                undo.append(lambda m=module, n=name: object.__delattr__(m, n))
            elif isinstance(held := module.get(name), list):
                originals = list(held)
                held[:] = [_Recorder(c, sink) if isinstance(c, nn.Module) else c for c in held]
                undo.append(lambda h=held, o=originals: h.__setitem__(slice(None), o))
    try:
        yield
    finally:
        for step in reversed(undo):
            step()


def _arrays(tree: Any) -> list[mx.array]:
    if isinstance(tree, mx.array):
        return [tree]
    if not isinstance(tree, (list, tuple, dict)):
        return []
    return [leaf for _, leaf in tree_flatten(tree) if isinstance(leaf, mx.array)]


class StagedEncode:
    """One image's encoder pass as a lazy graph, evaluated a stage (a module call) at a time."""

    def __init__(self, encoder: VisionEncoder, image: ImageInput, run: list[int]) -> None:
        self.image = image
        recorded: list[_Stage] = []
        with recording(encoder.tower, recorded):
            self.features = encoder.lazy_features(image, run)
        self._stages = [*recorded, _Stage(("features",), [self.features])]
        self._next = 0
        self._cost: dict[tuple[Any, ...], float] = {}  # seconds, by stage kind (the last)
        self._slowest = 0.0  # a kind not seen yet is expected to cost this

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
            stage = self._stages[self._next]
            expected = self._cost.get(stage.kind, self._slowest)
            spent = time.perf_counter() - started
            if budget_s is not None and self._next > first and spent + expected > budget_s:
                break
            began = time.perf_counter()
            mx.eval(stage.arrays)
            stage.arrays = []  # computed; the graph past it holds what it needs
            self._next += 1
            took = time.perf_counter() - began
            self._cost[stage.kind] = took
            self._slowest = max(self._slowest, took)


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
