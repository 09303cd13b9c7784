"""The parts the vision-language demo families (``servicer.demos.vision``) build from:
config.json and preprocessor_config.json fragments, and random weights that keep a tower's
activations at unit scale."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

from .common import special_token_ids

# CLIP's image normalisation (Qwen2-VL, LLaVA and Pixtral use it).
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# E[gelu(z)^2] for z ~ N(0, 1): sizes a projector's last layer after a GELU (`gelu_gain`).
_GELU_SECOND_MOMENT = 0.4252
# The text demo's config fields that are not the text model's.
_NOT_TEXT_FIELDS = ("architectures", "demo_build", "torch_dtype")


def tower_config(
    model_type: str,
    image_size: int,
    patch_size: int,
    heads: Mapping[str, Any],
    rest: Mapping[str, Any],
) -> dict[str, Any]:
    """vision_config of a ViT tower at the size every such demo tower has (width 64, MLP
    128, 2 layers of 2 heads, RGB input): its own attention fields after the heads', the
    rest at the end."""
    return {
        "model_type": model_type,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        **heads,
        "num_channels": 3,
        "image_size": image_size,
        "patch_size": patch_size,
        **rest,
    }


def nested_config(
    text_config: Mapping[str, Any],
    text_fields: Mapping[str, Any],
    vision_config: Mapping[str, Any],
    fields: Mapping[str, Any],
    ids: Mapping[str, int],
    vocab_size: int,
) -> dict:
    """config.json (less what the build adds) of a family whose text model's config nests
    under text_config: the text demo's, with `text_fields` over it, then the vision tower's,
    the family's own `fields`, and the vocabulary and special tokens both loaders read."""
    text_part = {k: v for k, v in text_config.items() if k not in _NOT_TEXT_FIELDS}
    return {
        "text_config": {**text_part, **text_fields},
        "vision_config": dict(vision_config),
        **fields,
        "vocab_size": vocab_size,
        **special_token_ids(ids),
        "tie_word_embeddings": True,
    }


def image_processor_config(
    image_processor: str,
    processor: str,
    resize: Mapping[str, Any],
    mean: Sequence[float],
    std: Sequence[float],
    more: Mapping[str, Any] = MappingProxyType({}),
) -> dict[str, Any]:
    """preprocessor_config.json of a family that resizes with `resize`'s fields, then
    rescales to [0, 1] and normalises with `mean` and `std`; `more` comes last."""
    return {
        "image_processor_type": image_processor,
        "processor_class": processor,
        "do_resize": True,
        **resize,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": list(mean),
        "image_std": list(std),
        "do_convert_rgb": True,
        **more,
    }


def random_linear(rng, prefix: str, fan_out: int, fan_in: int, gain: float = 1.0, bias=True):
    """A linear layer's weights: N(0, gain^2/fan_in), so activations keep their scale, and
    small biases."""
    weights = {
        f"{prefix}.weight": rng.standard_normal((fan_out, fan_in)) * (gain / math.sqrt(fan_in))
    }
    if bias:
        weights[f"{prefix}.bias"] = rng.standard_normal(fan_out) * 0.02
    return weights


def unit_layer_norm(prefix: str, size: int) -> dict:
    """A LayerNorm's weights at their initial values: scale one, shift zero."""
    import numpy as np

    return {f"{prefix}.weight": np.ones(size), f"{prefix}.bias": np.zeros(size)}


def gelu_gain(feature_rms: float) -> float:
    """The gain of a linear layer after a GELU of unit-scale inputs whose outputs should have
    RMS `feature_rms`."""
    return feature_rms / math.sqrt(_GELU_SECOND_MOMENT)


def patch_conv(rng, name: str, vision: Mapping[str, Any]) -> dict:
    """A ViT's patch embedding weight (a Conv2d) in MLX's layout: (out, height, width, in),
    fan-in scaled for normalised pixels."""
    width, patch, channels = vision["hidden_size"], vision["patch_size"], vision["num_channels"]
    fan_in = patch * patch * channels
    return {name: rng.standard_normal((width, patch, patch, channels)) / math.sqrt(fan_in)}


def siglip_tower(rng, tower: str, vision: Mapping[str, Any]) -> dict:
    """A SigLIP tower's weights under `tower` (its patch embedding with a bias, a position
    embedding per patch, the encoder layers and the post-layernorm), for pixels normalised
    to [-1, 1]; random, the activations kept near unit scale."""
    width = vision["hidden_size"]
    patches = (vision["image_size"] // vision["patch_size"]) ** 2
    out = patch_conv(rng, f"{tower}.embeddings.patch_embedding.weight", vision)
    out[f"{tower}.embeddings.patch_embedding.bias"] = rng.standard_normal(width) * 0.02
    out[f"{tower}.embeddings.position_embedding.weight"] = (
        rng.standard_normal((patches, width)) * 0.5
    )
    out |= clip_encoder(rng, tower, vision)
    out |= unit_layer_norm(f"{tower}.post_layernorm", width)
    return out


def clip_encoder(rng, tower: str, vision: Mapping[str, Any]) -> dict:
    """The encoder layers of a CLIP or SigLIP tower (`vision` its config): LayerNorms at
    their initial values, attention and MLP layers that keep activations at unit scale."""
    width, mlp = vision["hidden_size"], vision["intermediate_size"]
    out: dict[str, Any] = {}
    for layer in range(vision["num_hidden_layers"]):
        prefix = f"{tower}.encoder.layers.{layer}"
        out |= unit_layer_norm(f"{prefix}.layer_norm1", width)
        out |= unit_layer_norm(f"{prefix}.layer_norm2", width)
        for proj in ("q_proj", "k_proj", "v_proj"):
            out |= random_linear(rng, f"{prefix}.self_attn.{proj}", width, width)
        out |= random_linear(rng, f"{prefix}.self_attn.out_proj", width, width, gain=0.5)
        out |= random_linear(rng, f"{prefix}.mlp.fc1", mlp, width)
        out |= random_linear(rng, f"{prefix}.mlp.fc2", width, mlp, gain=0.5)
    return out
