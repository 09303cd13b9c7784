"""Images through the worker: mixed image and text traffic, ours against mlx_vlm.server.

    python bench/images.py                                  # the demo VLM (~2 minutes)
    python bench/images.py --model shape                    # a VLM of real shape (~15 min)
    python bench/images.py --model shape-qwen3_vl           # Qwen3-VL-2B's shape instead
    python bench/images.py --model demo --model shape --levels 1,8 --rounds 3
    python bench/images.py --render bench/results/images-STAMP.json    # a saved run's tables

Two servers on the same model, both up for the whole model, each paused (SIGSTOP) while the
other is measured:

- ours: `python -m servicer --protocols vllm` (the vLLM face, which takes images as
  `media_refs`), driven over gRPC as the smg router drives it: the chat template rendered
  and tokenized (one `<start_of_image>` anchor per image), the image as a `data:` URL;
- theirs: `python -m mlx_vlm.server` (mlx-vlm's OpenAI-compatible server, continuous
  batching on, its defaults otherwise), driven with streamed chat completions whose image
  is an `image_url` part with the same `data:` URL and the same question.

**Mixed traffic.** At each concurrency level (`--levels`, default 1,4,8), each round
(`--rounds`) is one closed-loop run per server on the same requests (new ones every round and
level): C clients send streamed requests back to back until the run's requests are done
(`--requests-per-client` x C, at least `--min-requests`); every other request carries one
image (`--image-share`), each image new (so neither server's image-feature cache ever
hits). All requests are greedy (temperature 0) for `--max-tokens` new tokens; mlx_vlm.server
has no ignore_eos, so neither gets it: both stop at the model's end of turn, and the table
says how many outputs the two servers had alike. The servers take turns, the first
alternating from round to round. Reported per level and server: output tokens/s (every
output token / first send to last token), TTFT p50 and p90 (send to the first token, all
requests, and image and text requests apart), the medians over rounds, the failed requests,
and the ratios ours / theirs (the median of the per-round ratios: tok/s above 1 and TTFT below
1 are ours faster). `--prompts`: `varied` questions of any length, `uniform` every image
request's prompt of one length (mlx-vlm 0.7.10's server fails every request of a prefill batch
holding Gemma 3 image prompts of different lengths: their 4-D attention masks do not
concatenate); the demo runs both, the real-shape model `uniform`.

**Stall.** Two text streams decode on a server (ignore_eos for ours; for mlx_vlm.server the
end of turn biased out); then an image request arrives (8 new tokens). The streams' longest
gap between two tokens while it is prefilled (from its send to its first token), against the
median of their longest gaps over windows as long before it, with no arrival (the window
before lasts at least 3x the image's TTFT on the idle server; `--gap-rounds` rounds, each on
new prompts and a new image). Our worker runs with its default `--max-prefill-stall-ms 50`;
mlx_vlm.server is measured too unless `--gap-servers ours`.

Every process runs with OpenBLAS preloaded when it is installed (as every bench's).
mlx_vlm.server needs fastapi, uvicorn and mlx-audio (its module imports mlx_audio; installed
without its dependencies): see bench/README.md. Prints the tables, writes
bench/results/images-STAMP.json, logs under bench/results/logs/STAMP/.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import math
import random
import shlex
import signal
import statistics
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _checkout  # noqa: F401  (before any `servicer` import)
import grpc
import httpx
import report
from workers import BENCH, Worker, log, parse_levels
from workload import StealMeter, disturbed, percentile

from servicer.proto import vllm_engine_pb2 as vpb
from servicer.proto import vllm_engine_pb2_grpc as vgrpc
from servicer.sysinfo import cpu_seconds, free_port

SERVERS = ("ours", "theirs")
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
]
# Per model kind: rounds, requests per client, at least this many requests a run, stall rounds,
# prompt variants.
DEFAULTS = {
    "demo": (5, 4, 8, 3, ("varied", "uniform")),
    "shape": (1, 1, 2, 1, ("uniform",)),
}
VARIANTS = ("varied", "uniform")
STREAM_TOKENS = 4000  # the stall phase's streams: cancelled long before
ARRIVING_TOKENS = 8
BASELINE_S = 1.0  # the stall phase's window before the arrival, at least
BASELINE_STEPS = 6  # ... and at least this many steps of each stream
TAIL_S = 0.3

ASKS = (
    "Describe {0} in {1}.",
    "What would {0} notice first in {1}?",
    "Write a short story about {0} in {1}.",
    "Give three reasons {0} would enjoy {1}.",
    "Explain to a child why {0} might visit {1}.",
)
SUBJECTS = ("a lighthouse keeper", "a curious fox", "a young baker", "an old fisherman")
PLACES = ("Lisbon", "a mountain village", "the Sahara", "a busy train station", "Kyoto")


# --------------------------------------------------------------------------- requests


def question(seed: str) -> str:
    rng = random.Random(seed)
    return rng.choice(ASKS).format(rng.choice(SUBJECTS), rng.choice(PLACES))


def all_questions() -> list[str]:
    return [a.format(s, p) for a in ASKS for s in SUBJECTS for p in PLACES]


def png(seed: str, size: tuple[int, int]) -> bytes:
    """A photo-sized PNG of smooth random colour (an 8x coarser noise, upscaled): a few tens
    of kilobytes, unlike raw noise."""
    import numpy as np
    from PIL import Image

    width, height = size
    rng = np.random.default_rng(random.Random(seed).getrandbits(64))
    coarse = rng.integers(0, 256, (max(1, height // 8), max(1, width // 8), 3), dtype=np.uint8)
    picture = Image.fromarray(coarse).resize((width, height), Image.BICUBIC)
    out = io.BytesIO()
    picture.save(out, format="PNG")
    return out.getvalue()


def data_url(raw: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(raw).decode()


@dataclass(frozen=True)
class Job:
    """One request, as both servers get it."""

    question: str
    image: str | None  # a data: URL
    prompt: tuple[int, ...]  # our tokenized prompt (the chat template, one anchor per image)


class Prompts:
    """The model's chat template and tokenizer, as the router renders and tokenizes."""

    def __init__(self, model: Path, image_size: tuple[int, int]) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model))
        self.image_size = image_size
        self._by_length: dict[int, list[str]] = {}
        self.eos = set(eos_ids(model))

    def ids(self, text: str, images: int) -> list[int]:
        content = [{"type": "image"}] * images + [{"type": "text", "text": text}]
        messages = [{"role": "user", "content": content}]
        rendered = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        return list(self.tokenizer.encode(rendered, add_special_tokens=False))

    def job(self, seed: str, image: bool, length: int | None = None) -> Job:
        """A request on a new question (of `length` tokens with its anchor, when given) and,
        with `image`, a new image."""
        text = question(seed) if length is None else self._question_of(length, seed)
        url = data_url(png(seed, self.image_size)) if image else None
        return Job(text, url, tuple(self.ids(text, 1 if image else 0)))

    def long_text_job(self, seed: str, tokens: int) -> Job:
        """A text request of about `tokens` prompt tokens (as long as an image request's
        expanded prompt: the stall phase's text arrival), a word at a time up to it."""
        rng = random.Random(seed)
        words: list[str] = []
        text, ids = "", self.ids("", 0)
        while len(ids) < tokens:
            if not words:
                words = rng.choice(ASKS).format(rng.choice(SUBJECTS), rng.choice(PLACES)).split()
            text = f"{text} {words.pop(0)}".strip()
            ids = self.ids(text, 0)
        return Job(text, None, tuple(ids))

    def by_length(self) -> dict[int, list[str]]:
        """Every question by the length of its image request's prompt (computed once)."""
        if not self._by_length:
            for text in all_questions():
                self._by_length.setdefault(len(self.ids(text, 1)), []).append(text)
        return self._by_length

    def uniform_length(self) -> int:
        """The most common length of an image request's prompt over every question."""
        return max(self.by_length(), key=lambda length: len(self.by_length()[length]))

    def _question_of(self, length: int, seed: str) -> str:
        return random.Random(seed).choice(self.by_length()[length])

    def jobs(self, count: int, seed: str, share: float, uniform: bool = False) -> list[Job]:
        """`count` requests, a `share` of them with an image (the first, and then evenly
        spread); `uniform`: every prompt as long as every other image request's."""
        length = self.uniform_length() if uniform else None
        return [
            self.job(f"{seed}/{i}", math.floor(i * share) != math.floor((i - 1) * share), length)
            for i in range(count)
        ]

    def text(self, ids: list[int]) -> str:
        """Output ids as text, a closing end of turn aside (mlx_vlm.server leaves it out)."""
        if ids and ids[-1] in self.eos:
            ids = ids[:-1]
        return self.tokenizer.decode(ids)


@dataclass
class Record:
    """One request as its client saw it (times in seconds, perf_counter)."""

    image: bool
    start: float
    end: float = 0.0
    ttft: float | None = None
    tokens: int = 0
    prompt_tokens: int = 0
    text: str = ""
    ids: list[int] = field(default_factory=list)
    chunks: list[float] = field(default_factory=list)  # when each token-bearing chunk came
    chunk_tokens: list[int] = field(default_factory=list)  # and its tokens
    error: str | None = None


# --------------------------------------------------------------------------- clients


class Ours:
    """Our worker's vLLM face over gRPC."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = vgrpc.VllmEngineStub(self.channel)
        self.ids = 0

    async def close(self) -> None:
        await self.channel.close()

    async def generate(
        self,
        job: Job,
        max_tokens: int,
        *,
        endless: bool = False,
        stop: asyncio.Event | None = None,
        record: Record | None = None,
    ) -> Record:
        """One streamed request; with `stop`, cancelled at the first token after it is set;
        `record` (filled as tokens come) lets the caller watch it."""
        self.ids += 1
        params = vpb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=endless)
        request = vpb.GenerateRequest(
            request_id=f"images-{self.ids}",
            tokenized=vpb.TokenizedInput(input_ids=list(job.prompt)),
            sampling_params=params,
            stream=True,
        )
        if job.image is not None:
            request.media_refs.items.append(vpb.MediaRef(modality=1, url=job.image))
        record = record or Record(image=job.image is not None, start=0.0)
        record.start = time.perf_counter()
        call = self.stub.Generate(request, timeout=1800)
        try:
            async for response in call:
                if not response.HasField("chunk"):
                    continue
                chunk = response.chunk
                record.prompt_tokens = chunk.prompt_tokens or record.prompt_tokens
                if not chunk.token_ids:
                    continue
                now = time.perf_counter()
                record.ttft = record.ttft if record.ttft is not None else now - record.start
                record.chunks.append(now)
                record.chunk_tokens.append(len(chunk.token_ids))
                record.ids.extend(chunk.token_ids)
                record.tokens += len(chunk.token_ids)
                record.end = now
                if stop is not None and stop.is_set():
                    call.cancel()
                    break
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.CANCELLED:
                record.error = f"{error.code().name}: {error.details()}"
        record.end = record.end or time.perf_counter()
        return record


class Theirs:
    """mlx_vlm.server's OpenAI chat completions over HTTP (streamed, server-sent events)."""

    def __init__(self, base: str, model: str, eos_ids: list[int], connections: int) -> None:
        limits = httpx.Limits(max_connections=connections + 4)
        self.client = httpx.AsyncClient(base_url=base, timeout=1800, limits=limits)
        self.model = model
        self.eos_ids = eos_ids

    async def close(self) -> None:
        await self.client.aclose()

    async def generate(
        self,
        job: Job,
        max_tokens: int,
        *,
        endless: bool = False,
        stop: asyncio.Event | None = None,
        record: Record | None = None,
    ) -> Record:
        """One streamed request; with `stop`, cancelled at the first token after it is set;
        `record` (filled as tokens come) lets the caller watch it."""
        content: list[dict[str, Any]] = []
        if job.image is not None:
            content.append({"type": "image_url", "image_url": {"url": job.image}})
        content.append({"type": "text", "text": job.question})
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if endless:  # no ignore_eos here: the end of turn made unpickable instead
            body["logit_bias"] = {str(i): -1e9 for i in self.eos_ids}
        record = record or Record(image=job.image is not None, start=0.0)
        record.start = time.perf_counter()
        pieces, usage = [], None
        try:
            async with self.client.stream("POST", "/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")
                    record.error = f"HTTP {response.status_code}: {text[:300]}"
                else:
                    async for line in response.aiter_lines():
                        if not line.startswith("data:"):
                            continue
                        data = line[5:].strip()
                        if data == "[DONE]":
                            break
                        event = json.loads(data)
                        if event.get("error"):
                            record.error = f"error event: {json.dumps(event['error'])[:300]}"
                        if event.get("usage"):
                            usage = event["usage"]
                        text = "".join(
                            (c.get("delta") or {}).get("content") or ""
                            for c in event.get("choices", [])
                        )
                        if not text:
                            continue
                        now = time.perf_counter()
                        record.ttft = record.ttft if record.ttft is not None else now - record.start
                        record.chunks.append(now)
                        record.chunk_tokens.append(1)  # an event a token
                        pieces.append(text)
                        record.end = now
                        if stop is not None and stop.is_set():
                            break
        except (httpx.HTTPError, json.JSONDecodeError) as error:
            record.error = f"{type(error).__name__}: {error}"
        record.end = record.end or time.perf_counter()
        record.text = "".join(pieces)
        if usage:
            record.tokens = int(usage.get("completion_tokens") or 0)
            record.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        else:
            record.tokens = len(record.chunks)
            if record.error is None and stop is None:
                record.error = f"the stream ended without usage after {len(record.chunks)} chunks"
        return record


# --------------------------------------------------------------------------- servers


class OurServer(Worker):
    """Our worker on its vLLM face: ready when the face's HealthCheck says healthy."""

    def _wait_healthy(self, timeout: float) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(self.address) as channel:
            stub = vgrpc.VllmEngineStub(channel)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"ours exited ({self.proc.returncode}):\n{self.tail()}")
                try:
                    if stub.HealthCheck(vpb.HealthCheckRequest(), timeout=2).healthy:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"ours was not healthy after {timeout:.0f} s:\n{self.tail()}")


class TheirServer(Worker):
    """mlx_vlm.server: ready when /health answers (it loads the model before it listens)."""

    def _wait_healthy(self, timeout: float) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"theirs exited ({self.proc.returncode}):\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"http://{self.address}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"theirs was not healthy after {timeout:.0f} s:\n{self.tail()}")


def our_server(model: Path, log_dir: Path, tag: str, flags: list[str]) -> OurServer:
    port = free_port()
    command = [sys.executable, "-m", "servicer", "--model", str(model), "--port", str(port)]
    command += ["--protocols", "vllm", "--log-level", "warning", *flags]
    return OurServer("ours", command, port, log_dir / f"ours-{tag}.log")


def their_server(model: Path, log_dir: Path, tag: str, flags: list[str]) -> TheirServer:
    port = free_port()
    command = [sys.executable, "-m", "mlx_vlm.server", "--model", str(model)]
    command += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "WARNING", *flags]
    return TheirServer("theirs", command, port, log_dir / f"theirs-{tag}.log")


def eos_ids(model: Path) -> list[int]:
    config = json.loads((model / "config.json").read_text())
    found = config.get("eos_token_id", (config.get("text_config") or {}).get("eos_token_id"))
    return [found] if isinstance(found, int) else list(found or [])


# --------------------------------------------------------------------------- runs


def _ms(value: float | None) -> float | None:
    return None if value is None else value * 1000


def summarize(records: list[Record], seconds_cpu: float) -> dict[str, Any]:
    ok = [r for r in records if r.error is None]
    start = min(r.start for r in records)
    end = max(r.end for r in records)
    tokens = sum(r.tokens for r in ok)

    def ttft(kind: bool | None, q: float) -> float | None:
        values = [r.ttft for r in ok if r.ttft is not None and kind in (None, r.image)]
        return _ms(percentile(values, q))

    return {
        "requests": len(records),
        "images": sum(r.image for r in records),
        "errors": len(records) - len(ok),
        "error_samples": sorted({r.error for r in records if r.error})[:3],
        "seconds": end - start,
        "output_tokens": tokens,
        "tokens_per_s": tokens / (end - start) if end > start else 0.0,
        "ttft_p50_ms": ttft(None, 50),
        "ttft_p90_ms": ttft(None, 90),
        "ttft_image_p50_ms": ttft(True, 50),
        "ttft_text_p50_ms": ttft(False, 50),
        "mean_output_tokens": tokens / len(ok) if ok else None,
        "mean_prompt_tokens_image": statistics.fmean(
            [r.prompt_tokens for r in ok if r.image] or [0]
        ),
        "client_cpu": seconds_cpu / (end - start) if end > start else None,
    }


async def closed_loop(client: Ours | Theirs, level: int, jobs: list[Job], max_tokens: int):
    queue = iter(jobs)
    records: list[Record | None] = [None] * len(jobs)
    indexed = iter(range(len(jobs)))

    async def one() -> None:
        for index, job in zip(indexed, queue, strict=False):
            records[index] = await client.generate(job, max_tokens)

    cpu = cpu_seconds()
    await asyncio.gather(*(one() for _ in range(level)))
    done = [r for r in records if r is not None]
    return done, cpu_seconds() - cpu


def same_outputs(
    ours: list[Record], theirs: list[Record], prompts: Prompts
) -> tuple[int, list[dict[str, Any]]]:
    """How many requests the two servers answered alike (our ids decoded against their
    streamed text, spaces at the ends aside), and the first two that differ."""
    alike, differ = 0, []
    for a, b in zip(ours, theirs, strict=True):
        if a.error is not None or b.error is not None:
            continue
        mine = prompts.text(a.ids)
        if mine.strip() == b.text.strip():
            alike += 1
        elif len(differ) < 2:
            differ.append({"image": a.image, "ours": mine, "theirs": b.text})
    return alike, differ


def _median(values: list[float | None]) -> float | None:
    found = [v for v in values if v is not None]
    return statistics.median(found) if found else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


async def warm_up(clients: dict[str, Ours | Theirs], servers: dict[str, Worker], prompts: Prompts):
    """One image and one text request at once, then one image alone (its TTFT: the
    stall phase's window), on each server, on prompts never measured."""
    idle_ttft = {}
    for name, client in clients.items():
        _only(servers, name)
        pair = [prompts.job(f"warm-{name}-a", True), prompts.job(f"warm-{name}-b", False)]
        await asyncio.gather(*(client.generate(job, 8) for job in pair))
        alone = await client.generate(prompts.job(f"warm-{name}-c", True), 4)
        if alone.error:
            raise RuntimeError(f"{name}: warm-up failed: {alone.error}")
        idle_ttft[name] = alone.ttft
        log(f"{name}: warm; an image request's TTFT alone {alone.ttft * 1000:.0f} ms")
    return idle_ttft


def _only(servers: dict[str, Worker], name: str) -> None:
    """Resume `name`, pause the others."""
    for other, server in servers.items():
        if other != name:
            server.pause()
    servers[name].resume()


async def mixed_traffic(
    clients: dict[str, Ours | Theirs],
    servers: dict[str, Worker],
    prompts: Prompts,
    args: argparse.Namespace,
    settings: dict[str, Any],
    variant: str,
) -> list[dict[str, Any]]:
    levels = []
    for level_index, level in enumerate(args.levels):
        count = max(settings["min_requests"], settings["per_client"] * level)
        rounds = []
        for round_index in range(settings["rounds"]):
            seed = f"mix-{variant}-c{level}-r{round_index}"
            jobs = prompts.jobs(count, seed, args.image_share, variant == "uniform")
            order = list(SERVERS) if (level_index + round_index) % 2 == 0 else list(SERVERS)[::-1]
            found: dict[str, Any] = {"order": order}
            records = {}
            for name in order:
                _only(servers, name)
                steal = StealMeter()
                records[name], cpu = await closed_loop(clients[name], level, jobs, args.max_tokens)
                found[name] = summarize(records[name], cpu)
                found[name]["steal"] = steal.share()
            found["alike"], found["differ"] = same_outputs(
                records["ours"], records["theirs"], prompts
            )
            found["tokens_per_s_ratio"] = _ratio(
                found["ours"]["tokens_per_s"], found["theirs"]["tokens_per_s"]
            )
            found["ttft_p50_ratio"] = _ratio(
                found["ours"]["ttft_p50_ms"], found["theirs"]["ttft_p50_ms"]
            )
            rounds.append(found)
            log(
                f"{variant} c={level} round {round_index + 1}: tok/s ours "
                f"{found['ours']['tokens_per_s']:.1f}, theirs "
                f"{found['theirs']['tokens_per_s']:.1f}; TTFT p50 ours "
                f"{report._fmt(found['ours']['ttft_p50_ms'], 0)} ms, theirs "
                f"{report._fmt(found['theirs']['ttft_p50_ms'], 0)} ms; alike "
                f"{found['alike']}/{count}"
            )
        levels.append(_level_summary(level, count, rounds))
    return levels


def _level_summary(level: int, count: int, rounds: list[dict[str, Any]]) -> dict[str, Any]:
    counted = [r for r in rounds if not any(disturbed(r[s]["steal"]) for s in SERVERS)] or rounds
    out: dict[str, Any] = {"concurrency": level, "requests": count, "rounds": rounds}
    for name in SERVERS:
        out[name] = {
            key: _median([r[name][key] for r in counted])
            for key in (
                "tokens_per_s",
                "ttft_p50_ms",
                "ttft_p90_ms",
                "ttft_image_p50_ms",
                "ttft_text_p50_ms",
                "mean_output_tokens",
                "mean_prompt_tokens_image",
                "client_cpu",
            )
        }
        out[name]["errors"] = sum(r[name]["errors"] for r in rounds)
    for key in ("tokens_per_s_ratio", "ttft_p50_ratio"):
        out[key] = _median([r[key] for r in counted])
        out[f"{key}s"] = [r[key] for r in rounds]
    out["ttft_p90_ratio"] = _median(
        [_ratio(r["ours"]["ttft_p90_ms"], r["theirs"]["ttft_p90_ms"]) for r in counted]
    )
    out["error_samples"] = sorted(
        {f"{n}: {e}" for r in rounds for n in SERVERS for e in r[n]["error_samples"]}
    )[:3]
    out["alike"] = sum(r["alike"] for r in rounds)
    out["compared"] = count * len(rounds)
    out["counted_rounds"] = len(counted)
    return out


# --------------------------------------------------------------------------- stall


def _gaps(streams: list[Record]) -> list[tuple[float, float]]:
    return [pair for s in streams for pair in zip(s.chunks, s.chunks[1:], strict=False)]


async def stall_round(
    client: Ours | Theirs, prompts: Prompts, seed: str, window: float, text_tokens: int = 0
) -> dict[str, Any]:
    """Two text streams decode; after a window of at least `window` seconds the image request
    (with `text_tokens`: a text request of that many prompt tokens) arrives; the streams' gaps
    before it and while it is prefilled."""
    stop = asyncio.Event()
    jobs = [prompts.job(f"{seed}/stream{i}", False) for i in range(2)]
    views = [Record(image=False, start=0.0) for _ in jobs]
    tasks = [
        asyncio.ensure_future(
            client.generate(job, STREAM_TOKENS, endless=True, stop=stop, record=view)
        )
        for job, view in zip(jobs, views, strict=True)
    ]
    deadline = time.perf_counter() + 1800
    while time.perf_counter() < deadline and not all(v.chunks or v.error for v in views):
        await asyncio.sleep(0.01)
    decoding_from = time.perf_counter()
    enough = [len(v.chunks) + BASELINE_STEPS for v in views]
    await asyncio.sleep(max(BASELINE_S, window))
    while time.perf_counter() < deadline and not all(
        len(v.chunks) >= n or v.error for v, n in zip(views, enough, strict=True)
    ):
        await asyncio.sleep(0.01)
    sent = time.perf_counter()
    job = (
        prompts.long_text_job(f"{seed}/text", text_tokens)
        if text_tokens
        else prompts.job(f"{seed}/image", True)
    )
    arriving = await client.generate(job, ARRIVING_TOKENS)
    first = sent + (arriving.ttft or 0.0)
    await asyncio.sleep(TAIL_S)
    stop.set()
    done: list[Record] = await asyncio.gather(*tasks)
    gaps = _gaps(done)
    before = [e - s for s, e in gaps if decoding_from <= s and e <= sent]
    tokens_before = sum(
        n
        for r in done
        for t, n in zip(r.chunks, r.chunk_tokens, strict=True)
        if decoding_from < t <= sent
    )
    during = [e - s for s, e in gaps if e > sent and s < first]
    # No arrival, over windows as long: the window before cut into pieces as long as the
    # arrival's (at least two steps; at most the whole window), each piece's longest gap,
    # their median.
    piece = min(max(first - sent, 2 * (percentile(before, 50) or 0.0)), sent - decoding_from)
    maxima = []
    edge = decoding_from
    while piece > 0 and edge + piece <= sent + 1e-9:
        inside = [e - s for s, e in gaps if edge <= e <= edge + piece and s >= decoding_from]
        if inside:
            maxima.append(max(inside))
        edge += piece
    return {
        "window_before_s": sent - decoding_from,
        "window_during_s": first - sent,
        "stream_tokens_per_s_before": tokens_before / (sent - decoding_from),
        "gap_p50_before_ms": _ms(percentile(before, 50)),
        "gap_max_before_ms": _ms(max(before, default=None)),
        "gap_max_as_long_ms": _ms(percentile(maxima, 50)),
        "pieces": len(maxima),
        "gap_max_during_ms": _ms(max(during, default=None)),
        "gaps_during": len(during),
        "image_ttft_ms": _ms(arriving.ttft),
        "arriving_prompt_tokens": arriving.prompt_tokens or len(job.prompt),
        "errors": sum(1 for r in [*done, arriving] if r.error),
        "error_samples": [r.error for r in [*done, arriving] if r.error][:3],
    }


async def stall_phase(
    clients: dict[str, Ours | Theirs],
    servers: dict[str, Worker],
    prompts: Prompts,
    names: list[str],
    rounds: int,
    idle_ttft: dict[str, float],
) -> dict[str, Any]:
    """Per server, `rounds` rounds of an image arriving, each followed by a text prompt as
    long as the image's expanded prompt arriving (the text rule's bound to compare with)."""
    out: dict[str, Any] = {}
    for name in names:
        _only(servers, name)
        client = clients[name]
        found: dict[str, list[dict[str, Any]]] = {"image": [], "text": []}
        for index in range(rounds):
            # The window before: at least three times the image's TTFT on the idle server
            # (beside two streams it takes longer), so that a piece as long fits in it.
            window = 3 * idle_ttft[name]
            image = await stall_round(client, prompts, f"stall-{index}", window)
            tokens = image["arriving_prompt_tokens"]
            text = await stall_round(client, prompts, f"stall-{index}", window, tokens)
            for kind, entry in (("image", image), ("text", text)):
                found[kind].append(entry)
                log(
                    f"stall {name} round {index + 1}, {kind} of {entry['arriving_prompt_tokens']}"
                    f" tokens arriving: longest gap {report._fmt(entry['gap_max_before_ms'], 0)}"
                    f" ms before, {report._fmt(entry['gap_max_during_ms'], 0)} ms while it came"
                    f" in (TTFT {report._fmt(entry['image_ttft_ms'], 0)} ms)"
                )
        for kind, entries in found.items():
            summary = {
                key: _median([r[key] for r in entries])
                for key in (
                    "stream_tokens_per_s_before",
                    "gap_p50_before_ms",
                    "gap_max_before_ms",
                    "gap_max_as_long_ms",
                    "gap_max_during_ms",
                    "image_ttft_ms",
                    "window_before_s",
                    "window_during_s",
                    "arriving_prompt_tokens",
                )
            }
            summary["ratio"] = _median(
                [_ratio(r["gap_max_during_ms"], r["gap_max_as_long_ms"]) for r in entries]
            )
            summary["errors"] = sum(r["errors"] for r in entries)
            out[name if kind == "image" else f"{name}, text"] = {"rounds": entries, **summary}
        out[name]["image_vs_text"] = _median(
            [
                _ratio(i["gap_max_during_ms"], t["gap_max_during_ms"])
                for i, t in zip(found["image"], found["text"], strict=True)
            ]
        )
    return out


# --------------------------------------------------------------------------- models


def resolve(
    model: str, image_size: int, bits: int, image_tokens: int = 256
) -> tuple[str, Path, str]:
    """(kind, directory, name) for `demo`, `shape` (gemma3's), `shape-FAMILY` or a directory."""
    if model == "demo":
        from servicer.demos.vision import demo_vlm_path

        return "demo", demo_vlm_path(family="gemma3"), "demo:vlm (gemma3)"
    if model == "shape" or model.startswith("shape-"):
        from vlm_shape import FAMILIES, vlm_shape_path

        family = model.partition("-")[2] or "gemma3"
        if family not in FAMILIES:
            raise SystemExit(f"--model {model}: shape families are {', '.join(FAMILIES)}")
        path = vlm_shape_path(image_size, bits, family=family, image_tokens=image_tokens)
        return "shape", path, f"real shape ({path.name})"
    path = Path(model).expanduser().resolve()
    if not (path / "config.json").exists():
        raise SystemExit(
            f"--model {model}: no config.json there (demo, shape, shape-qwen3_vl or a directory)"
        )
    return "shape", path, path.name


async def run_model(
    kind: str, path: Path, name: str, args: argparse.Namespace, log_dir: Path
) -> dict[str, Any]:
    rounds, per_client, min_requests, gap_rounds, variants = DEFAULTS[kind]
    settings = {
        "prompts": args.prompts or list(variants),
        "rounds": args.rounds or rounds,
        "per_client": args.requests_per_client or per_client,
        "min_requests": args.min_requests or min_requests,
        "gap_rounds": args.gap_rounds if args.gap_rounds is not None else gap_rounds,
    }
    prompts = Prompts(path, args.image_px)
    tag = kind
    servers: dict[str, Worker] = {
        "ours": our_server(path, log_dir, tag, shlex.split(args.worker_flags)),
        "theirs": their_server(path, log_dir, tag, shlex.split(args.their_flags)),
    }
    result: dict[str, Any] = {"model": name, "path": str(path), "settings": settings}
    result["commands"] = {k: shlex.join(s.command) for k, s in servers.items()}
    clients: dict[str, Ours | Theirs] = {}
    try:
        for server_name, server in servers.items():
            started = time.perf_counter()
            server.start(timeout=900)
            result[f"{server_name}_start_s"] = time.perf_counter() - started
            server.pause()
            log(f"{server_name} up in {result[f'{server_name}_start_s']:.0f} s")
        clients["ours"] = Ours(servers["ours"].address)
        clients["theirs"] = Theirs(
            f"http://{servers['theirs'].address}", str(path), eos_ids(path), max(args.levels)
        )
        idle = await warm_up(clients, servers, prompts)
        result["idle_image_ttft_ms"] = {k: v * 1000 for k, v in idle.items()}
        result["traffic"] = [
            {
                "prompts": variant,
                "levels": await mixed_traffic(clients, servers, prompts, args, settings, variant),
            }
            for variant in ([] if args.no_traffic else settings["prompts"])
        ]
        if settings["gap_rounds"]:
            result["stall"] = await stall_phase(
                clients, servers, prompts, args.gap_servers, settings["gap_rounds"], idle
            )
    finally:
        for client in clients.values():
            await client.close()
        for server in servers.values():
            server.stop()
    return result


# --------------------------------------------------------------------------- report


PROMPT_NOTES = {
    "varied": "questions of any length",
    "uniform": "every image request's prompt of one length (mlx_vlm.server fails image "
    "prompts of different lengths prefilled together)",
}


def _pair(a: Any, b: Any, digits: int = 0) -> str:
    return f"{report._fmt(a, digits)} / {report._fmt(b, digits)}"


def traffic_tables(results: dict[str, Any], found: dict[str, Any], traffic: dict) -> list[str]:
    s = found["settings"]
    w, h = results["image_px"]
    lines = [
        f"### {found['model']}, {traffic['prompts']} prompts: mixed traffic "
        f"({PROMPT_NOTES[traffic['prompts']]}; {results['image_share']:.0%} of the requests with "
        f"one {w}x{h} PNG, each new; {results['max_tokens']} new tokens, greedy; "
        f"{s['rounds']} round(s) per level, the median)",
        "",
    ]
    rows = []
    for entry in traffic["levels"]:
        o, t = entry["ours"], entry["theirs"]
        rows.append(
            [
                entry["concurrency"],
                entry["requests"],
                report._fmt(o["tokens_per_s"], 1),
                report._fmt(t["tokens_per_s"], 1),
                f"**{report._fmt(entry['tokens_per_s_ratio'], 2)}**",
                _pair(o["ttft_p50_ms"], o["ttft_p90_ms"]),
                _pair(t["ttft_p50_ms"], t["ttft_p90_ms"]),
                f"**{report._fmt(entry['ttft_p50_ratio'], 2)}** / "
                f"{report._fmt(entry['ttft_p90_ratio'], 2)}",
                f"{o['errors']} / {t['errors']} of {entry['compared']}",
            ]
        )
    headers = [
        "c",
        "requests",
        "tok/s ours",
        "tok/s theirs",
        "tok/s ours ÷ theirs",
        "TTFT p50 / p90 ms ours",
        "TTFT p50 / p90 ms theirs",
        "TTFT ours ÷ theirs p50 / p90",
        "failed ours / theirs (all rounds)",
    ]
    lines += [report.markdown_table(headers, rows), ""]
    rows = []
    for entry in traffic["levels"]:
        o, t = entry["ours"], entry["theirs"]
        rows.append(
            [
                entry["concurrency"],
                _pair(o["ttft_image_p50_ms"], t["ttft_image_p50_ms"]),
                _pair(o["ttft_text_p50_ms"], t["ttft_text_p50_ms"]),
                _pair(o["mean_output_tokens"], t["mean_output_tokens"], 1),
                _pair(o["mean_prompt_tokens_image"], t["mean_prompt_tokens_image"]),
                f"{entry['alike']} of {entry['compared']}",
                ", ".join(report._fmt(r, 2) for r in entry["tokens_per_s_ratios"]),
                "; ".join(e.replace("error event: ", "") for e in entry["error_samples"])[:100]
                or "-",
            ]
        )
    headers = [
        "c",
        "image TTFT p50 ms ours / theirs",
        "text TTFT p50 ms ours / theirs",
        "output tokens a request ours / theirs",
        "image prompt tokens ours / theirs",
        "outputs alike",
        "tok/s ratio per round",
        "failures",
    ]
    return [*lines, report.markdown_table(headers, rows), ""]


def stall_table(found: dict[str, Any]) -> list[str]:
    lines = [
        f"### {found['model']}: the longest gap between tokens of two decoding text streams "
        "while a request arrives (its send to its first token): an image request, and a text "
        "prompt as long as the image's expanded prompt (`, text`), against windows as long "
        "before it with no arrival (the median of their longest gaps)",
        "",
    ]
    rows = []
    for server, entry in found["stall"].items():
        rows.append(
            [
                server,
                report._fmt(entry.get("arriving_prompt_tokens"), 0),
                report._fmt(entry["stream_tokens_per_s_before"], 1),
                report._fmt(entry["gap_max_as_long_ms"], 0),
                report._fmt(entry["gap_max_before_ms"], 0),
                report._fmt(entry["gap_max_during_ms"], 0),
                report._fmt(entry["ratio"], 1),
                report._fmt(entry.get("image_vs_text"), 2),
                report._fmt(entry["image_ttft_ms"], 0),
                _pair(entry["window_before_s"], entry["window_during_s"], 2),
                len(entry["rounds"]),
                entry["errors"],
            ]
        )
    headers = [
        "server, arrival",
        "arriving prompt tokens",
        "streams' tok/s before",
        "longest gap, no arrival, as long a window ms",
        "longest gap in the whole window before ms",
        "longest gap, arriving ms",
        "arriving ÷ no arrival",
        "image ÷ text arriving",
        "arrival's TTFT ms",
        "windows s (before / during)",
        "rounds",
        "errors",
    ]
    return [*lines, report.markdown_table(headers, rows), ""]


def render(results: dict[str, Any]) -> str:
    lines: list[str] = []
    for found in results["models"]:
        for traffic in found["traffic"]:
            lines += traffic_tables(results, found, traffic)
        if found.get("stall"):
            lines += stall_table(found)
        lines += [
            f"Ours: `{found['commands']['ours']}`",
            "",
            f"Theirs: `{found['commands']['theirs']}`",
            "",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model",
        action="append",
        help="demo (the gemma3 demo VLM, default), shape (a random VLM of real shape, "
        "bench/vlm_shape.py: gemma-3-1b with SigLIP), shape-qwen3_vl (Qwen3-VL-2B's shape) "
        "or a model directory; repeatable",
    )
    parser.add_argument("--levels", type=parse_levels, default=[1, 4, 8])
    parser.add_argument("--rounds", type=int, help="rounds per level (demo 5, shape 1)")
    parser.add_argument(
        "--requests-per-client", type=int, help="a run's requests per client (demo 4, shape 1)"
    )
    parser.add_argument("--min-requests", type=int, help="a run's requests, at least (8, 2)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--image-share", type=float, default=0.5, help="requests with an image")
    parser.add_argument(
        "--image-px", default="320x240", help="the images sent, WIDTHxHEIGHT (default 320x240)"
    )
    parser.add_argument(
        "--prompts",
        type=lambda text: [v for v in text.split(",") if v],
        help="prompt variants: varied (any length), uniform (every image prompt of one "
        "length); default varied,uniform on the demo, uniform on shape",
    )
    parser.add_argument("--gap-rounds", type=int, help="stall rounds (demo 3, shape 1; 0: none)")
    parser.add_argument(
        "--no-traffic", action="store_true", help="the stall phase alone (no mixed traffic)"
    )
    parser.add_argument(
        "--gap-servers", default="ours,theirs", help="servers the stall phase measures"
    )
    parser.add_argument("--image-size", type=int, default=224, help="shape: its vision input")
    parser.add_argument(
        "--image-tokens", type=int, default=256, help="shape-qwen3_vl: merged tokens per image"
    )
    parser.add_argument("--bits", type=int, default=0, help="shape: 0 float32, 4 (mlx_vlm.convert)")
    parser.add_argument("--worker-flags", default="", help="extra flags for our worker")
    parser.add_argument("--their-flags", default="", help="extra flags for mlx_vlm.server")
    parser.add_argument("--out", type=Path, default=BENCH / "results")
    parser.add_argument("--render", type=Path, help="print a saved run's tables, run nothing")
    args = parser.parse_args(argv)
    if args.render:
        saved = json.loads(args.render.read_text())
        print(render(saved))
        print(f"Machine: {report.machine_line(saved)}")
        return 0
    width, _, height = args.image_px.partition("x")
    args.image_px = (int(width), int(height))
    args.gap_servers = [s for s in args.gap_servers.split(",") if s]
    if not set(args.gap_servers) <= set(SERVERS) or not 0 < args.image_share <= 1:
        parser.error("--gap-servers takes ours,theirs; --image-share lies in (0, 1]")
    if args.prompts is not None and (not args.prompts or not set(args.prompts) <= set(VARIANTS)):
        parser.error("--prompts takes varied, uniform or both")
    _check_their_server()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    log_dir = args.out / "logs" / stamp
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "machine": report.machine_info(),
        "levels": args.levels,
        "max_tokens": args.max_tokens,
        "image_share": args.image_share,
        "image_px": args.image_px,
        "versions": {p: report.version(p) for p in ("mlx-vlm", "fastapi", "uvicorn")},
        "commit": _commit(),
        "models": [],
    }
    began = time.perf_counter()
    for model in args.model or ["demo"]:
        kind, path, name = resolve(model, args.image_size, args.bits, args.image_tokens)
        log(f"model {name}: {path}")
        started = time.perf_counter()
        found = asyncio.run(run_model(kind, path, name, args, log_dir))
        found["seconds"] = time.perf_counter() - started
        results["models"].append(found)
    results["seconds"] = time.perf_counter() - began
    results["machine"]["load_average_end"] = [round(x, 2) for x in __import__("os").getloadavg()]
    print(render(results))
    print(f"Machine: {report.machine_line(results)}")
    print(
        f"Commit {results['commit']}; mlx-vlm {results['versions']['mlx-vlm']}; "
        f"{results['seconds'] / 60:.1f} minutes"
    )
    report.save_json(args.out, "images", results)
    return 0


def _commit() -> str:
    """HEAD's short hash, `+dirty` when the servicer package has changes not committed."""
    import subprocess

    def git(*words: str) -> str:
        done = subprocess.run(["git", *words], cwd=BENCH.parent, capture_output=True, text=True)
        return done.stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("+dirty" if git("status", "--porcelain", "--", "servicer") else "")


def _check_their_server() -> None:
    """mlx_vlm.server imports fastapi, uvicorn and mlx_audio at module import (python-multipart
    only serves its audio uploads)."""
    import importlib.util

    missing = [m for m in ("fastapi", "uvicorn", "mlx_audio") if not importlib.util.find_spec(m)]
    if missing:
        raise SystemExit(
            f"mlx_vlm.server needs {', '.join(missing)}: .venv/bin/pip install fastapi uvicorn "
            "&& .venv/bin/pip install --no-deps mlx-audio (see bench/README.md)"
        )


if __name__ == "__main__":
    sys.exit(main())
