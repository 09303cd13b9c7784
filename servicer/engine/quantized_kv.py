"""A quantized KV cache that batches: the engine's batch (or mlx-lm's) with keys and values kept as
MLX quantized tuples ``(packed uint32, scales, biases)``.

mlx-lm 0.32 has ``QuantizedKVCache`` (one sequence) and ``BatchKVCache`` (a left-padded batch in
full precision), but no batched quantized cache, so its server stops batching when ``kv_bits``
is set. ``BatchQuantizedKVCache`` is ``BatchKVCache`` with each of keys and values held as three
arrays that share the (batch, heads, time) axes; every batch operation (grow, roll, pad, filter,
concatenate) applies to the three alike. Quantizing is along the last axis, so each token's
vector quantizes on its own and rows, chunks and padding never change a token's blocks.

Attention runs on the quantized data: mlx-lm's ``scaled_dot_product_attention`` switches to
quantized matmuls when the cache has a ``bits`` attribute.

Some models' attention code cannot take quantized tuples (attention sinks, MLA's latent cache,
a direct call of ``mx.fast.scaled_dot_product_attention``, ``keys.astype``). For them the
dequantizing kinds (``DequantizingRowCache``, ``BatchDequantizingKVCache``, and the speculating
batch's ``RaggedDequantizingKVCache``) store exactly what the quantized kinds store (the same
buffers, padding and operations: the memory saving, what the admission guard and the prefix
store count) but hand back ``mx.dequantize`` of the stored tokens from ``update_and_fetch`` and
``keys_and_values``: plain arrays in the model's dtype, in the buffer's layout (so the model's
masks apply as before). They keep their settings as ``kv_bits`` / ``kv_group_size`` only, with
no ``bits`` attribute to send mlx-lm's attention down the quantized path, so the model's own
attention runs unchanged on keys and values that went through quantization. The cost: each
forward dequantizes each layer's whole held KV (``quantization`` reads the settings of either).

Use: ``BatchRunner.insert(prompts, caches=[make_row_cache(model, bits, group_size) ...])``
(``cache_kinds.make_row_cache``: which layers are quantized is the cache kinds' answer).
The per-row ``QuantizedRowCache.merge`` builds the batch cache, so the batch is quantized
wherever the rows are; other layer kinds (recurrent, sliding window) stay full precision.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import KVCache, QuantizedKVCache, _BaseCache, dynamic_roll

Quantized = tuple[mx.array, mx.array, mx.array]
KV = tuple[Quantized, Quantized]


def _quantize(x: mx.array, group_size: int, bits: int) -> Quantized:
    packed, scales, biases = mx.quantize(x, group_size=group_size, bits=bits)
    return packed, scales, biases


def _time_slice(kv: KV, start: int, stop: int) -> KV:
    return tree_map(lambda x: x[..., start:stop, :], kv)


def _kv_nbytes(*kv: Any) -> int:
    return sum(x.nbytes for part in kv if part is not None for x in part)


def _store(buffers: KV | None, filled: int, new: KV, step: int) -> KV:
    """`new` written after the first `filled` tokens of `buffers` (in place), which grow in
    whole steps of `step` tokens when it does not fit (no reallocation per token)."""
    n = new[0][0].shape[2]
    if buffers is None or filled + n > buffers[0][0].shape[2]:
        room = (step + n - 1) // step * step
        blank = tree_map(lambda x: mx.zeros((*x.shape[:2], room, x.shape[3]), x.dtype), new)
        if buffers is None:
            buffers = blank
        else:
            old = _time_slice(buffers, 0, filled)
            buffers = tree_map(lambda a, b: mx.concatenate([a, b], axis=2), old, blank)
    for buffer, part in zip((*buffers[0], *buffers[1]), (*new[0], *new[1]), strict=True):
        buffer[..., filled : filled + n, :] = part
    return buffers


def quantization(cache: Any) -> tuple[int, int] | None:
    """(bits, group size) of a cache that stores its keys and values quantized (ours, whether
    attention gets them quantized or dequantized; mlx-lm's QuantizedKVCache); None otherwise."""
    if hasattr(cache, "kv_bits"):
        return cache.kv_bits, cache.kv_group_size
    if hasattr(cache, "bits"):
        return cache.bits, cache.group_size
    return None


class _KvSetting:
    """A quantized cache's ``bits`` or ``group_size``, kept as ``kv_bits`` / ``kv_group_size``
    and set either way (mlx-lm's constructors set ``bits``). Readable where mlx-lm's attention
    is to run on the quantized tuples the cache hands back; absent when read on a cache that
    hands back dequantized arrays, so that ``hasattr(cache, "bits")`` is False and attention
    takes its plain path."""

    def __init__(self, readable: bool) -> None:
        self.readable = readable

    def __set_name__(self, owner: type, name: str) -> None:
        self.name, self.kept = name, f"kv_{name}"

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        if self.readable:
            return getattr(obj, self.kept)
        raise AttributeError(
            f"{type(obj).__name__} hands back dequantized keys and values: "
            f"its {self.name} is {self.kept}"
        )

    def __set__(self, obj: Any, value: int) -> None:
        setattr(obj, self.kept, value)


class QuantizedAttention:
    """``bits`` and ``group_size`` (kept as ``kv_bits`` / ``kv_group_size``): with them,
    mlx-lm's ``scaled_dot_product_attention`` runs on the quantized tuples the cache hands back."""

    kv_bits: int
    kv_group_size: int
    bits = _KvSetting(readable=True)
    group_size = _KvSetting(readable=True)

    def _quantize(self, keys: mx.array, values: mx.array) -> KV:
        return tuple(_quantize(x, self.kv_group_size, self.kv_bits) for x in (keys, values))


class Dequantizing:
    """What the dequantizing kinds add to the quantized ones: no ``bits`` / ``group_size`` to
    read, and the held tokens dequantized (in the dtype they were quantized from)."""

    kv_bits: int
    kv_group_size: int
    bits = _KvSetting(readable=False)
    group_size = _KvSetting(readable=False)

    def _dequantized(self, kv: KV) -> tuple[mx.array, mx.array]:
        keys, values = (
            mx.dequantize(*q, group_size=self.kv_group_size, bits=self.kv_bits) for q in kv
        )
        return keys, values


class QuantizedRowCache(QuantizedAttention, QuantizedKVCache):
    """One sequence's quantized KV: mlx-lm's ``QuantizedKVCache`` plus what batching needs
    (``size``, a ``merge`` that builds the batch cache, a state holding only the filled part)."""

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Any:
        held = None if self.keys is None else (self.keys, self.values)
        self.keys, self.values = _store(held, self.offset, self._quantize(keys, values), self.step)
        self.offset += keys.shape[2]
        return self.keys_and_values()

    def size(self) -> int:
        return self.offset

    @classmethod
    def merge(cls, caches: Sequence[Any]) -> BatchQuantizedKVCache:
        return BatchQuantizedKVCache.merge(caches)

    @property
    def state(self) -> tuple:
        # The buffer past `offset` is spare room: a stored state need not carry it.
        if self.keys is None:
            return None, None, self.offset, self.kv_group_size, self.kv_bits
        keys, values = _time_slice((self.keys, self.values), 0, self.offset)
        return keys, values, self.offset, self.kv_group_size, self.kv_bits

    @state.setter
    def state(self, v: tuple) -> None:
        keys, values, self.offset, self.kv_group_size, self.kv_bits = v
        self.keys = None if keys is None else tuple(keys)
        self.values = None if values is None else tuple(values)

    @property
    def nbytes(self) -> int:
        # mlx-lm's QuantizedKVCache.nbytes raises on an empty cache.
        return _kv_nbytes(self.keys, self.values)


def _quant_params(caches: Sequence[Any], bits: int | None, group_size: int | None):
    """Bits and group size for a merge: given, or read from the first quantized row."""
    quantized = [q for c in caches if (q := quantization(c)) is not None]
    if bits is None or group_size is None:
        if not quantized:
            raise ValueError("merging full-precision rows needs bits and group_size")
        bits = quantized[0][0] if bits is None else bits
        group_size = quantized[0][1] if group_size is None else group_size
    for row_bits, row_group in quantized:
        if (row_bits, row_group) != (bits, group_size):
            raise ValueError(
                f"cannot batch a {row_bits}-bit group-{row_group} row into a "
                f"{bits}-bit group-{group_size} cache"
            )
    return bits, group_size


def _row_kv(cache: Any, group_size: int, bits: int) -> KV | None:
    """A single-sequence cache's filled KV as quantized tuples; None when it holds nothing."""
    if cache.keys is None or cache.offset == 0:
        return None
    if quantization(cache) is not None:
        return _time_slice((cache.keys, cache.values), 0, cache.offset)
    if isinstance(cache, KVCache):
        keys = cache.keys[..., : cache.offset, :]
        values = cache.values[..., : cache.offset, :]
        return _quantize(keys, group_size, bits), _quantize(values, group_size, bits)
    raise TypeError(f"cannot batch a {type(cache).__name__} into a quantized KV cache")


class BatchQuantizedKVCache(QuantizedAttention, _BaseCache):
    """``BatchKVCache`` (left-padded rows, one write index, per-row ``offset``) whose keys and
    values are quantized tuples. Same operations and semantics, so a batch drives it
    as it drives ``BatchKVCache``; ``bits``/``group_size`` make mlx-lm's attention quantized."""

    step = KVCache.step  # grow as mlx-lm's caches do
    row_class = QuantizedRowCache  # what `extract` gives

    def __init__(self, bits: int = 8, group_size: int = 64, left_padding: Sequence[int] = ()):
        self.kv_bits = bits
        self.kv_group_size = group_size
        self.keys: Quantized | None = None
        self.values: Quantized | None = None
        self.left_padding = mx.array(list(left_padding), dtype=mx.int32)
        self.offset = -self.left_padding
        self._idx = 0
        self._right_padding: mx.array | None = None

    # ------------------------------------------------------------------ writing

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Any:
        held = None if self.keys is None else (self.keys, self.values)
        self.keys, self.values = _store(held, self._idx, self._quantize(keys, values), self.step)
        n = keys.shape[2]
        self._idx += n
        self.offset = self.offset + n
        return self.keys_and_values()

    def keys_and_values(self) -> Any:
        return _time_slice((self.keys, self.values), 0, self._idx)

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None) -> None:
        if left_padding is not None:
            if self.keys is not None:
                raise ValueError("left padding can only be added to an empty cache")
            left_padding = mx.array(left_padding, dtype=mx.int32)
            self.left_padding = self.left_padding + left_padding
            self.offset = self.offset - left_padding
        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = mx.array(right_padding, dtype=mx.int32)

    def finalize(self) -> None:
        """Right padding (from a prefill of uneven rows) becomes left padding: roll each row."""
        if self._right_padding is None:
            return
        padding = self._right_padding
        if self.keys is not None:
            self.keys, self.values = tree_map(
                lambda x: dynamic_roll(x, padding[:, None], axis=2), (self.keys, self.values)
            )
        self.offset = self.offset - padding
        self.left_padding = self.left_padding + padding
        self._right_padding = None

    def trim(self, n: int) -> int:
        n = min(self._idx, n)
        self._idx -= n
        self.offset = self.offset - n
        return n

    def is_trimmable(self) -> bool:
        return True

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> mx.array:
        # Causal plus each row's left padding, as BatchKVCache.
        return create_causal_mask(N, offset=self._idx, left_padding=self.left_padding, **kwargs)

    # ------------------------------------------------------------------ rows in, rows out

    def filter(self, batch_indices: Sequence[int]) -> None:
        """Keep only these rows (in place), then drop padding every row shares."""
        index = mx.array(list(batch_indices), dtype=mx.int32)
        if self.keys is not None:
            self.keys, self.values = tree_map(lambda x: x[index], (self.keys, self.values))
        self.offset = self.offset[index]
        self.left_padding = self.left_padding[index]
        shared = min(self.left_padding.tolist(), default=0)
        if shared > 0:
            if self.keys is not None:
                self.keys, self.values = _time_slice((self.keys, self.values), shared, None)
            self._idx -= shared
            self.left_padding = self.left_padding - shared

    def extend(self, other: BatchQuantizedKVCache) -> None:
        """Append `other`'s rows (in place), right-justifying both at the longer write index."""
        if quantization(other) != quantization(self):
            raise ValueError("cannot extend a quantized cache with different bits or group size")
        parts = [(c.offset, c.left_padding) for c in (self, other)]
        if self.keys is None and other.keys is None:
            self.offset, self.left_padding = (mx.concatenate(x) for x in zip(*parts, strict=True))
            return
        like = (self.keys, self.values) if self.keys is not None else (other.keys, other.values)
        idx = max(self._idx, other._idx)
        size = max(c.keys[0].shape[2] for c in (self, other) if c.keys is not None)
        mine, theirs = (c._aligned(idx, size, like) for c in (self, other))
        self.keys, self.values = tree_map(lambda a, b: mx.concatenate([a, b]), mine, theirs)
        self.offset = mx.concatenate([self.offset, other.offset])
        self.left_padding = mx.concatenate([c.left_padding + (idx - c._idx) for c in (self, other)])
        self._idx = idx

    def _aligned(self, idx: int, size: int, like: KV) -> KV:
        """This cache's KV moved so its write index is `idx`, in a buffer of `size` steps."""
        if self.keys is None:
            rows = self.offset.shape[0]
            kv = tree_map(lambda x: mx.zeros((rows, x.shape[1], 0, x.shape[3]), x.dtype), like)
        else:
            kv = (self.keys, self.values)
        left = idx - self._idx
        kv = _time_slice(kv, 0, size - left)  # spare room that would overflow the buffer
        right = size - left - kv[0][0].shape[2]
        if left or right:
            widths = [(0, 0), (0, 0), (left, right), (0, 0)]
            kv = tree_map(lambda x: mx.pad(x, widths), kv)
        return kv

    def extract(self, idx: int) -> Any:
        """Row `idx` as a single-sequence cache holding only its own tokens."""
        row = self.row_class(group_size=self.kv_group_size, bits=self.kv_bits)
        if self.keys is None:
            return row
        padding = int(self.left_padding[idx].item())
        kv = tree_map(
            lambda x: mx.contiguous(x[idx : idx + 1, :, padding : self._idx]),
            (self.keys, self.values),
        )
        row.keys, row.values = kv
        row.offset = self._idx - padding
        return row

    @classmethod
    def merge(
        cls, caches: Sequence[Any], bits: int | None = None, group_size: int | None = None
    ) -> BatchQuantizedKVCache:
        """A batch of single-sequence caches, left-padded to the longest. Quantized rows must
        share bits and group size; full-precision ``KVCache`` rows are quantized here."""
        bits, group_size = _quant_params(caches, bits, group_size)
        rows = [_row_kv(c, group_size, bits) for c in caches]
        lengths = [0 if r is None else r[0][0].shape[2] for r in rows]
        longest = max(lengths, default=0)
        batch = cls(bits, group_size, [longest - n for n in lengths])
        if longest == 0:
            return batch
        like = next(r for r in rows if r is not None)

        def padded(row: KV | None, n: int) -> KV:
            if row is None:
                return tree_map(
                    lambda x: mx.zeros((1, x.shape[1], longest, x.shape[3]), x.dtype), like
                )
            widths = [(0, 0), (0, 0), (longest - n, 0), (0, 0)]
            return tree_map(lambda x: mx.pad(x, widths), row)

        parts = [padded(r, n) for r, n in zip(rows, lengths, strict=True)]
        batch.keys, batch.values = tree_map(lambda *xs: mx.concatenate(xs), *parts)
        batch.offset = batch.offset + longest
        batch._idx = longest
        return batch

    # ------------------------------------------------------------------ bookkeeping

    def size(self) -> int:
        return self._idx

    def empty(self) -> bool:
        return self.keys is None

    @property
    def state(self) -> tuple:
        return (
            self.keys,
            self.values,
            self.offset,
            self.left_padding,
            self._idx,
            self.kv_group_size,
            self.kv_bits,
        )

    @state.setter
    def state(self, v: tuple) -> None:
        keys, values, self.offset, self.left_padding, self._idx = v[:5]
        self.kv_group_size, self.kv_bits = v[5:]
        self.keys = None if keys is None else tuple(keys)
        self.values = None if values is None else tuple(values)
        self._right_padding = None

    @property
    def nbytes(self) -> int:
        return _kv_nbytes(self.keys, self.values)


class DequantizingRowCache(Dequantizing, QuantizedRowCache):
    """``QuantizedRowCache`` that hands back its tokens dequantized (see the module docstring)."""

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        return self._dequantized(super().keys_and_values())

    @classmethod
    def merge(cls, caches: Sequence[Any]) -> BatchDequantizingKVCache:
        return BatchDequantizingKVCache.merge(caches)


class BatchDequantizingKVCache(Dequantizing, BatchQuantizedKVCache):
    """``BatchQuantizedKVCache`` that hands back its tokens dequantized, left padding and all
    (see the module docstring)."""

    row_class = DequantizingRowCache

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        return self._dequantized(super().keys_and_values())
