"""The bench's fixture models: every model the bench builds rather than loads, in one place.

    python bench/fixtures.py random --out /tmp/llama-1b --layers 16 --hidden 2048
    python bench/fixtures.py target            # prints the speculation target's path

- **random**: a random-weight llama of a realistic size with the demo tokenizer, 4-bit, for
  speed runs where no model can be downloaded (its output is noise; its speed is real).
- **real-shape** (`real_shape_llama`): the same builder in memory, float16, head_dim 128, for
  kv-quant's KV bytes (bytes do not depend on the weights).
- **target**: a ~10-20x costlier target whose natural draft is the demo llama, for the
  speculation part's draft setup; built on first use into the demo model cache
  (`MLX_GRPC_WORKER_CACHE`, default ~/.cache/mlx-grpc-worker) as `spec-target-s0-...`, keyed
  on the demo `RECIPE_VERSION` and `TARGET_VERSION`, behind a lock file, deterministic.

The demo models themselves are the package's (`servicer.demos.text`).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import _checkout  # noqa: F401  (before any `servicer` import)

from servicer.demos.common import default_cache_dir
from servicer.demos.text import DEMO_SEED, RECIPE_VERSION, demo_model_path, is_finished_build

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)
# Bump whenever anything that changes the target's built files changes.
TARGET_VERSION = "1"
TARGET_LAYERS = 24  # the llama's 2 plus 22 new ones: the decode step is mostly per-layer work
TARGET_MLP = 1024  # the llama's is 256
TARGET_NOISE = 0.6  # new layers' residual outputs at this fraction of a fresh layer's


def llama_config(
    layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int, **extra: Any
) -> dict[str, Any]:
    """An mlx-lm llama config of this shape (head_dim = hidden / heads)."""
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": intermediate,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        **extra,
    }


def random_llama(config: dict[str, Any], dtype: str = "bfloat16", seed: int = 0) -> Any:
    import mlx.core as mx
    from mlx_lm.models import llama

    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    model.set_dtype(getattr(mx, dtype))
    return model


def real_shape_llama() -> tuple[Any, int]:
    """A llama of real shape for KV bytes (2 layers suffice: every layer is alike)."""
    config = llama_config(2, 1024, 2048, 8, 8, vocab_size=512)
    return random_llama(config, "float16"), config["num_hidden_layers"]


def save_model(out: Path, weights: dict[str, Any], config: dict[str, Any], source: Path) -> None:
    """Write a model in mlx-lm's layout, with `source`'s tokenizer files."""
    import mlx.core as mx

    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, out / name)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def build_random(args: argparse.Namespace) -> None:
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    source = args.like or demo_model_path()
    base = json.loads((source / "config.json").read_text())
    keep = ("max_position_embeddings", "vocab_size", "bos_token_id", "eos_token_id")
    config = llama_config(
        args.layers,
        args.hidden,
        args.intermediate,
        args.heads,
        args.kv_heads,
        **{key: base.get(key) for key in (*keep, "pad_token_id")},
    )
    model = random_llama(config)
    if args.bits:
        nn.quantize(model, group_size=64, bits=args.bits)
        config["quantization"] = {"group_size": 64, "bits": args.bits}
    weights = dict(tree_flatten(model.parameters()))
    save_model(args.out, weights, config, source)
    stored = sum(v.size for v in weights.values()) / 1e6
    print(f"{args.out}: {args.layers} layers, hidden {args.hidden}, {stored:.0f}M stored values")


# --------------------------------------------------------------------------- the target


def target_model_path(cache_dir: Path | None = None, seed: int = DEMO_SEED) -> Path:
    """The cached target, built on first use (seconds, plus the demo llama); safe across
    processes: builders serialise on a lock file in the cache directory."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache_dir / f"spec-target-s{seed}-{RECIPE_VERSION}.{TARGET_VERSION}"
    if is_finished_build(target):
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        if is_finished_build(target):  # another process built it while we waited
            return target
        base = demo_model_path("llama", cache_dir=cache_dir)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=cache_dir))
        try:
            _build_target(tmp, base, seed)
            os.chmod(tmp, 0o755)  # mkdtemp makes it private; a model cache should be readable
            shutil.rmtree(target, ignore_errors=True)  # an unfinished leftover, never a build
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _build_target(out: Path, base: Path, seed: int) -> None:
    """A target ~10x costlier per decode step, whose natural draft is the demo llama.

    Training a large model on this CPU is out of reach, so it is built from the demo llama:
    its two trained layers stay first and last (MLPs widened from 256 to 1024 units whose new
    output weights are zero, so they change nothing), and 22 freshly initialised llama layers
    (mlx-lm's default init, seeded) go between them with their attention and MLP output
    projections scaled by TARGET_NOISE. Those layers are untrained: they perturb the llama's
    hidden state rather than improve it, so where the target disagrees with its draft it is
    just different, about as often as a real draft/target pair (K=4 greedy drafts from the
    llama are ~75 % accepted on corpus prompts). Its decode step costs 11-18x the llama's on
    CPU (24 layers instead of 2, ~30x the weights).
    """
    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    model, config = load_model(base)
    weights = {k: np.array(v.astype(mx.float32)) for k, v in tree_flatten(model.parameters())}
    config = {k: v for k, v in config.items() if k not in ("demo_build", "quantization")}
    config.update(num_hidden_layers=TARGET_LAYERS, intermediate_size=TARGET_MLP)
    # The new layers' init uses MLX's global generator, as the demo's does.
    fresh_model = random_llama(config, "float32", seed)
    fresh = {k: np.array(v) for k, v in tree_flatten(fresh_model.parameters())}
    built = _deepened(weights, fresh, int(weights["model.layers.0.mlp.down_proj.weight"].shape[1]))
    version = f"{RECIPE_VERSION}.{TARGET_VERSION}"
    config["demo_build"] = {"kind": "spec-target", "seed": seed, "version": version}
    config["demo_build"]["base"] = base.name
    # float32, like the demo models (bf16 near-ties flip greedy picks).
    arrays = {k: mx.array(v).astype(mx.float32) for k, v in sorted(built.items())}
    save_model(out, arrays, config, base)


def _deepened(base: dict[str, Any], fresh: dict[str, Any], base_mlp: int) -> dict[str, Any]:
    """`fresh` (the target's shape) with the llama's layers first and last, the rest damped."""
    import numpy as np

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    kinds = parser.add_subparsers(dest="kind", required=True)
    random = kinds.add_parser("random", help="a random-weight llama of a realistic size")
    random.add_argument("--out", type=Path, required=True)
    random.add_argument("--layers", type=int, default=16)
    random.add_argument("--hidden", type=int, default=2048)
    random.add_argument("--intermediate", type=int, default=5632)
    random.add_argument("--heads", type=int, default=16)
    random.add_argument("--kv-heads", type=int, default=4)
    random.add_argument("--bits", type=int, default=4, help="0: keep bf16")
    random.add_argument("--like", type=Path, help="tokenizer source (default: the demo model)")
    kinds.add_parser("target", help="the speculation target (cached; prints its path)")
    args = parser.parse_args(argv)
    if args.kind == "random":
        build_random(args)
    else:
        print(target_model_path())
    return 0


if __name__ == "__main__":
    sys.exit(main())
