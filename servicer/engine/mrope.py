"""Qwen-VL's multimodal RoPE (mRoPE) for mlx-lm's Qwen-VL text models in the engine's batch.

mlx-lm loads a Qwen2-VL (Qwen3-VL, Qwen3.5) checkpoint as a text model with 1-D RoPE, exact
for text: there every position's (t, h, w) ids are equal, and mRoPE at (p, p, p) is RoPE at p.
An image's tokens get a 3-D grid of ids instead, and the text after an image continues from
the largest id so far plus one, so from there each row's rotary position is its cache index
plus a per-row `rope_delta` (negative). This module makes the text model exact for image
prompts, row by row in one batch:

- `rope_index`: the (t, h, w) ids of one prompt and its delta, as mlx-vlm's `get_rope_index`;
- `enable_mrope(model)`: each attention's `rope` becomes an `MRoPE`, which reads a shared
  `RopePositions` the caller sets for each forward, one entry per row of the batch:
  `None` (1-D RoPE at the cache offset, mlx-lm's own, bit for bit), an int delta (mRoPE at
  cache offset + index + delta: decode, and text after an image) or a [3, n] array (the ids
  of the chunk's n real tokens; a right-padded chunk's padding columns get any ids).

Rows set to a delta or ids follow mlx-vlm's mRoPE math exactly (Qwen2-VL's chunked frequency
layout, Qwen3-VL's interleaved one where rope_scaling says `mrope_interleaved`): on Metal its
fused kernel (the same source), elsewhere its cos/sin formula, cast to the activations' dtype;
tests/test_mrope.py compares the two bit for bit on whatever backend it runs. `mx.fast.rope`
at offset + delta is not used for them: with `base` it differs from mlx-vlm's formula in the
last bits; with `freqs=1/inv_freq` it agreed on the CPU backend, which nothing promises for
the others.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

# Each row of a forward: None (plain RoPE), an int (a delta on the cache offset) or the
# chunk's ids, an int array [3, n] with n at most the chunk's width.
RowPositions = int | np.ndarray | None
ImageSpan = tuple[int, int, tuple[int, int, int]]  # (offset, length, (t, h, w) of the grid)


def rope_index(
    input_ids: Sequence[int], image_spans: Sequence[ImageSpan], spatial_merge_size: int
) -> tuple[np.ndarray, int]:
    """The (t, h, w) position ids [3, L] of one prompt and its rope delta (mlx-vlm's
    `get_rope_index` for one sequence).

    `image_spans` are the images' expanded placeholder runs in order: (offset, length,
    grid_thw), grid_thw the vision tower's patch grid (length is t * h * w / merge**2).
    Text runs count on from the largest id before them plus one; an image's run is its
    grid, (t, h / merge, w / merge), shifted to start there too. The delta is the largest id
    plus one minus L: the position of the token after the prompt minus its cache index."""
    total = len(input_ids)
    pieces: list[np.ndarray] = []
    start = 0  # the first token not yet placed
    next_id = 0  # the id the next text token gets
    for offset, length, (t, h, w) in image_spans:
        grid_t, grid_h, grid_w = int(t), int(h) // spatial_merge_size, int(w) // spatial_merge_size
        if length != grid_t * grid_h * grid_w:
            raise ValueError(
                f"an image of grid {(t, h, w)} (merge {spatial_merge_size}) has "
                f"{grid_t * grid_h * grid_w} tokens, not {length}"
            )
        if offset < start or offset + length > total:
            raise ValueError(f"image span {(offset, length)} overlaps another or the prompt's end")
        text = offset - start
        pieces.append(np.broadcast_to(np.arange(text, dtype=np.int64), (3, text)) + next_id)
        grid = np.stack(
            [
                np.repeat(np.arange(grid_t), grid_h * grid_w),
                np.tile(np.repeat(np.arange(grid_h), grid_w), grid_t),
                np.tile(np.arange(grid_w), grid_t * grid_h),
            ]
        )
        pieces.append(grid + next_id + text)
        next_id = int(pieces[-1].max()) + 1
        start = offset + length
    tail = total - start
    pieces.append(np.broadcast_to(np.arange(tail, dtype=np.int64), (3, tail)) + next_id)
    positions = np.concatenate(pieces, axis=1).astype(np.int64)
    if not image_spans:
        return positions, 0
    return positions, int(positions.max()) + 1 - total


def _selector(mrope_section: Sequence[int], half: int, interleaved: bool) -> list[int]:
    """Which of (t, h, w) each frequency reads (mlx-vlm's layouts): chunked (Qwen2-VL's), the
    first section t, the next h, the last w; interleaved (Qwen3-VL's), t h w t h w ... while
    the h and w sections last, then t."""
    selector = [0] * half
    start = mrope_section[0]
    for axis, length in enumerate(mrope_section[1:], start=1):
        taken = range(axis, length * 3, 3) if interleaved else range(start, start + length)
        for i in (i for i in taken if i < half):
            selector[i] = axis
        start += length
    return selector


class RopePositions:
    """What the attentions' rotary embedding uses in the next forward, shared by every layer.

    Set before a forward and cleared after it (`forward` does both): `set(rows)` with one
    entry per row of the batch (see `RowPositions`); nothing set, every row gets plain RoPE.
    The per-row values are taken afresh each forward, so a caller that filters or extends its
    batch filters or extends its own per-row list the same way. The positions are derived
    once per forward, from the first layer's cache offset (every layer's is the same)."""

    def __init__(
        self, dims: int, base: float, mrope_section: Sequence[int], interleaved: bool = False
    ) -> None:
        self.dims = dims
        self.mrope_section = tuple(int(s) for s in mrope_section)
        # mlx-vlm's inverse frequencies, computed as it does.
        self.inv_freq = 1.0 / (base ** (mx.arange(0, dims, 2).astype(mx.float32) / dims))
        selector = _selector(self.mrope_section, dims // 2, interleaved)
        self.selector = mx.array(selector, dtype=mx.int32)
        mx.eval(self.inv_freq, self.selector)
        self.rows: list[RowPositions] | None = None
        self._derived: dict[tuple[Any, ...], Any] = {}

    @property
    def active(self) -> bool:
        return self.rows is not None

    def set(self, rows: Sequence[RowPositions]) -> None:
        """The next forward's positions, one entry per row (an empty or all-None list is the
        same as nothing set)."""
        for row in rows:
            if isinstance(row, np.ndarray) and (row.ndim != 2 or row.shape[0] != 3):
                raise ValueError(f"a row's positions are [3, n], not {list(row.shape)}")
        self.rows = list(rows) if any(r is not None for r in rows) else None
        self._derived = {}

    def clear(self) -> None:
        self.rows = None
        self._derived = {}

    @contextmanager
    def forward(self, rows: Sequence[RowPositions]) -> Iterator[None]:
        """`set(rows)` for the forwards run inside, cleared on leaving."""
        self.set(rows)
        try:
            yield
        finally:
            self.clear()

    def positions(self, batch: int, width: int, offset: Any) -> tuple[mx.array, mx.array | None]:
        """This forward's ids (3, batch, width) int32 and which rows take mRoPE (batch,), or
        None where every row does."""
        key = ("positions", batch, width)
        if key not in self._derived:
            self._derived[key] = self._positions(batch, width, offset)
        return self._derived[key]

    def _positions(self, batch: int, width: int, offset: Any) -> tuple[mx.array, mx.array | None]:
        rows = self.rows or []
        if len(rows) != batch:
            raise ValueError(
                f"positions were set for {len(rows)} rows but the forward has {batch} (a "
                "forward that runs the batch's rows apart, in segments or groups, is not "
                "covered)"
            )
        explicit = np.zeros((batch, 3, width), dtype=np.int32)
        given = np.zeros(batch, dtype=bool)
        deltas = np.zeros(batch, dtype=np.int32)
        for b, row in enumerate(rows):
            if isinstance(row, np.ndarray):
                if row.shape[1] > width:
                    raise ValueError(f"row {b} has {row.shape[1]} ids for a {width}-wide chunk")
                explicit[b, :, : row.shape[1]] = row
                given[b] = True
            elif row is not None:
                deltas[b] = int(row)
        offsets = mx.broadcast_to(mx.array(offset), (batch,)).astype(mx.int32)
        counted = (
            offsets[:, None] + mx.arange(width, dtype=mx.int32)[None] + mx.array(deltas)[:, None]
        )
        ids = mx.where(mx.array(given)[:, None, None], mx.array(explicit), counted[:, None, :])
        taken = [row is not None for row in rows]
        return ids.transpose(1, 0, 2), None if all(taken) else mx.array(taken)

    def cos_sin(self, ids: mx.array, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
        """mlx-vlm's cos and sin (batch, 1, width, dims) for ids (3, batch, width)."""
        key = ("cos_sin", *ids.shape, dtype)
        if key not in self._derived:
            chosen = mx.take(ids, self.selector, axis=0).transpose(1, 2, 0)
            freqs = chosen.astype(mx.float32) * self.inv_freq
            emb = mx.concatenate([freqs, freqs], axis=-1)
            cos, sin = mx.cos(emb).astype(dtype), mx.sin(emb).astype(dtype)
            self._derived[key] = (cos[:, None], sin[:, None])
        return self._derived[key]


class MRoPE(nn.RoPE):
    """An attention's rotary embedding that reads a shared `RopePositions`: plain RoPE (the
    `nn.RoPE` it replaces, unchanged) for rows set to None or when nothing is set."""

    def __init__(self, rope: nn.RoPE, positions: RopePositions) -> None:
        super().__init__(rope.dims, traditional=rope.traditional, base=rope.base, scale=rope.scale)
        self.positions = positions

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        if not self.positions.active:
            return super().__call__(x, offset)
        ids, mrope = self.positions.positions(x.shape[0], x.shape[2], offset)
        rotated = self._mrope(x, ids)
        if mrope is None:
            return rotated
        return mx.where(mrope[:, None, None, None], rotated, super().__call__(x, offset))

    def _mrope(self, x: mx.array, ids: mx.array) -> mx.array:
        state = self.positions
        if _METAL and not self.traditional:
            return _metal_mrope(x, ids, state.inv_freq, state.selector, self.dims)
        cos, sin = state.cos_sin(ids, x.dtype)
        x_rot = x[..., : self.dims]
        half = self.dims // 2
        turned = mx.concatenate([-x_rot[..., half:], x_rot[..., :half]], axis=-1)
        if self.traditional:  # even/odd pairs: mlx-vlm's formula (on Metal unchecked)
            cos, sin = (mx.repeat(c[..., :half], 2, axis=-1) for c in (cos, sin))
            turned = mx.stack([-x_rot[..., 1::2], x_rot[..., 0::2]], axis=-1).flatten(-2)
        out = ((x_rot * cos) + (turned * sin)).astype(x.dtype)
        if self.dims < x.shape[-1]:
            out = mx.concatenate([out, x[..., self.dims :]], axis=-1)
        return out


# mlx-vlm's fused mRoPE kernel (rope_utils._mrope_apply_kernel, half-split pairing, 3-D ids),
# which it runs wherever Metal is: the same source, so the same bits.
_METAL_SOURCE = """
        uint elem = thread_position_in_grid.x;

        const int half_dim = {half};
        const int q_bsz = x_shape[0];
        const int q_heads = x_shape[1];
        const int q_len = x_shape[2];
        const int q_dim = x_shape[3];
        const int slots = half_dim + q_dim - {dims};
        const int work_size = q_bsz * q_heads * q_len * slots;

        if (elem >= uint(work_size)) {{
            return;
        }}

        int local = int(elem);
        int slot = local % slots;
        int tmp = local / slots;
        int t = tmp % q_len;
        tmp = tmp / q_len;
        int h = tmp % q_heads;
        int b = tmp / q_heads;
        int base = ((b * q_heads + h) * q_len + t) * q_dim;

        if (slot >= half_dim) {{
            int pass_d = {dims} + slot - half_dim;
            int pass_idx = base + pass_d;
            x_out[pass_idx] = x[pass_idx];
            return;
        }}

        int freq_idx = slot;
        int d = freq_idx;
        int pair_d = d + half_dim;
        int axis = int(position_selector[freq_idx]);
        float pos = static_cast<float>(position_ids[(axis * q_bsz + b) * q_len + t]);
        float angle = pos * static_cast<float>(inv_freq[freq_idx]);
        float c = metal::cos(angle);
        float s = metal::sin(angle);

        int idx = base + d;
        float xv = static_cast<float>(x[idx]);
        float xp = static_cast<float>(x[base + pair_d]);
        x_out[idx] = static_cast<T>(xv * c - xp * s);
        x_out[base + pair_d] = static_cast<T>(xp * c + xv * s);
"""
_METAL = mx.metal.is_available()  # where mlx-vlm runs its fused kernel
_metal_kernels: dict[int, Any] = {}


def _metal_mrope(
    x: mx.array, ids: mx.array, inv_freq: mx.array, selector: mx.array, dims: int
) -> mx.array:
    kernel = _metal_kernels.get(dims)
    if kernel is None:
        kernel = _metal_kernels[dims] = mx.fast.metal_kernel(
            name=f"servicer_mrope_half_split_{dims}",
            input_names=["x", "position_ids", "inv_freq", "position_selector"],
            output_names=["x_out"],
            source=_METAL_SOURCE.format(half=dims // 2, dims=dims),
        )
    slots = dims // 2 + x.shape[-1] - dims
    (out,) = kernel(
        inputs=[x, ids, inv_freq, selector],
        template=[("T", x.dtype)],
        grid=(x.shape[0] * x.shape[1] * x.shape[2] * slots, 1, 1),
        threadgroup=(256, 1, 1),
        output_shapes=[x.shape],
        output_dtypes=[x.dtype],
    )
    return out


def _text_args(model: nn.Module) -> Any:
    language = getattr(model, "language_model", None)
    return getattr(language, "args", None) or getattr(model, "args", None)


def _mrope_section(model: nn.Module) -> tuple[list[int], bool]:
    """The text model's mrope_section and whether its layout is interleaved (Qwen3-VL's)."""
    args = _text_args(model)
    scaling = getattr(args, "rope_scaling", None) or {}
    section = scaling.get("mrope_section") if isinstance(scaling, dict) else None
    kind = (scaling.get("type") or scaling.get("rope_type")) if isinstance(scaling, dict) else None
    if not section or len(section) != 3 or kind not in ("mrope", "default"):
        model_type = getattr(model, "model_type", type(model).__name__)
        raise ValueError(
            f"{model_type} has no Qwen-VL multimodal RoPE (rope_scaling with a 3-part "
            f"mrope_section): rope_scaling is {scaling or None}"
        )
    return [int(s) for s in section], bool(scaling.get("mrope_interleaved"))


def enable_mrope(model: nn.Module) -> RopePositions:
    """Give every attention of an mlx-lm Qwen-VL text model (as `mlx_lm.load` returns it; a
    hybrid's linear-attention layers have none) an `MRoPE` reading one shared `RopePositions`,
    and return that. Idempotent. Raises ValueError for a model without Qwen-VL's
    rope_scaling (mrope_section) or whose attentions' rope is not a plain `nn.RoPE`."""
    section, interleaved = _mrope_section(model)
    attentions = [layer.self_attn for layer in model.layers if "self_attn" in layer]
    ropes = [getattr(a, "rope", None) for a in attentions]
    if ropes and all(isinstance(r, MRoPE) for r in ropes):
        return ropes[0].positions
    first = ropes[0] if ropes else None
    if not isinstance(first, nn.RoPE) or any(type(r) is not nn.RoPE for r in ropes):
        raise ValueError(f"multimodal RoPE needs nn.RoPE attentions, not {type(first).__name__}")
    if first.scale != 1.0 or first.dims % 2:
        raise ValueError(f"multimodal RoPE needs Qwen-VL's rotary embedding, not {first}")
    positions = RopePositions(first.dims, first.base, section, interleaved)
    for attention, rope in zip(attentions, ropes, strict=True):
        attention.rope = MRoPE(rope, positions)
    return positions
