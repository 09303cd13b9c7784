"""`make bench-genai`: genai-bench against the worker behind the SMG router, offline.

    python bench/genai.py                               # demo model, D(100,100) and D(1000,100)
    python bench/genai.py --concurrency 1,4,8 --max-requests 16
    python bench/genai.py --model DIR --scenario "D(2000,200)"
    python bench/genai.py --side-by-side --concurrency 4,8,16   # against smg-grpc-servicer too

Starts our worker and `smg launch` in front of it, waits for GET /v1/models, then runs
genai-bench's OpenAI-compatible client (/v1/chat/completions, streamed, temperature 0) with
the model directory as its tokenizer, once per (scenario, concurrency). Its backend `sglang`
is that same OpenAI client plus `ignore_eos`, so every request yields the scenario's output
length; `--api-backend openai` drops ignore_eos (outputs then end at the model's EOS).
genai-bench lives in its own venv (bench/.venv-genai, installed on first use: it brings
locust, gevent, pandas and more, none of which the worker needs).

`--side-by-side` runs the same against smg-grpc-servicer's MLX servicer (bench/.venv-smg, as
in bench.py) in alternating rounds (`--rounds`, default 2): each round starts our worker and
a fresh router, runs every scenario and level, then does the same for smg-grpc-servicer, so
that the machine's speed drift hits both alike. The summary gives, per system, the median
over rounds with the range, and ours ÷ smg as the median of the per-round ratios.

Every run also counts the router's liveness vetoes ("Worker vetoed by liveness" lines in its
log written while that genai-bench invocation ran): a veto means the router saw in-flight
requests pile up without progress and stopped routing to the worker.

Nothing is downloaded at run time: HF_HUB_OFFLINE=1 and every tokenizer option points at the
local model directory; genai-bench's prompts come from the text file it ships. Its results,
plots and a summary table (summary.md, summary.json) land in bench/results/genai/STAMP/.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import report
from workers import (
    BENCH,
    OFFLINE_ENV,
    BatchConfig,
    Worker,
    add_common_args,
    ensure_venv,
    free_port,
    log,
    model_or_demo,
    our_worker,
    resolve_model,
    smg_servicer_python,
    smg_worker,
)

GENAI_VENV = BENCH / ".venv-genai"
GENAI_BENCH_VERSION = "0.0.5"
RESULTS = BENCH / "results" / "genai"
SYSTEMS = {"ours": "mlx-grpc-worker", "smg": "smg-grpc-servicer"}
VETO = "Worker vetoed by liveness"
READMIT = "Worker re-admitted by liveness"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# The router's log may trail the last request by a moment; a veto a run caused counts for it.
SETTLE_S = 1.0
# (row key, column label): the metrics compared side by side.
METRICS = [("ttft_p50_ms", "TTFT"), ("tpot_p50_ms", "TPOT"), ("output_tokens_per_s", "tok/s")]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--scenario",
        action="append",
        help='genai-bench traffic scenario, repeatable (default "D(100,100)" and "D(1000,100)")',
    )
    parser.add_argument("--concurrency", default="1,4,8", help="levels (default 1,4,8)")
    parser.add_argument(
        "--max-requests", type=int, default=16, help="requests per scenario and level (16)"
    )
    parser.add_argument(
        "--max-minutes", type=int, default=1, help="time limit per scenario and level (1)"
    )
    parser.add_argument(
        "--api-backend",
        choices=["sglang", "openai"],
        default="sglang",
        help="genai-bench client: both are its OpenAI-compatible chat-completions client; "
        "`openai` drops ignore_eos, so outputs end at EOS and fall short of the scenario's "
        "output length (default sglang, which sends ignore_eos)",
    )
    add_common_args(
        parser,
        "also run smg-grpc-servicer's MLX servicer (installed on first use into "
        "bench/.venv-smg), alternating with ours round by round",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        help="rounds of every system over every scenario and level, each on a fresh worker "
        "and router (default 2 with --side-by-side, else 1)",
    )
    parser.add_argument("--genai-bench-version", default=GENAI_BENCH_VERSION)
    parser.add_argument(
        "--from-start",
        action="store_true",
        help="start genai-bench the moment the router lists the model (while our worker may "
        "still be loading it), with no warm-up request first: the start counts too",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    args.scenario = args.scenario or ["D(100,100)", "D(1000,100)"]
    args.concurrency = [int(x) for x in args.concurrency.split(",") if x.strip()]
    args.worker_flags = shlex.split(args.worker_flags)
    args.model = resolve_model(args.model)
    if args.rounds is None:
        args.rounds = 2 if args.side_by_side else 1
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    args.systems = ["ours", "smg"] if args.side_by_side else ["ours"]
    return args


def _http_json(method: str, url: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as error:
        return error.code, None


def count_lines(path: Path, needle: str, start: int = 0, end: int | None = None) -> int:
    """Lines of `path` between byte offsets `start` and `end` that contain `needle`, ANSI
    colour codes stripped (the router colours its log even into a file)."""
    try:
        with open(path, "rb") as file:
            file.seek(start)
            data = file.read() if end is None else file.read(max(0, end - start))
    except OSError:
        return 0
    text = ANSI.sub("", data.decode(errors="replace"))
    return sum(needle in line for line in text.splitlines())


class Router:
    """`smg launch` in front of one worker, on free loopback ports."""

    def __init__(self, worker: Worker, log_path: Path) -> None:
        smg = shutil.which("smg", path=str(Path(sys.executable).parent)) or shutil.which("smg")
        if smg is None:
            raise SystemExit("the smg router is not installed: run `make install`")
        self.port = free_port()
        self.command = [
            smg,
            "launch",
            "--worker-urls",
            f"grpc://{worker.address}",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(free_port()),
        ]
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_size(self) -> int:
        try:
            return self.log_path.stat().st_size
        except OSError:
            return 0

    def start(self, timeout: float = 120, probe: bool = True) -> str:
        """Start, wait until it lists the model and (with `probe`) completes a request; the
        model's name."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        model = self.model = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the router exited; see {self.log_path}")
            try:
                if model is None:
                    status, body = _http_json("GET", f"{self.base}/v1/models")
                    if status == 200 and body and body.get("data"):
                        model = self.model = body["data"][0]["id"]
                if model is not None and not probe:
                    return model
                if model is not None:
                    request = {
                        "model": model,
                        "messages": [{"role": "user", "content": "hello"}],
                        "max_tokens": 4,
                    }
                    status, _ = _http_json("POST", f"{self.base}/v1/chat/completions", request)
                    if status == 200:
                        return model
            except (urllib.error.URLError, ConnectionError):
                pass
            time.sleep(0.25)
        raise RuntimeError(f"the router did not come up in {timeout:.0f} s; see {self.log_path}")

    def genai_bench(
        self,
        python: Path,
        args: argparse.Namespace,
        model_dir: Path,
        scenario: str,
        level: int,
        experiment: Path,
    ) -> tuple[str | None, dict[str, int]]:
        """One genai-bench run through this router: its failure (None when it ran), and the
        router's liveness vetoes and re-admissions while it ran."""
        start = self.log_size()
        failure = None
        try:
            assert self.model is not None, "start the router first"
            run_genai_bench(
                python, args, self.base, self.model, model_dir, scenario, level, experiment
            )
        except RuntimeError as error:
            failure = str(error)
            log(f"  failed: {failure}")
        time.sleep(SETTLE_S)
        end = self.log_size()
        return failure, {
            "vetoes": count_lines(self.log_path, VETO, start, end),
            "readmits": count_lines(self.log_path, READMIT, start, end),
        }

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def run_genai_bench(
    python: Path,
    args: argparse.Namespace,
    base: str,
    model: str,
    model_dir: Path,
    scenario: str,
    level: int,
    experiment: Path,
) -> None:
    """One genai-bench invocation: one scenario at one concurrency, into `experiment`."""
    experiment.parent.mkdir(parents=True, exist_ok=True)
    options = {
        "api-backend": args.api_backend,
        "api-base": base,
        "api-key": "unused",
        "task": "text-to-text",
        "api-model-name": model,
        "model-tokenizer": model_dir,
        "model": "mlx-grpc-worker",
        "additional-request-params": json.dumps({"ignore_eos": True, "temperature": 0.0}),
        "max-time-per-run": args.max_minutes,
        "max-requests-per-run": args.max_requests,
        "metrics-time-unit": "ms",
        "experiment-base-dir": experiment.parent,
        "experiment-folder-name": experiment.name,
        "log-dir": experiment.parent / "logs",
        "traffic-scenario": scenario,
        "num-concurrency": level,
    }
    command = [str(python.parent / "genai-bench"), "benchmark"]
    command += [part for key, value in options.items() for part in (f"--{key}", str(value))]
    output_path = experiment.parent / f"{experiment.name}.out"
    with open(output_path, "wb") as output:
        done = subprocess.run(
            command,
            cwd=experiment.parent,
            env={**os.environ, **OFFLINE_ENV},
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    if done.returncode != 0:
        raise RuntimeError(f"genai-bench exited with {done.returncode}; see {output_path}")


def summarise(experiment: Path) -> list[dict[str, Any]]:
    """One row per (scenario, concurrency) from genai-bench's per-run JSON files."""
    rows = []
    for path in sorted(experiment.glob("*_num_concurrency_*.json")):
        data = json.loads(path.read_text())
        agg = data["aggregated_metrics"]
        stats = agg["stats"]
        rows.append(
            {
                "scenario": agg["scenario"],
                "concurrency": agg["num_concurrency"],
                "requests": agg["num_completed_requests"],
                "errors": agg["num_error_requests"],
                "output_tokens_per_s": agg["mean_output_throughput_tokens_per_s"],
                "requests_per_s": agg["requests_per_second"],
                "ttft_p50_ms": stats["ttft"]["p50"],
                "ttft_p90_ms": stats["ttft"]["p90"],
                "ttft_p99_ms": stats["ttft"].get("p99"),
                "tpot_p50_ms": stats["tpot"]["p50"],
                "e2e_p50_ms": stats["e2e_latency"]["p50"],
                "output_tokens_mean": stats["num_output_tokens"]["mean"],
                "time_unit": data.get("_time_unit", "ms"),
            }
        )
    rows.sort(key=lambda row: (row["scenario"], row["concurrency"]))
    return rows


def _slug(scenario: str) -> str:
    """A folder name for a scenario: D(100,100) -> D100-100."""
    return re.sub(r"[^A-Za-z0-9]+", "-", scenario).strip("-")


def make_worker(
    system: str,
    smg_python: Path | None,
    model_dir: Path,
    log_dir: Path,
    tag: str,
    flags: list[str] | None = None,
) -> Worker:
    if system == "smg":
        assert smg_python is not None
        return smg_worker(smg_python, model_dir, BatchConfig(), log_dir, tag)
    return our_worker(model_dir, BatchConfig(), log_dir, tag, flags or [])


def run_round(
    system: str,
    round_no: int,
    args: argparse.Namespace,
    genai_python: Path,
    smg_python: Path | None,
    model_dir: Path,
    out: Path,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """A fresh worker and router for `system`, genai-bench once per (scenario, level).

    Returns one row per run (a failed run has `failed` and no metrics) and the router's
    record: its log and its vetoes in all and within runs.
    """
    tag = f"{system}-r{round_no}"  # each system's runs and logs apart
    worker = make_worker(system, smg_python, model_dir, out / "logs", tag, args.worker_flags)
    router = Router(worker, out / "logs" / f"router-{tag}.log")
    runs: list[dict[str, Any]] = []
    base = {"system": system, "round": round_no}
    try:
        log(f"round {round_no}: starting {SYSTEMS[system]} on {model_dir}, then the router")
        worker.start(wait=not args.from_start)
        if args.from_start:
            worker.wait_metadata()
        router.start(timeout=300, probe=not args.from_start)
        for scenario in args.scenario:
            for level in args.concurrency:
                log(f"round {round_no}, {system}: genai-bench {scenario} at concurrency {level}")
                experiment = out / tag / f"{_slug(scenario)}-c{level}"
                failure, counts = router.genai_bench(
                    genai_python, args, model_dir, scenario, level, experiment
                )
                rows = [] if failure else summarise(experiment)
                if not rows:
                    failure = failure or f"genai-bench wrote no results into {experiment}"
                    rows = [{"scenario": scenario, "concurrency": level, "failed": failure}]
                runs += [{**base, **row, **counts, "dir": str(experiment)} for row in rows]
    except RuntimeError as error:
        # The worker or router did not come up: the round's remaining runs have no numbers.
        log(f"round {round_no}, {system}: {error}")
        done = {(run["scenario"], run["concurrency"]) for run in runs}
        runs += [
            {**base, "scenario": s, "concurrency": c, "failed": str(error), "vetoes": None}
            for s in args.scenario
            for c in args.concurrency
            if (s, c) not in done
        ]
    finally:
        router.stop()
        worker.stop()
    in_runs = sum(run.get("vetoes") or 0 for run in runs)
    record = {
        **base,
        "router_log": str(router.log_path),
        "worker_log": str(worker.log_path),
        "vetoes_total": count_lines(router.log_path, VETO),
        "vetoes_in_runs": in_runs,
        "readmits_total": count_lines(router.log_path, READMIT),
    }
    return runs, record


# --------------------------------------------------------------------------- summary


def _key(scenario: str) -> tuple[int, ...]:
    """Order scenarios by their numbers, so D(100,100) comes before D(1000,100)."""
    return tuple(int(n) for n in re.findall(r"\d+", scenario))


def compare(runs: list[dict[str, Any]], systems: list[str]) -> list[dict[str, Any]]:
    """Per (scenario, concurrency): each system's median, min and max over rounds, its vetoes
    per run, and the median of the per-round ratios ours ÷ peer."""
    keys = sorted({(r["scenario"], r["concurrency"]) for r in runs}, key=lambda k: (_key(k[0]), k))
    out = []
    for scenario, level in keys:
        here = [r for r in runs if r["scenario"] == scenario and r["concurrency"] == level]
        entry: dict[str, Any] = {"scenario": scenario, "concurrency": level}
        by_round = {(r["system"], r["round"]): r for r in here if "failed" not in r}
        for system in systems:
            mine = sorted((r for r in here if r["system"] == system), key=lambda r: r["round"])
            ok = [r for r in mine if "failed" not in r]
            stats: dict[str, Any] = {
                "vetoes": [r.get("vetoes") for r in mine],
                "errors": sum(r["errors"] for r in ok),
                "failed_runs": len(mine) - len(ok),
            }
            for metric, _ in METRICS:
                values = [r[metric] for r in ok]
                stats[metric] = (
                    {"median": statistics.median(values), "min": min(values), "max": max(values)}
                    if values
                    else None
                )
            entry[system] = stats
        if len(systems) == 2:
            ours, peer = systems
            rounds = sorted({r["round"] for r in here})
            ratios: dict[str, float | None] = {}
            for metric, _ in METRICS:
                per_round = [
                    by_round[(ours, n)][metric] / by_round[(peer, n)][metric]
                    for n in rounds
                    if (ours, n) in by_round
                    and (peer, n) in by_round
                    and by_round[(peer, n)][metric]
                ]
                ratios[metric] = statistics.median(per_round) if per_round else None
            entry["ratio"] = ratios
        out.append(entry)
    return out


def _spread(stats: dict[str, Any] | None, rounds: int) -> str:
    """median (min-max) over rounds; just the value for one round."""
    if stats is None:
        return "-"
    digits = 2 if stats["median"] < 10 else 1
    median = f"{stats['median']:.{digits}f}"
    if rounds == 1:
        return median
    return f"{median} ({stats['min']:.{digits}f}-{stats['max']:.{digits}f})"


def _vetoes(values: list[int | None]) -> str:
    return ", ".join("-" if v is None else str(v) for v in values) or "-"


def _errors(stats: dict[str, Any]) -> str:
    failed = stats["failed_runs"]
    return f"{stats['errors']}" + (f" ({failed} failed)" if failed else "")


def compare_table(entries: list[dict[str, Any]], systems: list[str], rounds: int) -> str:
    headers = ["scenario", "conc"]
    for _, label in METRICS:
        headers += [f"{label} {system}" for system in systems]
        if len(systems) == 2:
            headers.append(f"{label} {systems[0]}÷{systems[1]}")
    headers += [f"vetoes {system}" for system in systems]
    headers += [f"errors {system}" for system in systems]
    rows = []
    for entry in entries:
        row: list[Any] = [entry["scenario"], entry["concurrency"]]
        for metric, _ in METRICS:
            row += [_spread(entry[system][metric], rounds) for system in systems]
            if len(systems) == 2:
                ratio = entry["ratio"][metric]
                row.append("-" if ratio is None else f"{ratio:.2f}")
        row += [_vetoes(entry[system]["vetoes"]) for system in systems]
        row += [_errors(entry[system]) for system in systems]
        rows.append(row)
    return report.markdown_table(headers, rows)


def runs_table(runs: list[dict[str, Any]], systems: list[str], rounds: int) -> str:
    """Every run's numbers; the system and round columns only when there is more than one."""
    lead = (["system"] if len(systems) > 1 else []) + (["round"] if rounds > 1 else [])
    order = ("scenario", "concurrency", "round", "system")
    rows = []
    for run in sorted(runs, key=lambda r: (_key(r["scenario"]), *(r[k] for k in order))):
        first = ([SYSTEMS[run["system"]]] if len(systems) > 1 else []) + (
            [run["round"]] if rounds > 1 else []
        )
        data = {**run, "output_tokens_per_s": "failed"} if "failed" in run else run
        rows.append(([*first, run["scenario"], run["concurrency"]], data))
    columns = (
        "output tok/s=output_tokens_per_s | req/s=requests_per_s:2 | TTFT p50 ms=ttft_p50_ms | "
        "TTFT p90 ms=ttft_p90_ms | TPOT p50 ms=tpot_p50_ms:2 | e2e p50 ms=e2e_p50_ms | "
        "out tokens=output_tokens_mean | requests=requests | errors=errors | vetoes=vetoes"
    )
    return report.keyed_table([*lead, "scenario", "conc"], columns, rows)


def write_summary(
    args: argparse.Namespace,
    model_dir: Path,
    machine: dict[str, Any],
    runs: list[dict[str, Any]],
    routers: list[dict[str, Any]],
    out: Path,
) -> str:
    """summary.md and summary.json in `out`; the table to print."""
    entries = compare(runs, args.systems)
    table = every = runs_table(runs, args.systems, args.rounds)
    systems = " and ".join(
        f"{SYSTEMS[s]}" + (f" {args.smg_version}" if s == "smg" else "") for s in args.systems
    )
    parts = [
        f"genai-bench {args.genai_bench_version} ({args.api_backend} client) through the smg "
        f"router to {systems}, {time.strftime('%Y-%m-%d %H:%M %Z')}, model {model_dir.name}, "
        f"{args.rounds} round(s), at most {args.max_requests} requests per run",
        f"Machine: {report.machine_line({'machine': machine})}",
    ]
    if len(args.systems) > 1 or args.rounds > 1:
        table = compare_table(entries, args.systems, args.rounds)
        explain = "TTFT and TPOT p50 in ms, output tokens/s; median over rounds, (min-max) "
        explain += "over rounds"
        if len(args.systems) == 2:
            explain += (
                "; ours ÷ smg is the median of the per-round ratios (below 1: ours is faster "
                "for TTFT and TPOT, slower for tok/s)"
            )
        explain += "; vetoes: the router's liveness vetoes in each round's run."
        parts += [explain, table, "Every run:", every]
    outside = [
        f"{SYSTEMS[r['system']]} round {r['round']}: {r['vetoes_total'] - r['vetoes_in_runs']}"
        for r in routers
        if r["vetoes_total"] != r["vetoes_in_runs"]
    ]
    if outside:
        parts.append(f"Vetoes outside the runs (start-up, probe, shut-down): {', '.join(outside)}")
    (out / "summary.md").write_text("\n\n".join(parts) + "\n")
    names = ("systems", "rounds", "concurrency", "max_requests", "max_minutes", "api_backend")
    settings = {name: getattr(args, name) for name in names} | {"scenarios": args.scenario}
    settings["genai_bench_version"] = args.genai_bench_version
    settings["smg_version"] = args.smg_version if args.side_by_side else None
    settings["model"] = str(model_dir)
    summary = dict(settings=settings, machine=machine, comparison=entries, runs=runs)
    summary["routers"] = routers
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return table


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    genai_python = ensure_venv(GENAI_VENV, [f"genai-bench=={args.genai_bench_version}"])
    smg_python = smg_servicer_python(args.smg_version) if args.side_by_side else None
    model_dir = model_or_demo(args.model)
    machine = report.machine_info()
    # Absolute: genai-bench runs in its experiment's folder and would nest a relative path.
    out = args.out.resolve() / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    routers: list[dict[str, Any]] = []
    # Rounds alternate the systems, so a slow minute of the machine hits both alike.
    for round_no in range(1, args.rounds + 1):
        for system in args.systems:
            round_runs, record = run_round(
                system, round_no, args, genai_python, smg_python, model_dir, out
            )
            runs += round_runs
            routers.append(record)
    machine["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    table = write_summary(args, model_dir, machine, runs, routers, out)
    print(table)
    print(f"\nsummary, genai-bench's JSON, xlsx and plots: {out}")
    ok = runs and not any("failed" in run or run["errors"] for run in runs)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
