"""Prefill on one worker, decode on another, through the real smg router (`make bench-pd`).

    python bench/pd.py --model real:smollm2-135m-instruct --model real --levels 1,8

Setups, one after another on the same requests, every worker with the same flags:
- `one`: one worker behind the router;
- `two`: two workers behind the router in its regular mode (cache-aware routing);
- `pd-pull`: `--pd-disaggregation`, the decode worker fetching the prefill's blocks from its
  block server (`--kv-transfer pull`);
- `pd-shared`: the same, both workers on one `--prompt-cache-dir` (`--kv-transfer shared`).

Workload: at each level C, C clients send streamed completions back to back (closed loop),
prompts of 50 to 8,000 tokens (log-uniform, new text each, so no prompt is a hit), 32 new
tokens each (ignore_eos). Reported: output tokens/s, TTFT p50/p90, the longest gap between two
tokens of any stream (the decode side's pace while prompts arrive), failed requests; for the PD
setups the blocks and MB moved (the decode worker's `mlx_worker_kv_transfer_*` and disk-tier
reuse) and the router's phases (`smg_pd_*`: mean prefill leg, decode TTFT). Everything runs on
this one machine: the two PD workers share its cores, so PD buys isolation here, not compute.
Prints the tables, writes bench/results/pd-STAMP.json, logs under bench/results/logs/pd-STAMP/.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _checkout  # noqa: F401  (before any `servicer` import)
import httpx
import report
from workers import Worker, free_port, log, parse_levels, process_env, resolve_model

ROOT = Path(__file__).resolve().parents[1]
SMG = Path(sys.executable).with_name("smg")
NEW_TOKENS = 32
SETUPS = ("one", "two", "pd-pull", "pd-shared")
WORDS = (
    "the",
    "bees",
    "of",
    "the",
    "valley",
    "make",
    "honey",
    "from",
    "the",
    "flowers",
    "of",
    "summer",
    "and",
    "keep",
    "it",
    "in",
    "combs",
    "of",
    "wax",
    "that",
    "the",
    "queen",
    "guards",
    "through",
    "the",
    "winter",
    "while",
    "the",
    "fields",
    "sleep",
    "under",
    "snow",
)


@dataclass
class Record:
    prompt_tokens: int = 0
    ttft_s: float | None = None
    longest_gap_s: float = 0.0
    tokens: int = 0
    error: str = ""


def prompt_of(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)) + f" {rng.random():.9f}"


def workload(seed: int, count: int, low: int, high: int) -> list[str]:
    """`count` prompts of `low` to `high` tokens, log-uniform (about 1.3 tokens a word)."""
    rng = random.Random(seed)
    sizes = [math.exp(rng.uniform(math.log(low), math.log(high))) for _ in range(count)]
    return [prompt_of(rng, max(8, int(size / 1.3))) for size in sizes]


class Router:
    """smg launch in front of the workers, regular or PD."""

    def __init__(self, args: list[str], log_path: Path) -> None:
        self.port, self.metrics_port = free_port(), free_port()
        command = [str(SMG), "launch", *args, "--host", "127.0.0.1", "--port", str(self.port)]
        command += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.metrics_port)]
        self._log = log_path.open("w")
        self.proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = ""

    def wait(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        with httpx.Client(base_url=self.url, timeout=60) as client:
            while time.monotonic() < deadline:
                try:
                    if not self.model:
                        data = client.get("/v1/models").json().get("data")
                        self.model = data[0]["id"] if data else ""
                    else:
                        body = {"model": self.model, "prompt": "hi", "max_tokens": 1}
                        if client.post("/v1/completions", json=body).status_code == 200:
                            return
                except (httpx.HTTPError, ValueError, KeyError):
                    pass
                time.sleep(0.2)
        raise RuntimeError("the router never served")

    def metrics(self) -> str:
        return httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).text

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(10)
        self._log.close()


def stream_one(client: httpx.Client, model: str, prompt: str) -> Record:
    body = {"model": model, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0}
    body |= {"stream": True, "ignore_eos": True}
    record = Record()
    start = last = time.perf_counter()
    try:
        with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {response.read()[:200]!r}"
                return record
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if not chunk.get("choices") or not chunk["choices"][0].get("text"):
                    continue
                now = time.perf_counter()
                if record.ttft_s is None:
                    record.ttft_s = now - start
                else:
                    record.longest_gap_s = max(record.longest_gap_s, now - last)
                last = now
                record.tokens += 1
    except httpx.HTTPError as exc:
        record.error = repr(exc)[:200]
    return record


def closed_loop(router: Router, level: int, prompts: list[str]) -> dict[str, Any]:
    queue = list(prompts)
    records: list[Record] = []

    def client_loop() -> None:
        with httpx.Client(base_url=router.url, timeout=600) as client:
            while queue:
                prompt = queue.pop()
                records.append(stream_one(client, router.model, prompt))

    started = time.perf_counter()
    with ThreadPoolExecutor(level) as pool:
        for future in [pool.submit(client_loop) for _ in range(level)]:
            future.result()
    seconds = time.perf_counter() - started
    done = [r for r in records if not r.error and r.ttft_s is not None]
    ttfts = sorted(r.ttft_s for r in done if r.ttft_s is not None)

    def pct(q: float) -> float | None:
        return ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))] * 1000 if ttfts else None

    return {
        "requests": len(records),
        "failed": len(records) - len(done),
        "errors": sorted({r.error for r in records if r.error})[:3],
        "tok_s": sum(r.tokens for r in done) / seconds,
        "ttft_p50_ms": pct(0.5),
        "ttft_p90_ms": pct(0.9),
        "longest_gap_ms": max((r.longest_gap_s for r in done), default=0.0) * 1000,
        "seconds": seconds,
    }


def worker(model: Path, log_dir: Path, tag: str, flags: list[str]) -> Worker:
    port = free_port()
    command = [sys.executable, "-m", "servicer", "--model", str(model), "--port", str(port)]
    command += ["--protocols", "mlx,vllm", "--log-level", "warning", *flags]
    return Worker(f"ours-{tag}", command, port, log_dir / f"{tag}.log", process_env())


def metric(page: str, name: str) -> float:
    total = 0.0
    for match in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", page, re.M):
        total += float(match.group(1))
    return total


def run_setup(
    setup: str, model: Path, log_dir: Path, levels: list[int], prompts: dict[int, list[str]]
) -> dict[str, Any]:
    cache = Path(tempfile.mkdtemp(prefix="pd-bench-"))
    workers: list[Worker] = []
    metrics_port = free_port()
    if setup == "one":
        workers = [worker(model, log_dir, "one", [])]
        route = ["--worker-urls", f"grpc://{workers[0].address}"]
    elif setup == "two":
        workers = [worker(model, log_dir, f"two{i}", []) for i in range(2)]
        route = ["--worker-urls", *(f"grpc://{w.address}" for w in workers)]
    else:
        transfer = setup.removeprefix("pd-")
        flags = ["--kv-transfer", transfer, "--prompt-cache-dir"]
        workers = [
            worker(model, log_dir, "prefill", [*flags, str(cache / "p"), "--kv-role", "prefill"]),
            worker(
                model,
                log_dir,
                "decode",
                [
                    *flags,
                    str(cache / ("p" if transfer == "shared" else "d")),
                    "--kv-role",
                    "decode",
                    "--metrics-port",
                    str(metrics_port),
                ],
            ),
        ]
        route = ["--pd-disaggregation", "--prefill", f"grpc://{workers[0].address}"]
        route += ["--decode", f"grpc://{workers[1].address}"]
    for each in workers:
        each.start()
    router = Router(route, log_dir / f"smg-{setup}.log")
    out: dict[str, Any] = {"levels": {}}
    try:
        router.wait()
        for level in levels:
            log(f"{setup}: c={level}, {len(prompts[level])} requests")
            out["levels"][str(level)] = closed_loop(router, level, prompts[level])
        if setup.startswith("pd-"):
            page = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
            names = ("fetched_blocks", "fetched_bytes", "fetch_seconds", "failures", "found_blocks")
            out["transfer"] = {n: metric(page, f"mlx_worker_kv_transfer_{n}_total") for n in names}
            out["transfer"]["reused_tokens"] = metric(
                page, 'mlx_worker_prompt_cache_tokens_reused_total{tier="disk"}'
            )
            phases = router.metrics()
            names = ("prefill_duration", "decode_ttft", "ttft", "kv_transfer_duration")
            out["phases"] = {name: _mean(phases, f"smg_pd_{name}_seconds") for name in names}
            out["router_pd_lines"] = [
                line
                for line in phases.splitlines()
                if line.startswith("smg_pd_") and "_bucket" not in line
            ]
    finally:
        router.close()
        for each in workers:
            each.stop()
    return out


def _mean(page: str, name: str) -> float | None:
    total, count = metric(page, f"{name}_sum"), metric(page, f"{name}_count")
    return total / count * 1000 if count else None


def render(results: dict[str, Any]) -> str:
    lines = [f"# PD through smg ({results['commit']})", ""]
    for model, setups in results["models"].items():
        lines += [f"## {model}", ""]
        rows = []
        for setup, found in setups.items():
            for level, stats in found["levels"].items():
                rows.append(
                    [
                        setup,
                        level,
                        stats["tok_s"],
                        stats["ttft_p50_ms"],
                        stats["ttft_p90_ms"],
                        stats["longest_gap_ms"],
                        f"{stats['failed']}/{stats['requests']}",
                    ]
                )
        headers = ["setup", "c", "tok/s", "TTFT p50 ms", "TTFT p90 ms", "longest gap ms", "failed"]
        lines += [report.markdown_table(headers, rows), ""]
        for setup, found in setups.items():
            if "transfer" in found:
                t, p = found["transfer"], found["phases"]
                rate = t["fetched_bytes"] / t["fetch_seconds"] / 1e6 if t["fetch_seconds"] else 0
                lines.append(
                    f"- {setup}: decode side found {t['found_blocks']:.0f} blocks "
                    f"({t['fetched_blocks']:.0f} fetched, {t['fetched_bytes'] / 1e6:.1f} MB at "
                    f"{rate:.0f} MB/s), reused {t['reused_tokens']:.0f} prompt tokens, "
                    f"{t['failures']:.0f} failed transfers; router phases (mean ms): prefill leg "
                    f"{_num(p['prefill_duration'])}, decode TTFT {_num(p['decode_ttft'])}, "
                    f"TTFT {_num(p['ttft'])}"
                )
        lines.append("")
    return "\n".join(lines)


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", help="real, real:NAME or a directory")
    parser.add_argument("--levels", type=parse_levels, default=[1, 8])
    parser.add_argument("--requests", type=int, default=8, help="requests a level (x2 at c>1)")
    parser.add_argument("--setups", default=",".join(SETUPS))
    parser.add_argument("--max-prompt", type=int, default=8000)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args(argv)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    log_dir = args.out / "logs" / f"pd-{stamp}"
    results: dict[str, Any] = {"commit": _commit(), "machine": report.machine_info(), "models": {}}
    for name in args.model or ["real:smollm2-135m-instruct"]:
        model = resolve_model(name)
        assert model is not None
        prompts = {
            level: workload(level, args.requests * (2 if level > 1 else 1), 50, args.max_prompt)
            for level in args.levels
        }
        found = {}
        for setup in args.setups.split(","):
            found[setup] = run_setup(setup, model, log_dir / model.name, args.levels, prompts)
        results["models"][model.name] = found
    text = render(results)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"pd-{stamp}.json").write_text(json.dumps(results, indent=1))
    return 0


def _commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


if __name__ == "__main__":
    sys.exit(main())
