"""`make bench` part "faces": the vLLM face against the MLX face, through the smg router.

    python bench/faces.py --model real                      # Gemma and the SmolLM2 chat model
    python bench/faces.py --model DIR --rounds 2
    python bench/bench.py --model real --only faces         # the same, as a part of bench.py

Issue 37's acceptance: on the real models, the vLLM face's output tokens/s and TTFT through
the router are at least 0.98 of the MLX face's, in one run, at concurrency 1 and 8.

For each model, two of our workers on it: one with `--protocols mlx` (the router takes it for
MLX) and one with `--protocols mlx,vllm` (the router takes it for vLLM), each behind its own
`smg launch`. Both stay up for the whole model; the one not being measured idles (the router
polls the vLLM one's loads every 10 s and holds its KV-event stream: that is part of the face).
In each round, at each level, both faces run the same closed loop on the same prompts back to
back, the first face alternating from round to round, so the machine's drift hits both alike:
C clients send streamed chat completions (`max_tokens` tokens, ignore_eos, temperature 0) one
after another until the run's requests are done; prompts are new for every round and level.

Reported per face and level: output tokens/s (every output token ÷ first send to last token),
TTFT p50 (send to the first content chunk), TPOT p50, as the median over rounds; and the
speed ratios vLLM ÷ MLX (tok/s vLLM ÷ MLX; TTFT MLX ÷ vLLM, so above 1 is faster for both),
the median of the per-round ratios, against the issue's 0.98.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import shlex
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import _checkout  # noqa: F401  (before any `servicer` import)
import httpx
import report
from genai import Router
from workers import (
    BatchConfig,
    Worker,
    log,
    model_or_demo,
    our_worker,
    parse_levels,
    resolve_model,
)
from workload import LevelStats, RequestRecord, StealMeter, percentile

from servicer.sysinfo import cpu_seconds

FACES = {"mlx": "mlx", "vllm": "mlx,vllm"}  # face -> the worker's --protocols
LEVELS = (1, 8)
MAX_TOKENS = 64
ROUNDS = 3
REQUESTS = {1: 4, 8: 16}  # per run; at least one wave at every level
TARGET = 0.98
# `--model real` here means both real models: the issue asks for both.
REAL_MODELS = ("real", "real:smollm2-135m-instruct")

ASKS = (
    "Write a short story about {0} in {1}.",
    "Describe a day in the life of {0} who lives in {1}.",
    "Explain to a child why {0} might visit {1}.",
    "Give three reasons {0} would enjoy {1}.",
    "Write a letter from {0} to a friend back in {1}.",
    "What would {0} pack for a trip to {1}?",
)
SUBJECTS = (
    "a lighthouse keeper",
    "a retired astronaut",
    "a curious fox",
    "a young baker",
    "an old fisherman",
    "a robot gardener",
    "a travelling musician",
    "a chess champion",
)
PLACES = (
    "Lisbon",
    "a mountain village",
    "the Sahara",
    "a busy train station",
    "Kyoto",
    "a floating market",
    "the Arctic",
    "a small island",
)


def questions(count: int, seed: str) -> list[str]:
    """`count` different chat questions (the same for both faces, new for every seed)."""
    rng = random.Random(seed)
    out: list[str] = []
    while len(out) < count:
        text = rng.choice(ASKS).format(rng.choice(SUBJECTS), rng.choice(PLACES))
        if text not in out:
            out.append(text)
    return out


async def chat(client: httpx.AsyncClient, model: str, text: str, max_tokens: int) -> RequestRecord:
    """One streamed chat completion; the output tokens from the usage the router reports
    (its content chunks when it reports none). Errors are recorded, not raised."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    record = RequestRecord(start=time.perf_counter())
    chunks, usage = 0, None
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                record.error = f"HTTP {response.status_code}: {text[:200]}"
            else:
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    event = json.loads(data)
                    if event.get("usage"):
                        usage = event["usage"].get("completion_tokens")
                    if any((c.get("delta") or {}).get("content") for c in event.get("choices", [])):
                        now = time.perf_counter()
                        if record.ttft is None:
                            record.ttft = now - record.start
                        chunks += 1
                        record.end = now
    except (httpx.HTTPError, json.JSONDecodeError) as error:
        record.error = f"{type(error).__name__}: {error}"
    record.end = record.end or time.perf_counter()
    record.tokens = usage if usage is not None else chunks
    return record


async def closed_loop(
    base: str, model: str, level: int, texts: list[str], max_tokens: int
) -> tuple[list[RequestRecord], float]:
    """`level` clients send `texts` one after another until all are done; the records and
    the driver's CPU (cores) over the run."""
    limits = httpx.Limits(max_connections=level + 2)
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as client:
        queue = iter(texts)
        records: list[RequestRecord] = []

        async def one_client() -> None:
            for text in queue:
                records.append(await chat(client, model, text, max_tokens))

        cpu, wall = cpu_seconds(), time.perf_counter()
        await asyncio.gather(*(one_client() for _ in range(level)))
        return records, (cpu_seconds() - cpu) / (time.perf_counter() - wall)


def _tpot_p50_ms(records: list[RequestRecord]) -> float | None:
    values = [
        (r.end - r.start - r.ttft) / (r.tokens - 1)
        for r in records
        if r.error is None and r.ttft is not None and r.tokens > 1
    ]
    value = percentile(values, 50)
    return None if value is None else value * 1000


class Face:
    """One face: our worker with its --protocols, and a router of its own in front."""

    def __init__(self, face: str, model: Path, log_dir: Path, tag: str, flags: list[str]) -> None:
        self.face = face
        flags = [*flags, "--protocols", FACES[face]]
        self.worker: Worker = our_worker(model, BatchConfig(), log_dir, f"{tag}-{face}", flags)
        self.router = Router(self.worker, log_dir / f"router-{tag}-{face}.log")
        self.model_name = ""

    def __enter__(self) -> Face:
        self.worker.start()
        try:
            self.model_name = self.router.start(timeout=300)
        except BaseException:
            self.close()
            raise
        return self

    def runtime(self) -> str | None:
        """The runtime the router took the worker for (from its /workers list)."""
        try:
            body = httpx.get(f"{self.router.base}/workers", timeout=10).json()
        except (httpx.HTTPError, ValueError):
            return None
        for entry in body.get("workers", []) if isinstance(body, dict) else []:
            for key in ("runtime_type", "runtime", "connection_mode_runtime"):
                if isinstance(entry, dict) and entry.get(key):
                    return str(entry[key])
        return None

    def run(self, level: int, texts: list[str], max_tokens: int) -> LevelStats:
        steal, cpu, start = StealMeter(), self.worker.cpu_seconds(), time.perf_counter()
        records, client_cpu = asyncio.run(
            closed_loop(self.router.base, self.model_name, level, texts, max_tokens)
        )
        worker_cpu = (self.worker.cpu_seconds() - cpu) / (time.perf_counter() - start)
        return LevelStats.from_records(
            level,
            records,
            expected_tokens=max_tokens,
            client_cpu=client_cpu,
            worker_cpu=worker_cpu,
            steal_share=steal.share(),
            tpot_p50_ms=_tpot_p50_ms(records),
        )

    def close(self) -> None:
        self.router.stop()
        self.worker.stop()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _median(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


def _ratio(vllm: float | None, mlx: float | None, higher_is_faster: bool) -> float | None:
    """vLLM's speed ÷ MLX's: tok/s vLLM ÷ MLX; a latency MLX ÷ vLLM."""
    if not vllm or not mlx:
        return None
    return vllm / mlx if higher_is_faster else mlx / vllm


def measure_model(
    model: Path,
    name: str,
    levels: tuple[int, ...],
    rounds: int,
    requests: dict[int, int],
    max_tokens: int,
    log_dir: Path,
    flags: list[str],
    fresh: bool = False,
) -> dict[str, Any]:
    """Both faces on `model`, alternating within every round and level; with `fresh`, both
    workers (and routers) start anew for every round, so that neither keeps for the whole
    run whatever placement its process happened to get."""
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {f: {c: [] for c in levels} for f in FACES}
    runtimes: dict[str, str | None] = {}
    with contextlib.ExitStack() as whole:
        faces = {} if fresh else _start(whole, model, name, levels, log_dir, flags, runtimes)
        for round_no in range(1, rounds + 1):
            with contextlib.ExitStack() as this_round:
                if fresh:
                    faces = _start(this_round, model, name, levels, log_dir, flags, runtimes)
                order = list(FACES) if round_no % 2 else list(reversed(FACES))
                for level in levels:
                    texts = questions(requests[level], f"{name}-r{round_no}-c{level}")
                    for face in order:
                        stats = faces[face].run(level, texts, max_tokens)
                        runs[face][level].append({"round": round_no, **stats.__dict__})
                        log(
                            f"faces {name} round {round_no} c={level}: {face} "
                            f"{stats.tokens_per_s:.1f} tok/s, TTFT p50 "
                            f"{stats.ttft_p50_ms or 0:.0f} ms, {stats.errors} errors"
                        )
    return {"model": str(model), "name": name, "runtimes": runtimes, **summarise(runs, levels)}


def _start(
    stack: contextlib.ExitStack,
    model: Path,
    name: str,
    levels: tuple[int, ...],
    log_dir: Path,
    flags: list[str],
    runtimes: dict[str, str | None],
) -> dict[str, Face]:
    """Both faces' workers and routers, warmed with a wave at each level (never measured)."""
    faces = {}
    for face in FACES:
        log(f"faces {name}: starting our worker with --protocols {FACES[face]} and a router")
        faces[face] = stack.enter_context(Face(face, model, log_dir, name, flags))
    runtimes.update({face: faces[face].runtime() for face in faces})
    log(f"faces {name}: the routers took the workers for {runtimes}")
    for face in faces.values():
        for level in levels:
            face.run(level, questions(level, f"warm-up-{level}"), 8)
    return faces


def summarise(runs: dict[str, dict[int, list[dict[str, Any]]]], levels) -> dict[str, Any]:
    """Per level: each face's medians over rounds and the per-round speed ratios."""
    rows = []
    for level in levels:
        entry: dict[str, Any] = {"concurrency": level}
        for face in FACES:
            mine = runs[face][level]
            entry[face] = {
                "tokens_per_s": _median([r["tokens_per_s"] for r in mine]),
                "ttft_p50_ms": _median([r["ttft_p50_ms"] for r in mine]),
                "tpot_p50_ms": _median([r["extra"].get("tpot_p50_ms") for r in mine]),
                "errors": sum(r["errors"] for r in mine),
                "requests": sum(r["requests"] for r in mine),
                "rounds": len(mine),
            }
        pairs = list(zip(runs["vllm"][level], runs["mlx"][level], strict=True))
        for key, faster in (("tokens_per_s", True), ("ttft_p50_ms", False)):
            per_round = [_ratio(v[key], m[key], faster) for v, m in pairs]
            entry[f"{key}_ratios"] = per_round
            entry[f"{key}_ratio"] = _median(per_round)
        rows.append(entry)
    return {"levels": rows, "runs": runs}


def run_part(
    models: list[str | None],
    log_dir: Path,
    *,
    levels: tuple[int, ...] = LEVELS,
    rounds: int = ROUNDS,
    requests: dict[int, int] | None = None,
    max_tokens: int = MAX_TOKENS,
    flags: list[str] | None = None,
    fresh: bool = False,
) -> dict[str, Any]:
    """Every model in `models` (None: the demo model; `real`: both real models)."""
    wanted: list[str | None] = []
    for model in models:
        wanted += list(REAL_MODELS) if model == "real" else [model]
    requests = {level: (requests or REQUESTS).get(level, 2 * level) for level in levels}
    settings = {
        "levels": list(levels),
        "rounds": rounds,
        "requests": requests,
        "max_tokens": max_tokens,
        "target": TARGET,
        "worker_flags": flags or [],
        "fresh_workers": fresh,
    }
    results: dict[str, Any] = {"settings": settings, "models": [], "failures": []}
    for spec in wanted:
        path = model_or_demo(resolve_model(spec))
        name = path.name
        try:
            found = measure_model(
                path, name, levels, rounds, requests, max_tokens, log_dir, flags or [], fresh
            )
        except RuntimeError as error:
            log(f"faces {name}: FAILED {error}")
            results["failures"].append(f"{name}: {error}")
            continue
        results["models"].append(found)
    return results


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def render(results: dict[str, Any]) -> str:
    s = results["settings"]
    lines = [
        f"Streamed chat completions through `smg launch`, {s['max_tokens']} new tokens, "
        f"ignore_eos, temperature 0; requests per run {s['requests']} by concurrency; "
        f"{s['rounds']} rounds, the faces back to back in each (first face alternating); "
        "medians over rounds.",
        "",
    ]
    rows = []
    for found in results["models"]:
        for entry in found["levels"]:
            for face in FACES:
                stats = entry[face]
                runtime = found["runtimes"].get(face) or "?"
                rows.append(
                    [
                        found["name"],
                        f"{face} (router: {runtime})",
                        entry["concurrency"],
                        _fmt(stats["tokens_per_s"], 2),
                        _fmt(stats["ttft_p50_ms"], 0),
                        _fmt(stats["tpot_p50_ms"], 1),
                        f"{stats['errors']} of {stats['requests']}",
                    ]
                )
    headers = ["model", "face", "c", "tok/s", "TTFT p50 ms", "TPOT p50 ms", "errors"]
    lines += [report.markdown_table(headers, rows), ""]
    rows = []
    for found in results["models"]:
        for entry in found["levels"]:
            row: list[Any] = [found["name"], entry["concurrency"]]
            verdict = []
            for key in ("tokens_per_s", "ttft_p50_ms"):
                ratio = entry[f"{key}_ratio"]
                each = ", ".join(_fmt(r, 3) for r in entry[f"{key}_ratios"])
                row.append(f"**{_fmt(ratio, 3)}** ({each})")
                verdict.append(ratio is not None and ratio >= s["target"])
            row.append("yes" if all(verdict) else "**no**")
            rows.append(row)
    headers = ["model", "c", "tok/s vLLM ÷ MLX (per round)", "TTFT MLX ÷ vLLM (per round)"]
    headers.append(f"both ≥ {s['target']}")
    lines += [
        "Speed ratios, the median of the per-round ratios (above 1: the vLLM face is faster; "
        "TTFT as MLX ÷ vLLM, so a shorter vLLM TTFT is above 1 too):",
        "",
        report.markdown_table(headers, rows),
    ]
    if results["failures"]:
        lines += ["", "Failures: " + "; ".join(results["failures"])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model",
        action="append",
        help="a model directory, `real` (both real models: Gemma and the SmolLM2 chat model), "
        "or `real:NAME` (one of ../shared/tools/real_model.sh's MODELs); repeatable "
        "(default: the demo model)",
    )
    parser.add_argument(
        "--levels", type=parse_levels, default=[1, 8], help="concurrency levels (default 1,8)"
    )
    parser.add_argument("--rounds", type=int, default=ROUNDS, help=f"default {ROUNDS}")
    parser.add_argument(
        "--requests",
        help="requests per run by level, e.g. 1:4,8:16 (default: "
        + ",".join(f"{c}:{n}" for c, n in REQUESTS.items())
        + "; 2 per client at other levels)",
    )
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    parser.add_argument("--worker-flags", default="", help="extra flags for both workers")
    parser.add_argument(
        "--fresh-workers",
        action="store_true",
        help="start both workers and routers anew for every round (slower; evens out what "
        "each process got at start)",
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    levels = tuple(args.levels)
    requests = dict(REQUESTS)
    if args.requests:
        requests = {int(c): int(n) for c, n in (p.split(":") for p in args.requests.split(","))}
    stamp = time.strftime("%Y%m%d-%H%M%S")
    # SIGTERM unwinds like an error, so the workers and routers started so far are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    results = run_part(
        args.model or [None],
        args.out / "logs" / stamp,
        levels=levels,
        rounds=args.rounds,
        requests=requests,
        max_tokens=args.max_tokens,
        flags=shlex.split(args.worker_flags),
        fresh=args.fresh_workers,
    )
    results["date"] = time.strftime("%Y-%m-%d %H:%M %Z")
    results["machine"] = report.machine_info()
    print(render(results))
    print(f"\nMachine: {report.machine_line(results)}")
    report.save_json(args.out, "faces", results)
    return 1 if results["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
