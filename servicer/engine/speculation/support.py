"""Which models can speculate here: those whose every layer's cache rolls back per row."""

from __future__ import annotations

import inspect
import sys
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

# Absolute, the module itself: cache_kinds imports this package's caches, so it may be
# mid-import when this module loads.
import servicer.engine.cache_kinds as cache_kinds

from ..decode_batch import merge_caches


def speculation_supported(model: Any) -> tuple[bool, str]:
    """(True, "") when every layer's batched cache rolls back per row (caches.py: full
    attention, sliding window, recurrent state); otherwise the kinds that cannot, named."""
    caches = make_prompt_cache(model)
    kinds = sorted({type(c).__name__ for c in caches if not cache_kinds.speculates(c)})
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
    try:
        _trial_verify(model)
    except Exception as exc:  # whatever the model asks of its caches that these lack
        return False, f"a trial verify on the caches that roll back per row failed: {exc!r}"
    return True, ""


def _trial_verify(model: Any) -> None:
    """Two rows of different lengths, batched as mlx-lm's prefill leaves them, adopted,
    verified (2 tokens) and rolled back: a model that needs something else of its caches
    fails here, at startup, not on a request."""
    rows = []
    for n in (2, 3):
        caches = make_prompt_cache(model)
        model(mx.array([[0] * n]), cache=caches)
        rows.append(caches)
    batch = [cache_kinds.adopt(layer, 2, padding_inert(model)) for layer in merge_caches(rows)]
    for layer in batch:
        layer.checkpoint([2, 1])
    logits = model(mx.array([[0, 0], [0, 0]]), cache=batch)
    for layer in batch:
        layer.rollback([1, 1])
    mx.eval(logits)


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
