"""Where a served token's time goes on a small fast model (issue 39, part 3).

    python bench/step_profile.py                          # the demo model, c = 1, 8, 32
    python bench/step_profile.py --levels 1 --requests 4 --flags "--speculate off"

At each level: the raw engine (mlx-lm's BatchGenerator loop in its own process) and our worker
on the same prompts, alternating, best of `--rounds`; then one more run of our worker with
py-spy sampling both of its processes (the engine process and the handler process). Each
sample is put in the bucket of the innermost Python frame that names one:

- `mlx-lm step`: mlx-lm's generation and prompt batches (the forward, sampling, the wait for
  the GPU/CPU result) - what the raw engine spends too;
- `speculation`: our speculating batch (drafting, clocks, its own verify forwards);
- `engine loop`: planning, the batch's rows, events, the prefix store, sending output;
- `hand-off`: the frames between the two processes, both ends;
- `handlers`: the handler process's servicer code (validation, output, streams);
- `grpc / asyncio`: gRPC's and asyncio's own Python code; `other`: the rest.

Prints wall ms per token (raw, served) and CPU ms per token per bucket and process, and writes
bench/results/step-profile-STAMP.json. Needs py-spy (`pip install py-spy`, in the dev extras).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from load import Client, Sampling
from workers import BatchConfig, log, model_or_demo, our_worker, parse_levels, raw_process
from workload import Shape, make_prompts, model_vocab_size

BUCKETS = (
    ("mlx-lm step", ("mlx_lm/generate.py", "mlx_lm/models/", "mlx_lm/sample_utils.py")),
    ("speculation", ("servicer/engine/speculation/",)),
    ("hand-off", ("servicer/engine/child.py", "servicer/engine_process.py", "msgspec")),
    ("engine loop", ("servicer/engine/",)),
    ("handlers", ("servicer/",)),
    ("grpc / asyncio", ("grpc/", "asyncio/")),
)
RATE = 250  # samples a second per thread


def bucket(stack: str) -> str:
    """The bucket of one collapsed stack ("frame;frame;...", outermost first)."""
    for frame in reversed(stack.split(";")):
        for name, marks in BUCKETS:
            if any(mark in frame for mark in marks):
                return name
    return "other"


def fold(raw: str) -> Counter[str]:
    """py-spy's raw output (one "stack count" a line) -> samples per bucket."""
    found: Counter[str] = Counter()
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            found[bucket(stack)] += int(count)
    return found


def py_spy() -> str:
    found = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(found).exists():
        raise SystemExit("py-spy is not installed: pip install py-spy")
    return found


def children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def served(address: str, prompts: list[list[int]], level: int, tokens: int) -> tuple[int, float]:
    async def run() -> tuple[int, float]:
        async with Client(address, 0, Sampling()) as client:
            started = time.perf_counter()
            records, _ = await client.closed_loop(
                level, len(prompts), Shape(0, tokens), prompts=prompts
            )
            wall = time.perf_counter() - started
            return sum(r.tokens for r in records), wall

    return asyncio.run(run())


def profiled_run(worker: Any, prompts: list[list[int]], level: int, tokens: int, out: Path):
    """One served run with py-spy on the worker and its engine process; samples per bucket."""
    pids = {"handler process": worker.proc.pid}
    for child in children(worker.proc.pid):
        pids["engine process"] = child
    spies = {}
    for name, pid in pids.items():
        target = out / f"{name.replace(' ', '-')}-c{level}.txt"
        command = [py_spy(), "record", "--pid", str(pid), "--rate", str(RATE), "--format"]
        command += ["raw", "--output", str(target), "--nonblocking", "--threads"]
        spies[name] = (
            subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE),
            target,
        )
    time.sleep(1.0)  # py-spy attaches
    count, wall = served(worker.address, prompts, level, tokens)
    for proc, _ in spies.values():
        proc.send_signal(2)  # SIGINT: py-spy writes what it has
    found = {}
    for name, (proc, target) in spies.items():
        proc.wait(60)
        found[name] = dict(fold(target.read_text())) if target.exists() else {}
    return count, wall, found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="default: the demo model")
    parser.add_argument("--levels", type=parse_levels, default=[1, 8, 32])
    parser.add_argument("--tokens", type=int, default=64, help="new tokens a request")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--requests", type=int, default=2, help="requests per client a run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--flags", default="", help="extra flags for our worker")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    model = model_or_demo(args.model)
    vocab = model_vocab_size(model)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    logs = args.out / "logs" / f"step-profile-{stamp}"
    logs.mkdir(parents=True, exist_ok=True)
    batch = BatchConfig()
    results: dict[str, Any] = {"model": str(model), "flags": args.flags, "levels": {}}
    worker = our_worker(model, batch, logs, "profile", args.flags.split()).start()
    try:
        with raw_process(model, batch) as raw:
            for level in args.levels:
                results["levels"][level] = one_level(args, level, vocab, raw, worker, logs)
    finally:
        worker.stop()
    print(render(results))
    path = args.out / f"step-profile-{stamp}.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    log(f"wrote {path}")
    return 0


def one_level(args, level: int, vocab: int, raw, worker, logs: Path) -> dict[str, Any]:
    count = level * args.requests
    shape = Shape(args.prompt_tokens, args.tokens)
    raw_ms, served_ms = [], []
    raw.run(level, shape, requests=level, warm_up=True)
    served(worker.address, make_prompts(level, args.prompt_tokens, vocab, "warm"), level, 16)
    for round_ in range(args.rounds):
        prompts = make_prompts(count, args.prompt_tokens, vocab, f"profile-{level}-{round_}")
        stats = raw.run(level, shape, requests=count, prompts=prompts)
        raw_ms.append(1000 / stats.tokens_per_s)
        tokens, wall = served(worker.address, prompts, level, args.tokens)
        served_ms.append(1000 * wall / tokens)
        log(
            f"c={level} round {round_ + 1}: raw {raw_ms[-1]:.3f} ms/token, ours {served_ms[-1]:.3f}"
        )
    prompts = make_prompts(4 * count, args.prompt_tokens, vocab, f"profile-{level}-spy")
    tokens, wall, samples = profiled_run(worker, prompts, level, args.tokens, logs)
    per_token = {
        process: {k: 1000 * v / RATE / tokens for k, v in found.items()}
        for process, found in samples.items()
    }
    return {
        "raw_ms_per_token": min(raw_ms),
        "served_ms_per_token": min(served_ms),
        "served_over_raw": min(raw_ms) / min(served_ms),
        "profiled_ms_per_token": 1000 * wall / tokens,
        "cpu_ms_per_token": per_token,
    }


def render(results: dict[str, Any]) -> str:
    names = [name for name, _ in BUCKETS] + ["other"]
    lines = [
        f"Model {results['model']}, our flags `{results['flags'] or '(defaults)'}`; wall ms a "
        "token (best of the rounds; served ÷ raw as tok/s), then CPU ms a token by bucket "
        "(py-spy, one more run):",
        "",
        "| c | raw ms | served ms | served ÷ raw | process | " + " | ".join(names) + " |",
        "|---|---|---|---|---|" + "---|" * len(names),
    ]
    for level, found in results["levels"].items():
        head = (
            f"| {level} | {found['raw_ms_per_token']:.3f} | {found['served_ms_per_token']:.3f} "
            f"| {found['served_over_raw']:.3f} "
        )
        for process, buckets in found["cpu_ms_per_token"].items():
            cells = " | ".join(f"{buckets.get(n, 0.0):.3f}" for n in names)
            lines.append(f"{head}| {process} | {cells} |")
            head = "| | | | "
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
