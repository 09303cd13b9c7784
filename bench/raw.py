"""The ceiling: mlx-lm's raw BatchGenerator loop, with no server around it.

    python bench/raw.py --model DIR --concurrency 8 --min-seconds 10

Keeps `concurrency` sequences in flight (a finished one is replaced by the next prompt at
once, as a server with back-to-back clients would), calls `next()` until every request is
done, and prints one JSON object (a LevelStats) on stdout. bench.py runs it in its own
process, with no worker running, for every concurrency level.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from dataclasses import asdict
from pathlib import Path

from workload import (
    WARMUP_SEED,
    LevelStats,
    RequestRecord,
    Shape,
    StealMeter,
    make_prompts,
    model_vocab_size,
)


def run_raw(
    model_dir: Path,
    concurrency: int,
    shape: Shape,
    *,
    requests: int | None = None,
    min_requests: int = 1,
    min_seconds: float = 0.0,
    completion_batch_size: int = 32,
    prefill_batch_size: int = 8,
    prefill_step_size: int = 2048,
    seed: int = 0,
) -> LevelStats:
    """Run the closed loop. With `requests`, exactly that many; otherwise keep inserting until
    both `min_requests` and `min_seconds` are reached, then let the ones in flight finish."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator

    model, _ = load(str(model_dir))
    generator = BatchGenerator(
        model,
        completion_batch_size=completion_batch_size,
        prefill_batch_size=prefill_batch_size,
        prefill_step_size=prefill_step_size,
        stream=mx.new_stream(mx.default_device()),
    )
    vocab = model_vocab_size(model_dir)
    cap = requests if requests is not None else 1 << 20

    def drive(
        count: int, limit_s: float, max_tokens: int, seed_name: int | str, measure: bool
    ) -> list[RequestRecord]:
        records: dict[int, RequestRecord] = {}
        done: list[RequestRecord] = []
        inserted = 0
        start = time.perf_counter()

        def insert(k: int) -> None:
            nonlocal inserted
            batch = make_prompts(k, shape.prompt_tokens, vocab, seed_name, start=inserted)
            now = time.perf_counter()
            for uid in generator.insert(batch, max_tokens=[max_tokens] * k):
                records[uid] = RequestRecord(start=now)
            inserted += k

        def want_more() -> bool:
            if inserted >= count:
                return False
            if requests is not None or not measure:
                return True
            return inserted < min_requests or time.perf_counter() - start < limit_s

        insert(min(concurrency, count))
        while records:
            _, responses = generator.next()
            now = time.perf_counter()
            finished = 0
            for response in responses:
                record = records.get(response.uid)
                if record is None:
                    continue
                if record.ttft is None:
                    record.ttft = now - record.start
                else:
                    record.itl.append(now - record.end)
                record.end = now
                record.tokens += 1
                if response.finish_reason is not None:
                    done.append(records.pop(response.uid))
                    finished += 1
            while finished and want_more():
                insert(1)
                finished -= 1
        return done

    # Warm-up: one wave of the same batch shape, short, not measured.
    drive(min(concurrency, completion_batch_size), 0.0, 16, WARMUP_SEED, measure=False)
    cpu, wall, steal = _cpu_seconds(), time.perf_counter(), StealMeter()
    records = drive(cap, min_seconds, shape.max_tokens, seed, measure=True)
    worker_cpu = (_cpu_seconds() - cpu) / (time.perf_counter() - wall)
    steal_share = steal.share()
    generator.close()
    return LevelStats.from_records(
        concurrency,
        records,
        expected_tokens=shape.max_tokens,
        completion_batch_size=completion_batch_size,
        prefill_batch_size=prefill_batch_size,
        worker_cpu=worker_cpu,
        steal_share=steal_share,
    )


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--concurrency", type=int, required=True)
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
    stats = run_raw(
        args.model,
        args.concurrency,
        Shape(args.prompt_tokens, args.max_tokens),
        requests=args.requests,
        min_requests=args.min_requests,
        min_seconds=args.min_seconds,
        completion_batch_size=args.completion_batch_size,
        prefill_batch_size=args.prefill_batch_size,
        prefill_step_size=args.prefill_step_size,
        seed=args.seed,
    )
    json.dump(asdict(stats), sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
