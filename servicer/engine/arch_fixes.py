"""mlx-lm architectures whose code breaks in a batch, and what the engine does about each.

Three kinds of answer:
- a fix in place after loading: the affected modules' class is swapped for a subclass that
  turns what a batch gives them (a per-row mask, per-row offsets) into what the original code
  expects. With one sequence (an integer offset, a shared mask) each fix runs the original
  code unchanged, so mlx-lm's single-sequence output is the reference. Two exceptions:
  plamo3's cache (`WindowPlusOneCaches`) holds one token more than mlx-lm 0.32 gives it, so
  that decode sees the window its mask (and HF's model) gives prompt tokens; its reference
  is mlx-lm's forward with no cache, which any chunking now equals; phi3small's
  block-sparse layers (`BlockSparseRowMasks`) are wrong alone in mlx-lm 0.32 (not causal inside
  a block); its reference is mlx-lm's model with the fix;
- prompts prefilled one at a time, for layers that read the batch's left padding as input
  (`PADDING_BLIND`): merged into the decoding batch afterwards, they are exact;
- a refusal at start with the reason (`UNSERVABLE`), where its caches have no batched form.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask, scaled_dot_product_attention
from mlx_lm.models.cache import ChunkedKVCache, KVCache, RotatingKVCache

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


# Architectures whose fix changes one sequence's output too (the fix is the right one; the
# reference for such a model is mlx-lm's generation with the fix applied).
CHANGES_ONE_SEQUENCE = frozenset({"phi3small", "plamo3"})

# Architectures refused at start with the reason: their caches have no batched form and giving
# them one is a large piece of work. Each entry: (still applies to this model?, the reason).
UNSERVABLE: dict[str, tuple[Callable[[nn.Module], bool], str]] = {
    # A batched deepseek_v41 needs per-row positions through the window indices, the
    # compressor's open groups (a different number of pending rows per row), the compressed
    # KV and index keys (a different count per row) and the indexer's visible groups, plus
    # merge/extract/filter/extend for LayerCache and the prefix store's snapshots of it.
    "deepseek_v41": (
        lambda model: not all(hasattr(c, "merge") for c in model.make_cache()),
        "mlx-lm 0.32's deepseek_v41 LayerCache (sliding window, compressed KV groups, index "
        "keys) has no batched form (no merge, extract or filter) and its forward takes one "
        "integer position for every row; the worker batches every request, so it refuses it",
    ),
}


class UnservableModel(ValueError):
    """The worker refuses this architecture (`UNSERVABLE` says why)."""


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
    queries, keys = _positions(cache, length)
    queries, keys = queries[:, :, None], keys[:, None, :]
    same = (keys <= queries) & (keys // chunk == queries // chunk)  # (B or 1, L, S)
    return same[:, None] if isinstance(cache.offset, mx.array) else same[0]


def _positions(cache: Any, length: int) -> tuple[mx.array, mx.array]:
    """The positions of this step's `length` queries and of every key slot once they are
    stored: (B, L) and (B, S) for a batch (negative over a row's padding), (1, L) and (1, S)
    for one sequence or no cache. Read before the step stores its keys."""
    offset = 0 if cache is None else cache.offset
    if not isinstance(offset, mx.array):
        return mx.arange(offset, offset + length)[None], mx.arange(offset + length)[None]
    first = _first_slots(cache)
    width = int(mx.max(first + offset).item()) + length
    return offset[:, None] + mx.arange(length), mx.arange(width)[None] - first[:, None]


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


class WindowPlusOneCaches:
    """plamo3: its sliding-window mask lets each token see itself and the `window_size` tokens
    before it (HF PLaMo 3's width), but mlx-lm 0.32 gives those layers a
    `RotatingKVCache(max_size=window_size)`: a decode step sees one earlier token less than a prompt
    token, and a prefill chunk's first token as well (the cache keeps `max_size - 1` earlier tokens
    between calls), so the output changes with the chunking. A window of `window_size + 1` slots (as
    later mlx-lm makes it) holds what the mask lets every token see, in prefill chunks of any size
    and in decode: a whole sequence through the model with no cache at all gives the same logits."""

    def make_cache(self) -> list[Any]:
        window = self.config.window_size  # type: ignore[attr-defined]
        caches = super().make_cache()  # type: ignore[misc]
        return [
            RotatingKVCache(max_size=window + 1, keep=c.keep)
            if type(c) is RotatingKVCache and c.max_size == window
            else c
            for c in caches
        ]


class AttentionLayerCaches:
    """nemotron-nas: mlx-lm makes a KV cache for every layer whose attention is not a no-op,
    the linear replacements (`replace_with_linear`) included, which never write theirs; an
    empty cache in a batch breaks mlx-lm's batch caches (`extract` of a cache with no keys).
    Only the layers with real attention get a cache; `AttentionCachesOnly` hands them out."""

    layers: list[nn.Module]

    def make_cache(self) -> list[Any]:
        return [KVCache() for layer in self.layers if _attends(layer)]


class AttentionCachesOnly:
    """nemotron-nas's model: each layer with real attention takes the next cache, every other
    layer none (a linear replacement ignores it). With mlx-lm's own cache list (one per
    layer that is not a no-op) the original code runs."""

    embed_tokens: nn.Embedding
    layers: list[nn.Module]
    norm: nn.Module
    num_attn_layers: int

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None) -> mx.array:
        if cache is None or len(cache) == self.num_attn_layers:
            return super().__call__(inputs, cache)  # type: ignore[misc]
        hidden = self.embed_tokens(inputs)
        mask = create_attention_mask(hidden, cache[0] if cache else None)
        caches = iter(cache)
        for layer in self.layers:
            hidden = layer(hidden, mask, cache=next(caches) if _attends(layer) else None)
        return self.norm(hidden)


def _attends(layer: nn.Module) -> bool:
    """A nemotron-nas layer with real attention (not a no-op, not a linear replacement)."""
    attention = getattr(layer, "self_attn", None)
    if attention is None:
        return False
    module = sys.modules[type(layer).__module__]
    return not isinstance(attention, module.LinearSubblockReplacement)


class RowBlocks:
    """minimax_m3_vl's sparse attention: its indexer cuts the keys into blocks by cache slot
    and keeps each query's top-k blocks (and its own); in a batch the slots count a row's
    left padding, so a row whose padding is not a multiple of the block size gets other block
    boundaries and keeps other keys than alone. Here the blocks are cut at each row's own
    positions (slot minus the row's first slot) and a query's own block is the one of its
    position; one sequence (an integer offset) runs the original code."""

    index_n_heads: int
    index_head_dim: int
    index_block_size: int
    index_topk_blocks: int
    index_local_blocks: int
    num_attention_heads: int
    index_k_proj: nn.Module
    index_k_norm: nn.Module
    index_q_proj: nn.Module
    index_q_norm: nn.Module
    index_rope: nn.Module

    def _block_mask(self, x: mx.array, mask: Any, offset: Any, cache: Any) -> Any:
        if cache is None or not isinstance(offset, mx.array):
            return super()._block_mask(x, mask, offset, cache)  # type: ignore[misc]
        batch, length, _ = x.shape
        heads, dim = self.index_n_heads, self.index_head_dim
        block, topk = self.index_block_size, self.index_topk_blocks
        positions = offset[:, None] + mx.arange(length)  # (B, L): each query's own position

        keys = self.index_k_proj(x).reshape(batch, length, 1, dim)
        keys = self.index_rope(self.index_k_norm(keys).transpose(0, 2, 1, 3), offset=offset)
        keys, _ = cache.update_and_fetch(keys, mx.zeros((batch, 1, length, 0), keys.dtype))
        slots = keys.shape[2]
        blocks = -(-slots // block)
        if topk >= blocks:  # no row has more blocks than the budget: nothing is dropped
            return mask

        queries = self.index_q_proj(x).reshape(batch, length, heads, dim)
        queries = self.index_rope(self.index_q_norm(queries).transpose(0, 2, 1, 3), offset=offset)
        first = _first_slots(cache)[:, None]  # (B, 1)
        key_positions = mx.arange(slots)[None] - first  # (B, S): negative over padding
        if isinstance(mask, mx.array):
            per_key = mask
        else:
            seen = key_positions[:, None, :] <= positions[:, :, None]
            per_key = (seen & (key_positions[:, None, :] >= 0))[:, None]
        scores = queries.astype(mx.float32) @ keys.astype(mx.float32).swapaxes(-1, -2)
        scores = mx.where(per_key, scores, -mx.inf)  # (B, H, L, S)

        # Each row's scores from its first slot on, so that block n holds its positions
        # n * block ... (n + 1) * block - 1; slots past the buffer score -inf.
        aligned = mx.arange(blocks * block)[None] + first  # (B, P): slot of each position
        inside = aligned < slots
        gathered = mx.take_along_axis(
            scores, mx.minimum(aligned, slots - 1)[:, None, None, :], axis=-1
        )
        gathered = mx.where(inside[:, None, None, :], gathered, -mx.inf)
        block_scores = gathered.reshape(batch, heads, length, blocks, block).max(axis=-1)
        if self.index_local_blocks > 0:
            own = (positions // block)[:, None, :, None]  # (B, 1, L, 1)
            ids = mx.arange(blocks)
            local = (ids <= own) & (ids > own - self.index_local_blocks)
            block_scores = mx.where(local, mx.inf, block_scores)

        chosen = mx.stop_gradient(mx.argpartition(-block_scores, kth=topk - 1, axis=-1))
        keep = mx.put_along_axis(
            mx.zeros(block_scores.shape, dtype=mx.bool_),
            chosen[..., :topk],
            mx.array(True),
            axis=-1,
        )
        # Back from positions to slots: slot s of row b holds position s - first[b].
        by_position = mx.repeat(keep, block, axis=-1)  # (B, H, L, P)
        index = mx.clip(key_positions, 0, blocks * block - 1)[:, None, None, :]
        keep = mx.take_along_axis(by_position, index, axis=-1) & per_key
        return mx.repeat(keep, self.num_attention_heads // heads, axis=1)


class BlockSparseRowMasks:
    """phi3small's model: one mask per forward for its block-sparse layers, from each row's own
    positions, which those layers then use in mlx-lm's dense attention (`_phi3small` turns
    their `block_sparse` off). A query sees a key at or before it whose block is one of its
    `blocksparse_num_local_blocks` latest, or on the head's vertical stride (every
    `blocksparse_vert_stride`-th block). mlx-lm 0.32's block-sparse attention adds its boolean
    causal mask to the scores as numbers (+1 / +0: a prompt's tokens see later tokens of their
    block, alone too), cuts blocks at cache slots (a left-padded row gets other blocks) and
    places a chunk's queries at whole blocks from the end (a chunk that starts inside a block
    gets other blocks). This runs for one sequence too."""

    args: Any
    embed_tokens: nn.Embedding
    layers: list[nn.Module]
    final_layernorm: nn.Module
    mup_embedding_multiplier: float | None

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None) -> mx.array:
        hidden = self.embed_tokens(inputs)
        if self.mup_embedding_multiplier:
            hidden = self.mup_embedding_multiplier * hidden
        caches = cache if cache is not None else [None] * len(self.layers)
        mask = create_attention_mask(hidden, caches[0], return_array=True)
        sparse = self._block_sparse_mask(caches[0], inputs.shape[1])
        if isinstance(mask, mx.array):  # a batch's padding
            sparse = sparse & mask
        every = self.args.dense_attention_every_n_layers
        for index, (layer, layer_cache) in enumerate(zip(self.layers, caches, strict=True)):
            hidden = layer(hidden, sparse if index % every == 0 else mask, layer_cache)
        return self.final_layernorm(hidden)

    def _block_sparse_mask(self, cache: Any, length: int) -> mx.array:
        """(B or 1, heads, L, S): which key slot each query of each head sees."""
        args = self.args
        queries, keys = _positions(cache, length)
        query_blocks = queries // args.blocksparse_block_size
        key_blocks = keys // args.blocksparse_block_size
        heads = mx.arange(1, args.num_attention_heads + 1)[None, :, None]
        on_stride = ((key_blocks[:, None, :] + heads) % args.blocksparse_vert_stride) == 0
        local = (
            query_blocks[:, :, None] - key_blocks[:, None, :] < args.blocksparse_num_local_blocks
        )
        seen = (keys[:, None, :] <= queries[:, :, None]) & (keys[:, None, :] >= 0)
        return (seen & local)[:, None] | (seen[:, None] & on_stride[:, :, None, :])


def _swap_class(fix: type, *modules: nn.Module) -> int:
    """Each module's class swapped for a subclass that mixes `fix` in; how many."""
    for module in modules:
        original = type(module)
        if not issubclass(original, fix):
            module.__class__ = type(f"Batched{original.__name__}", (fix, original), {})
    return len(modules)


def _gemma2(model: nn.Module) -> int:
    return _swap_class(GroupedScoresMask, *[layer.self_attn for layer in model.layers])


def _gpt_bigcode(model: nn.Module) -> int:
    return _swap_class(RowPositions, model.transformer)


def _afm7(model: nn.Module) -> int:
    return _swap_class(RowQueryPositions, model.model)


def _llama4(model: nn.Module) -> int:
    fixed = _swap_class(WholeHistoryCaches, model)
    fixed += _swap_class(ChunkedRowMasks, model.language_model.model)
    return fixed + _swap_class(RowTemperature, *[layer.self_attn for layer in model.layers])


def _plamo3(model: nn.Module) -> int:
    return _swap_class(WindowPlusOneCaches, model)


def _nemotron_nas(model: nn.Module) -> int:
    return _swap_class(AttentionLayerCaches, model) + _swap_class(AttentionCachesOnly, model.model)


def _phi3small(model: nn.Module) -> int:
    for layer in model.model.layers:
        layer.self_attn.block_sparse = False  # the model's mask carries the sparsity
    return _swap_class(BlockSparseRowMasks, model.model)


def _minimax_m3_vl(model: nn.Module) -> int:
    sparse = [layer.self_attn for layer in model.layers if layer.self_attn.is_sparse_attn]
    return _swap_class(RowBlocks, *sparse)


FIXES: dict[str, Callable[[nn.Module], int]] = {
    "afm7": _afm7,
    "gemma2": _gemma2,
    "gpt_bigcode": _gpt_bigcode,
    "llama4": _llama4,
    "minimax_m3_vl": _minimax_m3_vl,
    "nemotron-nas": _nemotron_nas,
    "phi3small": _phi3small,
    "plamo3": _plamo3,
}


def fix_for_batching(model: nn.Module) -> None:
    """Apply the model's architecture's fix, if it has one (a second call changes nothing)."""
    model_type = getattr(model, "model_type", None)
    if model_type in UNSERVABLE:
        applies, reason = UNSERVABLE[model_type]
        if applies(model):
            raise UnservableModel(f"{model_type}: {reason}")
    fix = FIXES.get(model_type or "")
    if fix is None:
        return
    count = fix(model)
    log.info("%s: %d module(s) fixed for batching", model_type, count)
