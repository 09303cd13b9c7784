"""`make bench` part "kv-quant": what --kv-bits 8 and 4 give and cost.

- KV bytes per token, at group 64, on a llama of real shape (head_dim 128, float16, random
  weights: bytes do not depend on them), from the engine's own memory measurement.
- Admission: how many 2,000-token requests one --max-kv-memory admits, from the engine's
  admission model on that real-shape model, and live on the demo llama (group 32, its
  head_dim), where the worker's running-requests gauge is watched under 48 concurrent ones.
- Output tok/s of our worker with 8 and 4 bits ÷ unquantized at concurrency 1, 8 and 32,
  interleaved in one run; and the TTFT of a 4,000-token prompt.
- Fidelity on the demo llama and the hybrid demo (bench/kv_fidelity.py): perplexity on held-out
  and unseen text, the largest logprob difference, greedy agreement.

`python bench/kv_quant.py [--quick]` runs the part alone.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path
from typing import Any

import _checkout  # noqa: F401  (before any `servicer` import)
import report
from load import served_run
from workers import BatchConfig, Worker, log, our_worker, resolve_model, scrape_metrics
from workload import make_prompts, percentile

from servicer.demos.text import demo_model_path
from servicer.sysinfo import free_port

VARIANTS = {"fp": (), "q8": ("--kv-bits", "8"), "q4": ("--kv-bits", "4")}
GROUP_32 = ("--kv-group-size", "32")  # the demo models' head_dim
REQUEST_TOKENS = 2000
ADMISSION_LIMIT = 1 << 30  # bytes, for the real-shape count
LIVE_LIMIT = "24M"  # the demo llama: about 11 unquantized 2,000-token requests
LIVE_REQUESTS = 48
LIVE_ANSWER = 256


def real_shape_bytes() -> dict[str, Any]:
    """Bytes per token and 2,000-token requests under ADMISSION_LIMIT, for each variant, on a
    llama of real shape (2 layers suffice: every layer is alike)."""
    from fixtures import real_shape_llama

    from servicer.admission import Admission
    from servicer.engine.cache_kinds import make_row_cache
    from servicer.engine.memory import measure

    model, layers = real_shape_llama()
    found = {}
    for name, bits in (("fp", None), ("q8", 8), ("q4", 4)):
        caches = make_row_cache(model, bits, 64) if bits else None
        memory = measure(model, caches)
        per_token = sum(b for b, _ in memory.per_token) / layers
        need = memory.estimate(REQUEST_TOKENS)
        found[name] = {
            "bytes_per_token_per_layer": per_token,
            "admitted": ADMISSION_LIMIT // need,
            "admission": Admission(memory, ADMISSION_LIMIT).limit_bytes,
        }
    for name in ("q8", "q4"):
        found[name]["bytes_ratio"] = (
            found[name]["bytes_per_token_per_layer"] / found["fp"]["bytes_per_token_per_layer"]
        )
        found[name]["admitted_ratio"] = found[name]["admitted"] / found["fp"]["admitted"]
    return found


def model_bytes(model_dir: Path, tokens: tuple[int, ...] = (4096, 32768)) -> dict[str, Any]:
    """KV bytes of a given model (the real one, say) for each variant, measured off its own
    caches, with the group size the worker would pick: per token in its full-attention
    layers, per token in its sliding-window layers (never quantized), and one request of
    each of `tokens`."""
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from servicer.engine.cache_kinds import make_row_cache
    from servicer.engine.memory import measure
    from servicer.engine.parts import cache_head_sizes, kv_group_size

    model, _ = load(str(model_dir))
    group = kv_group_size(cache_head_sizes(model), None)
    found: dict[str, Any] = {"model": str(model_dir), "group_size": group}
    for name, bits in (("fp", None), ("q8", 8), ("q4", 4)):
        caches = make_row_cache(model, bits, group) if bits else make_prompt_cache(model)
        memory = measure(model, caches)
        found[name] = {
            "full_attention_bytes_per_token": sum(b for b, w in memory.per_token if w is None),
            "window_bytes_per_token": sum(b for b, w in memory.per_token if w),
            "request_bytes": {n: memory.estimate(n) for n in tokens},
        }
    return found


def render_model_bytes(found: dict[str, Any]) -> str:
    fp = found["fp"]
    lines = [
        f"KV bytes of {found['model']} (group {found['group_size']})",
        "",
        "| | unquantized | 8 bits | 4 bits |",
        "|---|---|---|---|",
    ]
    rows = [("full-attention layers, bytes a token", lambda v: v["full_attention_bytes_per_token"])]
    rows.append(
        ("sliding-window layers, bytes a token (as is)", lambda v: v["window_bytes_per_token"])
    )
    for n in fp["request_bytes"]:
        rows.append((f"one {n:,}-token request, MiB", lambda v, n=n: v["request_bytes"][n] / 2**20))
    for label, value in rows:
        base = value(fp)
        cells = [
            f"{value(found[k]):,.1f}"
            + (f" ({value(found[k]) / base:.2f}x)" if k != "fp" and base else "")
            for k in ("fp", "q8", "q4")
        ]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def running_now(port: int) -> float:
    name = "mlx_worker_running_requests"
    return scrape_metrics(port, [name])[name]


def live_admission(model: Path, flags: tuple[str, ...], log_dir: Path, tag: str) -> int:
    """The most requests decoding at once, seen from the metrics, while LIVE_REQUESTS
    2,000-token requests are sent together under --max-kv-memory LIVE_LIMIT. Full prefill
    chunks and answers of LIVE_ANSWER tokens keep the early requests decoding while the
    later ones are prefilled, so memory, not the prefill order, is what stops admission."""
    port = free_port()
    extra = (*flags, *GROUP_32, "--max-kv-memory", LIVE_LIMIT, "--max-prefill-stall-ms", "0")
    worker = our_worker(
        model, BatchConfig(64, 8), log_dir, tag, (*extra, "--metrics-port", str(port))
    )
    worker.start()
    peak, done = 0.0, threading.Event()

    def watch() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, running_now(port))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        prompts = make_prompts(LIVE_REQUESTS, REQUEST_TOKENS, 512, f"admission-{tag}")
        served_run(worker.address, prompts, len(prompts), LIVE_ANSWER)
    finally:
        done.set()
        watcher.join()
        worker.stop()
    return int(peak)


def throughput(levels: tuple[int, ...], rounds: int, log_dir: Path) -> dict[str, Any]:
    """Served tok/s of each variant ÷ unquantized, rounds interleaved, and the TTFT of a
    4,000-token prompt (demo llama, group 32)."""
    model = demo_model_path()
    workers: dict[str, Worker] = {
        name: our_worker(
            model, BatchConfig(), log_dir, f"kv-{name}", (*flags, "--kv-group-size", "32")
        )
        for name, flags in VARIANTS.items()
    }
    result: dict[str, Any] = {"levels": {}, "ttft_4000_ms": {}}
    try:
        for worker in workers.values():
            worker.start()
        for level in levels:
            runs: dict[str, list[float]] = {name: [] for name in workers}
            for round_ in range(rounds + 1):  # the first round warms up
                prompts = make_prompts(max(4, 2 * level), 128, 512, f"kv-{level}-{round_}")
                for name, worker in workers.items():
                    stats = served_run(worker.address, prompts, level, 64)
                    if round_:
                        runs[name].append(stats.tokens_per_s)
            fp = percentile(runs["fp"], 50) or 0.0
            result["levels"][level] = {
                name: {"tokens_per_s": percentile(v, 50), "ratio": (percentile(v, 50) or 0) / fp}
                for name, v in runs.items()
            }
            log(
                f"kv-quant c={level}: "
                + ", ".join(f"{n} {r['ratio']:.2f}" for n, r in result["levels"][level].items())
            )
        long = make_prompts(2, 4000, 512, "kv-ttft")
        for name, worker in workers.items():
            result["ttft_4000_ms"][name] = served_run(worker.address, long, 1, 8).ttft_p50_ms or 0
    finally:
        for worker in workers.values():
            worker.stop()
    return result


def run_part(quick: bool = False, log_dir: Path = Path("bench/results/logs")) -> dict[str, Any]:
    from kv_fidelity import fidelity

    log_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"real_shape": real_shape_bytes(), "live_admission": {}}
    for name, flags in VARIANTS.items():
        result["live_admission"][name] = live_admission(demo_model_path(), flags, log_dir, name)
        log(f"kv-quant: {name} admits {result['live_admission'][name]} at {LIVE_LIMIT}")
    levels, rounds = ((1, 32), 1) if quick else ((1, 8, 32), 2)
    result["throughput"] = throughput(levels, rounds, log_dir)
    result["fidelity"] = {kind: fidelity(kind) for kind in ("llama", "hybrid")}
    return result


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def render(result: dict[str, Any]) -> str:
    real, live = result["real_shape"], result["live_admission"]
    lines = [
        "| | unquantized | 8 bits | 4 bits |",
        "|---|---|---|---|",
        "| KV bytes per token per layer, head_dim 128, float16, group 64 | "
        + " | ".join(
            f"{real[n]['bytes_per_token_per_layer']:.0f}"
            + (f" ({real[n]['bytes_ratio']:.3f}x)" if n != "fp" else "")
            for n in VARIANTS
        )
        + " |",
        f"| 2,000-token requests admitted under {ADMISSION_LIMIT >> 20} MiB (same model) | "
        + " | ".join(
            f"{real[n]['admitted']}" + (f" ({real[n]['admitted_ratio']:.2f}x)" if n != "fp" else "")
            for n in VARIANTS
        )
        + " |",
        f"| most running at once, {LIVE_REQUESTS} 2,000-token requests, demo llama, "
        f"--max-kv-memory {LIVE_LIMIT}, group 32 | "
        + " | ".join(
            f"{live[n]}" + (f" ({live[n] / live['fp']:.2f}x)" if n != "fp" and live["fp"] else "")
            for n in VARIANTS
        )
        + " |",
    ]
    throughput = result["throughput"]
    for level, runs in throughput["levels"].items():
        lines.append(
            f"| output tok/s ÷ unquantized, c={level} (demo llama, group 32) | "
            + " | ".join(_ratio(runs[n]["ratio"]) for n in VARIANTS)
            + " |"
        )
    lines.append(
        "| TTFT of a 4,000-token prompt, ms | "
        + " | ".join(f"{throughput['ttft_4000_ms'][n]:.0f}" for n in VARIANTS)
        + " |"
    )
    for kind, fid in result["fidelity"].items():
        for text in ("held_out", "unseen"):
            base = fid[text]["fp"]["ppl"]
            lines.append(
                f"| perplexity, {kind} demo, {text.replace('_', '-')} text (group 32) | "
                + " | ".join(
                    f"{fid[text][n]['ppl']:.3f}"
                    + (f" ({fid[text][n]['ppl'] / base - 1:+.2%})" if n != "fp" else "")
                    for n in VARIANTS
                )
                + " |"
            )
        gaps = [max(fid["held_out"][n]["gap"], fid["unseen"][n]["gap"]) for n in ("q8", "q4")]
        greedy = [fid["greedy"][n] for n in ("q8", "q4")]
        lines.append(
            f"| {kind} demo: largest logprob difference; greedy equal (until divergence / all) | "
            "- | "
            + " | ".join(
                f"{gap:.3f}; {g['until_divergence']:.0%} / {g['total']:.0%}"
                for gap, g in zip(gaps, greedy, strict=True)
            )
            + " |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="levels 1 and 32, one round")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument(
        "--model",
        help="only the KV bytes of this mlx-lm model directory, or `real` for the real model "
        "(../shared/tools/real_model.sh)",
    )
    args = parser.parse_args(argv)
    if args.model is not None:
        found = model_bytes(resolve_model(args.model))
        print(render_model_bytes(found))
        report.save_json(args.out, "kv-bytes", found)
        return 0
    result = run_part(args.quick, args.out / "logs")
    print(render(result))
    report.save_json(args.out, "kv-quant", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
