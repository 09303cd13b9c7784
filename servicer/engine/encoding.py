"""Images encoded before their requests join the batch, a piece a step (engine thread only).

One encoder pass can take seconds, one tower layer more than a step's budget (SigLIP at 224 px
on a 2-core CPU: ~3.6 s, ~130 ms a layer). `StagedEncode` keeps the output of every module call
of the pass's lazy graph (a large attention made by query rows apart, whose results do not
depend on one another) and evaluates them in call order, as many as the budget has room for:
the features are the single pass's bit for bit. `ImageEncodes` runs the waiting requests'
images so, oldest first; the scheduler admits a request once its images are through."""

from __future__ import annotations

import logging
import math
import sys
import time
import types
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
# Past this many scores (query rows x keys) a tower's attention is made by query rows (in
# multiples of ROW_ALIGN), a piece each: at 4,096 patches it alone takes seconds on a CPU.
SPLIT_AT = 256 * 1024
ROW_ALIGN = 32


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
        arrays = [leaf for _, leaf in tree_flatten(out) if isinstance(leaf, mx.array)]
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


@contextmanager
def lazy_pass(tower: nn.Module | None, sink: list[_Stage], piece: float = SPLIT_AT):
    """Within: `mx.eval` does nothing (mlx-vlm's Qwen3-VL evaluates its deepstack features
    while it builds the pass: most of the tower in one step), and the tower's attention calls
    of more than `piece` scores are made by query rows, each share appended to `sink`;
    compiled helpers of the tower's modules that make them (mlx-vlm's `ensure_fused_sdpa`)
    run as plain Python meanwhile, the same ops."""
    fast, compiled = mx.fast, _compiled_attention(tower) if tower is not None else []
    whole, evaluate_now = fast.scaled_dot_product_attention, mx.eval

    def by_rows(q: mx.array, k: mx.array, v: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        rows, keys, mask = q.shape[-2], k.shape[-2], kwargs.get("mask")
        by_row_mask = isinstance(mask, mx.array) and mask.ndim >= 2 and mask.shape[-2] == rows
        plain = mask is None or by_row_mask or (isinstance(mask, mx.array) and mask.shape[-2] == 1)
        if args or rows * keys <= piece or not plain:
            return whole(q, k, v, *args, **kwargs)
        step = max(ROW_ALIGN, int(piece // keys) // ROW_ALIGN * ROW_ALIGN)
        shares = []
        for start in range(0, rows, step):
            if by_row_mask:
                kwargs["mask"] = mask[..., start : start + step, :]
            shares.append(whole(q[..., start : start + step, :], k, v, **kwargs))
            sink.append(_Stage(("attention", tuple(shares[-1].shape)), [shares[-1]]))
        return mx.concatenate(shares, axis=-2)

    fast.scaled_dot_product_attention, mx.eval = by_rows, lambda *arrays: None
    for namespace, name, f in compiled:
        namespace[name] = types.FunctionType(
            f.__code__, f.__globals__, name, f.__defaults__, f.__closure__
        )
    try:
        yield
    finally:
        fast.scaled_dot_product_attention, mx.eval = whole, evaluate_now
        for namespace, name, f in compiled:
            namespace[name] = f


def _compiled_attention(tower: nn.Module) -> list[tuple[dict[str, Any], str, Any]]:
    """(module namespace, name, function) of each compiled function (mx.compile) that calls
    the fused attention, in the modules defining the tower's classes."""
    names = {type(m).__module__ for _, m in tower.named_modules()}
    return [
        (vars(module), name, value)
        for module in filter(None, (sys.modules.get(n) for n in names))
        for name, value in vars(module).items()
        if type(value) is not types.FunctionType  # mx.compile's subclass
        and isinstance(code := getattr(value, "__code__", None), types.CodeType)
        and "scaled_dot_product_attention" in code.co_names
    ]


def evaluate(stage: _Stage) -> None:
    """Compute a stage. An attention share traced inside some other compiled function is a
    placeholder MLX refuses to evaluate: skipped, it is computed with the rest of that
    function (the function's output is the traced graph's, not the share's)."""
    try:
        mx.eval(stage.arrays)
    except RuntimeError:
        if stage.kind[0] != "attention":
            raise


class StagedEncode:
    """One image's encoder pass as a lazy graph, evaluated a stage (a module call) at a time."""

    def __init__(
        self, encoder: VisionEncoder, image: ImageInput, run: list[int], piece: float = SPLIT_AT
    ) -> None:
        self.image = image
        recorded: list[_Stage] = []
        tower = encoder.tower
        with recording(tower, recorded), lazy_pass(tower, recorded, piece):
            self.features = encoder.lazy_features(image, run)
        self._stages = [*recorded, _Stage(("features",), [self.features])]
        self._next = 0
        self._cost: dict[tuple[Any, ...], float] = {}  # seconds, by stage kind (the last)
        self._slowest = 0.0  # a kind not seen yet is expected to cost this

    @property
    def done(self) -> bool:
        return self._next >= len(self._stages)

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
            evaluate(stage)
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
                piece = SPLIT_AT if budget_s is not None else math.inf  # split: ~10 % slower
                running = self._running = StagedEncode(self._encoder, image, run, piece)
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
