"""The ``qwen3_vl`` family of the demo vision-language model (``servicer.demos.vision``).

Qwen3-VL: Qwen2-VL's vision tokens and prompt (``<|vision_start|><|image_pad|><|vision_end|>``
per image, the pad repeated once per merged patch), a Qwen3 text stack (query/key RMSNorms)
with multimodal RoPE in the interleaved layout (``rope_scaling.mrope_interleaved``), and a
vision tower with learned position embeddings, 16-pixel patches and deepstack: the features
of some of its blocks (``deepstack_visual_indexes``) go through mergers of their own and are
added to the hidden states after the text model's first layers, at the image positions.
Built from the ``llama`` text demo, nothing trained here:

- the language model is the text demo's trained weights in Qwen3's stack (its query/key
  norms at one, which the llama demo lacks), so greedy text is varied but not the text
  demo's own; tied embeddings, as the small Qwen3-VL checkpoints have;
- the tokenizer is the text demo's with Qwen2-VL's vision tokens appended as special tokens
  and embedding rows for them drawn at the trained rows' scale;
- the vision tower (2 blocks of width 64, a 16x16 position table, 2x2 merge, deepstack after
  both blocks, so both text layers take deepstack features) is random from a seeded numpy
  generator, its mergers scaled so that their tokens have the text embeddings' RMS.

The image processor is Qwen2-VL's (transformers' Qwen2VLImageProcessor, mlx-vlm's numpy port
of it) with Qwen3-VL's 16-pixel patches and 0.5 normalisation. The smg router knows this
family by ``model_type``; where the worker advertises an ``mm_processor`` it leaves the
images to the worker (media references, one anchor each in the prompt). Its chat template
renders a video part as ``<|vision_start|><|video_pad|><|vision_end|>``; the video processor
config is the image one's (no fps or frame counts: Qwen3-VL's defaults, 2 fps, 4 to 768).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import parts, qwen2_vl
from .common import special_token_ids
from .vision import Family

VIDEO_ANCHOR = qwen2_vl.VISION_START + qwen2_vl.VIDEO_PAD + qwen2_vl.VISION_END
PATCH_SIZE = 16
MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2
TOKEN_PIXELS = PATCH_SIZE * MERGE_SIZE  # 32: the side of one image token
MIN_PIXELS = TOKEN_PIXELS**2 * 4  # 64 x 64
MAX_PIXELS = TOKEN_PIXELS**2 * 64  # 256 x 256
MEAN = STD = (0.5, 0.5, 0.5)
# The deepstack mergers' output over the embeddings' RMS: the text layers' hidden states are
# far larger than the embeddings, and features at the embeddings' scale would not shift them.
DEEPSTACK_GAIN = 64

VISION_CONFIG: Mapping[str, Any] = {
    "model_type": "qwen3_vl",
    "depth": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_heads": 2,
    "in_channels": 3,
    "patch_size": PATCH_SIZE,
    "spatial_merge_size": MERGE_SIZE,
    "temporal_patch_size": TEMPORAL_PATCH_SIZE,
    "num_position_embeddings": 256,  # a 16 x 16 table, interpolated to each image's grid
    "deepstack_visual_indexes": [0, 1],
    "hidden_act": "gelu_pytorch_tanh",
    "initializer_range": 0.02,
}


def image_processor_config(processor: str) -> dict[str, Any]:
    return parts.image_processor_config(
        "Qwen2VLImageProcessor",
        processor,
        {
            "min_pixels": MIN_PIXELS,
            "max_pixels": MAX_PIXELS,
            "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
        },
        MEAN,
        STD,
        {
            "patch_size": PATCH_SIZE,
            "merge_size": MERGE_SIZE,
            "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        },
    )


def processor_files(processor: str, video_processor: str) -> dict[str, dict[str, Any]]:
    """The image, video and whole processor's configs under `processor`'s class name."""
    image = image_processor_config(processor)
    video = {k: v for k, v in image.items() if k != "image_processor_type"}
    return {
        "preprocessor_config.json": image,
        "processor_config.json": {"processor_class": processor},
        "video_preprocessor_config.json": {**video, "video_processor_type": video_processor},
    }


def mrope_section(head_dim: int) -> list[int]:
    """Qwen3-VL's [24, 20, 20] of a 128-wide head, for `head_dim`: t takes what h and w
    (5/16 of the frequencies each) leave."""
    half = head_dim // 2
    hw = half * 5 // 16
    return [half - 2 * hw, hw, hw]


def qk_norms(text_config: Mapping[str, Any], layers: list[int] | None = None) -> dict:
    """Query and key RMSNorms at one (Qwen3's; the llama demo lacks them), for `layers`
    (default: all)."""
    import numpy as np

    head_dim = text_config["head_dim"]
    chosen = range(text_config["num_hidden_layers"]) if layers is None else layers
    return {
        f"language_model.model.layers.{layer}.self_attn.{norm}.weight": np.ones(head_dim)
        for layer in chosen
        for norm in ("q_norm", "k_norm")
    }


def vision_tower_weights(
    config: Mapping[str, Any], feature_rms: float, rng, feature_gain: float = 1.0
) -> dict:
    """Random weights of mlx-vlm's Qwen3-VL (and Qwen3.5) VisionModel: unit-scale blocks, its
    merger scaled to `feature_rms` (times `feature_gain`) after its GELU, the deepstack
    mergers DEEPSTACK_GAIN times `feature_rms`."""
    vision = config["vision_config"]
    width, mlp = vision["hidden_size"], vision["intermediate_size"]
    hidden = vision["out_hidden_size"]
    merged = width * vision["spatial_merge_size"] ** 2
    out: dict[str, Any] = qwen2_vl.patch_embedding(rng, vision, width)
    out["vision_tower.patch_embed.proj.bias"] = rng.standard_normal(width) * 0.02
    positions = vision["num_position_embeddings"]
    out["vision_tower.pos_embed.weight"] = rng.standard_normal((positions, width)) * 0.5
    for block in range(vision["depth"]):
        prefix = f"vision_tower.blocks.{block}"
        out |= parts.unit_layer_norm(f"{prefix}.norm1", width)
        out |= parts.unit_layer_norm(f"{prefix}.norm2", width)
        out |= parts.random_linear(rng, f"{prefix}.attn.qkv", 3 * width, width)
        out |= parts.random_linear(rng, f"{prefix}.attn.proj", width, width, gain=0.5)
        out |= parts.random_linear(rng, f"{prefix}.mlp.linear_fc1", mlp, width)
        out |= parts.random_linear(rng, f"{prefix}.mlp.linear_fc2", width, mlp, gain=0.5)
    gain = parts.gelu_gain(feature_rms)
    mergers = [("vision_tower.merger", width, gain * feature_gain)]
    mergers += [
        (f"vision_tower.deepstack_merger_list.{i}", merged, gain * DEEPSTACK_GAIN)
        for i in range(len(vision.get("deepstack_visual_indexes") or ()))
    ]
    for prefix, norm, out_gain in mergers:
        out |= parts.unit_layer_norm(f"{prefix}.norm", norm)
        out |= parts.random_linear(rng, f"{prefix}.linear_fc1", merged, merged)
        out |= parts.random_linear(rng, f"{prefix}.linear_fc2", hidden, merged, gain=out_gain)
    return out


class Qwen3VL(Family):
    model_type = "qwen3_vl"
    architecture = "Qwen3VLForConditionalGeneration"
    text_kind = "llama"
    recipe_version = "v2"  # v2: the chat template renders video parts
    vision_tokens = qwen2_vl.VISION_TOKENS
    image_anchor = qwen2_vl.IMAGE_ANCHOR
    video_anchor = VIDEO_ANCHOR
    image_token = qwen2_vl.IMAGE_PAD
    processor_files = processor_files("Qwen3VLProcessor", "Qwen3VLVideoProcessor")
    text_model_type = "qwen3_vl_text"
    feature_gain = 1.0  # the image tokens' RMS over the text embeddings'

    def text_fields(self, text_config: Mapping[str, Any]) -> dict[str, Any]:
        """text_config's fields over the text demo's."""
        return {
            "model_type": self.text_model_type,
            "rope_scaling": {
                "rope_type": "default",
                "mrope_section": mrope_section(text_config["head_dim"]),
                "mrope_interleaved": True,
            },
            "attention_bias": False,
        }

    def model_config(
        self, text_config: Mapping[str, Any], ids: Mapping[str, int], vocab_size: int
    ) -> dict:
        vision = {**VISION_CONFIG, "out_hidden_size": text_config["hidden_size"]}
        fields = {
            "image_token_id": ids[qwen2_vl.IMAGE_PAD],
            "video_token_id": ids[qwen2_vl.VIDEO_PAD],
            "vision_start_token_id": ids[qwen2_vl.VISION_START],
            "vision_end_token_id": ids[qwen2_vl.VISION_END],
        }
        text = {**self.text_fields(text_config), "vocab_size": vocab_size}
        text |= special_token_ids(ids)
        return parts.nested_config(text_config, text, vision, fields, ids, vocab_size)

    def extra_text_weights(self, text_config: Mapping[str, Any]) -> dict:
        return qk_norms(text_config)

    def vision_weights(self, config: Mapping[str, Any], feature_rms: float, rng) -> dict:
        return vision_tower_weights(config, feature_rms, rng, self.feature_gain)


FAMILY = Qwen3VL()
