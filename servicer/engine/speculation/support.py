"""Which models can speculate here: those whose every layer's cache rolls back per row."""

from __future__ import annotations

import inspect
import sys
from typing import Any

from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache


def _rolls_back(cache: Any) -> bool:
    """Full attention, a sliding window (no kept sink tokens) or recurrent state."""
    if type(cache) is RotatingKVCache:
        return cache.keep == 0
    return type(cache) in (KVCache, ArraysCache)


def speculation_supported(model: Any, max_kv_size: int | None = None) -> tuple[bool, str]:
    """(True, "") when every layer's batched cache rolls back per row (caches.py: full
    attention, sliding window, recurrent state); otherwise the kinds that cannot, named."""
    if max_kv_size is not None:
        return False, "max_kv_size keeps attention sink tokens, which the batch cannot roll back"
    kinds = sorted({type(c).__name__ for c in make_prompt_cache(model) if not _rolls_back(c)})
    if kinds:
        return False, (
            f"the model keeps {', '.join(kinds)} layers, which cannot roll back to an accepted "
            "prefix (full attention, sliding-window and recurrent layers can)"
        )
    if _uses(model, ".keys_and_values("):
        return False, (
            "the model's layers read other layers' KV (KV sharing: cache.keys_and_values()), "
            "which the caches that roll back per row do not offer"
        )
    return True, ""


def _uses(model: Any, text: str) -> bool:
    """Whether the source of the model's own module says `text` (how it uses its caches)."""
    module = sys.modules.get(type(model).__module__)
    try:
        return module is not None and text in inspect.getsource(module)
    except (OSError, TypeError):
        return False


def padding_inert(model: Any) -> bool:
    """Whether the model's recurrent layers honour per-row lengths (`ArraysCache.lengths`,
    as mlx-lm's Qwen3-Next, Qwen3.5 and Mamba 2 do), so right padding in a
    verify leaves a row's state alone. Where not, rows with padding replay their tokens."""
    return _uses(model, "cache.lengths")
