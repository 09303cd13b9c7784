"""The family matrix: every mlx-lm text architecture, served by the real worker, against mlx-lm.

For each architecture with a config in bench/families/configs/ (tiny sizes, the demo tokenizer's
vocabulary) a random-weight model is built once into a cache directory (seeded; weights rescaled
so that greedy output depends on the input) together with mlx-lm's own single-sequence greedy
output for a few prompts (`generate_step`, argmax sampler). Then the worker serves it in several
configurations (cells) and its greedy tokens are compared with mlx-lm's, token for token:

- defaults: `python -m servicer` as shipped (engine in a child process), three prompts at once;
- prefix: the same worker, a second wave repeating the prompts with new tails (prefix hits);
- thread: `--engine-mode thread`;  ngram: `--speculate ngram`;  kv8: `--kv-bits 8` (against
  mlx-lm's own quantized-cache generation, or keys and values quantized and dequantized where
  mlx-lm's quantized attention cannot run the model, or the plain reference where no layer is
  quantized; on a build of its own where the config's "families": {"kv8": {...}} overrides
  head sizes that MLX cannot quantize);  distributed: two ranks over the `ring` backend;
- the scheduling settings a user may set, each against the plain reference: stall0
  `--max-prefill-stall-ms 0` (the prefill budget off), nogroup `--no-group-rows`, fuse
  `--fuse-prefill`, prefill1 `--prefill-batch-size 1`, slots2 `--completion-batch-size 2`.

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
import contextlib
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

import _checkout  # noqa: F401  (before any `servicer` import)

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
FAMILIES = BENCH / "families"
CONFIGS = FAMILIES / "configs"
SKIPPED = FAMILIES / "skipped.json"
# The scheduling settings a user may set, each a cell of its own: exact on every architecture
# or refused at start with the reason.
SETTING_CELLS = ("stall0", "nogroup", "fuse", "prefill1", "slots2")
CELLS = ("defaults", "prefix", "thread", "ngram", "kv8", "distributed", *SETTING_CELLS)
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
BUILD_VERSION = "f2"  # bump when building or the reference changes
KV8_VERSION = "k2"  # bump when the kv8 reference (kv8_main) changes
VARIANTS = ("kv8",)  # cells that may build their own model: "families": {"kv8": {overrides}}
READY = re.compile(r"ready: serving .* on [\d.]+:(\d+)")
SEED = 0


def log(message: str) -> None:
    print(f"[families {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- configs


def load_configs() -> dict[str, dict[str, Any]]:
    return {path.stem: json.loads(path.read_text()) for path in sorted(CONFIGS.glob("*.json"))}


def arch_config(arch: str, variant: str | None = None) -> dict[str, Any]:
    """The config a build uses: the file's, less its variants' overrides ("families": {"kv8":
    {...}}); with `variant`, that variant's overrides merged in (nested dicts key by key), a
    model of its own (e.g. the kv8 cell's, with head sizes MLX can quantize in groups of 32)."""
    config = json.loads(json.dumps(load_configs()[arch]))
    options = config.get("families", {})
    overrides = {name: options.pop(name) for name in VARIANTS if name in options}
    if "families" in config and not options:
        del config["families"]

    def merge(into: dict[str, Any], extra: dict[str, Any]) -> None:
        for key, value in extra.items():
            if isinstance(value, dict) and isinstance(into.get(key), dict):
                merge(into[key], value)
            else:
                into[key] = value

    if variant is not None:
        merge(config, overrides[variant])
    return config


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
    from servicer.demos.text import demo_model_path

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
    """The first wave (three lengths) and the second (each first-wave prompt plus a new tail).
    A tokenizer that puts a BOS before every encoding (Gemma's) gets it first in each prompt,
    as the worker would put it there."""
    from tokenizers import Tokenizer

    from servicer.demos.text import _CORPUS_PATH

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    paragraphs = [p for p in _CORPUS_PATH.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    ids = tokenizer.encode(" ".join(paragraphs[:40]), add_special_tokens=False).ids
    plain, special = (tokenizer.encode("a", add_special_tokens=b).ids for b in (False, True))
    bos = special[:1] if len(special) > len(plain) and special[1:] == plain else []
    first: list[list[int]] = []
    start = 0
    for length in PROMPT_LENGTHS:
        first.append(bos + ids[start : start + length])
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


def randomize(
    model: Any,
    seed: int,
    gain: float,
    gains: dict[str, float] | None = None,
    norms: float | None = None,
) -> None:
    """Every floating weight of two or more dimensions drawn again from N(0, gain^2/fan_in):
    big enough that each layer moves the residual stream, so the next token depends on the
    context rather than only on the last token. Norms, biases and 1-D parameters keep their
    initial values.

    Build options (the config's "families" dict) for architectures that stay degenerate:
    `gains` maps a name fragment to its own gain for the weights whose dotted name contains it
    (the first fragment that matches; e.g. {"embed_tokens": 0.3} keeps a tied, scaled
    embedding from making every token predict itself); `norms` adds N(0, norms^2) noise to
    every 1-D floating parameter but biases (norm scales, per-channel and layer scalars) around
    its initial value, as training leaves them: no norm keeps one uniform scale on every
    channel and no scale initialised to zero keeps its path switched off."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    key = mx.random.key(seed)
    updated = []
    for index, (name, value) in enumerate(tree_flatten(model.parameters())):
        if value.ndim >= 2 and mx.issubdtype(value.dtype, mx.floating):
            scale = next((g for part, g in (gains or {}).items() if part in name), gain)
            std = scale / _fan_in(name, value.shape) ** 0.5
            noise = mx.random.normal(value.shape, key=mx.random.split(key, index + 2)[-1])
            value = (noise * std).astype(value.dtype)
        elif (
            norms
            and value.ndim == 1
            and not name.endswith("bias")
            and mx.issubdtype(value.dtype, mx.floating)
        ):
            noise = mx.random.normal(value.shape, key=mx.random.split(key, index + 2)[-1])
            value = (value + noise * norms).astype(value.dtype)
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
    randomize(
        model,
        options.get("seed", SEED),
        options.get("gain", 1.0),
        gains=options.get("gains"),
        norms=options.get("norms"),
    )
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


def kv8_dims(model: Any) -> list[int]:
    """The key and the value vector sizes of the layers `--kv-bits` quantizes (plain KVCache
    layers; those inside a CacheList stay full precision in the worker), after one token."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[5]]), cache=cache))
    return sorted(
        {
            int(array.shape[-1])
            for layer in cache
            if type(layer) is KVCache and layer.keys is not None
            for array in (layer.keys, layer.values)
        }
    )


def kv_group(dims: list[int]) -> int | None:
    """The group the worker picks without --kv-group-size: the largest of 64 and 32 that
    divides every key and value size (MLA's differ)."""
    for group in (64, 32):
        if dims and all(dim % group == 0 for dim in dims):
            return group
    return None


def reference(model: Any, tokenizer_file: Path) -> dict[str, Any]:
    first, second = make_prompts(tokenizer_file)
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
    return result


def quantized_cache(model: Any, group: int, round_trip: bool = False) -> list[Any]:
    """mlx-lm's own caches for one sequence with every plain KVCache layer an 8-bit
    QuantizedKVCache from the first token, as `--kv-bits 8` quantizes (other kinds as they
    are). mlx-lm's `kv_bits` would run the prompt in full precision and quantize after it.
    With `round_trip`, those layers are instead KVCaches that keep each key and value quantized
    and dequantized again (mx.quantize, mx.dequantize): the model's own attention on the values
    a quantized cache holds, for models whose attention cannot take quantized tuples."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

    def rounded(x: Any) -> Any:
        packed = mx.quantize(x, group_size=group, bits=8)
        return mx.dequantize(*packed, group_size=group, bits=8).astype(x.dtype)

    class RoundTripKVCache(KVCache):
        def update_and_fetch(self, keys: Any, values: Any) -> Any:
            return super().update_and_fetch(rounded(keys), rounded(values))

    def swap(c: Any) -> Any:
        if type(c) is not KVCache:
            return c
        return RoundTripKVCache() if round_trip else QuantizedKVCache(group_size=group, bits=8)

    return [swap(c) for c in make_prompt_cache(model)]


def kv8_reference(model: Any, prompts: list[list[int]]) -> dict[str, Any]:
    """What `--kv-bits 8` should answer: "kind" plain (no layer is quantized: the plain
    reference), mlx-lm (its QuantizedKVCache from the first token), round-trip (mlx-lm's
    quantized attention fails on this model: keys and values quantized and dequantized, then the
    model's own attention; equal up to float rounding), or none ("error" says why)."""
    dims = kv8_dims(model)
    facts: dict[str, Any] = {"kv_dims": dims, "group": kv_group(dims), "kind": "none"}
    if not dims:
        facts["kind"] = "plain"
        return facts
    group = facts["group"]
    if group is None:
        facts["error"] = f"no group of 64 or 32 divides the key and value sizes {dims}"
        return facts
    try:
        facts["tokens"] = [
            greedy(model, prompt, NEW_TOKENS, prompt_cache=quantized_cache(model, group))
            for prompt in prompts
        ]
        facts["kind"] = "mlx-lm"
    except Exception as exc:  # mlx-lm's own quantized attention cannot run this model
        reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
        facts["mlx_lm_error"] = reason.split(". The following argument types")[0][:300]
        facts["tokens"] = [
            greedy(model, prompt, NEW_TOKENS, prompt_cache=quantized_cache(model, group, True))
            for prompt in prompts
        ]
        facts["kind"] = "round-trip"
    return facts


def kv8_main(model_dir: Path) -> None:
    """Subprocess entry: the kv8 reference of the model built in `model_dir`."""
    from mlx_lm.utils import load_model

    model = as_served(load_model(model_dir)[0])
    prompts = json.loads((model_dir / "reference.json").read_text())["wave1"]
    facts = kv8_reference(model, prompts)
    (model_dir / f"kv8-{KV8_VERSION}.json").write_text(json.dumps(facts) + "\n")


def kv8_facts(model_dir: Path, timeout: float) -> dict[str, Any] | str:
    """The kv8 reference of a built model (made once, next to its reference.json), or the
    error text."""
    path = model_dir / f"kv8-{KV8_VERSION}.json"
    if not path.exists():
        command = [sys.executable, __file__, "--kv8-reference", str(model_dir)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return f"the kv8 reference took over {timeout:.0f} s"
        if done.returncode != 0 or not path.exists():
            lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
            return (lines[-1] if lines else f"exited {done.returncode}")[:400]
    return json.loads(path.read_text())


def as_served(model: Any) -> Any:
    """The model as the reference runs it: mlx-lm's own code, except where the worker's fix
    changes one sequence's output as well (arch_fixes.CHANGES_ONE_SEQUENCE)."""
    from servicer.engine.arch_fixes import CHANGES_ONE_SEQUENCE, fix_for_batching

    if getattr(model, "model_type", None) in CHANGES_ONE_SEQUENCE:
        fix_for_batching(model)
    return model


def build_main(arch: str, out: Path, variant: str | None = None) -> None:
    """Subprocess entry: build `arch` into `out` and write reference.json last."""
    config = arch_config(arch, variant)
    out.mkdir(parents=True, exist_ok=True)
    model = as_served(write_model(arch, json.loads(json.dumps(config)), out))
    facts = reference(model, out / "tokenizer.json")
    (out / "reference.json").write_text(json.dumps(facts) + "\n")


def build(
    arch: str, cache: Path, timeout: float, variant: str | None = None
) -> tuple[Path, dict[str, Any] | str]:
    """The built model's directory and its reference, or the build's error text."""
    name = arch if variant is None else f"{arch}-{variant}"
    out = cache / f"{name}-{build_key(arch_config(arch, variant))}"
    ref = out / "reference.json"
    if not ref.exists():
        command = [sys.executable, __file__, "--build", arch, "--out", str(out)]
        command += [] if variant is None else ["--variant", variant]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return out, f"build took over {timeout:.0f} s"
        if done.returncode != 0 or not ref.exists():
            lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
            return out, (lines[-1] if lines else f"build exited {done.returncode}")[:400]
    return out, json.loads(ref.read_text())


# --------------------------------------------------------------------------- real models

REAL_PREFIX = "real:"
# name -> (the shared script's MODEL, quantized to 4 bits as users run it)
REAL_MODELS = {
    "gemma-3-270m": ("gemma-3-270m", False),
    "gemma-3-270m-4bit": ("gemma-3-270m", True),
    "smollm2-135m-instruct": ("smollm2-135m-instruct", False),
    "smollm2-135m-instruct-4bit": ("smollm2-135m-instruct", True),
}
REAL_MODEL_SCRIPT = ROOT.parent / "shared" / "tools" / "real_model.sh"
OPENBLAS = Path("/usr/lib/x86_64-linux-gnu/libopenblas.so.0")
REAL_TIMEOUT = 600.0  # seconds a cell may take on a real model (float32 on a CPU)


def blas_env() -> dict[str, str]:
    """OpenBLAS preloaded where it is installed (a real model's prefill is ~10x faster)."""
    if not OPENBLAS.exists() or os.environ.get("LD_PRELOAD"):
        return {}
    return {"LD_PRELOAD": str(OPENBLAS), "OPENBLAS_NUM_THREADS": "1"}


def process_env() -> dict[str, str]:
    """A real model's processes (its reference and its workers): OpenBLAS where installed.
    The tiny builds keep MLX's own BLAS on both sides: 8-bit keys that differ by a rounding
    between two BLAS libraries can land in another quantization step (exaone's kv8 cell)."""
    return {**os.environ, **blas_env()}


def real_model_dir(name: str, cache: Path, timeout: float) -> Path | str:
    """The real model's directory (the shared script's build, converted to 4 bits by mlx-lm
    for a -4bit entry), or why not."""
    model, quantize = REAL_MODELS[name]
    if not REAL_MODEL_SCRIPT.exists():
        return f"{REAL_MODEL_SCRIPT} is absent (the shared tools are not beside the checkout)"
    env = {**os.environ, "MODEL": model}
    try:
        done = subprocess.run(
            ["bash", str(REAL_MODEL_SCRIPT)], capture_output=True, text=True, env=env,
            timeout=timeout,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return f"{REAL_MODEL_SCRIPT.name} took over {timeout:.0f} s"
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines or not Path(lines[-1]).is_dir():
        return f"{REAL_MODEL_SCRIPT.name} failed: {done.stderr.strip()[-300:]}"
    source = Path(lines[-1])
    if not quantize:
        return source
    out = cache / f"real-{name}"
    if not (out / "config.json").exists():
        command = [sys.executable, "-m", "mlx_lm", "convert", "--hf-path", str(source)]
        command += ["--mlx-path", str(out), "-q", "--q-bits", "4", "--q-group-size", "64"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            return f"mlx_lm convert failed: {done.stderr.strip()[-300:]}"
    return out


def real_reference_main(model_dir: Path, out: Path) -> None:
    """Subprocess entry: mlx-lm's references for a real model, into `out`/reference.json."""
    from mlx_lm.utils import load_model

    out.mkdir(parents=True, exist_ok=True)
    model = load_model(model_dir)[0]
    facts = reference(model, model_dir / "tokenizer.json")
    facts["kv8"] = kv8_reference(model, facts["wave1"])
    (out / "reference.json").write_text(json.dumps(facts) + "\n")


def run_real(name: str, cells: Sequence[str], cache: Path, timeout: float) -> dict[str, Any]:
    """A real model in the same cells as the tiny builds."""
    started = time.monotonic()
    timeout = max(timeout, REAL_TIMEOUT)
    model_dir = real_model_dir(name, cache, 4 * timeout)
    if isinstance(model_dir, str):
        return {"cells": {c: Cell("skipped", model_dir).as_dict() for c in cells}}
    out = cache / f"real-ref-{name}-{BUILD_VERSION}-{KV8_VERSION}"
    if not (out / "reference.json").exists():
        command = [sys.executable, __file__, "--real-reference", str(model_dir), "--out", str(out)]
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=4 * timeout, env=process_env()
        )
        if done.returncode != 0:
            reason = (done.stderr.strip().splitlines() or ["no output"])[-1][:400]
            return {"cells": {c: Cell("build", reason).as_dict() for c in cells}}
    ref = json.loads((out / "reference.json").read_text())
    blas = blas_env()
    found = single_cells(model_dir, ref, [c for c in cells if c != "kv8"], timeout, env=blas)
    if "kv8" in cells:
        found["kv8"] = kv8_served(model_dir, ref, ref["kv8"], timeout, env=blas)
    if "distributed" in cells:
        found["distributed"] = distributed_cell(model_dir, ref, timeout, out / "dist", env=blas)
    result = {c: found[c].as_dict() for c in cells if c in found}
    summary = " ".join(f"{c}={found[c].status}" for c in cells if c in found)
    log(f"{REAL_PREFIX}{name}: {summary} ({time.monotonic() - started:.0f} s)")
    facts = {k: ref[k] for k in ("distinct", "cache_kinds", "head_dims", "shard")}
    return {**facts, "cells": result}


# --------------------------------------------------------------------------- the worker


class Worker:
    """`python -m servicer` as a subprocess; its log is kept and its ready line parsed."""

    def __init__(self, args: Sequence[str], env: dict[str, str] | None = None) -> None:
        self.args = list(args)
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.lines: list[str] = []
        self.port = 0
        self.ready = threading.Event()
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> Worker:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "servicer", "--port", "0", *self.args],
            cwd=ROOT,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        threading.Thread(target=self._read, daemon=True).start()
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if match := READY.search(line):
                self.port = int(match.group(1))
                self.ready.set()

    def exited(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    def rss(self) -> int:
        """Resident bytes of the worker and its children (the engine process)."""
        import psutil

        try:
            root = psutil.Process(self.proc.pid)  # type: ignore[union-attr]
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return 0
        total = 0
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                total += proc.memory_info().rss
        return total

    def kill(self) -> None:
        """SIGKILL the worker's whole session (it and its engine process)."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def reason(self) -> str:
        """The worker's last error-looking log line (why it would not start)."""
        lines = [line.strip() for line in self.lines if line.strip()]
        for line in reversed(lines):
            if re.search(r"error|refus|not supported|cannot|must|invalid", line, re.I):
                return line[-400:]
        return (lines[-1] if lines else "no output")[-400:]


@dataclass
class Cell:
    status: str
    detail: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"status": self.status, "detail": self.detail, **self.extra}


# --------------------------------------------------------------------------- a cell


def one_request(port: int, prompt: list[int], timeout: float) -> dict[str, Any]:
    import grpc

    from servicer.proto import mlx_engine_pb2 as pb
    from servicer.proto import mlx_engine_pb2_grpc as pb_grpc

    request = pb.GenerateRequest(
        request_id=f"families-{threading.get_ident()}-{time.monotonic_ns()}",
        tokenized=pb.TokenizedInput(input_ids=prompt),
        sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
        stream=True,
    )
    tokens: list[int] = []
    cached = 0
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            for response in pb_grpc.MlxEngineStub(channel).Generate(request, timeout=timeout):
                if response.HasField("chunk"):
                    tokens.extend(response.chunk.token_ids)
                else:
                    cached = response.complete.cached_tokens
        except grpc.RpcError as error:
            return {"error": f"{error.code().name}: {error.details()}"}
    return {"tokens": tokens, "cached": cached}


def wave(port: int, prompts: list[list[int]], timeout: float) -> list[dict[str, Any]]:
    """The prompts sent at once, each on its own thread."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: one_request(port, p, timeout), prompts))


def compare(got: list[dict[str, Any]], want: list[dict[str, list]], prompts: list) -> Cell:
    """exact, or the worst first difference over the prompts (wrong before near-tie)."""
    for result in got:
        if "error" in result:
            return Cell("error", result["error"][:400])
    found: Cell | None = None
    for index, (result, ref) in enumerate(zip(got, want, strict=True)):
        tokens, expected = result["tokens"], ref["tokens"]
        if tokens == expected:
            continue
        pos = next(
            (i for i, (a, b) in enumerate(zip(tokens, expected, strict=False)) if a != b),
            min(len(tokens), len(expected)),
        )
        margin = ref["margins"][pos] if pos < len(ref["margins"]) else float("inf")
        status = "near-tie" if margin < MARGIN else "wrong"
        detail = (
            f"prompt {index} ({len(prompts[index])} tokens) position {pos}: "
            f"got {tokens[pos : pos + 3]} want {expected[pos : pos + 3]} "
            f"(top-2 gap {margin:.2g}; {len(tokens)} tokens)"
        )
        if found is None or (found.status == "near-tie" and status == "wrong"):
            found = Cell(status, detail)
    return found or Cell("exact")


def supervise(workers: list[Worker], done: Callable[[], bool], deadline: float) -> Cell | None:
    """Wait for `done`; a Cell when the time limit, the memory limit or an exit came first."""
    while not done():
        if time.monotonic() > deadline:
            last = workers[0].lines[-1].strip()[-200:] if workers[0].lines else "no output"
            return Cell("hang", f"over the time limit; killed; last log line: {last}")
        rss = sum(worker.rss() for worker in workers)
        if rss > RSS_LIMIT:
            return Cell("memory", f"RSS {rss / 2**30:.1f} GiB; killed")
        for worker in workers:
            if worker.exited():
                time.sleep(0.3)  # let the reader take the last lines
                return Cell("refused" if not worker.ready.is_set() else "error", worker.reason())
        time.sleep(0.1)
    return None


def run_waves(workers: list[Worker], waves: list[list[list[int]]], deadline: float) -> Any:
    """The waves one after another on the first worker, supervised; a list of results per
    wave, or a Cell when the run did not finish."""
    box: dict[str, Any] = {}

    def work() -> None:
        port = workers[0].port
        box["results"] = [wave(port, w, max(1.0, deadline - time.monotonic())) for w in waves]

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    stop = supervise(workers, lambda: not thread.is_alive(), deadline)
    return stop if stop is not None else box["results"]


CELL_FLAGS: dict[str, tuple[str, ...]] = {
    "defaults": (),
    "thread": ("--engine-mode", "thread"),
    "ngram": ("--speculate", "ngram"),
    "kv8": ("--kv-bits", "8"),
    "stall0": ("--max-prefill-stall-ms", "0"),  # the prefill budget off
    "nogroup": ("--no-group-rows",),
    "fuse": ("--fuse-prefill",),
    "prefill1": ("--prefill-batch-size", "1"),
    "slots2": ("--completion-batch-size", "2"),  # of three prompts at once, one waits
}


def serve_and_compare(
    workers: list[Worker], ref: dict[str, Any], cells: list[str], timeout: float
) -> dict[str, Cell]:
    """Start the workers, wait for rank 0's ready line, run the waves, compare. `cells` names
    what the first and (when given) the second wave are reported as."""
    deadline = time.monotonic() + timeout
    for worker in workers:
        worker.start()
    try:
        stop = supervise(workers, workers[0].ready.is_set, deadline)
        if stop is not None:
            return dict.fromkeys(cells, stop)
        waves = [ref["wave1"], ref["wave2"]][: len(cells)]
        results = run_waves(workers, waves, deadline)
    finally:
        for worker in workers:
            worker.kill()
    seconds = round(time.monotonic() - (deadline - timeout), 1)
    if isinstance(results, Cell):
        return dict.fromkeys(cells, Cell(results.status, results.detail, {"seconds": seconds}))
    want = ref["ref_kv8"] if cells[0] == "kv8" else ref["ref1"]
    out = {cells[0]: compare(results[0], want, ref["wave1"])}
    out[cells[0]].extra["seconds"] = seconds
    if len(cells) > 1:
        out[cells[1]] = prefix_cell(results[1], ref)
    return out


def prefix_cell(results: list[dict[str, Any]], ref: dict[str, Any]) -> Cell:
    cell = compare(results, ref["ref2"], ref["wave2"])
    if cell.status not in ("exact", "near-tie", "wrong"):
        return cell
    cached = [r["cached"] for r in results]
    cell.extra["cached_tokens"] = cached
    if cell.status == "exact" and not any(cached):
        return Cell("no-hit", "outputs exact; no prompt tokens reused", cell.extra)
    return cell


def single_cells(
    model_dir: Path,
    ref: dict[str, Any],
    cells: Sequence[str],
    timeout: float,
    arch: str = "",
    env: dict[str, str] | None = None,
) -> dict[str, Cell]:
    base = ("--model", str(model_dir), "--prompt-cache-block", BLOCK)
    out: dict[str, Cell] = {}
    for cell in ("defaults", "thread", "ngram", "kv8", *SETTING_CELLS):
        wanted = [c for c in ([cell, "prefix"] if cell == "defaults" else [cell]) if c in cells]
        if not wanted:
            continue
        if cell == "kv8":
            out[cell] = kv8_cell(arch, model_dir, ref, timeout)
            continue
        if wanted == ["prefix"]:  # the prefix cell rides on a defaults worker
            wanted = ["defaults", "prefix"]
        worker = Worker([*base, *CELL_FLAGS[cell]], env)
        found = serve_and_compare([worker], ref, wanted, timeout)
        out.update({k: v for k, v in found.items() if k in cells})
    return out


def kv8_cell(arch: str, model_dir: Path, ref: dict[str, Any], timeout: float) -> Cell:
    """`--kv-bits 8` against its reference (kv8_reference), on the kv8 variant's own build
    when the config has one. A model the worker will not quantize is refused with its reason;
    one with no quantized layer is compared with the plain reference."""
    extra: dict[str, Any] = {}
    if arch and "kv8" in load_configs()[arch].get("families", {}):
        model_dir, ref = build(arch, model_dir.parent, max(300.0, 5 * timeout), variant="kv8")
        if isinstance(ref, str):
            return Cell("build", f"the kv8 build: {ref}")
        extra["model"] = model_dir.name
        if ref["degenerate"]:
            distinct = f"distinct tokens {ref['distinct']} of {VARIETY_TOKENS}"
            return Cell("degenerate", f"the kv8 build's greedy output: {distinct}", extra)
    facts = kv8_facts(model_dir, max(300.0, 5 * timeout))
    if isinstance(facts, str):
        return Cell("build", f"the kv8 reference: {facts}", extra)
    cell = kv8_served(model_dir, ref, facts, timeout)
    cell.extra.update(extra)
    return cell


def kv8_served(
    model_dir: Path,
    ref: dict[str, Any],
    facts: dict[str, Any],
    timeout: float,
    env: dict[str, str] | None = None,
) -> Cell:
    """The worker with `--kv-bits 8` against the kv8 reference `facts` (kv8_reference)."""
    extra: dict[str, Any] = {}
    extra.update(reference=facts["kind"], group=facts["group"], kv_dims=facts["kv_dims"])
    notes = {
        "plain": f"no layer is quantized (cache kinds {', '.join(ref['cache_kinds'])})",
        "round-trip": f"mlx-lm's QuantizedKVCache fails: {facts.get('mlx_lm_error')}",
        "none": facts.get("error", ""),
    }
    if facts["kind"] in notes:
        extra["note"] = notes[facts["kind"]]
    want = ref["ref1"] if facts["kind"] == "plain" else facts.get("tokens")
    args = ["--model", str(model_dir), "--prompt-cache-block", BLOCK, "--kv-bits", "8"]
    worker = Worker(args, env)
    found = serve_and_compare([worker], {**ref, "ref_kv8": want or ref["ref1"]}, ["kv8"], timeout)
    cell = found["kv8"]
    if want is None and cell.status not in ("refused", "error", "hang", "memory"):
        cell = Cell("skipped", f"the worker served it; no reference: {facts.get('error')}")
    cell.extra.update(extra)
    return cell


def distributed_cell(
    model_dir: Path,
    ref: dict[str, Any],
    timeout: float,
    scratch: Path,
    env: dict[str, str] | None = None,
) -> Cell:
    from servicer.sysinfo import free_port

    if not ref["shard"]:
        return Cell("skipped", "the mlx-lm model has no shard() (no tensor parallelism)")
    scratch.mkdir(parents=True, exist_ok=True)
    hostfile = scratch / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{free_port()}"] for _ in range(2)]))
    args = (
        "--model",
        str(model_dir),
        "--prompt-cache-block",
        BLOCK,
        "--distributed",
        "--distributed-backend",
        "ring",
        "--distributed-timeout",
        "10",
    )
    ranks = [
        Worker(args, env={**(env or {}), "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)})
        for rank in range(2)
    ]
    return serve_and_compare(ranks, ref, ["distributed"], timeout)["distributed"]


# --------------------------------------------------------------------------- the matrix


def run_arch(arch: str, cells: Sequence[str], cache: Path, timeout: float) -> dict[str, Any]:
    started = time.monotonic()
    skipped = load_skipped()
    if arch in skipped:
        return {"cells": {c: Cell("skipped", skipped[arch]).as_dict() for c in cells}}
    model_dir, ref = build(arch, cache, timeout=max(300.0, 5 * timeout))
    if isinstance(ref, str):
        return {"cells": {c: Cell("build", ref).as_dict() for c in cells}}
    facts = {k: ref[k] for k in ("distinct", "cache_kinds", "head_dims", "shard")}
    if ref["degenerate"]:
        note = f"greedy output too uniform: distinct tokens {ref['distinct']} of {VARIETY_TOKENS}"
        return {**facts, "cells": {c: Cell("degenerate", note).as_dict() for c in cells}}
    found = single_cells(model_dir, ref, cells, timeout, arch)
    if "distributed" in cells:
        found["distributed"] = distributed_cell(model_dir, ref, timeout, model_dir / "dist")
    result = {c: found[c].as_dict() for c in cells if c in found}
    summary = " ".join(f"{c}={found[c].status}" for c in cells if c in found)
    log(f"{arch}: {summary} ({time.monotonic() - started:.0f} s)")
    return {**facts, "cells": result}


def mlx_lm_version() -> str:
    import importlib.metadata

    return importlib.metadata.version("mlx-lm")


def markdown(results: dict[str, Any], cells: Sequence[str]) -> str:
    lines = [
        f"mlx-lm {mlx_lm_version()}, {time.strftime('%Y-%m-%d')}, `make families`.",
        "",
        "| architecture | " + " | ".join(cells) + " |",
        "|---|" + "---|" * len(cells),
    ]
    for arch, result in sorted(results.items()):
        row = [result["cells"].get(c, {}).get("status", "-") for c in cells]
        lines.append(f"| {arch} | " + " | ".join(row) + " |")
    counts = []
    for cell in cells:
        tally: dict[str, int] = {}
        for result in results.values():
            status = result["cells"].get(cell, {}).get("status", "-")
            tally[status] = tally.get(status, 0) + 1
        counts.append(", ".join(f"{k} {v}" for k, v in sorted(tally.items())))
    lines += ["", "| cell | counts |", "|---|---|"]
    lines += [f"| {c} | {t} |" for c, t in zip(cells, counts, strict=True)]
    lines += ["", "Failures (first error text or first differing position):", ""]
    for arch, result in sorted(results.items()):
        for cell in cells:
            entry = result["cells"].get(cell, {})
            if entry.get("status") not in (None, "exact"):
                lines.append(f"- {arch} / {cell}: **{entry['status']}** {entry['detail']}")
    return "\n".join(lines) + "\n"


README_BEGIN = "<!-- families table: written by `make families` -->"
README_END = "<!-- end of the families table -->"


def _not_exact(result: dict[str, Any], cells: Sequence[str]) -> str:
    """A result's cells that are neither exact nor skipped, by status ("" if none)."""
    by_status: dict[str, list[str]] = {}
    for cell in cells:
        if cell not in result["cells"]:  # a real model not run in a newer cell yet
            continue
        status = result["cells"][cell]["status"]
        if status not in ("exact", "skipped"):
            by_status.setdefault(status, []).append(cell)
    return "; ".join(
        f"{status} {'everywhere' if len(found) == len(cells) else ', '.join(found)}"
        for status, found in by_status.items()
    )


def readme_summary(results: dict[str, Any], cells: Sequence[str]) -> str:
    """The README's compact table: architectures per status and cell, then every architecture
    with a cell that is neither exact nor skipped, with those cells; the real models apart."""
    reals = {a: r for a, r in results.items() if a.startswith(REAL_PREFIX)}
    tiny = {a: r for a, r in results.items() if a not in reals}
    skipped = sorted(a for a, r in tiny.items() if r["cells"][cells[0]]["status"] == "skipped")
    tested = {a: r for a, r in tiny.items() if a not in skipped}
    statuses = [
        s
        for s in STATUSES
        if any(r["cells"][c]["status"] == s for r in tested.values() for c in cells)
    ]
    lines = [
        f"mlx-lm {mlx_lm_version()}, {time.strftime('%Y-%m-%d')}: {len(tested)} architectures "
        f"({len(skipped)} more skipped, reasons in bench/families/skipped.json).",
        "",
        "| status | " + " | ".join(cells) + " |",
        "|---|" + "---|" * len(cells),
    ]
    for status in statuses:
        counts = [sum(r["cells"][c]["status"] == status for r in tested.values()) for c in cells]
        lines.append(f"| {status} | " + " | ".join(str(n) for n in counts) + " |")
    kv8_only, others = [], []
    for arch, result in sorted(tested.items()):
        parts = _not_exact(result, cells)
        if parts == "refused kv8":
            kv8_only.append(arch)
        elif parts:
            others.append(f"{arch} ({parts})")
    if kv8_only:
        others.append(
            "refused in kv8 alone (mlx-lm's attention code cannot take a quantized cache): "
            + ", ".join(kv8_only)
        )
    rest = "Neither exact nor skipped: " + "; ".join(others) + "."
    lines += ["", rest if others else "Every tested cell is exact."]
    if reals:
        described = [
            f"{a.removeprefix(REAL_PREFIX)} ({_not_exact(r, cells) or 'exact'})"
            for a, r in sorted(reals.items())
        ]
        lines += ["", "Real models (`ARGS=--real`), cells not exact: " + "; ".join(described) + "."]
    return "\n".join(lines) + "\n"


def write_readme(path: Path, summary: str) -> None:
    text = path.read_text()
    begin, end = text.index(README_BEGIN) + len(README_BEGIN), text.index(README_END)
    path.write_text(text[:begin] + "\n" + summary + text[end:])


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--only", help="comma-separated architectures (model_type names, or real:NAME)"
    )
    parser.add_argument(
        "--real",
        action="store_true",
        help=f"also the real models ({', '.join(REAL_MODELS)}; ../shared/tools/real_model.sh, "
        "4-bit by mlx_lm convert) in the same cells",
    )
    parser.add_argument("--cells", default=",".join(CELLS), help=f"subset of {','.join(CELLS)}")
    parser.add_argument("--jobs", type=int, default=1, help="architectures run at once")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per cell")
    parser.add_argument("--cache", type=Path, default=None, help="where models are built")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--markdown", type=Path, default=None, help="write the table here")
    parser.add_argument(
        "--readme", type=Path, default=None, help="after a full run, update this file's summary"
    )
    parser.add_argument(
        "--strict",
        action="store_true",
        help="exit 1 when a cell is neither exact, refused nor skipped (for a scheduled run)",
    )
    parser.add_argument("--build", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--kv8-reference", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--real-reference", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def architectures(only: str | None, real: bool = False) -> list[str]:
    """The names to run: --only's, or every architecture; with `real`, the real models too."""
    reals = [f"{REAL_PREFIX}{name}" for name in REAL_MODELS]
    known = set(load_configs()) | set(load_skipped()) | set(reals)
    if only:
        names = [name.strip() for name in only.split(",") if name.strip()]
        unknown = [name for name in names if name not in known]
        if unknown:
            raise SystemExit(f"no config for {unknown}; known: {sorted(known)}")
        return names + [r for r in reals if real and r not in names]
    return sorted(known - set(reals)) + (reals if real else [])


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.build:
        build_main(args.build, args.out, args.variant)
        return 0
    if args.kv8_reference:
        kv8_main(args.kv8_reference)
        return 0
    if args.real_reference:
        real_reference_main(args.real_reference, args.out)
        return 0
    cells = [c.strip() for c in args.cells.split(",") if c.strip()]
    if bad := [c for c in cells if c not in CELLS]:
        raise SystemExit(f"unknown cells {bad}; known: {list(CELLS)}")
    from servicer.demos.common import default_cache_dir

    cache = args.cache or default_cache_dir() / "families"
    names = architectures(args.only, args.real)
    missing = sorted(set(installed_architectures()) - set(names)) if not args.only else []
    demo_dir()  # build the tokenizer's source once, before the jobs start
    # A part again (some architectures, some cells): the rest keep their cells from the last run.
    results: dict[str, Any] = {}
    shown = list(cells)
    if args.json and args.json.exists() and (args.only or cells != list(CELLS)):
        earlier = json.loads(args.json.read_text())
        results = earlier["results"]
        shown = [c for c in CELLS if c in cells or c in earlier.get("cells", ())]
    lock = threading.Lock()

    def one(arch: str) -> None:
        if arch.startswith(REAL_PREFIX):
            result = run_real(arch.removeprefix(REAL_PREFIX), cells, cache, args.timeout)
        else:
            result = run_arch(arch, cells, cache, args.timeout)
        with lock:  # written after every architecture, so a cut-short run still reports
            results[arch] = merge_result(results.get(arch), result)
            write_outputs(args, shown, results, missing)

    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        list(pool.map(one, names))
    print(markdown(results, shown))
    complete = set(results) >= set(load_configs()) | set(load_skipped())
    tiny = [r for a, r in results.items() if not a.startswith(REAL_PREFIX)]
    every_cell = all(set(CELLS) <= set(r["cells"]) for r in tiny)
    if args.readme and complete and every_cell:
        write_readme(args.readme, readme_summary(results, CELLS))
    if missing:
        print(f"installed mlx-lm architectures without a config or a skip entry: {missing}")
    return 1 if args.strict and failing(results) else 0


def merge_result(earlier: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """An architecture's new cells over its earlier ones (a partial run keeps the rest)."""
    if earlier is None:
        return new
    return {**earlier, **new, "cells": {**earlier.get("cells", {}), **new["cells"]}}


def failing(results: dict[str, Any]) -> list[str]:
    """Every "arch / cell" that is neither exact, refused nor skipped."""
    fine = ("exact", "refused", "skipped")
    return [
        f"{arch} / {cell}"
        for arch, result in sorted(results.items())
        for cell, entry in result["cells"].items()
        if entry["status"] not in fine
    ]


def write_outputs(
    args: argparse.Namespace, cells: list[str], results: dict[str, Any], missing: list[str]
) -> None:
    payload = {"cells": cells, "results": results, "unlisted": missing}
    if args.json:
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    if args.markdown:
        args.markdown.write_text(markdown(results, cells))


if __name__ == "__main__":
    sys.exit(main())
