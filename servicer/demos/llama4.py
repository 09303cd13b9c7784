"""The ``llama4`` family of the demo vision-language model (``servicer.demos.vision``).

Llama 4 as mlx-vlm loads it (``Llama4ForConditionalGeneration``): a vision tower of 14-pixel
patches unfolded into a linear layer, a class token, learnt positions and 2-D RoPE, a 2x2
pixel shuffle with an MLP adapter, a linear projector, and a Llama 4 text model (mixture of
experts beside a shared expert every ``MOE_STEP`` layers, chunked local attention in the
RoPE layers, every fourth layer without RoPE and with attention temperature tuning). An image
is cut into tiles of ``TILE_SIZE`` pixels (a grid of at most ``MAX_TILES``), and an image of
several tiles has one more, the global tile (the whole image resized to one tile: Llama 4's,
which mlx-vlm 0.7.10's processor leaves out while its prompt holds its run; the worker adds
it, ``servicer.numpy_processors.with_global_tile``); each tile becomes ``TOKENS_PER_TILE``
``<|patch|>`` tokens. Built from the ``llama`` text demo
(``servicer.demos.text``), nothing trained here:

- the tokenizer and token embeddings are the text demo's trained ones, with Llama 4's image
  tokens appended as special tokens and embedding rows for them drawn at the trained rows'
  scale (the output head a copy of them); the chat template renders ``<|image|>``
  (``IMAGE_ANCHOR``, what Llama 4's processor expands) per image part.
- the text layers are random (Llama 4's differ from llama's): four layers at the text demo's
  sizes (the fourth without RoPE), every second a mixture of ``EXPERTS`` experts, linear
  layers N(0, 1/fan_in), each layer's output scaled to ``LAYER_GAIN`` times the embeddings'
  RMS.
- the vision tower is tiny (56-pixel tiles: 4x4 patches, shuffled into 4 image tokens),
  random from a seeded numpy generator; the projector is scaled so that the image tokens
  enter the language model at the text embeddings' RMS.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import parts
from .vision import Family

IMAGE_START, IMAGE_END = "<|image_start|>", "<|image_end|>"
TILE_X, TILE_Y = "<|tile_x_separator|>", "<|tile_y_separator|>"
IMAGE, PATCH = "<|image|>", "<|patch|>"
IMAGE_ANCHOR = IMAGE  # what the chat template renders for one image, unexpanded

TILE_SIZE = 56
PATCH_SIZE = 14  # mlx-vlm's processor counts 14-pixel patches whatever the config says
SHUFFLE = 0.5  # the pixel shuffle: 2x2 patches one image token
TOKENS_PER_TILE = int((TILE_SIZE // PATCH_SIZE) ** 2 * SHUFFLE**2)  # 4
MAX_TILES = 16
EXPERTS = 4
MOE_STEP = 2  # layers 1 and 3 are mixtures of experts, 0 and 2 dense
CHUNK = 8192  # chunked attention's chunk (Llama 4 Scout's)
FLOOR_SCALE = 4  # attention temperature moves every 4 positions (8192 in Llama 4)
LAYER_GAIN = 12.0  # each random text layer adds this times the embeddings' RMS

VISION_CONFIG = {
    "model_type": "llama4_vision_model",
    "hidden_size": 64,
    "intermediate_size": 256,  # 4 x 64: the adapter takes the 2x2 shuffle's width
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_channels": 3,
    "image_size": TILE_SIZE,
    "patch_size": PATCH_SIZE,
    "norm_eps": 1e-5,
    "pixel_shuffle_ratio": SHUFFLE,
    "projector_input_dim": 128,
    "projector_output_dim": 128,
    "vision_output_dim": 128,
    "projector_dropout": 0.0,
    "rope_theta": 10000,
    "vision_feature_layer": -1,
    "vision_feature_select_strategy": "default",
    "initializer_range": 0.02,
}

PREPROCESSOR = {
    "image_processor_type": "Llama4ImageProcessorFast",
    "processor_class": "Llama4Processor",
    "size": {"height": TILE_SIZE, "width": TILE_SIZE},
    "max_patches": MAX_TILES,
    "resize_to_max_canvas": False,
    "do_resize": True,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "do_convert_rgb": True,
}


def llama4_text_layers(text: Mapping[str, Any], feature_rms: float, rng) -> dict:
    """Random Llama 4 text layers under mlx-vlm's names less ``language_model.model.``:
    linear layers N(0, 1/fan_in), each layer's output layers scaled to `feature_rms`, norms
    at one; experts stacked [experts, out, in] (SwitchGLU's layout)."""
    import numpy as np

    hidden, heads = text["hidden_size"], text["num_attention_heads"]
    kv, head_dim = text["num_key_value_heads"], text["head_dim"]
    expert_ff, dense_ff = text["intermediate_size"], text["intermediate_size_mlp"]
    experts, step = text["num_local_experts"], text["interleave_moe_layer_step"]
    out: dict[str, Any] = {"norm.weight": np.ones(hidden)}

    def mlp(prefix: str, ff: int) -> dict:
        found = parts.random_linear(rng, f"{prefix}.gate_proj", ff, hidden, bias=False)
        found |= parts.random_linear(rng, f"{prefix}.up_proj", ff, hidden, bias=False)
        return found | parts.random_linear(
            rng, f"{prefix}.down_proj", hidden, ff, feature_rms, bias=False
        )

    for layer in range(text["num_hidden_layers"]):
        prefix = f"layers.{layer}"
        attention = f"{prefix}.self_attn"
        out |= parts.random_linear(rng, f"{attention}.q_proj", heads * head_dim, hidden, bias=False)
        out |= parts.random_linear(rng, f"{attention}.k_proj", kv * head_dim, hidden, bias=False)
        out |= parts.random_linear(rng, f"{attention}.v_proj", kv * head_dim, hidden, bias=False)
        out |= parts.random_linear(
            rng, f"{attention}.o_proj", hidden, heads * head_dim, feature_rms, bias=False
        )
        ff = f"{prefix}.feed_forward"
        if layer % step == step - 1:
            out[f"{ff}.router.weight"] = rng.standard_normal((experts, hidden)) / np.sqrt(hidden)
            gate = rng.standard_normal((experts, expert_ff, hidden)) / np.sqrt(hidden)
            up = rng.standard_normal((experts, expert_ff, hidden)) / np.sqrt(hidden)
            down = rng.standard_normal((experts, hidden, expert_ff)) * feature_rms
            out[f"{ff}.experts.gate_proj.weight"] = gate
            out[f"{ff}.experts.up_proj.weight"] = up
            out[f"{ff}.experts.down_proj.weight"] = down / np.sqrt(expert_ff)
            out |= mlp(f"{ff}.shared_expert", expert_ff)
        else:
            out |= mlp(ff, dense_ff)
        out[f"{prefix}.input_layernorm.weight"] = np.ones(hidden)
        out[f"{prefix}.post_attention_layernorm.weight"] = np.ones(hidden)
    return out


class Llama4(Family):
    model_type = "llama4"
    architecture = "Llama4ForConditionalGeneration"
    text_kind = "llama"
    recipe_version = "v1"
    # Appended after the text vocabulary: 512 to 517.
    vision_tokens = (IMAGE_START, IMAGE_END, TILE_X, TILE_Y, IMAGE, PATCH)
    image_anchor = IMAGE_ANCHOR
    image_token = PATCH
    processor_files: Mapping[str, Mapping[str, Any]] = {"preprocessor_config.json": PREPROCESSOR}
    untied_head = True  # Llama 4's output head is its own

    def model_config(
        self, text_config: Mapping[str, Any], ids: Mapping[str, int], vocab_size: int
    ) -> dict:
        text_fields = {
            "model_type": "llama4_text",
            "vocab_size": vocab_size,
            "tie_word_embeddings": False,
            "num_hidden_layers": 4,  # the fourth without RoPE
            "intermediate_size_mlp": text_config["intermediate_size"],
            "num_local_experts": EXPERTS,
            "num_experts_per_tok": 1,
            "interleave_moe_layer_step": MOE_STEP,
            "attention_chunk_size": CHUNK,
            "use_qk_norm": True,
            "attn_temperature_tuning": True,
            "floor_scale": FLOOR_SCALE,
            "attn_scale": 0.1,
            "rope_scaling": None,
        }
        fields = {
            "image_token_index": ids[PATCH],
            "boi_token_index": ids[IMAGE_START],
            "eoi_token_index": ids[IMAGE_END],
        }
        config = parts.nested_config(
            text_config, text_fields, VISION_CONFIG, fields, ids, vocab_size
        )
        return config | {"tie_word_embeddings": False}

    def vision_weights(self, config: Mapping[str, Any], feature_rms: float, rng) -> dict:
        """The vision tower, adapter and projector, and (under ``llama4.``) the random text
        layers, which replace the text demo's llama layers in `saved_weights`."""
        import numpy as np

        vision = config["vision_config"]
        width, mlp = vision["hidden_size"], vision["intermediate_size"]
        patch, channels = vision["patch_size"], vision["num_channels"]
        patches = (vision["image_size"] // patch) ** 2
        tower = "vision_model"
        unfolded = channels * patch * patch
        out = parts.random_linear(
            rng, f"{tower}.patch_embedding.linear", width, unfolded, bias=False
        )
        out[f"{tower}.class_embedding"] = rng.standard_normal(width) * 0.5
        out[f"{tower}.positional_embedding_vlm"] = rng.standard_normal((patches + 1, width)) * 0.5
        out |= parts.unit_layer_norm(f"{tower}.layernorm_pre", width)
        out |= parts.unit_layer_norm(f"{tower}.layernorm_post", width)
        for layer in range(vision["num_hidden_layers"]):
            prefix = f"{tower}.model.layers.{layer}"
            out |= parts.unit_layer_norm(f"{prefix}.input_layernorm", width)
            out |= parts.unit_layer_norm(f"{prefix}.post_attention_layernorm", width)
            for proj in ("q_proj", "k_proj", "v_proj"):
                out |= parts.random_linear(rng, f"{prefix}.self_attn.{proj}", width, width)
            out |= parts.random_linear(rng, f"{prefix}.self_attn.o_proj", width, width, gain=0.5)
            out |= parts.random_linear(rng, f"{prefix}.mlp.fc1", mlp, width)
            out |= parts.random_linear(rng, f"{prefix}.mlp.fc2", width, mlp, gain=0.5)
        adapter = f"{tower}.vision_adapter.mlp"
        inner, projected = vision["projector_input_dim"], vision["projector_output_dim"]
        out |= parts.random_linear(rng, f"{adapter}.fc1", inner, mlp, bias=False)
        out |= parts.random_linear(rng, f"{adapter}.fc2", projected, inner, bias=False)
        hidden = config["text_config"]["hidden_size"]
        gain = parts.gelu_gain(feature_rms) / np.sqrt(0.4252)  # after two GELUs
        out |= parts.random_linear(
            rng, "multi_modal_projector.linear_1", hidden, vision["vision_output_dim"], gain, False
        )
        text = llama4_text_layers(config["text_config"], feature_rms * LAYER_GAIN, rng)
        return out | {f"llama4.{name}": value for name, value in text.items()}

    def saved_weights(self, weights: dict) -> dict:
        llama = ("language_model.model.layers.", "language_model.model.norm.")
        out = {k: v for k, v in weights.items() if not k.startswith((*llama, "llama4."))}
        text = {k.removeprefix("llama4."): v for k, v in weights.items() if k.startswith("llama4.")}
        return out | {f"language_model.model.{name}": value for name, value in text.items()}


FAMILY = Llama4()
