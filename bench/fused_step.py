"""What a fused prefill step saves, in process: two rows decoding and one prompt's chunk, as
separate forwards (decode, then chunk: mlx-lm's way) against one packed forward
(servicer/engine/fused_prefill.py), with the decode step and the chunk alone for scale.

    python bench/fused_step.py [--model real] [--chunk 128] [--repeats 5]

Medians of the repeats after one warm-up; each forward's caches are trimmed back after it, so
every repeat sees the same contexts (rows at 300 tokens, the prompt at 1,000). Preload OpenBLAS
on a Linux CPU (README) for real-model figures.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _checkout  # noqa: F401  (before any `servicer` import)
import report
from workers import resolve_model

ROW_CONTEXT = 300
PROMPT_CONTEXT = 1000


def _trim(caches: list[Any], tokens: int) -> None:
    for cache in caches:
        if cache.is_trimmable():
            cache.trim(tokens)


def measure(model_dir: Path, chunk: int, repeats: int) -> dict[str, float]:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import _merge_caches
    from mlx_lm.models.cache import make_prompt_cache

    from servicer.engine import fused_prefill

    model, _ = load(str(model_dir))
    if not fused_prefill.enable_fused_prefill(model):
        raise SystemExit(f"{model_dir}: an architecture fused prefill does not cover")
    rows = [make_prompt_cache(model) for _ in range(2)]
    for cache in rows:
        model(mx.array([[5] * ROW_CONTEXT]), cache=cache)
        mx.eval([c.state for c in cache])
    decode = _merge_caches(rows)
    prompt = _merge_caches([make_prompt_cache(model)])
    model(mx.array([[9] * PROMPT_CONTEXT]), cache=prompt)
    mx.eval([c.state for c in prompt])
    inputs = mx.array([[3], [4]])
    tokens = mx.array([list(range(200, 200 + chunk))])

    def decode_step() -> None:
        mx.eval(model(inputs, cache=decode).argmax(-1))
        _trim(decode, 1)

    def chunk_alone() -> None:
        model.model(tokens, cache=prompt)
        mx.eval([c.state for c in prompt])
        _trim(prompt, chunk)

    def separate() -> None:
        logits = model(inputs, cache=decode)
        mx.eval(logits.argmax(-1))
        model.model(tokens, cache=prompt)
        mx.eval([c.state for c in prompt])
        _trim(decode, 1)
        _trim(prompt, chunk)

    def fused() -> None:
        logits = fused_prefill.packed_forward(model, tokens, prompt, inputs, decode)
        mx.eval(logits.argmax(-1), [c.state for c in prompt])
        _trim(decode, 1)
        _trim(prompt, chunk)

    cases: dict[str, Callable[[], None]] = {
        "decode": decode_step,
        "chunk": chunk_alone,
        "separate": separate,
        "fused": fused,
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for repeat in range(repeats + 1):
        for name, run in cases.items():
            start = time.perf_counter()
            run()
            if repeat:  # the first is a warm-up
                times[name].append((time.perf_counter() - start) * 1000)
    return {name: statistics.median(values) for name, values in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="real", help="`real`, `real:NAME` or a directory")
    parser.add_argument("--chunk", type=int, default=128, help="prompt tokens in the chunk")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    model_dir = resolve_model(args.model)
    assert model_dir is not None
    ms = measure(model_dir, args.chunk, args.repeats)
    saved = (ms["separate"] - ms["fused"]) / ms["decode"]
    print(
        f"\n{model_dir.name}: 2 rows at {ROW_CONTEXT} tokens, a {args.chunk}-token chunk at "
        f"{PROMPT_CONTEXT}; medians of {args.repeats}\n"
    )
    print("| decode step | chunk alone | decode, then chunk | fused | saved ÷ decode step |")
    print("|---|---|---|---|---|")
    print(
        f"| {ms['decode']:.0f} ms | {ms['chunk']:.0f} ms | {ms['separate']:.0f} ms "
        f"| {ms['fused']:.0f} ms | {saved:.2f} |"
    )
    report.save_json(args.out, "fused-step", {"model": str(model_dir), "chunk": args.chunk, **ms})
    return 0


if __name__ == "__main__":
    sys.exit(main())
