"""Which models can speculate here: those whose every layer's cache rolls back per row."""

from __future__ import annotations

from typing import Any

from mlx_lm.models.cache import KVCache, make_prompt_cache


def speculation_supported(model: Any, max_kv_size: int | None = None) -> tuple[bool, str]:
    """(True, "") when every layer keeps a plain KVCache, which batches as a BatchKVCache
    that rolls back per row. Recurrent state (ArraysCache), sliding windows
    (RotatingKVCache) and other kinds cannot be cut back to an accepted prefix here, so
    such models are refused (snapshot-and-replay is not implemented)."""
    if max_kv_size is not None:
        return False, "max_kv_size makes rotating caches, which cannot roll back"
    kinds = sorted({type(c).__name__ for c in make_prompt_cache(model) if type(c) is not KVCache})
    if kinds:
        return False, (
            f"the model keeps {', '.join(kinds)} layers, which cannot roll back to an accepted "
            "prefix; speculation needs every layer to keep a plain KVCache"
        )
    return True, ""
