"""Soak: many concurrent clients mixing every way a request can end; every request accounted for.

    python bench/soak.py --clients 64 --rounds 200          # nightly: a long run on its own worker
    python bench/soak.py --address 127.0.0.1:50051 ...      # against a running worker

The test suite runs a short version of the same driver (tests/test_soak.py). A request is
accounted for when it ended with exactly one terminal: a GenerateComplete (as the last message)
or a gRPC status, and that ending is one its kind allows. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import _checkout  # noqa: F401  (before any `servicer` import)
import grpc

from servicer.proto import mlx_engine_pb2 as pb
from servicer.proto import mlx_engine_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parent.parent

VOCAB = 512  # the demo model's
LONG = 3000
# How often each kind comes up, and the endings it allows.
KINDS = {
    "stream": (5, {"complete:length", "complete:stop"}),
    "unary": (3, {"complete:length", "complete:stop"}),
    "cancel": (2, {"cancelled", "complete:stop"}),
    "abort": (2, {"complete:abort", "complete:stop"}),
    "deadline": (2, {"status:DEADLINE_EXCEEDED", "complete:stop"}),
    "bad": (2, {"status:INVALID_ARGUMENT"}),
    "duplicate": (1, {"status:ALREADY_EXISTS"}),
}
BAD_PARAMS = [
    {"temperature": -1.0},
    {"top_p": 2.0},
    {"min_p": float("nan")},
    {"logprobs": 50},
    {"logit_bias": {VOCAB + 5: 1.0}},
    {"max_tokens": 0},
]


@dataclass
class Record:
    request_id: str
    kind: str
    ending: str = "pending"
    terminals: int = 0
    tokens: int = 0
    problem: str = ""


@dataclass
class SoakReport:
    requests: int = 0
    seconds: float = 0.0
    endings: dict[str, int] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)

    def table(self) -> str:
        rows = [f"{'ending':<28}{'count':>8}"]
        rows += [f"{name:<28}{count:>8}" for name, count in sorted(self.endings.items())]
        rows.append(f"{'requests':<28}{self.requests:>8}")
        rows.append(f"{'seconds':<28}{self.seconds:>8.1f}")
        rows.append(f"{'violations':<28}{len(self.violations):>8}")
        return "\n".join(rows)


def _prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(rng.randrange(2, 48))]


def _request(rid: str, prompt: list[int], stream: bool, **params) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=rid,
        tokenized=pb.TokenizedInput(input_ids=prompt),
        sampling_params=pb.SamplingParams(**params),
        stream=stream,
    )


async def _consume(call, record: Record, stream: bool = True, on_chunk=None, at: int = 0) -> None:
    """Read a call to its end; `on_chunk()` runs once `at` chunks have arrived and may return
    True to stop reading (the call was cancelled)."""
    chunks = 0
    try:
        async for response in call:
            if record.terminals:
                record.problem = "a message after the terminal one"
            if response.HasField("chunk"):
                chunks += 1
                record.tokens += len(response.chunk.token_ids)
                if on_chunk is not None and chunks == at and await on_chunk():
                    return
            else:
                record.terminals += 1
                complete = response.complete
                record.ending = f"complete:{complete.finish_reason}"
                sent = record.tokens if stream else len(complete.output_ids)
                if complete.completion_tokens != sent:
                    record.problem = f"completion_tokens {complete.completion_tokens} != {sent}"
        if not record.terminals:
            record.problem = "the stream ended without a terminal message"
    except grpc.aio.AioRpcError as error:
        record.ending = f"status:{error.code().name}"
        record.terminals += 1


async def _one(stub, rng: random.Random, rid: str, kind: str) -> Record:
    record = Record(rid, kind)
    prompt = _prompt(rng)
    if kind in ("stream", "unary"):
        stream = kind == "stream"
        params = {"max_tokens": rng.randrange(1, 48), "ignore_eos": rng.random() < 0.5}
        if rng.random() < 0.5:
            params["temperature"] = 0.0
        call = stub.Generate(_request(rid, prompt, stream, **params), timeout=120)
        await _consume(call, record, stream)
    elif kind == "cancel":
        call = stub.Generate(_request(rid, prompt, True, max_tokens=LONG), timeout=120)

        async def cancel() -> bool:
            call.cancel()
            record.ending, record.terminals = "cancelled", 1
            return True

        await _consume(call, record, True, cancel, rng.randrange(1, 8))
    elif kind == "abort":
        call = stub.Generate(_request(rid, prompt, True, max_tokens=LONG), timeout=120)

        async def abort() -> bool:
            await stub.Abort(pb.AbortRequest(request_ids=[rid]), timeout=30)
            return False

        await _consume(call, record, True, abort, rng.randrange(1, 8))
    elif kind == "deadline":
        timeout = rng.uniform(0.05, 0.4)
        call = stub.Generate(_request(rid, prompt, True, max_tokens=LONG), timeout=timeout)
        await _consume(call, record)
    elif kind == "bad":
        params = {"max_tokens": 4, **rng.choice(BAD_PARAMS)}
        if rng.random() < 0.3:
            prompt = [] if rng.random() < 0.5 else [*prompt, VOCAB + 1]
        call = stub.Generate(_request(rid, prompt, True, **params), timeout=30)
        await _consume(call, record)
    elif kind == "duplicate":
        # The original runs long and is aborted; the copy must be refused meanwhile. It ignores
        # EOS: a sampled EOS could otherwise end it before the copy arrives, and then the copy
        # is rightly accepted.
        original = Record(rid, "duplicate-original")
        first = stub.Generate(
            _request(rid, prompt, True, max_tokens=LONG, ignore_eos=True), timeout=120
        )

        async def refuse_copy_then_abort() -> bool:
            copy = stub.Generate(_request(rid, prompt, True, max_tokens=4), timeout=30)
            await _consume(copy, record)
            await stub.Abort(pb.AbortRequest(request_ids=[rid]), timeout=30)
            return False

        await _consume(first, original, True, refuse_copy_then_abort, 1)
        if original.ending not in ("complete:abort", "complete:stop") or original.problem:
            record.problem = f"the original ended {original.ending} {original.problem}".strip()
    return record


async def _client(stub, index: int, rounds: int, seed: int, records: list[Record]) -> None:
    rng = random.Random(seed * 1000 + index)
    names = list(KINDS)
    weights = [KINDS[name][0] for name in names]
    for n in range(rounds):
        kind = rng.choices(names, weights)[0]
        rid = f"soak-{seed}-{index}-{n}"
        try:
            record = await asyncio.wait_for(_one(stub, rng, rid, kind), timeout=180)
        except TimeoutError:
            record = Record(rid, kind, ending="hung", problem="no terminal within 180 s")
        records.append(record)


async def soak(address: str, clients: int = 64, rounds: int = 8, seed: int = 0) -> SoakReport:
    records: list[Record] = []
    started = time.perf_counter()
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.MlxEngineStub(channel)
        await asyncio.gather(*(_client(stub, i, rounds, seed, records) for i in range(clients)))
    report = SoakReport(requests=len(records), seconds=time.perf_counter() - started)
    report.endings = dict(Counter(r.ending for r in records))
    for record in records:
        allowed = KINDS[record.kind][1]
        if record.problem:
            report.violations.append(f"{record.request_id} ({record.kind}): {record.problem}")
        elif record.terminals != 1:
            report.violations.append(f"{record.request_id}: {record.terminals} terminals")
        elif record.ending not in allowed:
            report.violations.append(f"{record.request_id} ({record.kind}): {record.ending}")
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--address", help="a running worker (default: start one)")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=200, help="requests per client")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "soak.json")
    args = parser.parse_args()

    worker = None
    address = args.address
    if address is None:
        from workers import BatchConfig, model_or_demo, our_worker

        logs = args.out.parent / "logs"
        worker = our_worker(model_or_demo(None), BatchConfig(), logs, "soak").start()
        address = worker.address
    try:
        rss_before = _rss(worker)
        report = asyncio.run(soak(address, args.clients, args.rounds, args.seed))
        rss_after = _rss(worker)
    finally:
        if worker is not None:
            worker.stop(60)
    print(report.table())
    if rss_before is not None and rss_after is not None:
        print(f"{'worker RSS MiB before/after':<28}{rss_before:>8.0f} / {rss_after:.0f}")
    for violation in report.violations[:20]:
        print("VIOLATION", violation)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {**asdict(report), "rss_mib_before": rss_before, "rss_mib_after": rss_after}
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 1 if report.violations else 0


def _rss(worker) -> float | None:
    if worker is None or worker.proc is None:
        return None
    import psutil

    return psutil.Process(worker.proc.pid).memory_info().rss / 2**20


if __name__ == "__main__":
    sys.exit(main())
