"""A prefill chunk and the decoding rows in one forward (engine thread only).

On a memory-bound model a decode step costs about one read of every weight, for one row as
for 32; a prefill chunk beside it costs a second read. Here the chunk's tokens and the
decoding rows' tokens go through the model packed into one sequence: every position-wise
layer (projections, MLP, norms) runs once over both, and each attention runs per segment,
with that segment's own cache, positions and mask, exactly as the unfused forwards would.
Only the decoding rows go through the LM head.

It applies where the attention is one of the known standard ones (projections, optional
query/key norms, RoPE at the cache's offset, the cache's update, SDPA, the output
projection): `enable_fused_prefill` swaps their class for a subclass that takes the packed
path when its cache is a `Segments`, and behaves as before otherwise. The runner fuses a step
where one prompt is in prefill beside decoding rows (runner.BatchRunner._fused_step); other
steps run their forwards apart.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma3_text, llama, qwen2, qwen3
from mlx_lm.models.base import create_attention_mask, scaled_dot_product_attention

from .row_groups import PartMasks, RowGroups

# Attention classes whose forward is the standard one `_segment` reproduces, and the model
# classes around them whose head is `lm_head`, or the tied embedding.
_ATTENTION = (gemma3_text.Attention, llama.Attention, qwen2.Attention, qwen3.Attention)
_MODELS = (gemma3_text.Model, llama.Model, qwen2.Model, qwen3.Model)


class Segments:
    """One layer's caches for a packed forward: the chunk's (one row of `chunk` tokens) and
    the decoding rows' (`rows` rows of `width` tokens each), in that order in the sequence."""

    def __init__(self, chunk_cache: Any, chunk: int, decode_cache: Any, rows: int, width: int):
        self.parts = ((chunk_cache, 1, chunk), (decode_cache, rows, width))

    def make_mask(
        self, n: int, return_array: bool = False, window_size: int | None = None
    ) -> PartMasks:
        """What the model's own mask code asks of a layer's cache, asked of each segment's."""
        masks = []
        for cache, rows, width in self.parts:
            shaped = mx.zeros((rows, width, 1))  # create_attention_mask reads its shape only
            masks.append(create_attention_mask(shaped, cache, window_size, return_array))
        return PartMasks(masks)


class PackedAttention:
    """Mixed into a standard attention class by `enable_fused_prefill`: the per-segment path
    for a packed forward, the per-group path for a batch in row groups (row_groups), the
    class's own forward otherwise."""

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        if isinstance(cache, RowGroups):
            if cache.single:
                return super().__call__(x, mask.masks[0], cache.groups[0])  # type: ignore[misc]
            queries, keys, values = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # type: ignore[attr-defined]
            grouped = self._groups(queries, keys, values, x.shape[1], mask, cache)
            return self.o_proj(grouped)  # type: ignore[attr-defined]
        if not isinstance(cache, Segments):
            return super().__call__(x, mask, cache)  # type: ignore[misc]
        queries, keys, values = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # type: ignore[attr-defined]
        outputs, start = [], 0
        for (part_cache, rows, width), part_mask in zip(cache.parts, mask.masks, strict=True):
            end = start + rows * width
            projected = (queries[:, start:end], keys[:, start:end], values[:, start:end])
            outputs.append(self._attend(projected, rows, width, part_mask, part_cache))
            start = end
        return self.o_proj(mx.concatenate(outputs, axis=1))  # type: ignore[attr-defined]

    def _attend(
        self,
        projected: tuple[mx.array, mx.array, mx.array],
        rows: int,
        width: int,
        mask: Any,
        cache: Any,
    ) -> mx.array:
        """One segment's attention from its projected queries, keys and values, its rows in
        groups where its cache holds them so."""
        if not isinstance(cache, RowGroups):
            return self._segment(*projected, rows, width, mask, cache)
        if cache.single:
            return self._segment(*projected, rows, width, mask.masks[0], cache.groups[0])
        queries, keys, values = projected

        def shaped(t: mx.array) -> mx.array:
            return t.reshape(rows, width, -1)

        grouped = self._groups(shaped(queries), shaped(keys), shaped(values), width, mask, cache)
        return grouped.reshape(1, rows * width, -1)

    def _groups(
        self,
        queries: mx.array,
        keys: mx.array,
        values: mx.array,
        width: int,
        mask: PartMasks,
        cache: RowGroups,
    ) -> mx.array:
        """The attention of a batch (rows, width, ·) whose rows are in groups: each group's rows
        taken out, attended over their own cache, put back in batch order."""
        if len(mask.masks) != len(cache.groups):
            raise RuntimeError(
                f"{len(mask.masks)} group masks for a layer in {len(cache.groups)} groups"
            )
        outputs = []
        for group, take, part_mask in zip(cache.groups, cache.take, mask.masks, strict=True):
            n = int(take.shape[0])

            def part(t: mx.array, take: mx.array = take, n: int = n) -> mx.array:
                return t[take].reshape(1, n * width, -1)

            attended = self._segment(
                part(queries), part(keys), part(values), n, width, part_mask, group
            )
            outputs.append(attended.reshape(n, width, -1))
        return mx.concatenate(outputs)[cache.inverse]

    def _segment(
        self,
        queries: mx.array,
        keys: mx.array,
        values: mx.array,
        rows: int,
        width: int,
        mask: Any,
        cache: Any,
    ) -> mx.array:
        """The standard attention of one segment after its projections, back as (1, rows ·
        width, heads · head_dim)."""
        attention: Any = self
        queries = queries.reshape(rows, width, attention.n_heads, -1)
        keys = keys.reshape(rows, width, attention.n_kv_heads, -1)
        values = values.reshape(rows, width, attention.n_kv_heads, -1)
        if hasattr(attention, "q_norm"):
            queries, keys = attention.q_norm(queries), attention.k_norm(keys)
        queries = queries.transpose(0, 2, 1, 3)
        keys = keys.transpose(0, 2, 1, 3)
        values = values.transpose(0, 2, 1, 3)
        queries = attention.rope(queries, offset=cache.offset)
        keys = attention.rope(keys, offset=cache.offset)
        keys, values = cache.update_and_fetch(keys, values)
        output = scaled_dot_product_attention(
            queries, keys, values, cache=cache, scale=attention.scale, mask=mask
        )
        return output.transpose(0, 2, 1, 3).reshape(1, rows * width, -1)


def enable_fused_prefill(model: nn.Module) -> bool:
    """Make `model`'s attention take packed forwards, where it is a covered architecture
    (True); otherwise leave it as it is (False)."""
    if not isinstance(model, _MODELS):
        return False
    attentions = [layer.self_attn for layer in model.layers]
    if not all(type(a) in _ATTENTION or isinstance(a, PackedAttention) for a in attentions):
        return False
    for attention in attentions:
        original = type(attention)
        if not issubclass(original, PackedAttention):
            attention.__class__ = type(
                f"Packed{original.__name__}", (PackedAttention, original), {}
            )
    return True


def _head(model: nn.Module, hidden: mx.array) -> mx.array:
    if "lm_head" in model:
        return model.lm_head(hidden)
    return model.model.embed_tokens.as_linear(hidden)


def packed_forward(
    model: nn.Module,
    chunk: mx.array,
    chunk_caches: list[Any],
    inputs: mx.array,
    decode_caches: list[Any],
) -> mx.array:
    """The decoding rows' logits for `inputs` (rows, width), with the prompt `chunk` (1, n)
    put through the model into `chunk_caches` in the same forward."""
    rows, width = inputs.shape
    n = chunk.shape[1]
    packed = mx.concatenate([chunk, inputs.reshape(1, rows * width)], axis=1)
    caches = [
        Segments(c, n, d, rows, width) for c, d in zip(chunk_caches, decode_caches, strict=True)
    ]
    hidden = model.model(packed, cache=caches)
    return _head(model, hidden[:, n:].reshape(rows, width, -1))


class FusingModel:
    """What the generation batch calls as its model for one step: its first forward carries
    the staged chunk too; anything else goes to the model."""

    def __init__(self, model: nn.Module, chunk: mx.array, chunk_caches: list[Any]) -> None:
        self._model = model
        self._chunk = chunk
        self._chunk_caches = chunk_caches
        self.used = False

    def __call__(self, inputs: mx.array, cache: Any = None, **kwargs: Any) -> mx.array:
        if self.used or kwargs or cache is None or inputs.ndim != 2:
            return self._model(inputs, cache=cache, **kwargs)
        self.used = True
        return packed_forward(self._model, self._chunk, self._chunk_caches, inputs, cache)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)
