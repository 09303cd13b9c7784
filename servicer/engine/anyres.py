"""LLaVA-NeXT's "anyres" image features as transformers' LlavaNextForConditionalGeneration
packs them, for mlx-vlm's model of the family (a registry entry's `model_fix`; engine thread
and the tests' references only: this module computes with MLX).

mlx-vlm 0.7.10's LLaVA-NeXT runs its tower on every tile, appends the image newline as one more
*image* and splices a whole tile's features at each image token, whereas its processor (as
transformers') expands `<image>` to the packed count: the whole image's patches, then the tiles
as one grid with the padding cropped away (`unpad`) and the newline ending each row. `fix`
gives the model transformers' packing (`pack`), its own tower, projector and newline kept;
mlx-vlm's LLaVA-OneVision packs alike but crops with `int()` where transformers (and the
processor's count) round to 7 places first, which differs on some sizes (88 x 99 pixels at
LLaVA-NeXT's 336-pixel tiles), and downsamples past `anyres_max`, which LLaVA-NeXT never does.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np


def grid(size: tuple[int, int], pinpoints: list, tile: int) -> tuple[int, int]:
    """The (rows, cols) of tiles the processor cuts an image of `size` (height, width) into."""
    from transformers.image_processing_utils import select_best_resolution

    height, width = select_best_resolution(list(size), pinpoints)
    return height // tile, width // tile


def unpad(features: Any, size: tuple[int, int]) -> Any:
    """transformers' `unpad_image` on a grid [height, width, ...]: the rows or columns the
    processor's padding made, cropped evenly from both sides."""
    height, width = size
    rows, cols = features.shape[:2]
    if width / height > cols / rows:
        pad = (rows - int(round(height * (cols / width), 7))) // 2
        return features[pad : rows - pad]
    pad = (cols - int(round(width * (rows / height), 7))) // 2
    return features[:, pad : cols - pad]


def pack(tiles: Any, size: tuple[int, int], pinpoints: list, tile: int, newline: Any) -> Any:
    """One image's features as transformers packs them, from its tiles' [1 + n, side^2,
    hidden] (the whole image first): the whole image's, then the tiles' grid unpadded, row by
    row, `newline` ending each row (numpy or MLX arrays alike)."""
    lib = mx if isinstance(tiles, mx.array) else np
    if tiles.shape[0] == 1:
        return lib.concatenate([tiles[0], newline[None]])
    rows, cols = grid(size, pinpoints, tile)
    side = round(tiles.shape[1] ** 0.5)
    hidden = tiles.shape[-1]
    cells = tiles[1:].reshape(rows, cols, side, side, hidden).transpose(0, 2, 1, 3, 4)
    cells = unpad(cells.reshape(rows * side, cols * side, hidden), size)
    ends = lib.broadcast_to(newline[None, None], (cells.shape[0], 1, hidden))
    cells = lib.concatenate([cells, ends.astype(cells.dtype)], axis=1)
    return lib.concatenate([tiles[0], cells.reshape(-1, hidden)])


def _packed_features(model: Any, pixels: mx.array, image_sizes: Any, pinpoints: list) -> mx.array:
    """The images' features, packed, one after another: the tower on each image's tiles (the
    processor's padding of the tile axis dropped), its layer and strategy, the projector,
    `pack`."""
    config = model.config
    tile = config.vision_config.image_size
    sizes = [tuple(int(v) for v in s) for s in np.array(image_sizes).reshape(-1, 2)]
    counts = [int(np.prod(grid(s, pinpoints, tile))) + 1 for s in sizes]
    if pixels.ndim == 4:  # one image's tiles
        pixels = pixels[None]
    flat = mx.concatenate([pixels[i, :n] for i, n in enumerate(counts)])
    *_, hidden = model.vision_tower(flat.transpose(0, 2, 3, 1), output_hidden_states=True)
    layer = config.vision_feature_layer
    chosen = (
        hidden[layer]
        if isinstance(layer, int)
        else mx.concatenate([hidden[i] for i in layer], axis=-1)
    )
    if config.vision_feature_select_strategy == "default":
        chosen = chosen[:, 1:]
    features = model.multi_modal_projector(chosen)
    starts = np.cumsum([0, *counts])
    return mx.concatenate(
        [
            pack(features[a:b], s, pinpoints, tile, model.image_newline)
            for a, b, s in zip(starts[:-1], starts[1:], sizes, strict=True)
        ]
    )


def fix(model: Any, config: dict[str, Any]) -> Any:
    """mlx-vlm's LLaVA-NeXT `model` with transformers' packing (`config`: the checkpoint's
    config.json, whose pinpoints mlx-vlm's config drops): its image tokens take `pack`'s
    features (the instance's `get_input_embeddings` replaced; its class and weights kept)."""
    from mlx_vlm.models.base import InputEmbeddingsFeatures

    pinpoints, text_only = config["image_grid_pinpoints"], model.get_input_embeddings

    def get_input_embeddings(input_ids=None, pixel_values=None, **kwargs):
        if pixel_values is None:
            return text_only(input_ids)
        embeds = model.language_model.model.embed_tokens(input_ids)
        features = _packed_features(model, pixel_values, kwargs.get("image_sizes"), pinpoints)
        mask = input_ids == model.config.image_token_index
        tokens = int(mask.sum().item())
        if tokens != features.shape[0]:
            raise ValueError(f"{features.shape[0]} image features for {tokens} image tokens")
        at = mx.clip(mx.cumsum(mask.reshape(-1).astype(mx.int32)) - 1, 0, None)
        gathered = features.astype(embeds.dtype)[at.reshape(mask.shape)]
        return InputEmbeddingsFeatures(inputs_embeds=mx.where(mask[..., None], gathered, embeds))

    object.__setattr__(model, "get_input_embeddings", get_input_embeddings)
    return model
