"""The ``kimi_vl`` family of the demo vision-language model (``servicer.demos.vision``).

Kimi-VL: a MoonViT vision tower (patches of a native-resolution image, 2-D RoPE, a learnt
position grid interpolated to the image's), a 2x2 patch merge with a projector (LayerNorm,
linear, GELU, linear) and a DeepSeek-V3 text model (multi-head latent attention). An image
is center-cropped to whole 2x2 blocks of patches (resized first past ``IN_TOKEN_LIMIT``
patches); ``<|media_pad|>`` is repeated once per block. Built from the ``llama`` text demo
(``servicer.demos.text``), nothing trained here:

- the tokenizer and token embeddings are the text demo's trained ones, with Kimi-VL's media
  tokens appended as special tokens and embedding rows for them drawn at the trained rows'
  scale (the output head a copy of them); the chat template renders
  ``<|media_start|>image<|media_content|><|media_pad|><|media_end|>`` (``IMAGE_ANCHOR``,
  Kimi-VL's own) per image part.
- the text layers are random (DeepSeek-V3's differ from llama's): two dense layers of
  latent attention at the text demo's sizes, linear layers N(0, 1/fan_in), each layer's
  output scaled to 12x the embeddings' RMS (less, and it echoes the last token).
- the vision tower is a tiny MoonViT (14-pixel patches, 2x2 merged: a token a 28-pixel
  block), random from a seeded numpy generator; the projector is scaled so that the image
  tokens enter the language model at the text embeddings' RMS. The demo also records
  ``in_token_limit`` and ``patch_size`` in its vision_config, which mlx-vlm's processor reads
  none of.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import parts
from .vision import Family

MEDIA_START, MEDIA_CONTENT, MEDIA_END = "<|media_start|>", "<|media_content|>", "<|media_end|>"
MEDIA_PAD = "<|media_pad|>"
IMAGE_ANCHOR = f"{MEDIA_START}image{MEDIA_CONTENT}{MEDIA_PAD}{MEDIA_END}"

PATCH_SIZE = 14  # mlx-vlm's processor cuts 14-pixel patches whatever the config says
MERGE = 2  # 2x2 patches one image token
IN_TOKEN_LIMIT = 4096  # patches: a larger image is resized down (mlx-vlm's fixed limit)
POSITION_GRID = 8  # the learnt position embeddings' grid, interpolated to each image's
LAYER_GAIN = 12.0  # each random text layer adds this times the embeddings' RMS

VISION_CONFIG = {
    "model_type": "moonvit",
    "depth": 2,
    "embed_dim": 64,
    "hidden_size": 64,
    "num_heads": 2,
    "intermediate_size": 128,
    "patch_size": PATCH_SIZE,
    "num_channels": 3,
    "init_pos_emb_height": POSITION_GRID,
    "init_pos_emb_width": POSITION_GRID,
    "merge_kernel_size": [MERGE, MERGE],
    "in_token_limit": IN_TOKEN_LIMIT,
    "layer_norm_eps": 1e-6,
}
# Multi-head latent attention at the text demo's sizes (no query compression).
LATENT = {"kv_lora_rank": 64, "qk_rope_head_dim": 32, "qk_nope_head_dim": 32, "v_head_dim": 32}


def latent_attention_layers(text: Mapping[str, Any], feature_rms: float, rng) -> dict:
    """Random dense DeepSeek-V3 layers under mlx-vlm's names less ``language_model.model.``:
    linear layers N(0, 1/fan_in), each layer's output layer scaled to `feature_rms`, norms
    at one."""
    import numpy as np

    hidden, ff, heads = text["hidden_size"], text["intermediate_size"], text["num_attention_heads"]
    rank, rope = text["kv_lora_rank"], text["qk_rope_head_dim"]
    nope, value = text["qk_nope_head_dim"], text["v_head_dim"]
    out: dict[str, Any] = {"norm.weight": np.ones(hidden)}
    for layer in range(text["num_hidden_layers"]):
        prefix = f"layers.{layer}"
        attention = f"{prefix}.self_attn"
        out |= parts.random_linear(
            rng, f"{attention}.q_proj", heads * (nope + rope), hidden, bias=False
        )
        out |= parts.random_linear(
            rng, f"{attention}.kv_a_proj_with_mqa", rank + rope, hidden, bias=False
        )
        out[f"{attention}.kv_a_layernorm.weight"] = np.ones(rank)
        out |= parts.random_linear(
            rng, f"{attention}.kv_b_proj", heads * (nope + value), rank, bias=False
        )
        out |= parts.random_linear(
            rng, f"{attention}.o_proj", hidden, heads * value, feature_rms, bias=False
        )
        out |= parts.random_linear(rng, f"{prefix}.mlp.gate_proj", ff, hidden, bias=False)
        out |= parts.random_linear(rng, f"{prefix}.mlp.up_proj", ff, hidden, bias=False)
        out |= parts.random_linear(
            rng, f"{prefix}.mlp.down_proj", hidden, ff, feature_rms, bias=False
        )
        out[f"{prefix}.input_layernorm.weight"] = np.ones(hidden)
        out[f"{prefix}.post_attention_layernorm.weight"] = np.ones(hidden)
    return out


class KimiVL(Family):
    model_type = "kimi_vl"
    architecture = "KimiVLForConditionalGeneration"
    text_kind = "llama"
    recipe_version = "v1"
    # Appended after the text vocabulary: 512 to 515.
    vision_tokens = (MEDIA_START, MEDIA_CONTENT, MEDIA_END, MEDIA_PAD)
    image_anchor = IMAGE_ANCHOR
    image_token = MEDIA_PAD
    processor_files: Mapping[str, Mapping[str, Any]] = {}
    untied_head = True  # DeepSeek-V3's output head is its own

    def model_config(
        self, text_config: Mapping[str, Any], ids: Mapping[str, int], vocab_size: int
    ) -> dict:
        heads = text_config["num_attention_heads"]
        text_fields = {
            "model_type": "deepseek_v3",
            "vocab_size": vocab_size,
            "tie_word_embeddings": False,
            "num_key_value_heads": heads,
            "q_lora_rank": None,
            **LATENT,
            "first_k_dense_replace": text_config["num_hidden_layers"],  # every layer dense
            "moe_intermediate_size": text_config["intermediate_size"],
            "n_routed_experts": 1,
            "n_shared_experts": 1,
            "num_experts_per_tok": 1,
            "n_group": 1,
            "topk_group": 1,
        }
        fields = {
            "media_placeholder_token_id": ids[MEDIA_PAD],
            "image_token_index": ids[MEDIA_PAD],
            "scale_factor": MERGE,
        }
        config = parts.nested_config(
            text_config, text_fields, VISION_CONFIG, fields, ids, vocab_size
        )
        return config | {"tie_word_embeddings": False}

    def vision_weights(self, config: Mapping[str, Any], feature_rms: float, rng) -> dict:
        """MoonViT and the projector, and (under ``deepseek.``) the random text layers,
        which replace the text demo's llama layers in `saved_weights`."""
        vision = config["vision_config"]
        width, mlp = vision["hidden_size"], vision["intermediate_size"]
        hidden = config["text_config"]["hidden_size"]
        tower = "vision_tower"
        out = parts.patch_conv(rng, f"{tower}.patch_embed.proj.weight", vision)
        out[f"{tower}.patch_embed.proj.bias"] = rng.standard_normal(width) * 0.02
        grid = (vision["init_pos_emb_height"], vision["init_pos_emb_width"], width)
        out[f"{tower}.patch_embed.pos_emb.weight"] = rng.standard_normal(grid) * 0.5
        for block in range(vision["depth"]):
            prefix = f"{tower}.blocks.{block}"
            out |= parts.unit_layer_norm(f"{prefix}.norm0", width)
            out |= parts.unit_layer_norm(f"{prefix}.norm1", width)
            out |= parts.random_linear(rng, f"{prefix}.attn.wqkv", 3 * width, width)
            out |= parts.random_linear(rng, f"{prefix}.attn.wo", width, width, gain=0.5)
            out |= parts.random_linear(rng, f"{prefix}.mlp.fc0", mlp, width)
            out |= parts.random_linear(rng, f"{prefix}.mlp.fc1", width, mlp, gain=0.5)
        out |= parts.unit_layer_norm(f"{tower}.final_layernorm", width)
        merged = width * MERGE * MERGE
        out |= parts.unit_layer_norm("multi_modal_projector.pre_norm", width)
        out |= parts.random_linear(rng, "multi_modal_projector.linear_1", merged, merged)
        gain = parts.gelu_gain(feature_rms)
        out |= parts.random_linear(rng, "multi_modal_projector.linear_2", hidden, merged, gain)
        text = latent_attention_layers(config["text_config"], feature_rms * LAYER_GAIN, rng)
        return out | {f"deepseek.{name}": value for name, value in text.items()}

    def saved_weights(self, weights: dict) -> dict:
        llama = ("language_model.model.layers.", "language_model.model.norm.")
        out = {k: v for k, v in weights.items() if not k.startswith((*llama, "deepseek."))}
        deep = {
            k.removeprefix("deepseek."): v for k, v in weights.items() if k.startswith("deepseek.")
        }
        return out | {f"language_model.model.{name}": value for name, value in deep.items()}


FAMILY = KimiVL()
