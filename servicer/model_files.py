"""The model's files, read before any weight is loaded: what the router learns about the model.

Resolving comes first (a hub download or the demo model's first build can take a while).
Then config.json, generation_config.json and the tokenizer give the model's identity, context
length, vocabulary and special tokens, exactly as they will be once the model is loaded.
Handler side: nothing here imports MLX (the demo builder imports it only to build).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .messages import ModelInfo
from .tokenizer_bundle import router_tokenizer
from .vision_families import FAMILIES, VisionSpec, vision_refusal, vision_spec

log = logging.getLogger(__name__)

DEMO_PREFIX = "demo:"
DEFAULT_DEMO_KIND = "llama"
# Config keys that name the context length, in order of preference.
_CONTEXT_KEYS = ("max_position_embeddings", "max_seq_len", "n_positions", "seq_length", "n_ctx")
_FALLBACK_CONTEXT = 4096
VLM_DEMO_KIND = "vlm"  # demo:vlm, the tiny vision-language demo (demos.vision)
VLM_DEMO_FAMILY = "gemma3"  # demo:vlm's; demo:vlm:FAMILY names any served family


class ModelLoadError(RuntimeError):
    """The model could not be found or read; the message says why."""


@dataclass(frozen=True)
class ModelSpec:
    """What the user asked to serve: a local directory, a hub id, or a built-in demo kind."""

    model: str | None = None  # None: the default demo model
    served_model_name: str | None = None

    @property
    def demo_kind(self) -> str | None:
        if self.model is None:
            return DEFAULT_DEMO_KIND
        if self.model.startswith(DEMO_PREFIX):
            return self.model[len(DEMO_PREFIX) :] or DEFAULT_DEMO_KIND
        return None

    def describe(self) -> str:
        kind = self.demo_kind
        return f"the built-in {kind} demo model" if kind is not None else repr(self.model)


@dataclass(frozen=True)
class ModelFiles:
    """A resolved model directory and what its files say."""

    info: ModelInfo
    tokenizer: Any  # the Hugging Face tokenizer (text input, decoded text, stop strings)
    vision: VisionSpec | None = None  # how its prompts hold images (None: text only)

    @property
    def model_dir(self) -> Path:
        return Path(self.info.model_dir)


def resolve_model_dir(spec: ModelSpec) -> Path:
    """A local directory holding the model: the path itself, the demo model (built on first
    use), or a hub snapshot (downloaded on first use)."""
    kind = spec.demo_kind
    if kind is not None and kind.partition(":")[0] == VLM_DEMO_KIND:
        from .demos.vision import demo_vlm_path

        family = kind.partition(":")[2] or VLM_DEMO_FAMILY
        if family not in FAMILIES:
            raise ModelLoadError(f"unknown demo VLM family {family!r}; known: {list(FAMILIES)}")
        return demo_vlm_path(family=family)
    if kind is not None:
        from .demos.text import available_kinds, demo_model_path

        if kind not in available_kinds():
            known = [*available_kinds(), VLM_DEMO_KIND]
            raise ModelLoadError(f"unknown demo model {kind!r}; known: {known}")
        return demo_model_path(kind)
    assert spec.model is not None
    path = Path(spec.model).expanduser()
    if path.is_dir():
        return path.resolve()
    if _looks_local(spec.model) or spec.model.count("/") != 1:
        raise ModelLoadError(f"model path {spec.model!r} does not exist or is not a directory")
    from huggingface_hub import snapshot_download

    log.info(
        "fetching %s from the Hugging Face hub (the metadata answers once it is here)", spec.model
    )
    try:
        return Path(snapshot_download(spec.model))
    except Exception as exc:  # offline, unknown repo, auth: all end the same way
        raise ModelLoadError(f"could not fetch model {spec.model!r} from the hub: {exc}") from exc


def _looks_local(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~")) or Path(name).expanduser().exists()


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return value if isinstance(value, dict) else {}


def _ids(value: Any) -> list[int]:
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0]


def _first_id(value: Any) -> int | None:
    ids = _ids(value)
    return ids[0] if ids else None


def _context_length(config: dict[str, Any], tokenizer: Any) -> int:
    for section in (config, config.get("text_config") or {}):
        for key in _CONTEXT_KEYS:
            value = section.get(key)
            if isinstance(value, int) and value > 0:
                return value
    limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(limit, int) and 0 < limit < 10_000_000:
        return limit
    return _FALLBACK_CONTEXT


def load_tokenizer(model_dir: Path) -> Any:
    """The model's Hugging Face tokenizer, loaded as mlx-lm loads it."""
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as exc:
        raise ModelLoadError(f"cannot load the tokenizer of {model_dir}: {exc}") from exc


def read_model_files(spec: ModelSpec, model_dir: Path) -> ModelFiles:
    """The model's identity from its files (mlx-lm's rules for EOS: generation_config.json's
    eos_token_id over config.json's, plus the tokenizer's own)."""
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{model_dir} has no config.json: not an mlx-lm model directory")
    config = _read_json(config_path)
    if not config:
        raise ModelLoadError(f"{config_path} is not a JSON object")
    generation = _read_json(model_dir / "generation_config.json")
    tokenizer = load_tokenizer(model_dir)
    text_config = config.get("text_config") or {}
    eos = set(_ids(generation.get("eos_token_id") or config.get("eos_token_id")))
    if tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    vocab_size = config.get("vocab_size") or text_config.get("vocab_size") or len(tokenizer)
    model_path = str(model_dir) if spec.demo_kind is not None else str(spec.model)
    served = spec.served_model_name
    if served is None:
        kind = spec.demo_kind
        # demo:vlm:FAMILY's name holds the family's, as smg routes some families by name.
        served = f"mlx-grpc-worker-demo-{kind.replace(':', '-')}" if kind else model_path
    info = ModelInfo(
        model_path=model_path,
        model_dir=str(model_dir),
        served_model_name=served,
        model_type=str(config.get("model_type", "")),
        architectures=tuple(config.get("architectures") or ()),
        vocab_size=int(vocab_size),
        context_length=_context_length(config, tokenizer),
        eos_token_ids=tuple(sorted(eos)),
        bos_token_id=_first_id(config.get("bos_token_id", tokenizer.bos_token_id)),
        pad_token_id=_first_id(config.get("pad_token_id", tokenizer.pad_token_id)),
        hidden_size=int(config.get("hidden_size") or text_config.get("hidden_size") or 0),
    )
    bos = info.bos_token_id
    if bos is not None and adds_bos(tokenizer, bos):
        info = replace(info, adds_bos=True)
    vision = None
    refusal = vision_refusal(config)
    if refusal is not None:
        log.warning("%s", refusal)
    else:
        vision = vision_spec(config, tokenizer)
        info = replace(info, supports_vision=vision is not None)
    if vision is not None:
        image_token = tokenizer.convert_ids_to_tokens(vision.image_token_id)
        copy = router_tokenizer(model_dir, info.model_type, str(image_token))
        info = replace(info, router_tokenizer_dir=None if copy is None else str(copy))
    return ModelFiles(info, tokenizer, vision)


def adds_bos(tokenizer: Any, bos: int) -> bool:
    """Whether encoding text with the tokenizer's special tokens puts `bos` first, as mlx-lm
    encodes a prompt. Asked of the tokenizer itself: `add_bos_token` in its config and a
    template post-processor in tokenizer.json both end up there, whichever it has."""
    try:
        plain = list(tokenizer.encode("a", add_special_tokens=False))
        special = list(tokenizer.encode("a", add_special_tokens=True))
    except Exception:  # a tokenizer that cannot encode plain text: nothing to go by
        return False
    return bool(special) and special[0] == bos and (not plain or plain[0] != bos)


def prepare_model_files(spec: ModelSpec) -> ModelFiles:
    """Resolve, then read: everything the metadata RPCs answer from (blocking; call it off the
    event loop)."""
    kind = spec.demo_kind
    log.info("resolving %s", spec.describe() if kind is None else f"the {kind} demo model")
    model_dir = resolve_model_dir(spec)
    files = read_model_files(spec, model_dir)
    log.info("model files ready in %s (serving as %s)", model_dir, files.info.served_model_name)
    return files
