"""The ``llava_next`` family of the demo vision-language model (``servicer.demos.vision``).

LLaVA-NeXT (1.6): LLaVA's CLIP tower, projector (linear, gelu, linear) and llama text model,
each image tiled "anyres": the whole image resized and centre-cropped to the tower's size,
then the image resized to the best of ``image_grid_pinpoints`` (never one tile: 1x2, 2x1,
2x2, 3x1 or 1x3 tiles, as llava-v1.6's pinpoints), padded and cut into tiles of that size.
Its features: the whole image's patches, then the tiles' patches as one grid, the padding
cropped away, a learnt ``image_newline`` ending each row; the processor (transformers'
LlavaNextProcessor) expands the ``<image>`` anchor to that count. mlx-vlm's model packs them
otherwise, so its model is served and compared with transformers' packing
(``servicer.engine.anyres``). Built from the ``llama`` text demo (``servicer.demos.text``), nothing
trained here:

- the language model is the text demo's trained weights under ``language_model.``, its
  output head a copy of the embeddings (mlx-vlm's LLaVA-NeXT text stack holds its own):
  mlx-vlm runs it with that stack, the worker with mlx-lm's llama built from text_config.
- the tokenizer is the text demo's with ``<image>`` appended as a special token and an
  embedding row for it drawn at the trained rows' scale; the chat template renders
  ``<image>`` (``IMAGE_ANCHOR``) per image part.
- the vision tower is a tiny CLIP (42-pixel tiles of 14-pixel patches: 3x3 tokens a tile, the
  CLS token dropped, features from the next-to-last layer), random from a seeded numpy
  generator, as the ``llava`` demo's; the projector and the newline are scaled so that the
  image tokens enter the language model at the text embeddings' RMS.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import llava, parts
from .vision import Family

IMAGE_TOKEN = "<image>"
IMAGE_ANCHOR = IMAGE_TOKEN  # what the chat template renders for one image, unexpanded

TILE_SIZE = 42  # the tower's input: the whole image resized and cropped to it, and each tile
PATCH_SIZE = 14
# The resolutions an image may be tiled at (height, width), in tiles as llava-v1.6's.
GRID_PINPOINTS = [
    [TILE_SIZE * h, TILE_SIZE * w] for h, w in ((1, 2), (2, 1), (2, 2), (3, 1), (1, 3))
]

VISION_CONFIG = parts.tower_config(
    "clip_vision_model",
    TILE_SIZE,
    PATCH_SIZE,
    heads={},
    rest={"projection_dim": 64, "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5},
)


class LlavaNext(Family):
    model_type = "llava_next"
    architecture = "LlavaNextForConditionalGeneration"
    text_kind = "llama"
    recipe_version = "v2"  # v1: an earlier, untracked build in shared caches
    vision_tokens = (IMAGE_TOKEN,)  # appended after the text demo's vocabulary: id 512
    image_anchor = IMAGE_ANCHOR
    image_token = IMAGE_TOKEN
    untied_head = True
    # tokens_per_image: 9 for the whole image, then the tiles' grid unpadded, a newline a row.
    tokenizer_fields = {"extra_special_tokens": {"image_token": IMAGE_TOKEN}}
    processor_files = {
        "preprocessor_config.json": parts.image_processor_config(
            "LlavaNextImageProcessor",
            "LlavaNextProcessor",
            {
                "size": {"shortest_edge": TILE_SIZE},
                "crop_size": {"height": TILE_SIZE, "width": TILE_SIZE},
                "do_center_crop": True,
                "image_grid_pinpoints": GRID_PINPOINTS,
                "resample": 3,  # bicubic
                "do_pad": True,
            },
            parts.CLIP_MEAN,
            parts.CLIP_STD,
        ),
        # llava-v1.6's own processor_config.json, for the demo's sizes: (42/14)^2 patches
        # + 1 (CLS) - 1 (dropped by the "default" strategy) tokens for the whole image.
        "processor_config.json": {
            "processor_class": "LlavaNextProcessor",
            "image_token": IMAGE_TOKEN,
            "patch_size": PATCH_SIZE,
            "vision_feature_select_strategy": "default",
            "num_additional_image_tokens": 1,
        },
    }

    def model_config(
        self, text_config: Mapping[str, Any], ids: Mapping[str, int], vocab_size: int
    ) -> dict:
        hidden, heads = text_config["hidden_size"], text_config["num_attention_heads"]
        if text_config.get("head_dim", hidden // heads) * heads != hidden:
            raise ValueError("mlx-vlm's LLaVA-NeXT text stack needs head_dim = hidden / heads")
        text_fields = {"model_type": "llama", "vocab_size": vocab_size}
        fields = {
            "image_token_index": ids[IMAGE_TOKEN],
            "image_grid_pinpoints": GRID_PINPOINTS,
            "projector_hidden_act": "gelu",
            "vision_feature_select_strategy": "default",  # the CLS token dropped
            "vision_feature_layer": -2,
        }
        config = parts.nested_config(
            text_config, text_fields, VISION_CONFIG, fields, ids, vocab_size
        )
        config["text_config"]["tie_word_embeddings"] = config["tie_word_embeddings"] = False
        return config

    def vision_weights(self, config: Mapping[str, Any], feature_rms: float, rng) -> dict:
        """The ``llava`` demo's CLIP and projector weights at these sizes, and the newline
        drawn at `feature_rms`."""
        out = llava.FAMILY.vision_weights(config, feature_rms, rng)
        out["image_newline"] = rng.standard_normal(config["text_config"]["hidden_size"])
        out["image_newline"] *= feature_rms
        return out


FAMILY = LlavaNext()
