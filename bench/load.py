"""The gRPC load driver: closed-loop clients, a staggered burst, cancel-and-reuse.

Talks `mlx.grpc.engine.MlxEngine` with the project's generated stubs (wire-identical to
smg-grpc-proto's), so it drives any worker of that service: ours and smg-grpc-servicer's.
All clients share one grpc.aio channel (one HTTP/2 connection, many concurrent calls) on one
event loop; the driver measures its own CPU time so a report can tell when the client, not
the worker, was the limit.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import _checkout  # noqa: F401  (before any `servicer` import)
import grpc
from workload import WARMUP_SEED, LevelStats, RequestRecord, Shape, make_prompts, percentile

from servicer.proto import mlx_engine_pb2 as pb
from servicer.proto import mlx_engine_pb2_grpc as pb_grpc
from servicer.sysinfo import cpu_seconds

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
]
_ids = itertools.count(1)


@dataclass(frozen=True)
class Sampling:
    """What each request asks for besides the shape.

    `router` sends what the SMG router sends by default (top_p = 1, repetition_penalty = 1),
    which is what a worker sees in production; `minimal` sends only temperature 0.
    """

    style: str = "router"

    def params(self, max_tokens: int) -> pb.SamplingParams:
        params = pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        if self.style == "router":
            params.top_p = 1.0
            params.repetition_penalty = 1.0
        return params


class Client:
    """One channel to one worker."""

    def __init__(self, address: str, vocab_size: int, sampling: Sampling) -> None:
        self.address = address
        self.vocab_size = vocab_size
        self.sampling = sampling
        self._channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = pb_grpc.MlxEngineStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def request(self, prompt: list[int], max_tokens: int) -> pb.GenerateRequest:
        """A streamed request with this client's sampling settings."""
        return pb.GenerateRequest(
            request_id=f"bench-{next(_ids)}",
            tokenized=pb.TokenizedInput(input_ids=prompt),
            sampling_params=self.sampling.params(max_tokens),
            stream=True,
        )

    async def generate(
        self,
        prompt: list[int],
        max_tokens: int,
        *,
        cancel_after: int | None = None,
        timeout: float = 600,
    ) -> RequestRecord:
        """One streamed Generate; with `cancel_after`, cancel the call once that many tokens
        arrived. Errors are recorded, not raised."""
        request = self.request(prompt, max_tokens)
        record = RequestRecord(start=time.perf_counter())
        last = record.start
        call = self.stub.Generate(request, timeout=timeout)
        try:
            async for response in call:
                if not response.HasField("chunk"):
                    record.cached_tokens = response.complete.cached_tokens
                    continue
                record.cached_tokens = response.chunk.cached_tokens
                count = len(response.chunk.token_ids)
                if not count:
                    continue
                now = time.perf_counter()
                if record.ttft is None:
                    record.ttft = now - record.start
                else:
                    record.itl.extend([(now - last) / count] * count)
                last = now
                record.tokens += count
                if cancel_after is not None and record.tokens >= cancel_after:
                    call.cancel()
                    break
        except grpc.aio.AioRpcError as error:
            record.error = f"{error.code().name}: {error.details()}"
        record.end = time.perf_counter()
        return record

    # ----- workloads -----

    async def closed_loop(
        self,
        concurrency: int,
        requests: int,
        shape: Shape,
        seed: int | str = 0,
        prompts: Sequence[list[int]] = (),
    ) -> tuple[list[RequestRecord], float]:
        """The closed loop: `concurrency` clients send back to back until `requests` are
        done, on the seed's random prompts or on `prompts` in turn; returns the records and
        the driver's CPU seconds per wall second over the run."""
        prompts = prompts or self._prompts(requests, shape, seed)
        queue = iter(range(requests))
        records: list[RequestRecord] = []

        async def client() -> None:
            for index in queue:
                prompt = prompts[index % len(prompts)]
                records.append(await self.generate(prompt, shape.max_tokens))

        cpu, wall = cpu_seconds(), time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return records, (cpu_seconds() - cpu) / (time.perf_counter() - wall)

    async def warm_up(self, concurrency: int, shape: Shape) -> None:
        """One short wave at the level's concurrency, on prompts never measured."""
        prompts = self._prompts(concurrency, shape, WARMUP_SEED)
        await asyncio.gather(*(self.generate(p, 16) for p in prompts))

    async def staggered_burst(
        self, clients: int, per_client: int, stagger_s: float, shape: Shape, seed: int | str
    ) -> list[RequestRecord]:
        prompts = self._prompts(clients * per_client, shape, seed)
        records: list[RequestRecord] = []

        async def client(k: int) -> None:
            await asyncio.sleep(k * stagger_s)
            for i in range(per_client):
                records.append(await self.generate(prompts[k * per_client + i], shape.max_tokens))

        await asyncio.gather(*(client(k) for k in range(clients)))
        return records

    async def cancel_and_reuse(
        self, repeats: int, shape: Shape, cancel_after: int, long_tokens: int, seed: int | str
    ) -> dict[str, object]:
        """The follow-up request's latency right after a cancelled long stream, against the
        same request on an idle worker (alternating, so drift hits both alike)."""
        prompts = self._prompts(3 * repeats, shape, seed)
        idle: list[RequestRecord] = []
        follow: list[RequestRecord] = []
        cancelled: list[RequestRecord] = []
        for i in range(repeats):
            await asyncio.sleep(0.2)  # let the worker go idle
            idle.append(await self.generate(prompts[3 * i], shape.max_tokens))
            await asyncio.sleep(0.2)
            cancelled.append(
                await self.generate(prompts[3 * i + 1], long_tokens, cancel_after=cancel_after)
            )
            follow.append(await self.generate(prompts[3 * i + 2], shape.max_tokens))
        return _cancel_summary(idle, follow, cancelled, shape.max_tokens, cancel_after)

    def _prompts(self, count: int, shape: Shape, seed: int | str) -> list[list[int]]:
        return make_prompts(count, shape.prompt_tokens, self.vocab_size, seed)


def served_run(
    address: str,
    prompts: Sequence[list[int]],
    concurrency: int,
    max_tokens: int,
    requests: int | None = None,
) -> LevelStats:
    """One closed-loop run of `prompts` (in turn, `requests` of them, default one each) on
    the worker at `address`, with the router's sampling."""

    async def run() -> list[RequestRecord]:
        async with Client(address, 0, Sampling()) as client:
            shape = Shape(0, max_tokens)
            count = requests or len(prompts)
            records, _ = await client.closed_loop(concurrency, count, shape, prompts=prompts)
            return records

    records = asyncio.run(run())
    return LevelStats.from_records(concurrency, records, expected_tokens=max_tokens)


def _median_ms(values: Sequence[float]) -> float | None:
    value = percentile(values, 50)
    return None if value is None else value * 1000


def _cancel_summary(
    idle: list[RequestRecord],
    follow: list[RequestRecord],
    cancelled: list[RequestRecord],
    expected: int,
    cancel_after: int,
) -> dict[str, object]:
    def good(records: list[RequestRecord]) -> list[RequestRecord]:
        return [r for r in records if r.error is None and r.tokens == expected]

    idle_ok, follow_ok = good(idle), good(follow)
    idle_ms = _median_ms([r.end - r.start for r in idle_ok])
    follow_ms = _median_ms([r.end - r.start for r in follow_ok])
    errors = len(idle) - len(idle_ok) + len(follow) - len(follow_ok)
    errors += sum(1 for r in cancelled if r.error is not None or r.tokens < cancel_after)
    return {
        "repeats": len(idle),
        "idle_latency_ms": idle_ms,
        "follow_up_latency_ms": follow_ms,
        "ratio": follow_ms / idle_ms if idle_ms and follow_ms else None,
        "idle_ttft_ms": _median_ms([r.ttft for r in idle_ok if r.ttft is not None]),
        "follow_up_ttft_ms": _median_ms([r.ttft for r in follow_ok if r.ttft is not None]),
        "errors": errors,
    }


def burst_summary(
    records: list[RequestRecord], expected: int, steal_share: float | None = None
) -> dict[str, object]:
    stats = LevelStats.from_records(len(records), records, expected_tokens=expected)
    p50, peak = stats.ttft_p50_ms, stats.ttft_max_ms
    return {
        "requests": stats.requests,
        "ttft_p50_ms": p50,
        "ttft_p90_ms": stats.ttft_p90_ms,
        "ttft_max_ms": peak,
        "max_over_p50": peak / p50 if p50 and peak else None,
        "tokens_per_s": stats.tokens_per_s,
        "errors": stats.errors,
        "steal_share": steal_share,
    }


def summarize_bursts(bursts: list[dict[str, Any]]) -> dict[str, Any]:
    """Several bursts on one worker: the one with the median max ÷ p50 stands for them
    (the higher middle one of an even count).

    One burst's max is one request's TTFT; whether two prompts land in the same prefill
    window is down to timing, so a single burst swings between ~1.1 and ~2 here. Every
    burst stays listed under `bursts`, and `worst` keeps the highest ratio."""
    ratios = sorted(b["max_over_p50"] for b in bursts if b["max_over_p50"] is not None)
    middle = ratios[len(ratios) // 2] if ratios else None
    median = next((b for b in bursts if b["max_over_p50"] == middle), bursts[0])
    return {
        **median,
        "errors": sum(b["errors"] for b in bursts),
        "requests": sum(b["requests"] for b in bursts),
        "worst": ratios[-1] if ratios else None,
        "bursts": bursts,
    }
