"""Image prefixes and the caches: the disk tier keeps them across a restart, and a differential
fuzz (image and text requests at random, repeated images, concurrency, cancellations) answers
exactly as a worker without any prompt cache."""

from __future__ import annotations

import dataclasses
import functools
import random
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from conftest import demo_config
from support import ServerThread
from test_images import chat_ids, complete, data_url, expanded, image_request, needs_vlm, png

from servicer.proto import vllm_engine_pb2_grpc as vgrpc

pytestmark = needs_vlm

QUESTIONS = (
    "What do bees make?",
    "Describe a quiet place.",
    "Tell me about the sea and the sky.",
    "Hello there.",
)


@pytest.fixture(scope="module")
def vlm_dir():
    from servicer.demo_vlm import demo_vlm_path

    return demo_vlm_path(family="gemma3")


def _worker(vlm_dir, **engine) -> ServerThread:
    config = demo_config(vlm_dir, **engine)
    return ServerThread(dataclasses.replace(config, protocols=("vllm",)))


def test_the_disk_tier_keeps_image_prefixes_across_a_restart(vlm_dir, tmp_path):
    prompt = chat_ids(vlm_dir, QUESTIONS[2])
    image_at = expanded(vlm_dir, prompt).index(514)
    first, second = data_url(png(60)), data_url(png(61))
    settings = {"prompt_cache_block": 4, "prompt_cache_dir": str(tmp_path)}
    with _worker(vlm_dir, **settings) as running, running.channel() as channel:
        cold = complete(vgrpc.VllmEngineStub(channel), image_request(prompt, [first]))
    with _worker(vlm_dir, **settings) as running, running.channel() as channel:
        stub = vgrpc.VllmEngineStub(channel)
        again = complete(stub, image_request(prompt, [first]))
        other = complete(stub, image_request(prompt, [second]))
    assert again.cached_tokens > image_at + 4
    assert list(again.output_ids) == list(cold.output_ids)
    assert other.cached_tokens <= image_at


def _fuzz_jobs(vlm_dir, seed: int, count: int) -> list[tuple[list[int], list[str], bool]]:
    """(prompt, image urls, cancel early) at random: 0-2 images from a pool of four."""
    rng = random.Random(seed)
    pool = [data_url(png(70 + i)) for i in range(4)]
    jobs = []
    for _ in range(count):
        images = rng.choice((0, 1, 1, 2))
        prompt = chat_ids(vlm_dir, rng.choice(QUESTIONS), images=images)
        jobs.append((prompt, [rng.choice(pool) for _ in range(images)], rng.random() < 0.15))
    return jobs


def _run(stub, job) -> list[int] | None:
    prompt, urls, cancel = job
    message = image_request(prompt, urls, max_tokens=10)
    if cancel:
        message.stream = True
        calls = stub.Generate(message, timeout=120)
        next(calls)
        calls.cancel()
        return None
    return list(complete(stub, message).output_ids)


@pytest.mark.parametrize("seed", [0, 1])
def test_image_and_text_requests_answer_as_without_any_cache(vlm_dir, seed):
    jobs = _fuzz_jobs(vlm_dir, seed, 24)
    answers = {}
    for name, engine in (("cached", {"prompt_cache_block": 4}), ("cold", {"prompt_cache_size": 0})):
        with _worker(vlm_dir, **engine) as running, running.channel() as channel:
            stub = vgrpc.VllmEngineStub(channel)
            with ThreadPoolExecutor(4) as pool:
                try:
                    answers[name] = list(pool.map(functools.partial(_run, stub), jobs))
                except grpc.RpcError as error:
                    pytest.fail(f"{name}: {error.code()} {error.details()}")
    for job, cached, cold in zip(jobs, answers["cached"], answers["cold"], strict=True):
        if not job[2]:
            assert cached == cold, job
