"""Differential fuzz of a prompt cache several workers share: WORKERS workers on one
`--prompt-cache-dir` (`--prompt-cache-shared`), each writing its blocks through and finding the
others', get concurrent greedy requests at random; every answer must equal the answer of a
worker without any prompt cache. Prompts grow from a few shared stems (so that the workers
write and read the same blocks at once, a conversation moving between them); between rounds a
worker is stopped and another started on the same directory (it indexes what is there).

`python tests/shared_cache_fuzz.py --seeds 5` (or `make fuzz-shared-cache SEEDS=5`) prints one
line per seed and kind (`llama:kv8`: with an 8-bit KV cache) and exits non-zero on any
differing answer or error; tests/test_kv_transfer.py runs one small seed in CI.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from support import ServerThread
from test_kv_transfer import generate, kv_config

from servicer.demos.text import demo_model_path

WORKERS = 3
MAX_TOKENS = 6


@dataclass
class FuzzResult:
    requests: int = 0
    hits: int = 0  # answers that reused a cached prefix
    differing: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def prompts(rng: random.Random, count: int, vocab: int) -> list[list[int]]:
    """Prompts of 20 to 300 tokens grown from four stems (each 40 tokens at least, so that its
    first half fills a block): many share blocks, some whole."""
    stems = [[rng.randrange(3, vocab) for _ in range(rng.randrange(40, 200))] for _ in range(4)]
    out = []
    for _ in range(count):
        stem = rng.choice(stems)
        stem = stem[: rng.randrange(len(stem) // 2, len(stem) + 1)]
        out.append(stem + [rng.randrange(3, vocab) for _ in range(rng.randrange(0, 100))])
    return out


def fuzz(kind: str, seed: int, rounds: int = 3, per_round: int = 12) -> FuzzResult:
    rng = random.Random(seed)
    kind, _, variant = kind.partition(":")
    model = demo_model_path(kind)
    engine = {"kv_bits": 8} if variant == "kv8" else {}
    result = FuzzResult()
    asks = [prompts(rng, per_round, 400) for _ in range(rounds)]
    with ServerThread(kv_config(model, None, engine=engine)) as reference:
        want = {
            tuple(ids): list(generate(reference.channel(), ids, MAX_TOKENS).output_ids)
            for batch in asks
            for ids in batch
        }
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "cache"
        config = kv_config(model, cache, engine=engine)
        workers = [ServerThread(config).start() for _ in range(WORKERS)]
        try:
            for round_index, batch in enumerate(asks):
                targets = [rng.randrange(WORKERS) for _ in batch]

                def ask(item: tuple[list[int], int]) -> tuple[list[int], list[int], int]:
                    ids, target = item
                    complete = generate(workers[target].channel(), ids, MAX_TOKENS)
                    return ids, list(complete.output_ids), complete.cached_tokens

                items = list(zip(batch, targets, strict=True))
                half = len(items) // 2  # two waves: the second finds what the first kept
                for wave in (items[:half], items[half:]):
                    with ThreadPoolExecutor(6) as pool:
                        futures = [pool.submit(ask, item) for item in wave]
                    for future in futures:
                        result.requests += 1
                        try:
                            ids, got, cached = future.result()
                        except Exception as exc:  # a failed call is a finding, not a crash
                            result.errors.append(f"round {round_index}: {exc!r}"[:300])
                            continue
                        result.hits += cached > 0
                        if got != want[tuple(ids)]:
                            result.differing.append(
                                f"round {round_index}, {len(ids)} tokens: {got} != "
                                f"{want[tuple(ids)]} (cached {cached})"
                            )
                restart = rng.randrange(WORKERS)  # a restart between rounds
                workers[restart].stop()
                workers[restart] = ServerThread(config).start()
        finally:
            for worker in workers:
                worker.stop()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--kinds", default="llama,hybrid,llama:kv8")
    args = parser.parse_args()
    failed = False
    for kind in args.kinds.split(","):
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            result = fuzz(kind, seed)
            print(
                f"{kind} seed {seed}: {result.requests} requests, {result.hits} hits, "
                f"{len(result.differing)} differing, {len(result.errors)} errors",
                flush=True,
            )
            for finding in result.differing + result.errors:
                print("  " + finding)
            failed |= bool(result.differing or result.errors)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
