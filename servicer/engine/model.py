"""Loading a model's weights with mlx-lm (its files are already resolved and read)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm import load
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import sharded_load

from ..model_files import ModelLoadError
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
        if group is None:
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
