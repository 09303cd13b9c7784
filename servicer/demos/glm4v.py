"""The ``glm4v`` family of the demo vision-language model (``servicer.demos.vision``):
GLM-4.1V / GLM-4.5V-style (dense text stack).

GLM-4V: a ViT whose patches are merged 2x2 by a convolution and a SwiGLU merger, the image
tokens given 3-D rotary positions (t, h, w) in the text model as Qwen2-VL's are, a GLM-4 text
model (partial rotary embeddings in even/odd pairs, norms after attention and MLP too). The
worker runs mlx-lm's ``glm4`` model on ``text_config`` (``model_type`` "glm4v_text", which
mlx-lm lacks: the registry maps it) with ``servicer.engine.mrope``'s positions for image rows.
Built from the ``llama`` text demo (``servicer.demos.text``), nothing trained here:

- the language model is the text demo's trained weights in GLM-4's layout: the MLP's gate and
  up projections fused (``gate_up_proj``), zero q/k/v biases, its own output head (a copy of
  the tied embedding), and the norms GLM-4 adds after attention and after the MLP at
  ``POST_NORM_SCALES`` (the text demo's own attention and MLP outputs' RMS, so its
  residual stream keeps its scale). GLM's partial rotary embedding (half the head, even/odd
  pairs) is not the llama demo's, so the text differs from the text demo's, still varied.
- the tokenizer is the text demo's with GLM-4V's image and video tokens appended as special
  tokens (``<|begin_of_image|>``, ``<|end_of_image|>``, ``<|image|>``, the video ones, and
  the box markers mlx-vlm's processor adds) and embedding rows for them drawn at the trained
  rows' scale. The chat template renders ``IMAGE_ANCHOR`` per image; the processor
  (transformers' Glm4vProcessor / Glm4vImageProcessorPil, mlx-vlm's alike) repeats
  ``<|image|>`` once per merged 28x28 patch: 4 to 64 image tokens an image.
- the vision tower (patch size 14, 2x2 merge, two temporal frames, as the real family;
  width 64, 2 layers, a 4x4 grid of learned positions interpolated to each image's) is
  random, from a seeded numpy generator, its merger's last layer scaled so that its output
  tokens have the trained text embeddings' RMS: the image shifts the continuation without
  drowning the prompt.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from . import parts
from .common import special_token_ids
from .vision import Family

BEGIN_IMAGE = "<|begin_of_image|>"
END_IMAGE = "<|end_of_image|>"
IMAGE_TOKEN = "<|image|>"
BEGIN_VIDEO = "<|begin_of_video|>"
END_VIDEO = "<|end_of_video|>"
VIDEO_TOKEN = "<|video|>"
BOX_TOKENS = ("<|begin_of_box|>", "<|end_of_box|>")  # mlx-vlm's processor adds them
# Appended after the text demo's vocabulary, in this order.
VISION_TOKENS = (BEGIN_IMAGE, END_IMAGE, IMAGE_TOKEN, BEGIN_VIDEO, END_VIDEO, VIDEO_TOKEN)
VISION_TOKENS += BOX_TOKENS
IMAGE_ANCHOR = BEGIN_IMAGE + IMAGE_TOKEN + END_IMAGE  # what the chat template renders

PATCH_SIZE = 14
MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2
CELL = PATCH_SIZE * MERGE_SIZE  # one image token's pixels a side
# GLM's processor bounds frames x height x width (two frames for an image): 4 to 64 tokens.
MIN_PIXELS = TEMPORAL_PATCH_SIZE * CELL**2 * 4
MAX_PIXELS = TEMPORAL_PATCH_SIZE * CELL**2 * 64
# (after attention, after the MLP) per layer: the text demo's own attention and MLP outputs'
# RMS on a corpus chat, layer by layer.
POST_NORM_SCALES = ((0.8, 3.4), (0.67, 0.8))

VISION_CONFIG: Mapping[str, Any] = {
    "model_type": "glm4v",
    "depth": 2,
    "hidden_size": 64,
    "intermediate_size": 128,  # the merger's SwiGLU width
    "num_heads": 2,
    "patch_size": PATCH_SIZE,
    "image_size": 4 * PATCH_SIZE,  # learned positions: a 4x4 grid
    "in_channels": 3,
    "spatial_merge_size": MERGE_SIZE,
    "temporal_patch_size": TEMPORAL_PATCH_SIZE,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "attention_bias": False,
}


def qkv_biases(text_config: Mapping[str, Any]) -> dict:
    """Zero q/k/v biases for every layer (GLM-4 has them, llama lacks them)."""
    import numpy as np

    head_dim = text_config["hidden_size"] // text_config["num_attention_heads"]
    widths = {
        "q_proj": text_config["num_attention_heads"] * head_dim,
        "k_proj": text_config["num_key_value_heads"] * head_dim,
        "v_proj": text_config["num_key_value_heads"] * head_dim,
    }
    return {
        f"language_model.model.layers.{layer}.self_attn.{proj}.bias": np.zeros(width, np.float32)
        for layer in range(text_config["num_hidden_layers"])
        for proj, width in widths.items()
    }


class Glm4v(Family):
    model_type = "glm4v"
    architecture = "Glm4vForConditionalGeneration"
    text_kind = "llama"
    recipe_version = "v1"
    vision_tokens = VISION_TOKENS
    image_anchor = IMAGE_ANCHOR
    image_token = IMAGE_TOKEN
    untied_head = True
    text_model_type = "glm4v_text"
    tokenizer_fields = {
        "extra_special_tokens": {"image_token": IMAGE_TOKEN, "video_token": VIDEO_TOKEN}
    }
    processor_files = {
        "preprocessor_config.json": parts.image_processor_config(
            "Glm4vImageProcessor",
            "Glm4vProcessor",
            {
                "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
                "resample": 3,  # bicubic
            },
            parts.CLIP_MEAN,
            parts.CLIP_STD,
            {
                "patch_size": PATCH_SIZE,
                "temporal_patch_size": TEMPORAL_PATCH_SIZE,
                "merge_size": MERGE_SIZE,
            },
        ),
        "processor_config.json": {"processor_class": "Glm4vProcessor"},
    }

    def text_fields(self, text_config: Mapping[str, Any]) -> dict[str, Any]:
        """GLM-4's text fields over the text demo's (the MoE family adds its experts')."""
        head_dim = text_config["hidden_size"] // text_config["num_attention_heads"]
        if text_config.get("head_dim", head_dim) != head_dim or head_dim % 8:
            raise ValueError("GLM-4V's text stack needs head_dim = hidden_size / heads, 8k")
        # Half the head rotates; its frequencies split over (t, h, w) as the real [8, 12, 12].
        half = head_dim // 4
        section = [half // 4, (half - half // 4) // 2, (half - half // 4) // 2]
        return {
            "model_type": self.text_model_type,
            "partial_rotary_factor": 0.5,
            "attention_bias": True,
            "rope_scaling": {"rope_type": "default", "mrope_section": section},
            "tie_word_embeddings": False,
        }

    def model_config(
        self, text_config: Mapping[str, Any], ids: Mapping[str, int], vocab_size: int
    ) -> dict:
        text_fields = {**self.text_fields(text_config), "vocab_size": vocab_size}
        text_fields |= {"eos_token_id": ids["<|end|>"], "pad_token_id": ids["<|pad|>"]}
        vision = {**VISION_CONFIG, "model_type": self.model_type}
        vision["out_hidden_size"] = text_config["hidden_size"]
        fields = {
            "image_token_id": ids[IMAGE_TOKEN],
            "video_token_id": ids[VIDEO_TOKEN],
            "image_start_token_id": ids[BEGIN_IMAGE],
            "image_end_token_id": ids[END_IMAGE],
            "video_start_token_id": ids[BEGIN_VIDEO],
            "video_end_token_id": ids[END_VIDEO],
            # mlx-vlm's names for the image start and end (its defaults are GLM's real ids).
            "vision_start_token_id": ids[BEGIN_IMAGE],
            "vision_end_token_id": ids[END_IMAGE],
        }
        config = parts.nested_config(text_config, text_fields, vision, fields, ids, vocab_size)
        return {**config, **special_token_ids(ids), "tie_word_embeddings": False}

    def extra_text_weights(self, text_config: Mapping[str, Any]) -> dict:
        """Zero q/k/v biases and the post-attention and post-MLP norms GLM-4 adds."""
        import numpy as np

        hidden = text_config["hidden_size"]
        out = qkv_biases(text_config)
        for layer in range(text_config["num_hidden_layers"]):
            prefix = f"language_model.model.layers.{layer}"
            attn, mlp = POST_NORM_SCALES[min(layer, len(POST_NORM_SCALES) - 1)]
            out[f"{prefix}.post_self_attn_layernorm.weight"] = np.full(hidden, attn, np.float32)
            out[f"{prefix}.post_mlp_layernorm.weight"] = np.full(hidden, mlp, np.float32)
        return out

    def saved_weights(self, weights: dict) -> dict:
        """The MLP's gate and up projections fused, gate first (GLM-4's gate_up_proj)."""
        import numpy as np

        out = dict(weights)
        for name in [n for n in weights if n.endswith(".mlp.gate_proj.weight")]:
            up = name.replace("gate_proj", "up_proj")
            if not name.startswith("language_model."):
                continue
            fused = np.concatenate([out.pop(name), out.pop(up)])
            out[name.replace("gate_proj", "gate_up_proj")] = fused
        return out

    def vision_weights(self, config: Mapping[str, Any], feature_rms: float, rng) -> dict:
        """Random vision tower weights, shaped as mlx-vlm's GLM-4V VisionModel holds them:
        linear layers N(0, 1/fan_in), RMSNorms at one, so every activation stays near unit
        scale; the merger's last layer is scaled so the image tokens come out with RMS about
        `feature_rms` (the text embeddings')."""
        import numpy as np

        vision = config["vision_config"]
        width, out_width = vision["hidden_size"], vision["out_hidden_size"]
        merge, context = vision["spatial_merge_size"], vision["intermediate_size"]
        tower = "vision_tower"
        frames, patch = vision["temporal_patch_size"], vision["patch_size"]
        fan_in = frames * patch * patch * vision["in_channels"]
        shape = (width, frames, patch, patch, vision["in_channels"])
        out: dict[str, Any] = {
            f"{tower}.patch_embed.proj.weight": rng.standard_normal(shape) / math.sqrt(fan_in),
            f"{tower}.patch_embed.proj.bias": rng.standard_normal(width) * 0.02,
            f"{tower}.embeddings.position_embedding.weight": rng.standard_normal(
                ((vision["image_size"] // patch) ** 2, width)
            )
            * 0.5,
        }
        for norm in ("post_conv_layernorm", "post_layernorm"):
            out[f"{tower}.{norm}.weight"] = np.ones(width)
        for block in range(vision["depth"]):
            prefix = f"{tower}.blocks.{block}"
            out[f"{prefix}.norm1.weight"] = np.ones(width)
            out[f"{prefix}.norm2.weight"] = np.ones(width)
            out |= parts.random_linear(rng, f"{prefix}.attn.qkv", 3 * width, width, bias=False)
            out |= parts.random_linear(rng, f"{prefix}.attn.proj", width, width, 0.5, bias=False)
            mlp = f"{prefix}.mlp"
            for proj in ("gate_proj", "up_proj"):
                out |= parts.random_linear(rng, f"{mlp}.{proj}", out_width, width, bias=False)
            out |= parts.random_linear(rng, f"{mlp}.down_proj", width, out_width, 0.5, bias=False)
        fan_in = merge * merge * width
        out[f"{tower}.downsample.weight"] = rng.standard_normal(
            (out_width, merge, merge, width)
        ) / math.sqrt(fan_in)
        out[f"{tower}.downsample.bias"] = rng.standard_normal(out_width) * 0.02
        merger = f"{tower}.merger"
        out |= parts.random_linear(rng, f"{merger}.proj", out_width, out_width, bias=False)
        out |= parts.unit_layer_norm(f"{merger}.post_projection_norm", out_width)
        for proj in ("gate_proj", "up_proj"):
            out |= parts.random_linear(rng, f"{merger}.{proj}", context, out_width, bias=False)
        # silu(gate) * up of unit-scale inputs has RMS about 0.6.
        gain = feature_rms / 0.6
        out |= parts.random_linear(rng, f"{merger}.down_proj", out_width, context, gain, bias=False)
        return out


FAMILY = Glm4v()
