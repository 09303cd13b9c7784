"""The ``llava`` family of the demo vision-language model (``servicer.demos.vision``).

LLaVA (1.5's architecture): a CLIP vision tower, a projector (linear, gelu, linear) and a
llama text model. Built from the ``llama`` text demo (``servicer.demos.text``), nothing
trained here:

- the language model is the text demo's trained weights as they are, under
  ``language_model.``, with ``text_config.model_type`` "llama": mlx-vlm runs it with its
  LLaVA text stack, and the worker with mlx-lm's llama model (``servicer.engine.model``), both
  plain 1-D RoPE: the text demo exactly.
- the tokenizer is the text demo's with ``<image>`` appended as a special token and an
  embedding row for it drawn at the trained rows' scale. The chat template renders
  ``<image>`` (``IMAGE_ANCHOR``) per image part; the processor (mlx-vlm's LlavaProcessor)
  repeats it ``TOKENS_PER_IMAGE`` times: one per patch of the resized and centre-cropped
  image, the CLS token dropped (``vision_feature_select_strategy`` "default").
- the vision tower is a tiny CLIP (56-pixel images, 14-pixel patches: 4x4 = 16 image
  tokens), random from a seeded numpy generator; its features come from the next-to-last
  layer, as LLaVA's do, and the projector is scaled so that the image tokens enter the
  language model at about the text embeddings' RMS: the image shifts the continuation
  without drowning the prompt.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import parts
from .vision import Family

IMAGE_TOKEN = "<image>"
IMAGE_ANCHOR = IMAGE_TOKEN  # what the chat template renders for one image, unexpanded

IMAGE_SIZE = 56  # every image is resized (shortest edge) and centre-cropped to this square
PATCH_SIZE = 14
TOKENS_PER_IMAGE = (IMAGE_SIZE // PATCH_SIZE) ** 2  # 16: one per patch, CLS dropped

VISION_CONFIG = parts.tower_config(
    "clip_vision_model",
    IMAGE_SIZE,
    PATCH_SIZE,
    heads={},
    rest={"projection_dim": 64, "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5},
)


class Llava(Family):
    model_type = "llava"
    architecture = "LlavaForConditionalGeneration"
    text_kind = "llama"
    recipe_version = "v1"
    vision_tokens = (IMAGE_TOKEN,)  # appended after the text demo's vocabulary: id 512
    image_anchor = IMAGE_ANCHOR
    image_token = IMAGE_TOKEN
    tokens_per_image = TOKENS_PER_IMAGE
    tokenizer_fields = {"extra_special_tokens": {"image_token": IMAGE_TOKEN}}
    processor_files = {
        "preprocessor_config.json": parts.image_processor_config(
            "CLIPImageProcessor",
            "LlavaProcessor",
            {
                "size": {"shortest_edge": IMAGE_SIZE},
                "resample": 3,  # bicubic
                "do_center_crop": True,
                "crop_size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
            },
            parts.CLIP_MEAN,
            parts.CLIP_STD,
        ),
        # llava-1.5's own processor_config.json, for the demo's sizes: the processor counts
        # (56/14)^2 patches + 1 (CLS) - 1 (dropped by the "default" strategy) tokens.
        "processor_config.json": {
            "processor_class": "LlavaProcessor",
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
            raise ValueError("mlx-vlm's LLaVA text stack needs head_dim = hidden_size / heads")
        text_fields = {"model_type": "llama", "vocab_size": vocab_size, "tie_word_embeddings": True}
        fields = {
            "image_token_index": ids[IMAGE_TOKEN],
            "image_seq_length": TOKENS_PER_IMAGE,
            "projector_hidden_act": "gelu",
            "vision_feature_select_strategy": "default",  # the CLS token dropped
            "vision_feature_layer": -2,
        }
        return parts.nested_config(text_config, text_fields, VISION_CONFIG, fields, ids, vocab_size)

    def vision_weights(self, config: Mapping[str, Any], feature_rms: float, rng) -> dict:
        """Random CLIP and projector weights, shaped as mlx-vlm's LLaVA holds them.

        Linear layers get N(0, 1/fan_in) weights and small biases, so every activation stays
        near unit scale (the tower's residual stream starts LayerNorm-ed); the projector's last
        layer is scaled so the image tokens come out with RMS about `feature_rms` (the text
        embeddings'), for gelu of unit-scale inputs.
        """
        vision = config["vision_config"]
        width = vision["hidden_size"]
        positions = (vision["image_size"] // vision["patch_size"]) ** 2 + 1  # patches and CLS
        hidden = config["text_config"]["hidden_size"]
        tower = "vision_tower.vision_model"
        # Pixels are CLIP-normalised. CLIP's patch embedding has no bias.
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
        return out


FAMILY = Llava()
