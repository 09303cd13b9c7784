"""What the engine takes from mlx-lm beyond its public API, in one list.

The batch, its prefill and its decode step are the engine's own (runner, prompt_batch,
decode_batch); from mlx-lm it takes models, loading, cache classes, samplers and tokenizers.
The rolling-back caches of speculation take over the batched caches' write position, and
read per-row lengths of recurrent layers. Each touch point is listed here with what it is
for; `missing_touch_points` reads mlx-lm's own source for each, so that an mlx-lm upgrade
that moves one turns speculation off at start with a clear log line (`parts`) and fails one
test (tests/test_mlx_lm_compat.py), not a run.
"""

from __future__ import annotations

import inspect
from functools import cache

from mlx_lm.models import cache as mlx_cache

# (class, attribute, what we use it for)
TOUCH_POINTS: tuple[tuple[type, str, str], ...] = (
    (mlx_cache.BatchKVCache, "_idx", "the write position a rolling-back cache takes over"),
    (mlx_cache.BatchRotatingKVCache, "_idx", "likewise for sliding windows"),
    (mlx_cache.ArraysCache, "lengths", "per-row lengths: recurrent layers that honour padding"),
)


@cache
def _source(cls: type) -> str:
    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):
        return ""


def missing_touch_points() -> list[str]:
    """The touch points the installed mlx-lm no longer has, as "Class.attribute"."""
    missing = []
    for cls, name, _ in TOUCH_POINTS:
        if not hasattr(cls, name) and f"self.{name}" not in _source(cls):
            missing.append(f"{cls.__name__}.{name}")
    return missing
