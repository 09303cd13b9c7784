"""Tiny vision-language demo checkpoints in mlx-vlm's on-disk format, built locally from a seed.

The vision counterpart of ``demo_model``: tests and ``demo:vlm`` need a real vision-language
model but must never download one. The families share one build (``Family`` says what
differs): ``qwen2_vl`` (the default, below), ``gemma3`` (``servicer.demo_vlm_gemma3``,
built from the ``gemma3`` text demo), ``mistral3`` (``servicer.demo_vlm_mistral3``, from
the ``llama`` one), ``llava`` (``servicer.demo_vlm_llava``, from the ``llama`` one too)
and ``qwen2_5_vl`` (``servicer.demo_vlm_qwen2_5``: this family's text stack, tokens and
processor with Qwen2.5-VL's vision tower); gemma3, mistral3 and llava also load as text
models with mlx-lm.

The default family is ``qwen2_vl``: mlx-vlm serves it, and the smg router's own
preprocessor knows it by ``model_type`` whatever the served name is (a name like
``demo:vlm`` included; qwen2_5_vl it would only know by a name holding "qwen" and "vl").
The router preprocesses qwen2_vl itself (``mm_inputs``) even when workers advertise an
``mm_processor``: its anchor is not one it leaves to a worker (../shared/DESIGN.md).

What is built for it (nothing is trained here):

- the language model is the ``llama`` demo model's trained weights (``demo_model``) moved
  into Qwen2-VL's text stack: the same sizes, RMSNorm, SwiGLU, tied embeddings, and rotary
  embeddings that multimodal RoPE reduces to for text positions; the q/k/v biases Qwen2
  has and llama lacks are zeros. So greedy text is as varied as the text demo's.
- the tokenizer is that model's, with the family's vision tokens appended as special
  tokens (``<|vision_start|>``, ``<|vision_end|>``, ``<|vision_pad|>``, ``<|image_pad|>``,
  ``<|video_pad|>``) and embedding rows for them drawn at the trained rows' scale.
- the vision tower (patch size 14, 2x2 merge, as the real family) is random, from a
  seeded numpy generator, scaled so that its output tokens have the trained text
  embeddings' RMS: the image shifts the continuation without drowning the prompt.

Usage: ``python -m servicer.demo_vlm [--family qwen2_vl] [--seed 0] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import math
import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from servicer import demo_model
from servicer.demo_model import BOS_TOKEN, EOS_TOKEN, MODEL_MAX_LENGTH, PAD_TOKEN

log = logging.getLogger(__name__)

DEMO_VLM_SEED = 0
DEFAULT_FAMILY = "qwen2_vl"
# The families and the modules that describe them (each module's FAMILY).
_FAMILY_MODULES = {
    "qwen2_vl": "servicer.demo_vlm",
    "gemma3": "servicer.demo_vlm_gemma3",
    "mistral3": "servicer.demo_vlm_mistral3",
    "llava": "servicer.demo_vlm_llava",
    "qwen2_5_vl": "servicer.demo_vlm_qwen2_5",
}
FAMILIES = tuple(_FAMILY_MODULES)

MODEL_TYPE = "qwen2_vl"
TEXT_KIND = "llama"  # the demo_model kind whose weights become the language model
# Bump whenever anything that changes the built files changes (configs, tokens, init);
# the text model's own demo_model.RECIPE_VERSION is part of the build name too.
VLM_RECIPE_VERSION = "v2"

VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
VISION_PAD = "<|vision_pad|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
# Appended after the text demo's vocabulary, in this order (Qwen2-VL's own order).
VISION_TOKENS = (VISION_START, VISION_END, VISION_PAD, IMAGE_PAD, VIDEO_PAD)
# What the chat template renders for one image, unexpanded: the processor (mlx-vlm's or
# the router's) repeats IMAGE_PAD once per merged patch.
IMAGE_ANCHOR = VISION_START + IMAGE_PAD + VISION_END


def chat_template(image_anchor: str) -> str:
    """The text demo's template, plus content given as a list of parts (text, image), an
    image part rendering `image_anchor`. Kept as minimal Jinja as the text demo's so the
    router's minijinja renders it identically."""
    return (
        "{{ bos_token }}"
        "{% for message in messages %}"
        "<|{{ message['role'] }}|>"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}"
        "{% if part['type'] == 'text' %}{{ part['text'] }}"
        "{% elif part['type'] == 'image' or part['type'] == 'image_url' %}"
        + image_anchor
        + "{% endif %}"
        "{% endfor %}{% endif %}"
        "<|end|>"
        "{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )


CHAT_TEMPLATE = chat_template(IMAGE_ANCHOR)

# Questions from the demo corpus's chats, asked about an image in the tests.
TEST_PROMPTS: tuple[str, ...] = ("Describe a quiet place.", "What do bees make?")

# The image processor: Qwen2-VL's (CLIP normalisation, 14-pixel patches, 2x2 merge, two
# temporal frames per patch), with pixel bounds kept small: 4 to 64 image tokens.
PATCH_SIZE = 14
MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2
MIN_PIXELS = (PATCH_SIZE * MERGE_SIZE) ** 2 * 4  # 56 x 56
MAX_PIXELS = (PATCH_SIZE * MERGE_SIZE) ** 2 * 64  # 224 x 224
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

# Text sizes come from the text demo's config; these are the vision tower's.
VISION_CONFIG: Mapping[str, Any] = {
    "model_type": MODEL_TYPE,
    "depth": 2,
    "embed_dim": 64,
    "num_heads": 2,
    "mlp_ratio": 2,  # an int: transformers validates Qwen2VLVisionConfig strictly
    "in_channels": 3,
    "in_chans": 3,
    "patch_size": PATCH_SIZE,
    "spatial_patch_size": PATCH_SIZE,
    "spatial_merge_size": MERGE_SIZE,
    "temporal_patch_size": TEMPORAL_PATCH_SIZE,
    "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-6,
}

# Every family's build holds these, and its processor files (Family.processor_files).
_COMMON_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.json",
)
# E[gelu(z)^2] for z ~ N(0, 1): sizes the merger's last layer (see _vision_weights).
_GELU_SECOND_MOMENT = 0.4252


@dataclass(frozen=True)
class Family:
    """What one demo VLM family is made of; the build steps around it are shared."""

    model_type: str  # config.json's, which mlx-vlm (and the router) dispatch on
    text_kind: str  # the demo_model kind whose trained weights become language_model.*
    recipe_version: str  # bump whenever this family's built files change
    vision_tokens: tuple[str, ...]  # special tokens appended to the text vocabulary
    image_anchor: str  # what the chat template renders per image, unexpanded
    image_token: str  # the token the processor repeats, where the image features go
    # How many image tokens one image becomes; None where that depends on its size.
    tokens_per_image: int | None
    # (text demo config, special-token ids, vocabulary size) -> config.json, less the
    # torch_dtype and demo_build fields the build adds.
    model_config: Callable[[Mapping[str, Any], Mapping[str, int], int], dict]
    # (config.json, text embedding RMS, numpy generator) -> vision tower and projector.
    vision_weights: Callable[[Mapping[str, Any], float, Any], dict]
    # File name -> JSON content: the image processor's and processor's configs.
    processor_files: Mapping[str, Mapping[str, Any]]
    # (text demo config) -> weights the text stack has and the text demo lacks.
    extra_text_weights: Callable[[Mapping[str, Any]], dict] = lambda text_config: {}
    # Fields added to tokenizer_config.json.
    tokenizer_fields: Mapping[str, Any] = field(default_factory=dict)

    @property
    def chat_template(self) -> str:
        return chat_template(self.image_anchor)

    @property
    def required_files(self) -> tuple[str, ...]:
        return (*_COMMON_FILES, *self.processor_files)


def get_family(name: str = DEFAULT_FAMILY) -> Family:
    """The `Family` called `name` (its ``model_type``)."""
    try:
        module = _FAMILY_MODULES[name]
    except KeyError:
        raise ValueError(f"unknown demo VLM family {name!r}; known: {list(FAMILIES)}") from None
    return importlib.import_module(module).FAMILY


def build_name(seed: int = DEMO_VLM_SEED, family: str = DEFAULT_FAMILY) -> str:
    """Directory name of a cached build; changes whenever this recipe or the text one does."""
    fam = get_family(family)
    text = f"{fam.text_kind}-{demo_model.RECIPE_VERSION}"
    return f"demo-vlm-{fam.model_type}-s{seed}-{fam.recipe_version}-{text}"


def is_finished_build(path: Path, family: str = DEFAULT_FAMILY) -> bool:
    # Builds appear by atomic rename, so a directory holding every file is complete.
    path, names = Path(path), get_family(family).required_files
    return path.is_dir() and all((path / name).is_file() for name in names)


def build_vlm(
    path: Path,
    seed: int = DEMO_VLM_SEED,
    text_model: Path | None = None,
    family: str = DEFAULT_FAMILY,
) -> Path:
    """Build the demo vision-language model of `family` into directory `path`; return `path`.

    `text_model` is a finished demo build of the family's text kind to take the language
    model from; by default the cached one (built on first use) for the default seed, else
    one built for `seed` in a temporary directory. Like ``demo_model.build_model``: atomic,
    and a finished build at `path` is returned untouched. Needs no network and no mlx-vlm.
    """
    fam = get_family(family)

    def build_into(tmp: Path) -> None:
        if text_model is not None:
            _build_into(tmp, seed, Path(text_model), fam)
        elif seed == demo_model.DEMO_SEED:
            _build_into(tmp, seed, demo_model.demo_model_path(fam.text_kind), fam)
        else:
            text_dir = tmp / ".text"
            demo_model.build_model(text_dir, fam.text_kind, seed)
            _build_into(tmp, seed, text_dir, fam)
            shutil.rmtree(text_dir)

    def finished(target: Path) -> bool:
        return is_finished_build(target, family)

    return demo_model.build_atomically(path, finished, build_into, f"demo VLM ({family})")


def demo_vlm_path(cache_dir: Path | None = None, family: str = DEFAULT_FAMILY) -> Path:
    """Path of the cached demo vision-language model of `family`, building it on first use.

    The cache is the text demo's (``MLX_GRPC_WORKER_CACHE`` or ~/.cache/mlx-grpc-worker),
    which also holds the text model it is made from. Safe across processes.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else demo_model.default_cache_dir()
    fam = get_family(family)

    def build(target: Path) -> Path:
        text_model = demo_model.demo_model_path(fam.text_kind, cache_dir)
        return build_vlm(target, DEMO_VLM_SEED, text_model, family)

    return demo_model.cached_build(
        cache_dir / build_name(DEMO_VLM_SEED, family),
        lambda target: is_finished_build(target, family),
        build,
        f"the {family} demo vision-language model",
    )


# --------------------------------------------------------------------------- building


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


def _write_tokenizer(out: Path, text_model: Path, fam: Family) -> tuple[dict[str, int], int]:
    """The text demo's tokenizer with the family's vision tokens appended.

    Returns every special token's id and the vocabulary size."""
    from tokenizers import AddedToken, Tokenizer

    tokenizer = Tokenizer.from_file(str(text_model / "tokenizer.json"))
    base = tokenizer.get_vocab_size()
    vision = fam.vision_tokens
    tokenizer.add_special_tokens([AddedToken(tok, special=True) for tok in vision])
    ids = {tok: tokenizer.token_to_id(tok) for tok in (*demo_model.SPECIAL_TOKENS, *vision)}
    if [ids[tok] for tok in vision] != list(range(base, base + len(vision))):
        raise RuntimeError(f"vision tokens did not get the ids after the text vocabulary: {ids}")
    tokenizer.save(str(out / "tokenizer.json"))
    extra = [*demo_model.SPECIAL_TOKENS[3:], *vision]
    demo_model._write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS_TOKEN,
            "eos_token": EOS_TOKEN,
            "pad_token": PAD_TOKEN,
            "additional_special_tokens": extra,
            "add_bos_token": False,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": MODEL_MAX_LENGTH,
            **fam.tokenizer_fields,
            "chat_template": fam.chat_template,
        },
    )
    demo_model._write_json(
        out / "special_tokens_map.json",
        {
            "bos_token": BOS_TOKEN,
            "eos_token": EOS_TOKEN,
            "pad_token": PAD_TOKEN,
            "additional_special_tokens": extra,
        },
    )
    # mlx-vlm's processors read the template from here.
    demo_model._write_json(out / "chat_template.json", {"chat_template": fam.chat_template})
    return ids, tokenizer.get_vocab_size()


def _image_processor_config() -> dict[str, Any]:
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2VLProcessor",
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_convert_rgb": True,
        "image_mean": list(CLIP_MEAN),
        "image_std": list(CLIP_STD),
        "patch_size": PATCH_SIZE,
        "merge_size": MERGE_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        "min_pixels": MIN_PIXELS,
        "max_pixels": MAX_PIXELS,
        "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
    }


def _model_config(text_config: Mapping[str, Any], ids: Mapping[str, int], vocab_size: int) -> dict:
    heads = text_config["num_attention_heads"]
    head_dim = text_config["hidden_size"] // heads
    if text_config.get("head_dim", head_dim) != head_dim or head_dim % 8:
        raise ValueError("the text model's head_dim must be hidden_size / heads, a multiple of 8")
    # Multimodal RoPE splits the head's frequencies over (t, h, w) as 1/4, 3/8, 3/8 (the
    # real checkpoints' [16, 24, 24] for a 128-wide head).
    quarter = head_dim // 8
    mrope_section = [quarter, (head_dim // 2 - quarter) // 2, (head_dim // 2 - quarter) // 2]
    return {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "model_type": MODEL_TYPE,
        # The language model's fields sit at the top level, as in Qwen2-VL's own config.
        "hidden_size": text_config["hidden_size"],
        "num_hidden_layers": text_config["num_hidden_layers"],
        "intermediate_size": text_config["intermediate_size"],
        "num_attention_heads": heads,
        "num_key_value_heads": text_config["num_key_value_heads"],
        "max_position_embeddings": text_config["max_position_embeddings"],
        "rope_theta": text_config["rope_theta"],
        "rms_norm_eps": text_config["rms_norm_eps"],
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "rope_scaling": {"type": "mrope", "mrope_section": mrope_section},
        "vocab_size": vocab_size,
        "bos_token_id": ids[BOS_TOKEN],
        "eos_token_id": ids[EOS_TOKEN],
        "pad_token_id": ids[PAD_TOKEN],
        "vision_start_token_id": ids[VISION_START],
        "vision_end_token_id": ids[VISION_END],
        "vision_token_id": ids[VISION_PAD],
        "image_token_id": ids[IMAGE_PAD],
        "video_token_id": ids[VIDEO_PAD],
        "vision_config": {**VISION_CONFIG, "hidden_size": text_config["hidden_size"]},
    }


def _qkv_biases(text_config: Mapping[str, Any]) -> dict:
    """Zero q/k/v biases: Qwen2 has them, llama lacks them."""
    import numpy as np

    head_dim = text_config["hidden_size"] // text_config["num_attention_heads"]
    widths = {
        "q_proj": text_config["num_attention_heads"] * head_dim,
        "k_proj": text_config["num_key_value_heads"] * head_dim,
        "v_proj": text_config["num_key_value_heads"] * head_dim,
    }
    return {
        f"language_model.model.layers.{layer}.self_attn.{proj}.bias": np.zeros(width, np.float32)
        for layer in range(text_config["num_hidden_layers"])
        for proj, width in widths.items()
    }


def _text_weights(text_model: Path, hidden: int, vocab: int, rng) -> dict:
    """The text demo's weights under ``language_model.``, with embedding rows for the
    appended tokens drawn at the trained rows' scale."""
    import numpy as np
    from safetensors.numpy import load_file

    # The text demo is float32 (its recipe writes it so): numpy reads it as it is.
    source = load_file(str(text_model / "model.safetensors"))
    out: dict[str, np.ndarray] = {}
    for name, value in source.items():
        if not name.startswith("model."):
            raise ValueError(f"unexpected tensor {name!r} in the text model (tied embeddings?)")
        out[f"language_model.{name}"] = value
    name = "language_model.model.embed_tokens.weight"
    embed = out[name]
    scale = float(np.sqrt(np.mean(embed**2)))
    extra = rng.standard_normal((vocab - embed.shape[0], hidden)) * scale
    out[name] = np.concatenate([embed, extra.astype(np.float32)])
    return out


def _vision_weights(config: Mapping[str, Any], feature_rms: float, rng) -> dict:
    """Random vision tower weights, shaped as mlx-vlm's Qwen2-VL VisionModel holds them.

    Linear layers get N(0, 1/fan_in) weights and small biases, so every activation stays
    near unit scale; the merger's last layer is scaled so the image tokens come out with
    RMS `feature_rms` (the text embeddings'), for post-LayerNorm inputs.
    """
    import numpy as np

    config = config["vision_config"]
    width = config["embed_dim"]
    hidden = config["hidden_size"]
    mlp = int(width * config["mlp_ratio"])
    merged = width * config["spatial_merge_size"] ** 2
    out: dict[str, Any] = patch_embedding(rng, config, width)
    for block in range(config["depth"]):
        prefix = f"vision_tower.blocks.{block}"
        out |= unit_layer_norm(f"{prefix}.norm1", width)
        out |= unit_layer_norm(f"{prefix}.norm2", width)
        out |= random_linear(rng, f"{prefix}.attn.qkv", 3 * width, width)
        out |= random_linear(rng, f"{prefix}.attn.proj", width, width, gain=0.5)
        out |= random_linear(rng, f"{prefix}.mlp.fc1", mlp, width)
        out |= random_linear(rng, f"{prefix}.mlp.fc2", width, mlp, gain=0.5)
    out |= unit_layer_norm("vision_tower.merger.ln_q", width)
    out |= random_linear(rng, "vision_tower.merger.mlp.0", merged, merged)
    gain = feature_rms / math.sqrt(_GELU_SECOND_MOMENT)
    out |= random_linear(rng, "vision_tower.merger.mlp.2", hidden, merged, gain=gain)
    return {name: np.asarray(value, np.float32) for name, value in out.items()}


def patch_embedding(rng, vision: Mapping[str, Any], width: int) -> dict[str, Any]:
    """A Qwen-VL tower's patch embedding (a Conv3d without bias) in MLX's layout: (out,
    frames, height, width, in). A patch is the (flattened) normalised pixels, about unit scale,
    so fan-in scaling keeps the output there."""
    patch, frames, channels = (
        vision["patch_size"],
        vision["temporal_patch_size"],
        vision["in_channels"],
    )
    fan_in = frames * patch * patch * channels
    weight = rng.standard_normal((width, frames, patch, patch, channels)) / math.sqrt(fan_in)
    return {"vision_tower.patch_embed.proj.weight": weight}


_VIDEO_PROCESSOR_CONFIG = {
    **{k: v for k, v in _image_processor_config().items() if k != "image_processor_type"},
    "video_processor_type": "Qwen2VLVideoProcessor",
}

FAMILY = Family(
    model_type=MODEL_TYPE,
    text_kind=TEXT_KIND,
    recipe_version=VLM_RECIPE_VERSION,
    vision_tokens=VISION_TOKENS,
    image_anchor=IMAGE_ANCHOR,
    image_token=IMAGE_PAD,
    tokens_per_image=None,  # one per merged 28x28 patch
    model_config=_model_config,
    vision_weights=_vision_weights,
    processor_files={
        "preprocessor_config.json": _image_processor_config(),
        # Present so that mlx-vlm never looks for them on the hub.
        "processor_config.json": {"processor_class": "Qwen2VLProcessor"},
        "video_preprocessor_config.json": _VIDEO_PROCESSOR_CONFIG,
    },
    extra_text_weights=_qkv_biases,
)


def _build_into(out: Path, seed: int, text_model: Path, fam: Family) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    if not demo_model.is_finished_build(text_model):
        raise FileNotFoundError(f"{text_model} is not a finished demo model build")
    text_config = json.loads((text_model / "config.json").read_text(encoding="utf-8"))
    kind = text_config.get("demo_build", {}).get("kind")
    if kind != fam.text_kind or not text_config.get("tie_word_embeddings"):
        raise ValueError(f"{text_model} is not a {fam.text_kind} demo build with tied embeddings")

    ids, vocab_size = _write_tokenizer(out, text_model, fam)
    config = {
        **fam.model_config(text_config, ids, vocab_size),
        "torch_dtype": "float32",
        # Ignored by loaders; records which recipe produced the weights.
        "demo_build": {
            "kind": "vlm",
            "seed": seed,
            "version": fam.recipe_version,
            "text": {"kind": fam.text_kind, "version": demo_model.RECIPE_VERSION},
        },
    }
    text_rng, vision_rng = (
        np.random.default_rng(s) for s in np.random.SeedSequence([seed, 0x71E]).spawn(2)
    )
    weights = _text_weights(text_model, text_config["hidden_size"], vocab_size, text_rng)
    weights |= fam.extra_text_weights(text_config)
    embed = weights["language_model.model.embed_tokens.weight"]
    feature_rms = float(np.sqrt(np.mean(embed**2)))
    weights |= fam.vision_weights(config, feature_rms, vision_rng)
    save_file(
        {name: np.ascontiguousarray(weights[name], dtype=np.float32) for name in sorted(weights)},
        str(out / "model.safetensors"),
        metadata={"format": "mlx"},
    )
    demo_model._write_json(out / "config.json", config)
    demo_model._write_json(
        out / "generation_config.json",
        {
            "bos_token_id": ids[BOS_TOKEN],
            "eos_token_id": ids[EOS_TOKEN],
            "pad_token_id": ids[PAD_TOKEN],
        },
    )
    for name, content in fam.processor_files.items():
        demo_model._write_json(out / name, dict(content))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default=DEFAULT_FAMILY, choices=FAMILIES)
    parser.add_argument("--seed", type=int, default=DEMO_VLM_SEED, help="only with --out")
    parser.add_argument("--out", type=Path, help="build here instead of the shared cache")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    if args.out is not None:
        path = build_vlm(args.out, args.seed, family=args.family)
    else:
        if args.seed != DEMO_VLM_SEED:
            parser.error("--seed needs --out (the cache holds only the default seed)")
        path = demo_vlm_path(family=args.family)
    print(path)
    print(f"ready in {time.perf_counter() - start:.1f}s", file=sys.stderr)


if __name__ == "__main__":
    main()
