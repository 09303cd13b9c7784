"""The engine's loop against the raw engine, in one process (issue 39, part 3).

    python bench/engine_loop.py                      # the demo model, c = 1, 8, 32
    python bench/engine_loop.py --levels 1 --rounds 6 --model real
    python bench/engine_loop.py --levels 8 --worker-flags "--speculate off"

No server, no gRPC, no second process: the worker's `Engine` (scheduler, batch, prefix store,
speculation, hand-off to an outbox; its default settings, as `python -m servicer` builds them)
and mlx-lm's `BatchGenerator` loop (bench/raw.py), each driven by a closed loop that sends the
next prompt as soon as a request finishes, on the same prompts, alternating within each round.
What the served sweep adds beyond this ratio is the handler process, gRPC and the client; what
this ratio lacks of 1.0 is the engine loop's own host work around mlx-lm's step (the step's
graph is mlx-lm's: tests/test_decode_graph.py). The loop thread's CPU time a token (the
engine thread's, the raw loop's) is the host work that builds and launches each step, less
its waits for the device: where the device is fast (a small model on a GPU) that work is the
step. Prints a table, writes bench/results/engine-loop-STAMP.json.
"""

from __future__ import annotations

import argparse
import math
import shlex
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import _checkout  # noqa: F401  (before any `servicer` import)
import report
from raw import RawEngine
from workers import model_or_demo, parse_levels, resolve_model
from workload import LevelStats, RequestRecord, Shape, make_prompts, model_vocab_size, note_token


class EngineDriver:
    """The worker's engine in this process, its output read by a closed loop of clients."""

    def __init__(self, model_dir: Path, flags: list[str] | None = None) -> None:
        from servicer.cli import config_from_args, parse_args
        from servicer.engine import Engine
        from servicer.model_files import prepare_model_files
        from servicer.outbox import Outbox

        # The sizes bench.py gives its workers (and RawEngine's defaults).
        sizes = ["--completion-batch-size", "32", "--prefill-batch-size", "8"]
        config = config_from_args(parse_args(["--model", str(model_dir), *sizes, *(flags or [])]))
        self._engine_config = config.engine
        self._window_s = config.handlers.stream_window_ms / 1000
        self._per_handoff = config.handlers.stream_interval
        self._cond = threading.Condition()
        self._outbox = Outbox(self._woken)
        self._engine = Engine(config.engine, self._outbox)
        self._engine.start(prepare_model_files(config.model).info)
        self._engine.wait_ready(600)
        clock_of = getattr(time, "pthread_getcpuclockid", None)  # not on macOS
        ident = _engine_thread(self._engine).ident
        self._thread_clock = clock_of(ident) if clock_of is not None else None
        self._records: dict[int, RequestRecord] = {}
        self._done: list[RequestRecord] = []
        self._queue: list[list[int]] = []
        self._ticket = 0
        self._max_tokens = 0

    def close(self) -> None:
        self._engine.shutdown(30)

    def thread_seconds(self) -> float:
        """CPU time of the engine thread so far: its host work, not its waits for the device
        (NaN where the platform cannot read another thread's clock)."""
        if self._thread_clock is None:
            return math.nan
        return time.clock_gettime(self._thread_clock)

    def run(self, concurrency: int, prompts: list[list[int]], max_tokens: int) -> LevelStats:
        with self._cond:
            self._records, self._done, self._queue = {}, [], list(prompts)
            self._max_tokens = max_tokens
            for _ in range(min(concurrency, len(prompts))):
                self._submit()
            if not self._cond.wait_for(lambda: len(self._done) == len(prompts), 600):
                raise SystemExit("the engine did not finish the round in 10 minutes")
        return LevelStats.from_records(
            concurrency,
            self._done,
            expected_tokens=max_tokens,
            completion_batch_size=self._engine_config.completion_batch_size,
            prefill_batch_size=self._engine_config.prefill_batch_size,
        )

    def _submit(self) -> None:
        from servicer.messages import GenerationRequest, SamplingSpec

        if not self._queue:
            return
        self._ticket += 1
        self._records[self._ticket] = RequestRecord(start=time.perf_counter())
        request = GenerationRequest(
            ticket=self._ticket,
            request_id=f"loop-{self._ticket}",
            prompt=self._queue.pop(0),
            max_tokens=self._max_tokens,
            sampling=SamplingSpec(temperature=0.0),
            tokens_per_handoff=self._per_handoff,
            handoff_window_s=self._window_s,
        )
        self._engine.submit(request)

    def _woken(self) -> None:
        """On the engine thread, once some request needs its output (as the server's reader
        would be woken)."""
        out = self._outbox.take()
        if out is None:
            return
        now = time.perf_counter()
        with self._cond:
            for failure in out.failures:  # an error, not a hang: the round still ends
                record = self._records.pop(failure.ticket, None)
                if record is not None:
                    record.error = failure.message
                    self._done.append(record)
                    self._submit()
            for event in out.events:
                record = self._records.get(event.ticket)
                if record is None:
                    continue
                if event.token is not None:
                    note_token(record, now)
                if event.finish_reason is not None:
                    self._done.append(self._records.pop(event.ticket))
                    self._submit()
            self._cond.notify_all()


def _engine_thread(engine: Any) -> threading.Thread:
    thread = engine._thread  # the one thread that builds and launches every step
    assert thread.ident is not None
    return thread


def measure(
    model_dir: Path,
    levels: list[int],
    rounds: int,
    requests: int,
    shape: Shape,
    flags: list[str] | None = None,
) -> list[dict[str, Any]]:
    raw = RawEngine(model_dir)
    engine = EngineDriver(model_dir, flags)
    vocab = model_vocab_size(model_dir)
    cells = []
    try:
        for level in levels:
            count = max(requests, 4 * level)
            warm = make_prompts(level, shape.prompt_tokens, vocab, f"loop-warm/{level}")
            raw.run(level, Shape(shape.prompt_tokens, 16), prompts=warm, requests=level)
            engine.run(level, [list(p) for p in warm], 16)
            pairs = []
            for round_ in range(rounds):
                prompts = make_prompts(count, shape.prompt_tokens, vocab, f"loop/{level}/{round_}")
                order = ("raw", "engine") if round_ % 2 == 0 else ("engine", "raw")
                got: dict[str, LevelStats] = {}
                for who in order:
                    if who == "raw":
                        began = time.thread_time()  # the raw loop runs on this thread
                        got[who] = raw.run(level, shape, prompts=prompts, requests=count)
                        host = time.thread_time() - began
                    else:
                        began = engine.thread_seconds()
                        got[who] = engine.run(level, [list(p) for p in prompts], shape.max_tokens)
                        host = engine.thread_seconds() - began
                    tokens = max(got[who].output_tokens, 1)
                    got[who].extra["host_us_per_token"] = 1e6 * host / tokens
                pairs.append(got)
                ratio = got["engine"].tokens_per_s / got["raw"].tokens_per_s
                print(
                    f"c = {level} round {round_ + 1}: raw {got['raw'].tokens_per_s:.0f}, "
                    f"engine {got['engine'].tokens_per_s:.0f} tok/s ({ratio:.3f}); loop thread "
                    f"CPU us a token raw {got['raw'].extra['host_us_per_token']:.1f}, "
                    f"engine {got['engine'].extra['host_us_per_token']:.1f}",
                    file=sys.stderr,
                    flush=True,
                )
            cells.append(_cell(level, pairs))
    finally:
        engine.close()
        raw.close()
    return cells


def _cell(level: int, pairs: list[dict[str, LevelStats]]) -> dict[str, Any]:
    raw = [p["raw"].tokens_per_s for p in pairs]
    ours = [p["engine"].tokens_per_s for p in pairs]
    ratios = [o / r for o, r in zip(ours, raw, strict=True)]

    def median_of(who: str, field: str) -> float | None:
        values = [getattr(p[who], field) for p in pairs if getattr(p[who], field) is not None]
        return statistics.median(values) if values else None

    return {
        "c": level,
        "raw_tokens_per_s": raw,
        "engine_tokens_per_s": ours,
        "ratios": ratios,
        "median_ratio": statistics.median(ratios),
        "best_ratio": max(ours) / max(raw),
        "ttft_p50_ms": {who: median_of(who, "ttft_p50_ms") for who in ("raw", "engine")},
        "itl_p50_ms": {who: median_of(who, "itl_p50_ms") for who in ("raw", "engine")},
        "errors": {who: sum(p[who].errors for p in pairs) for who in ("raw", "engine")},
        "host_us_per_token": {
            who: statistics.median(p[who].extra["host_us_per_token"] for p in pairs)
            for who in ("raw", "engine")
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a model directory, or `real`")
    parser.add_argument("--levels", type=parse_levels, default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=4, help="pairs of runs, order alternating")
    parser.add_argument("--requests", type=int, default=48, help="requests a run (at least 4c)")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument(
        "--worker-flags", default="", help='the engine\'s own flags, e.g. "--speculate off"'
    )
    args = parser.parse_args(argv)
    model_dir = model_or_demo(resolve_model(args.model))
    shape = Shape(args.prompt_tokens, args.max_tokens)
    flags = shlex.split(args.worker_flags)
    cells = measure(model_dir, args.levels, args.rounds, args.requests, shape, flags)
    rows = [
        [
            cell["c"],
            f"{statistics.median(cell['raw_tokens_per_s']):.0f}",
            f"{statistics.median(cell['engine_tokens_per_s']):.0f}",
            f"{cell['median_ratio']:.3f}",
            f"{cell['best_ratio']:.3f}",
            " / ".join(f"{r:.2f}" for r in cell["ratios"]),
            "{raw:.1f} / {engine:.1f}".format(**cell["ttft_p50_ms"]),
            "{raw:.1f} / {engine:.1f}".format(**cell["host_us_per_token"]),
        ]
        for cell in cells
    ]
    headers = [
        "c",
        "raw tok/s",
        "engine tok/s",
        "÷ raw (median pair)",
        "÷ raw (best runs)",
        "each pair",
        "TTFT p50 ms raw / engine",
        "loop thread CPU us a token raw / engine",
    ]
    print(f"model: {model_dir}; {shape.prompt_tokens} + {shape.max_tokens} tokens, greedy")
    print(report.markdown_table(headers, rows))
    settings = {
        "model": str(model_dir),
        "rounds": args.rounds,
        "requests": args.requests,
        "worker_flags": flags,
    }
    report.save_json(args.out, "engine-loop", {"settings": settings, "cells": cells})
    return 0


if __name__ == "__main__":
    report.exit_now(main())
