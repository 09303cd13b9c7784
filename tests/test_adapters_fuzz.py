"""Differential fuzz of the prompt cache with adapters: random prompts (families sharing long
prefixes, cuts at and between block boundaries, the same prompt under several adapters, exact
repeats, next turns over earlier answers), each for the base or one of three adapters (two
LoRA, one DoRA) picked at random, at concurrency 4 in a shuffled order, a few of them
cancelled mid-stream (the call cancelled, or the Abort RPC), all greedy over the vLLM face
(one address per adapter). One worker has the prompt cache on (4-token blocks, a disk tier,
stopped and restarted on the same directory halfway), one has it off: every answer that was
not cancelled must be the same token for token, no request may reuse more of its prompt than
an earlier request of the same adapter could have left, and both workers stay SERVING.

`python tests/test_adapters_fuzz.py --seeds 50` runs more seeds and prints what they
covered; CI runs seeds 0 and 1.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import grpc
import pytest
from conftest import demo_config
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support import ServerThread
from test_adapters import RANDOM_ADAPTERS, References, write_random_adapter

from servicer.demos.text import SPECIAL_TOKENS, VOCAB_SIZE, demo_model_path
from servicer.proto import vllm_engine_pb2 as vpb
from servicer.proto import vllm_engine_pb2_grpc as vgrpc

BLOCK = 4  # tokens per prompt-cache block
CONCURRENCY = 4
CI_SEEDS = (0, 1)
NAMES: tuple[str | None, ...] = (None, *RANDOM_ADAPTERS)  # the base; "attn", "all", "dora"
FIRST_TEXT_ID = len(SPECIAL_TOKENS)
LONG = 400  # a cancelled request's max_tokens: far more than it gets to
SMALL_RAM = 96 << 10  # odd seeds: a RAM tier of ~24 blocks, blocks keep moving to disk


# ----- the workload -----


@dataclass
class Job:
    """One request: its adapter (None: the base), prompt and length; `cancel` ("client": the
    call cancelled, "abort": the Abort RPC) after `after` streamed chunks."""

    index: int
    phase: int
    adapter: str | None
    prompt: list[int]
    max_tokens: int
    cancel: str | None = None
    after: int = 1

    def describe(self) -> str:
        return (
            f"request {self.index} (phase {self.phase}, adapter {self.adapter or 'base'}, "
            f"max_tokens {self.max_tokens}, prompt of {len(self.prompt)}: {self.prompt})"
        )


@dataclass
class Answer:
    tokens: list[int]
    cached: int = 0
    error: str | None = None


class Draw:
    """Random jobs for one seed."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.jobs: list[Job] = []

    def text(self, low: int, high: int) -> list[int]:
        n = self.rng.randint(low, high)
        return [self.rng.randrange(FIRST_TEXT_ID, VOCAB_SIZE) for _ in range(n)]

    def add(self, phase: int, adapter: str | None, prompt: list[int], **kw: Any) -> Job:
        max_tokens = kw.pop("max_tokens", self.rng.randint(3, 12))
        job = Job(len(self.jobs), phase, adapter, prompt, max_tokens, **kw)
        self.jobs.append(job)
        return job

    def name(self) -> str | None:
        return self.rng.choice(NAMES)

    def cancelled(self, phase: int, prompt: list[int]) -> None:
        kind = self.rng.choice(["client", "abort"])
        after = self.rng.randint(1, 4)
        self.add(phase, self.name(), prompt, max_tokens=LONG, cancel=kind, after=after)

    def first_phase(self) -> tuple[list[Job], list[list[int]]]:
        rng = self.rng
        systems = [self.text(12, 40) for _ in range(3)]
        for system in systems:
            for _ in range(3):
                self.add(1, self.name(), system + self.text(1, 10))
            cut = BLOCK * rng.randint(1, len(system) // BLOCK)
            self.add(1, self.name(), system[:cut] + self.text(1, 8))  # at a block boundary
            self.add(1, self.name(), system[: cut + rng.randrange(1, BLOCK)] + self.text(1, 8))
        shared = self.text(9, 30)  # the same prompt under several adapters at once
        for name in rng.sample(NAMES, rng.randint(2, len(NAMES))):
            self.add(1, name, list(shared))
        for job in rng.sample(self.jobs, 2):  # exact repeats
            self.add(1, job.adapter, list(job.prompt))
        for _ in range(2):
            self.cancelled(1, rng.choice(systems) + self.text(1, 6))
        return [j for j in self.jobs if j.phase == 1], systems

    def second_phase(self, systems: list[list[int]], outputs: dict[int, list[int]]) -> list[Job]:
        """After the restart: phase one's prompts again (disk hits), continued (next turns),
        cut short, and under other adapters; new prompts on the old prefixes."""
        rng = self.rng
        done = [j for j in self.jobs if j.cancel is None]
        for job in rng.sample(done, 4):  # next turns: prompt, its answer, a new message
            self.add(2, job.adapter, job.prompt + outputs[job.index] + self.text(1, 8))
        for job in rng.sample(done, 3):
            self.add(2, job.adapter, list(job.prompt))
        for job in rng.sample(done, 3):
            other = rng.choice([n for n in NAMES if n != job.adapter])
            self.add(2, other, list(job.prompt))
        for job in rng.sample(done, 3):
            self.add(
                2, job.adapter, job.prompt[: rng.randrange(2, len(job.prompt))] + self.text(1, 6)
            )
        for system in systems:
            self.add(2, self.name(), system + self.text(1, 10))
        self.cancelled(2, rng.choice(systems) + self.text(1, 6))
        return [j for j in self.jobs if j.phase == 2]


# ----- the workers -----


def adapter_dirs_for(root: Path) -> dict[str, Path]:
    from mlx_lm import load

    dirs = {}
    for seed, (name, options) in enumerate(RANDOM_ADAPTERS.items()):
        model, _ = load(str(demo_model_path("llama")))
        dirs[name] = write_random_adapter(root / name, model, seed=seed, **options)
    return dirs


def worker_config(adapter_dirs: dict[str, Path], **engine: Any):
    config = demo_config(
        demo_model_path("llama"),
        adapters=tuple((name, str(path)) for name, path in adapter_dirs.items()),
        **engine,
    )
    return replace(
        config,
        protocols=("mlx", "vllm"),
        engine_mode="thread",  # its prefix store's figures are read directly
        adapter_ports=tuple((name, 0) for name in adapter_dirs),
    )


class Worker:
    """A running worker and a vLLM stub on each of its addresses (None: the base's)."""

    def __init__(self, config: Any, tag: str) -> None:
        self.tag = tag
        self.running = ServerThread(config).start()
        server = self.running.server
        addresses = {None: self.running.address}
        addresses.update({n: f"127.0.0.1:{p}" for n, p in server.adapter_ports.items()})
        self.channels = {n: grpc.insecure_channel(a) for n, a in addresses.items()}
        self.stubs = {n: vgrpc.VllmEngineStub(c) for n, c in self.channels.items()}

    def serving(self) -> bool:
        stub = health_pb2_grpc.HealthStub(self.channels[None])
        status = stub.Check(health_pb2.HealthCheckRequest(), timeout=10).status
        return status == health_pb2.HealthCheckResponse.SERVING

    def run(self, job: Job, seed: int) -> Answer:
        stub = self.stubs[job.adapter]
        request_id = f"{self.tag}-s{seed}-r{job.index}"
        request = vpb.GenerateRequest(
            request_id=request_id,
            tokenized=vpb.TokenizedInput(input_ids=job.prompt),
            sampling_params=vpb.SamplingParams(
                temperature=0.0, max_tokens=job.max_tokens, ignore_eos=True
            ),
            stream=job.cancel is not None,
        )
        tokens: list[int] = []
        try:
            if job.cancel is None:
                (response,) = list(stub.Generate(request, timeout=120))
                complete = response.complete
                return Answer(list(complete.output_ids), complete.cached_tokens)
            call = stub.Generate(request, timeout=120)
            for chunks, response in enumerate(call, start=1):
                if not response.HasField("chunk"):
                    return Answer(tokens, response.complete.cached_tokens)
                tokens += response.chunk.token_ids
                if chunks == job.after:
                    if job.cancel == "client":
                        call.cancel()
                        return Answer(tokens)
                    stub.Abort(vpb.AbortRequest(request_ids=[request_id]), timeout=10)
            return Answer(tokens)
        except grpc.RpcError as error:
            if job.cancel == "client" and error.code() == grpc.StatusCode.CANCELLED:
                return Answer(tokens)
            return Answer(tokens, error=f"{error.code()}: {error.details()}")

    def run_all(self, jobs: list[Job], seed: int, rng: random.Random) -> dict[int, Answer]:
        order = list(jobs)
        rng.shuffle(order)
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            answers = list(pool.map(lambda job: self.run(job, seed), order))
        return {job.index: answer for job, answer in zip(order, answers, strict=True)}

    def close(self) -> None:
        for channel in self.channels.values():
            channel.close()
        self.running.stop()


# ----- one seed -----


@dataclass
class Coverage:
    seeds: int = 0
    requests: int = 0
    cancelled: int = 0
    cut_short: int = 0  # cancelled requests that ended before their max_tokens
    hits: int = 0  # answers of the cached worker with cached tokens
    tokens_reused: int = 0
    ram_hits: int = 0
    disk_hits: int = 0
    evictions: int = 0
    adapter_differs: int = 0  # same prompt, other adapter, other tokens
    findings: list[str] = field(default_factory=list)


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _reuse_bound(job: Job, before: list[tuple[Job, list[int]]]) -> int:
    """The most of `job`'s prompt an earlier (or concurrent) request of the same adapter can
    have left in the cache: the longest prefix it shares with that request's prompt and
    answer."""
    seqs = [j.prompt + tokens for j, tokens in before if j.adapter == job.adapter and j is not job]
    return max((_common(job.prompt, s) for s in seqs), default=0)


class Referee:
    """mlx-lm's own greedy tokens, asked only to say which side of a mismatch is right."""

    def __init__(self, adapter_dirs: dict[str, Path]) -> None:
        self.refs = References({"float32": demo_model_path("llama")}, adapter_dirs)

    def say(self, job: Job) -> list[int]:
        return self.refs.greedy("float32", job.adapter, job.prompt, job.max_tokens)


def _compare(
    seed: int,
    jobs: list[Job],
    cached: dict[int, Answer],
    plain: dict[int, Answer],
    history: list[tuple[Job, list[int]]],
    referee: Referee,
    cover: Coverage,
) -> None:
    for job in jobs:
        got, want = cached[job.index], plain[job.index]
        cover.requests += 1
        where = f"seed {seed} {job.describe()}"
        for side, answer in (("cached", got), ("uncached", want)):
            if answer.error is not None:
                cover.findings.append(f"{where}: the {side} worker failed it: {answer.error}")
        if want.cached:
            cover.findings.append(f"{where}: the uncached worker reused {want.cached} tokens")
        bound = _reuse_bound(job, history)
        if got.cached > bound:
            cover.findings.append(
                f"{where}: reused {got.cached} cached tokens, but no earlier request of this "
                f"adapter shares more than {bound}"
            )
        if got.cached:
            cover.hits += 1
            cover.tokens_reused += got.cached
        if job.cancel is not None:
            cover.cancelled += 1
            cover.cut_short += len(got.tokens) < job.max_tokens
            n = min(len(got.tokens), len(want.tokens))  # what both streamed before the cancel
            if got.tokens[:n] != want.tokens[:n]:
                cover.findings.append(
                    f"{where}: cancelled, streamed {got.tokens} with the cache on and "
                    f"{want.tokens} with it off, first apart at {_common(got.tokens, want.tokens)}"
                )
            continue
        if got.error is None and want.error is None and got.tokens != want.tokens:
            at = _common(got.tokens, want.tokens)
            mlx_lm = referee.say(job)
            right = [s for s, a in (("cached", got), ("uncached", want)) if a.tokens == mlx_lm]
            cover.findings.append(
                f"{where}: cache on {got.tokens} (reused {got.cached}) != cache off "
                f"{want.tokens}, first at position {at}; mlx-lm's: {mlx_lm} "
                f"(equal to: {', '.join(right) or 'neither'})"
            )


def fuzz_seed(
    seed: int,
    adapter_dirs: dict[str, Path],
    plain: Worker,
    workdir: Path,
    referee: Referee,
    cover: Coverage,
) -> None:
    """One seed: phase one on both workers, the cached one stopped and restarted on its
    directory, phase two on both; findings go to `cover`."""
    rng = random.Random(f"adapters/{seed}")
    draw = Draw(rng)
    first, systems = draw.first_phase()
    engine = dict(
        prompt_cache_block=BLOCK,
        prompt_cache_dir=str(workdir),
        prompt_cache_bytes=SMALL_RAM if seed % 2 else None,
        prefill_step_size=rng.choice([8, 16, 2048]),
    )
    config = worker_config(adapter_dirs, **engine)
    history: list[tuple[Job, list[int]]] = []
    outputs: dict[int, list[int]] = {}
    for phase in (1, 2):
        jobs = first if phase == 1 else draw.second_phase(systems, outputs)
        cached = Worker(config, f"cached{phase}")
        try:
            got = cached.run_all(jobs, seed, rng)
            if not cached.serving():
                cover.findings.append(f"seed {seed}: the cached worker is not SERVING")
            stats = cached.running.server.prefix_stats()
        finally:
            cached.close()
        want = plain.run_all(jobs, seed, rng)
        if not plain.serving():
            cover.findings.append(f"seed {seed}: the uncached worker is not SERVING")
        history += [(job, got[job.index].tokens) for job in jobs]
        _compare(seed, jobs, got, want, history, referee, cover)
        outputs.update({job.index: want[job.index].tokens for job in jobs})
        if stats is not None:
            cover.ram_hits += stats.ram_hits
            cover.disk_hits += stats.disk_hits
            cover.evictions += stats.evictions
    by_prompt: dict[tuple[int, ...], dict[str | None, list[int]]] = {}
    for job in draw.jobs:
        if job.cancel is None:
            by_prompt.setdefault(tuple(job.prompt), {})[job.adapter] = outputs[job.index]
    for answers in by_prompt.values():
        cover.adapter_differs += len({tuple(t) for t in answers.values()}) - 1
    cover.seeds += 1


@dataclass
class Fuzz:
    adapter_dirs: dict[str, Path]
    plain: Worker
    referee: Referee

    def run(self, seeds: list[int]) -> Coverage:
        cover = Coverage()
        for seed in seeds:
            with tempfile.TemporaryDirectory(prefix="adapters-fuzz-") as workdir:
                fuzz_seed(seed, self.adapter_dirs, self.plain, Path(workdir), self.referee, cover)
        return cover


def fuzz(root: Path) -> Iterator[Fuzz]:
    adapter_dirs = adapter_dirs_for(root)
    plain = Worker(worker_config(adapter_dirs, prompt_cache_size=0), "plain")
    try:
        yield Fuzz(adapter_dirs, plain, Referee(adapter_dirs))
    finally:
        plain.close()


# ----- CI -----


@pytest.fixture(scope="module")
def fuzzer(tmp_path_factory) -> Iterator[Fuzz]:
    yield from fuzz(tmp_path_factory.mktemp("adapters"))


def test_cached_answers_with_adapters_equal_uncached_answers(fuzzer: Fuzz) -> None:
    cover = fuzzer.run(list(CI_SEEDS))
    assert cover.findings == []
    assert cover.requests >= 70 and cover.cancelled >= 4 and cover.cut_short >= 4
    assert cover.hits > 10 and cover.ram_hits > 0 and cover.disk_hits > 0
    assert cover.evictions > 0  # the odd seed's small RAM tier
    assert cover.adapter_differs > 0  # the adapters change the answers


def test_a_restart_with_other_weights_under_the_same_name_reuses_no_block(
    fuzzer: Fuzz, tmp_path: Path
) -> None:
    from mlx_lm import load

    model, _ = load(str(demo_model_path("llama")))
    retrained = write_random_adapter(tmp_path / "attn2", model, seed=99, **RANDOM_ADAPTERS["attn"])
    swapped = {**fuzzer.adapter_dirs, "attn": retrained}
    job = Job(0, 1, "attn", [20 + (i * 7) % 400 for i in range(40)], 12)
    answers = []
    for dirs in (fuzzer.adapter_dirs, swapped):
        config = worker_config(dirs, prompt_cache_block=BLOCK, prompt_cache_dir=str(tmp_path))
        worker = Worker(config, "swap")
        try:
            answers.append(worker.run(job, 0))
        finally:
            worker.close()
    want = References({"float32": demo_model_path("llama")}, swapped)
    assert answers[0].error is None and answers[1].error is None
    assert answers[1].cached == 0, answers[1]
    assert answers[1].tokens == want.greedy("float32", "attn", job.prompt, job.max_tokens)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20, help="how many seeds (default 20)")
    parser.add_argument("--first-seed", type=int, default=0)
    args = parser.parse_args(argv)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="adapters-fuzz-") as root:
        runner = fuzz(Path(root))
        fuzzer = next(runner)
        try:
            cover = fuzzer.run(list(range(args.first_seed, args.first_seed + args.seeds)))
        finally:
            runner.close()
    for line in cover.findings:
        print(line)
    shown = {k: v for k, v in vars(cover).items() if k != "findings"}
    print(" ".join(f"{k}={v}" for k, v in shown.items()), f"findings={len(cover.findings)}")
    print(f"{time.monotonic() - started:.0f} s")
    return 1 if cover.findings else 0


if __name__ == "__main__":
    sys.exit(main())
