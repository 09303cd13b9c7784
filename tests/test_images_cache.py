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
from support import ServerThread, slow
from test_images import chat_ids, complete, data_url, expanded, image_request, needs_vlm, png

from servicer.proto import vllm_engine_pb2_grpc as vgrpc
from servicer.vision_families import SERVED_FAMILIES

pytestmark = needs_vlm
FAST_FUZZ = {("gemma3", 0), ("qwen2_vl", 0)}

QUESTIONS = (
    "What do bees make?",
    "Describe a quiet place.",
    "Tell me about the sea and the sky.",
    "Hello there.",
)


@pytest.fixture(scope="module")
def vlm_dir():
    from servicer.demos.vision import demo_vlm_path

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


# Every served family, three seeds each (`make fuzz-images`); a fast slice in `make test`.
FUZZ_CASES = [
    (family, seed) if (family, seed) in FAST_FUZZ else slow(family, seed)
    for family in SERVED_FAMILIES
    for seed in range(3)
]


@pytest.mark.parametrize(("family", "seed"), FUZZ_CASES)
def test_image_and_text_requests_answer_as_without_any_cache(family, seed):
    from servicer.demos.vision import demo_vlm_path

    vlm_dir = demo_vlm_path(family=family)
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


def _answers(stub, jobs) -> list[list[int] | None]:
    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(functools.partial(_run, stub), jobs))


def _engine_rss_mib() -> float:
    """Resident memory of this process's children: the engine processes of its workers."""
    import psutil

    children = psutil.Process().children(recursive=True)
    return sum(child.memory_info().rss for child in children) / 2**20


RSS_BOUND_MIB = 64  # growth allowed after the first round (the caches full by then)


def test_a_restart_on_the_disk_tier_answers_as_without_any_cache_in_bounded_memory(
    vlm_dir, tmp_path
):
    """Half the fuzz's requests, a restart on the same disk tier, the other half: every answer
    a cache-off worker's. Then rounds of new images through small caches: the engine's
    resident memory stays within RSS_BOUND_MIB of the first round's."""
    jobs = _fuzz_jobs(vlm_dir, 3, 24)
    with _worker(vlm_dir, prompt_cache_size=0) as running, running.channel() as channel:
        cold = _answers(vgrpc.VllmEngineStub(channel), jobs)
    cached = {
        "prompt_cache_block": 4,
        "prompt_cache_dir": str(tmp_path),
        "prompt_cache_size": 512,
        "encoder_cache_bytes": 1 << 16,
    }
    got = []
    for half in (jobs[:12], jobs[12:]):
        with _worker(vlm_dir, **cached) as running, running.channel() as channel:
            got += _answers(vgrpc.VllmEngineStub(channel), half)
    for job, a, b in zip(jobs, got, cold, strict=True):
        if not job[2]:
            assert a == b, job
    with _worker(vlm_dir, **cached) as running, running.channel() as channel:
        stub = vgrpc.VllmEngineStub(channel)
        rss = []
        for round_ in range(4):
            prompt = chat_ids(vlm_dir, QUESTIONS[round_ % 4])
            fresh = [(prompt, [data_url(png(300 + 10 * round_ + i))], False) for i in range(10)]
            assert all(_answers(stub, fresh))
            rss.append(_engine_rss_mib())
    assert rss[-1] - rss[0] < RSS_BOUND_MIB, rss
