"""The ``glm4v_moe`` family of the demo vision-language model (``servicer.demos.vision``):
GLM-4.5V / GLM-4.6V-style (mixture-of-experts text stack).

``servicer.demos.glm4v``'s build (tokens, chat template, processor, vision tower, mlx-vlm's
on-disk names) with GLM-4.5's MoE text model: no norms after attention and MLP, the partial
rotary embedding in half-split pairs (mlx-vlm's ``sectioned_half_split``, mlx-lm's
``glm4_moe``), the first ``FIRST_DENSE`` layers dense and the rest sigmoid-routed experts
plus shared experts. The worker runs mlx-lm's ``glm4_moe`` model on ``text_config``
(``model_type`` "glm4v_moe_text", mapped by the registry). Built from the ``llama`` text demo,
nothing trained here:

- the language model is the text demo's trained weights with zero q/k/v biases and its own
  output head (a copy of the tied embedding); a dense layer keeps the text demo's MLP; an MoE
  layer's shared experts are that MLP whole (``n_shared_experts`` x ``moe_intermediate_size``
  its width) and each routed expert a slice of it (``EXPERTS`` slices of its intermediate
  width), chosen ``TOP_K`` a token by a router drawn from a fixed seed and weighted by
  ``ROUTED_SCALE``: the text demo's MLP plus a routed part of it again.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import glm4v

FIRST_DENSE = 1  # first_k_dense_replace
EXPERTS = 4
TOP_K = 2
ROUTED_SCALE = 0.5
ROUTER_SEED = 0x61


class Glm4vMoe(glm4v.Glm4v):
    model_type = "glm4v_moe"
    architecture = "Glm4vMoeForConditionalGeneration"
    recipe_version = "v1"
    text_model_type = "glm4v_moe_text"

    def text_fields(self, text_config: Mapping[str, Any]) -> dict[str, Any]:
        width = text_config["intermediate_size"]
        if width % EXPERTS:
            raise ValueError(f"the MLP's width {width} does not split into {EXPERTS} experts")
        heads = text_config["num_attention_heads"]
        return {
            **super().text_fields(text_config),
            "head_dim": text_config["hidden_size"] // heads,
            "moe_intermediate_size": width // EXPERTS,
            "n_routed_experts": EXPERTS,
            "n_shared_experts": EXPERTS,  # the whole MLP
            "num_experts_per_tok": TOP_K,
            "first_k_dense_replace": FIRST_DENSE,
            "norm_topk_prob": True,
            "routed_scaling_factor": ROUTED_SCALE,
            "n_group": 1,
            "topk_group": 1,
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "use_qk_norm": False,
        }

    def extra_text_weights(self, text_config: Mapping[str, Any]) -> dict:
        """Zero q/k/v biases (no norms after attention and MLP in GLM-4.5's layers)."""
        return glm4v.qkv_biases(text_config)

    def saved_weights(self, weights: dict) -> dict:
        """The MoE layers' MLPs as shared experts (whole) and routed experts (slices), stacked
        as mlx-vlm's SwitchGLU holds them, with a router from a fixed seed."""
        import numpy as np

        rng = np.random.default_rng(ROUTER_SEED)
        out = dict(weights)
        layer = FIRST_DENSE
        while f"language_model.model.layers.{layer}.mlp.gate_proj.weight" in out:
            mlp = f"language_model.model.layers.{layer}.mlp"
            gate, up, down = (
                out.pop(f"{mlp}.{p}.weight") for p in ("gate_proj", "up_proj", "down_proj")
            )
            for name, value in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
                out[f"{mlp}.shared_experts.{name}.weight"] = value
            out[f"{mlp}.switch_mlp.gate_proj.weight"] = np.stack(np.split(gate, EXPERTS))
            out[f"{mlp}.switch_mlp.up_proj.weight"] = np.stack(np.split(up, EXPERTS))
            out[f"{mlp}.switch_mlp.down_proj.weight"] = np.stack(np.split(down, EXPERTS, axis=1))
            hidden = gate.shape[1]
            out[f"{mlp}.gate.weight"] = rng.standard_normal((EXPERTS, hidden)) / np.sqrt(hidden)
            out[f"{mlp}.gate.e_score_correction_bias"] = np.zeros(EXPERTS)
            layer += 1
        return out


FAMILY = Glm4vMoe()
