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
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from ..admission import MemoryModel


def measure(model: nn.Module, cache: list[Any] | None = None) -> MemoryModel:
    """What one request's `cache` (by default `make_prompt_cache`'s) holds after a token."""
    cache = make_prompt_cache(model) if cache is None else cache
    model(mx.array([[0]]), cache=cache)
    per_token: list[tuple[int, int | None]] = []
    fixed = 0
    for layer in _flatten(cache):
        if isinstance(layer, QuantizedKVCache) and layer.keys is not None:
            parts = [*layer.keys, *layer.values]  # (batch, heads, tokens, packed) each
            mx.eval(parts)
            per_token.append((sum(p.shape[1] * p.shape[3] * p.dtype.size for p in parts), None))
        elif isinstance(layer, KVCache | RotatingKVCache) and layer.keys is not None:
            mx.eval(layer.keys, layer.values)
            row = layer.keys.shape[1] * (
                layer.keys.shape[3] * layer.keys.dtype.size
                + layer.values.shape[3] * layer.values.dtype.size
            )
            window = layer.max_size if isinstance(layer, RotatingKVCache) else None
            per_token.append((row, window))
        elif isinstance(layer, ArraysCache):
            mx.eval([c for c in layer.cache if c is not None])
            fixed += layer.nbytes
        else:  # an unfamiliar cache: count what one token made it hold, per token
            per_token.append((max(getattr(layer, "nbytes", 0), 1), None))
    return MemoryModel(tuple(per_token), fixed)


def _flatten(caches: list[Any]) -> list[Any]:
    flat = []
    for cache in caches:
        if isinstance(cache, CacheList):
            flat.extend(_flatten(list(cache.caches)))
        else:
            flat.append(cache)
    return flat


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
