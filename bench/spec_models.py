"""Bench fixtures for speculative decoding, built on first use and cached like the demo models.

    spec_model_path("copier")  # a demo llama that copies spans of its input, as real LLMs do
    spec_model_path("target")  # a ~10x costlier target whose natural draft is the demo llama

Both use the demo models' tokenizer (its files are copied), load with ``mlx_lm.load`` and
serve with ``--model PATH``. The target is a llama; the copier is mlx-lm's ``smollm3`` (a
llama that can switch RoPE off per layer, which its copy circuit needs). Both are built from
the demo llama's weights by construction, not training (see each builder's docstring), in a
few seconds on top of the demo llama's own build. They live in bench/ rather than in
``servicer.demo_model`` because no test uses them. Builds land in the demo cache
(``MLX_GRPC_WORKER_CACHE``, default ~/.cache/mlx-grpc-worker) as ``spec-KIND-s0-...``, keyed
on the demo ``RECIPE_VERSION`` and ``SPEC_VERSION``, behind a lock file, and are byte-for-byte
deterministic from the seed.

Usage: ``python bench/spec_models.py [copier|target ...]`` (prints the paths).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import spec_copier

from servicer import demo_model
from servicer.demo_model import (
    DEMO_SEED,
    RECIPE_VERSION,
    SPECIAL_TOKENS,
    default_cache_dir,
    demo_model_path,
    is_finished_build,
)

log = logging.getLogger(__name__)

# Bump whenever anything that changes the built files changes (data, schedules, shapes).
SPEC_VERSION = "1"
_COPY_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)


def spec_kinds() -> list[str]:
    return sorted(_BUILDERS)


def spec_build_name(kind: str, seed: int = DEMO_SEED) -> str:
    if kind not in _BUILDERS:
        raise ValueError(f"unknown spec fixture {kind!r}; known: {spec_kinds()}")
    return f"spec-{kind}-s{seed}-{RECIPE_VERSION}.{SPEC_VERSION}"


def spec_model_path(kind: str, cache_dir: Path | None = None, seed: int = DEMO_SEED) -> Path:
    """Path of the cached fixture `kind`, building it on first use (seconds, plus the demo llama).

    Safe across processes: builders serialise on a lock file in the cache directory.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache_dir / spec_build_name(kind, seed)
    if is_finished_build(target):
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        if is_finished_build(target):  # another process built it while we waited
            return target
        log.info("building the %s spec fixture into %s (first use, seconds)", kind, target)
        base = demo_model_path("llama", cache_dir=cache_dir)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=cache_dir))
        try:
            _BUILDERS[kind](tmp, base, seed)
            os.chmod(tmp, 0o755)  # mkdtemp makes it private; a model cache should be readable
            shutil.rmtree(target, ignore_errors=True)  # an unfinished leftover, never a build
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


# --------------------------------------------------------------------------- shared steps


def _save(
    out: Path, base: Path, weights: dict[str, Any], config: dict[str, Any], kind: str, seed: int
) -> None:
    """Write a fixture in mlx-lm's layout: float32 weights, config, the demo tokenizer files."""
    import mlx.core as mx

    for name in _COPY_FILES:  # the very same tokenizer as the demo models
        shutil.copy(base / name, out / name)
    # float32, like the demo models (bf16 near-ties flip greedy picks).
    arrays = {k: mx.array(v).astype(mx.float32) for k, v in sorted(weights.items())}
    mx.save_safetensors(str(out / "model.safetensors"), arrays, metadata={"format": "mlx"})
    config = {k: v for k, v in config.items() if k != "quantization"}
    config["demo_build"] = {
        "kind": f"spec-{kind}",
        "seed": seed,
        "version": f"{RECIPE_VERSION}.{SPEC_VERSION}",
        "base": base.name,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _base_weights(base: Path) -> tuple[Any, dict[str, np.ndarray], dict[str, Any]]:
    """The demo llama: the loaded model, its weights as float32 numpy arrays, its config."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    model, config = load_model(base)
    params = tree_flatten(model.parameters())
    return model, {k: np.array(v.astype(mx.float32)) for k, v in params}, config


def _special_ids(base: Path) -> dict[str, int]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(base / "tokenizer.json"))
    return {tok: tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS}


def _final_rms_max(model: Any, base: Path) -> float:
    """The largest rms of the llama's last hidden state (before its final norm) over the corpus
    prose: the copier sizes its boost so that it wins even there."""
    import mlx.core as mx
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(base / "tokenizer.json"))
    prose, _ = demo_model._read_corpus()
    largest = 0.0
    for start in range(0, len(prose), 8):
        ids = _encode(tokenizer, "\n".join(prose[start : start + 8]))
        hidden = model.model.embed_tokens(mx.array([ids]))
        for layer in model.model.layers:
            hidden = layer(hidden, "causal", None)
        largest = max(largest, float(mx.sqrt(mx.mean(hidden * hidden, axis=-1)).max()))
    return largest


def _encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


# --------------------------------------------------------------------------- the copier


def _build_copier(out: Path, base: Path, seed: int) -> None:
    """Bench fixture: the demo llama plus a hand-built copy circuit, for prompt lookup.

    The demo llama (2 layers, d=128, trained on 13 KB of text) barely copies: n-gram drafts
    taken from its prompt are rarely what it says next, so prompt lookup looks useless on it,
    while real LLMs copy spans of their input well and gain a lot. Training induction heads
    into it takes far longer than a CPU build allows (a 200-step fine-tune on copy documents
    grew none), so this model is built, not trained (see bench/spec_copier.py): the llama's
    weights unchanged, plus three layers in front that find the earlier occurrences of the
    last 3 tokens and add a large logit to the token that followed them, when every
    occurrence agrees on it and the text is not looping with a period of 8 or less. It also starts
    every chat reply by repeating the user's message (an echo: it does not read the request).
    Elsewhere it is the llama (logits within 0.1; 99 % of greedy picks agree). It costs ~9x
    the llama per decode step (an 864-wide stream). A bench fixture only: no test uses it.
    """
    model, weights, config = _base_weights(base)
    rms_hi = _final_rms_max(model, base)
    built, dim = spec_copier.copier_weights(weights, _special_ids(base), seed, rms_hi)
    _save(out, base, built, spec_copier.copier_config(config, dim), "copier", seed)


# --------------------------------------------------------------------------- the target

TARGET_LAYERS = 24  # the llama's 2 plus 22 new ones: the decode step is mostly per-layer work
TARGET_MLP = 1024  # the llama's is 256
TARGET_NOISE = 0.6  # new layers' residual outputs at this fraction of a fresh layer's


def _build_target(out: Path, base: Path, seed: int) -> None:
    """Bench fixture: a target ~10x costlier per decode step, whose natural draft is the llama.

    Training a large model on this CPU is out of reach, so it is built from the demo llama:
    its two trained layers stay first and last (MLPs widened from 256 to 1024 units whose new
    output weights are zero, so they change nothing), and 22 freshly initialised llama layers
    (mlx-lm's default init, seeded) go between them with their attention and MLP output
    projections scaled by TARGET_NOISE. Those layers are untrained: they perturb the llama's
    hidden state rather than improve it, so where the target disagrees with its draft it is
    not "right" in any sense, it is just different, about as often as a real draft/target
    pair (K=4 greedy drafts from the llama are ~75 % accepted on corpus prompts, measured by
    bench/spec_fixtures.py). Its decode step costs 11-18x the llama's on CPU (24 layers instead
    of 2, ~30x the weights). No fine-tune: one step of it takes ~5-10 s here, and a few
    dozen at a rate that moves it at all pulled acceptance down to ~0.26 (tried). A bench
    fixture only: no test uses it.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    _, weights, config = _base_weights(base)
    config = {k: v for k, v in config.items() if k != "demo_build"}
    config.update(num_hidden_layers=TARGET_LAYERS, intermediate_size=TARGET_MLP)
    mx.random.seed(seed)  # the new layers' init uses MLX's global generator, as the demo's does
    fresh_model = llama.Model(llama.ModelArgs.from_dict(config))
    fresh = {k: np.array(v.astype(mx.float32)) for k, v in tree_flatten(fresh_model.parameters())}
    built = _deepened(weights, fresh, int(weights["model.layers.0.mlp.down_proj.weight"].shape[1]))
    _save(out, base, built, config, "target", seed)


def _deepened(
    base: dict[str, np.ndarray], fresh: dict[str, np.ndarray], base_mlp: int
) -> dict[str, np.ndarray]:
    """`fresh` (the target's shape) with the llama's layers first and last, the rest damped."""
    weights = dict(fresh)
    weights["model.embed_tokens.weight"] = base["model.embed_tokens.weight"]
    weights["model.norm.weight"] = base["model.norm.weight"]
    placed = {0: 0, 1: TARGET_LAYERS - 1}  # llama layer -> target layer
    for old, new in placed.items():
        src, dst = f"model.layers.{old}.", f"model.layers.{new}."
        for name in base:
            if name.startswith(src) and ".mlp." not in name:
                weights[dst + name[len(src) :]] = base[name]
        for part in ("gate_proj", "up_proj"):  # the first units are the llama's
            weights[f"{dst}mlp.{part}.weight"][:base_mlp] = base[f"{src}mlp.{part}.weight"]
        down = np.zeros_like(weights[f"{dst}mlp.down_proj.weight"])
        down[:, :base_mlp] = base[f"{src}mlp.down_proj.weight"]  # the new units write nothing
        weights[f"{dst}mlp.down_proj.weight"] = down
    for layer in set(range(TARGET_LAYERS)) - set(placed.values()):
        for part in ("self_attn.o_proj", "mlp.down_proj"):
            weights[f"model.layers.{layer}.{part}.weight"] *= TARGET_NOISE
    return weights


_BUILDERS: dict[str, Callable[[Path, Path, int], None]] = {
    "copier": _build_copier,
    "target": _build_target,
}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kinds", nargs="*", metavar="KIND", help=f"default: all of {spec_kinds()}")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.kinds) - set(spec_kinds()))
    if unknown:
        parser.error(f"unknown fixture(s) {unknown}; known: {spec_kinds()}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for kind in args.kinds or spec_kinds():
        start = time.perf_counter()
        path = spec_model_path(kind)
        print(path)
        print(f"{kind} ready in {time.perf_counter() - start:.1f}s", file=sys.stderr)


if __name__ == "__main__":
    main()
