"""The ``pixtral`` family of the demo vision-language model (``servicer.demos.vision``).

Pixtral (Pixtral-12B's layout): a Pixtral vision tower with no patch merger (one image token
per patch), a projector (linear, gelu, linear, with biases) and a Mistral text model. Built
from the ``llama`` text demo (``servicer.demos.text``), nothing trained here:

- the language model is the text demo's trained weights as they are, under
  ``language_model.``, with ``text_config.model_type`` "mistral", and an ``lm_head`` that is a
  copy of the embeddings (both loaders hold one: mlx-vlm's Pixtral text stack always, mlx-lm's
  ``pixtral`` model type unties it): mlx-vlm runs it with Pixtral's Mistral stack and mlx-lm
  with its llama model, both plain 1-D RoPE: the text demo exactly.
- the tokenizer is the text demo's with Pixtral's image tokens appended as special tokens
  (``[IMG]``, ``[IMG_BREAK]``, ``[IMG_END]``) and embedding rows for them drawn at the
  trained rows' scale. The chat template renders ``[IMG]`` (``IMAGE_ANCHOR``) per image
  part; the processor (mlx-vlm's, as transformers' PixtralProcessor) expands it into
  ``image_sequence(rows, cols)``: a row of ``[IMG]`` per 16-pixel row of the image, rows
  ended by ``[IMG_BREAK]`` and the last by ``[IMG_END]``. Image features replace the
  ``[IMG]`` tokens only; the break and end tokens keep their embeddings.
- the vision tower is a tiny Pixtral (16-pixel patches as Pixtral-12B's; images fit into
  64x64 and rounded up to 16-pixel multiples: at most 4x4 image tokens), random from a
  seeded numpy generator; the projector is scaled so that the image tokens enter the
  language model at the text embeddings' RMS: the image shifts the continuation without
  drowning the prompt.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from . import parts
from .vision import Family

IMAGE_TOKEN = "[IMG]"
IMAGE_BREAK_TOKEN = "[IMG_BREAK]"
IMAGE_END_TOKEN = "[IMG_END]"
# Appended after the text demo's vocabulary, in this order: ids 512, 513, 514.
VISION_TOKENS = (IMAGE_TOKEN, IMAGE_BREAK_TOKEN, IMAGE_END_TOKEN)
# What the chat template renders for one image, unexpanded (Pixtral's own anchor).
IMAGE_ANCHOR = IMAGE_TOKEN

PATCH_SIZE = 16  # one image token per patch: no merger
IMAGE_SIZE = 64  # longest edge an image is shrunk to fit: at most 4x4 image tokens

VISION_CONFIG = parts.tower_config(
    "pixtral",
    IMAGE_SIZE,  # sizes the 2-D RoPE table: must hold the largest image
    PATCH_SIZE,
    heads={"head_dim": 32},
    rest={"rope_theta": 10000.0, "rms_norm_eps": 1e-5, "hidden_act": "silu"},
)


def image_grid(height: int, width: int) -> tuple[int, int]:
    """(rows, cols) of image tokens for an image of `height` x `width` pixels: shrunk to fit
    IMAGE_SIZE (never enlarged), then each side rounded up to whole patches, as Pixtral's
    image processor does."""
    ratio = max(height / IMAGE_SIZE, width / IMAGE_SIZE)
    if ratio > 1:
        height, width = math.floor(height / ratio), math.floor(width / ratio)
    return -(-height // PATCH_SIZE), -(-width // PATCH_SIZE)


def image_sequence(rows: int, cols: int) -> str:
    """What the processor puts in place of one anchor for a `rows` x `cols` grid:
    rows * cols image tokens and one break (the last one an end) per row."""
    return IMAGE_BREAK_TOKEN.join([IMAGE_TOKEN * cols] * rows) + IMAGE_END_TOKEN


class Pixtral(Family):
    model_type = "pixtral"
    architecture = "LlavaForConditionalGeneration"
    text_kind = "llama"
    recipe_version = "v1"
    vision_tokens = VISION_TOKENS
    image_anchor = IMAGE_ANCHOR
    image_token = IMAGE_TOKEN
    untied_head = True
    # tokens_per_image: rows x cols of 16-pixel patches, plus a break or end per row.
    processor_files = {
        "preprocessor_config.json": parts.image_processor_config(
            "PixtralImageProcessor",
            "PixtralProcessor",
            {
                "size": {"longest_edge": IMAGE_SIZE},
                "patch_size": {"height": PATCH_SIZE, "width": PATCH_SIZE},
                "resample": 3,  # bicubic
            },
            parts.CLIP_MEAN,
            parts.CLIP_STD,
        ),
        # Pixtral-12B's own processor_config.json, for the demo's tokens and sizes.
        "processor_config.json": {
            "processor_class": "PixtralProcessor",
            "image_token": IMAGE_TOKEN,
            "image_break_token": IMAGE_BREAK_TOKEN,
            "image_end_token": IMAGE_END_TOKEN,
            "patch_size": PATCH_SIZE,
            "spatial_merge_size": 1,
        },
    }

    def model_config(
        self, text_config: Mapping[str, Any], ids: Mapping[str, int], vocab_size: int
    ) -> dict:
        heads = text_config["num_attention_heads"]
        text_fields = {
            # Pixtral's Mistral stack for mlx-vlm, llama for mlx-lm; both need head_dim.
            "model_type": "mistral",
            "head_dim": text_config.get("head_dim", text_config["hidden_size"] // heads),
            "vocab_size": vocab_size,
            "tie_word_embeddings": False,
        }
        fields = {
            "image_token_index": ids[IMAGE_TOKEN],
            "projector_hidden_act": "gelu",
            "vision_feature_layer": -1,
            "vision_feature_select_strategy": "full",
        }
        config = parts.nested_config(
            text_config, text_fields, VISION_CONFIG, fields, ids, vocab_size
        )
        config["tie_word_embeddings"] = False
        return config

    def vision_weights(self, config: Mapping[str, Any], feature_rms: float, rng) -> dict:
        """Random Pixtral and projector weights, shaped as mlx-vlm's Pixtral holds them.

        Linear layers get N(0, 1/fan_in) weights (Pixtral's tower has no biases), so every
        activation stays near unit scale; RMSNorms start at one. The projector's last layer
        is scaled so the image tokens come out with RMS `feature_rms` (the text embeddings'),
        for gelu of unit-scale inputs.
        """
        import numpy as np

        vision = config["vision_config"]
        width, mlp = vision["hidden_size"], vision["intermediate_size"]
        hidden = config["text_config"]["hidden_size"]
        tower = "vision_tower.vision_model"

        def linear(name: str, fan_out: int, fan_in: int, gain: float = 1.0) -> dict:
            return parts.random_linear(rng, name, fan_out, fan_in, gain, bias=False)

        out = parts.patch_conv(rng, f"{tower}.patch_conv.weight", vision)  # pixels CLIP-normalised
        out[f"{tower}.ln_pre.weight"] = np.ones(width)
        for layer in range(vision["num_hidden_layers"]):
            prefix = f"{tower}.transformer.layers.{layer}"
            out[f"{prefix}.attention_norm.weight"] = np.ones(width)
            out[f"{prefix}.ffn_norm.weight"] = np.ones(width)
            for proj in ("q_proj", "k_proj", "v_proj"):
                out |= linear(f"{prefix}.attention.{proj}", width, width)
            out |= linear(f"{prefix}.attention.o_proj", width, width, 0.5)
            for proj in ("gate_proj", "up_proj"):
                out |= linear(f"{prefix}.feed_forward.{proj}", mlp, width)
            out |= linear(f"{prefix}.feed_forward.down_proj", width, mlp, 0.5)
        projector = "multi_modal_projector"
        out |= parts.random_linear(rng, f"{projector}.linear_1", hidden, width)
        gain = parts.gelu_gain(feature_rms)
        out |= parts.random_linear(rng, f"{projector}.linear_2", hidden, hidden, gain)
        return out


FAMILY = Pixtral()
