"""Loading a model with mlx-lm and describing it for the handlers."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm import load
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import sharded_load

from ..messages import ModelInfo

log = logging.getLogger(__name__)

# Config keys that name the context length, in order of preference.
_CONTEXT_KEYS = ("max_position_embeddings", "max_seq_len", "n_positions", "seq_length", "n_ctx")
_FALLBACK_CONTEXT = 4096
# Libraries whose BLAS, once in the process, replaces the reference one by symbol interposition.
_FAST_BLAS = ("libopenblas", "libmkl", "libblis", "libflexiblas")


class ModelLoadError(RuntimeError):
    """The model could not be found or loaded; the message says why."""


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: TokenizerWrapper
    info: ModelInfo


def _looks_local(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~")) or Path(name).expanduser().exists()


def resolve_model_dir(model: str) -> Path:
    """A local directory for `model`: the path itself, or a hub snapshot (downloaded)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path.resolve()
    if _looks_local(model) or model.count("/") != 1:
        raise ModelLoadError(f"model path {model!r} does not exist or is not a directory")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(model))
    except Exception as exc:  # offline, unknown repo, auth: all end the same way
        raise ModelLoadError(f"could not fetch model {model!r} from the hub: {exc}") from exc


def _context_length(config: dict[str, Any], tokenizer: TokenizerWrapper) -> int:
    for section in (config, config.get("text_config") or {}):
        for key in _CONTEXT_KEYS:
            value = section.get(key)
            if isinstance(value, int) and value > 0:
                return value
    limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(limit, int) and 0 < limit < 10_000_000:
        return limit
    return _FALLBACK_CONTEXT


def _first_id(value: Any) -> int | None:
    if isinstance(value, list):
        value = value[0] if value else None
    return value if isinstance(value, int) and value >= 0 else None


def load_model(
    model: str,
    adapter_path: str | None,
    served_model_name: str | None,
    group: mx.distributed.Group | None = None,
) -> LoadedModel:
    """Load with mlx-lm; with a distributed `group`, shard it by tensor parallelism."""
    model_dir = resolve_model_dir(model)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{model_dir} has no config.json: not an mlx-lm model directory")
    try:
        if group is None:
            mlx_model, tokenizer = load(str(model_dir), adapter_path=adapter_path)
        else:
            if adapter_path is not None:
                raise ModelLoadError("--adapter-path is not supported with --distributed")
            mlx_model, tokenizer = sharded_load(str(model_dir), tensor_group=group)
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"mlx-lm could not load {model_dir}: {exc}") from exc
    config = json.loads(config_path.read_text())
    text_config = config.get("text_config") or {}
    vocab_size = config.get("vocab_size") or text_config.get("vocab_size") or len(tokenizer)
    info = ModelInfo(
        model_path=model,
        model_dir=str(model_dir),
        served_model_name=served_model_name or model,
        model_type=str(config.get("model_type", "")),
        architectures=tuple(config.get("architectures") or ()),
        vocab_size=int(vocab_size),
        context_length=_context_length(config, tokenizer),
        eos_token_ids=tuple(sorted(tokenizer.eos_token_ids)),
        bos_token_id=_first_id(config.get("bos_token_id", tokenizer.bos_token_id)),
        pad_token_id=_first_id(config.get("pad_token_id", tokenizer.pad_token_id)),
        has_thinking=bool(tokenizer.think_start_tokens and tokenizer.think_end_tokens),
    )
    return LoadedModel(model=mlx_model, tokenizer=tokenizer, info=info)


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
