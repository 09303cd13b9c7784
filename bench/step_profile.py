"""Where a served token's time goes on a small fast model (issue 39, part 3).

    python bench/step_profile.py                          # the demo model, c = 1, 8, 32
    python bench/step_profile.py --levels 1 --requests 4 --flags "--speculate off"

At each level: the raw engine (mlx-lm's BatchGenerator loop in its own process) and our worker
on the same prompts, alternating, best of `--rounds`; then one more run of each on the same
prompts with py-spy sampling the raw engine's process and both of ours (the engine process
and the handler process; `--native` adds C/C++ frames to the stacks kept under logs/). Each
sample is put in the bucket of the innermost Python frame that names one:

- `mlx-lm launch`: the decode step handing the next step's graph to MLX (`async_eval`: on
  a GPU this encodes and launches the step's kernels, and waits where MLX's queue is full);
  mlx-lm's step in the raw engine, the engine's own (decode_batch) when served;
- `mlx-lm wait`: the decode step waiting for the step in flight (`eval`);
- `mlx-lm step`: the rest of the decode and prefill steps (building the forward, sampling):
  mlx-lm's batches in the raw engine, the runner's when served;
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
import functools
import importlib
import inspect
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
    # The decode and prefill steps: mlx-lm's in the raw engine, the engine's own when served.
    (
        "mlx-lm step",
        (
            "mlx_lm/generate.py",
            "mlx_lm/models/",
            "mlx_lm/sample_utils.py",
            "servicer/engine/decode_batch.py",
            "servicer/engine/prompt_batch.py",
            "servicer/engine/runner.py",
        ),
    ),
    ("speculation", ("servicer/engine/speculation/",)),
    ("hand-off", ("servicer/engine/child.py", "servicer/engine_process.py", "msgspec")),
    ("engine loop", ("servicer/engine/",)),
    ("handlers", ("servicer/",)),
    ("grpc / asyncio", ("grpc/", "asyncio/")),
)
RATE = 250  # samples a second per thread
# A decode step handing the next step's graph to MLX (async_eval), and waiting for the step in
# flight (eval): mlx-lm's step in the raw engine, the engine's own (decode_batch) when served.
LAUNCH = "mlx-lm launch"
WAIT = "mlx-lm wait"
# (module, class, launch line, wait line) of each decode step.
STEPS = (
    ("mlx_lm.generate", "GenerationBatch", "mx.async_eval(self._next_tokens", "mx.eval(inputs"),
    ("servicer.engine.decode_batch", "DecodeBatch", "mx.async_eval(sampled", "mx.eval(inputs"),
)


@functools.cache
def step_lines() -> dict[str, str]:
    """py-spy's names for the two lines of each decode step (mlx-lm's `GenerationBatch._step`,
    the engine's `DecodeBatch._step`) where it hands the next step to MLX and where it waits
    for the one in flight: on a GPU the first encodes and launches every kernel of the step."""
    found = {}
    for module, cls, launch, wait in STEPS:
        step = getattr(importlib.import_module(module), cls)._step
        lines, first = inspect.getsourcelines(step)
        path = inspect.getsourcefile(step) or ""
        parts = Path(path).parts
        short = "/".join(parts[parts.index(module.split(".")[0]) :])  # as py-spy names it
        for name, code in ((LAUNCH, launch), (WAIT, wait)):
            at = next((i for i, line in enumerate(lines) if code in line), None)
            if at is not None:
                found[f"_step ({short}:{first + at})"] = name
    return found


def bucket(stack: str) -> str:
    """The bucket of one collapsed stack ("frame;frame;...", outermost first)."""
    frames = stack.split(";")
    innermost = next((f for f in reversed(frames) if ".py:" in f), "")  # past native frames
    for line, name in step_lines().items():
        if innermost.endswith(line):
            return name
    for frame in reversed(frames):
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


class Spies:
    """py-spy on some processes while a run goes; their samples per bucket after it."""

    def __init__(self, pids: dict[str, int], out: Path, level: int, native: bool) -> None:
        self.spies = {}
        for name, pid in pids.items():
            target = out / f"{name.replace(' ', '-')}-c{level}.txt"
            command = [py_spy(), "record", "--pid", str(pid), "--rate", str(RATE), "--format"]
            command += ["raw", "--output", str(target), "--nonblocking", "--threads"]
            command += ["--native"] if native else []
            self.spies[name] = (
                subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE),
                target,
            )
        time.sleep(1.0)  # py-spy attaches

    def stop(self) -> dict[str, dict[str, int]]:
        for proc, _ in self.spies.values():
            proc.send_signal(2)  # SIGINT: py-spy writes what it has
        found = {}
        for name, (proc, target) in self.spies.items():
            proc.wait(60)
            found[name] = dict(fold(target.read_text())) if target.exists() else {}
        return found


def profiled_run(worker: Any, prompts: list[list[int]], level: int, tokens: int, args: Any):
    """One served run with py-spy on the worker and its engine process; samples per bucket."""
    pids = {"handler process": worker.proc.pid}
    for child in children(worker.proc.pid):
        pids["engine process"] = child
    spies = Spies(pids, args.logs, level, args.native)
    count, wall = served(worker.address, prompts, level, tokens)
    return count, wall, spies.stop()


def profiled_raw_run(raw: Any, prompts: list[list[int]], level: int, args: Any):
    """The same prompts through the raw engine with py-spy on its process."""
    spies = Spies({"raw process": raw.proc.pid}, args.logs, level, args.native)
    stats = raw.run(
        level, Shape(args.prompt_tokens, args.tokens), requests=len(prompts), prompts=prompts
    )
    return stats.output_tokens, spies.stop()["raw process"]


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
    parser.add_argument(
        "--native", action="store_true", help="py-spy --native: C/C++ frames in the stacks too"
    )
    args = parser.parse_args(argv)
    model = model_or_demo(args.model)
    vocab = model_vocab_size(model)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    logs = args.out / "logs" / f"step-profile-{stamp}"
    logs.mkdir(parents=True, exist_ok=True)
    args.logs = logs
    batch = BatchConfig()
    results: dict[str, Any] = {"model": str(model), "flags": args.flags, "levels": {}}
    worker = our_worker(model, batch, logs, "profile", args.flags.split()).start()
    try:
        with raw_process(model, batch) as raw:
            for level in args.levels:
                results["levels"][level] = one_level(args, level, vocab, raw, worker)
    finally:
        worker.stop()
    print(render(results))
    path = args.out / f"step-profile-{stamp}.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    log(f"wrote {path}")
    return 0


def one_level(args, level: int, vocab: int, raw, worker) -> dict[str, Any]:
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
    raw_tokens, raw_samples = profiled_raw_run(raw, prompts, level, args)
    tokens, wall, samples = profiled_run(worker, prompts, level, args.tokens, args)
    per_token = {
        process: {k: 1000 * v / RATE / tokens for k, v in found.items()}
        for process, found in samples.items()
    }
    per_token["raw process"] = {k: 1000 * v / RATE / raw_tokens for k, v in raw_samples.items()}
    return {
        "raw_ms_per_token": min(raw_ms),
        "served_ms_per_token": min(served_ms),
        "served_over_raw": min(raw_ms) / min(served_ms),
        "profiled_ms_per_token": 1000 * wall / tokens,
        "cpu_ms_per_token": per_token,
    }


def render(results: dict[str, Any]) -> str:
    names = [LAUNCH, WAIT] + [name for name, _ in BUCKETS] + ["other"]
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
