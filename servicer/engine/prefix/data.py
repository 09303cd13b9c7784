"""A prompt block's contents in RAM: its tokens' attention KV and, at a snapshot, the state of
the layers that cannot be cut (engine side)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx


@dataclass
class BlockData:
    """A block in RAM: its tokens' KV for every attention layer and, at a snapshot, every
    other layer's state at its end."""

    kv: list[tuple[mx.array, mx.array]]
    states: dict[int, Any] | None = None

    @property
    def nbytes(self) -> int:
        total = sum(k.nbytes + v.nbytes for k, v in self.kv)
        if self.states:
            total += sum(state_bytes(state) for state in self.states.values())
        return total


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
