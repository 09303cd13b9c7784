"""Every cache kind the engine meets (mlx-lm's and ours) and what may be done with it: one table.

A layer's cache kind decides whether the prefix store cuts it at any token or keeps it whole
at snapshots, whether `--kv-bits` quantizes it, whether a model keeping it can speculate
(mlx-lm's batch of it becomes a cache here that rolls back per row) or serve as a draft model,
how its bytes are measured for the admission guard, and which cache a speculating batch adopts
it as. Every other module asks this one: a new mlx-lm cache kind is one entry in `KINDS`.

An entry holds for its class exactly. A subclass the table does not name (a model's own cache)
keeps how its nearest named base is measured, adopted and flattened, but none of the promises
(`attention_kv`, `quantize`, `speculates`, `drafts`, `groups_rows`): a subclass may change what
they rest on.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    BatchRotatingKVCache,
    CacheList,
    ChunkedKVCache,
    ConcatenateKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from ..engine_config import KV_BITS, KV_GROUP_SIZES
from .quantized_kv import (
    BatchDequantizingKVCache,
    BatchQuantizedKVCache,
    DequantizingRowCache,
    QuantizedRowCache,
)
from .row_groups import RowGroups
from .speculation.caches import (
    RaggedDequantizingKVCache,
    RaggedKVCache,
    RaggedQuantizedKVCache,
    RecurrentCache,
    RingKVCache,
)

# mlx-lm's caches grow their buffers in steps of this many tokens; ours (BatchQuantizedKVCache,
# RaggedKVCache) take the same `KVCache.step`, and the admission guard rounds up to it.
GROWTH_STEP: int = KVCache.step


@dataclass(frozen=True)
class Bytes:
    """What one request's layer costs: bytes a token (up to a window, or None), or fixed."""

    per_token: tuple[int, int | None] | None = None
    fixed: int = 0


# A batch cache from mlx-lm's prefill -> the cache that rolls back per row (`extra`: the most
# tokens a verify gives back; `padding_inert`: the model honours per-row lengths).
Adopt = Callable[[Any, int, bool], Any]
# A speculating batch's cache -> mlx-lm's batch cache again, for a batch that has stopped
# drafting (mlx-lm's plain step is cheaper: one write index, no per-row scatter).
Release = Callable[[Any], Any]
Measure = Callable[[Any], Bytes | None]  # None: nothing to read yet (no keys)


@dataclass(frozen=True)
class CacheKind:
    """What the engine may do with one cache class (each field says which question it answers)."""

    note: str  # what the kind is, or why the engine cannot do more with it
    attention_kv: bool = False  # full-attention KV: the prefix store cuts it at any token
    quantize: bool = False  # --kv-bits holds it as a QuantizedRowCache (or a DequantizingRowCache)
    speculates: bool = False  # a prompt cache whose batch `adopt` turns into one that rolls back
    drafts: bool = False  # a draft model may keep it: its batch gives back any number of tokens
    sliding: bool = False  # a window; its kept sink tokens (`keep`) cannot be rolled back
    adopt: Adopt | None = None  # None: a speculating batch cannot hold it
    release: Release | None = None  # None: it stays as it is when drafting stops
    measure: Measure | None = None  # None: what one token made it hold, counted per token
    nested: Callable[[Any], list[Any]] | None = None  # a cache of caches: its layers
    groups_rows: bool = False  # a batch's full-attention KV that row_groups may hold in groups


def _quantized_bytes(layer: Any) -> Bytes | None:
    if layer.keys is None:
        return None
    parts = [*layer.keys, *layer.values]  # (batch, heads, tokens, packed) each
    mx.eval(parts)
    return Bytes((sum(p.shape[1] * p.shape[3] * p.dtype.size for p in parts), None))


def _kv_bytes(layer: Any) -> Bytes | None:
    if layer.keys is None:
        return None
    mx.eval(layer.keys, layer.values)
    keys, values = layer.keys, layer.values
    row = keys.shape[1] * (keys.shape[3] * keys.dtype.size + values.shape[3] * values.dtype.size)
    return Bytes((row, None))


def _window_bytes(layer: Any) -> Bytes | None:
    kv = _kv_bytes(layer)  # a sliding layer holds no more than its window
    return None if kv is None else replace(kv, per_token=(kv.per_token[0], layer.max_size))


def _state_bytes(layer: Any) -> Bytes:
    mx.eval([c for c in layer.cache if c is not None])
    return Bytes(fixed=layer.nbytes)  # recurrent state: the same at any length


def _as_is(layer: Any, extra: int, padding_inert: bool) -> Any:
    return layer  # already one of the caches that roll back per row


def _rows_merged(layer: Any) -> Any:
    """Each row as mlx-lm's single-sequence cache, merged as mlx-lm's batch (one copy)."""
    rows = [layer.extract(i) for i in range(layer.rows)]
    return rows[0].merge(rows)


def _batch(description: str, ragged: type) -> CacheKind:
    """mlx-lm's batch of full-attention rows, which a speculating batch adopts as `ragged`."""
    return CacheKind(
        description, groups_rows=True, adopt=lambda layer, extra, inert: ragged.adopt(layer)
    )


def _ragged(description: str) -> CacheKind:
    """A speculating batch's full-attention rows (adopted already), released merged."""
    return CacheKind(description, adopt=_as_is, release=_rows_merged, groups_rows=True)


KINDS: Mapping[type, CacheKind] = MappingProxyType(
    {
        # mlx-lm's single-sequence kinds, as models make them
        KVCache: CacheKind(
            "full attention",
            attention_kv=True,
            quantize=True,
            speculates=True,
            drafts=True,
            measure=_kv_bytes,
        ),
        RotatingKVCache: CacheKind(
            "a sliding window (with `keep` sink tokens); kept whole at snapshots",
            speculates=True,
            sliding=True,
            measure=_window_bytes,
        ),
        ArraysCache: CacheKind(
            "recurrent state (conv, SSM): fixed size, kept whole at snapshots",
            speculates=True,
            adopt=lambda layer, extra, inert: RecurrentCache.adopt(layer, inert),
            measure=_state_bytes,
        ),
        QuantizedKVCache: CacheKind(
            "mlx-lm's quantized KV: no model makes it (--kv-bits makes QuantizedRowCache)",
            measure=_quantized_bytes,
        ),
        ChunkedKVCache: CacheKind(
            "chunked attention (llama4 alone): no batched form here rolls it back",
        ),
        CacheList: CacheKind(
            "a layer's several caches: each is measured; no batched form rolls it back",
            nested=lambda cache: list(cache.caches),
        ),
        ConcatenateKVCache: CacheKind("no model makes it; it has no batched form"),
        # mlx-lm's batched kinds, as its prefill leaves them
        BatchKVCache: _batch("full attention, a batch", RaggedKVCache),
        BatchRotatingKVCache: CacheKind(
            "a sliding window, a batch",
            sliding=True,
            adopt=lambda layer, extra, inert: RingKVCache.adopt(layer, extra),
        ),
        # ours: --kv-bits (quantized_kv)
        QuantizedRowCache: CacheKind(
            "full attention, quantized (one request)", attention_kv=True, measure=_quantized_bytes
        ),
        BatchQuantizedKVCache: _batch("full attention, quantized, a batch", RaggedQuantizedKVCache),
        # ours: --kv-bits where the model's attention takes plain arrays only (quantized_kv):
        # stored quantized, handed back dequantized
        DequantizingRowCache: CacheKind(
            "full attention, quantized, dequantized for attention (one request)",
            attention_kv=True,
            measure=_quantized_bytes,
        ),
        BatchDequantizingKVCache: _batch(
            "full attention, quantized, dequantized for attention, a batch",
            RaggedDequantizingKVCache,
        ),
        # ours: a speculating batch's caches (speculation.caches), adopted already
        RaggedKVCache: _ragged("full attention, rows rolled back per row"),
        RaggedQuantizedKVCache: _ragged("RaggedKVCache, quantized"),
        RaggedDequantizingKVCache: _ragged("RaggedKVCache, quantized, dequantized for attention"),
        RingKVCache: CacheKind(
            "a sliding window, rolled back per row",
            sliding=True,
            adopt=_as_is,
            release=_rows_merged,
        ),
        RecurrentCache: CacheKind(
            "recurrent state, snapshot and replay", adopt=_as_is, measure=_state_bytes
        ),
        # ours: a batch's full-attention layer with its rows in groups (row_groups)
        RowGroups: CacheKind(
            "full attention, a batch in groups of similar length",
            adopt=lambda layer, extra, inert: layer.map(lambda g: adopt(g, extra, inert)),
            release=lambda layer: layer.map(release),
        ),
    }
)

# A class with no named base: what one token made it hold is counted per token.
UNFAMILIAR = CacheKind("a cache this table does not name")
# What an unnamed subclass does not inherit from its named base (see the module docstring).
_PROMISES = ("attention_kv", "quantize", "speculates", "drafts", "groups_rows")


def kind_of(cache: Any) -> CacheKind:
    """`cache`'s entry; for an unnamed subclass, its nearest named base's less the promises."""
    cls = type(cache)
    for base in cls.__mro__:
        kind = KINDS.get(base)
        if kind is not None:
            if base is cls:
                return kind
            return replace(kind, **dict.fromkeys(_PROMISES, False))
    return UNFAMILIAR


def speculates(cache: Any) -> bool:
    """Whether a model keeping `cache` (a prompt cache) can speculate: its batch rolls back
    per row. A window's kept sink tokens would have to stay where rolled-back tokens go."""
    kind = kind_of(cache)
    return kind.speculates and not (kind.sliding and cache.keep)


def adopt(layer: Any, extra: int, padding_inert: bool = True) -> Any:
    """One layer of a prefilled mlx-lm batch as the cache that rolls back here (`extra`:
    the most tokens a verify gives back, the ring's slots beyond the window)."""
    how = kind_of(layer).adopt
    if how is None:
        raise TypeError(f"{type(layer).__name__} cannot roll back per row")
    return how(layer, extra, padding_inert)


def release(layer: Any) -> Any:
    """One layer of a speculating batch that stopped drafting, as mlx-lm's batch cache where
    its kind has one (recurrent state steps the same either way and stays)."""
    how = kind_of(layer).release
    return layer if how is None else how(layer)


def grouped(caches: Sequence[Any]) -> list[Any]:
    """A batch's layers, each full-attention one as a `RowGroups` of one group."""
    return [RowGroups.of(c) if kind_of(c).groups_rows else c for c in caches]


def layers(caches: Sequence[Any]) -> list[Any]:
    """The caches that hold state, a cache of caches (CacheList) opened."""
    flat = []
    for cache in caches:
        nested = kind_of(cache).nested
        flat.extend(layers(nested(cache)) if nested is not None else [cache])
    return flat


def bytes_of(layer: Any) -> Bytes:
    """What `layer` (one request's, after a token) costs; a cache this table cannot read is
    counted at what it holds now, per token."""
    measure = kind_of(layer).measure
    size = measure(layer) if measure is not None else None
    return size if size is not None else Bytes((max(getattr(layer, "nbytes", 0), 1), None))


def make_row_cache(
    model: nn.Module, bits: int = 8, group_size: int = 64, dequantize: bool = False
) -> list[Any]:
    """One request's per-layer caches for ``BatchRunner.insert(caches=...)`` with
    --kv-bits: a ``QuantizedRowCache`` (with `dequantize`, a ``DequantizingRowCache``: for a
    model whose attention takes plain arrays only, see `check_quantization`) for each layer
    the table quantizes (plain full attention); every other kind as ``make_prompt_cache``
    makes it."""
    _check_settings(bits, group_size)
    return _quantized(make_prompt_cache(model), bits, group_size, dequantize)


def _quantized(caches: Sequence[Any], bits: int, group_size: int, dequantize: bool) -> list[Any]:
    row = DequantizingRowCache if dequantize else QuantizedRowCache
    return [row(group_size=group_size, bits=bits) if kind_of(c).quantize else c for c in caches]


def check_quantization(model: nn.Module, bits: int, group_size: int) -> str | None:
    """Which quantized cache serves `model` with --kv-bits: None when its attention runs on the
    quantized data (``QuantizedRowCache``), else why it cannot (attention sinks, MLA's latent cache,
    a direct call of ``mx.fast.scaled_dot_product_attention``, ``keys.astype``), the dequantizing
    kind (``DequantizingRowCache``: stored quantized, handed back as plain arrays) having run it
    instead. Refuses settings MLX cannot quantize with, and a model that runs on neither, before a
    prefill fails on them mid-batch. Whether `group_size` divides the quantized layers' head sizes
    is the caller's to choose (`parts.kv_group_size`, from the sizes measured on those layers)."""
    _check_settings(bits, group_size)
    if not any(kind_of(c).quantize for c in make_prompt_cache(model)):
        return None  # no layer is quantized (no plain attention KV cache): nothing to try
    name = type(model).__module__.rpartition(".")[2]
    quantized = _one_token(model, bits, group_size, dequantize=False)
    if quantized is None:
        return None
    why = f"mlx-lm's {name} model does not run on quantized keys and values ({quantized})"
    dequantized = _one_token(model, bits, group_size, dequantize=True)
    if dequantized is None:
        return why
    raise ValueError(
        f"mlx-lm's {name} model does not run on a quantized KV cache ({quantized}), nor on "
        f"one that hands back dequantized keys and values ({dequantized}); serve it without "
        "--kv-bits"
    )


def _one_token(model: nn.Module, bits: int, group_size: int, dequantize: bool) -> str | None:
    """One token through `model` on fresh quantized caches: None, or why it failed."""
    caches = _quantized(make_prompt_cache(model), bits, group_size, dequantize)
    try:
        mx.eval(model(mx.array([[0]]), cache=caches))
    except Exception as exc:
        reason = (str(exc).strip().splitlines() or [""])[0]
        if reason.endswith(":") and ". " in reason:  # "...: incompatible arguments. These:"
            reason = reason.rpartition(". ")[0]
        return f"{type(exc).__name__}: {reason}"
    return None


def _check_settings(bits: int, group_size: int) -> None:
    """Settings MLX can quantize with. The head sizes are not read off the model's config: its
    `head_dim` may be another layer kind's (gemma4_text's sliding layers' 32, beside global
    layers of 64) or no attention head at all (mamba2's SSM heads)."""
    if bits not in KV_BITS:
        raise ValueError(f"KV bits must be one of {KV_BITS}, got {bits}")
    if group_size not in KV_GROUP_SIZES:
        raise ValueError(f"KV group size must be one of {KV_GROUP_SIZES}, got {group_size}")
