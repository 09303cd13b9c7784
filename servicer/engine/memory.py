"""How much KV and recurrent-state memory a request will need, for the admission guard.

Measured once on the engine thread from the model's own cache objects after one token:
attention layers cost a fixed number of bytes per token (up to their window, for sliding
layers), recurrent layers a fixed amount per request.
"""

from __future__ import annotations

import os
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from ..admission import MemoryModel
from .cache_kinds import GROWTH_STEP, bytes_of, layers


def measure(model: nn.Module, cache: list[Any] | None = None) -> MemoryModel:
    """What one request's `cache` (by default `make_prompt_cache`'s) holds after a token."""
    cache = make_prompt_cache(model) if cache is None else cache
    model(mx.array([[0]]), cache=cache)
    per_token: list[tuple[int, int | None]] = []
    fixed = 0
    for layer in layers(cache):
        size = bytes_of(layer)
        if size.per_token is not None:
            per_token.append(size.per_token)
        fixed += size.fixed
    return MemoryModel(tuple(per_token), fixed, GROWTH_STEP)


def device_memory_bytes() -> int:
    """The accelerator's memory (Metal, CUDA), or the machine's RAM on the CPU."""
    info = mx.device_info()
    for key in ("max_recommended_working_set_size", "memory_size", "total_memory"):
        value = info.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def weights_bytes(model: nn.Module) -> int:
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))
