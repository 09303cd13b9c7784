"""Quantized-KV helpers for tests: full-precision caches turned into --kv-bits rows."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from servicer.engine.cache_kinds import kind_of
from servicer.engine.quantized_kv import QuantizedRowCache


def quantized_row(cache: Any, bits: int, group_size: int) -> QuantizedRowCache:
    """A full-precision row's tokens (e.g. a prefix hit kept in full precision), quantized."""
    row = QuantizedRowCache(group_size=group_size, bits=bits)
    if cache.keys is not None and cache.offset:
        n = cache.offset
        row.update_and_fetch(cache.keys[..., :n, :], cache.values[..., :n, :])
    return row


def quantize_rows(caches: Sequence[Any], bits: int = 8, group_size: int = 64) -> list[Any]:
    """Per-layer caches of one sequence with each layer --kv-bits quantizes (cache_kinds'
    table) as a ``QuantizedRowCache`` holding its tokens; other layers as they are.
    ``BatchGenerator`` merges with the first row's class, so rows should all be quantized."""
    return [quantized_row(c, bits, group_size) if kind_of(c).quantize else c for c in caches]
