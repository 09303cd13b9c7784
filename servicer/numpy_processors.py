"""mlx-vlm processors that compute with MLX, redone on the handler side in numpy and PIL (no
torch, no MLX), step for step and bit for bit (tests/test_images_<family>.py check them
against mlx-vlm's own on many images).

`DynamicTilesProcessor`, InternVL's dynamic tiling (mlx-vlm 0.7.10's ``InternVLChatProcessor``
normalises with MLX). transformers' GotOcr2 image processor tiles alike but breaks
aspect-ratio ties another way (more tiles while they cover under twice the image, where
mlx-vlm's picks the grid whose area is nearest the image's), so it cuts some images into
other tiles. mlx-vlm's: the grid (columns x rows, at most ``max_dynamic_patch`` tiles) whose
aspect ratio is nearest the image's, the image resized to it (PIL bicubic) and cut into
tiles, the whole image resized to one tile after them where there are several; each tile
scaled to [0, 1] and normalised with ImageNet's mean and std in float32 (the same arithmetic
as MLX's); and ``<image>`` in the text replaced by ``<img>``, ``<IMG_CONTEXT>`` once per
image token of every tile, ``</img>``.

`NativePatchesProcessor`, Kimi-VL's (mlx-vlm's ``KimiVLProcessor``, which scales, normalises
and patchifies with MLX): the image resized down (bicubic) where it has over 4096 patches,
center-cropped to whole 2x2 blocks of 14-pixel patches, scaled to [0, 1] and normalised with
CLIP's mean and std in float32, cut into patches [N, 3, 14, 14] row by row, its grid
``image_grid_hws``; ``<|media_pad|>`` repeated once per block. Those sizes are mlx-vlm's
fixed defaults: its processor reads none of the checkpoint's (Kimi-VL's own are the same).

`with_global_tile`, not a processor but a fix to one: a tiling processor whose image processor
cuts an image into its grid of tiles and stops there, while its prompt expansion writes one
more tile's run for the whole image (the global tile), as mlx-vlm 0.7.10's Llama 4 processor
does. It adds that tile, as the model's own processor makes it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

IMAGE_PLACEHOLDER = "<image>"
MEDIA_PAD = "<|media_pad|>"
START, END, CONTEXT = "<img>", "</img>", "<IMG_CONTEXT>"
MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)[:, None, None]
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)[:, None, None]
CLIP_MEAN = np.array([0.48145466, 0.4578275, 0.40821073], dtype=np.float32)[:, None, None]
CLIP_STD = np.array([0.26862954, 0.26130258, 0.27577711], dtype=np.float32)[:, None, None]


def grid(width: int, height: int, tile: int, least: int, most: int) -> tuple[int, int]:
    """The (columns, rows) an image of `width` x `height` pixels is cut into: the aspect ratio
    nearest its own among grids of `least` to `most` tiles, ties to the grid whose area is
    nearest the image's (the first such in mlx-vlm's order)."""
    ratios = {
        (i, j)
        for n in range(least, most + 1)
        for i in range(1, n + 1)
        for j in range(1, n + 1)
        if least <= i * j <= most
    }
    aspect, area = width / height, width * height
    best_diff, best = float("inf"), (1, 1)
    for cols, rows in sorted(ratios, key=lambda r: r[0] * r[1]):
        diff = abs(aspect - cols / rows)
        if diff < best_diff:
            best_diff, best = diff, (cols, rows)
        elif diff == best_diff:
            here = abs(area - tile * tile * cols * rows)
            if here < abs(area - tile * tile * best[0] * best[1]):
                best = (cols, rows)
    return best


class DynamicTilesProcessor:
    """The checkpoint's tokenizer and tiling: called as a transformers processor is (`text`,
    `images`, return_tensors="np"), it gives input_ids with each ``<image>`` expanded and
    pixel_values [1, tiles, 3, size, size] (float32), as mlx-vlm's processor does."""

    def __init__(
        self,
        tokenizer: Any,
        size: int,
        tokens_per_tile: int,
        least: int = 1,
        most: int = 12,
        thumbnail: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.size, self.tokens_per_tile = size, tokens_per_tile
        self.least, self.most, self.thumbnail = least, most, thumbnail
        self.context_id = tokenizer.convert_tokens_to_ids(CONTEXT)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, **_: Any) -> DynamicTilesProcessor:
        """Sizes from config.json, processor_config.json over them, as mlx-vlm reads them."""
        from transformers import AutoTokenizer

        model_dir = Path(model_dir)
        config = _json(model_dir / "config.json")
        vision = config.get("vision_config") or {}
        size = config.get("force_image_size", vision.get("image_size", 448))
        patch = vision.get("patch_size", 14)
        ratio = config.get("downsample_ratio", 0.5)
        own = _json(model_dir / "processor_config.json")
        size = own.get("image_size", size)
        patch, ratio = own.get("patch_size", patch), own.get("downsample_ratio", ratio)
        tokens = own.get("num_image_token") or int((size // patch) ** 2 * ratio**2)
        return cls(
            AutoTokenizer.from_pretrained(str(model_dir)),
            size,
            tokens,
            config.get("min_dynamic_patch", 1),
            config.get("max_dynamic_patch", 12),
            config.get("use_thumbnail", True),
        )

    def tiles(self, image: Any) -> list[Any]:
        """The PIL tiles of one image, row by row, then its thumbnail where there are several."""
        from PIL import Image

        bicubic = Image.Resampling.BICUBIC
        width, height = image.size
        if not width or not height:
            raise ValueError("an image of no pixels")
        cols, rows = grid(width, height, self.size, self.least, self.most)
        s = self.size
        resized = image.resize((s * cols, s * rows), resample=bicubic)
        out = [
            resized.crop((c * s, r * s, (c + 1) * s, (r + 1) * s))
            for r in range(rows)
            for c in range(cols)
        ]
        if self.thumbnail and len(out) > 1:
            out.append(image.resize((s, s), resample=bicubic))
        return out

    def pixels(self, image: Any) -> np.ndarray:
        """One image's tiles, normalised: [tiles, 3, size, size] float32."""
        from PIL import Image

        stacked = []
        for tile in self.tiles(image):
            tile = tile if tile.mode == "RGB" else tile.convert("RGB")
            tile = tile.resize((self.size, self.size), resample=Image.Resampling.BICUBIC)
            scaled = np.array(tile).astype(np.float32) / 255.0
            stacked.append((scaled.transpose(2, 0, 1) - MEAN) / STD)
        return np.stack(stacked)

    def __call__(
        self, text: str | None = None, images: list[Any] | None = None, **kwargs: Any
    ) -> dict[str, Any]:
        images = list(images or [])
        tiles = [self.pixels(image) for image in images]
        if text is None:
            return {"pixel_values": np.concatenate(tiles)[None]}
        if text.count(IMAGE_PLACEHOLDER) != len(images):
            raise ValueError(f"{len(images)} images for {text.count(IMAGE_PLACEHOLDER)} anchors")
        for pixels in tiles:
            run = START + CONTEXT * (self.tokens_per_tile * len(pixels)) + END
            text = text.replace(IMAGE_PLACEHOLDER, run, 1)
        special = kwargs.get("add_special_tokens", True)
        ids = self.tokenizer(text, add_special_tokens=special)["input_ids"]
        out: dict[str, Any] = {"input_ids": np.array([ids], dtype=np.int64)}
        if tiles:
            out["pixel_values"] = np.concatenate(tiles)[None]
            out["image_token_index"] = np.array(self.context_id, dtype=np.int64)
        return out


class NativePatchesProcessor:
    """The checkpoint's tokenizer and Kimi-VL's patches: called as a transformers processor
    is (`text`, `images`), it gives input_ids with each ``<|media_pad|>`` expanded,
    pixel_values [patches, 3, 14, 14] (float32) and image_grid_hws [images, 2], as mlx-vlm's
    processor does."""

    patch, merge, limit = 14, 2, 4096

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, **_: Any) -> NativePatchesProcessor:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(model_dir)))

    def sized(self, image: Any) -> Any:
        """The image resized down to the patch limit, center-cropped to whole blocks."""
        from PIL import Image

        p, block = self.patch, self.merge * self.patch
        w, h = image.size
        if (w // p) * (h // p) > self.limit:
            scale = math.sqrt(self.limit / ((w // p) * (h // p)))
            image = image.resize((int(w * scale), int(h * scale)), Image.Resampling.BICUBIC)
        w, h = image.size
        new_w, new_h = w - w % block, h - h % block
        if not new_w or not new_h:
            raise ValueError(f"an image under {block} pixels a side")
        left, top = (w - new_w) // 2, (h - new_h) // 2
        image = image.crop((left, top, left + new_w, top + new_h))
        if new_w // p >= 512 or new_h // p >= 512:
            raise ValueError("an image past the position embeddings (512 patches a side)")
        return image

    def patches(self, image: Any) -> tuple[np.ndarray, tuple[int, int]]:
        """One image's patches [N, 3, p, p] (float32) and its patch grid (rows, columns)."""
        image = self.sized(image).convert("RGB")
        scaled = np.asarray(image, dtype=np.float32) / np.float32(255.0)
        pixels = (scaled.transpose(2, 0, 1) - CLIP_MEAN) / CLIP_STD
        p, (c, h, w) = self.patch, pixels.shape
        cut = pixels.reshape(c, h // p, p, w // p, p).transpose(1, 3, 0, 2, 4)
        return cut.reshape(-1, c, p, p), (h // p, w // p)

    def __call__(
        self, text: str | None = None, images: list[Any] | None = None, **_: Any
    ) -> dict[str, Any]:
        done = [self.patches(image) for image in images or []]
        out: dict[str, Any] = {}
        if done:
            out["pixel_values"] = np.concatenate([patches for patches, _ in done])
            out["image_grid_hws"] = np.array([grid for _, grid in done], dtype=np.int64)
        if text is not None:
            if text.count(MEDIA_PAD) != len(done):
                raise ValueError(f"{len(done)} images for {text.count(MEDIA_PAD)} anchors")
            for _, (h, w) in done:
                text = text.replace(MEDIA_PAD, "<|placeholder|>" * (h * w // self.merge**2), 1)
            text = text.replace("<|placeholder|>", MEDIA_PAD)
            out["input_ids"] = np.array([self.tokenizer.encode(text)], dtype=np.int64)
        return out


def with_global_tile(processor: Any) -> Any:
    """`processor` (in place) with its image processor's output completed by each tiled
    image's global tile, as transformers' and Meta's Llama 4 processors make it: the whole
    image resized to one tile, after that image's local tiles, only where there are several
    (one tile: nothing added, the output as it was). The image processor's own resize (PIL
    bicubic, as its tiles) and its own normalisation (`_preprocess_single`); its grid from
    the `aspect_ratios` (rows, columns) it returns. Without it an image of h x w > 1 tiles
    has h x w tiles of features for the h x w + 1 runs of ``<|patch|>`` its prompt holds, and
    the model's merge reads the last run from past the end of the features."""
    from PIL import Image

    images = processor.image_processor
    if getattr(images, "global_tile", False):
        return processor
    preprocess = images.preprocess

    def completed(pictures: Any, **kwargs: Any) -> dict[str, Any]:
        pictures = pictures if isinstance(pictures, list) else [pictures]
        out = preprocess(pictures, **kwargs)
        tiles, start = [], 0
        for picture, (rows, cols) in zip(pictures, out["aspect_ratios"], strict=True):
            tiles.extend(out["pixel_values"][start : start + rows * cols])
            start += rows * cols
            if rows * cols > 1:
                if not isinstance(picture, Image.Image):
                    picture = Image.fromarray(np.uint8(picture))
                whole = picture.resize((images.size, images.size), Image.Resampling.BICUBIC)
                tiles.append(images._preprocess_single(whole))
        return {**out, "pixel_values": np.stack(tiles)}

    images.preprocess = completed
    images.global_tile = True
    return processor


def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
