"""The ``qwen3_vl_moe`` family of the demo vision-language model (``servicer.demos.vision``).

Qwen3-VL-MoE (Qwen3-VL-30B-A3B's architecture): everything of the ``qwen3_vl`` demo (its
prompt, processor, interleaved multimodal RoPE, a vision tower with deepstack, here under the
``qwen3_vl_moe`` model type) with a mixture-of-experts text stack (Qwen3-MoE). Built from the
``llama`` text demo, nothing trained here:

- each text layer's MLP becomes ``EXPERTS`` tiny experts, the quarters of the text demo's
  SwiGLU (its intermediate rows split four ways), their down projections doubled since a
  token takes ``TOP_K`` of them, with a random router (``mlp.gate``): greedy text stays near
  the text demo's and depends on the routing;
- the output head is its own (``tie_word_embeddings`` false: mlx-lm's qwen3_vl_moe reads an
  ``lm_head``), a copy of the embedding;
- the query/key norms at one, the tokenizer and the vision tower as ``qwen3_vl``'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import qwen3_vl

EXPERTS = 4
TOP_K = 2


def moe_text_weights(weights: dict, text_config: Mapping[str, Any], rng, experts: int) -> dict:
    """The text demo's dense SwiGLU MLPs as `experts` experts each (its intermediate rows split
    evenly, down projections scaled by experts / TOP_K) behind a random router."""
    import numpy as np

    out = dict(weights)
    hidden = text_config["hidden_size"]
    for layer in range(text_config["num_hidden_layers"]):
        prefix = f"language_model.model.layers.{layer}.mlp"
        gate, up, down = (out.pop(f"{prefix}.{p}_proj.weight") for p in ("gate", "up", "down"))
        out[f"{prefix}.switch_mlp.gate_proj.weight"] = np.stack(np.split(gate, experts))
        out[f"{prefix}.switch_mlp.up_proj.weight"] = np.stack(np.split(up, experts))
        scaled = np.split(down * (experts / TOP_K), experts, axis=1)
        out[f"{prefix}.switch_mlp.down_proj.weight"] = np.stack(scaled)
        out[f"{prefix}.gate.weight"] = rng.standard_normal((experts, hidden)) / np.sqrt(hidden)
    return out


class Qwen3VLMoe(qwen3_vl.Qwen3VL):
    model_type = "qwen3_vl_moe"
    architecture = "Qwen3VLMoeForConditionalGeneration"
    recipe_version = "v1"
    text_model_type = "qwen3_vl_moe_text"
    untied_head = True
    processor_files = qwen3_vl.processor_files("Qwen3VLProcessor", "Qwen3VLVideoProcessor")

    def text_fields(self, text_config: Mapping[str, Any]) -> dict[str, Any]:
        return {
            **super().text_fields(text_config),
            "num_experts": EXPERTS,
            "num_experts_per_tok": TOP_K,
            "moe_intermediate_size": text_config["intermediate_size"] // EXPERTS,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "norm_topk_prob": True,
            "tie_word_embeddings": False,
        }

    def model_config(
        self, text_config: Mapping[str, Any], ids: Mapping[str, int], vocab_size: int
    ) -> dict:
        config = super().model_config(text_config, ids, vocab_size)
        config["vision_config"]["model_type"] = self.model_type
        return {**config, "tie_word_embeddings": False}

    def adapt_text_weights(self, weights: dict, text_config: Mapping[str, Any], rng) -> dict:
        return moe_text_weights(weights, text_config, rng, EXPERTS)


FAMILY = Qwen3VLMoe()
