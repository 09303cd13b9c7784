"""The ``lfm2_vl`` family of the demo vision-language model (``servicer.demos.vision``).

LFM2-VL (LiquidAI; config.json's model type "lfm2_vl" as transformers names it, "lfm2-vl" in
checkpoints made before: ``servicer.demos.lfm2_vl_dashed``): a SigLIP2 NaFlex vision tower
(patches flattened, packed into rows of ``MAX_PATCHES``, position embeddings resized to each
image's patch grid), a pixel unshuffle of 2x2 patches into one, a projector (LayerNorm,
linear, GELU, linear) and an LFM2 text model (gated short-convolution layers and attention
layers). An image larger than ``TILE`` pixels a side (about) is cut into a grid of 2 to 10
tiles plus a thumbnail, each tile marked ``<|img_row_R_col_C|>``; a smaller one is resized
to whole patches; ``<|image_start|>`` and ``<|image_end|>`` close the run. mlx-vlm's
processor (``mlx_vlm/models/lfm2_vl/processing_lfm2_vl.py``, numpy and PIL over
transformers' Lfm2VlProcessor) expands the ``<image>`` anchor; the worker runs that module
itself, without MLX (``servicer.vlm_modules``). Built from the ``llama`` text demo
(``servicer.demos.text``), nothing trained here:

- the tokenizer and token embeddings are the text demo's trained ones, with LFM2-VL's image
  tokens appended as special tokens (``<image>``, the start, end and thumbnail markers and
  a ``<|img_row_R_col_C|>`` per tile of every grid of up to 10 tiles) and embedding rows
  for them drawn at the trained rows' scale; the chat template renders ``<image>``
  (``IMAGE_ANCHOR``) per image part.
- the text layers are random (LFM2's differ from llama's): a short-convolution layer, then
  an attention layer (the text demo's sizes), linear layers N(0, 1/fan_in) with each
  layer's output scaled to 4x the embeddings' RMS, under ``language_model.model.``: mlx-vlm
  runs them with its LFM2 model, the worker with mlx-lm's lfm2 built from text_config (mlx-lm
  has no "lfm2_vl"; it loads "lfm2-vl" checkpoints itself, their vision weights dropped).
- the vision tower is a tiny SigLIP2 (4-pixel patches, 32-pixel tiles: 8x8 patches, 16
  image tokens a tile), random from a seeded numpy generator; the projector is scaled so
  that the image tokens enter the language model at the text embeddings' RMS.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from . import parts
from .vision import Family

IMAGE_TOKEN = "<image>"
IMAGE_ANCHOR = IMAGE_TOKEN  # what the chat template renders for one image, unexpanded
START, END, THUMBNAIL = "<|image_start|>", "<|image_end|>", "<|img_thumbnail|>"
MAX_TILES = 10  # mlx-vlm's processor tiles with its own defaults: 2 to 10 tiles
TILE_MARKERS = tuple(
    f"<|img_row_{r}_col_{c}|>"
    for r in range(1, MAX_TILES + 1)
    for c in range(1, MAX_TILES + 1)
    if r * c <= MAX_TILES
)

PATCH_SIZE = 4
DOWNSAMPLE = 2  # the pixel unshuffle: 2x2 patches one image token
TILE = 32
MAX_IMAGE_TOKENS = 16  # a tile's: (32 / 4 / 2)^2
MIN_IMAGE_TOKENS = 4
MAX_PATCHES = (TILE // PATCH_SIZE) ** 2  # 64: a tile's patches, the packed row's length
# Each random text layer adds this many times the embeddings' RMS to the residual stream:
# enough that the continuation is the context's, not the last token's echo.
LAYER_GAIN = 4.0

VISION_CONFIG = parts.tower_config(
    "siglip2_vision_model",
    TILE,
    PATCH_SIZE,
    heads={},
    rest={
        "num_patches": MAX_PATCHES,
        "layer_norm_eps": 1e-6,
        "hidden_act": "gelu_pytorch_tanh",
        "vision_use_head": False,
    },
)

# Where the image processor's settings differ from mlx-vlm's defaults (it reads both files).
PROCESSOR_SETTINGS = {
    "downsample_factor": DOWNSAMPLE,
    "encoder_patch_size": PATCH_SIZE,
    "tile_size": TILE,
    "min_image_tokens": MIN_IMAGE_TOKENS,
    "max_image_tokens": MAX_IMAGE_TOKENS,
    "max_pixels_tolerance": 2.0,
    "do_pad": True,
}


def lfm2_text_layers(text: Mapping[str, Any], feature_rms: float, rng) -> dict:
    """Random LFM2 layers at the text demo's sizes (a short convolution, then attention),
    under mlx-lm's and mlx-vlm's names less ``language_model.model.``: every linear layer
    N(0, 1/fan_in), each layer's output layer scaled to `feature_rms` (the embeddings' RMS),
    norms at one."""
    import numpy as np

    hidden, ff = text["hidden_size"], text["intermediate_size"]
    feature_rms *= LAYER_GAIN
    heads, kv_heads = text["num_attention_heads"], text["num_key_value_heads"]
    head_dim = hidden // heads
    out: dict[str, Any] = {"embedding_norm.weight": np.ones(hidden)}
    for layer, kind in enumerate(text["layer_types"]):
        prefix = f"layers.{layer}"
        if kind == "conv":
            out |= parts.random_linear(
                rng, f"{prefix}.conv.in_proj", 3 * hidden, hidden, bias=False
            )
            conv = rng.standard_normal((hidden, text["conv_L_cache"], 1)) / math.sqrt(3)
            out[f"{prefix}.conv.conv.weight"] = conv
            out |= parts.random_linear(
                rng, f"{prefix}.conv.out_proj", hidden, hidden, feature_rms, bias=False
            )
        else:
            attention = f"{prefix}.self_attn"
            widths = {"q_proj": hidden, "k_proj": kv_heads * head_dim}
            widths["v_proj"] = kv_heads * head_dim
            for proj, width in widths.items():
                out |= parts.random_linear(rng, f"{attention}.{proj}", width, hidden, bias=False)
            out |= parts.random_linear(
                rng, f"{attention}.out_proj", hidden, hidden, feature_rms, bias=False
            )
            out[f"{attention}.q_layernorm.weight"] = np.ones(head_dim)
            out[f"{attention}.k_layernorm.weight"] = np.ones(head_dim)
        out |= parts.random_linear(rng, f"{prefix}.feed_forward.w1", ff, hidden, bias=False)
        out |= parts.random_linear(rng, f"{prefix}.feed_forward.w3", ff, hidden, bias=False)
        out |= parts.random_linear(
            rng, f"{prefix}.feed_forward.w2", hidden, ff, feature_rms, bias=False
        )
        out[f"{prefix}.operator_norm.weight"] = np.ones(hidden)
        out[f"{prefix}.ffn_norm.weight"] = np.ones(hidden)
    return out


class Lfm2Vl(Family):
    model_type = "lfm2_vl"
    architecture = "Lfm2VlForConditionalGeneration"
    text_kind = "llama"
    recipe_version = "v1"
    # Appended after the text vocabulary: 512 onwards.
    vision_tokens = (IMAGE_TOKEN, START, END, THUMBNAIL, *TILE_MARKERS)
    image_anchor = IMAGE_ANCHOR
    image_token = IMAGE_TOKEN
    tokenizer_fields = {
        "extra_special_tokens": {
            "image_token": IMAGE_TOKEN,
            "image_start_token": START,
            "image_end_token": END,
            "image_thumbnail_token": THUMBNAIL,
        }
    }
    processor_files = {
        "preprocessor_config.json": parts.image_processor_config(
            "Lfm2VlImageProcessor",
            "Lfm2VlProcessor",
            {"resample": 3},  # bicubic
            mean=(0.5, 0.5, 0.5),
            std=(0.5, 0.5, 0.5),
            more={**PROCESSOR_SETTINGS, "max_num_patches": MAX_PATCHES},
        ),
        "processor_config.json": {
            "processor_class": "Lfm2VlProcessor",
            "use_image_special_tokens": True,
        },
    }

    def model_config(
        self, text_config: Mapping[str, Any], ids: Mapping[str, int], vocab_size: int
    ) -> dict:
        text_fields = {
            "model_type": "lfm2",
            "vocab_size": vocab_size,
            "tie_word_embeddings": True,
            "norm_eps": text_config["rms_norm_eps"],
            "conv_bias": False,
            "conv_L_cache": 3,
            "block_dim": text_config["hidden_size"],
            "block_ff_dim": text_config["intermediate_size"],
            "block_multiple_of": 16,
            "block_ffn_dim_multiplier": 1.0,
            "block_auto_adjust_ff_dim": False,
            "layer_types": ["conv", "full_attention"],
        }
        if text_config["num_hidden_layers"] != len(text_fields["layer_types"]):
            raise ValueError("the LFM2 demo stack has one conv and one attention layer")
        fields = {
            "image_token_index": ids[IMAGE_TOKEN],
            "image_token_id": ids[IMAGE_TOKEN],
            "projector_hidden_size": text_config["hidden_size"],
            "projector_bias": True,
            "projector_use_layernorm": True,
            "projector_hidden_act": "gelu",
            "vision_feature_layer": -1,
            "max_num_patches": MAX_PATCHES,
            "do_image_splitting": True,
            "min_tiles": 2,
            "max_tiles": MAX_TILES,
            "use_thumbnail": True,
            **PROCESSOR_SETTINGS,
        }
        return parts.nested_config(text_config, text_fields, VISION_CONFIG, fields, ids, vocab_size)

    def vision_weights(self, config: Mapping[str, Any], feature_rms: float, rng) -> dict:
        """The SigLIP2 tower and projector, and (under ``lfm2.``) the random LFM2 layers,
        which replace the text demo's llama layers in `saved_weights`."""
        vision = config["vision_config"]
        width, patch = vision["hidden_size"], vision["patch_size"]
        hidden = config["text_config"]["hidden_size"]
        tower = "vision_tower"
        out = parts.random_linear(
            rng, f"{tower}.embeddings.patch_embedding", width, 3 * patch * patch
        )
        out[f"{tower}.embeddings.position_embedding.weight"] = (
            rng.standard_normal((vision["num_patches"], width)) * 0.5
        )
        out |= parts.clip_encoder(rng, tower, vision)
        out |= parts.unit_layer_norm(f"{tower}.post_layernorm", width)
        unshuffled = width * config["downsample_factor"] ** 2
        projector = "multi_modal_projector"
        out |= parts.unit_layer_norm(f"{projector}.layer_norm", unshuffled)
        out |= parts.random_linear(rng, f"{projector}.linear_1", hidden, unshuffled)
        gain = parts.gelu_gain(feature_rms)
        out |= parts.random_linear(rng, f"{projector}.linear_2", hidden, hidden, gain)
        text = lfm2_text_layers(config["text_config"], feature_rms, rng)
        return out | {f"lfm2.{name}": value for name, value in text.items()}

    def saved_weights(self, weights: dict) -> dict:
        llama = ("language_model.model.layers.", "language_model.model.norm.")
        out = {k: v for k, v in weights.items() if not k.startswith((*llama, "lfm2."))}
        lfm2 = {k.removeprefix("lfm2."): v for k, v in weights.items() if k.startswith("lfm2.")}
        return out | {f"language_model.model.{name}": value for name, value in lfm2.items()}


FAMILY = Lfm2Vl()
