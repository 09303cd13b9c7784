"""genai-bench through the smg router, offline: the library bench/nightly.py runs it with.

- `Router`: `smg launch` in front of one worker on free loopback ports; `Router.genai_bench`
  runs genai-bench once through it and counts the router's liveness vetoes meanwhile.
- `genai_bench_python`: genai-bench's own venv (bench/.venv-genai, installed on first use:
  it brings locust, gevent, pandas and more, none of which the worker needs).
- `run_genai_bench`: one invocation, one `Load` (a scenario at one concurrency).
- `summarise`: genai-bench's per-run JSON files -> one row of numbers per run.

genai-bench's OpenAI-compatible client (/v1/chat/completions, streamed, temperature 0) sends
the requests, with the model directory as its tokenizer. Its backend `sglang` is that same
client plus `ignore_eos`, so every request yields the scenario's output length; `openai` drops
ignore_eos (outputs then end at the model's EOS). Nothing is downloaded at run time:
HF_HUB_OFFLINE=1, every tokenizer option points at the local model directory, and
genai-bench's prompts come from the text file it ships.

A liveness veto is a "Worker vetoed by liveness" line in the router's log: the router saw
in-flight requests pile up without progress and stopped routing to the worker.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workers import (
    BENCH,
    OFFLINE_ENV,
    BatchConfig,
    Worker,
    ensure_venv,
    free_port,
    log,
    our_worker,
    smg_worker,
)

GENAI_VENV = BENCH / ".venv-genai"
GENAI_BENCH_VERSION = "0.0.5"
SYSTEMS = {"ours": "mlx-grpc-worker", "smg": "smg-grpc-servicer"}
API_BACKENDS = ("sglang", "openai")
VETO = "Worker vetoed by liveness"
READMIT = "Worker re-admitted by liveness"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# The router's log may trail the last request by a moment; a veto a run caused counts for it.
SETTLE_S = 1.0


@dataclass(frozen=True)
class Load:
    """What one genai-bench run sends: a scenario at one concurrency, until `max_requests`
    requests or `max_minutes` have passed, with the `api_backend` client."""

    scenario: str
    concurrency: int
    max_requests: int
    max_minutes: int
    api_backend: str = "sglang"


def genai_bench_python(version: str = GENAI_BENCH_VERSION) -> Path:
    """genai-bench's venv, installed from the package registry on first use."""
    return ensure_venv(GENAI_VENV, [f"genai-bench=={version}"])


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
        self, python: Path, load: Load, model_dir: Path, experiment: Path
    ) -> tuple[str | None, dict[str, int]]:
        """One genai-bench run through this router: its failure (None when it ran), and the
        router's liveness vetoes and re-admissions while it ran."""
        start = self.log_size()
        failure = None
        try:
            assert self.model is not None, "start the router first"
            run_genai_bench(python, load, self.base, self.model, model_dir, experiment)
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
    python: Path, load: Load, base: str, model: str, model_dir: Path, experiment: Path
) -> None:
    """One genai-bench invocation: one scenario at one concurrency, into `experiment`."""
    experiment.parent.mkdir(parents=True, exist_ok=True)
    options = {
        "api-backend": load.api_backend,
        "api-base": base,
        "api-key": "unused",
        "task": "text-to-text",
        "api-model-name": model,
        "model-tokenizer": model_dir,
        "model": "mlx-grpc-worker",
        "additional-request-params": json.dumps({"ignore_eos": True, "temperature": 0.0}),
        "max-time-per-run": load.max_minutes,
        "max-requests-per-run": load.max_requests,
        "metrics-time-unit": "ms",
        "experiment-base-dir": experiment.parent,
        "experiment-folder-name": experiment.name,
        "log-dir": experiment.parent / "logs",
        "traffic-scenario": load.scenario,
        "num-concurrency": load.concurrency,
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


def slug(scenario: str) -> str:
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
    """`system`'s worker ("ours" with `flags`, or "smg"), not started yet."""
    if system == "smg":
        assert smg_python is not None
        return smg_worker(smg_python, model_dir, BatchConfig(), log_dir, tag)
    return our_worker(model_dir, BatchConfig(), log_dir, tag, flags or [])
