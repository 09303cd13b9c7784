"""Batched caches that roll back per row: each cache kind owns its rollback.

A speculating step feeds every row its pending token plus its drafts in one forward (rows
with fewer drafts right-padded), then keeps for each row only what the target accepted.
Every layer's cache answers the same two calls, so the batch never asks which kind it holds:

- ``checkpoint(fed)``: the next forward(s) feed row b ``fed[b]`` real tokens, then padding.
- ``rollback(kept)``: row b keeps the first ``kept[b]`` tokens fed since the checkpoint.
  Returns the rows whose state this layer could not cut there (it put them back at the
  checkpoint instead): those must replay their kept tokens.

mlx-lm's batched caches keep rows right-aligned at one shared write index, so a per-row
rollback has to move every row's whole buffer (``dynamic_roll``), a copy of the batch's KV
per step that grows with the context. Here each row keeps its own end instead:

- ``RaggedKVCache`` (full attention; ``RaggedQuantizedKVCache`` with ``--kv-bits``, and
  ``RaggedDequantizingKVCache`` where the model's attention takes plain arrays only): rows
  share a time axis, each holds the span ``[start, end)``. A forward writes each row's new
  tokens at its own end (a slice when the ends agree, a scatter of just the new tokens when
  not); a rollback moves the ends back. Nothing is copied, whatever the context length.
- ``RingKVCache`` (sliding window): a ring of ``window + k`` slots per row, position p in
  slot ``p % capacity``, the mask limited to the window. A verify of up to k + 1 tokens
  overwrites only positions that no query after a rollback of up to k + 1 can see.
- ``RecurrentCache`` (conv and SSM state, ``ArraysCache``): a recurrence cannot be cut.
  ``checkpoint`` keeps a reference to the state (MLX arrays are immutable, so this copies
  nothing) and sets per-row lengths so padding leaves the state alone (where the model
  honours them); ``rollback`` keeps the new state of rows that kept everything they were
  fed, puts back the checkpoint for the rest, and returns those that kept some tokens, to
  be replayed (snapshot and replay; see the README for why not per-position states).

Rows join from mlx-lm's prefill (``cache_kinds.adopt`` turns its batch caches into these)
and leave through ``filter``; ``extract`` gives back mlx-lm's single-sequence caches, so the
prefix store and finished rows see the usual kinds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    BatchRotatingKVCache,
    KVCache,
    RotatingKVCache,
    _BaseCache,
)

from ..quantized_kv import (
    BatchQuantizedKVCache,
    Dequantizing,
    DequantizingRowCache,
    QuantizedAttention,
    QuantizedRowCache,
)

KV = Any  # an array, or a quantized (packed, scales, biases) tuple


def _width(kv: KV) -> int:
    return (kv[0] if isinstance(kv, tuple) else kv).shape[2]


def _write(buffer: KV, new: KV, at: list[int], capacity: int | None = None) -> KV:
    """`new` (B, H, S, D) written into `buffer` at each row's slots `at[b] + j` (modulo
    `capacity` for a ring): a slice when every row writes at the same place, else a scatter
    of the new tokens only."""
    s = _width(new)
    first = at[0]
    same = all(a == first for a in at)
    if capacity is not None:
        first %= capacity
        same = same and first + s <= capacity
    if same:

        def put(b: mx.array, n: mx.array) -> mx.array:
            b[..., first : first + s, :] = n
            return b

        return tree_map(put, buffer, new)
    slots = mx.array(at, dtype=mx.int32)[:, None] + mx.arange(s, dtype=mx.int32)
    if capacity is not None:
        slots = slots % capacity
    index = slots[:, None, :, None]
    return tree_map(lambda b, n: mx.put_along_axis(b, index, n, axis=2), buffer, new)


class _RowEnds:
    """A speculating batch's KV, rolled back by each row's end (its next position):
    `checkpoint` marks the ends before a verify forward, `rollback` keeps `kept` of the tokens
    written past the mark. The class sets `_end` and `_mark` and keeps `offset` in step with
    `_end` in `_sync`. Its state is read (measured), never restored: it lives one batch."""

    _end: list[int]
    _mark: list[int]
    keys: Any
    values: Any
    offset: mx.array

    def _sync(self) -> None:
        raise NotImplementedError

    @property
    def rows(self) -> int:
        return len(self._end)

    @property
    def state(self) -> tuple:
        return self.keys, self.values, self.offset

    @state.setter
    def state(self, v: tuple) -> None:
        raise NotImplementedError("a speculating batch's cache is not restored from a state")

    def checkpoint(self, fed: Sequence[int]) -> None:
        self._mark = list(self._end)

    def rollback(self, kept: Sequence[int]) -> list[int]:
        self._end = [m + k for m, k in zip(self._mark, kept, strict=True)]
        self._sync()
        return []


class RaggedKVCache(_RowEnds, _BaseCache):
    """Full-attention KV for a batch whose rows each hold ``[start, end)`` of a shared time
    axis. See the module docstring."""

    step = KVCache.step  # grow as mlx-lm's caches do

    def __init__(self, keys: KV | None, values: KV | None, start: list[int], end: list[int]):
        self.keys, self.values = keys, values
        self._start, self._end = list(start), list(end)
        self._mark: list[int] = list(end)
        self._sync()

    def _sync(self) -> None:
        self.offset = mx.array([e - s for s, e in zip(self._start, self._end, strict=True)])

    @property
    def row_starts(self) -> list[int]:
        """Each row's first slot on the shared time axis."""
        return list(self._start)

    @classmethod
    def adopt(cls, layer: BatchKVCache) -> RaggedKVCache:
        """mlx-lm's left-padded batch cache, as is (no copy)."""
        rows = int(layer.offset.shape[0])
        return cls(layer.keys, layer.values, layer.left_padding.tolist(), [layer._idx] * rows)

    @classmethod
    def blank(cls, rows: int) -> RaggedKVCache:
        return cls(None, None, [0] * rows, [0] * rows)

    # ----- the forward -----

    def _quantize(self, keys: mx.array, values: mx.array) -> tuple[KV, KV]:
        return keys, values

    def _room(self, need: int) -> int:
        """Room for `need` tokens, in whole steps (no reallocation per token)."""
        return (need + self.step - 1) // self.step * self.step

    def _grow(self, new: KV, need: int) -> None:
        room = self._room(need)

        def blank(x: mx.array, width: int) -> mx.array:
            return mx.zeros((x.shape[0], x.shape[1], width, x.shape[3]), x.dtype)

        if self.keys is None:
            self.keys, self.values = tree_map(lambda x: blank(x, room), new)
            return
        used = max(self._end)
        grown = tree_map(
            lambda b: mx.concatenate([b[..., :used, :], blank(b, room - used)], axis=2),
            (self.keys, self.values),
        )
        self.keys, self.values = grown

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[KV, KV]:
        new = self._quantize(keys, values)
        s = keys.shape[2]
        top = max(self._end) + s
        if self.keys is None or top > _width(self.keys):
            self._grow(new, top)
        self.keys = _write(self.keys, new[0], self._end)
        self.values = _write(self.values, new[1], self._end)
        self._end = [e + s for e in self._end]
        self.offset = self.offset + s
        return tree_map(lambda b: b[..., :top, :], (self.keys, self.values))

    def make_mask(
        self, N: int, return_array: bool = False, window_size: int | None = None, **_: Any
    ) -> mx.array:
        """Row b's query j (at slot end[b] + j) sees the row's slots from its start to
        itself (and no more than `window_size` back)."""
        top = max(self._end) + N
        slots = mx.arange(top)[None, None, None, :]
        query = (mx.array(self._end)[:, None] + mx.arange(N))[:, None, :, None]
        start = mx.array(self._start)[:, None, None, None]
        mask = (slots >= start) & (slots <= query)
        if window_size is not None:
            mask = mask & (slots > query - window_size)
        return mask

    # ----- rows in, rows out -----

    def filter(self, batch_indices: Sequence[int]) -> None:
        keep = list(batch_indices)
        self._start = [self._start[i] for i in keep]
        self._end = [self._end[i] for i in keep]
        self._mark = list(self._end)
        if self.keys is not None:
            index = mx.array(keep, dtype=mx.int32)
            shared = min(self._start, default=0)
            top = max(self._end, default=0)
            self.keys, self.values = tree_map(
                lambda x: x[index][..., shared:top, :], (self.keys, self.values)
            )
            self._start = [s - shared for s in self._start]
            self._end = [e - shared for e in self._end]
        self._sync()

    def extend(self, other: RaggedKVCache) -> None:
        """Append `other`'s rows; the narrower buffer is padded on the right (no row moves)."""
        if other.keys is not None or self.keys is not None:
            like = self.keys if self.keys is not None else other.keys
            like_v = self.values if self.values is not None else other.values
            width = max(_width(c.keys) for c in (self, other) if c.keys is not None)

            def fit(cache: RaggedKVCache, kv: KV, template: KV) -> KV:
                rows = len(cache._end)
                if kv is None:
                    return tree_map(
                        lambda t: mx.zeros((rows, t.shape[1], width, t.shape[3]), t.dtype), template
                    )
                pad = width - _width(kv)
                if pad == 0:
                    return kv
                return tree_map(lambda x: mx.pad(x, [(0, 0), (0, 0), (0, pad), (0, 0)]), kv)

            def joined(mine: KV, theirs: KV, template: KV) -> KV:
                parts = fit(self, mine, template), fit(other, theirs, template)
                return tree_map(lambda a, b: mx.concatenate([a, b]), *parts)

            self.keys = joined(self.keys, other.keys, like)
            self.values = joined(self.values, other.values, like_v)
        self._start += other._start
        self._end += other._end
        self._mark = list(self._end)
        self._sync()

    def put_row(self, idx: int, row: KVCache | None) -> None:
        """Row idx holds `row`'s tokens (a single-sequence cache, as `extract` gives), or
        none: a row that catches up on its own leaves and rejoins the batch this way."""
        n = 0 if row is None or row.keys is None else row.offset
        if n:
            new = (row.keys[..., :n, :], row.values[..., :n, :])
            rows, width = len(self._end), 0 if self.keys is None else _width(self.keys)
            if n > width:
                room = self._room(n)

                def widen(b: mx.array | None, x: mx.array) -> mx.array:
                    shape = (rows, x.shape[1], room - (0 if b is None else b.shape[2]), x.shape[3])
                    pad = mx.zeros(shape, x.dtype)
                    return pad if b is None else mx.concatenate([b, pad], axis=2)

                self.keys, self.values = widen(self.keys, new[0]), widen(self.values, new[1])
            self.keys[idx : idx + 1, :, :n, :] = new[0]
            self.values[idx : idx + 1, :, :n, :] = new[1]
            self._start[idx] = 0
        self._end[idx] = self._start[idx] + n
        self._mark[idx] = self._end[idx]
        self._sync()

    def _row(self, idx: int) -> tuple[KV, KV]:
        start, end = self._start[idx], self._end[idx]
        return tree_map(
            lambda x: mx.contiguous(x[idx : idx + 1, :, start:end, :]), (self.keys, self.values)
        )

    def _empty_row(self) -> Any:
        return KVCache()

    def extract(self, idx: int) -> Any:
        cache = self._empty_row()
        if self.keys is not None:
            cache.keys, cache.values = self._row(idx)
            cache.offset = self._end[idx] - self._start[idx]
        return cache

    def lengths(self) -> list[int]:
        """Tokens each row holds (for tests and checks)."""
        return [e - s for s, e in zip(self._start, self._end, strict=True)]

    # ----- bookkeeping -----

    def size(self) -> int:
        return max(self._end, default=0)

    def empty(self) -> bool:
        return self.keys is None

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(n, min(self.lengths(), default=0))
        self._end = [e - n for e in self._end]
        self._sync()
        return n

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return self.keys.nbytes + self.values.nbytes


class RaggedQuantizedKVCache(QuantizedAttention, RaggedKVCache):
    """``RaggedKVCache`` holding quantized tuples (``--kv-bits``); ``bits`` and
    ``group_size`` make mlx-lm's attention run on the quantized data."""

    row_class = QuantizedRowCache  # what `extract` gives

    def __init__(
        self,
        keys: KV | None,
        values: KV | None,
        start: list[int],
        end: list[int],
        bits: int,
        group_size: int,
    ) -> None:
        self.kv_bits, self.kv_group_size = bits, group_size
        super().__init__(keys, values, start, end)

    @classmethod
    def adopt(cls, layer: BatchQuantizedKVCache) -> RaggedQuantizedKVCache:  # type: ignore[override]
        rows = int(layer.offset.shape[0])
        start, end = layer.left_padding.tolist(), [layer._idx] * rows
        return cls(layer.keys, layer.values, start, end, layer.kv_bits, layer.kv_group_size)

    def _empty_row(self) -> Any:
        return self.row_class(group_size=self.kv_group_size, bits=self.kv_bits)

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return sum(x.nbytes for part in (self.keys, self.values) for x in part)


class RaggedDequantizingKVCache(Dequantizing, RaggedQuantizedKVCache):
    """``RaggedQuantizedKVCache`` that hands back its tokens dequantized (for a model whose
    attention takes plain arrays only; see quantized_kv)."""

    row_class = DequantizingRowCache

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[KV, KV]:
        return self._dequantized(super().update_and_fetch(keys, values))


class RingKVCache(_RowEnds, _BaseCache):
    """Sliding-window KV: per row a ring of ``window + k`` slots holding its latest
    positions, position p in slot ``p % capacity``; ``end[b]`` is the row's next position,
    ``low[b]`` the lowest it ever held here. A rollback (`_RowEnds`) loses nothing: the slots
    of dropped positions held positions more than a window before any later query (at most
    k + 1 are dropped from a ring of window + k). See the module docstring."""

    def __init__(self, window: int, capacity: int, keys: mx.array, values: mx.array) -> None:
        self.window, self.capacity = window, capacity
        self.keys, self.values = keys, values
        rows = keys.shape[0]
        self._end = [0] * rows
        self._low = [0] * rows
        self._mark = [0] * rows
        self._sync()

    def _sync(self) -> None:
        self.offset = mx.array(self._end)

    @classmethod
    def adopt(cls, layer: BatchRotatingKVCache, extra: int) -> RingKVCache:
        """mlx-lm's batch of rotating caches, each row's last `window` tokens copied into a
        ring with `extra` more slots (once, as the row joins)."""
        window = layer.max_size
        rows = [layer.extract(i) for i in range(int(layer.offset.shape[0]))]
        return cls.from_rows(rows, window, window + extra)

    @classmethod
    def from_rows(cls, rows: Sequence[RotatingKVCache], window: int, capacity: int) -> RingKVCache:
        like = next((r for r in rows if r.keys is not None), None)
        if like is None:
            raise ValueError("a ring cache needs one row with keys to take its shape from")
        h, dk, dv = like.keys.shape[1], like.keys.shape[3], like.values.shape[3]
        keys = mx.zeros((len(rows), h, capacity, dk), like.keys.dtype)
        values = mx.zeros((len(rows), h, capacity, dv), like.values.dtype)
        ring = cls(window, capacity, keys, values)
        for b, row in enumerate(rows):
            held = 0 if row.keys is None else min(window, row.keys.shape[2], row.offset)
            first = row.offset - held
            if held:
                ring.keys = _place(ring.keys, row.keys[..., -held:, :], b, first, capacity)
                ring.values = _place(ring.values, row.values[..., -held:, :], b, first, capacity)
            ring._end[b], ring._low[b] = row.offset, first
        ring._mark = list(ring._end)
        ring._sync()
        return ring

    # ----- the forward -----

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        s = keys.shape[2]
        if s + self.window - 1 > self.capacity:
            raise ValueError(f"a forward of {s} tokens does not fit a ring of {self.capacity}")
        self.keys = _write(self.keys, keys, self._end, self.capacity)
        self.values = _write(self.values, values, self._end, self.capacity)
        self._end = [p + s for p in self._end]
        self.offset = self.offset + s
        return self.keys, self.values

    def make_mask(
        self, N: int, return_array: bool = False, window_size: int | None = None, **_: Any
    ) -> mx.array:
        """Slot t of row b holds the latest position q < end[b] + N with q = t (mod
        capacity); query j (position end[b] + j) sees it when low[b] <= q <= its position
        and q is within the window."""
        window = window_size or self.window
        c = self.capacity
        slots = mx.arange(c)[None, None, None, :]
        top = mx.array([p + N - 1 for p in self._end])[:, None, None, None]
        held = slots + c * mx.floor_divide(top - slots, c)
        query = (mx.array(self._end)[:, None] + mx.arange(N))[:, None, :, None]
        low = mx.array(self._low)[:, None, None, None]
        return (held >= low) & (held <= query) & (held > query - window)

    # ----- rows in, rows out -----

    def filter(self, batch_indices: Sequence[int]) -> None:
        keep = list(batch_indices)
        index = mx.array(keep, dtype=mx.int32)
        self.keys, self.values = self.keys[index], self.values[index]
        self._end = [self._end[i] for i in keep]
        self._low = [self._low[i] for i in keep]
        self._mark = list(self._end)
        self._sync()

    def extend(self, other: RingKVCache) -> None:
        if other.capacity != self.capacity or other.window != self.window:
            raise ValueError("cannot join ring caches of different windows")
        self.keys = mx.concatenate([self.keys, other.keys])
        self.values = mx.concatenate([self.values, other.values])
        self._end += other._end
        self._low += other._low
        self._mark = list(self._end)
        self._sync()

    def extract(self, idx: int) -> RotatingKVCache:
        """Row `idx` as mlx-lm's rotating cache: its last `window` tokens in order."""
        pos = self._end[idx]
        held = min(self.window, pos - self._low[idx])
        cache = RotatingKVCache(self.window)
        if held > 0:
            slots = (mx.arange(held) + (pos - held)) % self.capacity
            cache.keys = mx.contiguous(self.keys[idx : idx + 1, :, slots])
            cache.values = mx.contiguous(self.values[idx : idx + 1, :, slots])
            cache._idx = held
        cache.offset = pos
        return cache

    # ----- bookkeeping -----

    def size(self) -> int:
        return self.capacity

    def empty(self) -> bool:
        return False

    def is_trimmable(self) -> bool:
        return False

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


class RecurrentCache(ArraysCache):
    """mlx-lm's ArraysCache with snapshot-and-replay rollback. `padding_inert`: the model
    honours per-row `lengths` (padding past them leaves the state alone), so a row that kept
    everything it was fed keeps the new state even when the forward was wider."""

    def __init__(self, size: int, padding_inert: bool = True) -> None:
        super().__init__(size)
        self.padding_inert = padding_inert
        self._snapshot: list[mx.array | None] | None = None
        self._fed: list[int] = []
        self._width = 0

    @classmethod
    def adopt(cls, layer: ArraysCache, padding_inert: bool) -> RecurrentCache:
        cache = cls(len(layer.cache), padding_inert)
        cache.cache = list(layer.cache)
        cache.left_padding, cache.lengths = layer.left_padding, layer.lengths
        return cache

    def checkpoint(self, fed: Sequence[int]) -> None:
        self._snapshot = list(self.cache)
        self._fed = list(fed)
        self._width = 0
        self.lengths = mx.array(self._fed)

    def advance(self, N: int) -> None:
        super().advance(N)
        self._width += N

    def rollback(self, kept: Sequence[int]) -> list[int]:
        self.lengths = None
        if self._snapshot is None:
            return []
        # Models that ignore per-row lengths never call `advance` either: every row was
        # padded to the widest fed, so that is the forward's width.
        width = self._width or max(self._fed, default=0)
        exact = [
            k == f and (self.padding_inert or f == width)
            for k, f in zip(kept, self._fed, strict=True)
        ]
        if all(exact):
            return []
        back = mx.array([not e for e in exact])
        self.cache = [
            now if before is None or now is None else mx.where(_rows(back, now), before, now)
            for now, before in zip(self.cache, self._snapshot, strict=True)
        ]
        return [b for b, (e, k) in enumerate(zip(exact, kept, strict=True)) if not e and k > 0]

    def filter(self, batch_indices: Sequence[int]) -> None:
        super().filter(mx.array(list(batch_indices), dtype=mx.int32))
        self._snapshot = None

    def extend(self, other: ArraysCache) -> None:
        super().extend(other)
        self._snapshot = None

    def extract(self, idx: int) -> ArraysCache:
        cache = ArraysCache(len(self.cache))
        cache.cache = [None if c is None else mx.contiguous(c[idx : idx + 1]) for c in self.cache]
        return cache


def _place(buffer: mx.array, row: mx.array, b: int, first: int, capacity: int) -> mx.array:
    """Row b's tokens `row` (1, H, n, D), positions first.., into their ring slots."""
    slots = (mx.arange(row.shape[2]) + first) % capacity
    buffer[b : b + 1, :, slots] = row
    return buffer


def _rows(mask: mx.array, like: mx.array) -> mx.array:
    return mask.reshape((-1,) + (1,) * (like.ndim - 1))
