"""Decoding rows of very different lengths in separate attention groups (engine thread only).

mlx-lm's batch caches are rectangles: in a full-attention layer every row is padded to the
longest row. When a prompt of 8,000 tokens joins 8 streams at a few hundred, the join copies
every row out to 8,000 slots, and from then on each step's attention reads all of them for
every row (Gemma 3 270M, float32, this CPU: ~0.8 s for the join, ~0.5 s a step; see
bench/RESULTS.md, "Rows in groups").

Here a decoding batch's full-attention layer is a `RowGroups`: its rows in groups, each group
a batch cache of the kind the batch would have held (mlx-lm's, quantized, or speculation's).
Arriving rows join the group whose length they share, or start a group of their own when
padding them together would more than double that attention's work (`choose_group`). The
projections, MLP, norms and head still run once over the whole batch; only the attention runs
once per group, on the group's rows (fused_prefill's `PackedAttention` does it, for the
attention classes it covers). With one group the forward is mlx-lm's own, on that group's cache.

Every full-attention layer of a batch makes the same choices (they hold the same tokens), so
the mask the model builds from one layer's `RowGroups` fits the others.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx

# A group of its own pays a few extra operations per layer (gathers, a second attention call);
# below this many padded key slots it costs more than it saves.
MIN_SPLIT_SLOTS = 4096
# Rows join a group unless the joined attention reads more than this many times the slots of
# the two apart.
SPLIT_RATIO = 2.0
# Past this many groups new rows join the group where they cost least.
MAX_GROUPS = 4


def choose_group(groups: Sequence[tuple[int, int]], rows: int, width: int) -> int | None:
    """Which group (each `(rows, width)`) `rows` new rows of `width` slots join: its index, or
    None for a group of their own."""
    best, best_extra, best_joined, best_apart = None, 0, 0, 0
    for g, (held, held_width) in enumerate(groups):
        joined = (held + rows) * max(held_width, width)
        apart = held * held_width + rows * width
        if best is None or joined - apart < best_extra:
            best, best_extra, best_joined, best_apart = g, joined - apart, joined, apart
    if best is None:
        return None
    cheap = best_extra < MIN_SPLIT_SLOTS or best_joined <= SPLIT_RATIO * best_apart
    return best if cheap or len(groups) >= MAX_GROUPS else None


class PartMasks:
    """Each part's attention mask (a row group's, or a packed forward's segment's), as that
    part's own cache made it."""

    def __init__(self, masks: Sequence[Any]) -> None:
        self.masks = tuple(masks)


class RowGroups:
    """One full-attention layer's KV for a decoding batch, its rows in groups: `groups[g]` is
    a batch cache holding batch rows `members[g]`, in that order. See the module docstring."""

    def __init__(self, groups: list[Any], members: list[list[int]]) -> None:
        self.groups = groups
        self.members = members
        self._index()

    @classmethod
    def of(cls, layer: Any) -> RowGroups:
        """A batch cache's rows as one group."""
        return cls([layer], [list(range(_rows(layer)))])

    def map(self, change: Callable[[Any], Any]) -> RowGroups:
        """The same groups, each cache replaced by `change(cache)`."""
        return RowGroups([change(g) for g in self.groups], [list(m) for m in self.members])

    def _index(self) -> None:
        self.single = len(self.groups) == 1
        if self.single:  # the forward is mlx-lm's on the one group: no gathers to build
            self.take, self.inverse = [], mx.array([], dtype=mx.int32)
            return
        self.take = [mx.array(m, dtype=mx.int32) for m in self.members]
        order = [b for m in self.members for b in m]
        inverse = [0] * len(order)
        for position, row in enumerate(order):
            inverse[row] = position
        self.inverse = mx.array(inverse, dtype=mx.int32)

    @property
    def rows(self) -> int:
        return sum(len(m) for m in self.members)

    # ----- the forward -----

    def make_mask(
        self, N: int, return_array: bool = False, window_size: int | None = None, **_: Any
    ) -> PartMasks:
        return PartMasks(
            [
                g.make_mask(N, return_array=return_array, window_size=window_size)
                for g in self.groups
            ]
        )

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Any:
        raise TypeError("a grouped batch's attention runs per group (fused_prefill)")

    @property
    def offset(self) -> mx.array:
        if self.single:
            return mx.broadcast_to(self.groups[0].offset, (len(self.members[0]),))
        pairs = zip(self.groups, self.members, strict=True)
        offsets = [mx.broadcast_to(g.offset, (len(m),)) for g, m in pairs]
        return mx.concatenate(offsets)[self.inverse]

    @property
    def state(self) -> tuple:
        return tuple(g.state for g in self.groups)

    # ----- rows in, rows out -----

    def filter(self, batch_indices: Sequence[int]) -> None:
        renumber = {old: new for new, old in enumerate(batch_indices)}
        groups, members = [], []
        for group, held in zip(self.groups, self.members, strict=True):
            keep = [j for j, row in enumerate(held) if row in renumber]
            if not keep:
                continue
            if len(keep) < len(held):
                group.filter(keep)
            groups.append(group)
            members.append([renumber[held[j]] for j in keep])
        self.groups, self.members = groups, members
        self._index()

    def extend(self, other: RowGroups) -> None:
        base = self.rows
        for group, held in zip(other.groups, other.members, strict=True):
            shapes = [(len(m), g.size()) for g, m in zip(self.groups, self.members, strict=True)]
            target = choose_group(shapes, len(held), group.size())
            moved = [base + row for row in held]
            if target is None:
                self.groups.append(group)
                self.members.append(moved)
            else:
                self.groups[target].extend(group)
                self.members[target].extend(moved)
        self._index()

    def _locate(self, idx: int) -> tuple[Any, int]:
        for group, held in zip(self.groups, self.members, strict=True):
            if idx in held:
                return group, held.index(idx)
        raise IndexError(f"row {idx} is in no group of {self.rows} rows")

    def extract(self, idx: int) -> Any:
        group, j = self._locate(idx)
        return group.extract(j)

    # ----- speculation's per-row rollback (speculation.caches) -----

    def checkpoint(self, fed: Sequence[int]) -> None:
        for group, held in zip(self.groups, self.members, strict=True):
            group.checkpoint([fed[row] for row in held])

    def rollback(self, kept: Sequence[int]) -> list[int]:
        again = []
        for group, held in zip(self.groups, self.members, strict=True):
            again.extend(held[j] for j in group.rollback([kept[row] for row in held]))
        return sorted(again)

    # ----- bookkeeping -----

    def size(self) -> int:
        return max((g.size() for g in self.groups), default=0)

    def empty(self) -> bool:
        return all(g.empty() for g in self.groups)

    def is_trimmable(self) -> bool:
        return all(g.is_trimmable() for g in self.groups)

    def trim(self, n: int) -> int:
        return min((g.trim(n) for g in self.groups), default=0)

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in self.groups)


def _rows(layer: Any) -> int:
    return int(layer.offset.shape[0])
