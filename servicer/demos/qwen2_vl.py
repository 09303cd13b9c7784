"""The ``qwen2_vl`` family of the demo vision-language model (``servicer.demos.vision``), its
default.

mlx-vlm serves it, and the smg router's own preprocessor knows it by ``model_type`` whatever
the served name is (a name like ``demo:vlm`` included; qwen2_5_vl it would only know by a name
holding "qwen" and "vl"). The router preprocesses qwen2_vl itself (``mm_inputs``) even when
workers advertise an ``mm_processor``: its anchor is not one it leaves to a worker
(../shared/DESIGN.md).

Built from the ``llama`` text demo, nothing trained here:

- the language model is the text demo's trained weights moved into Qwen2-VL's text stack: the
  same sizes, RMSNorm, SwiGLU, tied embeddings, and rotary embeddings that multimodal RoPE
  reduces to for text positions; the q/k/v biases Qwen2 has and llama lacks are zeros. So
  greedy text is as varied as the text demo's.
- the tokenizer is the text demo's, with the family's vision tokens appended as special
  tokens (``<|vision_start|>``, ``<|vision_end|>``, ``<|vision_pad|>``, ``<|image_pad|>``,
  ``<|video_pad|>``) and embedding rows for them drawn at the trained rows' scale.
- the vision tower (patch size 14, 2x2 merge, as the real family) is random, from a
  seeded numpy generator, scaled so that its output tokens have the trained text
  embeddings' RMS: the image shifts the continuation without drowning the prompt.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from . import parts
from .common import special_token_ids
from .vision import Family, chat_template

VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
VISION_PAD = "<|vision_pad|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
# Appended after the text demo's vocabulary, in this order (Qwen2-VL's own order).
VISION_TOKENS = (VISION_START, VISION_END, VISION_PAD, IMAGE_PAD, VIDEO_PAD)
# What the chat template renders for one image, unexpanded: the processor (mlx-vlm's or
# the router's) repeats IMAGE_PAD once per merged patch.
IMAGE_ANCHOR = VISION_START + IMAGE_PAD + VISION_END
CHAT_TEMPLATE = chat_template(IMAGE_ANCHOR)

# The image processor: Qwen2-VL's (CLIP normalisation, 14-pixel patches, 2x2 merge, two
# temporal frames per patch), with pixel bounds kept small: 4 to 64 image tokens.
PATCH_SIZE = 14
MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2
MIN_PIXELS = (PATCH_SIZE * MERGE_SIZE) ** 2 * 4  # 56 x 56
MAX_PIXELS = (PATCH_SIZE * MERGE_SIZE) ** 2 * 64  # 224 x 224

# Text sizes come from the text demo's config; these are the vision tower's.
VISION_CONFIG: Mapping[str, Any] = {
    "model_type": "qwen2_vl",
    "depth": 2,
    "embed_dim": 64,
    "num_heads": 2,
    "mlp_ratio": 2,  # an int: transformers validates Qwen2VLVisionConfig strictly
    "in_channels": 3,
    "in_chans": 3,
    "patch_size": PATCH_SIZE,
    "spatial_patch_size": PATCH_SIZE,
    "spatial_merge_size": MERGE_SIZE,
    "temporal_patch_size": TEMPORAL_PATCH_SIZE,
    "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-6,
}


def _image_processor_config() -> dict[str, Any]:
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2VLProcessor",
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_convert_rgb": True,
        "image_mean": list(parts.CLIP_MEAN),
        "image_std": list(parts.CLIP_STD),
        "patch_size": PATCH_SIZE,
        "merge_size": MERGE_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        "min_pixels": MIN_PIXELS,
        "max_pixels": MAX_PIXELS,
        "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
    }


def patch_embedding(rng, vision: Mapping[str, Any], width: int) -> dict[str, Any]:
    """A Qwen-VL tower's patch embedding (a Conv3d without bias) in MLX's layout: (out,
    frames, height, width, in). A patch is the (flattened) normalised pixels, about unit scale,
    so fan-in scaling keeps the output there."""
    patch, frames, channels = (
        vision["patch_size"],
        vision["temporal_patch_size"],
        vision["in_channels"],
    )
    fan_in = frames * patch * patch * channels
    weight = rng.standard_normal((width, frames, patch, patch, channels)) / math.sqrt(fan_in)
    return {"vision_tower.patch_embed.proj.weight": weight}


_VIDEO_PROCESSOR_CONFIG = {
    **{k: v for k, v in _image_processor_config().items() if k != "image_processor_type"},
    "video_processor_type": "Qwen2VLVideoProcessor",
}


class Qwen2VL(Family):
    model_type = "qwen2_vl"
    architecture = "Qwen2VLForConditionalGeneration"
    text_kind = "llama"
    # The text model's own RECIPE_VERSION is part of the build name too.
    recipe_version = "v2"
    vision_tokens = VISION_TOKENS
    image_anchor = IMAGE_ANCHOR
    image_token = IMAGE_PAD
    # tokens_per_image: one per merged 28x28 patch.
    processor_files = {
        "preprocessor_config.json": _image_processor_config(),
        # Present so that mlx-vlm never looks for them on the hub.
        "processor_config.json": {"processor_class": "Qwen2VLProcessor"},
        "video_preprocessor_config.json": _VIDEO_PROCESSOR_CONFIG,
    }

    def model_config(
        self, text_config: Mapping[str, Any], ids: Mapping[str, int], vocab_size: int
    ) -> dict:
        heads = text_config["num_attention_heads"]
        head_dim = text_config["hidden_size"] // heads
        if text_config.get("head_dim", head_dim) != head_dim or head_dim % 8:
            raise ValueError(
                "the text model's head_dim must be hidden_size / heads, a multiple of 8"
            )
        # Multimodal RoPE splits the head's frequencies over (t, h, w) as 1/4, 3/8, 3/8 (the
        # real checkpoints' [16, 24, 24] for a 128-wide head).
        quarter = head_dim // 8
        mrope_section = [quarter, (head_dim // 2 - quarter) // 2, (head_dim // 2 - quarter) // 2]
        # The language model's fields sit at the top level, as in Qwen2-VL's own config.
        copied = (
            "hidden_size",
            "num_hidden_layers",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
            "rope_theta",
            "rms_norm_eps",
        )
        return {
            **{name: text_config[name] for name in copied},
            "hidden_act": "silu",
            "tie_word_embeddings": True,
            "rope_scaling": {"type": "mrope", "mrope_section": mrope_section},
            "vocab_size": vocab_size,
            **special_token_ids(ids),
            "vision_start_token_id": ids[VISION_START],
            "vision_end_token_id": ids[VISION_END],
            "vision_token_id": ids[VISION_PAD],
            "image_token_id": ids[IMAGE_PAD],
            "video_token_id": ids[VIDEO_PAD],
            "vision_config": {**VISION_CONFIG, "hidden_size": text_config["hidden_size"]},
        }

    def extra_text_weights(self, text_config: Mapping[str, Any]) -> dict:
        """Zero q/k/v biases: Qwen2 has them, llama lacks them."""
        import numpy as np

        head_dim = text_config["hidden_size"] // text_config["num_attention_heads"]
        widths = {
            "q_proj": text_config["num_attention_heads"] * head_dim,
            "k_proj": text_config["num_key_value_heads"] * head_dim,
            "v_proj": text_config["num_key_value_heads"] * head_dim,
        }
        return {
            f"language_model.model.layers.{layer}.self_attn.{proj}.bias": np.zeros(
                width, np.float32
            )
            for layer in range(text_config["num_hidden_layers"])
            for proj, width in widths.items()
        }

    def vision_weights(self, config: Mapping[str, Any], feature_rms: float, rng) -> dict:
        """Random vision tower weights, shaped as mlx-vlm's Qwen2-VL VisionModel holds them.

        Linear layers get N(0, 1/fan_in) weights and small biases, so every activation stays
        near unit scale; the merger's last layer is scaled so the image tokens come out with
        RMS `feature_rms` (the text embeddings'), for post-LayerNorm inputs.
        """
        config = config["vision_config"]
        width = config["embed_dim"]
        hidden = config["hidden_size"]
        mlp = int(width * config["mlp_ratio"])
        merged = width * config["spatial_merge_size"] ** 2
        out: dict[str, Any] = patch_embedding(rng, config, width)
        for block in range(config["depth"]):
            prefix = f"vision_tower.blocks.{block}"
            out |= parts.unit_layer_norm(f"{prefix}.norm1", width)
            out |= parts.unit_layer_norm(f"{prefix}.norm2", width)
            out |= parts.random_linear(rng, f"{prefix}.attn.qkv", 3 * width, width)
            out |= parts.random_linear(rng, f"{prefix}.attn.proj", width, width, gain=0.5)
            out |= parts.random_linear(rng, f"{prefix}.mlp.fc1", mlp, width)
            out |= parts.random_linear(rng, f"{prefix}.mlp.fc2", width, mlp, gain=0.5)
        out |= parts.unit_layer_norm("vision_tower.merger.ln_q", width)
        out |= parts.random_linear(rng, "vision_tower.merger.mlp.0", merged, merged)
        gain = parts.gelu_gain(feature_rms)
        out |= parts.random_linear(rng, "vision_tower.merger.mlp.2", hidden, merged, gain=gain)
        return out


FAMILY = Qwen2VL()
