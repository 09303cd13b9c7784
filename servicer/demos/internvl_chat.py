"""The ``internvl_chat`` family of the demo vision-language model (``servicer.demos.vision``).

InternVL 2.5 / 3 / 3.5 as mlx-vlm loads them (``InternVLChatModel``, the format
mlx-community converts): an InternViT vision tower (a class token, LayerScale), a pixel
shuffle of 2x2 patches into one, an MLP projector (LayerNorm, linear, GELU, linear) and a
Qwen2 text model. An image is tiled dynamically: cut into the grid of at most
``MAX_TILES`` tiles nearest its aspect ratio, plus the whole image as one tile where there
are several; each tile becomes ``TOKENS_PER_TILE`` image tokens. The processor
(``servicer.numpy_processors``, mlx-vlm's step for step) expands the ``<image>`` anchor into
``<img>``, ``<IMG_CONTEXT>`` per image token, ``</img>``. Built from the ``llama`` text demo
(``servicer.demos.text``), nothing trained here:

- the language model is the text demo's trained weights moved into Qwen2's text stack (the
  same sizes, RMSNorm, SwiGLU, tied embeddings and RoPE; the q/k/v biases Qwen2 has and
  llama lacks are zeros), under ``language_model.``: mlx-vlm runs it with its InternVL text
  model, the worker with mlx-lm's qwen2 built from text_config (mlx-lm has no internvl_chat
  model type: ``servicer.engine.model.text_stack_config``).
- the tokenizer is the text demo's with ``<image>``, ``<img>``, ``</img>`` and
  ``<IMG_CONTEXT>`` appended as special tokens and embedding rows for them drawn at the
  trained rows' scale; the chat template renders ``<image>`` (``IMAGE_ANCHOR``) per image.
- the vision tower is a tiny InternViT (56-pixel tiles of 14-pixel patches: 4x4 patches,
  shuffled into 4 image tokens a tile), random from a seeded numpy generator; the projector
  is scaled so that the image tokens enter the language model at the text embeddings' RMS:
  the image shifts the continuation without drowning the prompt.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import parts
from .llava_onevision import qwen2_biases
from .vision import Family

IMAGE_ANCHOR = "<image>"  # what the chat template renders for one image, unexpanded
START, END, CONTEXT = "<img>", "</img>", "<IMG_CONTEXT>"

TILE_SIZE = 56
PATCH_SIZE = 14
DOWNSAMPLE = 0.5  # the pixel shuffle: 2x2 patches one image token
TOKENS_PER_TILE = int((TILE_SIZE // PATCH_SIZE) ** 2 * DOWNSAMPLE**2)  # 4
MAX_TILES = 4  # grids of 1 to 4 tiles (and the thumbnail)

VISION_CONFIG = parts.tower_config(
    "intern_vit_6b",
    TILE_SIZE,
    PATCH_SIZE,
    heads={},
    rest={
        "layer_norm_eps": 1e-6,
        "qkv_bias": True,
        "qk_normalization": False,
        "norm_type": "layer_norm",
        "drop_path_rate": 0.0,
    },
)


def intern_vit_and_projector(config: Mapping[str, Any], feature_rms: float, rng) -> dict:
    """Random InternViT and projector weights under mlx-vlm's names: linear layers
    N(0, 1/fan_in) with small biases, LayerScale at one, so every activation stays near unit
    scale; the projector's last layer is scaled so the image tokens come out with RMS about
    `feature_rms` (the text embeddings'), for gelu of unit-scale inputs."""
    import numpy as np

    vision = config["vision_config"]
    width, mlp = vision["hidden_size"], vision["intermediate_size"]
    patches = (vision["image_size"] // vision["patch_size"]) ** 2
    hidden = config["text_config"]["hidden_size"]
    tower = "vision_model"
    out = parts.patch_conv(rng, f"{tower}.embeddings.patch_embedding.weight", vision)
    out[f"{tower}.embeddings.patch_embedding.bias"] = rng.standard_normal(width) * 0.02
    out[f"{tower}.embeddings.class_embedding"] = rng.standard_normal((1, 1, width)) * 0.5
    out[f"{tower}.embeddings.position_embedding"] = (
        rng.standard_normal((1, patches + 1, width)) * 0.5
    )
    for layer in range(vision["num_hidden_layers"]):
        prefix = f"{tower}.encoder.layers.{layer}"
        out |= parts.unit_layer_norm(f"{prefix}.norm1", width)
        out |= parts.unit_layer_norm(f"{prefix}.norm2", width)
        out |= parts.random_linear(rng, f"{prefix}.attn.qkv", 3 * width, width)
        out |= parts.random_linear(rng, f"{prefix}.attn.proj", width, width, gain=0.5)
        out |= parts.random_linear(rng, f"{prefix}.mlp.fc1", mlp, width)
        out |= parts.random_linear(rng, f"{prefix}.mlp.fc2", width, mlp, gain=0.5)
        out[f"{prefix}.ls1"] = np.ones(width)
        out[f"{prefix}.ls2"] = np.ones(width)
    shuffled = width * int(1 / config["downsample_ratio"]) ** 2
    out |= parts.unit_layer_norm("mlp1.0", shuffled)
    out |= parts.random_linear(rng, "mlp1.1", hidden, shuffled)
    out |= parts.random_linear(rng, "mlp1.3", hidden, hidden, parts.gelu_gain(feature_rms))
    return out


class InternVLChat(Family):
    model_type = "internvl_chat"
    architecture = "InternVLChatModel"
    text_kind = "llama"
    recipe_version = "v1"
    # Appended after the text vocabulary: 512 to 515.
    vision_tokens = (IMAGE_ANCHOR, START, END, CONTEXT)
    image_anchor = IMAGE_ANCHOR
    image_token = CONTEXT
    processor_files: Mapping[str, Mapping[str, Any]] = {}

    def model_config(
        self, text_config: Mapping[str, Any], ids: Mapping[str, int], vocab_size: int
    ) -> dict:
        hidden, heads = text_config["hidden_size"], text_config["num_attention_heads"]
        if text_config.get("head_dim", hidden // heads) * heads != hidden:
            raise ValueError("Qwen2's text stack needs head_dim = hidden_size / heads")
        text_fields = {"model_type": "qwen2", "vocab_size": vocab_size, "tie_word_embeddings": True}
        text_fields["attention_bias"] = True  # Qwen2's q/k/v biases (mlx-vlm: else q/k norms)
        fields = {
            "image_token_index": ids[CONTEXT],
            "downsample_ratio": DOWNSAMPLE,
            "force_image_size": TILE_SIZE,
            "min_dynamic_patch": 1,
            "max_dynamic_patch": MAX_TILES,
            "use_thumbnail": True,
            "select_layer": -1,
            "template": "internvl2_5",
        }
        return parts.nested_config(text_config, text_fields, VISION_CONFIG, fields, ids, vocab_size)

    def extra_text_weights(self, text_config: Mapping[str, Any]) -> dict:
        return qwen2_biases(text_config)

    def vision_weights(self, config: Mapping[str, Any], feature_rms: float, rng) -> dict:
        return intern_vit_and_projector(config, feature_rms, rng)


FAMILY = InternVLChat()
