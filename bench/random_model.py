"""A random-weight llama of a realistic size, for speed measurements where no model can be
downloaded (a GPU machine with no network): the demo model's tokenizer, 4-bit weights.

    python bench/random_model.py --out /tmp/llama-1b --layers 16 --hidden 2048

Its output is noise; throughput and latency are what a trained model of that shape gives.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import llama

from servicer.demo_model import demo_model_path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--bits", type=int, default=4, help="0: keep bf16")
    parser.add_argument("--like", type=Path, help="tokenizer source (default: the demo model)")
    args = parser.parse_args(argv)
    source = args.like or demo_model_path()
    base = json.loads((source / "config.json").read_text())
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": args.hidden,
        "num_hidden_layers": args.layers,
        "intermediate_size": args.intermediate,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.hidden // args.heads,
        "max_position_embeddings": base["max_position_embeddings"],
        "vocab_size": base["vocab_size"],
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "bos_token_id": base.get("bos_token_id"),
        "eos_token_id": base.get("eos_token_id"),
        "pad_token_id": base.get("pad_token_id"),
    }
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    model.set_dtype(mx.bfloat16)
    if args.bits:
        nn.quantize(model, group_size=64, bits=args.bits)
        config["quantization"] = {"group_size": 64, "bits": args.bits}
    args.out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(args.out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (args.out / "config.json").write_text(json.dumps(config, indent=2))
    for name in (*TOKENIZER_FILES, "generation_config.json"):
        if (source / name).is_file():
            shutil.copy(source / name, args.out / name)
    params = sum(v.size for _, v in tree_flatten(model.parameters()))
    print(
        f"{args.out}: {args.layers} layers, hidden {args.hidden}, {params / 1e6:.0f}M stored values"
    )


if __name__ == "__main__":
    main()
