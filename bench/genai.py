"""`make bench-genai`: genai-bench against the worker behind the SMG router, offline.

    python bench/genai.py                               # demo model, D(100,100) and D(1000,100)
    python bench/genai.py --concurrency 1,4,8 --max-requests 16
    python bench/genai.py --model DIR --scenario "D(2000,200)"

Starts our worker and `smg launch` in front of it, waits for GET /v1/models, then runs
genai-bench's OpenAI-compatible client (/v1/chat/completions, streamed, temperature 0) with
the model directory as its tokenizer. Its backend `sglang` is that same OpenAI client plus
`ignore_eos`, so every request yields the scenario's output length; `--api-backend openai`
drops ignore_eos (outputs then end at the model's EOS). genai-bench lives in its own venv
(bench/.venv-genai, installed on first use: it brings locust, gevent, pandas and more, none
of which the worker needs).
Nothing is downloaded at run time: HF_HUB_OFFLINE=1 and every tokenizer option points at the
local model directory; genai-bench's prompts come from the text file it ships. Its results,
plots and a summary table (summary.md, summary.json) land in bench/results/genai/STAMP/.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import report
from workers import BENCH, OFFLINE_ENV, BatchConfig, Worker, ensure_venv, free_port, log, our_worker

GENAI_VENV = BENCH / ".venv-genai"
GENAI_BENCH_VERSION = "0.0.5"
RESULTS = BENCH / "results" / "genai"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, help="mlx-lm model directory (default: demo model)")
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
    parser.add_argument("--genai-bench-version", default=GENAI_BENCH_VERSION)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    args.scenario = args.scenario or ["D(100,100)", "D(1000,100)"]
    args.concurrency = [int(x) for x in args.concurrency.split(",") if x.strip()]
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

    def start(self, timeout: float = 120) -> str:
        """Start, wait until it lists the model and completes a request; the model's name."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        model = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the router exited; see {self.log_path}")
            try:
                if model is None:
                    status, body = _http_json("GET", f"{self.base}/v1/models")
                    if status == 200 and body and body.get("data"):
                        model = body["data"][0]["id"]
                if model is not None:
                    probe = {
                        "model": model,
                        "messages": [{"role": "user", "content": "hello"}],
                        "max_tokens": 4,
                    }
                    status, _ = _http_json("POST", f"{self.base}/v1/chat/completions", probe)
                    if status == 200:
                        return model
            except (urllib.error.URLError, ConnectionError):
                pass
            time.sleep(0.25)
        raise RuntimeError(f"the router did not come up in {timeout:.0f} s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def run_genai_bench(
    python: Path, args: argparse.Namespace, base: str, model: str, model_dir: Path, out: Path
) -> None:
    command = [
        str(python.parent / "genai-bench"),
        "benchmark",
        "--api-backend",
        args.api_backend,
        "--api-base",
        base,
        "--api-key",
        "unused",
        "--task",
        "text-to-text",
        "--api-model-name",
        model,
        "--model-tokenizer",
        str(model_dir),
        "--model",
        "mlx-grpc-worker",
        "--additional-request-params",
        json.dumps({"ignore_eos": True, "temperature": 0.0}),
        "--max-time-per-run",
        str(args.max_minutes),
        "--max-requests-per-run",
        str(args.max_requests),
        "--metrics-time-unit",
        "ms",
        "--experiment-base-dir",
        str(out),
        "--experiment-folder-name",
        "experiment",
        "--log-dir",
        str(out / "logs"),
    ]
    for scenario in args.scenario:
        command += ["--traffic-scenario", scenario]
    for level in args.concurrency:
        command += ["--num-concurrency", str(level)]
    log(f"genai-bench: {' '.join(args.scenario)} at concurrency {args.concurrency}")
    output_path = out / "genai-bench.out"
    with open(output_path, "wb") as output:
        done = subprocess.run(
            command,
            cwd=out,
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
                "tpot_p50_ms": stats["tpot"]["p50"],
                "e2e_p50_ms": stats["e2e_latency"]["p50"],
                "output_tokens_mean": stats["num_output_tokens"]["mean"],
                "time_unit": data.get("_time_unit", "ms"),
            }
        )
    rows.sort(key=lambda row: (row["scenario"], row["concurrency"]))
    return rows


def summary_table(rows: list[dict[str, Any]]) -> str:
    headers = [
        "scenario",
        "conc",
        "output tok/s",
        "req/s",
        "TTFT p50 ms",
        "TTFT p90 ms",
        "TPOT p50 ms",
        "e2e p50 ms",
        "out tokens",
        "requests",
        "errors",
    ]
    return report.markdown_table(
        headers,
        [
            [
                row["scenario"],
                row["concurrency"],
                row["output_tokens_per_s"],
                round(row["requests_per_s"], 2),
                row["ttft_p50_ms"],
                row["ttft_p90_ms"],
                round(row["tpot_p50_ms"], 2),
                row["e2e_p50_ms"],
                row["output_tokens_mean"],
                row["requests"],
                row["errors"],
            ]
            for row in rows
        ],
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    python = ensure_venv(GENAI_VENV, [f"genai-bench=={args.genai_bench_version}"])
    if args.model is None:
        from servicer.demo_model import demo_model_path

        model_dir = demo_model_path()
    else:
        model_dir = args.model.expanduser().resolve()
    machine = report.machine_info()
    out = args.out / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    worker = our_worker(model_dir, BatchConfig(), out / "logs", "genai")
    router = Router(worker, out / "logs" / "router.log")
    try:
        log(f"starting the worker on {model_dir}")
        worker.start()
        log("starting the router")
        model = router.start()
        run_genai_bench(python, args, router.base, model, model_dir, out)
    finally:
        router.stop()
        worker.stop()
    rows = summarise(out / "experiment")
    table = summary_table(rows)
    machine["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    header = (
        f"genai-bench {args.genai_bench_version} ({args.api_backend} client) through the smg "
        f"router, {time.strftime('%Y-%m-%d %H:%M %Z')}, model {model_dir.name}"
    )
    summary = f"{header}\n\nMachine: {report.machine_line({'machine': machine})}\n\n{table}\n"
    (out / "summary.md").write_text(summary)
    (out / "summary.json").write_text(json.dumps(rows, indent=2) + "\n")
    print(table)
    print(f"\nsummary, genai-bench's JSON, xlsx and plots: {out}")
    return 0 if rows and not any(row["errors"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
