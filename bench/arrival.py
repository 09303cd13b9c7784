"""Long prompt arrival: k streams decode, then one long prompt arrives; what the streams see.

For each case the running streams' gaps (time between two chunks of one stream) are split
into those before the arrival and those overlapping its prefill (from its send to its first
token); the arriving prompt's TTFT is measured from its send.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import grpc
from load import Client
from workload import make_prompts, percentile

STREAM_PROMPT_TOKENS = 128
STREAM_MAX_TOKENS = 3000  # outlasts every case
BASELINE_S = 1.0  # decoding alone before the arrival, at least
# and at least this many steps of every stream: the streams' own decode step is the gaps'
# unit, and on a slow model one second may hold a single step (or none that lies wholly
# inside it); the engine's estimate of its decode step gets the same steps to settle.
BASELINE_STEPS = 6
TAIL_S = 0.5  # decoding after the arriving prompt's first token


@dataclass
class StreamTimes:
    """When each chunk of one stream arrived."""

    chunks: list[float] = field(default_factory=list)
    error: str | None = None

    def gaps(self) -> list[tuple[float, float]]:
        """(start, end) of every gap between two chunks."""
        return list(zip(self.chunks, self.chunks[1:], strict=False))


async def _stream(
    client: Client, prompt: list[int], stop: asyncio.Event, times: StreamTimes
) -> StreamTimes:
    request = client.request(prompt, STREAM_MAX_TOKENS)
    call = client.stub.Generate(request, timeout=600)
    try:
        async for response in call:
            if response.HasField("chunk") and response.chunk.token_ids:
                times.chunks.append(time.perf_counter())
            if stop.is_set():
                call.cancel()
                break
    except grpc.aio.AioRpcError as error:
        if error.code() != grpc.StatusCode.CANCELLED:
            times.error = f"{error.code().name}: {error.details()}"
    return times


def _ms(value: float | None) -> float | None:
    return None if value is None else value * 1000


async def long_prompt_arrival(
    client: Client, streams: int, prompt_tokens: int, seed: str, new_tokens: int = 8
) -> dict[str, Any]:
    """One case: `streams` streams decoding, then a `prompt_tokens` prompt arrives (and
    generates `new_tokens`)."""
    prompts = make_prompts(streams, STREAM_PROMPT_TOKENS, client.vocab_size, f"{seed}-streams")
    (arriving,) = make_prompts(1, prompt_tokens, client.vocab_size, f"{seed}-arriving")
    stop = asyncio.Event()
    running = [StreamTimes() for _ in prompts]
    tasks = [
        asyncio.ensure_future(_stream(client, p, stop, times))
        for p, times in zip(prompts, running, strict=True)
    ]
    deadline = time.perf_counter() + 120
    while time.perf_counter() < deadline and not all(t.chunks or t.error for t in running):
        await asyncio.sleep(0.01)
    decoding_from = time.perf_counter()  # every stream has its first token
    enough = [len(t.chunks) + BASELINE_STEPS for t in running]
    await asyncio.sleep(BASELINE_S)
    while time.perf_counter() < deadline and not all(
        len(t.chunks) >= n or t.error for t, n in zip(running, enough, strict=True)
    ):
        await asyncio.sleep(0.01)
    sent = time.perf_counter()
    record = await client.generate(arriving, new_tokens)
    first = sent + (record.ttft or 0.0)
    await asyncio.sleep(TAIL_S)
    stop.set()
    results: list[StreamTimes] = await asyncio.gather(*tasks)
    return _summary(results, decoding_from, sent, first, record, streams, prompt_tokens)


def _summary(
    results: list[StreamTimes],
    decoding_from: float,
    sent: float,
    first: float,
    record: Any,
    streams: int,
    prompt_tokens: int,
) -> dict[str, Any]:
    gaps = [gap for times in results for gap in times.gaps()]
    before = [end - start for start, end in gaps if decoding_from <= start and end <= sent]
    during = [end - start for start, end in gaps if end > sent and start < first]
    timeline = sorted((end - sent, end - start) for start, end in gaps)
    errors = sum(1 for times in results if times.error) + (1 if record.error else 0)
    return {
        "streams": streams,
        "prompt_tokens": prompt_tokens,
        "gap_p50_before_ms": _ms(percentile(before, 50)),
        "gap_p99_during_ms": _ms(percentile(during, 99)),
        "gap_max_during_ms": _ms(max(during, default=None)),
        "ttft_ms": _ms(record.ttft),
        "errors": errors,
        "timeline": [(round(t, 4), round(g * 1000, 2)) for t, g in timeline],
    }
