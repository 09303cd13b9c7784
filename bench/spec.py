"""Speculative decoding on one model: what it buys at batch 1, and what verifying costs.

    python bench/spec.py [--model DIR] [--tokens 128] [--k-max 4] [--out results/spec.json]

1. Decode at batch 1, greedy, with prompt-lookup speculation and without (mlx-lm's own
   BatchGenerator), on (a) corpus passages followed by their start again and (b) random
   text (corpus words in random order): tokens per target step, acceptance, decode tok/s,
   and whether the tokens were identical. `--draft DIR` adds a draft-model column.
2. The cost of one target forward with 1 vs K+1 tokens per row at batch 1..32 over a
   cached context: the ratio is what a step of verification costs in plain steps, so
   speculation pays while the tokens it emits per row-step exceed it. The break-even
   acceptance is the per-token acceptance a where (1 - a^(K+1)) / (1 - a) equals the ratio.

Prints tables and writes the numbers as JSON. Absolute times mean something only on the
machine they came from (MLX on CPU here); nothing asserts speed.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import mlx.core as mx  # noqa: E402
from mlx_lm import load  # noqa: E402
from mlx_lm.generate import BatchGenerator  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from servicer.demo_model import demo_model_path  # noqa: E402
from servicer.engine.speculation import (  # noqa: E402
    PromptLookup,
    SpeculationConfig,
    SpeculativeBatchGenerator,
)
from servicer.engine.speculation.draft_model import DraftModel  # noqa: E402

CORPUS = ROOT / "servicer" / "demo_corpus.txt"


def prompt_sets(tokenizer: Any, count: int, length: int) -> dict[str, list[list[int]]]:
    text = CORPUS.read_text(encoding="utf-8")
    passages = [p.strip() for p in text.split("\n\n") if len(p.strip()) > 300][:count]
    repeated = []
    for passage in passages:
        ids = list(tokenizer.encode(passage, add_special_tokens=False))[:length]
        repeated.append(ids + ids[: len(ids) // 2])
    words = text.split()
    rng = random.Random(0)
    shuffled = []
    for _ in range(count):
        ids = tokenizer.encode(" ".join(rng.choices(words, k=length)), add_special_tokens=False)
        shuffled.append(list(ids)[: length + length // 2])
    return {"repeat": repeated, "random": shuffled}


def decode(generator: BatchGenerator, prompt: list[int], tokens: int) -> dict[str, Any]:
    """One request alone; decode time runs from its first token to its last."""
    generator.insert([prompt], max_tokens=[tokens])
    out: list[int] = []
    steps, started = 0, None
    while len(out) < tokens:
        _, responses = generator.next()
        if started is not None:
            steps += 1
        for response in responses:
            if started is None:
                started = time.perf_counter()
            out.append(response.token)
    assert started is not None
    seconds = time.perf_counter() - started
    return {"tokens": out, "steps": steps, "seconds": seconds}


def batch1_rows(model: Any, sets: dict, args: argparse.Namespace, draft: Any) -> list[dict]:
    """Each mode over every prompt of a set, modes interleaved, `--rounds` times: the
    medians of the rounds (the machine is shared; interleaving spreads its noise)."""
    config = SpeculationConfig(k_max=args.k_max)
    makers = {
        "off": lambda: BatchGenerator(model),
        "ngram": lambda: SpeculativeBatchGenerator(
            model, source=PromptLookup(args.ngram), speculation=config
        ),
    }
    if draft is not None:
        makers["draft"] = lambda: SpeculativeBatchGenerator(
            model, source=DraftModel(draft), speculation=config
        )
    for make in makers.values():
        decode(make(), next(iter(sets.values()))[0][:8], 8)  # warm-up: compile, allocate
    rows = []
    for name, prompts in sets.items():
        rounds: dict[str, list[list[dict]]] = {mode: [] for mode in makers}
        for _ in range(args.rounds):
            for mode, make in makers.items():
                runs = []
                for prompt in prompts:
                    generator = make()
                    runs.append(decode(generator, prompt, args.tokens))
                    runs[-1]["stats"] = getattr(generator, "speculation", None)
                rounds[mode].append(runs)
        reference = [r["tokens"] for r in rounds["off"][0]]
        for mode, runs in rounds.items():
            rows.append(_decode_row(name, mode, runs, reference, args.tokens))
    return rows


def _decode_row(
    name: str, mode: str, rounds: list[list[dict]], reference: list, tokens: int
) -> dict[str, Any]:
    runs = rounds[0]
    decoded = sum(tokens - 1 for _ in runs)  # the first token comes with prefill
    steps = sum(r["steps"] for r in runs)
    seconds = statistics.median(sum(r["seconds"] for r in runs) for runs in rounds)
    row = {
        "prompts": name,
        "mode": mode,
        "tokens_per_step": decoded / steps,
        "decode_tok_s": decoded / seconds,
        "identical_to_off": all([r["tokens"] for r in runs] == reference for runs in rounds),
    }
    stats = [r["stats"] for r in runs]
    if stats[0] is not None:
        drafted = sum(s.drafted for s in stats)
        row["acceptance"] = sum(s.accepted for s in stats) / drafted if drafted else 0.0
        row["drafted_per_step"] = drafted / steps
    return row


def forward_costs(model: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Median seconds of one forward with 1, 2, 3 and K+1 new tokens per row, and what
    acceptance K = width - 1 drafts need to pay for the wider forward."""
    widths = sorted({1, 2, 3, args.k_max + 1})
    rows = []
    for batch in args.batches:
        cache = [c.merge([c] * batch) for c in _context(model)]
        samples: dict[int, list[float]] = {w: [] for w in widths}
        for repeat in range(args.repeats + 2):
            for width in widths:  # interleaved, so every width sees the same machine
                inputs = mx.zeros((batch, width), dtype=mx.uint32)
                start = time.perf_counter()
                mx.eval(model(inputs, cache=cache))
                if repeat >= 2:
                    samples[width].append(time.perf_counter() - start)
                for layer in cache:
                    layer.trim(width)
        times = {w: statistics.median(values) for w, values in samples.items()}
        row: dict[str, Any] = {"batch": batch, "ms_1": 1000 * times[1]}
        for width in widths[1:]:
            ratio = times[width] / times[1]
            row[f"ratio_{width}"] = ratio
            row[f"break_even_k{width - 1}"] = _break_even(ratio, width - 1)
        rows.append(row)
    return rows


def _context(model: Any, length: int = 256) -> list[Any]:
    cache = make_prompt_cache(model)
    model(mx.array([[i % 300 + 10 for i in range(length)]]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def _break_even(ratio: float, k: int) -> float | None:
    """Per-token acceptance at which K drafts emit `ratio` tokens per step."""
    if ratio <= 1.0:
        return 0.0
    if ratio >= k + 1:
        return None  # never pays
    low, high = 0.0, 1.0
    for _ in range(50):
        a = (low + high) / 2
        if sum(a**i for i in range(k + 1)) < ratio:
            low = a
        else:
            high = a
    return low


def table(rows: list[dict[str, Any]]) -> str:
    headers = list(rows[0])
    for row in rows[1:]:
        headers += [h for h in row if h not in headers]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for row in rows:
        cells = [_cell(row.get(h)) for h in headers]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--draft", type=Path, default=None, help="a draft model directory")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--k-max", type=int, default=4)
    parser.add_argument(
        "--ngram", type=lambda s: tuple(int(x) for x in s.split(",")), default=(3, 2)
    )
    parser.add_argument("--repeats", type=int, default=20, help="forwards per cell")
    parser.add_argument("--rounds", type=int, default=3, help="decode rounds per mode")
    parser.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--only", choices=["decode", "forward"], default=None)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "spec.json")
    args = parser.parse_args()
    args.batches = args.batches or [1, 2, 4, 8, 16, 32]
    model, tokenizer = load(str(args.model or demo_model_path("llama")))
    draft = load(str(args.draft))[0] if args.draft else None
    sets = prompt_sets(tokenizer, args.prompts, 120)
    decoding, costs = [], []
    if args.only != "forward":
        decoding = batch1_rows(model, sets, args, draft)
        print(f"## Decode at batch 1, {args.tokens} tokens, greedy, K max {args.k_max}, ", end="")
        print(f"n-grams {args.ngram}\n")
        print(table(decoding))
    if args.only != "decode":
        costs = forward_costs(model, args)
        print("\n## One target forward over a 256-token context, W tokens per row vs 1\n")
        print("ratio_W: its time over one token's; break_even_kK: the per-token acceptance at")
        print("which K drafts emit that many tokens per step (- : never)\n")
        print(table(costs))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "decode": decoding,
        "forward": costs,
        "k_max": args.k_max,
        "tokens": args.tokens,
        "ngram": args.ngram,
    }
    args.out.write_text(json.dumps(record, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
