"""`make bench` part "long-prompt": one long prompt arriving while streams decode, on a real
model (issue 39's table): the long prompt's first token, the streams' longest gap (also in
their own decode steps), and each worker's peak memory.

Workers, one after another on the same cases: ours with its defaults, ours with the prefill
chunk in the decoding rows' forward (`--fuse-prefill`), ours with every row padded to the
longest in one batch (`--no-group-rows`), ours without the prefill budget
(`--max-prefill-stall-ms 0`), ours without the prompt cache (`--prompt-cache-size 0`), and
smg-grpc-servicer (no chunking). Float32 on this CPU: a 4-bit model prefills about 10x slower
here (MLX's CPU quantized matmul), which would measure that kernel rather than the scheduling.

    python bench/long_prompt.py [--model real] [--cases 2:8000,8:8000,2:16000,8:16000]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

import report
from arrival import long_prompt_arrival
from load import Client, Sampling
from workers import BatchConfig, Worker, log, our_worker, resolve_model, smg_worker

CASES = ((2, 8000), (8, 8000), (2, 16000), (8, 16000))
NEW_TOKENS = 16  # the long prompt's answer
WORKERS = {
    "ours": (),
    "ours_fused": ("--fuse-prefill",),
    "ours_off": ("--max-prefill-stall-ms", "0"),
    "ours_nocache": ("--prompt-cache-size", "0"),
    "ours_padded": ("--no-group-rows",),
}
LABELS = {
    "ours": "ours, defaults",
    "ours_fused": "ours, `--fuse-prefill`",
    "ours_off": "ours, `--max-prefill-stall-ms 0`",
    "ours_nocache": "ours, `--prompt-cache-size 0`",
    "ours_padded": "ours, `--no-group-rows`",
    "smg": "smg-grpc-servicer (no chunking)",
}


def parse_cases(text: str) -> tuple[tuple[int, int], ...]:
    """`2:8000,8:16000` -> ((2, 8000), (8, 16000)): streams, prompt tokens."""
    cases = []
    for part in text.split(","):
        streams, tokens = part.split(":")
        cases.append((int(streams), int(tokens)))
    return tuple(cases)


def peak_memory_bytes(pid: int) -> int:
    """The peak resident memory of a process and its children (each one's own peak, summed:
    our engine runs in a child process)."""
    total, pids = 0, [pid]
    while pids:
        current = pids.pop()
        try:
            status = Path(f"/proc/{current}/status").read_text()
            children = Path(f"/proc/{current}/task/{current}/children").read_text().split()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmHWM:"):
                total += int(line.split()[1]) * 1024
        pids.extend(int(child) for child in children)
    return total


async def _cases_on(
    worker: Worker, vocab_size: int, cases: tuple[tuple[int, int], ...]
) -> list[dict[str, Any]]:
    found = []
    async with Client(worker.address, vocab_size, Sampling()) as client:
        for streams, tokens in cases:
            case = await long_prompt_arrival(
                client, streams, tokens, f"long-{streams}-{tokens}", NEW_TOKENS
            )
            assert worker.proc is not None
            case["peak_memory_bytes"] = peak_memory_bytes(worker.proc.pid)
            steps = case["gap_p50_before_ms"]
            case["gap_max_in_steps"] = (
                case["gap_max_during_ms"] / steps if steps and case["gap_max_during_ms"] else None
            )
            found.append(case)
            log(
                f"long prompt: {worker.name} {worker.log_path.stem} {streams} streams + {tokens} "
                f"tokens: TTFT {(case['ttft_ms'] or 0) / 1000:.1f} s, longest gap "
                f"{case['gap_max_during_ms'] or 0:.0f} ms"
            )
    return found


def run_part(
    model: Path,
    cases: tuple[tuple[int, int], ...],
    log_dir: Path,
    smg_python: Path | None,
    flags: tuple[str, ...] = (),
    only: tuple[str, ...] = tuple(WORKERS),
) -> dict[str, Any]:
    """Every worker of `only`, in that order, on every case; a worker that fails is
    reported, the others go on."""
    from mlx_lm.utils import load_tokenizer

    vocab_size = len(load_tokenizer(model).get_vocab())
    batch = BatchConfig(completion_batch_size=32, prefill_batch_size=8)
    workers = {
        name: our_worker(model, batch, log_dir, f"long-{name}", (*flags, *WORKERS[name]))
        for name in only
    }
    if smg_python is not None:
        workers["smg"] = smg_worker(smg_python, model, batch, log_dir, "long")
    results: dict[str, Any] = {"model": str(model), "cases": cases, "workers": {}}
    for name, worker in workers.items():
        try:
            with worker:
                results["workers"][name] = asyncio.run(_cases_on(worker, vocab_size, cases))
        except Exception as exc:  # one worker's failure is a row of the report
            results["workers"][name] = {"error": f"{type(exc).__name__}: {exc}"}
            log(f"FAILED long prompt on {name}: {exc}")
    return results


def render(results: dict[str, Any]) -> str:
    """The issue's table, one block per case, each worker's TTFT also as a ratio to the
    worker without a budget."""
    lines = []
    workers = results["workers"]
    for index, (streams, tokens) in enumerate(results["cases"]):
        lines.append(
            f"\n{tokens:,} prompt tokens arriving while {streams} streams decode, "
            f"{NEW_TOKENS} new tokens ({Path(results['model']).name})\n"
        )
        lines.append(
            "| worker | first token of the long prompt | ÷ budget off | longest gap in the "
            "streams | in their decode steps | peak memory |"
        )
        lines.append("|---|---|---|---|---|---|")
        off = workers.get("ours_off")
        off_ttft = off[index]["ttft_ms"] if isinstance(off, list) else None
        for name, cases in workers.items():
            if not isinstance(cases, list):
                lines.append(f"| {LABELS[name]} | {cases['error'][:60]} | | | | |")
                continue
            case = cases[index]
            ttft, gap = case["ttft_ms"], case["gap_max_during_ms"]
            ratio = f"{ttft / off_ttft:.2f}" if ttft and off_ttft else "-"
            steps = f"{case['gap_max_in_steps']:.1f}" if case["gap_max_in_steps"] else "-"
            lines.append(
                f"| {LABELS[name]} | {(ttft or 0) / 1000:.2f} s | {ratio} | {gap or 0:,.0f} ms "
                f"| {steps} | {case['peak_memory_bytes'] / 2**30:.1f} GB |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="real", help="`real` (default) or a model directory")
    parser.add_argument("--cases", help="streams:tokens,... (default: the four of CASES)")
    parser.add_argument("--side-by-side", action="store_true", help="also smg-grpc-servicer")
    parser.add_argument(
        "--workers",
        default=",".join(WORKERS),
        help=f"which of our workers run (default all: {','.join(WORKERS)})",
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    only = tuple(name.strip() for name in args.workers.split(",") if name.strip())
    unknown = [name for name in only if name not in WORKERS]
    if unknown or not only:
        parser.error(f"--workers {args.workers!r}: name some of {', '.join(WORKERS)}")
    model = resolve_model(args.model)
    assert model is not None
    cases = parse_cases(args.cases) if args.cases else CASES
    smg = None
    if args.side_by_side:
        from workers import smg_servicer_python

        smg = smg_servicer_python()
    results = run_part(model, cases, args.out / "logs", smg, only=only)
    print(render(results))
    report.save_json(args.out, "long-prompt", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
