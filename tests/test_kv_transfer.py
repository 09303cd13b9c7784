"""Prompt KV between workers: the router's prefill/decode split with each transfer mode, a
prompt cache two workers share behind one router, and the faults on the way (a dead, broken,
corrupt or slow peer; a peer of another layout), each ending in the answer one worker gives.

In PD mode smg 1.13 reports the prefill worker's `cached_tokens` in the answer's usage (a cold
prefill: 0), so the decode side's reuse is read from the decode worker's own metrics."""

from __future__ import annotations

import asyncio
import json
import random
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest
from support import SMG, Router, ServerThread, slow

from servicer.engine_config import EngineConfig
from servicer.handlers import HandlerOptions
from servicer.kv_transfer import KvTransferOptions, fetch_blocks
from servicer.model_files import ModelSpec
from servicer.proto import vllm_engine_pb2 as pb
from servicer.proto import vllm_engine_pb2_grpc as pb_grpc
from servicer.server import ServerConfig

BLOCK = 16
WORDS = [
    "bees",
    "honey",
    "hive",
    "flower",
    "queen",
    "wax",
    "comb",
    "nectar",
    "pollen",
    "summer",
    "field",
    "garden",
]
needs_smg = pytest.mark.skipif(SMG is None, reason="the smg router is a dev dependency")


def kv_config(
    model_dir: Path,
    cache_dir: Path | None,
    role: str = "both",
    transfer: str | None = None,
    metrics: bool = False,
    engine: dict | None = None,
    **options: object,
) -> ServerConfig:
    """A vLLM-face worker whose prompt blocks are written through to `cache_dir` (None: no
    prompt cache at all: the reference), with `engine`'s settings besides."""
    cache: dict = {"prompt_cache_size": 0}
    if cache_dir is not None:
        cache = {"prompt_cache_dir": str(cache_dir), "prompt_cache_shared": True}
    settings = {"prompt_cache_block": BLOCK, **cache, **(engine or {})}
    kv = KvTransferOptions(role=role, transfer=transfer, **options)  # type: ignore[arg-type]
    return ServerConfig(
        model=ModelSpec(str(model_dir)),
        engine=EngineConfig(**settings),  # type: ignore[arg-type]
        handlers=HandlerOptions(kv=kv),
        port=0,
        protocols=("vllm",),
        metrics_port=0 if metrics else None,
    )


def prompt_text(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def reused_tokens(server: ServerThread) -> tuple[float, float]:
    """The worker's prompt tokens reused from its disk tier, and its prompt cache misses."""
    assert server.server is not None and server.server.metrics_port is not None
    page = httpx.get(f"http://127.0.0.1:{server.server.metrics_port}/metrics", timeout=10).text

    def value(pattern: str) -> float:
        match = re.search(pattern + r" ([0-9.e+]+)", page)
        return float(match.group(1)) if match else 0.0

    reused = value(r'mlx_worker_prompt_cache_tokens_reused_total\{tier="disk"\}')
    return reused, value("mlx_worker_prompt_cache_misses_total")


def completion(router: Router, model: str, prompt: str) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": 10, "temperature": 0}
    response = router.client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def chat(router: Router, model: str, messages: list[dict]) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": 10, "temperature": 0}
    response = router.client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def answers(router: Router, model: str) -> tuple[list[str], int]:
    """Completions of ~40 to ~1,500 tokens alone, then six chats at once: their texts, and
    the prompt tokens they held."""
    texts, prompt_tokens = [], 0
    for seed, words in ((1, 12), (2, 130), (3, 480)):
        reply = completion(router, model, prompt_text(seed, words))
        texts.append(reply["choices"][0]["text"])
        prompt_tokens += reply["usage"]["prompt_tokens"]
    asks = [[{"role": "user", "content": prompt_text(10 + i, 30 + 90 * i)}] for i in range(6)]
    with ThreadPoolExecutor(6) as pool:
        replies = list(pool.map(lambda messages: chat(router, model, messages), asks))
    for reply in replies:
        texts.append(reply["choices"][0]["message"]["content"])
        prompt_tokens += reply["usage"]["prompt_tokens"]
    return texts, prompt_tokens


@pytest.fixture(scope="module")
def reference_answers(demo_dir, tmp_path_factory) -> list[str]:
    """What one worker answers, alone behind the router."""
    tmp = tmp_path_factory.mktemp("reference")
    with ServerThread(kv_config(demo_dir, None)) as single:
        router = Router([single.address], tmp / "smg.log")
        try:
            return answers(router, router.wait_until_serving())[0]
        finally:
            router.close()


@needs_smg
@pytest.mark.parametrize("transfer", ["pull", slow("shared")])
def test_a_pd_pair_answers_as_one_worker_and_the_decode_side_reuses_the_prefill(
    transfer, demo_dir, tmp_path, reference_answers
):
    prefill_dir = tmp_path / "cache"
    decode_dir = tmp_path / ("cache" if transfer == "shared" else "decode-cache")
    prefill = ServerThread(kv_config(demo_dir, prefill_dir, "prefill", transfer))
    decode = ServerThread(kv_config(demo_dir, decode_dir, "decode", transfer, metrics=True))
    with prefill, decode:
        info = pb_grpc.VllmEngineStub(prefill.channel()).GetServerInfo(pb.GetServerInfoRequest())
        connector = {"pull": "NixlConnector", "shared": "SharedStorageConnector"}[transfer]
        assert (info.kv_connector, info.kv_role, info.block_size) == (connector, "kv_both", BLOCK)
        router = Router([prefill.address, decode.address], tmp_path / "smg.log", pd=True)
        try:
            model = router.wait_until_serving()
            reused_before, misses_before = reused_tokens(decode)
            texts, prompt_tokens = answers(router, model)
            reused, misses = reused_tokens(decode)
        finally:
            router.close()
    assert texts == reference_answers
    assert misses == misses_before, "every request found the prefill's blocks"
    assert reused - reused_before >= 0.9 * prompt_tokens


@needs_smg
def test_two_workers_on_one_cache_directory_reuse_each_others_turns(demo_dir, tmp_path):
    """Round robin sends each turn of a conversation to the other worker: from the second on,
    each finds the turns before it, which the other worker kept."""
    cache = tmp_path / "cache"
    with (
        ServerThread(kv_config(demo_dir, cache)) as first,
        ServerThread(kv_config(demo_dir, cache)) as second,
    ):
        router = Router(
            [first.address, second.address], tmp_path / "smg.log", "--policy", "round_robin"
        )
        try:
            model = router.wait_until_serving()
            messages: list[dict] = []
            cached, previous = [], 0
            for turn in range(4):
                messages.append({"role": "user", "content": prompt_text(20 + turn, 60)})
                reply = chat(router, model, messages)
                cached.append((reply["usage"]["prompt_tokens_details"]["cached_tokens"], previous))
                previous = reply["usage"]["prompt_tokens"]
                messages.append(reply["choices"][0]["message"])
                time.sleep(0.3)  # the user reads and types
        finally:
            router.close()
    assert all(hit >= before - BLOCK for hit, before in cached[1:]), cached


# ----- faults: direct calls, the prefill's kv_transfer_params_json in hand -----


def generate(
    channel: grpc.Channel, ids: list[int], max_tokens: int, params: str = ""
) -> pb.GenerateComplete:
    request = pb.GenerateRequest(
        request_id=f"r{time.monotonic_ns()}",
        tokenized=pb.TokenizedInput(input_ids=ids),
        sampling_params=pb.SamplingParams(max_tokens=max_tokens, temperature=0),
        stream=False,
    )
    if params:
        request.kv_transfer_params_json = params
    responses = list(pb_grpc.VllmEngineStub(channel).Generate(request, timeout=60))
    # Before it, a PD worker's empty chunks (it is still at work), streamed or not.
    assert all(not r.chunk.token_ids for r in responses[:-1])
    return responses[-1].complete


FAULT_IDS = [5 + (i * 7) % 400 for i in range(120)]


@pytest.fixture(scope="module")
def fault_reference(demo_dir) -> list[int]:
    with ServerThread(kv_config(demo_dir, None)) as single:
        return list(generate(single.channel(), FAULT_IDS, 8).output_ids)


class FakePeer:
    """A block server that answers as told: `mode` "corrupt" (the real files, a byte
    flipped), "truncated" (half of the first file, then the connection ends) or "silent"
    (never answers)."""

    def __init__(self, files: dict[str, bytes], mode: str) -> None:
        self.files, self.mode = files, mode
        self.port = 0
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._main, daemon=True).start()
        self._ready.wait(10)

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        length = int.from_bytes(await reader.readexactly(8), "little")
        keys = json.loads(await reader.readexactly(length))["keys"]
        if self.mode == "silent":
            await asyncio.sleep(3600)
        for key in keys:
            data = bytearray(self.files.get(key, b""))
            if self.mode == "truncated":
                writer.write(len(data).to_bytes(8, "little") + bytes(data[: len(data) // 2]))
                break
            if data:
                data[len(data) // 2] ^= 0xFF
            writer.write(len(data).to_bytes(8, "little") + bytes(data))
        await writer.drain()
        writer.close()


def prefill_params(demo_dir: Path, tmp_path: Path, **engine: object) -> tuple[dict, dict]:
    """A prefill's kv_transfer_params_json for FAULT_IDS, and its block files by key."""
    with ServerThread(kv_config(demo_dir, tmp_path / "prefill", "prefill", "pull")) as prefill:
        params = json.loads(generate(prefill.channel(), FAULT_IDS, 1).kv_transfer_params_json)
        directory = next((tmp_path / "prefill").iterdir())
        files = {key: (directory / f"{key}.blk").read_bytes() for key in params["keys"]}
    return params, files


@pytest.mark.parametrize(
    "fault", ["dead", "corrupt", slow("truncated"), "slow", slow("mismatched")]
)
def test_a_failed_transfer_is_a_local_prefill_with_the_right_answer(
    fault, demo_dir, tmp_path, fault_reference
):
    params, files = prefill_params(demo_dir, tmp_path)  # the prefill worker is gone now
    if fault in ("corrupt", "truncated", "slow"):
        peer = FakePeer(files, {"slow": "silent"}.get(fault, fault))
        params["port"] = peer.port
    if fault == "mismatched":  # a prefill of another layout (another block size, dtype...)
        params["model"] = "0" * 32
    config = kv_config(
        demo_dir, tmp_path / "decode", "decode", "pull", metrics=True, fetch_timeout_s=1.0
    )
    with ServerThread(config) as decode:
        started = time.monotonic()
        complete = generate(decode.channel(), FAULT_IDS, 8, json.dumps(params))
        elapsed = time.monotonic() - started
        counters = decode.server.servicer.kv.counters  # type: ignore[union-attr]
        reused, _ = reused_tokens(decode)
    assert list(complete.output_ids) == fault_reference
    assert complete.cached_tokens == 0 and reused == 0
    assert counters.failures == 1
    assert elapsed < 30  # bounded by the fetch timeout, not a hang


def test_a_fetched_transfer_is_a_hit_with_the_right_answer(demo_dir, tmp_path, fault_reference):
    """The same path as the faults, whole: the decode worker loads what it fetched."""
    with (
        ServerThread(kv_config(demo_dir, tmp_path / "prefill", "prefill", "pull")) as prefill,
        ServerThread(kv_config(demo_dir, tmp_path / "decode", "decode", "pull")) as decode,
    ):
        params = generate(prefill.channel(), FAULT_IDS, 1).kv_transfer_params_json
        complete = generate(decode.channel(), FAULT_IDS, 8, params)
        counters = decode.server.servicer.kv.counters  # type: ignore[union-attr]
    assert list(complete.output_ids) == fault_reference
    assert complete.cached_tokens == len(FAULT_IDS) - 1
    assert counters.failures == 0 and counters.fetched_blocks == len(json.loads(params)["keys"])


def test_workers_sharing_a_cache_directory_answer_as_a_worker_without_one():
    """A slice of `make fuzz-shared-cache`: three workers on one directory, concurrent
    requests at random, a restart between rounds."""
    from shared_cache_fuzz import fuzz

    result = fuzz("llama", seed=0, rounds=2, per_round=6)
    assert result.hits and not result.differing and not result.errors, result


@needs_smg
@pytest.mark.parametrize(
    ("family", "transfer"),
    [slow("gemma3", "pull"), ("qwen2_vl", "pull"), slow("qwen2_vl", "shared")],
)
def test_a_pd_pair_answers_image_chats_as_one_worker(family, transfer, tmp_path):
    """The prefill's blocks run past the image (keyed by what the image is): the decode side
    reuses them without encoding it. smg sends a family it processes itself (qwen2_vl) to the
    decode side without pixels: the prefill names its images' keys."""
    from test_images import data_url, png
    from vlm_support import chat_through_a_router, routed_image_chat

    from servicer.demos.vision import demo_vlm_path

    model_dir = demo_vlm_path(family=family)
    urls = [data_url(png(seed, (64, 48))) for seed in (3, 4)]
    want = []
    with ServerThread(kv_config(model_dir, None)) as single:
        for i, url in enumerate(urls):
            reply = chat_through_a_router(single, tmp_path / f"ref{i}.log", "What is it?", url)
            want.append(reply.json()["choices"][0]["message"]["content"])
    decode_dir = tmp_path / ("p" if transfer == "shared" else "d")
    prefill = ServerThread(kv_config(model_dir, tmp_path / "p", "prefill", transfer))
    decode = ServerThread(kv_config(model_dir, decode_dir, "decode", transfer, metrics=True))
    with prefill, decode:
        router = Router([prefill.address, decode.address], tmp_path / "smg.log", pd=True)
        try:
            got = [routed_image_chat(router, "What is it?", url).json() for url in urls]
            reused, _ = reused_tokens(decode)
        finally:
            router.close()
    assert [r.get("choices", [{}])[0].get("message", {}).get("content", r) for r in got] == want
    prompt_tokens = sum(reply["usage"]["prompt_tokens"] for reply in got)
    assert reused >= 0.9 * prompt_tokens


@pytest.mark.slow
def test_a_pd_pair_with_an_8_bit_kv_cache_answers_as_one_such_worker(demo_dir, tmp_path):
    kv8 = {"kv_bits": 8}
    with ServerThread(kv_config(demo_dir, None, engine=kv8)) as single:
        want = list(generate(single.channel(), FAULT_IDS, 8).output_ids)
    with (
        ServerThread(kv_config(demo_dir, tmp_path / "p", "prefill", "pull", engine=kv8)) as p,
        ServerThread(kv_config(demo_dir, tmp_path / "d", "decode", "pull", engine=kv8)) as d,
    ):
        info = pb_grpc.VllmEngineStub(p.channel()).GetServerInfo(pb.GetServerInfoRequest())
        params = generate(p.channel(), FAULT_IDS, 1).kv_transfer_params_json
        complete = generate(d.channel(), FAULT_IDS, 8, params)
    assert info.kv_cache_dtype == "int8"
    assert list(complete.output_ids) == want
    assert complete.cached_tokens == len(FAULT_IDS) - 1


@needs_smg
@pytest.mark.slow
@pytest.mark.parametrize("slow_role", ["prefill"])
def test_a_leg_longer_than_the_routers_patience_is_served(slow_role, demo_dir, tmp_path):
    """smg 1.13 fails a PD leg that sends nothing for 3 s after its dispatch: a PD worker says
    it is still at work every second until its first token (an empty chunk), so a slow
    prefill, or a decode worker whose steps are slow, is served, not a 504."""
    from servicer.faults import FaultPlan

    delay_ms = {"prefill": 1500, "decode": 3500}[slow_role]  # the decode leg: one step
    slow_steps = {"faults": FaultPlan.parse(f"slow:{delay_ms}"), "prefill_step_size": 32}
    slow_steps["warmup"] = False

    def config(role: str) -> ServerConfig:
        engine = slow_steps if role == slow_role else None
        return kv_config(demo_dir, tmp_path / role, role, "pull", engine=engine)

    with ServerThread(config("prefill")) as prefill, ServerThread(config("decode")) as decode:
        router = Router([prefill.address, decode.address], tmp_path / "smg.log", pd=True)
        try:
            model = router.wait_until_serving(timeout=180)
            started = time.monotonic()
            reply = completion(router, model, prompt_text(7, 40))
            elapsed = time.monotonic() - started
        finally:
            router.close()
    assert elapsed > 4 and reply["choices"][0]["text"]


def test_a_transfer_between_workers_with_tls_speaks_tls(demo_dir, tmp_path, fault_reference):
    """Workers whose gRPC port has TLS serve and fetch blocks over TLS too (a pair sharing
    one certificate); a plain connection to that block server gets nothing."""
    from dataclasses import replace

    from test_operations import _self_signed

    cert, key = _self_signed(tmp_path)

    def tls_config(directory: str, role: str) -> ServerConfig:
        config = kv_config(demo_dir, tmp_path / directory, role, "pull")
        return replace(config, tls_cert=cert, tls_key=key)

    credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
    options = [("grpc.ssl_target_name_override", "localhost")]
    with (
        ServerThread(tls_config("p", "prefill")) as prefill,
        ServerThread(tls_config("d", "decode")) as decode,
        grpc.secure_channel(prefill.address, credentials, options) as to_prefill,
        grpc.secure_channel(decode.address, credentials, options) as to_decode,
    ):
        params = generate(to_prefill, FAULT_IDS, 1).kv_transfer_params_json
        named = json.loads(params)
        with pytest.raises((OSError, EOFError)):  # a plain connection: no blocks
            asyncio.run(fetch_blocks("127.0.0.1", named["port"], "", named["keys"][:1], 5.0))
        complete = generate(to_decode, FAULT_IDS, 8, params)
    assert named["tls"] is True
    assert list(complete.output_ids) == fault_reference
    assert complete.cached_tokens == len(FAULT_IDS) - 1


def test_a_peers_block_names_are_taken_only_as_blocks_of_this_prompt(tmp_path):
    from servicer.engine.prefix.keys import ROOT, block_key, block_keys
    from servicer.kv_transfer import SharedBlocks

    blocks = SharedBlocks(tmp_path / "model", BLOCK)
    prompt = list(range(3, 3 + 2 * BLOCK + 5))
    keys = block_keys(prompt, BLOCK)
    tail = block_key(keys[1], prompt[2 * BLOCK : 2 * BLOCK + 4])
    chain = blocks.chain(prompt, keys, [*keys, tail])
    assert chain is not None and [c[0] for c in chain] == [*keys, tail]
    assert chain[2] == (tail, keys[1], tuple(prompt[2 * BLOCK : 2 * BLOCK + 4]))
    assert blocks.chain(prompt, keys, list(keys[:1])) is not None
    other = block_key(ROOT, tuple(range(100, 100 + BLOCK)))
    assert blocks.chain(prompt, keys, [other]) is None  # another prompt's
    assert blocks.chain(prompt, keys, [keys[1]]) is None  # out of order
    first_partial = block_key(ROOT, tuple(prompt[:4]))
    assert blocks.chain(prompt, keys, [first_partial, keys[1]]) is None  # a partial not last


def test_a_mismatched_pd_pair_on_one_directory_is_refused_at_start(demo_dir, tmp_path):
    """Another block size (or KV quantization, or other files) lays the KV out otherwise: the
    decode worker refuses to start beside such a prefill worker, and says why."""
    from servicer.messages import EngineStartupError

    cache = tmp_path / "cache"
    with ServerThread(kv_config(demo_dir, cache, "prefill", "shared")):
        config = kv_config(demo_dir, cache, "decode", "shared", engine={"prompt_cache_block": 32})
        decode = ServerThread(config)
        try:
            with pytest.raises(EngineStartupError, match=r"mismatched PD pair.*block size 16"):
                decode.start()
        finally:
            decode.stop()
