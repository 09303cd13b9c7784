"""Differential fuzz of the prompt cache: families of random prompts (shared system prompts,
cuts at block boundaries and between them, next turns, chat-shaped messages, exact repeats)
through a worker with the cache on (small blocks and snapshot intervals, a RAM budget small
enough that blocks keep moving to its disk tier, a restart on the same directory halfway),
at concurrency 4 in a shuffled order. Every output must equal the model's greedy output
without any cache, and the worker must stay SERVING.

`python tests/cache_fuzz.py --seeds 50` (or `make fuzz-cache SEEDS=50`) runs many seeds of
every demo kind and prints what they covered; tests/test_cache_fuzz.py runs a few in CI.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from conftest import Reference, demo_config
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support import ServerThread, generate

from servicer.demos.text import SPECIAL_TOKENS, VOCAB_SIZE, available_kinds, demo_model_path

NEW_TOKENS = 6
CONCURRENCY = 4
BOS, END, SYSTEM, USER, ASSISTANT = 0, 1, 3, 4, 5  # the demo tokenizer's special ids
FIRST_TEXT_ID = len(SPECIAL_TOKENS)
COUNTED = ("ram_hits", "disk_hits", "snapshot_hits", "misses", "evictions", "faults")


@dataclass
class Coverage:
    """What one kind's seeds exercised, and what went wrong."""

    seeds: int = 0
    prompts: int = 0
    differing: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    ram_hits: int = 0
    disk_hits: int = 0
    snapshot_hits: int = 0
    misses: int = 0
    evictions: int = 0  # blocks spilled from RAM to disk
    faults: int = 0
    tokens_reused: int = 0
    restarts: int = 0

    def add(self, stats: object) -> None:
        for name in COUNTED:
            setattr(self, name, getattr(self, name) + getattr(stats, name))
        self.tokens_reused += stats.ram_tokens + stats.disk_tokens  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Setup:
    block: int
    interval: int
    ram_bytes: int

    @classmethod
    def draw(cls, rng: random.Random) -> Setup:
        block = rng.choice([16, 32, 64])
        blocks = rng.choice([4, 8, 16, 32])  # of about 1 KiB a token: blocks keep moving
        return cls(block, block * rng.choice([1, 2, 4]), blocks * block * 1024)


class Prompts:
    """Random prompt families for one seed."""

    def __init__(self, rng: random.Random, vocab: int, block: int) -> None:
        self.rng = rng
        self.vocab = vocab
        self.block = block

    def text(self, low: int, high: int) -> list[int]:
        return [
            self.rng.randrange(FIRST_TEXT_ID, self.vocab)
            for _ in range(self.rng.randint(low, high))
        ]

    def first_pass(self) -> list[list[int]]:
        rng, block = self.rng, self.block
        prompts: list[list[int]] = []
        for _ in range(rng.randint(2, 3)):
            system = self.text(block, 6 * block)
            prompts += [system + self.text(1, 40) for _ in range(2)]
            cut = block * rng.randint(1, max(1, len(system) // block))
            prompts.append(system[:cut] + self.text(1, 30))  # at a block boundary
            prompts.append(system[: cut + rng.randrange(1, block)] + self.text(1, 30))  # between
            prompts += [self.chat(system, self.text(3, 30)) for _ in range(2)]
        prompts += [self.text(100, 300) for _ in range(2)]  # unrelated: they push blocks out
        prompts += [list(p) for p in rng.sample(prompts, 2)]  # exact repeats
        return prompts

    def chat(self, system: list[int], user: list[int]) -> list[int]:
        return [BOS, SYSTEM, *system, END, USER, *user, END, ASSISTANT]

    def second_pass(self, first: list[list[int]], outputs: list[list[int]]) -> list[list[int]]:
        rng = self.rng
        turns = rng.sample(range(len(first)), len(first) // 2)
        prompts = [first[i] + outputs[i] + [END, USER, *self.text(2, 30)] for i in turns]
        prompts += [list(first[i]) for i in rng.sample(range(len(first)), len(first) // 3)]
        prompts += [
            first[i][: rng.randrange(2, len(first[i]))] + self.text(1, 20) for i in turns[:4]
        ]
        return prompts


def _serving(running: ServerThread) -> bool:
    with running.channel() as chan:
        stub = health_pb2_grpc.HealthStub(chan)
        status = stub.Check(health_pb2.HealthCheckRequest(), timeout=10).status
    return status == health_pb2.HealthCheckResponse.SERVING


def _run_pass(
    running: ServerThread, prompts: list[list[int]], rng: random.Random
) -> list[tuple[list[int], list[int] | None, str | None]]:
    """Each prompt once, shuffled, `CONCURRENCY` at a time: (prompt, tokens or None, error)."""
    order = list(range(len(prompts)))
    rng.shuffle(order)

    def one(i: int) -> tuple[int, list[int] | None, str | None]:
        with running.channel() as chan:
            outcome = generate(
                chan, prompts[i], temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True
            )
        if outcome.error is not None:
            return i, None, f"{outcome.code}: {outcome.error.details()}"
        return i, outcome.tokens, None

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        done = {i: (tokens, error) for i, tokens, error in pool.map(one, order)}
    return [(prompts[i], *done[i]) for i in range(len(prompts))]


def fuzz_seed(kind: str, seed: int, workdir: Path, reference: Reference, cover: Coverage) -> None:
    """One seed of one kind: two passes, a restart between them; findings go to `cover`."""
    rng = random.Random(f"{kind}/{seed}")
    setup = Setup.draw(rng)
    config = demo_config(
        demo_model_path(kind),
        prompt_cache_block=setup.block,
        prompt_cache_snapshot_interval=setup.interval,
        prompt_cache_bytes=setup.ram_bytes,
        prompt_cache_dir=str(workdir),
    )
    config = replace(config, engine_mode="thread")  # its prefix store is read directly
    family = Prompts(rng, VOCAB_SIZE, setup.block)
    prompts = family.first_pass()
    outputs: list[list[int]] = []
    for round_ in range(2):
        with ServerThread(config) as running:
            results = _run_pass(running, prompts, rng)
            if not _serving(running):
                cover.errors.append(f"{kind} seed {seed}: not SERVING after pass {round_ + 1}")
            cover.add(running.server.prefix_stats())
        cover.restarts += round_
        outputs = _check(kind, seed, setup, results, reference, cover)
        if round_ == 0:
            prompts = family.second_pass(prompts, outputs)
    cover.seeds += 1


def _check(
    kind: str,
    seed: int,
    setup: Setup,
    results: list[tuple[list[int], list[int] | None, str | None]],
    reference: Reference,
    cover: Coverage,
) -> list[list[int]]:
    outputs = []
    for prompt, tokens, error in results:
        cover.prompts += 1
        expected = reference.greedy(prompt, NEW_TOKENS)
        outputs.append(expected)
        where = f"{kind} seed {seed} {setup} prompt of {len(prompt)} tokens"
        if error is not None:
            cover.errors.append(f"{where}: {error}")
        elif tokens != expected:
            cover.differing.append(f"{where}: {tokens} != {expected}")
    return outputs


def fuzz(kinds: list[str], seeds: list[int]) -> dict[str, Coverage]:
    report = {}
    for kind in kinds:
        reference = Reference(demo_model_path(kind))
        cover = report[kind] = Coverage()
        for seed in seeds:
            with tempfile.TemporaryDirectory(prefix="cache-fuzz-") as workdir:
                fuzz_seed(kind, seed, Path(workdir), reference, cover)
    return report


def print_report(report: dict[str, Coverage], seconds: float) -> None:
    columns = ("seeds", "prompts", *COUNTED, "tokens_reused", "restarts")
    print(" | ".join(("kind", *columns, "differing", "errors")))
    for kind, cover in report.items():
        cells = [str(getattr(cover, name)) for name in columns]
        print(" | ".join((kind, *cells, str(len(cover.differing)), str(len(cover.errors)))))
        for line in (cover.differing + cover.errors)[:10]:
            print("   ", line)
    print(f"{seconds:.0f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=50, help="seeds per kind (default 50)")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--kinds", default=",".join(available_kinds()))
    parser.add_argument("--json", type=Path, help="write the report here too")
    args = parser.parse_args(argv)
    started = time.monotonic()
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    report = fuzz(args.kinds.split(","), seeds)
    print_report(report, time.monotonic() - started)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({k: asdict(v) for k, v in report.items()}, indent=1))
    failed = any(cover.differing or cover.errors for cover in report.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
