"""A vision-language model of real shape with random weights, for bench/images.py.

    python bench/vlm_shape.py                     # builds (first use) and prints its directory
    python bench/vlm_shape.py --image-size 448    # a costlier vision pass
    python bench/vlm_shape.py --bits 4            # 4-bit language model (mlx_vlm.convert)
    python bench/vlm_shape.py --family qwen3_vl   # Qwen3-VL-2B's shape instead
    python bench/vlm_shape.py --family qwen3_vl --image-tokens 1024   # larger images

Its outputs are noise; its speed is a real model's. Two shapes (`--family`): gemma3 (the
default, `--model shape` in bench/images.py) and qwen3_vl (`--model shape-qwen3_vl`).

**gemma3.** The files take the gemma3 demo VLM's
(`servicer.demos.gemma3`) as template: the same model type (mlx-vlm's `gemma3`, which
mlx-lm also loads as its text model), chat template, image tokens and processor files, at
these sizes:

- language model: google/gemma-3-1b's text stack (hidden 1152, 26 layers, 4 query heads and
  1 KV head of 256, MLP 6912, sliding window 512 on 5 layers of every 6, a 262,144-token
  vocabulary with tied embeddings): about 1.0 billion parameters;
- vision tower: Gemma 3's SigLIP (so400m: hidden 1152, 27 layers, 16 heads, MLP 4304,
  14-pixel patches) at `--image-size` pixels (default 224, not Gemma 3's 896: one encoder
  pass at 896 takes minutes on the 2-core CPU, at 448 ~21 s, at 224 ~3.6 s), average-pooled
  to Gemma 3's 256 image tokens per image whatever the size (224: 16x16 patches, pool 1;
  448: pool 2; 896: pool 4), so the language model's prefill of an image is the real one.

The tokenizer is the demo's (512 byte-level BPE tokens, its special tokens and the image
tokens at 512-514), its vocabulary padded to 262,144 with tokens `Ġw515` ... that no text
encodes to (they decode to " w515" ...), so the embedding and the LM head have the real
model's size and any sampled id decodes.

Weights are float32 by default: on this CPU (MLX's CPU backend, OpenBLAS preloaded) a
4-bit matmul of 256 rows by 1152x6912 takes ~1.8 s against ~0.04 s in float32 (and bf16
~0.8 s), so a 4-bit model's image prefill would take minutes. `--bits 4` quantizes the
language model with `python -m mlx_vlm.convert -q` (the vision tower stays float32, as
mlx-vlm's convert leaves it) for machines where 4-bit is fast (Metal, CUDA).

**qwen3_vl.** The files take the qwen3_vl demo VLM's (`servicer.demos.qwen3_vl`) as
template: mlx-vlm's `qwen3_vl` model type, its chat template, vision tokens
(`<|vision_start|><|image_pad|><|vision_end|>` per image, the pad repeated once per merged
token) and Qwen2-VL image processor files (16-pixel patches, 2x2 merge, 0.5 normalisation), at
Qwen/Qwen3-VL-2B-Instruct's sizes:

- language model: Qwen3 (hidden 2048, 28 layers, 16 query heads and 8 KV heads of 128, query
  and key RMSNorms, MLP 6144, a 151,936-token vocabulary with tied embeddings, rope_theta 5e6,
  multimodal RoPE with mrope_section [24, 20, 20] interleaved, context 262,144): about 1.7
  billion parameters;
- vision tower: depth 24, hidden 1024, 16 heads, MLP 4096, 16-pixel patches over 2 frames
  (temporal patch 2), a 48x48 learned position table (2304) interpolated to each image's grid,
  2x2 spatial merge into the text's 2048, deepstack mergers after blocks 5, 11 and 17 (their
  features added after the first three text layers): about 0.4 billion parameters;
- images: every image is resized to about `--image-tokens` merged tokens (default 256, one
  per 32x32 pixels: min_pixels = max_pixels = 256 x 32 x 32 in the processor configs, so a
  320x240 PNG becomes 448x608, 266 tokens, 1,064 patches through the tower). The real
  processor keeps an image between 64 and 16,384 tokens (its own size, within those bounds);
  the pinned count makes every image cost the same, as Gemma 3's fixed 256 do, and keeps the
  vision pass affordable on the 2-core CPU. Change it with `--image-tokens` (a new build).

The tokenizer is the qwen3_vl demo's (512 byte-level BPE tokens, its special tokens, the
vision tokens at 512-516) padded to 151,936 ids as the gemma3 one is. float32 by default;
`--bits 4` as for gemma3 (the vision tower stays float32). About 8.5 GB in float32.

Cached under ~/.cache/mlx-grpc-worker/bench-vlm-shape/ (MLX_GRPC_WORKER_CACHE moves the
root), one directory per (family, image size or tokens, bits, recipe version), built behind a
lock file.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _checkout  # noqa: F401  (before any `servicer` import)

from servicer.demos.common import build_atomically, cached_build, default_cache_dir

# Bump whenever anything that changes the built files changes.
RECIPE_VERSION = "v1"
SEED = 0
VOCAB_SIZE = 262_144  # gemma-3-1b's (the 4B's is 262,208)
MM_TOKENS_PER_IMAGE = 256
PATCH_SIZE = 14
TEXT_SHAPE: dict[str, Any] = {
    "model_type": "gemma3_text",
    "hidden_size": 1152,
    "num_hidden_layers": 26,
    "intermediate_size": 6912,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "query_pre_attn_scalar": 256,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "max_position_embeddings": 32768,
    "rope_theta": 1_000_000.0,
    "rope_global_base_freq": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "rms_norm_eps": 1e-6,
    "hidden_activation": "gelu_pytorch_tanh",
    "tie_word_embeddings": True,
}
VISION_SHAPE: dict[str, Any] = {
    "model_type": "siglip_vision_model",
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_channels": 3,
    "patch_size": PATCH_SIZE,
    "layer_norm_eps": 1e-6,
    "vision_use_head": False,
}
# Copied from the demo as they are (the processor files are rewritten for the image size).
TEMPLATE_FILES = ("chat_template.json", "generation_config.json", "special_tokens_map.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "preprocessor_config.json")


FAMILIES = ("gemma3", "qwen3_vl")
DEFAULT_FAMILY = "gemma3"

# qwen3_vl: Qwen/Qwen3-VL-2B-Instruct's sizes. Bump its version whenever its files change.
QWEN_RECIPE_VERSION = "v1"
QWEN_VOCAB_SIZE = 151_936
QWEN_IMAGE_TOKENS = 256  # per image, by default (the processor's min_pixels = max_pixels)
QWEN_TOKEN_PIXELS = 32  # the side of one merged token: 16-pixel patches, 2x2 merge
QWEN_TEXT_SHAPE: dict[str, Any] = {
    "model_type": "qwen3_vl_text",
    "hidden_size": 2048,
    "num_hidden_layers": 28,
    "intermediate_size": 6144,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 262_144,
    "rope_theta": 5_000_000.0,
    "rope_scaling": {
        "rope_type": "default",
        "mrope_section": [24, 20, 20],
        "mrope_interleaved": True,
    },
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "attention_bias": False,
    "tie_word_embeddings": True,
}
QWEN_VISION_SHAPE: dict[str, Any] = {
    "model_type": "qwen3_vl",
    "depth": 24,
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_heads": 16,
    "in_channels": 3,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "out_hidden_size": 2048,
    "num_position_embeddings": 2304,
    "deepstack_visual_indexes": [5, 11, 17],
    "hidden_act": "gelu_pytorch_tanh",
    "initializer_range": 0.02,
}
# Rewritten for the image tokens (the others are copied as TEMPLATE_FILES are).
QWEN_PROCESSOR_FILES = (
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "processor_config.json",
)


def template_path(family: str = DEFAULT_FAMILY) -> Path:
    from servicer.demos.vision import demo_vlm_path

    return demo_vlm_path(family=family)


def is_finished(path: Path) -> bool:
    return path.is_dir() and all((path / name).is_file() for name in REQUIRED_FILES)


def vlm_shape_path(
    image_size: int = 224,
    bits: int = 0,
    cache_dir: Path | None = None,
    family: str = DEFAULT_FAMILY,
    image_tokens: int = QWEN_IMAGE_TOKENS,
) -> Path:
    """The cached model of real shape, built on first use: gemma3 (a minute or two, ~5.7 GB;
    `image_size` its vision input) or qwen3_vl (a few minutes, ~8.5 GB; `image_tokens` each
    image's merged tokens)."""
    if family == "qwen3_vl":
        return qwen3_vl_shape_path(image_tokens, bits, cache_dir)
    if family != "gemma3":
        raise SystemExit(f"unknown shape family {family!r}: {', '.join(FAMILIES)}")
    side = math.isqrt(MM_TOKENS_PER_IMAGE)
    if image_size % (PATCH_SIZE * side):
        raise SystemExit(f"--image-size must be a multiple of {PATCH_SIZE * side} (224, 448, 896)")
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    name = f"gemma3-1b-siglip{image_size}-{'f32' if not bits else f'q{bits}'}-{RECIPE_VERSION}"
    target = root / "bench-vlm-shape" / name

    def build(path: Path) -> Path:
        if not bits:
            return build_atomically(path, is_finished, lambda t: _build(t, image_size), name)
        source = vlm_shape_path(image_size, 0, cache_dir)
        return build_atomically(path, is_finished, lambda t: _quantize(source, t, bits), name)

    return cached_build(target, is_finished, build, f"the real-shape VLM {name}")


def qwen3_vl_shape_path(
    image_tokens: int = QWEN_IMAGE_TOKENS, bits: int = 0, cache_dir: Path | None = None
) -> Path:
    """The cached Qwen3-VL-2B-shaped model, built on first use (a few minutes, ~8.5 GB)."""
    if image_tokens < 4:
        raise SystemExit("--image-tokens must be at least 4 (the processor's smallest image)")
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    precision = "f32" if not bits else f"q{bits}"
    name = f"qwen3-vl-2b-{image_tokens}tok-{precision}-{QWEN_RECIPE_VERSION}"
    target = root / "bench-vlm-shape" / name

    def build(path: Path) -> Path:
        if not bits:
            return build_atomically(
                path, is_finished, lambda t: _build_qwen3_vl(t, image_tokens), name
            )
        source = qwen3_vl_shape_path(image_tokens, 0, cache_dir)
        keep = (*TOKENIZER_FILES, *TEMPLATE_FILES, *QWEN_PROCESSOR_FILES)
        return build_atomically(path, is_finished, lambda t: _quantize(source, t, bits, keep), name)

    return cached_build(target, is_finished, build, f"the real-shape VLM {name}")


def model_config(template: dict[str, Any], image_size: int) -> dict[str, Any]:
    layers = TEXT_SHAPE["num_hidden_layers"]
    pattern = TEXT_SHAPE["sliding_window_pattern"]
    kinds = [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)
    ]
    ids = {
        key: template[key] for key in ("boi_token_index", "eoi_token_index", "image_token_index")
    }
    specials = {key: template[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
    return {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "text_config": {
            **TEXT_SHAPE,
            "layer_types": kinds,
            "vocab_size": VOCAB_SIZE,
            "mm_tokens_per_image": MM_TOKENS_PER_IMAGE,
            **specials,
        },
        "vision_config": {**VISION_SHAPE, "image_size": image_size},
        "mm_tokens_per_image": MM_TOKENS_PER_IMAGE,
        **ids,
        "hidden_size": TEXT_SHAPE["hidden_size"],
        "vocab_size": VOCAB_SIZE,
        **specials,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "bench_build": {"kind": "vlm-shape", "seed": SEED, "version": RECIPE_VERSION},
    }


def _shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every weight's name and shape as mlx-vlm's Gemma 3 holds them (MLX's layouts)."""
    t, v = config["text_config"], config["vision_config"]
    hidden, mlp, head = t["hidden_size"], t["intermediate_size"], t["head_dim"]
    q, kv = t["num_attention_heads"] * head, t["num_key_value_heads"] * head
    shapes: dict[str, tuple[int, ...]] = {
        "language_model.model.embed_tokens.weight": (t["vocab_size"], hidden),
        "language_model.model.norm.weight": (hidden,),
    }
    for i in range(t["num_hidden_layers"]):
        p = f"language_model.model.layers.{i}."
        for norm in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
            shapes[f"{p}{norm}_layernorm.weight"] = (hidden,)
        shapes |= {
            f"{p}self_attn.q_proj.weight": (q, hidden),
            f"{p}self_attn.k_proj.weight": (kv, hidden),
            f"{p}self_attn.v_proj.weight": (kv, hidden),
            f"{p}self_attn.o_proj.weight": (hidden, q),
            f"{p}self_attn.q_norm.weight": (head,),
            f"{p}self_attn.k_norm.weight": (head,),
            f"{p}mlp.gate_proj.weight": (mlp, hidden),
            f"{p}mlp.up_proj.weight": (mlp, hidden),
            f"{p}mlp.down_proj.weight": (hidden, mlp),
        }
    width, vmlp, patch = v["hidden_size"], v["intermediate_size"], v["patch_size"]
    tower = "vision_tower.vision_model."
    shapes |= {
        f"{tower}embeddings.patch_embedding.weight": (width, patch, patch, v["num_channels"]),
        f"{tower}embeddings.patch_embedding.bias": (width,),
        f"{tower}embeddings.position_embedding.weight": ((v["image_size"] // patch) ** 2, width),
        f"{tower}post_layernorm.weight": (width,),
        f"{tower}post_layernorm.bias": (width,),
    }
    for i in range(v["num_hidden_layers"]):
        p = f"{tower}encoder.layers.{i}."
        for norm in ("layer_norm1", "layer_norm2"):
            shapes[f"{p}{norm}.weight"] = (width,)
            shapes[f"{p}{norm}.bias"] = (width,)
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            shapes[f"{p}self_attn.{proj}.weight"] = (width, width)
            shapes[f"{p}self_attn.{proj}.bias"] = (width,)
        shapes |= {
            f"{p}mlp.fc1.weight": (vmlp, width),
            f"{p}mlp.fc1.bias": (vmlp,),
            f"{p}mlp.fc2.weight": (width, vmlp),
            f"{p}mlp.fc2.bias": (width,),
        }
    shapes["multi_modal_projector.mm_soft_emb_norm.weight"] = (width,)
    shapes["multi_modal_projector.mm_input_projection_weight"] = (width, hidden)
    return shapes


def _random(name: str, shape: tuple[int, ...]) -> Any:
    """Unit-scale activations: linear weights N(0, 1/fan_in), small biases, unit norms
    (Gemma's RMSNorm scales by 1 + weight: zeros; SigLIP's LayerNorm: ones and zeros)."""
    import mlx.core as mx

    if name.endswith("layernorm.weight") or name.endswith("_norm.weight"):
        if name.startswith("vision_tower"):
            return mx.ones(shape)
        return mx.zeros(shape)
    if name.endswith(".bias"):
        return mx.random.normal(shape) * 0.02
    if name.endswith("embed_tokens.weight"):
        return mx.random.normal(shape) * (1 / math.sqrt(shape[1]))
    if name.endswith("position_embedding.weight"):
        return mx.random.normal(shape) * 0.5
    fan_in = math.prod(shape[1:])
    return mx.random.normal(shape) * (1 / math.sqrt(fan_in))


def padded_tokenizer(template: Path, vocab_size: int) -> dict[str, Any]:
    """The demo's tokenizer.json with its BPE vocabulary padded to `vocab_size` ids."""
    data = json.loads((template / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    # Added tokens the BPE vocabulary lacks get ids after its last on loading, whatever the
    # file says: put them in it, at their ids.
    for token in data["added_tokens"]:
        vocab.setdefault(token["content"], token["id"])
    taken = set(vocab.values())
    for index in range(vocab_size):
        if index not in taken:
            vocab[f"Ġw{index}"] = index
    return data


def _build(out: Path, image_size: int) -> None:
    import mlx.core as mx

    template = template_path()
    config = model_config(json.loads((template / "config.json").read_text()), image_size)
    mx.random.seed(SEED)
    weights = {name: _random(name, shape) for name, shape in _shapes(config).items()}
    mx.eval(weights)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    del weights
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in TEMPLATE_FILES:
        shutil.copy(template / name, out / name)
    (out / "tokenizer.json").write_text(json.dumps(padded_tokenizer(template, VOCAB_SIZE)))
    tokenizer_config = json.loads((template / "tokenizer_config.json").read_text())
    tokenizer_config["model_max_length"] = TEXT_SHAPE["max_position_embeddings"]
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    pre = json.loads((template / "preprocessor_config.json").read_text())
    pre["size"] = {"height": image_size, "width": image_size}
    pre["image_seq_length"] = MM_TOKENS_PER_IMAGE
    (out / "preprocessor_config.json").write_text(json.dumps(pre, indent=2) + "\n")
    processor = json.loads((template / "processor_config.json").read_text())
    processor["image_seq_length"] = MM_TOKENS_PER_IMAGE
    (out / "processor_config.json").write_text(json.dumps(processor, indent=2) + "\n")


def qwen3_vl_config(template: dict[str, Any]) -> dict[str, Any]:
    """config.json: the demo's token ids, Qwen3-VL-2B's sizes."""
    ids = {
        key: template[key]
        for key in (
            "image_token_id",
            "video_token_id",
            "vision_start_token_id",
            "vision_end_token_id",
        )
    }
    specials = {key: template[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
    return {
        "architectures": ["Qwen3VLForConditionalGeneration"],
        "model_type": "qwen3_vl",
        "text_config": {**QWEN_TEXT_SHAPE, "vocab_size": QWEN_VOCAB_SIZE, **specials},
        "vision_config": dict(QWEN_VISION_SHAPE),
        **ids,
        "vocab_size": QWEN_VOCAB_SIZE,
        **specials,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "bench_build": {"kind": "vlm-shape", "seed": SEED, "version": QWEN_RECIPE_VERSION},
    }


def _qwen3_vl_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every weight's name and shape as mlx-vlm's Qwen3-VL holds them (MLX's layouts: the
    patch embedding's Conv3d channels last), as the qwen3_vl demo names them."""
    t, v = config["text_config"], config["vision_config"]
    hidden, mlp, head = t["hidden_size"], t["intermediate_size"], t["head_dim"]
    q, kv = t["num_attention_heads"] * head, t["num_key_value_heads"] * head
    shapes: dict[str, tuple[int, ...]] = {
        "language_model.model.embed_tokens.weight": (t["vocab_size"], hidden),
        "language_model.model.norm.weight": (hidden,),
    }
    for i in range(t["num_hidden_layers"]):
        p = f"language_model.model.layers.{i}."
        shapes |= {
            f"{p}input_layernorm.weight": (hidden,),
            f"{p}post_attention_layernorm.weight": (hidden,),
            f"{p}self_attn.q_proj.weight": (q, hidden),
            f"{p}self_attn.k_proj.weight": (kv, hidden),
            f"{p}self_attn.v_proj.weight": (kv, hidden),
            f"{p}self_attn.o_proj.weight": (hidden, q),
            f"{p}self_attn.q_norm.weight": (head,),
            f"{p}self_attn.k_norm.weight": (head,),
            f"{p}mlp.gate_proj.weight": (mlp, hidden),
            f"{p}mlp.up_proj.weight": (mlp, hidden),
            f"{p}mlp.down_proj.weight": (hidden, mlp),
        }
    width, vmlp, patch = v["hidden_size"], v["intermediate_size"], v["patch_size"]
    merged = width * v["spatial_merge_size"] ** 2
    tower = "vision_tower."
    shapes |= {
        f"{tower}patch_embed.proj.weight": (
            width,
            v["temporal_patch_size"],
            patch,
            patch,
            v["in_channels"],
        ),
        f"{tower}patch_embed.proj.bias": (width,),
        f"{tower}pos_embed.weight": (v["num_position_embeddings"], width),
    }
    for i in range(v["depth"]):
        p = f"{tower}blocks.{i}."
        for norm in ("norm1", "norm2"):
            shapes[f"{p}{norm}.weight"] = (width,)
            shapes[f"{p}{norm}.bias"] = (width,)
        shapes |= {
            f"{p}attn.qkv.weight": (3 * width, width),
            f"{p}attn.qkv.bias": (3 * width,),
            f"{p}attn.proj.weight": (width, width),
            f"{p}attn.proj.bias": (width,),
            f"{p}mlp.linear_fc1.weight": (vmlp, width),
            f"{p}mlp.linear_fc1.bias": (vmlp,),
            f"{p}mlp.linear_fc2.weight": (width, vmlp),
            f"{p}mlp.linear_fc2.bias": (width,),
        }
    # The merger normalises each patch before the 2x2 shuffle, the deepstack mergers after it.
    mergers = [(f"{tower}merger.", width)]
    mergers += [
        (f"{tower}deepstack_merger_list.{i}.", merged)
        for i in range(len(v["deepstack_visual_indexes"]))
    ]
    for p, norm in mergers:
        shapes |= {
            f"{p}norm.weight": (norm,),
            f"{p}norm.bias": (norm,),
            f"{p}linear_fc1.weight": (merged, merged),
            f"{p}linear_fc1.bias": (merged,),
            f"{p}linear_fc2.weight": (t["hidden_size"], merged),
            f"{p}linear_fc2.bias": (t["hidden_size"],),
        }
    return shapes


def _random_qwen3_vl(name: str, shape: tuple[int, ...]) -> Any:
    """Unit-scale activations: linear weights N(0, 1/fan_in), small biases, unit norms (Qwen3's
    RMSNorm scales by its weight: ones; the tower's LayerNorms: ones and zeros)."""
    import mlx.core as mx

    is_norm = ".norm" in name or "layernorm" in name or name.endswith("_norm.weight")
    if is_norm:
        return mx.zeros(shape) if name.endswith(".bias") else mx.ones(shape)
    if name.endswith(".bias"):
        return mx.random.normal(shape) * 0.02
    if name.endswith("embed_tokens.weight"):
        return mx.random.normal(shape) * (1 / math.sqrt(shape[1]))
    if name.endswith("pos_embed.weight"):
        return mx.random.normal(shape) * 0.5
    fan_in = math.prod(shape[1:])
    return mx.random.normal(shape) * (1 / math.sqrt(fan_in))


def qwen3_vl_processor_files(template: Path, image_tokens: int) -> dict[str, dict[str, Any]]:
    """The demo's processor configs with every image pinned to about `image_tokens` merged
    tokens (min_pixels = max_pixels)."""
    pixels = image_tokens * QWEN_TOKEN_PIXELS**2
    out = {}
    for name in QWEN_PROCESSOR_FILES:
        content = json.loads((template / name).read_text())
        if "max_pixels" in content:
            content |= {"min_pixels": pixels, "max_pixels": pixels}
            content["size"] = {"shortest_edge": pixels, "longest_edge": pixels}
        out[name] = content
    return out


def _build_qwen3_vl(out: Path, image_tokens: int) -> None:
    import mlx.core as mx

    template = template_path("qwen3_vl")
    config = qwen3_vl_config(json.loads((template / "config.json").read_text()))
    mx.random.seed(SEED)
    weights = {}
    for name, shape in _qwen3_vl_shapes(config).items():
        weights[name] = _random_qwen3_vl(name, shape)
        mx.eval(weights[name])  # one at a time: no temporaries of the whole model at once
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    del weights
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in TEMPLATE_FILES:
        shutil.copy(template / name, out / name)
    (out / "tokenizer.json").write_text(json.dumps(padded_tokenizer(template, QWEN_VOCAB_SIZE)))
    tokenizer_config = json.loads((template / "tokenizer_config.json").read_text())
    tokenizer_config["model_max_length"] = QWEN_TEXT_SHAPE["max_position_embeddings"]
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    for name, content in qwen3_vl_processor_files(template, image_tokens).items():
        (out / name).write_text(json.dumps(content, indent=2) + "\n")


def _quantize(
    source: Path,
    out: Path,
    bits: int,
    keep: tuple[str, ...] = (*TOKENIZER_FILES, *TEMPLATE_FILES),
) -> None:
    """mlx-vlm's own convert, `-q`, into `out` (a fresh temporary directory); the `keep`
    files the convert did not write copied from `source`."""
    with tempfile.TemporaryDirectory(dir=out.parent) as scratch:
        converted = Path(scratch) / "q"
        command = [sys.executable, "-m", "mlx_vlm.convert", "--hf-path", str(source)]
        command += ["--mlx-path", str(converted), "-q", "--q-bits", str(bits)]
        subprocess.run(command, check=True)
        for item in converted.iterdir():
            shutil.move(str(item), out / item.name)
    for name in keep:
        if not (out / name).exists():
            shutil.copy(source / name, out / name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default=DEFAULT_FAMILY, choices=FAMILIES)
    parser.add_argument(
        "--image-size", type=int, default=224, help="gemma3: 224 (default), 448, 896"
    )
    parser.add_argument(
        "--image-tokens",
        type=int,
        default=QWEN_IMAGE_TOKENS,
        help=f"qwen3_vl: merged tokens per image (default {QWEN_IMAGE_TOKENS})",
    )
    parser.add_argument("--bits", type=int, default=0, help="0: float32 (default); 4, 8")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    print(vlm_shape_path(args.image_size, args.bits, None, args.family, args.image_tokens))
    print(f"ready in {time.perf_counter() - started:.1f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
