"""A prompt block's contents in RAM: its tokens' attention KV and, at a snapshot, the state of
the layers that cannot be cut (engine side).

A layer's keys (or values) are one array, or, with a quantized KV cache, MLX's quantized
triple (packed, scales, biases); every helper here treats both alike, along the token axis.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

Part = mx.array | tuple[mx.array, ...]  # keys or values: an array, or a quantized triple


@dataclass
class BlockData:
    """A block in RAM: its tokens' KV for every attention layer and, at a snapshot, every
    other layer's state at its end."""

    kv: list[tuple[Part, Part]]
    states: dict[int, Any] | None = None

    @property
    def nbytes(self) -> int:
        total = sum(a.nbytes for a in arrays_of(self.kv))
        if self.states:
            total += sum(state_bytes(state) for state in self.states.values())
        return total


def time_slice(part: Part, start: int, end: int) -> Part:
    """Tokens [start, end) of keys or values, copied: a slice would keep the whole source
    buffer alive."""
    if isinstance(part, tuple):
        return tuple(mx.contiguous(x[..., start:end, :]) for x in part)
    return mx.contiguous(part[..., start:end, :])


def concat(parts: list[Part]) -> Part:
    """Blocks' keys (or values) joined along the tokens."""
    if isinstance(parts[0], tuple):
        return tuple(mx.concatenate([p[i] for p in parts], axis=2) for i in range(len(parts[0])))
    return mx.concatenate(parts, axis=2)


def tokens_in(part: Part) -> int:
    return (part[0] if isinstance(part, tuple) else part).shape[2]


def state_bytes(layer: Any) -> int:
    try:
        return int(layer.nbytes)
    except Exception:
        return 0


def arrays_of(tree: Any) -> list[mx.array]:
    if isinstance(tree, mx.array):
        return [tree]
    if isinstance(tree, BlockData):
        return arrays_of(tree.kv) + arrays_of(list((tree.states or {}).values()))
    if isinstance(tree, list | tuple):
        return [a for item in tree for a in arrays_of(item)]
    if isinstance(tree, dict):
        return arrays_of(list(tree.values()))
    state = getattr(tree, "state", None)
    if state is not None and not isinstance(tree, mx.array):
        return arrays_of(list(state) if isinstance(state, list | tuple) else [state])
    return []
