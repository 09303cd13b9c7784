"""`make bench` part "speculation": speculative decoding on models that show what it does.

Three setups: the demo llama with prompt lookup (it copies poorly: the plain case), a target
that costs ~10-20x the demo llama per decode step with the demo llama as its draft (built by
bench/fixtures.py, cached under ~/.cache/mlx-grpc-worker), and, when ../shared has it, the
real model (google/gemma-3-270m, ../shared/tools/real_model.sh) with prompt lookup: a real
pretrained model copies spans of its prompt, which is where prompt lookup pays.

Each setup, workload and concurrency measures in one run, interleaved: the raw BatchGenerator
without speculation (in this process), our worker without and with speculation, and with
--side-by-side smg-grpc-servicer; the worker's own metrics give the tokens per target step
and the acceptance. `python bench/speculation.py [--quick]` runs the part alone.

The real model (or `--model DIR`, which replaces the setups with that model alone) runs on
natural text through its tokenizer (with BOS, as the worker
receives it): code continuation, a passage then its start again, and plain prose. Our worker
with prompt lookup against the same worker without speculation, in one run, interleaved (the
raw BatchGenerator is left out: a second copy of a real model in this process only slows the
run down).
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _checkout  # noqa: F401  (before any `servicer` import)
import report
from fixtures import target_model_path
from load import served_run
from raw import RawEngine
from workers import (
    BatchConfig,
    Worker,
    log,
    our_worker,
    parse_levels,
    resolve_model,
    scrape_metrics,
    smg_worker,
)
from workload import (
    LevelStats,
    Shape,
    chat_prompts,
    copy_prompts,
    natural_prompts,
    percentile,
)

from servicer.demos.text import demo_model_path
from servicer.sysinfo import free_port

LEVELS = (1, 2, 4, 8, 16)
MAX_TOKENS = 64
ROUNDS = 2
K = 4  # --speculate-k
SHAPE = Shape(0, MAX_TOKENS)  # the prompts are given; every answer is MAX_TOKENS long


@dataclass(frozen=True)
class Setup:
    name: str
    model: Path
    flags: tuple[str, ...]
    draft: Path | None = None  # the draft model, whose step the ideal speed-up counts
    real: bool = False  # a real model: natural-text workloads, no raw reference


def _drafting() -> tuple[Path, tuple[str, ...], Path]:
    llama = demo_model_path("llama")
    return target_model_path(), ("--speculate", "draft", "--draft-model", str(llama)), llama


def _lookup(kind: str) -> Callable[[], tuple[Path, tuple[str, ...], None]]:
    return lambda: (demo_model_path(kind), ("--speculate", "ngram"), None)


# Each demo setup's name and its (model, flags, draft), built on first use: only when chosen.
SETUPS: dict[str, Callable[[], tuple[Path, tuple[str, ...], Path | None]]] = {
    "target, demo llama drafting": _drafting,
    "demo llama, prompt lookup": _lookup("llama"),
    "demo hybrid, prompt lookup": _lookup("hybrid"),
    "demo gemma3, prompt lookup": _lookup("gemma3"),
}


def setup_names(wanted: list[str] | None) -> list[str]:
    """The demo setups whose name contains one of `wanted` (all of them for None). A word that
    matches none (other than `real`, the real model) is an error, never an empty run."""
    if wanted is None:
        return list(SETUPS)
    unknown = [w for w in wanted if w != "real" and not any(w in name for name in SETUPS)]
    if unknown or not wanted:
        raise ValueError(
            f"--setups {','.join(wanted)!r}: {unknown or 'nothing'} matches no setup "
            f"(setups: {'; '.join(SETUPS)}; and `real`)"
        )
    return [name for name in SETUPS if any(w in name for w in wanted)]


def setups(wanted: list[str] | None = None) -> list[Setup]:
    return [Setup(name, *SETUPS[name]()) for name in setup_names(wanted)]


def workloads(model: Path) -> dict[str, list[list[int]]]:
    """Copy-heavy (the answer repeats spans of the prompt) and genai-style text."""
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(model)
    return {"copy-heavy": copy_prompts(tokenizer), "genai-style": chat_prompts(tokenizer)}


# --------------------------------------------------------------------------- a real model

REAL_LEVELS = {"code": (1,), "passage, then its start": (1,), "prose": (1, 4, 16)}


def real_workloads(model: Path) -> dict[str, list[list[int]]]:
    """Each workload's prompts through the model's tokenizer, BOS first."""
    from mlx_lm.utils import load_tokenizer

    return natural_prompts(load_tokenizer(model))


def real_setup(model: str) -> Setup:
    path = resolve_model(model)
    assert path is not None
    return Setup(f"{path.name}, prompt lookup", path, ("--speculate", "ngram"), real=True)


# --------------------------------------------------------------------------- one run


def speculation_metrics(port: int) -> dict[str, float]:
    """The worker's speculation counters, from its /metrics."""
    names = {
        "drafted": "mlx_worker_speculation_drafted_tokens_total",
        "accepted": "mlx_worker_speculation_accepted_tokens_total",
        "row_steps": "mlx_worker_speculation_tokens_per_row_step_count",
        "tokens": "mlx_worker_speculation_tokens_per_row_step_sum",
        "steps_off": "mlx_worker_speculation_steps_off_total",
    }
    values = scrape_metrics(port, list(names.values()))
    return {key: values[name] for key, name in names.items()}


@dataclass
class Cell:
    """One setup, workload and concurrency: every run of each worker, and the counters."""

    runs: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, stats: LevelStats, raw: LevelStats | None) -> None:
        ratio = stats.tokens_per_s / raw.tokens_per_s if raw and raw.tokens_per_s else None
        self.runs.setdefault(name, []).append(
            {
                "tokens_per_s": stats.tokens_per_s,
                "ratio_to_raw": ratio,
                "ttft_p50_ms": stats.ttft_p50_ms,
                "itl_p50_ms": stats.itl_p50_ms,
                "itl_p99_ms": stats.itl_p99_ms,
                "errors": stats.errors,
            }
        )

    def median(self, name: str, key: str) -> float | None:
        return percentile([r[key] for r in self.runs.get(name, []) if r[key] is not None], 50)

    def summary(self, draft_ratio: float, verify: list[float]) -> dict[str, Any]:
        """Ratios to raw, the speed-up over speculation off, and how close it comes to the
        ideal: tokens per target step / (1 + K * draft step / target step); and to the ideal
        on this machine, whose verify forward of 1 + K tokens costs `verify[K]` plain ones."""
        on, off = self.median("on", "tokens_per_s"), self.median("off", "tokens_per_s")
        speedup = on / off if on and off else None
        counters = self.counters
        per_step = counters["tokens"] / counters["row_steps"] if counters.get("row_steps") else None
        drafted_per_step = counters["drafted"] / counters["row_steps"] if per_step else 0.0
        ideal = per_step / (1 + drafted_per_step * draft_ratio) if per_step else None
        verify_cost = _read_off(verify, 1 + drafted_per_step) if verify else 1.0
        machine_ideal = (
            per_step / (verify_cost + drafted_per_step * draft_ratio) if per_step else None
        )
        return {
            "on_to_raw": self.median("on", "ratio_to_raw"),
            "off_to_raw": self.median("off", "ratio_to_raw"),
            "smg_to_raw": self.median("smg", "ratio_to_raw"),
            "speedup": speedup,
            "tokens_per_step": per_step,
            "acceptance": counters["accepted"] / counters["drafted"]
            if counters.get("drafted")
            else None,
            "ideal": ideal,
            "efficiency": speedup / ideal if speedup and ideal else None,
            "machine_ideal": machine_ideal,
            "machine_efficiency": speedup / machine_ideal if speedup and machine_ideal else None,
            "steps_off": counters.get("steps_off", 0.0),
            "ttft_on_ms": self.median("on", "ttft_p50_ms"),
            "ttft_off_ms": self.median("off", "ttft_p50_ms"),
            "itl_p50_on_ms": self.median("on", "itl_p50_ms"),
            "itl_p99_on_ms": self.median("on", "itl_p99_ms"),
            "errors": sum(r["errors"] for runs in self.runs.values() for r in runs),
        }


# --------------------------------------------------------------------------- the part


def step_times(model: Any, prompt: list[int], steps: int = 40, warmup: int = 5) -> list[float]:
    """Seconds per decode step at batch 1 (mlx-lm's generate_step, one yield per token)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    times, last = [], time.perf_counter()
    for _ in generate_step(mx.array(prompt), model, max_tokens=steps + warmup):
        now = time.perf_counter()
        times.append(now - last)
        last = now
    return times[warmup:]


def draft_step_ratio(setup: Setup, prompt: list[int]) -> float:
    """A draft decode step ÷ a target decode step at batch 1 (0 for prompt lookup)."""
    if setup.draft is None:
        return 0.0
    from mlx_lm import load

    steps = {}
    for name, path in (("draft", setup.draft), ("target", setup.model)):
        model, _ = load(str(path))
        steps[name] = percentile(step_times(model, prompt, steps=40), 50) or 0.0
    return steps["draft"] / steps["target"] if steps["target"] else 0.0


def verify_costs(setup: Setup, prompt: list[int], widths: range, repeats: int = 30) -> list[float]:
    """A target forward of w tokens ÷ one of 1 token, at batch 1 on the prompt's cache, for
    each w in `widths` (taking turns, median of `repeats`): what a verify costs on this
    machine. A memory-bound device (a Mac, a GPU at small batches) reads ~1 for every w."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    model, _ = load(str(setup.model))
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([prompt]), cache=cache))
    times: dict[int, list[float]] = {w: [] for w in widths}
    for _ in range(repeats + 3):
        for w in widths:
            tic = time.perf_counter()
            mx.eval(model(mx.array([prompt[-w:]]), cache=cache))
            times[w].append(time.perf_counter() - tic)
            trim_prompt_cache(cache, w)
    one = percentile(times[1][3:], 50) or 1.0
    return [(percentile(times[w][3:], 50) or 0.0) / one for w in widths]


def _read_off(costs: list[float], width: float) -> float:
    """costs[i] is width i + 1's; in between, on the line."""
    low = min(int(width), len(costs))
    high = min(low + 1, len(costs))
    share = width - low
    return costs[low - 1] + share * (costs[high - 1] - costs[low - 1])


def measure_setup(
    setup: Setup, levels: tuple[int, ...], rounds: int, smg_python: Path | None, log_dir: Path
) -> dict[str, Any]:
    batch = BatchConfig(completion_batch_size=32, prefill_batch_size=8)
    prompts = real_workloads(setup.model) if setup.real else workloads(setup.model)
    first = next(iter(prompts.values()))[0] if setup.real else prompts["genai-style"][0]
    ratio = draft_step_ratio(setup, first)
    verify = verify_costs(setup, first, range(1, K + 2), repeats=10 if setup.real else 30)
    raw = None if setup.real else RawEngine(setup.model)
    metrics_port = free_port()
    flags = (*setup.flags, "--speculate-k", str(K), "--metrics-port", str(metrics_port))
    tag = re.sub(r"\W+", "-", setup.name)
    workers: dict[str, Worker] = {
        "off": our_worker(setup.model, batch, log_dir, f"{tag}-off", ("--speculate", "off")),
        "on": our_worker(setup.model, batch, log_dir, f"{tag}-on", flags),
    }
    if smg_python is not None:
        workers["smg"] = smg_worker(smg_python, setup.model, batch, log_dir, tag)
    result: dict[str, Any] = {"draft_step_ratio": ratio, "verify_costs": verify, "cells": {}}
    try:
        for worker in workers.values():
            worker.start()
        for workload, chosen in prompts.items():
            for level in REAL_LEVELS[workload] if setup.real else levels:
                cell = measure_cell(raw, workers, chosen, level, rounds, metrics_port)
                summary = cell.summary(ratio, verify)
                result["cells"][f"{workload} c={level}"] = {"runs": cell.runs, **summary}
                log(
                    f"speculation {setup.name}, {workload}, c={level}: on ÷ raw "
                    f"{_fmt(summary['on_to_raw'])}, speed-up {_fmt(summary['speedup'])}, "
                    f"{_fmt(summary['tokens_per_step'])} tokens/step, acceptance "
                    f"{_fmt(summary['acceptance'])}"
                )
    finally:
        for worker in workers.values():
            worker.stop()
        if raw is not None:
            raw.close()
    return result


def measure_cell(
    raw: RawEngine | None,
    workers: dict[str, Worker],
    prompts: list[list[int]],
    level: int,
    rounds: int,
    metrics_port: int,
) -> Cell:
    """Warm-ups at this batch shape, then `rounds` of each worker in turn (the order flips
    every round, so a drift in the machine's speed does not favour one side)."""
    # A real model: each prompt once at c=1, one wave of requests above (its steps are long).
    # The demo models: runs of a second or more (shorter ones are this machine's noise).
    requests = max(len(prompts), level) if raw is None else max(16, 4 * level)
    cell = Cell()
    if raw is not None:
        raw.run(level, SHAPE, requests=level, prompts=prompts)
    for worker in workers.values():
        served_run(worker.address, prompts, level, MAX_TOKENS, level)
    before = speculation_metrics(metrics_port)
    for round_ in range(rounds):
        reference = None
        if raw is not None:
            reference = raw.run(level, SHAPE, requests=requests, prompts=prompts)
        if reference is not None:
            cell.add("raw", reference, reference)
        order = list(workers.items())
        for name, worker in order[::-1] if round_ % 2 else order:
            stats = served_run(worker.address, prompts, level, MAX_TOKENS, requests)
            cell.add(name, stats, reference)
    after = speculation_metrics(metrics_port)
    cell.counters = {key: after[key] - before[key] for key in after}
    return cell


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def render(results: dict[str, Any]) -> str:
    """The part's table (Markdown)."""
    lines = [
        "| setup | workload | c | on ÷ raw | off ÷ raw | smg ÷ raw | speed-up (on ÷ off) | "
        "tokens/target step | acceptance | ideal | efficiency | ideal here | efficiency here | "
        "TTFT p50 on / off ms | ITL p50 / p99 on ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for setup, result in results.items():
        for cell, s in result["cells"].items():
            workload, level = cell.rsplit(" c=", 1)
            lines.append(
                f"| {setup} | {workload} | {level} | {_fmt(s['on_to_raw'])} | "
                f"{_fmt(s['off_to_raw'])} | {_fmt(s['smg_to_raw'])} | {_fmt(s['speedup'])} | "
                f"{_fmt(s['tokens_per_step'])} | {_fmt(s['acceptance'])} | {_fmt(s['ideal'])} | "
                f"{_fmt(s['efficiency'])} | {_fmt(s.get('machine_ideal'))} | "
                f"{_fmt(s.get('machine_efficiency'))} | {_fmt(s['ttft_on_ms'], 1)} / "
                f"{_fmt(s['ttft_off_ms'], 1)} | {_fmt(s['itl_p50_on_ms'], 2)} / "
                f"{_fmt(s['itl_p99_on_ms'], 2)} |"
            )
    ratios = ", ".join(
        f"{name}: {r['draft_step_ratio']:.3f}"
        for name, r in results.items()
        if r["draft_step_ratio"]
    )
    if ratios:
        lines.append(f"\nDraft step ÷ target step at batch 1: {ratios}.")
    verify = "; ".join(
        f"{name}: " + " / ".join(f"{c:.2f}" for c in r["verify_costs"])
        for name, r in results.items()
        if r.get("verify_costs")
    )
    if verify:
        lines.append(
            f"A target forward of 1 .. {K + 1} tokens ÷ one of 1 token at batch 1 (what a verify "
            f"costs here; 'ideal here' divides by it): {verify}."
        )
    return "\n".join(lines)


def run_part(
    levels: tuple[int, ...] = LEVELS,
    rounds: int = ROUNDS,
    smg_python: Path | None = None,
    log_dir: Path = Path("bench/results/logs"),
    wanted: list[str] | None = None,
    model: str | None = None,
) -> dict[str, Any]:
    log_dir.mkdir(parents=True, exist_ok=True)
    chosen = [real_setup(model)] if model is not None else setups(wanted)
    if model is None and wanted is not None and "real" in wanted:  # 20+ minutes: only when asked
        chosen.append(real_setup("real"))
    return {s.name: measure_setup(s, levels, rounds, smg_python, log_dir) for s in chosen}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="levels 1 and 16, one round")
    parser.add_argument(
        "--levels", type=parse_levels, help="concurrency levels, e.g. 1,4 (default 1,2,4,8,16)"
    )
    parser.add_argument("--rounds", type=int, help=f"runs of each worker per level ({ROUNDS})")
    parser.add_argument(
        "--setups", help="only setups whose name contains one of these (a,b; `real`: real model)"
    )
    parser.add_argument("--side-by-side", action="store_true")
    parser.add_argument(
        "--model",
        help="`real` (google/gemma-3-270m from ../shared/tools) or a model directory: measure "
        "it alone on code, a passage then its start, and prose",
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    wanted = None
    if args.setups is not None:
        wanted = [word.strip() for word in args.setups.split(",") if word.strip()]
    try:
        setup_names(wanted)
    except ValueError as error:
        parser.error(str(error))
    smg = None
    if args.side_by_side:
        from workers import smg_servicer_python

        smg = smg_servicer_python()
    levels, rounds = ((1, 16), 1) if args.quick else (LEVELS, ROUNDS)
    if args.levels:
        levels = tuple(args.levels)
    rounds = args.rounds or rounds
    results = run_part(levels, rounds, smg, args.out / "logs", wanted, args.model)
    print(render(results))
    report.save_json(args.out, "speculation", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
