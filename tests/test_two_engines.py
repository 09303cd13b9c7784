"""Two engines (two models, two ports) in one process, on one event loop, at the same time."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from conftest import Reference, demo_config
from support import make_request

from servicer.demos.common import default_cache_dir
from servicer.demos.text import DEMO_MODEL_KIND, build_model, build_name
from servicer.proto import mlx_engine_pb2_grpc as pb_grpc
from servicer.server import WorkerServer

N = 24


@pytest.fixture(scope="module")
def second_dir():
    """Same recipe, another seed: a different model."""
    return build_model(default_cache_dir() / build_name(DEMO_MODEL_KIND, 1), seed=1)


async def _generate(stub, prompt: list[int], stream: bool) -> list[int]:
    request = make_request(prompt, stream=stream, temperature=0, max_tokens=N, ignore_eos=True)
    tokens: list[int] = []
    async for response in stub.Generate(request, timeout=120):
        if response.HasField("chunk"):
            tokens.extend(response.chunk.token_ids)
        else:
            tokens.extend(response.complete.output_ids)
    return tokens


async def _serve_both(first_dir, second_dir, prompts) -> tuple[list, list]:
    servers = [WorkerServer(demo_config(d)) for d in (first_dir, second_dir)]
    ports = [await s.start() for s in servers]
    await asyncio.gather(*(s.wait_ready(120) for s in servers))
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}") for port in ports]
    try:
        stubs = [pb_grpc.MlxEngineStub(c) for c in channels]
        calls = [
            _generate(stub, prompt, stream=i % 2 == 0)
            for stub in stubs
            for i, prompt in enumerate(prompts)
        ]
        results = await asyncio.gather(*calls)
    finally:
        for channel in channels:
            await channel.close()
        for server in servers:
            await server.stop()
    return results[: len(prompts)], results[len(prompts) :]


def test_two_engines_serve_concurrently_and_each_matches_its_own_model(
    demo_dir, second_dir, reference, prompts
):
    second = Reference(second_dir)
    first_out, second_out = asyncio.run(_serve_both(demo_dir, second_dir, prompts))
    assert first_out == [reference.greedy(p, N) for p in prompts]
    assert second_out == [second.greedy(p, N) for p in prompts]
    assert first_out != second_out  # really two models
