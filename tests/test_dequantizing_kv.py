"""--kv-bits on models whose attention cannot take quantized tuples (gpt_oss's attention sinks,
deepseek_v3's MLA latent cache): the dequantizing cache kind stores keys and values quantized
and hands them back dequantized, so the model's own attention runs on the values a quantized
cache holds. A batch of prompts of different lengths gives each row the logits of mlx-lm's
single-sequence run with keys and values quantized and dequantized (bench/families.py's
round-trip reference, what the family matrix compares the kv8 cell with)."""

from __future__ import annotations

from typing import Any

import families
import mlx.core as mx
import pytest
from mlx_lm.generate import _merge_caches, _right_pad_prompts
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.utils import _get_classes

from servicer.engine.arch_fixes import fix_for_batching
from servicer.engine.cache_kinds import (
    adopt,
    bytes_of,
    check_quantization,
    kind_of,
    make_row_cache,
)
from servicer.engine.parts import cache_head_sizes, kv_group_size
from servicer.engine.prefix.store import CacheLayout
from servicer.engine.quantized_kv import (
    BatchDequantizingKVCache,
    DequantizingRowCache,
    QuantizedRowCache,
    quantization,
)
from servicer.engine.speculation.caches import RaggedDequantizingKVCache

PROMPTS = ([5, 17, 42, 99, 3, 61], [7, 8, 9, 10, 11, 12, 13, 200, 201, 4, 6])
FOLLOW = ([1, 2, 3, 4], [20, 21, 22, 23])


def build(arch: str) -> Any:
    """A tiny random-weight model of `arch` from the family matrix's config, with its kv8
    overrides merged (head sizes MLX can quantize), as the kv8 cell builds it."""
    variants = families.load_configs()[arch].get("families", {})
    config = families.arch_config(arch, "kv8" if "kv8" in variants else None)
    config.pop("families", None)
    model_class, args_class = _get_classes(config)
    mx.random.seed(0)
    model = model_class(args_class.from_dict(config))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    fix_for_batching(model)  # as the worker serves it
    return model


def alone(model: Any, group: int, prompt: list[int], follow: list[int]) -> list[mx.array]:
    """The round-trip reference: one sequence, keys and values quantized and dequantized as
    they enter plain KVCaches, the model's own attention."""
    cache = families.quantized_cache(model, group, round_trip=True)
    logits = [model(mx.array([prompt]), cache=cache)[0, -1]]
    logits += [model(mx.array([[t]]), cache=cache)[0, -1] for t in follow]
    return logits


def together(model: Any, group: int) -> tuple[list[mx.array], list[Any]]:
    """Both prompts as mlx-lm's BatchGenerator runs them on the worker's --kv-bits rows: the
    rows merged, the prompts but their last tokens prefilled right-padded and rolled into left
    padding, then one decode step a token."""
    rows = [make_row_cache(model, 8, group, dequantize=True) for _ in PROMPTS]
    cache = _merge_caches(rows)
    heads = [p[:-1] for p in PROMPTS]
    lengths = [len(h) for h in heads]
    width = max(lengths)
    padding = [width - n for n in lengths]
    for c in cache:
        c.prepare(lengths=lengths, right_padding=padding)
    model(_right_pad_prompts(heads, max_length=width), cache=cache)
    for c in cache:
        c.finalize()
    logits = [model(mx.array([[p[-1]] for p in PROMPTS]), cache=cache)[:, -1]]
    for step in range(len(FOLLOW[0])):
        logits.append(model(mx.array([[f[step]] for f in FOLLOW]), cache=cache)[:, -1])
    return logits, cache


@pytest.mark.parametrize(
    ("arch", "cause"), [("gpt_oss", "attention sinks"), ("deepseek_v3", "swapaxes")]
)
def test_a_batch_gives_each_row_the_round_trip_logits(arch: str, cause: str) -> None:
    model = build(arch)
    group = kv_group_size(cache_head_sizes(model), None)
    why = check_quantization(model, 8, group)  # refused the model before
    assert why is not None and cause in why
    got, cache = together(model, group)
    assert any(isinstance(c, BatchDequantizingKVCache) for c in cache)
    for c in cache:
        if isinstance(c, BatchDequantizingKVCache):
            assert quantization(c) == (8, group)
            assert c.keys[0].dtype == mx.uint32  # stored quantized
    for row, (prompt, follow) in enumerate(zip(PROMPTS, FOLLOW, strict=True)):
        want = alone(model, group, prompt, follow)
        for step, logits in enumerate(got):
            assert mx.allclose(logits[row], want[step], atol=1e-4).item(), (row, step)


def _kv(seed: int, n: int, dtype: Any = mx.float32) -> tuple[mx.array, mx.array]:
    k1, k2 = mx.random.split(mx.random.key(seed))
    return (
        mx.random.normal((1, 2, n, 64), key=k1).astype(dtype),
        mx.random.normal((1, 2, n, 64), key=k2).astype(dtype),
    )


def _rounded(x: mx.array) -> mx.array:
    return mx.dequantize(*mx.quantize(x, group_size=32, bits=8), group_size=32, bits=8)


def test_the_dequantizing_kind_stores_what_the_quantized_kind_stores() -> None:
    """Same buffers and bytes as QuantizedRowCache, no `bits` for mlx-lm's attention to take
    the quantized path on, plain arrays in the model's dtype back; its batch, the row a batch
    gives back, the speculating batch and the prefix store's rows are all of the kind."""
    keys, values = _kv(0, 5, mx.bfloat16)
    plain, quantized = DequantizingRowCache(32, 8), QuantizedRowCache(32, 8)
    got = plain.update_and_fetch(keys, values)
    quantized.update_and_fetch(keys, values)
    assert not hasattr(plain, "bits") and not hasattr(plain, "group_size")
    assert quantization(plain) == quantization(quantized) == (8, 32)
    for a, b in zip((plain.keys, plain.values), (quantized.keys, quantized.values), strict=True):
        assert all(mx.array_equal(x, y).item() for x, y in zip(a, b, strict=True))
    assert plain.nbytes == quantized.nbytes and bytes_of(plain) == bytes_of(quantized)
    assert [x.dtype for x in got] == [mx.bfloat16, mx.bfloat16]
    assert mx.array_equal(got[0], _rounded(keys)).item()
    assert mx.array_equal(got[1], _rounded(values)).item()
    # mlx-lm's attention takes its plain path: no quantized matmul on the arrays handed back
    queries = mx.random.normal((1, 2, 1, 64)).astype(mx.bfloat16)
    scaled_dot_product_attention(queries, *got, cache=plain, scale=0.125, mask=None)

    other = DequantizingRowCache(32, 8)
    other.update_and_fetch(*_kv(1, 3))
    batch = DequantizingRowCache.merge([plain, other])
    assert isinstance(batch, BatchDequantizingKVCache) and not hasattr(batch, "bits")
    keys_back, _ = batch.update_and_fetch(*(mx.concatenate([x] * 2) for x in _kv(2, 1)))
    assert keys_back.shape == (2, 2, 6, 64) and keys_back.dtype == mx.float32
    row = batch.extract(1)
    assert type(row) is DequantizingRowCache and row.offset == 4
    ragged = adopt(batch, 4)
    assert type(ragged) is RaggedDequantizingKVCache and not hasattr(ragged, "bits")
    keys_back, _ = ragged.update_and_fetch(*(mx.concatenate([x] * 2) for x in _kv(3, 1)))
    assert keys_back.dtype == mx.float32
    assert type(ragged.extract(0)) is DequantizingRowCache

    layout = CacheLayout.of([row])
    assert layout.quantized == (8, 32) and layout.kv == (0,)
    keys_state, values_state, length, *_ = row.state
    stored = layout.kv_cache(keys_state, values_state, length)
    assert type(stored) is DequantizingRowCache and kind_of(stored).attention_kv
    assert mx.array_equal(stored.keys_and_values()[0], row.keys_and_values()[0]).item()
