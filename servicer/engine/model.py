"""Loading a model's weights with mlx-lm (its files are already resolved and read)."""

from __future__ import annotations

import importlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm import load
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import (
    MODEL_REMAPPING,
    infer_quant_config,
    load_adapters,
    load_config,
    load_tokenizer,
    sharded_load,
)

from ..model_files import ModelLoadError
from ..vision_families import text_stack_config as _text_config
from ..vision_families import text_stack_only
from .arch_fixes import UnservableModel, fix_for_batching

log = logging.getLogger(__name__)

# Libraries whose BLAS, once in the process, replaces the reference one by symbol interposition.
_FAST_BLAS = ("libopenblas", "libmkl", "libblis", "libflexiblas")


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: TokenizerWrapper


def load_model(
    model_dir: Path, adapter_path: str | None, group: mx.distributed.Group | None = None
) -> LoadedModel:
    """Load with mlx-lm; with a distributed `group`, shard it by tensor parallelism."""
    try:
        if group is None and text_stack_config(model_dir) is not None:
            mlx_model, tokenizer = load_text_stack(model_dir)
            if adapter_path is not None:
                mlx_model = load_adapters(mlx_model, adapter_path)
                mlx_model.eval()
        elif group is None:
            mlx_model, tokenizer = load(str(model_dir), adapter_path=adapter_path)
        else:
            if adapter_path is not None:
                raise ModelLoadError("--adapter-path is not supported with --distributed")
            check_shardable(model_dir, group.size())
            mlx_model, tokenizer = sharded_load(str(model_dir), tensor_group=group)
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"mlx-lm could not load {model_dir}: {exc}") from exc
    try:
        fix_for_batching(mlx_model)
    except UnservableModel as exc:
        raise ModelLoadError(f"cannot serve {model_dir}: {exc}") from exc
    return LoadedModel(model=mlx_model, tokenizer=tokenizer)


# The text stack of a vision-language checkpoint whose model type mlx-lm has no module for
# (nor a remapping to one), or one that cannot take mlx-vlm's weights (the registry's
# `text_stack`), whose text_config names a text model type mlx-lm has: that model is built
# from text_config and takes the checkpoint's language_model.* weights, its vision tower and
# projector left out (llava_next: text only, vision_families.vision_refusal). llava itself
# mlx-lm loads (its remapping to mistral3 wraps the same llama model), images included.
def _mlx_lm_knows(model_type: Any) -> bool:
    if not isinstance(model_type, str) or not model_type:
        return False
    try:
        importlib.import_module(f"mlx_lm.models.{MODEL_REMAPPING.get(model_type, model_type)}")
    except (ImportError, ValueError):
        return False
    return True


def text_stack_config(model_dir: Path) -> dict[str, Any] | None:
    """The checkpoint's text_config where mlx-lm loads only its text stack (above); else None."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    text = _text_config(config) if isinstance(config, dict) else None
    whole = _mlx_lm_knows(config.get("model_type")) and not text_stack_only(config)
    if not isinstance(text, dict) or whole:
        return None
    return text if _mlx_lm_knows(text.get("model_type")) else None


def _language_weights(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """The language model's weights under the text model's own names: mlx-vlm's (a flat
    stack's given the ``model.`` level), or transformers' ``model.language_model.``, ``lm_head``."""
    out = {}
    for name, value in weights.items():
        if name.startswith("language_model."):
            name = name.removeprefix("language_model.")
            out[name if name.startswith(("model.", "lm_head.")) else f"model.{name}"] = value
        elif name.startswith("model.language_model."):
            out["model." + name.removeprefix("model.language_model.")] = value
        elif name.startswith("lm_head."):
            out[name] = value
    return out


def load_text_stack(model_dir: Path) -> tuple[nn.Module, TokenizerWrapper]:
    """mlx-lm's text model of `model_dir`'s text_config with its language_model.* weights,
    quantized as the checkpoint's are (each layer with scales, its bits and group size read
    from them as mlx-lm does), and the checkpoint's tokenizer as mlx-lm loads it."""
    model_dir = Path(model_dir)
    config = load_config(model_dir)
    text = dict(_text_config(config) or {})
    weights: dict[str, mx.array] = {}
    for path in sorted(model_dir.glob("model*.safetensors")):
        weights |= _language_weights(mx.load(str(path)))
    if not weights:
        raise FileNotFoundError(f"no language_model.* weights in {model_dir}")
    # Where text_config leaves it out (transformers' defaults differ by family), the weights
    # say whether the output head is its own.
    text.setdefault("tie_word_embeddings", "lm_head.weight" not in weights)
    model_type = text["model_type"]
    arch = importlib.import_module(f"mlx_lm.models.{MODEL_REMAPPING.get(model_type, model_type)}")
    args = arch.ModelArgs.from_dict(text)
    args.rope_scaling = getattr(args, "rope_scaling", None) or text.get("rope_scaling")  # mrope
    model = arch.Model(args)
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    quantization = config.get("quantization") or text.get("quantization")
    if quantization:

        def quantized(path: str, module: nn.Module) -> bool | dict:
            if not hasattr(module, "to_quantized") or f"{path}.scales" not in weights:
                return False
            return infer_quant_config(path, module, weights)

        nn.quantize(
            model,
            group_size=quantization["group_size"],
            bits=quantization["bits"],
            mode=quantization.get("mode", "affine"),
            class_predicate=quantized,
        )
    model.eval()
    model.load_weights(list(weights.items()))
    mx.eval(model.parameters())
    tokenizer = load_tokenizer(model_dir, eos_token_ids=config.get("eos_token_id"))
    log.info("%s: mlx-lm's %s text model loaded alone", config.get("model_type"), model_type)
    return model, tokenizer


def check_shardable(model_dir: Path, ranks: int) -> None:
    """Tensor parallelism splits every attention and KV head and each layer's width over the
    ranks: refuse, with the numbers, a model they do not divide (mlx-lm would fail inside a
    forward, or at load for a quantized model whose split width misses its group size)."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return  # mlx-lm's own load says what is wrong
    text = config.get("text_config") or config
    quantization = config.get("quantization") or {}
    group = quantization.get("group_size") if isinstance(quantization, dict) else None
    problems = [
        f"{name} {text[name]} does not divide by {ranks}"
        for name in ("num_attention_heads", "num_key_value_heads")
        if isinstance(text.get(name), int) and text[name] % ranks
    ]
    if isinstance(group, int) and group > 0:
        problems += [
            f"{name} {text[name]} over {ranks} ranks is {text[name] // ranks} wide, not a "
            f"multiple of the quantization group {group}"
            for name in ("hidden_size", "intermediate_size")
            if isinstance(text.get(name), int) and (text[name] // ranks) % group
        ]
    if problems:
        raise ModelLoadError(
            f"cannot shard {model_dir.name} over {ranks} ranks: " + "; ".join(problems)
        )


def reference_blas_hint(mapped_files: str, on_cpu: bool) -> str | None:
    """A tip when MLX computes on the CPU with the reference BLAS its Linux wheel bundles
    (`mapped_files`: the text of /proc/self/maps). Its matrix products, prefill above all, are
    about ten times slower than OpenBLAS's, which a preload swaps in without rebuilding MLX."""
    if not on_cpu or "mlx_cpu.libs/libblas" not in mapped_files:
        return None
    if any(name in mapped_files for name in _FAST_BLAS):
        return None
    return (
        "MLX computes on the CPU with the reference BLAS of its wheel; prefill runs about 10x "
        "faster with OpenBLAS preloaded: install libopenblas0 and start the worker with "
        "LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 (see README, Performance)"
    )


def log_blas_hint() -> None:
    try:
        mapped = Path("/proc/self/maps").read_text()
    except OSError:  # not Linux
        return
    hint = reference_blas_hint(mapped, mx.default_device().type == mx.DeviceType.cpu)
    if hint is not None:
        log.info("%s", hint)
