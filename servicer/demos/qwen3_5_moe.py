"""The ``qwen3_5_moe`` family of the demo vision-language model (``servicer.demos.vision``).

Qwen3.5-MoE: everything of the ``qwen3_5`` demo (Qwen3-VL's prompt, processor and tower
without deepstack, the hybrid text stack's delta-net and attention layers, interleaved
multimodal RoPE) with a mixture of experts in every layer: routed experts plus a gated shared
expert (Qwen3-Next's sparse block). Built from the ``hybrid`` text demo, nothing trained here:

- each layer's dense SwiGLU becomes ``qwen3_vl_moe.EXPERTS`` routed experts (its quarters, as
  the ``qwen3_vl_moe`` demo splits them, ``qwen3_vl_moe.TOP_K`` a token, behind a random
  router) and a shared expert (the whole SwiGLU), the two halved (the shared expert's gate
  at zero: sigmoid 0.5), so greedy text stays near the hybrid demo's;
- the delta-net projections split as ``qwen3_5``'s; tied embeddings;
- the tokenizer and the vision tower (its tokens louder than the embeddings) as
  ``qwen3_5``'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import qwen3_5, qwen3_vl, qwen3_vl_moe


def shared_expert_weights(weights: dict, text_config: Mapping[str, Any], rng) -> dict:
    """Each layer's dense SwiGLU as half routed experts (`qwen3_vl_moe.moe_text_weights`) and
    half a shared expert behind a zero gate."""
    import numpy as np

    out = dict(weights)
    for layer in range(text_config["num_hidden_layers"]):
        prefix = f"language_model.model.layers.{layer}.mlp"
        for proj in ("gate", "up", "down"):
            shared = out[f"{prefix}.{proj}_proj.weight"]
            out[f"{prefix}.shared_expert.{proj}_proj.weight"] = shared
        out[f"{prefix}.shared_expert_gate.weight"] = np.zeros((1, text_config["hidden_size"]))
        out[f"{prefix}.down_proj.weight"] = out[f"{prefix}.down_proj.weight"] * 0.5
    return qwen3_vl_moe.moe_text_weights(out, text_config, rng, qwen3_vl_moe.EXPERTS)


class Qwen3_5Moe(qwen3_5.Qwen3_5):
    model_type = "qwen3_5_moe"
    architecture = "Qwen3_5MoeForConditionalGeneration"
    recipe_version = "v3"
    text_model_type = "qwen3_5_moe_text"
    untied_head = False
    processor_files = qwen3_vl.processor_files("Qwen3VLProcessor", "Qwen3VLVideoProcessor")

    def text_fields(self, text_config: Mapping[str, Any]) -> dict[str, Any]:
        intermediate = text_config["intermediate_size"]
        return {
            **super().text_fields(text_config),
            "num_experts": qwen3_vl_moe.EXPERTS,
            "num_experts_per_tok": qwen3_vl_moe.TOP_K,
            "moe_intermediate_size": intermediate // qwen3_vl_moe.EXPERTS,
            "shared_expert_intermediate_size": intermediate,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "norm_topk_prob": True,
        }

    def adapt_text_weights(self, weights: dict, text_config: Mapping[str, Any], rng) -> dict:
        split = qwen3_5.split_delta_net(weights, text_config)
        return shared_expert_weights(split, text_config, rng)


FAMILY = Qwen3_5Moe()
