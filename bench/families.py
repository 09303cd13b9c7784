"""The family matrix: every mlx-lm text architecture, served by the real worker, against mlx-lm.

For each architecture with a config in bench/families/configs/ (tiny sizes, the demo tokenizer's
vocabulary) a random-weight model is built once into a cache directory (seeded; weights rescaled
so that greedy output depends on the input) together with mlx-lm's own single-sequence greedy
output for a few prompts (`generate_step`, argmax sampler). Then the worker serves it in several
configurations (cells) and its greedy tokens are compared with mlx-lm's, token for token:

- defaults: `python -m servicer` as shipped (engine in a child process), three prompts at once;
- prefix: the same worker, a second wave repeating the prompts with new tails (prefix hits);
- thread: `--engine-mode thread`;  ngram: `--speculate ngram`;  kv8: `--kv-bits 8` (against
  mlx-lm's own quantized-cache generation);  distributed: two ranks over the `ring` backend.

Every cell uses `--prompt-cache-block 16` so the short prompts span several blocks. A cell is
exact, near-tie (first differing position where mlx-lm's top two logits are within MARGIN),
wrong, no-hit (prefix cell: exact, but nothing was reused), refused (the worker would not
start, with its reason), error (a gRPC error), hang (over the time limit; the worker is
killed), memory (the worker's RSS went over the limit), or skipped (with the reason).

Usage: python bench/families.py [--only llama,qwen3] [--cells defaults,prefix] [--jobs 1]
       [--timeout 60] [--json OUT] [--markdown OUT]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
FAMILIES = BENCH / "families"
CONFIGS = FAMILIES / "configs"
SKIPPED = FAMILIES / "skipped.json"
CELLS = ("defaults", "prefix", "thread", "ngram", "kv8", "distributed")
STATUSES = (
    "exact",
    "near-tie",
    "wrong",
    "no-hit",
    "refused",
    "error",
    "hang",
    "memory",
    "skipped",
    "degenerate",
    "build",
)
MARGIN = 1e-3  # top-2 logit gap under which a differing greedy token is a near tie
NEW_TOKENS = 16  # tokens compared per prompt
VARIETY_TOKENS = 24  # greedy tokens checked for variety
MIN_DISTINCT = 8  # distinct tokens required among VARIETY_TOKENS
PROMPT_LENGTHS = (6, 27, 75)  # the first wave's prompts
TAIL_LENGTHS = (5, 9, 13)  # the second wave adds these to the first wave's prompts
RSS_LIMIT = 3 << 30
BLOCK = "16"
BUILD_VERSION = "f1"  # bump when building or the reference changes
READY = re.compile(r"ready: serving .* on [\d.]+:(\d+)")
SEED = 0


def log(message: str) -> None:
    print(f"[families {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- configs


def load_configs() -> dict[str, dict[str, Any]]:
    return {path.stem: json.loads(path.read_text()) for path in sorted(CONFIGS.glob("*.json"))}


def load_skipped() -> dict[str, str]:
    return json.loads(SKIPPED.read_text()) if SKIPPED.exists() else {}


def installed_architectures() -> list[str]:
    """Modules of the installed mlx_lm.models that define a Model class."""
    import importlib.util

    spec = importlib.util.find_spec("mlx_lm.models")
    assert spec is not None and spec.submodule_search_locations
    folder = Path(next(iter(spec.submodule_search_locations)))
    names = []
    for path in sorted(folder.glob("*.py")):
        if re.search(r"^class Model\b", path.read_text(encoding="utf-8"), re.MULTILINE):
            names.append(path.stem)
    return names


def demo_dir() -> Path:
    from servicer.demo_model import demo_model_path

    return demo_model_path()


def build_key(config: dict[str, Any]) -> str:
    import importlib.metadata

    blob = json.dumps(
        [config, BUILD_VERSION, importlib.metadata.version("mlx-lm"), PROMPT_LENGTHS, SEED],
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


# --------------------------------------------------------------------------- prompts


def make_prompts(tokenizer_file: Path) -> tuple[list[list[int]], list[list[int]]]:
    """The first wave (three lengths) and the second (each first-wave prompt plus a new tail)."""
    from tokenizers import Tokenizer

    from servicer.demo_model import _CORPUS_PATH

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    paragraphs = [p for p in _CORPUS_PATH.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    ids = tokenizer.encode(" ".join(paragraphs[:40]), add_special_tokens=False).ids
    first: list[list[int]] = []
    start = 0
    for length in PROMPT_LENGTHS:
        first.append(ids[start : start + length])
        start += length + 7
    second = []
    for prompt, tail in zip(first, TAIL_LENGTHS, strict=True):
        second.append(prompt + ids[start : start + tail])
        start += tail + 3
    return first, second


# --------------------------------------------------------------------------- building


def _fan_in(name: str, shape: Sequence[int]) -> int:
    if len(shape) == 3 and "conv" in name:
        return shape[-2] * shape[-1]
    return shape[-1]


def randomize(model: Any, seed: int, gain: float) -> None:
    """Every floating weight of two or more dimensions drawn again from N(0, gain^2/fan_in):
    big enough that each layer moves the residual stream, so the next token depends on the
    context rather than only on the last token. Norms, biases and 1-D parameters keep their
    initial values."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    key = mx.random.key(seed)
    updated = []
    for index, (name, value) in enumerate(tree_flatten(model.parameters())):
        if value.ndim >= 2 and mx.issubdtype(value.dtype, mx.floating):
            std = gain / _fan_in(name, value.shape) ** 0.5
            noise = mx.random.normal(value.shape, key=mx.random.split(key, index + 2)[-1])
            value = (noise * std).astype(value.dtype)
        updated.append((name, value))
    model.update(tree_unflatten(updated))


def _save(model: Any, config: dict[str, Any], out: Path, drop: Sequence[str] = ()) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    weights = {
        name: value
        for name, value in tree_flatten(model.parameters())
        if not any(name.startswith(prefix) for prefix in drop)
    }
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def write_model(arch: str, config: dict[str, Any], out: Path) -> Any:
    """Build the random model into `out` (with the demo tokenizer) and load it back as mlx-lm
    would; returns the loaded model."""
    import shutil

    import mlx.core as mx
    from mlx_lm.utils import _get_classes, load_model

    options = dict(config.pop("families", {}))
    demo = demo_dir()
    demo_config = json.loads((demo / "config.json").read_text())
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        config.setdefault(name, demo_config[name])
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(demo / name, out / name)
    shutil.copy(demo / "generation_config.json", out / "generation_config.json")
    model_class, args_class = _get_classes(config)
    mx.random.seed(options.get("seed", SEED))
    model = model_class(args_class.from_dict(config))
    randomize(model, options.get("seed", SEED), options.get("gain", 1.0))
    model.set_dtype(mx.float32)
    _save(model, config, out)
    try:
        return load_model(out)[0]
    except ValueError as exc:
        if "lm_head" not in str(exc):
            raise
    _save(model, config, out, drop=("lm_head",))  # tied on load: no head in the checkpoint
    return load_model(out)[0]


# --------------------------------------------------------------------------- mlx-lm's answer


def greedy(model: Any, prompt: list[int], count: int, **kv: Any) -> dict[str, list]:
    """mlx-lm's single-sequence greedy tokens and, per position, its top-2 logit gap."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.generate import generate_step

    tokens: list[int] = []
    margins: list[float] = []
    steps = generate_step(
        mx.array(prompt), model, max_tokens=count, sampler=lambda x: mx.argmax(x, axis=-1), **kv
    )
    for token, logprobs in steps:
        top = np.sort(np.array(logprobs.astype(mx.float32)).reshape(-1))[-2:]
        tokens.append(int(token))
        margins.append(float(top[1] - top[0]))
    return {"tokens": tokens, "margins": margins}


def cache_facts(model: Any) -> dict[str, Any]:
    """The cache classes of the model's layers and the attention head size (from the key
    cache's shape after a one-token forward), as the worker checks --kv-group-size."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[5]]), cache=cache))
    kinds = sorted({type(c).__name__ for c in cache})
    heads = set()
    for layer in cache:
        for inner in getattr(layer, "caches", None) or [layer]:
            keys = getattr(inner, "keys", None)
            if type(inner).__name__ == "KVCache" and keys is not None:
                heads.add(int(keys.shape[-1]))
    return {"cache_kinds": kinds, "head_dims": sorted(heads)}


def kv_group(head_dims: list[int]) -> int | None:
    for group in (64, 32):
        if head_dims and all(dim % group == 0 for dim in head_dims):
            return group
    return None


def reference(model: Any, out: Path) -> dict[str, Any]:
    first, second = make_prompts(out / "tokenizer.json")
    wave1 = [greedy(model, prompt, VARIETY_TOKENS) for prompt in first]
    distinct = [len(set(run["tokens"])) for run in wave1]
    facts = cache_facts(model)
    result: dict[str, Any] = {
        "wave1": first,
        "wave2": second,
        "ref1": [{k: v[:NEW_TOKENS] for k, v in run.items()} for run in wave1],
        "ref2": [greedy(model, prompt, NEW_TOKENS) for prompt in second],
        "distinct": distinct,
        "degenerate": min(distinct) < MIN_DISTINCT,
        "shard": hasattr(model, "shard"),
        **facts,
    }
    group = kv_group(facts["head_dims"])
    if group is not None:
        kv = {"kv_bits": 8, "kv_group_size": group, "quantized_kv_start": 0}
        try:
            result["ref_kv8"] = [greedy(model, prompt, NEW_TOKENS, **kv) for prompt in first]
        except Exception as exc:  # mlx-lm itself cannot quantize this cache
            result["ref_kv8_error"] = f"{type(exc).__name__}: {exc}"[:300]
    return result


def build_main(arch: str, out: Path) -> None:
    """Subprocess entry: build `arch` into `out` and write reference.json last."""
    config = load_configs()[arch]
    out.mkdir(parents=True, exist_ok=True)
    model = write_model(arch, json.loads(json.dumps(config)), out)
    facts = reference(model, out)
    (out / "reference.json").write_text(json.dumps(facts) + "\n")


def build(arch: str, cache: Path, timeout: float) -> tuple[Path, dict[str, Any] | str]:
    """The built model's directory and its reference, or the build's error text."""
    out = cache / f"{arch}-{build_key(load_configs()[arch])}"
    ref = out / "reference.json"
    if not ref.exists():
        command = [sys.executable, __file__, "--build", arch, "--out", str(out)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return out, f"build took over {timeout:.0f} s"
        if done.returncode != 0 or not ref.exists():
            lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
            return out, (lines[-1] if lines else f"build exited {done.returncode}")[:400]
    return out, json.loads(ref.read_text())
