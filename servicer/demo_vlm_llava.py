"""The ``llava`` family of the demo vision-language model (``servicer.demo_vlm``).

LLaVA (1.5's architecture): a CLIP vision tower, a projector (linear, gelu, linear) and a
llama text model. Built from the ``llama`` text demo (``demo_model``), nothing trained here:

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

import math
from collections.abc import Mapping
from typing import Any

from servicer.demo_model import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN
from servicer.demo_vlm import CLIP_MEAN, CLIP_STD, Family, random_linear, unit_layer_norm

MODEL_TYPE = "llava"
TEXT_KIND = "llama"  # the demo_model kind whose weights become the language model
# Bump whenever anything that changes the built files changes (configs, tokens, init).
VLM_RECIPE_VERSION = "v1"

IMAGE_TOKEN = "<image>"
# Appended after the text demo's vocabulary: id 512.
VISION_TOKENS = (IMAGE_TOKEN,)
IMAGE_ANCHOR = IMAGE_TOKEN  # what the chat template renders for one image, unexpanded

IMAGE_SIZE = 56  # every image is resized (shortest edge) and centre-cropped to this square
PATCH_SIZE = 14
TOKENS_PER_IMAGE = (IMAGE_SIZE // PATCH_SIZE) ** 2  # 16: one per patch, CLS dropped

VISION_CONFIG: Mapping[str, Any] = {
    "model_type": "clip_vision_model",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_channels": 3,
    "image_size": IMAGE_SIZE,
    "patch_size": PATCH_SIZE,
    "projection_dim": 64,
    "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-5,
}
# The text demo's config fields that are not the text model's.
_NOT_TEXT_FIELDS = ("architectures", "demo_build", "torch_dtype")
# E[gelu(z)^2] for z ~ N(0, 1): sizes the projector's last layer (see _vision_weights).
_GELU_SECOND_MOMENT = 0.4252


def _model_config(text_config: Mapping[str, Any], ids: Mapping[str, int], vocab_size: int) -> dict:
    hidden, heads = text_config["hidden_size"], text_config["num_attention_heads"]
    if text_config.get("head_dim", hidden // heads) * heads != hidden:
        raise ValueError("mlx-vlm's LLaVA text stack needs head_dim = hidden_size / heads")
    text = {k: v for k, v in text_config.items() if k not in _NOT_TEXT_FIELDS}
    return {
        "architectures": ["LlavaForConditionalGeneration"],
        "model_type": MODEL_TYPE,
        "text_config": {
            **text,
            "model_type": "llama",
            "vocab_size": vocab_size,
            "tie_word_embeddings": True,
        },
        "vision_config": dict(VISION_CONFIG),
        "image_token_index": ids[IMAGE_TOKEN],
        "image_seq_length": TOKENS_PER_IMAGE,
        "projector_hidden_act": "gelu",
        "vision_feature_select_strategy": "default",  # the CLS token dropped
        "vision_feature_layer": -2,
        "vocab_size": vocab_size,
        "bos_token_id": ids[BOS_TOKEN],
        "eos_token_id": ids[EOS_TOKEN],
        "pad_token_id": ids[PAD_TOKEN],
        "tie_word_embeddings": True,
    }


def _vision_weights(config: Mapping[str, Any], feature_rms: float, rng) -> dict:
    """Random CLIP and projector weights, shaped as mlx-vlm's LLaVA holds them.

    Linear layers get N(0, 1/fan_in) weights and small biases, so every activation stays
    near unit scale (the tower's residual stream starts LayerNorm-ed); the projector's last
    layer is scaled so the image tokens come out with RMS about `feature_rms` (the text
    embeddings'), for gelu of unit-scale inputs.
    """
    import numpy as np

    vision = config["vision_config"]
    width, mlp = vision["hidden_size"], vision["intermediate_size"]
    patch, channels = vision["patch_size"], vision["num_channels"]
    positions = (vision["image_size"] // patch) ** 2 + 1  # the patches and CLS
    hidden = config["text_config"]["hidden_size"]
    tower = "vision_tower.vision_model"
    out: dict[str, Any] = {}
    # MLX's Conv2d layout: (out, height, width, in); pixels are CLIP-normalised. CLIP's
    # patch embedding has no bias.
    out[f"{tower}.embeddings.patch_embedding.weight"] = rng.standard_normal(
        (width, patch, patch, channels)
    ) / math.sqrt(patch * patch * channels)
    out[f"{tower}.embeddings.class_embedding"] = rng.standard_normal(width)
    out[f"{tower}.embeddings.position_embedding.weight"] = (
        rng.standard_normal((positions, width)) * 0.5
    )
    out |= unit_layer_norm(f"{tower}.pre_layrnorm", width)  # sic: CLIP's own name
    for layer in range(vision["num_hidden_layers"]):
        prefix = f"{tower}.encoder.layers.{layer}"
        out |= unit_layer_norm(f"{prefix}.layer_norm1", width)
        out |= unit_layer_norm(f"{prefix}.layer_norm2", width)
        for proj in ("q_proj", "k_proj", "v_proj"):
            out |= random_linear(rng, f"{prefix}.self_attn.{proj}", width, width)
        out |= random_linear(rng, f"{prefix}.self_attn.out_proj", width, width, gain=0.5)
        out |= random_linear(rng, f"{prefix}.mlp.fc1", mlp, width)
        out |= random_linear(rng, f"{prefix}.mlp.fc2", width, mlp, gain=0.5)
    out |= unit_layer_norm(f"{tower}.post_layernorm", width)
    out |= random_linear(rng, "multi_modal_projector.linear_1", hidden, width)
    gain = feature_rms / math.sqrt(_GELU_SECOND_MOMENT)
    out |= random_linear(rng, "multi_modal_projector.linear_2", hidden, hidden, gain)
    return {name: np.asarray(value, np.float32) for name, value in out.items()}


def _image_processor_config() -> dict[str, Any]:
    return {
        "image_processor_type": "CLIPImageProcessor",
        "processor_class": "LlavaProcessor",
        "do_resize": True,
        "size": {"shortest_edge": IMAGE_SIZE},
        "resample": 3,  # bicubic
        "do_center_crop": True,
        "crop_size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": list(CLIP_MEAN),
        "image_std": list(CLIP_STD),
        "do_convert_rgb": True,
    }


FAMILY = Family(
    model_type=MODEL_TYPE,
    text_kind=TEXT_KIND,
    recipe_version=VLM_RECIPE_VERSION,
    vision_tokens=VISION_TOKENS,
    image_anchor=IMAGE_ANCHOR,
    image_token=IMAGE_TOKEN,
    tokens_per_image=TOKENS_PER_IMAGE,
    model_config=_model_config,
    vision_weights=_vision_weights,
    processor_files={
        "preprocessor_config.json": _image_processor_config(),
        # llava-1.5's own processor_config.json, for the demo's sizes: the processor counts
        # (56/14)^2 patches + 1 (CLS) - 1 (dropped by the "default" strategy) tokens.
        "processor_config.json": {
            "processor_class": "LlavaProcessor",
            "image_token": IMAGE_TOKEN,
            "patch_size": PATCH_SIZE,
            "vision_feature_select_strategy": "default",
            "num_additional_image_tokens": 1,
        },
    },
    tokenizer_fields={"extra_special_tokens": {"image_token": IMAGE_TOKEN}},
)
