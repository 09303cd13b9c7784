"""The ceiling: mlx-lm's raw BatchGenerator loop, with no server around it.

    python bench/raw.py --model DIR --concurrency 8 --min-seconds 10
    python bench/raw.py --model DIR --serve     # one JSON command per stdin line

Keeps `concurrency` sequences in flight (a finished one is replaced by the next prompt at
once, as a server with back-to-back clients would), calls `next()` until every request is
done, and prints one JSON object (a LevelStats) on stdout. bench.py keeps one in its own
process per concurrency level (`--serve`) and alternates short runs of it with runs of each
worker, so that every worker run has a raw run of the same prompts just before it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TextIO

import _checkout  # noqa: F401  (before any `servicer` import)
from workload import (
    WARMUP_SEED,
    LevelStats,
    RequestRecord,
    Shape,
    StealMeter,
    make_prompts,
    model_vocab_size,
    note_token,
)

from servicer.sysinfo import cpu_seconds


class RawEngine:
    """One model and one BatchGenerator, driven in closed loops with no server around them."""

    def __init__(
        self,
        model_dir: Path,
        *,
        completion_batch_size: int = 32,
        prefill_batch_size: int = 8,
        prefill_step_size: int = 2048,
    ) -> None:
        import mlx.core as mx
        from mlx_lm import load
        from mlx_lm.generate import BatchGenerator

        from servicer.engine import EngineConfig
        from servicer.engine.parts import batch_generator_settings

        model, _ = load(str(model_dir))
        config = EngineConfig(
            completion_batch_size=completion_batch_size,
            prefill_batch_size=prefill_batch_size,
            prefill_step_size=prefill_step_size,
        )
        # mlx-lm's own, unmodified: the reference the served engine is measured against.
        self.generator = BatchGenerator(
            model, **batch_generator_settings(config, mx.new_stream(mx.default_device()))
        )
        self.completion_batch_size = completion_batch_size
        self.prefill_batch_size = prefill_batch_size
        self.vocab = model_vocab_size(model_dir)

    def close(self) -> None:
        self.generator.close()

    def warm_up(self, concurrency: int, shape: Shape) -> None:
        """One wave of the same batch shape, short, not measured."""
        wave = min(concurrency, self.completion_batch_size)
        self._drive(shape, wave, wave, 16, WARMUP_SEED, lambda inserted: False)

    def run(
        self,
        concurrency: int,
        shape: Shape,
        *,
        requests: int | None = None,
        min_requests: int = 1,
        min_seconds: float = 0.0,
        seed: int | str = 0,
        prompts: Sequence[list[int]] = (),
    ) -> LevelStats:
        """With `requests`, exactly that many; otherwise keep inserting until both
        `min_requests` and `min_seconds` are reached, then let the ones in flight finish.
        The seed's random prompts, or `prompts` in turn."""
        start = time.perf_counter()

        def want_more(inserted: int) -> bool:
            if requests is not None:
                return inserted < requests
            return inserted < min_requests or time.perf_counter() - start < min_seconds

        cpu, wall, steal = cpu_seconds(), time.perf_counter(), StealMeter()
        cap = requests if requests is not None else 1 << 20
        records = self._drive(shape, concurrency, cap, shape.max_tokens, seed, want_more, prompts)
        worker_cpu = (cpu_seconds() - cpu) / (time.perf_counter() - wall)
        return LevelStats.from_records(
            concurrency,
            records,
            expected_tokens=shape.max_tokens,
            completion_batch_size=self.completion_batch_size,
            prefill_batch_size=self.prefill_batch_size,
            worker_cpu=worker_cpu,
            steal_share=steal.share(),
        )

    def _drive(
        self,
        shape: Shape,
        concurrency: int,
        cap: int,
        max_tokens: int,
        seed: int | str,
        want_more: Callable[[int], bool],
        prompts: Sequence[list[int]] = (),
    ) -> list[RequestRecord]:
        """Keep `concurrency` sequences in flight (a finished one is replaced by the next
        prompt at once, as a server with back-to-back clients would) until no more are wanted."""
        generator = self.generator
        records: dict[int, RequestRecord] = {}
        done: list[RequestRecord] = []
        inserted = 0

        def insert(k: int) -> None:
            nonlocal inserted
            if prompts:
                batch = [prompts[(inserted + i) % len(prompts)] for i in range(k)]
            else:
                batch = make_prompts(k, shape.prompt_tokens, self.vocab, seed, start=inserted)
            now = time.perf_counter()
            for uid in generator.insert(batch, max_tokens=[max_tokens] * k):
                records[uid] = RequestRecord(start=now)
            inserted += k

        insert(min(concurrency, cap))
        while records:
            _, responses = generator.next()
            now = time.perf_counter()
            finished = 0
            for response in responses:
                record = records.get(response.uid)
                if record is None:
                    continue
                note_token(record, now)
                if response.finish_reason is not None:
                    done.append(records.pop(response.uid))
                    finished += 1
            while finished and inserted < cap and want_more(inserted):
                insert(1)
                finished -= 1
        return done


def serve(engine: RawEngine, lines: TextIO, out: TextIO) -> None:
    """The paired-sweep protocol: one JSON command per line in, one LevelStats per line out.

    A command is {"concurrency", "prompt_tokens", "max_tokens", "warm_up"?, "requests"?,
    "min_requests"?, "min_seconds"?, "seed"?}. The process idles on its input in between,
    so a worker can be measured while it waits."""
    for line in lines:
        if not line.strip():
            continue
        command = json.loads(line)
        shape = Shape(command.pop("prompt_tokens"), command.pop("max_tokens"))
        concurrency = command.pop("concurrency")
        if command.pop("warm_up", False):
            engine.warm_up(concurrency, shape)
        stats = engine.run(concurrency, shape, **command)
        out.write(json.dumps(asdict(stats)) + "\n")
        out.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--serve", action="store_true", help="read commands from stdin")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--requests", type=int, help="exactly this many requests")
    parser.add_argument("--min-requests", type=int, default=1)
    parser.add_argument("--min-seconds", type=float, default=0.0)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--completion-batch-size", type=int, default=32)
    parser.add_argument("--prefill-batch-size", type=int, default=8)
    parser.add_argument("--prefill-step-size", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    engine = RawEngine(
        args.model,
        completion_batch_size=args.completion_batch_size,
        prefill_batch_size=args.prefill_batch_size,
        prefill_step_size=args.prefill_step_size,
    )
    try:
        if args.serve:
            serve(engine, sys.stdin, sys.stdout)
            return 0
        shape = Shape(args.prompt_tokens, args.max_tokens)
        engine.warm_up(args.concurrency, shape)
        stats = engine.run(
            args.concurrency,
            shape,
            requests=args.requests,
            min_requests=args.min_requests,
            min_seconds=args.min_seconds,
            seed=args.seed,
        )
    finally:
        engine.close()
    json.dump(asdict(stats), sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
