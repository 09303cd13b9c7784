"""Tiny vision-language demo checkpoints in mlx-vlm's on-disk format, built locally from a seed.

The vision counterpart of ``servicer.demos.text``: tests and ``demo:vlm`` need a real
vision-language model but must never download one. The families share one build (``Family``
says what differs, each in a module of its own): ``qwen2_vl`` (the default,
``servicer.demos.qwen2_vl``), ``gemma3`` (``servicer.demos.gemma3``, built from the ``gemma3``
text demo), ``mistral3`` (``servicer.demos.mistral3``, from the ``llama`` one), ``llava``
(``servicer.demos.llava``, from the ``llama`` one too), ``qwen2_5_vl``
(``servicer.demos.qwen2_5_vl``: qwen2_vl's text stack, tokens and processor with Qwen2.5-VL's
vision tower), ``pixtral`` (``servicer.demos.pixtral``, from the ``llama`` one) and
``llava_onevision`` (``servicer.demos.llava_onevision``, from the ``llama`` one as Qwen2),
``qwen3_vl`` and ``qwen3_vl_moe`` (``servicer.demos.qwen3_vl``, ``servicer.demos.qwen3_vl_moe``:
the ``llama`` one as Qwen3, its MLPs as experts in the second; deepstack) and ``qwen3_5`` and
``qwen3_5_moe`` (``servicer.demos.qwen3_5``, ``servicer.demos.qwen3_5_moe``: the ``hybrid``
one as Qwen3.5, its MLPs as routed and shared experts in the second);
``glm4v`` and ``glm4v_moe`` (``servicer.demos.glm4v``, ``servicer.demos.glm4v_moe``, from the
``llama`` one in GLM-4's dense and MoE layouts);
gemma3, mistral3, llava and pixtral also load as text models with mlx-lm.

What every family's build is made of (nothing is trained here):

- the language model is a text demo's trained weights (``servicer.demos.text``), moved
  under ``language_model.``, so greedy text is as varied as the text demo's.
- the tokenizer is that model's, with the family's vision tokens appended as special
  tokens and embedding rows for them drawn at the trained rows' scale.
- the vision tower and projector are random, from a seeded numpy generator, scaled so that
  the image tokens enter the language model at the trained text embeddings' RMS: the image
  shifts the continuation without drowning the prompt.

Usage: ``python -m servicer.demos.vision [--family qwen2_vl] [--seed 0] [--out DIR]``.
"""

from __future__ import annotations

import abc
import argparse
import importlib
import json
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

from .. import vision_families
from . import common, text

DEMO_VLM_SEED = 0
DEFAULT_FAMILY = "qwen2_vl"
# The families and the modules that describe them (each module's FAMILY), from the registry.
_FAMILY_MODULES = {name: f"servicer.demos.{f.demo}" for name, f in vision_families.FAMILIES.items()}
FAMILIES = tuple(_FAMILY_MODULES)

# Questions from the demo corpus's chats, asked about an image in the tests.
TEST_PROMPTS: tuple[str, ...] = ("Describe a quiet place.", "What do bees make?")


def chat_template(image_anchor: str, video_anchor: str | None = None) -> str:
    """The text demo's template, plus content given as a list of parts (text, image, video),
    an image part rendering `image_anchor`, a video part `video_anchor` (None: none). Kept as
    minimal Jinja as the text demo's so the router's minijinja renders it identically."""
    video = (
        "{% elif part['type'] == 'video' or part['type'] == 'video_url' %}" + video_anchor
        if video_anchor is not None
        else ""
    )
    return (
        "{{ bos_token }}"
        "{% for message in messages %}"
        "<|{{ message['role'] }}|>"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}"
        "{% if part['type'] == 'text' %}{{ part['text'] }}"
        "{% elif part['type'] == 'image' or part['type'] == 'image_url' %}"
        + image_anchor
        + video
        + "{% endif %}"
        "{% endfor %}{% endif %}"
        "<|end|>"
        "{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )


class Family(abc.ABC):
    """What one demo VLM family is made of: a subclass a family (its module's FAMILY is one),
    what differs in its attributes and methods; the build steps around it are shared."""

    model_type: str  # config.json's, which mlx-vlm (and the router) dispatch on
    architecture: str  # config.json's architectures
    text_kind: str  # the text demo kind whose trained weights become language_model.*
    recipe_version: str  # bump whenever anything that changes this family's built files does
    vision_tokens: tuple[str, ...]  # special tokens appended to the text vocabulary
    image_anchor: str  # what the chat template renders per image, unexpanded
    # What it renders per video (served only where the family's registry entry has a video
    # layout: servicer/vision_families.py).
    video_anchor: str | None = None
    image_token: str  # the token the processor repeats, where the image features go
    # How many image tokens one image becomes; None where that depends on its size.
    tokens_per_image: int | None = None
    # File name -> JSON content: the image processor's and processor's configs.
    processor_files: Mapping[str, Mapping[str, Any]]
    # Fields added to tokenizer_config.json.
    tokenizer_fields: Mapping[str, Any] = MappingProxyType({})
    # The text stack holds its own lm_head (written as a copy of the embeddings).
    untied_head: bool = False

    @abc.abstractmethod
    def model_config(
        self, text_config: Mapping[str, Any], ids: Mapping[str, int], vocab_size: int
    ) -> dict:
        """config.json, less the architectures, model_type, torch_dtype and demo_build
        fields the build adds: from the text demo's config, every special token's id and the
        vocabulary size."""

    @abc.abstractmethod
    def vision_weights(self, config: Mapping[str, Any], feature_rms: float, rng) -> dict:
        """The vision tower's and projector's weights for `config` (config.json), random
        from numpy generator `rng`, scaled so that the image tokens enter the language model
        with RMS `feature_rms` (the text embeddings')."""

    def extra_text_weights(self, text_config: Mapping[str, Any]) -> dict:
        """Weights the family's text stack has and the text demo lacks."""
        return {}

    def adapt_text_weights(self, weights: dict, text_config: Mapping[str, Any], rng) -> dict:
        """The text weights (the text demo's under ``language_model.``, with the extra ones)
        as the family's text stack holds them (some weights split, merged or replaced)."""
        return weights

    def saved_weights(self, weights: dict) -> dict:
        """All the weights (text and vision) under the names the family's checkpoints use."""
        return weights

    def text_weights(self, weights: dict, text_config: Mapping[str, Any]) -> dict:
        """The language model's weights from the text demo's `weights` (moved under
        ``language_model.``, embedding rows for the appended tokens added)."""
        return weights | self.extra_text_weights(text_config)

    @property
    def chat_template(self) -> str:
        served = vision_families.FAMILIES.get(self.model_type)
        video = self.video_anchor if served is not None and served.video else None
        return chat_template(self.image_anchor, video)

    @property
    def required_files(self) -> tuple[str, ...]:
        return (*common.MODEL_FILES, "chat_template.json", *self.processor_files)


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
    text_part = f"{fam.text_kind}-{text.RECIPE_VERSION}"
    return f"demo-vlm-{fam.model_type}-s{seed}-{fam.recipe_version}-{text_part}"


def is_finished_build(path: Path, family: str = DEFAULT_FAMILY) -> bool:
    return common.has_files(path, get_family(family).required_files)


def build_vlm(
    path: Path,
    seed: int = DEMO_VLM_SEED,
    text_model: Path | None = None,
    family: str = DEFAULT_FAMILY,
) -> Path:
    """Build the demo vision-language model of `family` into directory `path`; return `path`.

    `text_model` is a finished demo build of the family's text kind to take the language
    model from; by default the cached one (built on first use) for the default seed, else
    one built for `seed` in a temporary directory. Like ``text.build_model``: atomic, and a
    finished build at `path` is returned untouched. Needs no network and no mlx-vlm.
    """
    fam = get_family(family)

    def build_into(tmp: Path) -> None:
        if text_model is not None:
            _build_into(tmp, seed, Path(text_model), fam)
        elif seed == text.DEMO_SEED:
            _build_into(tmp, seed, text.demo_model_path(fam.text_kind), fam)
        else:
            text_dir = tmp / ".text"
            text.build_model(text_dir, fam.text_kind, seed)
            _build_into(tmp, seed, text_dir, fam)
            shutil.rmtree(text_dir)

    def finished(target: Path) -> bool:
        return is_finished_build(target, family)

    return common.build_atomically(path, finished, build_into, f"demo VLM ({family})")


def demo_vlm_path(cache_dir: Path | None = None, family: str = DEFAULT_FAMILY) -> Path:
    """Path of the cached demo vision-language model of `family`, building it on first use.

    The cache is the text demo's (``MLX_GRPC_WORKER_CACHE`` or ~/.cache/mlx-grpc-worker),
    which also holds the text model it is made from. Safe across processes.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else common.default_cache_dir()
    fam = get_family(family)

    def build(target: Path) -> Path:
        text_model = text.demo_model_path(fam.text_kind, cache_dir)
        return build_vlm(target, DEMO_VLM_SEED, text_model, family)

    return common.cached_build(
        cache_dir / build_name(DEMO_VLM_SEED, family),
        lambda target: is_finished_build(target, family),
        build,
        f"the {family} demo vision-language model",
    )


# --------------------------------------------------------------------------- building


def _write_tokenizer(out: Path, text_model: Path, fam: Family) -> tuple[dict[str, int], int]:
    """The text demo's tokenizer with the family's vision tokens appended.

    Returns every special token's id and the vocabulary size."""
    from tokenizers import AddedToken, Tokenizer

    tokenizer = Tokenizer.from_file(str(text_model / "tokenizer.json"))
    base = tokenizer.get_vocab_size()
    vision = fam.vision_tokens
    tokenizer.add_special_tokens([AddedToken(tok, special=True) for tok in vision])
    ids = {tok: tokenizer.token_to_id(tok) for tok in (*common.SPECIAL_TOKENS, *vision)}
    if [ids[tok] for tok in vision] != list(range(base, base + len(vision))):
        raise RuntimeError(f"vision tokens did not get the ids after the text vocabulary: {ids}")
    tokenizer.save(str(out / "tokenizer.json"))
    common.write_tokenizer_configs(out, vision, fam.chat_template, fam.tokenizer_fields)
    # mlx-vlm's processors read the template from here.
    common.write_json(out / "chat_template.json", {"chat_template": fam.chat_template})
    return ids, tokenizer.get_vocab_size()


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


def _build_into(out: Path, seed: int, text_model: Path, fam: Family) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    if not text.is_finished_build(text_model):
        raise FileNotFoundError(f"{text_model} is not a finished demo model build")
    text_config = json.loads((text_model / "config.json").read_text(encoding="utf-8"))
    kind = text_config.get("demo_build", {}).get("kind")
    if kind != fam.text_kind or not text_config.get("tie_word_embeddings"):
        raise ValueError(f"{text_model} is not a {fam.text_kind} demo build with tied embeddings")

    ids, vocab_size = _write_tokenizer(out, text_model, fam)
    config = {
        "architectures": [fam.architecture],
        "model_type": fam.model_type,
        **fam.model_config(text_config, ids, vocab_size),
        "torch_dtype": "float32",
        # Ignored by loaders; records which recipe produced the weights.
        "demo_build": {
            "kind": "vlm",
            "seed": seed,
            "version": fam.recipe_version,
            "text": {"kind": fam.text_kind, "version": text.RECIPE_VERSION},
        },
    }
    text_rng, vision_rng = (
        np.random.default_rng(s) for s in np.random.SeedSequence([seed, 0x71E]).spawn(2)
    )
    weights = _text_weights(text_model, text_config["hidden_size"], vocab_size, text_rng)
    weights = fam.text_weights(weights, text_config)
    weights = fam.adapt_text_weights(weights, text_config, text_rng)
    embed = weights["language_model.model.embed_tokens.weight"]
    if fam.untied_head:
        weights["language_model.lm_head.weight"] = embed
    feature_rms = float(np.sqrt(np.mean(embed**2)))
    weights |= fam.vision_weights(config, feature_rms, vision_rng)
    weights = fam.saved_weights(weights)
    save_file(
        {name: np.ascontiguousarray(weights[name], dtype=np.float32) for name in sorted(weights)},
        str(out / "model.safetensors"),
        metadata={"format": "mlx"},
    )
    common.write_model_files(out, config, ids)
    for name, content in fam.processor_files.items():
        common.write_json(out / name, dict(content))


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
