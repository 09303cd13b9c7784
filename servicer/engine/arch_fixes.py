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


FIXES: dict[str, Callable[[nn.Module], int]] = {
    "afm7": _afm7,
    "gemma2": _gemma2,
    "gpt_bigcode": _gpt_bigcode,
}


def fix_for_batching(model: nn.Module) -> None:
    """Apply the model's architecture's fix, if it has one (a second call changes nothing)."""
    model_type = getattr(model, "model_type", None)
    fix = FIXES.get(model_type or "")
    if fix is None:
        return
    count = fix(model)
    log.info("%s: %d module(s) fixed for batching", model_type, count)
