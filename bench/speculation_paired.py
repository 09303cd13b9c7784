"""Speculation on (the default: prompt lookup, the clocks deciding) against off, in process,
to a few percent: the engine's own runner both ways on the demo models, each holding the
same `c` rows that decode without end, stepped in alternating chunks in which every row gains
`--tokens` tokens, each chunk timed to its last token's evaluation. Chunks of tokens, not of
steps, keep both at the same context lengths, where a step costs the same. A chunk of one and
the next of the other make a pair; the table gives the median of the pairs' on ÷ off (tokens
a second) and a bootstrap 90 % interval, the share of steps that drafted and the tokens a row
got per step. Each row's tokens are compared between the two (greedy: they must be the same).

    python bench/speculation_paired.py [--kinds llama,hybrid,gemma3] [--levels 1,2,4,8]
        [--workloads genai-style,copy-heavy] [--chunks 50] [--tokens 16] [--out DIR]

The demo models only: rows that decode without end are a steady state of the clocks, not a
workload (a real model falls into repeating itself, which prompt lookup copies perfectly).
Served runs (bench/speculation.py) vary 10-15 % run to run on a shared CPU, more than the
3 % this has to show; paired chunks of one process cancel the machine's drift. Preload
OpenBLAS on a Linux CPU (README). About 2 minutes with the defaults.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import _checkout  # noqa: F401  (before any `servicer` import)
import report
from workers import parse_levels
from workload import chat_prompts, copy_prompts

KINDS = ("llama", "hybrid", "gemma3")
WORKLOADS = {"genai-style": chat_prompts, "copy-heavy": copy_prompts}
ENDLESS = 1_000_000  # max_tokens: the rows outlast the measurement


def interval(pairs: list[float], draws: int = 2000) -> tuple[float, float]:
    """A bootstrap 90 % interval of the median of `pairs`."""
    draw = random.Random(0)
    medians = sorted(statistics.median(draw.choices(pairs, k=len(pairs))) for _ in range(draws))
    return medians[draws // 20], medians[draws - 1 - draws // 20]


class Rows:
    """One runner holding the rows, and every token each row got so far."""

    def __init__(self, runner: Any, prompts: list[list[int]]) -> None:
        from servicer.engine.parts import warm_up

        self.runner = runner
        warm_up(runner, 1)
        self.uids = runner.insert(prompts, max_tokens=[ENDLESS] * len(prompts))
        self.tokens: dict[int, list[int]] = {uid: [] for uid in self.uids}

    def gain(self, n: int) -> int:
        """Steps until every row has `n` more tokens; the tokens that took."""
        goal = {uid: len(self.tokens[uid]) + n for uid in self.uids}
        got = 0
        while any(len(self.tokens[uid]) < want for uid, want in goal.items()):
            responses = self.runner.next()[1]
            for r in responses:
                self.tokens[r.uid].append(r.token)
            got += len(responses)
        return got


def measure(parts: Any, config: Any, prompts: list[list[int]], chunks: int, gain: int) -> dict:
    import mlx.core as mx

    from servicer.engine.parts import new_runner
    from servicer.engine.speculation import SpeculationCounters

    stream = mx.new_stream(mx.default_device())
    seconds: dict[str, list[float]] = {"off": [], "on": []}
    with mx.stream(stream):
        rows = {
            name: Rows(new_runner(parts, config, stream, SpeculationCounters(), speculate), prompts)
            for name, speculate in (("off", False), ("on", True))
        }
        for each in rows.values():
            each.gain(3 * gain)  # the prompts' prefill, and the clocks' first windows
        before = rows["on"].runner.speculation
        for k in range(chunks):
            for name in ("off", "on") if k % 2 == 0 else ("on", "off"):
                if name == "on":
                    rows[name].runner.after_pause()
                mx.synchronize()
                start = time.perf_counter()
                got = rows[name].gain(gain)
                mx.synchronize()
                seconds[name].append((time.perf_counter() - start) / got)
        after = rows["on"].runner.speculation
        for each in rows.values():
            each.runner.close()
    pairs = [off / on for off, on in zip(seconds["off"], seconds["on"], strict=True)]
    pairs_of_rows = zip(rows["off"].uids, rows["on"].uids, strict=True)
    same = all(
        rows["off"].tokens[a][:n] == rows["on"].tokens[b][:n]
        for a, b in pairs_of_rows
        for n in [min(len(rows["off"].tokens[a]), len(rows["on"].tokens[b]))]
    )
    low, high = interval(pairs)
    drafted = after.speculative_steps - before.speculative_steps
    stepped = after.steps - before.steps
    return {
        "off_ms_per_token": 1000 * statistics.median(seconds["off"]),
        "on_over_off": statistics.median(pairs),
        "interval_90": [low, high],
        "drafting_steps": drafted / max(stepped, 1),
        "tokens_per_row_step": (after.emitted - before.emitted) / max(stepped, 1) / len(prompts),
        "same_tokens": same,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--levels", type=parse_levels, default=[1, 2, 4, 8])
    parser.add_argument("--chunks", type=int, default=50, help="chunks of each, alternating")
    parser.add_argument("--tokens", type=int, default=16, help="tokens a row gains a chunk")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)

    from mlx_lm.utils import load_tokenizer

    from servicer.demos.text import demo_model_path
    from servicer.engine import EngineConfig
    from servicer.engine.parts import build_parts
    from servicer.model_files import ModelSpec, prepare_model_files

    config = EngineConfig(prompt_cache_size=0)
    results, table = [], []
    for kind in args.kinds.split(","):
        path = demo_model_path(kind)
        parts = build_parts(config, prepare_model_files(ModelSpec(str(path))).info)
        tokenizer = load_tokenizer(path)
        for workload in args.workloads.split(","):
            texts = WORKLOADS[workload](tokenizer)
            for level in args.levels:
                draw = random.Random(level)
                prompts = [texts[draw.randrange(len(texts))] for _ in range(level)]
                got = measure(parts, config, prompts, args.chunks, args.tokens)
                results.append({"kind": kind, "workload": workload, "c": level, **got})
                low, high = got["interval_90"]
                table.append(
                    [
                        f"demo {kind}",
                        workload,
                        level,
                        f"{got['off_ms_per_token']:.3f}",
                        f"{got['on_over_off']:.3f}",
                        f"{low:.3f}-{high:.3f}",
                        f"{100 * got['drafting_steps']:.0f} %",
                        f"{got['tokens_per_row_step']:.2f}",
                        "yes" if got["same_tokens"] else "NO",
                    ]
                )
                print(" | ".join(str(c) for c in table[-1]), file=sys.stderr, flush=True)
    headers = [
        "model",
        "workload",
        "c",
        "off: ms a token",
        "on ÷ off",
        "90 % interval",
        "steps drafting",
        "tokens a row-step",
        "same tokens",
    ]
    print(report.markdown_table(headers, table))
    settings = {"chunks": args.chunks, "tokens": args.tokens, "levels": args.levels}
    report.save_json(args.out, "speculation-paired", {"settings": settings, "cells": results})
    return 0 if all(r["same_tokens"] for r in results) else 1


if __name__ == "__main__":
    report.exit_now(main())
