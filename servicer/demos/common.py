"""What every demo build shares: the model cache, atomic builds, the special tokens and the
files written around the weights (tokenizer configs, generation config).

Imports nothing beyond the standard library at module level: the handler side uses the cache
helpers (``tokenizer_bundle``), and must never import MLX.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

CACHE_ENV = "MLX_GRPC_WORKER_CACHE"

BOS_TOKEN = "<|begin|>"
EOS_TOKEN = "<|end|>"
PAD_TOKEN = "<|pad|>"
# Order fixes the ids: bos=0, eos=1, pad=2, ...
SPECIAL_TOKENS = (
    BOS_TOKEN,
    EOS_TOKEN,
    PAD_TOKEN,
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<think>",
    "</think>",
)
MODEL_MAX_LENGTH = 4096

# Every demo build holds these (a vision one more: its template and processor files).
MODEL_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)


def default_cache_dir() -> Path:
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "mlx-grpc-worker"


def has_files(path: Path, names: Iterable[str]) -> bool:
    """Whether `path` is a finished build: builds appear by atomic rename, so a directory
    holding every file is complete."""
    path = Path(path)
    return path.is_dir() and all((path / name).is_file() for name in names)


def build_atomically(
    path: Path, finished: Callable[[Path], bool], build_into: Callable[[Path], None], what: str
) -> Path:
    """`build_into` a temporary sibling of `path`, then rename it into place: `path` never
    holds a partial build, and a `finished` one there is returned untouched."""
    path = Path(path)
    if finished(path):
        return path
    if path.exists() and not (path.is_dir() and not any(path.iterdir())):
        # Fail before spending a build on a rename that cannot succeed.
        raise FileExistsError(f"{path} exists and is not a finished {what} build")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        build_into(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; a model cache should be readable
        try:
            # rename(2) replaces a missing or empty directory, and fails on a non-empty one.
            os.rename(tmp, path)
        except OSError:
            if not finished(path):  # else another process won the race: fine
                raise FileExistsError(f"{path} exists and is not a finished {what} build") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def cached_build(
    target: Path, finished: Callable[[Path], bool], build: Callable[[Path], Path], what: str
) -> Path:
    """`target` in the model cache, built on first use by `build`; builders in several
    processes serialise on a lock file beside it."""
    if finished(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        if not finished(target):  # else another process built it while we waited
            log.info("building %s into %s (first use)", what, target)
        return build(target)


# --------------------------------------------------------------------------- files


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def special_token_ids(ids: Mapping[str, int]) -> dict[str, int]:
    """The config fields naming the BOS, EOS and pad tokens' ids (config.json's and
    generation_config.json's)."""
    return {
        "bos_token_id": ids[BOS_TOKEN],
        "eos_token_id": ids[EOS_TOKEN],
        "pad_token_id": ids[PAD_TOKEN],
    }


def write_tokenizer_configs(
    out: Path, extra_tokens: Iterable[str], chat_template: str, fields: Mapping[str, Any]
) -> None:
    """tokenizer_config.json and special_tokens_map.json for a tokenizer holding
    SPECIAL_TOKENS, `extra_tokens` (added special tokens) and `chat_template`; `fields` go
    into tokenizer_config.json too."""
    named = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}
    additional = {"additional_special_tokens": [*SPECIAL_TOKENS[3:], *extra_tokens]}
    write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **named,
            **additional,
            "add_bos_token": False,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": MODEL_MAX_LENGTH,
            **fields,
            "chat_template": chat_template,
        },
    )
    write_json(out / "special_tokens_map.json", {**named, **additional})


def write_model_files(out: Path, config: Mapping[str, Any], ids: Mapping[str, int]) -> None:
    """config.json, and generation_config.json naming the special tokens' ids."""
    write_json(out / "config.json", config)
    write_json(out / "generation_config.json", special_token_ids(ids))
