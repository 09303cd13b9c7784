"""`make nightly`: the unattended nightly benchmark, with a history, a verdict and trends.

    python bench/nightly.py                       # the full set on the demo model
    python bench/nightly.py --quick               # smoke run: D(100,100) at c=1,4, < 5 min
    python bench/nightly.py --model real          # the real model (../shared/tools/real_model.sh)
    python bench/nightly.py --side-by-side        # smg-grpc-servicer as a second reference
    python bench/nightly.py --history PATH        # default bench/results/nightly-history.jsonl

The scenario set is fixed: genai-bench D(100,100) and D(1000,100) at concurrency 1, 4 and 16
through the real `smg` router to our worker (bench/genai.py's router and genai-bench runner).
`--quick` runs D(100,100) at 1 and 4 with 32 requests each (about 1.5 minutes on the demo model).

Before and after each (scenario, level) the raw engine (bench/raw.py: mlx-lm's BatchGenerator
with the worker's batch settings, no server) runs the same shape and concurrency, so every
number of ours also has a ratio to a reference measured seconds apart on the same machine; with
`--side-by-side` smg-grpc-servicer's MLX servicer, behind its own router, runs right after
ours. The ratios (bench/history.py) are what the verdict judges: they cancel the drift of the
machine's speed from night to night.

The night's record is appended to the history (JSON lines), then judged against the last 7
records of the same machine, model and mode: exit 1 on a regression (a ratio below the
recent range by more than its margin, or any error, failed run or router veto), else 0.
Output in bench/results/nightly/STAMP/: index.html (verdict, trends, links to genai-bench's
plots), trend-METRIC.png, verdict.md, record.json, genai-bench's runs and the logs.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import re
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
    SMG_SERVICER_VERSION,
    BatchConfig,
    Worker,
    add_common_args,
    log,
    model_or_demo,
    raw_process,
    resolve_model,
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
        parser,
        "also run smg-grpc-servicer behind its own router, as a second reference",
        peer_version=False,
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
        "--scenario",
        action="append",
        help="replace the fixed scenarios (repeatable; for tests and trials)",
    )
    parser.add_argument("--concurrency", help="replace the fixed levels, e.g. 1,4")
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
    args.levels = (
        [int(x) for x in args.concurrency.split(",") if x.strip()]
        if args.concurrency
        else fixed["concurrency"]
    )
    if args.max_requests is None:
        args.max_requests = 32 if args.quick else 64
    if args.max_minutes is None:
        args.max_minutes = 1 if args.quick else 2
    return args


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
    """A worker behind its own router, up for the whole night."""

    system: str  # "ours" or "smg"
    worker: Worker
    router: genai.Router


def measure(args: argparse.Namespace, model_dir: Path, out: Path) -> list[dict[str, Any]]:
    """Every (scenario, level): the raw engine, then ours (then the peer) through a router.

    Workers and routers start once and stay up; the raw engine idles on its input while they
    run, and they idle while it runs."""
    genai_python = genai.ensure_venv(
        genai.GENAI_VENV, [f"genai-bench=={genai.GENAI_BENCH_VERSION}"]
    )
    systems = ["ours", "smg"] if args.side_by_side else ["ours"]
    smg_python = genai.smg_servicer_python() if args.side_by_side else None
    gargs = genai.parse_args(["--max-minutes", str(args.max_minutes)])
    logs = out / "logs"
    started: list[Served] = []
    results: list[dict[str, Any]] = []
    try:
        for system in systems:
            flags = args.worker_flags.split() if system == "ours" else []
            worker = genai.make_worker(system, smg_python, model_dir, logs, "nightly", flags)
            if system == "ours" and args.slow_ms > 0:
                worker.env = {**worker.env, "MLX_GRPC_WORKER_FAULTS": f"slow:{args.slow_ms:g}"}
            served = Served(system, worker, genai.Router(worker, logs / f"router-{system}.log"))
            log(f"starting {genai.SYSTEMS[system]} on {model_dir.name}, then its router")
            started.append(served)
            worker.start()
            served.router.start()
        with raw_process(model_dir, BatchConfig()) as raw:
            for scenario in args.scenarios:
                shape = _shape(scenario)
                for level in args.levels:
                    requests = max(args.max_requests, 2 * level)
                    result: dict[str, Any] = {"scenario": scenario, "concurrency": level}
                    if shape is not None:
                        log(f"raw engine: {scenario} at concurrency {level}")
                        before = raw.run(level, shape, warm_up=True, **raw_length(level))
                    for served in started:
                        result[served.system] = _run_served(
                            gargs, genai_python, served, model_dir, scenario, level, requests, out
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
        for served in reversed(started):
            served.router.stop()
            served.worker.stop()
    return results


def _run_served(
    gargs: argparse.Namespace,
    genai_python: Path,
    served: Served,
    model_dir: Path,
    scenario: str,
    level: int,
    requests: int,
    out: Path,
) -> dict[str, Any]:
    """One genai-bench run through `served`'s router, with the router's vetoes meanwhile."""
    log(f"{genai.SYSTEMS[served.system]}: genai-bench {scenario} at concurrency {level}")
    here = copy.copy(gargs)
    here.max_requests = requests
    experiment = out / served.system / f"{genai._slug(scenario)}-c{level}"
    failure, counts = served.router.genai_bench(
        genai_python, here, model_dir, scenario, level, experiment
    )
    vetoes = counts["vetoes"]
    return _served_metrics(experiment, failure, vetoes)


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
            "genai_bench": genai.GENAI_BENCH_VERSION,
            "smg_grpc_servicer": SMG_SERVICER_VERSION if args.side_by_side else None,
            "python": platform.python_version(),
        },
        "machine": machine_info,
        "model": model_dir.name,
        "model_path": str(model_dir),
        "quick": args.quick,
        "settings": {
            "scenarios": args.scenarios,
            "concurrency": args.levels,
            "max_requests": args.max_requests,
            "max_minutes": args.max_minutes,
            "side_by_side": args.side_by_side,
            "worker_flags": args.worker_flags,
            "slow_ms": args.slow_ms,
        },
        "results": with_ratios(results),
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
    if not args.no_record:
        history.append_record(args.history, record)
    (out / "record.json").write_text(json.dumps(record, indent=2) + "\n")
    (out / "verdict.md").write_text(f"{summary}\n\n{table}\n")
    comparable = [r for r in past if history.comparable(record, r)] + [record]
    trends = report.trend_pictures(comparable, judged, out)
    page = report.html_page(record, judged, summary, trends, out, args.history)
    print(table)
    print()
    print(f"Verdict: {summary}")
    print(f"history: {args.history} ({len(past) + (not args.no_record)} records)")
    print(f"page: {page}")
    return 1 if judged.regressed else 0


if __name__ == "__main__":
    sys.exit(main())
