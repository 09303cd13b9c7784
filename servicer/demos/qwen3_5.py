"""The ``qwen3_5`` family of the demo vision-language model (``servicer.demos.vision``).

Qwen3.5: Qwen3-VL's prompt, processor and vision tower (no deepstack: mlx-vlm disables it for
this family) over a hybrid text stack, Qwen3-Next's: gated delta-net (linear attention)
layers and, every ``full_attention_interval``-th layer, gated attention whose rotary half of
each head takes interleaved multimodal RoPE (``rope_parameters.mrope_interleaved``). Built
from the ``hybrid`` text demo (a qwen3_next model), nothing trained here:

- the language model is the hybrid demo's trained weights in Qwen3.5's layout: each delta-net
  layer's fused projections (``in_proj_qkvz``, ``in_proj_ba``, grouped by key head) split
  into ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b`` and ``in_proj_a``; the rest as it is. So
  its text is the hybrid demo's (mRoPE reduces to its RoPE for text positions);
- the tokenizer is the text demo's with Qwen2-VL's vision tokens appended as special tokens
  and embedding rows for them drawn at the trained rows' scale;
- the vision tower is ``qwen3_vl``'s tiny one (16-pixel patches, learned position table) with
  no deepstack mergers, random from a seeded numpy generator, its image tokens at
  ``feature_gain`` times the text embeddings' RMS (the hybrid demo ignores quieter ones).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import qwen3_vl


def split_delta_net(weights: dict, text_config: Mapping[str, Any]) -> dict:
    """Qwen3-Next's fused delta-net projections (rows grouped by key head: q, k, then the
    group's v and z heads; b then a) as Qwen3.5's separate ones (q, k and v of every head in
    turn, the order the convolution reads them in, which the fused layout's reordering
    makes)."""
    import numpy as np

    nk, nv = text_config["linear_num_key_heads"], text_config["linear_num_value_heads"]
    dk, dv = text_config["linear_key_head_dim"], text_config["linear_value_head_dim"]
    out = dict(weights)
    for layer in range(text_config["num_hidden_layers"]):
        prefix = f"language_model.model.layers.{layer}.linear_attn"
        if f"{prefix}.in_proj_qkvz.weight" not in out:
            continue
        qkvz = out.pop(f"{prefix}.in_proj_qkvz.weight")
        hidden = qkvz.shape[-1]
        grouped = qkvz.reshape(nk, -1, hidden)
        q, k, v, z = np.split(grouped, [dk, 2 * dk, 2 * dk + nv // nk * dv], axis=1)
        rows = [part.reshape(-1, hidden) for part in (q, k, v)]
        out[f"{prefix}.in_proj_qkv.weight"] = np.concatenate(rows)
        out[f"{prefix}.in_proj_z.weight"] = z.reshape(-1, hidden)
        ba = out.pop(f"{prefix}.in_proj_ba.weight").reshape(nk, -1, hidden)
        b, a = np.split(ba, [nv // nk], axis=1)
        out[f"{prefix}.in_proj_b.weight"] = b.reshape(-1, hidden)
        out[f"{prefix}.in_proj_a.weight"] = a.reshape(-1, hidden)
    return out


class Qwen3_5(qwen3_vl.Qwen3VL):
    model_type = "qwen3_5"
    architecture = "Qwen3_5ForConditionalGeneration"
    text_kind = "hybrid"
    recipe_version = "v3"
    text_model_type = "qwen3_5_text"
    # transformers' Qwen3.5 tokenizer would add its default unknown token past the model's
    # rows (a real checkpoint has it in its vocabulary): the demo names none.
    tokenizer_fields = {**qwen3_vl.Qwen3VL.tokenizer_fields, "unk_token": None}
    # The hybrid demo barely heeds image tokens at the embeddings' scale (the answers would
    # not depend on the image); louder, they do.
    feature_gain = 4.0
    processor_files = qwen3_vl.processor_files("Qwen3VLProcessor", "Qwen3VLVideoProcessor")

    def text_fields(self, text_config: Mapping[str, Any]) -> dict[str, Any]:
        """Qwen3.5's rope_parameters (its rotary share of each head, the interleaved mRoPE
        sections of that share) in place of the hybrid demo's rope fields."""
        rotary = int(text_config["head_dim"] * text_config["partial_rotary_factor"])
        return {
            "model_type": self.text_model_type,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": text_config["rope_theta"],
                "partial_rotary_factor": text_config["partial_rotary_factor"],
                "mrope_section": qwen3_vl.mrope_section(rotary),
                "mrope_interleaved": True,
            },
        }

    def model_config(
        self, text_config: Mapping[str, Any], ids: Mapping[str, int], vocab_size: int
    ) -> dict:
        config = super().model_config(text_config, ids, vocab_size)
        vision = {**config["vision_config"], "model_type": self.model_type}
        config["vision_config"] = {**vision, "deepstack_visual_indexes": []}
        return config

    def extra_text_weights(self, text_config: Mapping[str, Any]) -> dict:
        return {}  # Qwen3-Next's attention has its query/key norms

    def adapt_text_weights(self, weights: dict, text_config: Mapping[str, Any], rng) -> dict:
        return split_delta_net(weights, text_config)


FAMILY = Qwen3_5()
