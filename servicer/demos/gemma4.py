"""The ``gemma4`` family of the demo vision-language model (``servicer.demos.vision``).

Gemma 4's text stack differs from every text demo kind (per-layer inputs, K/V norms, layer
scalars), so only the tokenizer and the token embeddings come from the ``gemma3`` text demo;
the rest is random, from a seeded numpy generator:

- the language model is mlx-lm's ``gemma4_text`` at the text demo's size (width 128, a
  sliding-window layer of 16 then a global one) with per-layer inputs (width 16 a layer), so
  an image's positions take the per-layer embedding mlx-vlm gives them (of token 0) and its
  features through the per-layer projection. The token embeddings are the gemma3 text
  demo's trained rows; the layers are random at unit scale, greedy text is not the demo's.
  The checkpoint also loads with ``mlx_lm.load`` (its ``gemma4`` type drops the vision side).
- the tokenizer is the text demo's with Gemma 4's image, video and audio tokens appended as
  special tokens. The chat template renders ``<|image|>`` (``IMAGE_ANCHOR``) per image part,
  as Gemma 4's own does; the processor expands it into ``<|image>``, the image's soft tokens
  and ``<image|>``, as many as the image's aspect-ratio-preserving resize makes (at most
  ``MAX_SOFT_TOKENS``): the count depends on the image's size.
- the vision tower is a tiny Gemma 4 ViT (4-pixel patches, pooled 2x2), random; the
  embedder's projection is scaled so that the image tokens enter the language model at the
  (scaled) text embeddings' RMS. mlx-vlm puts the features in unscaled, next to the text
  embeddings it has already scaled by sqrt(hidden).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from . import parts
from .vision import Family

BOI_TOKEN = "<|image>"
EOI_TOKEN = "<image|>"
IMAGE_TOKEN = "<|image|>"
VIDEO_TOKEN = "<|video|>"
BOA_TOKEN = "<|audio>"
EOA_TOKEN = "<audio|>"
AUDIO_TOKEN = "<|audio|>"
# Appended after the text demo's vocabulary, in this order: ids 512 to 518.
VISION_TOKENS = (BOI_TOKEN, EOI_TOKEN, IMAGE_TOKEN, VIDEO_TOKEN, BOA_TOKEN, EOA_TOKEN, AUDIO_TOKEN)
IMAGE_ANCHOR = IMAGE_TOKEN

PATCH_SIZE = 4
POOLING = 2  # soft tokens pool POOLING x POOLING patches
MAX_SOFT_TOKENS = 70  # the smallest budget transformers' processor accepts
PER_LAYER_WIDTH = 16
LOUD = 2.0

VISION_CONFIG = {
    "model_type": "gemma4_vision",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "global_head_dim": 32,
    "patch_size": PATCH_SIZE,
    "pooling_kernel_size": POOLING,
    "position_embedding_size": 160,  # patches a side of the widest image the budget allows
    "default_output_length": MAX_SOFT_TOKENS,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_theta": 100.0, "rope_type": "default"},
    "standardize": False,
    "use_clipped_linears": False,
}

IMAGE_PROCESSOR = parts.image_processor_config(
    "Gemma4ImageProcessor",
    "Gemma4Processor",
    {"resample": 3},  # bicubic, to the aspect-preserving size the budget allows
    mean=(0.0, 0.0, 0.0),  # Gemma 4 takes pixels in [0, 1]: no normalisation
    std=(1.0, 1.0, 1.0),
    more={
        "do_normalize": False,
        "patch_size": PATCH_SIZE,
        "pooling_kernel_size": POOLING,
        "max_soft_tokens": MAX_SOFT_TOKENS,
    },
)


class Gemma4(Family):
    model_type = "gemma4"
    architecture = "Gemma4ForConditionalGeneration"
    text_kind = "gemma3"  # the tokenizer and token embeddings only
    recipe_version = "v1"
    vision_tokens = VISION_TOKENS
    image_anchor = IMAGE_ANCHOR
    image_token = IMAGE_TOKEN
    # The processor reads these tokens (and their ids) as the tokenizer's attributes.
    tokenizer_fields = {
        "extra_special_tokens": {
            "boi_token": BOI_TOKEN,
            "eoi_token": EOI_TOKEN,
            "image_token": IMAGE_TOKEN,
            "boa_token": BOA_TOKEN,
            "eoa_token": EOA_TOKEN,
            "audio_token": AUDIO_TOKEN,
        },
    }
    # transformers' Gemma4ImageProcessorPil reads preprocessor_config.json, mlx-vlm's own
    # processor the "image_processor" of processor_config.json (as Gemma 4's checkpoints ship).
    processor_files = {
        "preprocessor_config.json": IMAGE_PROCESSOR,
        "processor_config.json": {
            "processor_class": "Gemma4Processor",
            "image_seq_length": MAX_SOFT_TOKENS,
            "image_processor": IMAGE_PROCESSOR,
        },
    }

    def model_config(
        self, text_config: Mapping[str, Any], ids: Mapping[str, int], vocab_size: int
    ) -> dict:
        text = {
            "model_type": "gemma4_text",
            "hidden_size": text_config["hidden_size"],
            "num_hidden_layers": 2,
            "intermediate_size": text_config["intermediate_size"],
            "num_attention_heads": text_config["num_attention_heads"],
            "num_key_value_heads": text_config["num_key_value_heads"],
            "head_dim": text_config["head_dim"],
            "global_head_dim": text_config["head_dim"],
            "sliding_window": text_config["sliding_window"],
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {
                "full_attention": {
                    "partial_rotary_factor": 0.25,
                    "rope_theta": 1000000.0,
                    "rope_type": "proportional",
                },
                "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
            },
            "hidden_size_per_layer_input": PER_LAYER_WIDTH,
            "vocab_size_per_layer_input": vocab_size,
            "num_kv_shared_layers": 0,
            "use_double_wide_mlp": False,
            "final_logit_softcapping": 30.0,
            "rms_norm_eps": 1e-6,
            "hidden_activation": "gelu_pytorch_tanh",
            "max_position_embeddings": text_config["max_position_embeddings"],
            "vocab_size": vocab_size,
            "tie_word_embeddings": True,
            **{k: text_config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")},
        }
        return {
            "text_config": text,
            "vision_config": dict(VISION_CONFIG),
            "audio_config": None,
            "image_token_id": ids[IMAGE_TOKEN],
            "boi_token_id": ids[BOI_TOKEN],
            "eoi_token_id": ids[EOI_TOKEN],
            "video_token_id": ids[VIDEO_TOKEN],
            "audio_token_id": ids[AUDIO_TOKEN],
            "boa_token_id": ids[BOA_TOKEN],
            "eoa_token_id": ids[EOA_TOKEN],
            "vision_soft_tokens_per_image": MAX_SOFT_TOKENS,
            "hidden_size": text_config["hidden_size"],
            "vocab_size": vocab_size,
            **parts.special_token_ids(ids),
            "tie_word_embeddings": True,
        }

    def text_weights(self, weights: dict, text_config: Mapping[str, Any]) -> dict:
        """The text demo's token embeddings; every other text weight random, shaped as
        mlx-lm's and mlx-vlm's gemma4_text hold them (Gemma 4's norms scale by their weight:
        ones are the unit norm)."""
        import numpy as np

        rng = np.random.default_rng(0x6E4)
        embed = weights["language_model.model.embed_tokens.weight"]
        vocab, hidden = embed.shape
        heads, kv = text_config["num_attention_heads"], text_config["num_key_value_heads"]
        head_dim, mlp = text_config["head_dim"], text_config["intermediate_size"]
        layers, width = 2, PER_LAYER_WIDTH
        model = "language_model.model"
        out: dict[str, Any] = {f"{model}.embed_tokens.weight": embed}
        scaled_rms = float(np.sqrt(np.mean(embed**2))) * math.sqrt(hidden)
        ones = {f"{model}.norm.weight": hidden, f"{model}.per_layer_projection_norm.weight": width}
        for i in range(layers):
            layer = f"{model}.layers.{i}"
            for shape, name in (
                ((heads * head_dim, hidden), "self_attn.q_proj"),
                ((kv * head_dim, hidden), "self_attn.k_proj"),
                ((kv * head_dim, hidden), "self_attn.v_proj"),
                ((hidden, heads * head_dim), "self_attn.o_proj"),
                ((mlp, hidden), "mlp.gate_proj"),
                ((mlp, hidden), "mlp.up_proj"),
                ((hidden, mlp), "mlp.down_proj"),
                ((width, hidden), "per_layer_input_gate"),
                ((hidden, width), "per_layer_projection"),
            ):
                gain = 0.5 if name.endswith(("o_proj", "down_proj", "per_layer_projection")) else 1
                out |= parts.random_linear(rng, f"{layer}.{name}", *shape, gain=gain, bias=False)
            ones |= {f"{layer}.self_attn.{n}.weight": head_dim for n in ("q_norm", "k_norm")}
            for norm in ("input_layernorm", "pre_feedforward_layernorm"):
                ones[f"{layer}.{norm}.weight"] = hidden
            # The blocks' outputs (normed) at LOUD times the scaled embeddings' RMS: the
            # layers, not the residual token, decide the next token.
            for norm in ("post_attention_layernorm", "post_feedforward_layernorm"):
                out[f"{layer}.{norm}.weight"] = np.full(hidden, LOUD * scaled_rms)
            out[f"{layer}.post_per_layer_input_norm.weight"] = np.full(hidden, scaled_rms)
            out[f"{layer}.layer_scalar"] = np.ones(1)
        out |= {name: np.ones(size) for name, size in ones.items()}
        out[f"{model}.embed_tokens_per_layer.weight"] = rng.standard_normal(
            (vocab, layers * width)
        ) / math.sqrt(width)
        out |= parts.random_linear(
            rng, f"{model}.per_layer_model_projection", layers * width, hidden, bias=False
        )
        return out

    def vision_weights(self, config: Mapping[str, Any], feature_rms: float, rng) -> dict:
        """Random Gemma 4 ViT and embedder weights, shaped as mlx-vlm's Gemma 4 holds them.

        The embedder normalises the pooled features (no scale) before its projection, which
        is scaled so the image tokens come out with RMS `feature_rms` * sqrt(hidden): the
        text embeddings' as the language model takes them in."""
        import numpy as np

        vision = config["vision_config"]
        width, mlp = vision["hidden_size"], vision["intermediate_size"]
        head_dim = vision["head_dim"]
        tower = "vision_tower"
        patch_in = 3 * vision["patch_size"] ** 2
        out = parts.random_linear(
            rng, f"{tower}.patch_embedder.input_proj", width, patch_in, bias=False
        )
        out[f"{tower}.patch_embedder.position_embedding_table"] = (
            rng.standard_normal((2, vision["position_embedding_size"], width)) * 0.5
        )
        for i in range(vision["num_hidden_layers"]):
            layer = f"{tower}.encoder.layers.{i}"
            for shape, name in (
                ((width, width), "self_attn.q_proj"),
                ((width, width), "self_attn.k_proj"),
                ((width, width), "self_attn.v_proj"),
                ((width, width), "self_attn.o_proj"),
                ((mlp, width), "mlp.gate_proj"),
                ((mlp, width), "mlp.up_proj"),
                ((width, mlp), "mlp.down_proj"),
            ):
                gain = 0.5 if name.endswith(("o_proj", "down_proj")) else 1
                out |= parts.random_linear(
                    rng, f"{layer}.{name}.linear", *shape, gain=gain, bias=False
                )
            for norm in ("q_norm", "k_norm"):
                out[f"{layer}.self_attn.{norm}.weight"] = np.ones(head_dim)
            for norm in (
                "input_layernorm",
                "post_attention_layernorm",
                "pre_feedforward_layernorm",
                "post_feedforward_layernorm",
            ):
                out[f"{layer}.{norm}.weight"] = np.ones(width)
        hidden = config["text_config"]["hidden_size"]
        out["embed_vision.embedding_projection.weight"] = rng.standard_normal((hidden, width)) * (
            feature_rms * math.sqrt(hidden / width)
        )
        return out


FAMILY = Gemma4()
