"""Per-row rollback of a batched KV cache: each row drops its own number of newest tokens."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.cache import BatchKVCache

from ..quantized_kv import BatchQuantizedKVCache


def rollback(layers: Sequence[Any], drop: Sequence[int], compact_at: int = 64) -> None:
    """Drop the newest `drop[i]` tokens of row i in every layer.

    `trim` cuts every row alike, so the common part goes that way; the rest is rolled out
    per row with `prepare(right_padding=...)` + `finalize()` (mlx-lm's `dynamic_roll`): the
    dropped tokens wrap round into the row's left padding, which the mask hides. Rows that
    keep fewer tokens than others so gain left padding; once every row has `compact_at`
    of it, it is sliced off (as `filter` does), so the buffer does not grow without bound.
    """
    if not layers or not any(drop):
        return
    low = min(drop)
    extra = [d - low for d in drop]
    for layer in layers:
        if not isinstance(layer, BatchKVCache | BatchQuantizedKVCache):
            raise TypeError(f"cannot roll back {type(layer).__name__} per row")
        if low:
            layer.trim(low)
        if any(extra):
            layer.prepare(right_padding=extra)
            layer.finalize()
    if any(extra):
        _compact(layers, compact_at)


def _compact(layers: Sequence[Any], at: int) -> None:
    shared = min(layers[0].left_padding.tolist())
    if shared < max(at, 1):
        return
    for layer in layers:
        if layer.keys is not None:
            layer.keys, layer.values = tree_map(
                lambda x: x[..., shared:, :], (layer.keys, layer.values)
            )
        layer._idx -= shared
        layer.left_padding = layer.left_padding - shared


def row_lengths(layer: BatchKVCache) -> list[int]:
    """Tokens each row holds (for tests and checks)."""
    lengths = mx.array(layer._idx) - layer.left_padding
    return [int(n) for n in lengths.tolist()]
