"""The ``qwen2_5_vl`` family of the demo vision-language model (``servicer.demos.vision``).

Qwen2.5-VL: Qwen2-VL's text stack, tokens, chat anchor, image processor and multimodal RoPE
(mlx-lm loads it as its qwen2_vl text model; mlx-vlm's ``get_rope_index`` is Qwen2-VL's for
images), with another vision tower: RMSNorms, a SwiGLU MLP with biases, windowed attention in
every block but those in ``fullatt_block_indexes``, the merged patches reordered window by
window and back, and a merger (RMSNorm, then a GELU MLP) out to ``out_hidden_size``. So this
family shares everything with the default ``qwen2_vl`` build but the vision tower, its config
and the processor's class name:

- the language model is the ``llama`` text demo's trained weights in Qwen2's stack (zero
  q/k/v biases), the tokenizer the text demo's with Qwen2-VL's vision tokens appended;
- the vision tower is tiny (2 blocks of width 64, the first windowed, the second full) and
  random from a seeded numpy generator, its windows 56 pixels wide (2x2 merged tokens, so
  the test images span several windows), scaled so its output tokens have the trained text
  embeddings' RMS: the image shifts the continuation without drowning the prompt.

The smg router knows this family only by a served name holding "qwen" and "vl" (its own
Qwen-VL processing, ``mm_inputs``); under another name it leaves the images to the worker
(media references). The demo's directory name holds both. Its chat template renders a video
part as ``<|vision_start|><|video_pad|><|vision_end|>`` (the router refuses video for its
Qwen-VL spec: a video reaches the worker as a media reference only).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import parts, qwen2_vl

WINDOW_SIZE = 56  # pixels: 2x2 merged tokens a window (Qwen2.5-VL's own is 112 = 4x4)
VISION_CONFIG: Mapping[str, Any] = {
    "model_type": "qwen2_5_vl",
    "depth": 2,
    "hidden_size": 64,  # the tower's width; out_hidden_size is the text model's
    "intermediate_size": 128,
    "num_heads": 2,
    "in_channels": 3,
    "in_chans": 3,
    "patch_size": qwen2_vl.PATCH_SIZE,
    "spatial_patch_size": qwen2_vl.PATCH_SIZE,
    "spatial_merge_size": qwen2_vl.MERGE_SIZE,
    "temporal_patch_size": qwen2_vl.TEMPORAL_PATCH_SIZE,
    "window_size": WINDOW_SIZE,
    "fullatt_block_indexes": [1],
    "tokens_per_second": 2,
    "hidden_act": "silu",
}


def _processor_files() -> dict[str, dict[str, Any]]:
    """Qwen2-VL's image and video processor configs under Qwen2.5-VL's processor class
    (its image processor is Qwen2-VL's)."""
    qwen2 = qwen2_vl.FAMILY.processor_files
    processor = {"processor_class": "Qwen2_5_VLProcessor"}
    return {
        "preprocessor_config.json": {**qwen2["preprocessor_config.json"], **processor},
        "processor_config.json": processor,
        "video_preprocessor_config.json": {
            **qwen2["video_preprocessor_config.json"],
            **processor,
        },
    }


class Qwen2_5VL(qwen2_vl.Qwen2VL):
    """Qwen2-VL's tokens, text stack (its zero q/k/v biases) and processor, with Qwen2.5-VL's
    vision tower."""

    model_type = "qwen2_5_vl"
    architecture = "Qwen2_5_VLForConditionalGeneration"
    recipe_version = "v2"  # v2: the chat template renders video parts
    processor_files = _processor_files()
    video_anchor = qwen2_vl.VISION_START + qwen2_vl.VIDEO_PAD + qwen2_vl.VISION_END

    def model_config(
        self, text_config: Mapping[str, Any], ids: Mapping[str, int], vocab_size: int
    ) -> dict:
        """Qwen2-VL's config (the text model's fields at the top level, the vision token ids,
        mRoPE sections) with Qwen2.5-VL's vision tower."""
        config = super().model_config(text_config, ids, vocab_size)
        vision = {**VISION_CONFIG, "out_hidden_size": text_config["hidden_size"]}
        return {**config, "vision_config": vision}

    def vision_weights(self, config: Mapping[str, Any], feature_rms: float, rng) -> dict:
        """Random vision tower weights, shaped as mlx-vlm's Qwen2.5-VL VisionModel holds them.

        Linear layers get N(0, 1/fan_in) weights and small biases, so every activation stays
        near unit scale; RMSNorms start at one. The merger's last layer is scaled so the image
        tokens come out with RMS `feature_rms` (the text embeddings'), for unit-scale gelu inputs.
        """
        import numpy as np

        vision = config["vision_config"]
        width, mlp = vision["hidden_size"], vision["intermediate_size"]
        hidden = vision["out_hidden_size"]
        merged = width * vision["spatial_merge_size"] ** 2
        out: dict[str, Any] = qwen2_vl.patch_embedding(rng, vision, width)
        for block in range(vision["depth"]):
            prefix = f"vision_tower.blocks.{block}"
            out[f"{prefix}.norm1.weight"] = np.ones(width)
            out[f"{prefix}.norm2.weight"] = np.ones(width)
            out |= parts.random_linear(rng, f"{prefix}.attn.qkv", 3 * width, width)
            out |= parts.random_linear(rng, f"{prefix}.attn.proj", width, width, gain=0.5)
            out |= parts.random_linear(rng, f"{prefix}.mlp.gate_proj", mlp, width)
            out |= parts.random_linear(rng, f"{prefix}.mlp.up_proj", mlp, width)
            out |= parts.random_linear(rng, f"{prefix}.mlp.down_proj", width, mlp, gain=0.5)
        out["vision_tower.merger.ln_q.weight"] = np.ones(width)
        out |= parts.random_linear(rng, "vision_tower.merger.mlp.0", merged, merged)
        gain = parts.gelu_gain(feature_rms)
        out |= parts.random_linear(rng, "vision_tower.merger.mlp.2", hidden, merged, gain=gain)
        return out


FAMILY = Qwen2_5VL()
