"""What attention groups save when a long prompt joins short streams, in process: k rows
decoding (300-token prompts), then one long prompt inserted; each `BatchGenerator.next()` timed,
with the rows in one padded batch (mlx-lm's way) and in groups (servicer/engine/row_groups.py),
alternating, on the same prompts. Every row's tokens are compared between the two.

    python bench/row_groups.py [--model real] [--cases 8:8000,2:8000] [--rounds 2] [--out DIR]

Columns: the streams' median step before the long prompt arrives; the join step (where the
long row's first token comes: its last prefill piece, its first forward and the join); the
streams' median step after it, while the long row decodes. Preload OpenBLAS on a Linux CPU
(README) for real-model figures.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import _checkout  # noqa: F401  (before any `servicer` import)
import report
from workers import model_or_demo, resolve_model

SHORT_PROMPT = 300
STREAM_TOKENS = 10_000  # the streams outlast the measurement
AFTER_STEPS = 8  # steps measured after the join


def run_case(
    model: Any, rows: int, long_tokens: int, grouped: bool, new_tokens: int
) -> dict[str, Any]:
    import mlx.core as mx

    from servicer.engine.cache_kinds import grouped as grouping
    from servicer.engine.runner import BatchRunner

    runner = BatchRunner(model, grouping=grouping if grouped else None)
    prompts = [[(7 * i + j) % 5000 + 100 for j in range(SHORT_PROMPT)] for i in range(rows)]
    streams = runner.insert(prompts, max_tokens=[STREAM_TOKENS] * rows)
    tokens: dict[int, list[int]] = {uid: [] for uid in streams}

    def step() -> tuple[float, set[int]]:
        start = time.perf_counter()
        _, responses = runner.next()
        elapsed = time.perf_counter() - start
        for r in responses:
            tokens.setdefault(r.uid, []).append(r.token)
        return elapsed, {r.uid for r in responses}

    while not all(tokens[uid] for uid in streams):
        step()
    before = [step()[0] for _ in range(4)]
    (long_uid,) = runner.insert(
        [[(11 * j) % 7000 + 50 for j in range(long_tokens)]], max_tokens=[new_tokens]
    )
    prefill = []
    while True:
        elapsed, uids = step()
        if long_uid in uids:
            join = elapsed
            break
        prefill.append(elapsed)
    after = [step()[0] for _ in range(AFTER_STEPS)]
    runner.close()
    mx.clear_cache()
    return {
        "before_ms": statistics.median(before) * 1000,
        "prefill_s": sum(prefill),
        "join_ms": join * 1000,
        "after_ms": statistics.median(after) * 1000,
        "tokens": {str(uid): t for uid, t in tokens.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="real", help="real, demo, or a model directory")
    parser.add_argument("--cases", default="8:8000,2:8000", help="streams:long-prompt tokens,...")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)

    from mlx_lm import load

    from servicer.engine import fused_prefill

    model_dir = model_or_demo(None if args.model == "demo" else resolve_model(args.model))
    model, _ = load(str(model_dir))
    if not fused_prefill.enable_fused_prefill(model):
        raise SystemExit(f"{model_dir}: an architecture row groups do not cover")
    cases = [tuple(int(x) for x in c.split(":")) for c in args.cases.split(",")]
    results: list[dict[str, Any]] = []
    table = []
    for rows, long_tokens in cases:
        for r in range(args.rounds):
            order = [False, True] if r % 2 == 0 else [True, False]
            pair = {g: run_case(model, rows, long_tokens, g, AFTER_STEPS + 2) for g in order}
            same = list(pair[False]["tokens"].values()) == list(pair[True]["tokens"].values())
            for g in order:
                res = pair[g]
                row = {
                    "streams": rows,
                    "long_tokens": long_tokens,
                    "round": r + 1,
                    "grouped": g,
                    "before_ms": round(res["before_ms"], 1),
                    "prefill_s": round(res["prefill_s"], 2),
                    "join_ms": round(res["join_ms"], 1),
                    "after_ms": round(res["after_ms"], 1),
                    "same_tokens": same,
                }
                results.append(row)
                table.append(
                    [
                        f"{rows}:{long_tokens}",
                        r + 1,
                        "groups" if g else "one padded batch",
                        f"{row['before_ms']:.0f}",
                        f"{row['prefill_s']:.1f}",
                        f"{row['join_ms']:.0f}",
                        f"{row['after_ms']:.0f}",
                        "yes" if same else "NO",
                    ]
                )
                print(" | ".join(str(c) for c in table[-1]), file=sys.stderr, flush=True)
    headers = [
        "streams:prompt",
        "round",
        "rows",
        "step before (ms)",
        "prefill (s)",
        "join step (ms)",
        "step after (ms)",
        "same tokens",
    ]
    print(report.markdown_table(headers, table))
    report.save_json(args.out, "row-groups", {"model": str(model_dir), "runs": results})
    return 0 if all(r["same_tokens"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
