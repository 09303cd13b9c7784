"""The ``llava_onevision`` family of the demo vision-language model (``servicer.demos.vision``).

LLaVA-OneVision: a SigLIP vision tower, a projector (linear, gelu, linear) and a Qwen2 text
model; each image is tiled "anyres": the whole image at the tower's size, then the image
resized to the best of ``image_grid_pinpoints`` and cut into tiles of that size. Its features:
the whole image's patches, then the tiles' patches as one grid, the padding cropped away, a
learnt ``image_newline`` ending each row. How many image tokens an image becomes depends on
its size: the processor (transformers' LlavaOnevisionProcessor, mlx-vlm's own too) expands
the ``<image>`` anchor to that count. Built from the ``llama`` text demo
(``servicer.demos.text``), nothing trained here:

- the language model is the text demo's trained weights moved into Qwen2's text stack (the
  same sizes, RMSNorm, SwiGLU, tied embeddings and RoPE; the q/k/v biases Qwen2 has and
  llama lacks are zeros), under ``language_model.``: mlx-vlm runs it with its Qwen2 model,
  the worker with mlx-lm's qwen2 built from text_config (mlx-lm has no llava_onevision
  model type: ``servicer.engine.model.text_stack_config``).
- the tokenizer is the text demo's with ``<image>`` and ``<video>`` appended as special
  tokens and embedding rows for them drawn at the trained rows' scale; the chat template
  renders ``<image>`` (``IMAGE_ANCHOR``) per image part.
- the vision tower is a tiny SigLIP (42-pixel tiles of 14-pixel patches: 3x3 tokens a
  tile; pinpoints up to 2x2 tiles, so an image is 9 whole-image tokens and up to 6x6 tile
  tokens plus a newline a row), random from a seeded numpy generator; the projector and
  the newline are scaled so that the image tokens enter the language model at the text
  embeddings' RMS: the image shifts the continuation without drowning the prompt.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import parts
from .vision import Family

IMAGE_TOKEN = "<image>"
VIDEO_TOKEN = "<video>"
IMAGE_ANCHOR = IMAGE_TOKEN  # what the chat template renders for one image, unexpanded

TILE_SIZE = 42  # the tower's input: the whole image resized to it, and each tile
PATCH_SIZE = 14
TOKENS_PER_TILE = (TILE_SIZE // PATCH_SIZE) ** 2  # 9
# The resolutions an image may be tiled at (height, width): 1x1, 1x2, 2x1 or 2x2 tiles.
GRID_PINPOINTS = [[TILE_SIZE * h, TILE_SIZE * w] for h, w in ((1, 1), (1, 2), (2, 1), (2, 2))]
ASPECT_RATIO = "anyres_max_9"  # at most 9 tiles' worth of features before pooling: never here

VISION_CONFIG = parts.tower_config(
    "siglip_vision_model",
    TILE_SIZE,
    PATCH_SIZE,
    heads={},
    rest={"layer_norm_eps": 1e-6, "hidden_act": "gelu_pytorch_tanh", "vision_use_head": False},
)


def qwen2_biases(text_config: Mapping[str, Any]) -> dict:
    """Zero q/k/v biases: Qwen2 has them, llama lacks them."""
    import numpy as np

    heads, kv_heads = text_config["num_attention_heads"], text_config["num_key_value_heads"]
    head_dim = text_config["hidden_size"] // heads
    widths = {"q_proj": heads * head_dim, "k_proj": kv_heads * head_dim}
    widths["v_proj"] = kv_heads * head_dim
    return {
        f"language_model.model.layers.{layer}.self_attn.{proj}.bias": np.zeros(width, np.float32)
        for layer in range(text_config["num_hidden_layers"])
        for proj, width in widths.items()
    }


def siglip_and_projector(config: Mapping[str, Any], feature_rms: float, rng) -> dict:
    """Random SigLIP (no pooling head), projector and image newline weights, shaped as
    mlx-vlm's anyres LLaVA models hold them: linear layers N(0, 1/fan_in) with small biases,
    so every activation stays near unit scale; the projector's last layer is scaled so the
    image tokens come out with RMS about `feature_rms` (the text embeddings'), for gelu of
    unit-scale inputs, and the newline is drawn at that RMS."""
    vision = config["vision_config"]
    width = vision["hidden_size"]
    hidden = config["text_config"]["hidden_size"]
    tower = "vision_tower.vision_model"
    out = parts.siglip_tower(rng, tower, vision)  # pixels in [-1, 1]
    out |= parts.random_linear(rng, "multi_modal_projector.linear_1", hidden, width)
    gain = parts.gelu_gain(feature_rms)
    out |= parts.random_linear(rng, "multi_modal_projector.linear_2", hidden, hidden, gain)
    out["image_newline"] = rng.standard_normal(hidden) * feature_rms
    return out


class LlavaOnevision(Family):
    model_type = "llava_onevision"
    architecture = "LlavaOnevisionForConditionalGeneration"
    text_kind = "llama"
    recipe_version = "v1"
    vision_tokens = (IMAGE_TOKEN, VIDEO_TOKEN)  # appended after the text vocabulary: 512, 513
    image_anchor = IMAGE_ANCHOR
    image_token = IMAGE_TOKEN
    # tokens_per_image: 9 for the whole image, then the tiles' grid unpadded, a newline a row.
    tokenizer_fields = {
        "extra_special_tokens": {"image_token": IMAGE_TOKEN, "video_token": VIDEO_TOKEN}
    }
    processor_files = {
        "preprocessor_config.json": parts.image_processor_config(
            "LlavaOnevisionImageProcessor",
            "LlavaOnevisionProcessor",
            {
                "size": {"height": TILE_SIZE, "width": TILE_SIZE},
                "image_grid_pinpoints": GRID_PINPOINTS,
                "resample": 3,  # bicubic
                "do_pad": True,
            },
            mean=(0.5, 0.5, 0.5),  # SigLIP's: pixels to [-1, 1]
            std=(0.5, 0.5, 0.5),
        ),
        # llava-onevision's own processor_config.json, for the demo's sizes.
        "processor_config.json": {
            "processor_class": "LlavaOnevisionProcessor",
            "image_token": IMAGE_TOKEN,
            "video_token": VIDEO_TOKEN,
            "num_image_tokens": TOKENS_PER_TILE,
            "vision_feature_select_strategy": "full",
            "vision_aspect_ratio": ASPECT_RATIO,
        },
    }

    def model_config(
        self, text_config: Mapping[str, Any], ids: Mapping[str, int], vocab_size: int
    ) -> dict:
        hidden, heads = text_config["hidden_size"], text_config["num_attention_heads"]
        if text_config.get("head_dim", hidden // heads) * heads != hidden:
            raise ValueError("Qwen2's text stack needs head_dim = hidden_size / heads")
        text_fields = {"model_type": "qwen2", "vocab_size": vocab_size, "tie_word_embeddings": True}
        fields = {
            "image_token_index": ids[IMAGE_TOKEN],
            "video_token_index": ids[VIDEO_TOKEN],
            "image_grid_pinpoints": GRID_PINPOINTS,
            "vision_aspect_ratio": ASPECT_RATIO,
            "vision_feature_select_strategy": "full",
            "vision_feature_layer": -1,
            "use_image_newline_parameter": True,
            "projector_hidden_act": "gelu",
        }
        return parts.nested_config(text_config, text_fields, VISION_CONFIG, fields, ids, vocab_size)

    def extra_text_weights(self, text_config: Mapping[str, Any]) -> dict:
        return qwen2_biases(text_config)

    def vision_weights(self, config: Mapping[str, Any], feature_rms: float, rng) -> dict:
        return siglip_and_projector(config, feature_rms, rng)


FAMILY = LlavaOnevision()
