"""mlx-lm architectures whose code breaks in a batch, and what the engine does about each.

Two kinds of answer:
- a fix in place after loading: the affected modules' class is swapped for a subclass that
  turns what a batch gives them (a per-row mask, per-row offsets) into what the original code
  expects. With one sequence (an integer offset, a shared mask) each fix runs the original
  code unchanged, so mlx-lm's single-sequence output is the reference;
- prompts prefilled one at a time, for layers that read the batch's left padding as input
  (`PADDING_BLIND`): merged into the decoding batch afterwards, they are exact.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask, scaled_dot_product_attention
from mlx_lm.models.cache import ChunkedKVCache, KVCache

log = logging.getLogger(__name__)

# Recurrent or convolution layers that read mlx-lm's left padding as input: prompts of
# different lengths prefilled together get wrong state (mlx-lm 0.32's BatchGenerator gives the
# same wrong tokens); longcat_flash_ngram's n-gram embeddings hash the padding in with a
# row's first tokens. nemotron_h's layers do take padding, yet its batched prefill differs from
# its single-sequence one past any near tie (family matrix, random weights); alone it is exact.
PADDING_BLIND = frozenset(
    {
        "afm7",
        "baichuan_m1",
        "bailing_moe_linear",
        "falcon_mamba",
        "jamba",
        "longcat_flash_ngram",
        "mamba",
        "nemotron_h",
        "olmo_hybrid",
        "recurrent_gemma",
        "rwkv7",
    }
)


# Architectures whose mlx-lm code is wrong for one sequence as well, so no batching fix can
# make them right: refused at start with the reason rather than served wrong.
UNSERVABLE = {
    "phi3small": (
        "mlx-lm 0.32's phi3small block-sparse attention adds its boolean causal mask to the "
        "scores as numbers (+1 / +0, not -inf), so a prompt's tokens attend to later tokens of "
        "their 64-token block; the worker refuses it rather than serve that output"
    ),
}


class UnservableModel(ValueError):
    """mlx-lm computes this architecture wrongly even for one sequence."""


def prefill_rows(model_type: str, configured: int) -> int:
    """Most prompts prefilled together: one for a model whose layers cannot take padding."""
    if model_type in PADDING_BLIND and configured > 1:
        log.info("%s prefills one prompt at a time (its layers read padding)", model_type)
        return 1
    return configured


class GroupedScoresMask:
    """gemma2: scores are grouped (B, kv_heads, repeats, L, S) while a batch's mask is
    (B, 1, L, S); a shared (L, S) mask broadcasts either way."""

    repeats: int

    def __call__(self, x: mx.array, mask: mx.array | None = None, cache: Any = None) -> mx.array:
        if mask is not None and mask.ndim == 4 and self.repeats > 1:
            mask = mx.expand_dims(mask, 2)
        return super().__call__(x, mask, cache)  # type: ignore[misc]


class RowPositions:
    """gpt_bigcode: learned absolute positions, read with numpy from an integer offset; a
    batch's offset is one per row (negative over left padding, which the mask hides)."""

    wte: nn.Embedding
    wpe: nn.Embedding
    h: list[nn.Module]
    ln_f: nn.Module

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None) -> mx.array:
        offset = None if cache is None else cache[0].offset
        if not isinstance(offset, mx.array):
            return super().__call__(inputs, cache)  # type: ignore[misc]
        assert cache is not None
        hidden = self.wte(inputs)
        mask = create_attention_mask(hidden, cache[0])
        positions = mx.maximum(offset.reshape(-1, 1) + mx.arange(inputs.shape[1]), 0)
        hidden = hidden + self.wpe(positions)
        for layer, layer_cache in zip(self.h, cache, strict=True):
            hidden = layer(hidden, mask, cache=layer_cache)
        return self.ln_f(hidden)


class RowQueryPositions:
    """afm7: the KV-reuse layers place their queries at the shared cache's length minus the
    chunk; in a batch that length counts each row's left padding. A row's own position is the
    shared cache's offset (one per row) minus the chunk."""

    embedding: nn.Embedding
    layers: list[nn.Module]
    kv_reuse_layers: list[nn.Module]
    output_norm: nn.Module

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None) -> mx.array:
        offset = None if cache is None else cache[-1].offset
        if not isinstance(offset, mx.array):
            return super().__call__(inputs, cache)  # type: ignore[misc]
        assert cache is not None
        hidden = self.embedding(inputs)
        mask = create_attention_mask(hidden, cache[0])
        for layer, layer_cache in zip(self.layers, cache):  # noqa: B905 - as mlx-lm's own
            hidden = layer(hidden, mask, cache=layer_cache)
        keys, values = cache[-1].keys_and_values()
        start = cache[-1].offset - inputs.shape[1]
        for block in self.kv_reuse_layers:
            hidden = _kv_reuse_block(block, hidden, keys, values, mask, start)
        return self.output_norm(hidden)


def _kv_reuse_block(
    block: Any, x: mx.array, keys: mx.array, values: mx.array, mask: Any, start: mx.array
) -> mx.array:
    """mlx-lm's KVReuseTransformerBlock with its queries at per-row positions `start`."""
    attention = block.self_attn
    normed = block.input_layernorm(x)
    batch, length, _ = normed.shape
    queries = attention.q_proj(normed).reshape(batch, length, attention.n_heads, -1)
    queries = attention.q_norm(attention.rope(queries.transpose(0, 2, 1, 3), offset=start))
    out = scaled_dot_product_attention(
        queries, keys, values, cache=None, scale=attention.scale, mask=mask
    )
    hidden = x + attention.out_proj(out.transpose(0, 2, 1, 3).reshape(batch, length, -1))
    return hidden + block.mlp(block.post_attention_layernorm(hidden))


class WholeHistoryCaches:
    """llama4: mlx-lm's ChunkedKVCache cannot join a batch (it has no batched form); the
    chunked-attention layers keep the whole history in a plain KV cache instead, and their mask
    keeps each query to its own chunk (`ChunkedRowMasks`). Past one chunk (8,192 tokens on the
    real models) those layers hold more than mlx-lm's cache would, as the global layers do."""

    layers: list[nn.Module]

    def make_cache(self) -> list[Any]:
        return [KVCache() for _ in self.layers]


class ChunkedRowMasks:
    """llama4's text model: the chunked layers' mask from per-row positions. A batch's caches
    give each row's first slot (its left padding) and its length so far (`offset`)."""

    embed_tokens: nn.Embedding
    layers: list[nn.Module]
    norm: nn.Module
    attention_chunk_size: int

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None) -> mx.array:
        if cache is None or isinstance(cache[0], ChunkedKVCache):
            return super().__call__(inputs, cache)  # type: ignore[misc]
        hidden = self.embed_tokens(inputs)
        global_mask = create_attention_mask(hidden, cache[3], return_array=True)
        chunk_mask = _same_chunk(cache[0], inputs.shape[1], self.attention_chunk_size)
        if global_mask is not None and not isinstance(global_mask, str):
            chunk_mask = chunk_mask & global_mask
        for index, (layer, layer_cache) in enumerate(zip(self.layers, cache, strict=True)):
            mask = chunk_mask if (index + 1) % 4 != 0 else global_mask
            hidden = layer(hidden, mask, cache=layer_cache)
        return self.norm(hidden)


def _same_chunk(cache: Any, length: int, chunk: int) -> mx.array:
    """True where a key slot is at or before the query and in the query's chunk: (L, S) for
    one sequence, (B, 1, L, S) for a batch."""
    offset = cache.offset
    if not isinstance(offset, mx.array):
        queries = mx.arange(offset, offset + length)[:, None]
        keys = mx.arange(offset + length)[None]
        return (keys <= queries) & (keys // chunk == queries // chunk)
    first = _first_slots(cache)
    width = int(mx.max(first + offset).item()) + length
    queries = (offset[:, None] + mx.arange(length))[:, None, :, None]
    keys = mx.arange(width)[None, None, None, :] - first[:, None, None, None]
    return (keys <= queries) & (keys // chunk == queries // chunk)


def _first_slots(cache: Any) -> mx.array:
    """Where each row's first token sits in a batch cache's buffer."""
    padding = getattr(cache, "left_padding", None)
    if padding is not None:
        return padding
    return mx.array(cache.row_starts)


class RowTemperature:
    """llama4's attention without positions scales its queries by their position (temperature
    tuning) from an integer offset; a batch's offset is one per row, negative over padding."""

    use_rope: int
    attn_temperature_tuning: int
    floor_scale: int
    attn_scale: float
    n_heads: int
    n_kv_heads: int
    scale: float
    q_proj: nn.Module
    k_proj: nn.Module
    v_proj: nn.Module
    o_proj: nn.Module

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        offset = None if cache is None else cache.offset
        if self.use_rope or not self.attn_temperature_tuning or not isinstance(offset, mx.array):
            return super().__call__(x, mask, cache)  # type: ignore[misc]
        batch, length, _ = x.shape

        def heads(projected: mx.array, count: int) -> mx.array:
            return projected.reshape(batch, length, count, -1).transpose(0, 2, 1, 3)

        queries = heads(self.q_proj(x), self.n_heads)
        keys = heads(self.k_proj(x), self.n_kv_heads)
        values = heads(self.v_proj(x), self.n_kv_heads)
        positions = mx.maximum(offset[:, None] + mx.arange(1, length + 1), 0)
        scales = mx.log(mx.floor(positions / self.floor_scale) + 1.0) * self.attn_scale + 1.0
        queries = (queries * scales[:, None, :, None]).astype(queries.dtype)
        keys, values = cache.update_and_fetch(keys, values)
        out = scaled_dot_product_attention(
            queries, keys, values, cache=cache, scale=self.scale, mask=mask
        )
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(batch, length, -1))


def _swap_class(module: nn.Module, fix: type) -> None:
    original = type(module)
    if issubclass(original, fix):
        return
    module.__class__ = type(f"Batched{original.__name__}", (fix, original), {})


def _gemma2(model: nn.Module) -> int:
    attentions = [layer.self_attn for layer in model.layers]
    for attention in attentions:
        _swap_class(attention, GroupedScoresMask)
    return len(attentions)


def _gpt_bigcode(model: nn.Module) -> int:
    _swap_class(model.transformer, RowPositions)
    return 1


def _afm7(model: nn.Module) -> int:
    _swap_class(model.model, RowQueryPositions)
    return 1


def _llama4(model: nn.Module) -> int:
    _swap_class(model, WholeHistoryCaches)
    _swap_class(model.language_model.model, ChunkedRowMasks)
    attentions = [layer.self_attn for layer in model.layers]
    for attention in attentions:
        _swap_class(attention, RowTemperature)
    return 2 + len(attentions)


FIXES: dict[str, Callable[[nn.Module], int]] = {
    "afm7": _afm7,
    "gemma2": _gemma2,
    "gpt_bigcode": _gpt_bigcode,
    "llama4": _llama4,
}


def fix_for_batching(model: nn.Module) -> None:
    """Apply the model's architecture's fix, if it has one (a second call changes nothing)."""
    model_type = getattr(model, "model_type", None)
    if model_type in UNSERVABLE:
        raise UnservableModel(f"{model_type}: {UNSERVABLE[model_type]}")
    fix = FIXES.get(model_type or "")
    if fix is None:
        return
    count = fix(model)
    log.info("%s: %d module(s) fixed for batching", model_type, count)
