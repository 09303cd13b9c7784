"""The ``llava_next`` family of the demo vision-language model (``servicer.demos.vision``).

LLaVA-NeXT (1.6's architecture): a CLIP vision tower, a projector (linear, gelu, linear) and
a llama text model; each image is tiled "anyres": the whole image at the tower's size, then
the image resized to the best of ``image_grid_pinpoints`` and cut into tiles of that size; a
learnt ``image_newline`` ends each row of the tiles' features. How many image tokens an image
becomes depends on its size: the processor (transformers' LlavaNextProcessor, mlx-vlm's own
too) expands the ``<image>`` anchor to that count. Built from the ``llama`` text demo
(``servicer.demos.text``), nothing trained here:

- the language model is the text demo's trained weights as they are, under
  ``language_model.``, with an ``lm_head`` that is a copy of the embeddings, and ``text_config.model_type`` "llama": mlx-vlm runs it with its
  LLaVA-NeXT text stack, the worker with mlx-lm's llama built from text_config (mlx-lm has
  no llava_next model type: ``servicer.engine.model.text_stack_config``).
- the tokenizer is the text demo's with ``<image>`` appended as a special token and an
  embedding row for it drawn at the trained rows' scale; the chat template renders
  ``<image>`` (``IMAGE_ANCHOR``) per image part.
- the vision tower is a tiny CLIP (42-pixel tiles of 14-pixel patches: 3x3 tokens a tile,
  the CLS token dropped; pinpoints up to 2x2 tiles), features from the next-to-last layer as
  LLaVA's, random from a seeded numpy generator; the projector and the newline are scaled so
  that the image tokens enter the language model at the text embeddings' RMS.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import parts
from .vision import Family

IMAGE_TOKEN = "<image>"
IMAGE_ANCHOR = IMAGE_TOKEN  # what the chat template renders for one image, unexpanded

TILE_SIZE = 42  # the tower's input: the whole image resized and cropped to it, and each tile
PATCH_SIZE = 14
# The resolutions an image may be tiled at (height, width): 1x2, 2x1 or 2x2 tiles.
GRID_PINPOINTS = [[TILE_SIZE * h, TILE_SIZE * w] for h, w in ((1, 2), (2, 1), (2, 2))]

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
    recipe_version = "v1"
    vision_tokens = (IMAGE_TOKEN,)  # appended after the text demo's vocabulary: id 512
    image_anchor = IMAGE_ANCHOR
    image_token = IMAGE_TOKEN
    untied_head = True  # mlx-vlm's LLaVA-NeXT text stack always has an lm_head
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
        # llava-v1.6's own processor_config.json, for the demo's sizes.
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
            raise ValueError("mlx-vlm's LLaVA-NeXT text stack needs head_dim = hidden_size / heads")
        text_fields = {
            "model_type": "llama",
            "vocab_size": vocab_size,
            "tie_word_embeddings": False,
        }
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
        return config | {"tie_word_embeddings": False}

    def vision_weights(self, config: Mapping[str, Any], feature_rms: float, rng) -> dict:
        """Random CLIP, projector and image newline weights, shaped as mlx-vlm's LLaVA-NeXT
        holds them: linear layers N(0, 1/fan_in) with small biases, so every activation stays
        near unit scale; the projector's last layer is scaled so the image tokens come out
        with RMS about `feature_rms` (the text embeddings'), and the newline drawn at it."""
        vision = config["vision_config"]
        width = vision["hidden_size"]
        positions = (vision["image_size"] // vision["patch_size"]) ** 2 + 1  # patches and CLS
        hidden = config["text_config"]["hidden_size"]
        tower = "vision_tower.vision_model"
        out = parts.patch_conv(rng, f"{tower}.embeddings.patch_embedding.weight", vision)
        out[f"{tower}.embeddings.class_embedding"] = rng.standard_normal(width)
        out[f"{tower}.embeddings.position_embedding.weight"] = (
            rng.standard_normal((positions, width)) * 0.5
        )
        out |= parts.unit_layer_norm(f"{tower}.pre_layrnorm", width)  # sic: CLIP's own name
        out |= parts.clip_encoder(rng, tower, vision)
        out |= parts.unit_layer_norm(f"{tower}.post_layernorm", width)
        out |= parts.random_linear(rng, "multi_modal_projector.linear_1", hidden, width)
        gain = parts.gelu_gain(feature_rms)
        out |= parts.random_linear(rng, "multi_modal_projector.linear_2", hidden, hidden, gain)
        out["image_newline"] = rng.standard_normal(hidden) * feature_rms
        return out


FAMILY = LlavaNext()
