"""Tiny demo checkpoints in mlx-lm's on-disk format, built locally from a seed.

Tests and the default server need a real model but must never download one, so this
module trains a byte-level BPE tokenizer on a small bundled corpus, random-initialises a
tiny mlx-lm architecture and trains it briefly (deterministically) so that greedy output
is varied text rather than one repeated token. Every model kind shares the same tokenizer;
a kind is just another entry in ``_RECIPES``.

Usage: ``python -m servicer.demos.text [--kind llama] [--seed 0] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from .common import (
    BOS_TOKEN,
    EOS_TOKEN,
    MODEL_FILES,
    MODEL_MAX_LENGTH,
    SPECIAL_TOKENS,
    build_atomically,
    cached_build,
    default_cache_dir,
    has_files,
    special_token_ids,
    write_model_files,
    write_tokenizer_configs,
)

DEMO_MODEL_KIND = "llama"
DEMO_SEED = 0
# Bump whenever anything that changes the built files changes (corpus, tokenizer,
# configs, training recipe): cached builds are keyed on it.
RECIPE_VERSION = "v3"
VOCAB_SIZE = 512

# Deliberately minimal Jinja (loops, ifs, subscripts) so the Rust minijinja engine used
# by the router renders it identically to Python's jinja2.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

# Prompts whose greedy continuations the tests check for variety (plain text, encoded
# without special tokens).
TEST_PROMPTS: tuple[str, ...] = (
    "The river",
    "In the morning",
    "She opened the",
    "Tell me about the old library",
    "When the train",
    "A good soup",
    "Our cat",
    "Numbers have",
)

_CORPUS_PATH = Path(__file__).with_name("corpus.txt")
_CHAT_RE = re.compile(r"^User: (?P<user>.+)\nAssistant: (?P<assistant>.+)$", re.MULTILINE)


@dataclass(frozen=True)
class _Recipe:
    """How to build one model kind: its mlx-lm config and its training schedule.

    The defaults were tuned on a 2-core CPU, where MLX runs a matmul at only a few
    GFLOP/s: a ~20 s budget buys ~40k training tokens, which is enough (with these
    settings) to get from unigram babble to memorised-corpus-like, varied text.
    """

    config: Mapping[str, Any]  # config.json minus the tokenizer-derived fields
    architecture: str
    steps: int = 80
    batch_size: int = 16  # sequences per step, split evenly across `shards`
    seq_len: int = 32  # short windows learn faster than long ones at this budget
    # Each step's batch is split into this many shards whose gradients are computed on
    # parallel threads (MLX's CPU backend runs one op at a time per stream) and averaged
    # in a fixed order, so the result never depends on thread timing or core count.
    shards: int = 2
    learning_rate: float = 1e-2
    final_lr_fraction: float = 0.1
    warmup_steps: int = 10
    betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = 0.0
    chat_repeats: int = 2  # chat samples are short; repeat them so <|end|> is learned
    # Training runs in bf16: MLX's own bf16 CPU gemm is ~2x faster than its fp32 (reference
    # BLAS) path. The saved weights are float32 (see _build_into).
    dtype: str = "bfloat16"


def _config(
    model_type: str, layers: Mapping[str, Any], heads: Mapping[str, Any], rest: Mapping[str, Any]
) -> Mapping[str, Any]:
    """A kind's config.json fields: the sizes every kind shares (width 128, 2 layers, 4 query
    heads of 32, 2 KV heads, MLP 256), with its own layer fields after the layer count, its
    own attention fields after the heads' and the rest at the end."""
    return MappingProxyType(
        {
            "model_type": model_type,
            "hidden_size": 128,
            "num_hidden_layers": 2,
            **layers,
            "intermediate_size": 256,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            **heads,
            "max_position_embeddings": MODEL_MAX_LENGTH,
            "rope_theta": 10000.0,
            **rest,
        }
    )


_RECIPES: Mapping[str, _Recipe] = MappingProxyType(
    {
        "llama": _Recipe(
            architecture="LlamaForCausalLM",
            config=_config(
                "llama",
                layers={},
                heads={},
                rest={
                    "rms_norm_eps": 1e-5,
                    "tie_word_embeddings": True,
                    "hidden_act": "silu",
                    "attention_bias": False,
                    "mlp_bias": False,
                },
            ),
        ),
        # Gated-DeltaNet layer then a full-attention layer: make_cache() mixes
        # ArraysCache (conv + recurrent state) and KVCache. Dense MLPs (no experts).
        "hybrid": _Recipe(
            architecture="Qwen3NextForCausalLM",
            steps=60,  # learns faster per step than llama, and its steps cost more wall time
            config=_config(
                "qwen3_next",
                layers={"full_attention_interval": 2},
                heads={
                    "partial_rotary_factor": 0.5,
                    "linear_num_key_heads": 2,
                    "linear_num_value_heads": 4,
                    "linear_key_head_dim": 32,
                    "linear_value_head_dim": 32,
                    "linear_conv_kernel_dim": 4,
                    "num_experts": 0,
                    "num_experts_per_tok": 0,
                    "decoder_sparse_step": 1,
                    "mlp_only_layers": [],
                    "moe_intermediate_size": 0,
                    "shared_expert_intermediate_size": 0,
                },
                rest={"rms_norm_eps": 1e-6, "tie_word_embeddings": True, "hidden_act": "silu"},
            ),
        ),
        # A sliding-window layer (RotatingKVCache, window 16) then a global one (KVCache).
        "gemma3": _Recipe(
            architecture="Gemma3ForCausalLM",
            config=_config(
                "gemma3_text",
                layers={
                    "sliding_window": 16,
                    "sliding_window_pattern": 2,
                    "layer_types": ["sliding_attention", "full_attention"],
                },
                heads={"query_pre_attn_scalar": 32},
                rest={
                    "rope_local_base_freq": 10000.0,
                    "rms_norm_eps": 1e-6,
                    "tie_word_embeddings": True,
                    "hidden_activation": "gelu_pytorch_tanh",
                },
            ),
        ),
    }
)


def available_kinds() -> list[str]:
    return sorted(_RECIPES)


def _recipe(kind: str) -> _Recipe:
    try:
        return _RECIPES[kind]
    except KeyError:
        raise ValueError(f"unknown demo model kind {kind!r}; known: {available_kinds()}") from None


def build_name(kind: str = DEMO_MODEL_KIND, seed: int = DEMO_SEED) -> str:
    """Directory name of a cached build; changes whenever the recipe does."""
    _recipe(kind)
    return f"demo-{kind}-s{seed}-{RECIPE_VERSION}"


def is_finished_build(path: Path) -> bool:
    return has_files(path, MODEL_FILES)


def build_model(path: Path, kind: str = DEMO_MODEL_KIND, seed: int = DEMO_SEED) -> Path:
    """Build the demo model `kind` into directory `path` and return `path`.

    The build happens in a temporary sibling directory that is renamed into place, so
    `path` never holds a partial build. If `path` already holds a finished build it is
    returned untouched. Note: this reseeds MLX's global random generator.
    """
    recipe = _recipe(kind)
    return build_atomically(
        path, is_finished_build, lambda tmp: _build_into(tmp, kind, recipe, seed), "demo model"
    )


def demo_model_path(kind: str = DEMO_MODEL_KIND, cache_dir: Path | None = None) -> Path:
    """Path of the cached demo model for `kind`, building it on first use.

    Safe across processes: builders serialise on a lock file in the cache directory.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return cached_build(
        cache_dir / build_name(kind, DEMO_SEED),
        is_finished_build,
        lambda target: build_model(target, kind, DEMO_SEED),
        f"the {kind} demo model",
    )


# --------------------------------------------------------------------------- building


def _read_corpus() -> tuple[list[str], list[tuple[str, str]]]:
    """Split the corpus into prose paragraphs and (user, assistant) exchanges."""
    text = _CORPUS_PATH.read_text(encoding="utf-8")
    prose: list[str] = []
    chats: list[tuple[str, str]] = []
    for block in re.split(r"\n\s*\n", text.strip()):
        block = block.strip()
        if match := _CHAT_RE.fullmatch(block):
            chats.append((match["user"], match["assistant"]))
        elif block:
            prose.append(block)
    return prose, chats


def _render_chat(messages: Sequence[Mapping[str, str]], add_generation_prompt: bool) -> str:
    # The same template the tokenizer ships, rendered the way transformers does.
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(CHAT_TEMPLATE).render(
        messages=list(messages),
        add_generation_prompt=add_generation_prompt,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
    )


def _train_tokenizer(corpus_text: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    # No prefix space, so encode/decode round-trips text exactly.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        # Every byte is in the vocab, so any text is encodable.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus_text.splitlines(keepends=True), trainer)
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer has {tokenizer.get_vocab_size()} tokens, want {VOCAB_SIZE}")
    return tokenizer


def _write_tokenizer_files(out: Path, tokenizer) -> dict[str, int]:
    tokenizer.save(str(out / "tokenizer.json"))
    write_tokenizer_configs(out, (), CHAT_TEMPLATE, {})
    return {tok: tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS}


def _training_stream(tokenizer, rng, chat_repeats: int):
    """One long token stream: prose paragraphs and chat samples in a seeded order."""
    import numpy as np

    prose, chats = _read_corpus()
    # One newline between paragraphs: with "\n\n" the model learns "\n" -> "\n" and greedy
    # decoding falls into newline loops.
    docs = [p + "\n" for p in prose]
    for user, assistant in chats:
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        docs.extend([_render_chat(messages, add_generation_prompt=False)] * chat_repeats)
    ids: list[int] = []
    for i in rng.permutation(len(docs)):
        ids.extend(tokenizer.encode(docs[i], add_special_tokens=False).ids)
    return np.asarray(ids, dtype=np.int32)


def _model_config(kind: str, recipe: _Recipe, seed: int, ids: Mapping[str, int]) -> dict:
    return {
        "architectures": [recipe.architecture],
        **recipe.config,
        "vocab_size": VOCAB_SIZE,
        **special_token_ids(ids),
        "torch_dtype": "float32",
        # Ignored by loaders; records which recipe produced the weights.
        "demo_build": {"kind": kind, "seed": seed, "version": RECIPE_VERSION},
    }


def _optimizer(recipe: _Recipe):
    """AdamW with a linear warm-up, then cosine decay to a fraction of the peak rate."""
    import mlx.optimizers as optim

    schedule = optim.join_schedules(
        [
            optim.linear_schedule(
                recipe.learning_rate / recipe.warmup_steps,
                recipe.learning_rate,
                recipe.warmup_steps,
            ),
            optim.cosine_decay(
                recipe.learning_rate,
                recipe.steps - recipe.warmup_steps,
                recipe.learning_rate * recipe.final_lr_fraction,
            ),
        ],
        [recipe.warmup_steps],
    )
    return optim.AdamW(
        learning_rate=schedule,
        betas=list(recipe.betas),
        weight_decay=recipe.weight_decay,
        bias_correction=True,  # matters in a run this short
    )


def _train(model, replicas: Sequence[Any], data, recipe: _Recipe, rng) -> None:
    """Train `model` in place on random windows of `data`, one shard per replica."""
    import mlx.core as mx
    import mlx.nn as nn
    import numpy as np
    from mlx.utils import tree_map

    steps, length, shards = recipe.steps, recipe.seq_len, len(replicas)
    per_shard = recipe.batch_size // shards
    # The whole batch order is fixed up front.
    starts = rng.integers(0, len(data) - length - 1, (steps, shards, per_shard))
    windows = data[starts[..., None] + np.arange(length + 1)]
    optimizer = _optimizer(recipe)

    def loss_fn(replica, tokens):
        logits = replica(tokens[:, :-1])
        return nn.losses.cross_entropy(logits, tokens[:, 1:], reduction="mean")

    grad_fns = [nn.value_and_grad(replica, loss_fn) for replica in replicas]
    local = threading.local()

    def shard_grads(index: int, params, tokens):
        # MLX streams are per thread; each worker thread gets its own CPU stream.
        if not hasattr(local, "stream"):
            local.stream = mx.new_stream(mx.cpu)
        with mx.stream(local.stream):
            replicas[index].update(params)
            loss, grads = grad_fns[index](replicas[index], mx.array(tokens))
            mx.eval(loss, grads)
        return grads

    with ThreadPoolExecutor(max_workers=shards, thread_name_prefix="demo-train") as pool:
        for step in range(steps):
            params = model.parameters()
            shard_results = list(
                pool.map(shard_grads, range(shards), [params] * shards, windows[step])
            )
            # Equal shard sizes: the mean of shard gradients is the full-batch gradient.
            grads = shard_results[0]
            for other in shard_results[1:]:
                grads = tree_map(mx.add, grads, other)
            grads = tree_map(lambda g: g / shards, grads)
            optimizer.update(model, grads)
            mx.eval(model.parameters(), optimizer.state)


def _new_model(module, args, config: Mapping[str, Any]):
    model = module.Model(args)
    if config.get("tie_word_embeddings") and "lm_head" in model:
        # Some architectures (gemma3_text) always make an lm_head and only tie on load,
        # when the checkpoint has none; train tied so the saved weights match that.
        del model["lm_head"]
        model.tie_word_embeddings = True
    return model


def _build_into(out: Path, kind: str, recipe: _Recipe, seed: int) -> None:
    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten

    tokenizer = _train_tokenizer(_CORPUS_PATH.read_text(encoding="utf-8"))
    ids = _write_tokenizer_files(out, tokenizer)
    config = _model_config(kind, recipe, seed, ids)
    order_rng, batch_rng = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(2))

    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    args = module.ModelArgs.from_dict(config)
    dtype = getattr(mx, recipe.dtype)
    mx.random.seed(seed)  # parameter init uses MLX's global generator
    model = _new_model(module, args, config)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    # Shard workers run copies of the architecture loaded with the current weights.
    replicas = [_new_model(module, args, config) for _ in range(recipe.shards)]
    data = _training_stream(tokenizer, order_rng, recipe.chat_repeats)
    _train(model, replicas, data, recipe, batch_rng)

    # Served in float32: bf16 rounding makes near-ties between the top two logits common,
    # and then batched and single-sequence runs (or a sharded one) may pick differently.
    model.set_dtype(mx.float32)
    weights = dict(sorted(tree_flatten(model.parameters())))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    write_model_files(out, config, ids)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", default=DEMO_MODEL_KIND, choices=available_kinds())
    parser.add_argument("--seed", type=int, default=DEMO_SEED, help="only with --out")
    parser.add_argument("--out", type=Path, help="build here instead of the shared cache")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    if args.out is not None:
        path = build_model(args.out, args.kind, args.seed)
    else:
        if args.seed != DEMO_SEED:
            parser.error("--seed needs --out (the cache holds only the default seed)")
        path = demo_model_path(args.kind)
    print(path)
    print(f"ready in {time.perf_counter() - start:.1f}s", file=sys.stderr)


if __name__ == "__main__":
    main()
