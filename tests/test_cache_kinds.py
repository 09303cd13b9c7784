"""The table of cache kinds: every kind mlx-lm and the worker define has an entry, and the
answers are those the engine's modules gave before they asked the table (exact classes for
the promises, the nearest named base for measuring and adopting)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from typing import Any

import mlx.core as mx
import mlx_lm.models.cache as mlx_cache
import pytest
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    BatchRotatingKVCache,
    CacheList,
    ChunkedKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    _BaseCache,
)

import servicer.engine
from servicer.engine import cache_kinds
from servicer.engine.cache_kinds import KINDS, UNFAMILIAR, Bytes, adopt, bytes_of, kind_of
from servicer.engine.quantized_kv import (
    BatchDequantizingKVCache,
    BatchQuantizedKVCache,
    DequantizingRowCache,
    QuantizedRowCache,
)
from servicer.engine.row_groups import RowGroups
from servicer.engine.speculation.caches import (
    RaggedDequantizingKVCache,
    RaggedKVCache,
    RaggedQuantizedKVCache,
    RecurrentCache,
    RingKVCache,
)


def _cache_classes(module: Any) -> set[type]:
    return {
        cls
        for _, cls in inspect.getmembers(module, inspect.isclass)
        if issubclass(cls, _BaseCache)
        and cls is not _BaseCache
        and cls.__module__ == module.__name__
    }


def test_every_mlx_lm_cache_kind_has_an_entry():
    assert _cache_classes(mlx_cache) - set(KINDS) == set()


def test_every_cache_kind_the_worker_defines_has_an_entry():
    ours: set[type] = set()
    for info in pkgutil.walk_packages(servicer.engine.__path__, "servicer.engine."):
        ours |= _cache_classes(importlib.import_module(info.name))
    assert ours >= {QuantizedRowCache, RaggedKVCache, RecurrentCache}  # the walk finds them
    assert ours - set(KINDS) == set()


def _bare(cls: type, **attributes: Any) -> Any:
    """An instance for the type questions (no constructor: some need shapes)."""
    cache = cls.__new__(cls)
    cache.__dict__.update(attributes)
    return cache


# What the modules answered before the table, by their own tests (for the comparison below).
def _old_speculates(cache: Any) -> bool:  # speculation/support.py: exact classes
    if type(cache) is RotatingKVCache:
        return cache.keep == 0
    return type(cache) in (KVCache, ArraysCache)


def _old_adopts(layer: Any) -> bool:  # speculation/caches.py: an isinstance chain
    kinds = (RaggedKVCache, RingKVCache, RecurrentCache, BatchQuantizedKVCache, BatchKVCache)
    later = (RowGroups,)  # kinds that came after the table
    return isinstance(layer, (*kinds, *later, BatchRotatingKVCache, ArraysCache))


def _old_measure(layer: Any) -> str:  # memory.py: an isinstance chain
    if isinstance(layer, QuantizedKVCache):
        return "quantized"
    if isinstance(layer, KVCache | RotatingKVCache):
        return "window" if isinstance(layer, RotatingKVCache) else "kv"
    return "state" if isinstance(layer, ArraysCache) else "unfamiliar"


MEASURES = {
    cache_kinds._quantized_bytes: "quantized",
    cache_kinds._kv_bytes: "kv",
    cache_kinds._window_bytes: "window",
    cache_kinds._state_bytes: "state",
    None: "unfamiliar",
}


def _subclass(cls: type) -> type:
    return type(f"Own{cls.__name__}", (cls,), {})  # a model's own cache, unnamed here


@pytest.mark.parametrize("cls", [*KINDS, *(_subclass(c) for c in KINDS)], ids=lambda c: c.__name__)
@pytest.mark.parametrize("keep", [0, 4])
def test_each_answer_is_the_one_its_module_gave_before(cls: type, keep: int):
    cache = _bare(cls, keep=keep)
    kind = kind_of(cache)
    assert cache_kinds.speculates(cache) == _old_speculates(cache)
    rows = (KVCache, QuantizedRowCache, DequantizingRowCache)  # the prefix store's
    assert kind.attention_kv == (type(cache) in rows)
    assert kind.quantize == (type(cache) is KVCache)  # quantized_kv, parts
    assert kind.drafts == (type(cache) is KVCache)  # draft_model
    assert (kind.adopt is not None) == _old_adopts(cache)
    assert MEASURES[kind.measure] == _old_measure(cache)
    assert (kind.nested is not None) == isinstance(cache, CacheList)  # memory's flattening


def test_the_batch_kinds_held_in_row_groups_are_full_attention():
    held = {cls for cls, kind in KINDS.items() if kind.groups_rows}
    assert held == {
        BatchKVCache,
        BatchQuantizedKVCache,
        BatchDequantizingKVCache,
        RaggedKVCache,
        RaggedQuantizedKVCache,
        RaggedDequantizingKVCache,
    }
    assert not kind_of(_bare(_subclass(BatchKVCache))).groups_rows  # a model's own: not promised


def test_a_class_outside_the_table_is_unfamiliar():
    assert kind_of(object()) is UNFAMILIAR
    with pytest.raises(TypeError, match="cannot roll back per row"):
        adopt(_bare(ChunkedKVCache), 4)


def _kv(tokens: int, heads: int = 2, dim: int = 4, cache: Any = None) -> Any:
    cache = KVCache() if cache is None else cache
    data = mx.ones((1, heads, tokens, dim), dtype=mx.float16)
    cache.update_and_fetch(data, data)
    return cache


def test_bytes_per_token_window_and_fixed_state():
    assert bytes_of(_kv(3)) == Bytes((2 * (4 * 2 + 4 * 2), None))  # heads x (keys + values)
    assert bytes_of(_kv(3, cache=RotatingKVCache(max_size=8))) == Bytes((32, 8))
    state = ArraysCache(2)
    state[0] = mx.zeros((1, 10), dtype=mx.float32)
    assert bytes_of(state) == Bytes(fixed=40)
    assert bytes_of(KVCache()) == Bytes((1, None))  # nothing held yet: counted as unfamiliar


def test_a_cache_list_is_opened_to_its_layers():
    inner = [KVCache(), ArraysCache(1)]
    assert cache_kinds.layers([CacheList(*inner), RotatingKVCache(4)])[:2] == inner


def test_adopt_turns_each_batch_kind_into_the_one_that_rolls_back():
    batch = BatchKVCache.merge([_kv(3), _kv(1)])
    assert type(adopt(batch, 4)) is RaggedKVCache
    quantized = BatchQuantizedKVCache.merge([_kv(3, dim=32)], bits=8, group_size=32)
    assert type(adopt(quantized, 4)) is RaggedQuantizedKVCache
    rotating = BatchRotatingKVCache.merge([_kv(3, cache=RotatingKVCache(max_size=8))])
    ring = adopt(rotating, 4)
    assert type(ring) is RingKVCache and ring.capacity == 8 + 4
    recurrent = adopt(ArraysCache(2), 4, padding_inert=False)
    assert type(recurrent) is RecurrentCache and not recurrent.padding_inert
    assert adopt(ring, 4) is ring  # adopted already


def test_the_caches_grow_in_mlx_lms_steps():
    assert cache_kinds.GROWTH_STEP == KVCache.step == RaggedKVCache.step
    assert BatchQuantizedKVCache.step == cache_kinds.GROWTH_STEP
