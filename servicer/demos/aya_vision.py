"""The ``aya_vision`` family of the demo vision-language model (``servicer.demos.vision``).

Aya Vision (Cohere): a SigLIP vision tower, a pixel shuffle of 2x2 patches into one, a SwiGLU
projector (LayerNorm, linear, SiLU gate, linear) and a Cohere2 text model (parallel attention
and MLP under one LayerNorm, sliding-window layers with RoPE, global layers without, a scaled
tied output head). An image is cut into a grid of up to ``MAX_TILES`` tiles nearest its aspect
ratio plus, where there are several, the whole image as one more (transformers' GotOcr2 image
processor); the processor (transformers' AyaVisionProcessor, which mlx-vlm runs too) expands
``<image>`` into ``<|START_OF_IMG|>``, per tile ``TILE_i`` and its image tokens, the whole
image's ``TILE_GLOBAL`` and image tokens, ``<|END_OF_IMG|>``. Built from the ``llama`` text
demo (``servicer.demos.text``), nothing trained here:

- the tokenizer and token embeddings are the text demo's trained ones, with Aya Vision's image
  tokens appended as special tokens and embedding rows for them drawn at the trained rows'
  scale; the chat template renders ``<image>`` (``IMAGE_ANCHOR``) per image part.
- the text layers are random (Cohere2's differ from llama's): a sliding-window layer (window
  ``WINDOW``), then a global one, at the text demo's sizes, linear layers N(0, 1/fan_in), each
  layer's output scaled to ``LAYER_GAIN`` times the embeddings' RMS; mlx-vlm runs them with
  its Aya Vision text model, the worker with mlx-lm's cohere2 built from text_config (mlx-lm
  has no aya_vision model type).
- the vision tower is a tiny SigLIP (56-pixel tiles of 14-pixel patches, shuffled into 4 image
  tokens a tile), random from a seeded numpy generator; the projector is scaled so that the
  image tokens enter the language model at the text embeddings' RMS.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import parts
from .vision import Family

IMAGE_ANCHOR = "<image>"  # what the chat template renders for one image, unexpanded
START, END = "<|START_OF_IMG|>", "<|END_OF_IMG|>"
PATCH, LINE_BREAK = "<|IMG_PATCH|>", "<|IMG_LINE_BREAK|>"

TILE_SIZE = 56
PATCH_SIZE = 14
DOWNSAMPLE = 2  # the pixel shuffle: 2x2 patches one image token
TOKENS_PER_TILE = (TILE_SIZE // (PATCH_SIZE * DOWNSAMPLE)) ** 2  # 4
MAX_TILES = 4
WINDOW = 16  # the sliding-window layer's: shorter than every test prompt
LAYER_GAIN = 12.0  # each random text layer adds this times the embeddings' RMS

VISION_CONFIG = parts.tower_config(
    "siglip_vision_model",
    TILE_SIZE,
    PATCH_SIZE,
    heads={},
    rest={"layer_norm_eps": 1e-6, "hidden_act": "gelu_pytorch_tanh", "vision_use_head": False},
)


def cohere2_layers(text: Mapping[str, Any], feature_rms: float, rng) -> dict:
    """Random Cohere2 layers under mlx-vlm's and mlx-lm's names less ``language_model.model.``:
    linear layers N(0, 1/fan_in), each layer's two output layers scaled to `feature_rms`,
    norms at one."""
    import numpy as np

    hidden, ff, heads = text["hidden_size"], text["intermediate_size"], text["num_attention_heads"]
    head_dim, kv_heads = text["head_dim"], text["num_key_value_heads"]
    out: dict[str, Any] = {"norm.weight": np.ones(hidden)}
    for layer in range(text["num_hidden_layers"]):
        prefix = f"layers.{layer}"
        attention = f"{prefix}.self_attn"
        widths = {"q_proj": heads * head_dim, "k_proj": kv_heads * head_dim}
        widths["v_proj"] = kv_heads * head_dim
        for proj, width in widths.items():
            out |= parts.random_linear(rng, f"{attention}.{proj}", width, hidden, bias=False)
        out |= parts.random_linear(
            rng, f"{attention}.o_proj", hidden, heads * head_dim, feature_rms, bias=False
        )
        out |= parts.random_linear(rng, f"{prefix}.mlp.gate_proj", ff, hidden, bias=False)
        out |= parts.random_linear(rng, f"{prefix}.mlp.up_proj", ff, hidden, bias=False)
        out |= parts.random_linear(
            rng, f"{prefix}.mlp.down_proj", hidden, ff, feature_rms, bias=False
        )
        out[f"{prefix}.input_layernorm.weight"] = np.ones(hidden)
    return out


class AyaVision(Family):
    model_type = "aya_vision"
    architecture = "AyaVisionForConditionalGeneration"
    text_kind = "llama"
    recipe_version = "v1"
    # Appended after the text vocabulary: 512 to 516.
    vision_tokens = (IMAGE_ANCHOR, START, END, PATCH, LINE_BREAK)
    image_anchor = IMAGE_ANCHOR
    image_token = PATCH
    tokenizer_fields = {"extra_special_tokens": {"image_token": IMAGE_ANCHOR}}
    processor_files = {
        "preprocessor_config.json": parts.image_processor_config(
            "GotOcr2ImageProcessor",
            "AyaVisionProcessor",
            {"size": {"height": TILE_SIZE, "width": TILE_SIZE}, "resample": 3},  # bicubic
            mean=(0.5, 0.5, 0.5),
            std=(0.5, 0.5, 0.5),
            more={"crop_to_patches": True, "min_patches": 1, "max_patches": MAX_TILES},
        ),
        "processor_config.json": {
            "processor_class": "AyaVisionProcessor",
            "image_token": IMAGE_ANCHOR,
            "patch_size": PATCH_SIZE,
            "img_size": TILE_SIZE,
            "downsample_factor": DOWNSAMPLE,
            "start_of_img_token": START,
            "end_of_img_token": END,
            "img_patch_token": PATCH,
            "img_line_break_token": LINE_BREAK,
            "tile_token": "TILE",
            "tile_global_token": "TILE_GLOBAL",
        },
    }

    def model_config(
        self, text_config: Mapping[str, Any], ids: Mapping[str, int], vocab_size: int
    ) -> dict:
        hidden, heads = text_config["hidden_size"], text_config["num_attention_heads"]
        text_fields = {
            "model_type": "cohere2",
            "vocab_size": vocab_size,
            "tie_word_embeddings": True,
            "head_dim": text_config.get("head_dim", hidden // heads),
            "layer_norm_eps": 1e-5,
            "logit_scale": 0.0625,
            "attention_bias": False,
            "layer_norm_bias": False,
            "sliding_window": WINDOW,
            "sliding_window_pattern": 2,  # a sliding-window layer, then a global one
        }
        fields = {
            "image_token_index": ids[PATCH],
            "downsample_factor": DOWNSAMPLE,
            "alignment_intermediate_size": 2 * hidden,
            "adapter_layer_norm_eps": 1e-6,
            "max_splits_per_img": MAX_TILES,
            "vision_feature_layer": -1,
            "vision_feature_select_strategy": "full",
        }
        return parts.nested_config(text_config, text_fields, VISION_CONFIG, fields, ids, vocab_size)

    def vision_weights(self, config: Mapping[str, Any], feature_rms: float, rng) -> dict:
        """SigLIP and the projector, and (under ``cohere2.``) the random text layers, which
        replace the text demo's llama layers in `saved_weights`."""
        vision = config["vision_config"]
        width = vision["hidden_size"]
        hidden = config["text_config"]["hidden_size"]
        tower = "vision_tower.vision_model"
        out = parts.siglip_tower(rng, tower, vision)  # pixels in [-1, 1]
        shuffled = width * DOWNSAMPLE**2
        inner = config["alignment_intermediate_size"]
        projector = "multi_modal_projector"
        out |= parts.unit_layer_norm(f"{projector}.layernorm", shuffled)
        out |= parts.random_linear(rng, f"{projector}.linear_1", inner, shuffled)
        # silu(gate) * x of unit-scale halves has RMS about 0.6: scaled up to the text's.
        out |= parts.random_linear(
            rng, f"{projector}.linear_2", hidden, inner // 2, feature_rms / 0.6
        )
        text = cohere2_layers(config["text_config"], feature_rms * LAYER_GAIN, rng)
        return out | {f"cohere2.{name}": value for name, value in text.items()}

    def saved_weights(self, weights: dict) -> dict:
        llama = ("language_model.model.layers.", "language_model.model.norm.")
        out = {k: v for k, v in weights.items() if not k.startswith((*llama, "cohere2."))}
        own = {k.removeprefix("cohere2."): v for k, v in weights.items() if "cohere2." in k}
        return out | {f"language_model.model.{name}": value for name, value in own.items()}


FAMILY = AyaVision()
