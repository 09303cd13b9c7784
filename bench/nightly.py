"""`make nightly`: genai-bench through the smg router, ours beside the raw engine (and
smg-grpc-servicer), with a history, a verdict and trends. The bench's one genai-bench harness.

    python bench/nightly.py                       # the full set on the demo model
    python bench/nightly.py --quick               # smoke run: D(100,100) at c=1,4, < 5 min
    python bench/nightly.py --model real          # the real model (../shared/tools/real_model.sh)
    python bench/nightly.py --side-by-side        # smg-grpc-servicer as a second reference
    python bench/nightly.py --history PATH        # default bench/results/nightly-history.jsonl
    python bench/nightly.py --side-by-side --scenario "D(2000,200)" --concurrency 4,8,16
                                                  # an ad-hoc comparison: its own series

The scenario set is fixed: genai-bench D(100,100) and D(1000,100) at concurrency 1, 4 and 16
through the real `smg` router to our worker (bench/genai.py's router and genai-bench runner).
`--quick` runs D(100,100) at 1 and 4 with 32 requests each (about 1.5 minutes on the demo model).
`--scenario`, `--concurrency`, `--max-requests`, `--max-minutes`, `--api-backend` and
`--from-start` make an ad-hoc run: recorded and judged as a mode of its own (its settings), so it
never mixes with the nightly's series.

Before and after each (scenario, level) the raw engine (bench/raw.py: mlx-lm's BatchGenerator
with the worker's batch settings, no server) runs the same shape and concurrency, so every
number of ours also has a ratio to a reference measured seconds apart on the same machine; with
`--side-by-side` smg-grpc-servicer's MLX servicer, behind its own router, runs right after
ours. The ratios (bench/history.py) are what the verdict judges: they cancel the drift of the
machine's speed from night to night.

The night's record is appended to the history (JSON lines), then judged against the last 7
records of the same machine, model and mode: exit 1 on a regression (a ratio below the
recent range by more than its margin, or any error, failed run or router veto), else 0.
Output in bench/results/nightly/STAMP/: index.html (verdict, numbers, trends, links to
genai-bench's plots), trend-METRIC.png, verdict.md, record.json, genai-bench's runs and the logs.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import genai
import history
import report
from workers import (
    BENCH,
    ROOT,
    BatchConfig,
    Worker,
    add_common_args,
    log,
    model_or_demo,
    parse_levels,
    raw_process,
    resolve_model,
    smg_servicer_python,
)
from workload import Shape

DEFAULT_HISTORY = BENCH / "results" / "nightly-history.jsonl"
RESULTS = BENCH / "results" / "nightly"
FULL = {"scenarios": ["D(100,100)", "D(1000,100)"], "concurrency": [1, 4, 16]}
QUICK = {"scenarios": ["D(100,100)"], "concurrency": [1, 4]}
RAW_MIN_S = 3.0  # the shortest raw-engine run

Measure = Callable[[argparse.Namespace, Path, Path], list[dict[str, Any]]]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="D(100,100) at c=1,4 with a few requests"
    )
    parser.add_argument(
        "--history",
        type=Path,
        default=DEFAULT_HISTORY,
        help=f"JSON-lines history (default {DEFAULT_HISTORY.relative_to(ROOT)})",
    )
    add_common_args(
        parser, "also run smg-grpc-servicer behind its own router, as a second reference"
    )
    parser.add_argument(
        "--scenario",
        action="append",
        help="replace the fixed scenarios with this genai-bench traffic scenario, e.g. "
        '"D(2000,200)" (repeatable)',
    )
    parser.add_argument(
        "--concurrency", type=parse_levels, help="replace the fixed levels, e.g. 1,4,8"
    )
    parser.add_argument(
        "--max-requests",
        type=int,
        help="requests per run at concurrency C: max(N, 2C) (default N = 32 with --quick, 64)",
    )
    parser.add_argument(
        "--max-minutes", type=int, help="genai-bench's limit per run (default 1, 2 full)"
    )
    parser.add_argument(
        "--api-backend",
        choices=genai.API_BACKENDS,
        default="sglang",
        help="genai-bench client: both are its OpenAI-compatible chat-completions client; "
        "`openai` drops ignore_eos, so outputs end at EOS and fall short of the scenario's "
        "output length (default sglang, which sends ignore_eos)",
    )
    parser.add_argument(
        "--from-start",
        action="store_true",
        help="start each worker just before its first genai-bench run, which starts the "
        "moment the router lists the model (while the worker may still be loading it), with "
        "no warm-up request first: the start counts too",
    )
    parser.add_argument(
        "--genai-bench-version",
        default=genai.GENAI_BENCH_VERSION,
        help=f"installed into bench/.venv-genai (default {genai.GENAI_BENCH_VERSION})",
    )
    parser.add_argument(
        "--window", type=int, default=history.WINDOW, help="recent nights judged against (7)"
    )
    parser.add_argument(
        "--margin",
        type=float,
        help="one margin for every metric instead of the documented per-metric ones",
    )
    parser.add_argument(
        "--slow-ms",
        type=float,
        default=0.0,
        help="test only: every engine step of our worker takes this much longer "
        "(the `slow:MS` fault), to check that the verdict catches a slower worker",
    )
    parser.add_argument("--no-record", action="store_true", help="judge, but do not append")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    fixed = QUICK if args.quick else FULL
    args.scenarios = args.scenario or fixed["scenarios"]
    args.levels = args.concurrency or fixed["concurrency"]
    if args.max_requests is not None and args.max_requests < 1:
        parser.error("--max-requests must be at least 1")
    given = (args.scenario, args.concurrency, args.max_requests, args.max_minutes)
    custom = any(value is not None for value in given) or args.from_start
    if args.max_requests is None:
        args.max_requests = 32 if args.quick else 64
    if args.max_minutes is None:
        args.max_minutes = 1 if args.quick else 2
    args.mode = "quick" if args.quick else "full"
    if custom or args.api_backend != "sglang":
        args.mode = custom_mode(args)
    return args


def custom_mode(args: argparse.Namespace) -> str:
    """An ad-hoc run's mode: its settings, so that only runs like it are judged together."""
    mode = (
        f"custom: {' '.join(args.scenarios)} at c={','.join(map(str, args.levels))}, "
        f"{args.max_requests} requests, {args.max_minutes} min, {args.api_backend}"
    )
    return mode + (", from start" if args.from_start else "")


# --------------------------------------------------------------------------- the machine


def machine() -> dict[str, Any]:
    """What the verdict compares nights on (and the load the night started under)."""
    keep = ("cpu", "cores", "gpu", "memory_gib", "os", "mlx_device", "load_average")
    return {key: report.machine_info()[key] for key in keep}


def commit() -> dict[str, Any]:
    def git(*argv: str) -> str:
        done = subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    return {
        "commit": git("rev-parse", "HEAD") or None,
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
    }


# --------------------------------------------------------------------------- measuring


def _shape(scenario: str) -> Shape | None:
    """D(in,out) -> its shape; other genai-bench scenarios have no raw reference."""
    match = re.fullmatch(r"D\((\d+),(\d+)\)", scenario.replace(" ", ""))
    return Shape(int(match[1]), int(match[2])) if match else None


def raw_length(level: int) -> dict[str, Any]:
    """A raw run: one wave of `level` requests at least, and at least RAW_MIN_S seconds (a
    run of half a second measures mostly noise). Rates are compared, not totals, so it need
    not be as many requests as ours: on a slow model that would double the night."""
    return {"min_requests": level, "min_seconds": RAW_MIN_S}


def _raw_metrics(runs: list[Any]) -> dict[str, Any]:
    """The better of the raw runs around ours, metric by metric: a neighbour's load only ever
    slows a run, so the faster one is nearer the machine's speed. The raw loop keeps no p99
    of TTFT; with a few dozen requests its max is that p99."""

    def best(values: list[float | None], higher: bool = False) -> float | None:
        known = [v for v in values if v is not None]
        return (max(known) if higher else min(known)) if known else None

    return {
        "tok_s": best([s.tokens_per_s for s in runs], higher=True),
        "ttft_p50": best([s.ttft_p50_ms for s in runs]),
        "ttft_p99": best([s.ttft_max_ms for s in runs]),
        "tpot": best([s.itl_p50_ms for s in runs]),
        "e2e": best([s.e2e_p50_ms for s in runs]),
        "errors": sum(s.errors for s in runs),
        "requests": sum(s.requests for s in runs),
        "runs": len(runs),
    }


def _served_metrics(experiment: Path, failure: str | None, vetoes: int) -> dict[str, Any]:
    rows = [] if failure else genai.summarise(experiment)
    if not rows:
        return {"failed": failure or f"no results in {experiment}", "vetoes": vetoes}
    row = rows[0]
    return {
        "tok_s": row["output_tokens_per_s"],
        "ttft_p50": row["ttft_p50_ms"],
        "ttft_p99": row["ttft_p99_ms"],
        "tpot": row["tpot_p50_ms"],
        "e2e": row["e2e_p50_ms"],
        "errors": row["errors"],
        "requests": row["requests"],
        "output_tokens_mean": row["output_tokens_mean"],
        "vetoes": vetoes,
        "dir": str(experiment),
    }


@dataclass
class Served:
    """A worker behind its own router, up for the whole night once started."""

    system: str  # "ours" or "smg"
    worker: Worker
    router: genai.Router
    up: bool = False

    def start(self, from_start: bool) -> None:
        """Start the worker, then the router. `from_start`: the router as soon as the worker
        answers GetModelInfo (it may still be loading), no probe request through it."""
        log(f"starting {genai.SYSTEMS[self.system]}, then its router")
        self.up = True
        if from_start:
            self.worker.start(wait=False)
            self.worker.wait_metadata()
            self.router.start(timeout=300, probe=False)
        else:
            self.worker.start()
            self.router.start()

    def stop(self) -> None:
        self.router.stop()
        self.worker.stop()


def measure(args: argparse.Namespace, model_dir: Path, out: Path) -> list[dict[str, Any]]:
    """Every (scenario, level): the raw engine, then ours (then the peer) through a router.

    Workers and routers start once (with --from-start, each just before its first run) and
    stay up; the raw engine idles on its input while they run, and they idle while it runs."""
    genai_python = genai.genai_bench_python(args.genai_bench_version)
    systems = ["ours", "smg"] if args.side_by_side else ["ours"]
    smg_python = smg_servicer_python(args.smg_version) if args.side_by_side else None
    logs = out / "logs"
    services: list[Served] = []
    for system in systems:
        flags = shlex.split(args.worker_flags) if system == "ours" else []
        worker = genai.make_worker(system, smg_python, model_dir, logs, "nightly", flags)
        if system == "ours" and args.slow_ms > 0:
            worker.env = {**worker.env, "MLX_GRPC_WORKER_FAULTS": f"slow:{args.slow_ms:g}"}
        services.append(Served(system, worker, genai.Router(worker, logs / f"router-{system}.log")))
    results: list[dict[str, Any]] = []
    try:
        if not args.from_start:
            for served in services:
                served.start(from_start=False)
        with raw_process(model_dir, BatchConfig()) as raw:
            for scenario in args.scenarios:
                shape = _shape(scenario)
                for level in args.levels:
                    result: dict[str, Any] = {"scenario": scenario, "concurrency": level}
                    if shape is not None:
                        log(f"raw engine: {scenario} at concurrency {level}")
                        before = raw.run(level, shape, warm_up=True, **raw_length(level))
                    for served in services:
                        if not served.up:
                            served.start(from_start=True)
                        result[served.system] = _run_served(
                            args, genai_python, served, model_dir, scenario, level, out
                        )
                    if shape is not None:
                        # Before and after ours: the reference brackets it in time.
                        after = raw.run(level, shape, **raw_length(level))
                        result["raw"] = _raw_metrics([before, after])
                    results.append(result)
    except RuntimeError as error:
        # A worker, router or the raw engine that does not come up or dies: the night still
        # ends with a record and a verdict, its remaining runs failed (a regression).
        log(f"the night stopped: {error}")
        done = {(r["scenario"], r["concurrency"]) for r in results}
        failed = {"failed": str(error)[-1000:], "vetoes": 0}
        results += [
            {"scenario": s, "concurrency": c, **{system: failed for system in systems}}
            for s in args.scenarios
            for c in args.levels
            if (s, c) not in done
        ]
    finally:
        for served in reversed(services):
            served.stop()
    return results


def _run_served(
    args: argparse.Namespace,
    genai_python: Path,
    served: Served,
    model_dir: Path,
    scenario: str,
    level: int,
    out: Path,
) -> dict[str, Any]:
    """One genai-bench run through `served`'s router, with the router's vetoes meanwhile."""
    log(f"{genai.SYSTEMS[served.system]}: genai-bench {scenario} at concurrency {level}")
    requests = max(args.max_requests, 2 * level)
    load = genai.Load(scenario, level, requests, args.max_minutes, args.api_backend)
    experiment = out / served.system / f"{genai.slug(scenario)}-c{level}"
    failure, counts = served.router.genai_bench(genai_python, load, model_dir, experiment)
    return _served_metrics(experiment, failure, counts["vetoes"])


def router_vetoes(results: list[dict[str, Any]], out: Path) -> dict[str, dict[str, int]]:
    """Each router's liveness vetoes in its whole log (start-up, probe and shut-down too) and
    within genai-bench's runs."""
    found = {}
    for system in genai.SYSTEMS:
        path = out / "logs" / f"router-{system}.log"
        if path.exists():
            in_runs = sum((r.get(system) or {}).get("vetoes") or 0 for r in results)
            found[system] = {"total": genai.count_lines(path, genai.VETO), "in_runs": in_runs}
    return found


# --------------------------------------------------------------------------- the numbers

NUMBERS_NOTE = (
    "Each system's numbers (the raw engine's: the better of its runs before and after ours), "
    "the router's liveness vetoes within each run, and the errors:"
)
# (key, label): the numbers the summary shows for every system side by side.
NUMBERS = [("tok_s", "tok/s"), ("ttft_p50", "TTFT p50 ms"), ("tpot", "TPOT p50 ms")]


def _number(value: Any) -> str:
    if not isinstance(value, (int, float)):
        return "-"
    return f"{value:.2f}" if value < 10 else f"{value:.1f}"


def numbers_table(results: list[dict[str, Any]]) -> str:
    """Per (scenario, level): each system's tok/s, TTFT p50 and TPOT p50 side by side (the
    raw engine's the better of its two runs), the routers' vetoes and the errors."""
    systems = [
        s for s in ("raw", "ours", "smg") if any(isinstance(r.get(s), dict) for r in results)
    ]
    served = [s for s in systems if s != "raw"]
    headers = ["scenario", "conc"]
    headers += [f"{label} {system}" for _, label in NUMBERS for system in systems]
    headers += [f"vetoes {system}" for system in served]
    headers += [f"errors {system}" for system in systems]
    rows = []
    ordered = sorted(
        results, key=lambda r: (history.scenario_order(r["scenario"]), r["concurrency"])
    )
    for result in ordered:
        found = {system: result.get(system) or {} for system in systems}
        row: list[Any] = [result["scenario"], result["concurrency"]]
        for key, _ in NUMBERS:
            for system in systems:
                failed = key == "tok_s" and "failed" in found[system]
                row.append("failed" if failed else _number(found[system].get(key)))
        row += [found[system].get("vetoes", "-") for system in served]
        row += [found[system].get("errors", "-") for system in systems]
        rows.append(row)
    return report.markdown_table(headers, rows)


def numbers_text(results: list[dict[str, Any]], vetoes: dict[str, dict[str, int]]) -> str:
    """The numbers table, with the vetoes the routers logged outside the runs."""
    text = numbers_table(results)
    outside = [
        f"{genai.SYSTEMS[system]} {counts['total'] - counts['in_runs']}"
        for system, counts in vetoes.items()
        if counts["total"] != counts["in_runs"]
    ]
    if outside:
        text += (
            f"\n\nRouter vetoes outside the runs (start-up, probe, shut-down): {', '.join(outside)}"
        )
    return text


# --------------------------------------------------------------------------- the record


def with_ratios(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each result with `ratio`: {reference: {metric: ours' speed ÷ the reference's}}."""
    out = []
    for result in results:
        ours = result.get("ours") or {}
        ratio = {
            reference: history.ratios(ours, result[reference])
            for reference in ("raw", "smg")
            if isinstance(result.get(reference), dict)
        }
        out.append({**result, "ratio": ratio})
    return out


def build_record(
    args: argparse.Namespace,
    model_dir: Path,
    results: list[dict[str, Any]],
    out: Path,
    machine_info: dict[str, Any],
) -> dict[str, Any]:
    return {
        "schema": history.SCHEMA,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **commit(),
        "versions": {
            "mlx": report.version("mlx"),
            "mlx_lm": report.version("mlx-lm"),
            "smg": report.version("smg"),
            "genai_bench": args.genai_bench_version,
            "smg_grpc_servicer": args.smg_version if args.side_by_side else None,
            "python": platform.python_version(),
        },
        "machine": machine_info,
        "model": model_dir.name,
        "model_path": str(model_dir),
        "quick": args.quick,
        "mode": args.mode,
        "settings": {
            "scenarios": args.scenarios,
            "concurrency": args.levels,
            "max_requests": args.max_requests,
            "max_minutes": args.max_minutes,
            "api_backend": args.api_backend,
            "from_start": args.from_start,
            "side_by_side": args.side_by_side,
            "worker_flags": args.worker_flags,
            "slow_ms": args.slow_ms,
        },
        "results": with_ratios(results),
        "router_vetoes": router_vetoes(results, out),
        "out": str(out),
    }


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None, measure_fn: Measure = measure) -> int:
    args = parse_args(argv)
    model_path = model_or_demo(resolve_model(args.model))
    out = args.out / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    machine_info = machine()
    results = measure_fn(args, model_path, out)
    record = build_record(args, model_path, results, out, machine_info)
    past = history.read_history(args.history)
    margins = {name: args.margin for name in history.METRICS} if args.margin is not None else None
    judged = history.verdict(record, past, window=args.window, margins=margins)
    summary = history.verdict_summary(judged)
    table = history.verdict_table(judged)
    numbers = numbers_text(record["results"], record["router_vetoes"])
    if not args.no_record:
        history.append_record(args.history, record)
    (out / "record.json").write_text(json.dumps(record, indent=2) + "\n")
    (out / "verdict.md").write_text(f"{summary}\n\n{table}\n\n{NUMBERS_NOTE}\n\n{numbers}\n")
    comparable = [r for r in past if history.comparable(record, r)] + [record]
    trends = report.trend_pictures(comparable, judged, out)
    page = report.html_page(record, judged, summary, trends, out, args.history, numbers)
    print(f"{NUMBERS_NOTE}\n\n{numbers}\n")
    print(table)
    print()
    print(f"Verdict: {summary}")
    print(f"history: {args.history} ({len(past) + (not args.no_record)} records)")
    print(f"page: {page}")
    return 1 if judged.regressed else 0


if __name__ == "__main__":
    sys.exit(main())
