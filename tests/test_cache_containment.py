"""A fault in the prompt cache or in planning fails one request or makes it a miss; the engine
and every other request go on."""

from __future__ import annotations

import random
from dataclasses import replace

import grpc
from conftest import Reference, demo_config
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support import ServerThread, generate

from servicer.demo_model import demo_model_path

N = 8


def _hybrid_small_blocks(directory, **engine):
    """The issue's flags: the hybrid demo, a disk tier, 64-token blocks, snapshots every 128."""
    return demo_config(
        demo_model_path("hybrid"),
        prompt_cache_dir=str(directory),
        prompt_cache_bytes=200 * 1024,
        prompt_cache_block=64,
        prompt_cache_snapshot_interval=128,
        **engine,
    )


def _serving(chan: grpc.Channel) -> bool:
    stub = health_pb2_grpc.HealthStub(chan)
    status = stub.Check(health_pb2.HealthCheckRequest(), timeout=10).status
    return status == health_pb2.HealthCheckResponse.SERVING


def test_a_snapshot_kept_after_its_block_went_to_disk_is_served_exactly(tmp_path):
    """A block first kept without a snapshot, evicted to disk, then kept again with one: the
    disk copy lacks the snapshot, so it is rewritten (or the match is a miss), never trusted."""
    reference = Reference(demo_model_path("hybrid"))
    rng = random.Random(22)

    def tokens(count: int) -> list[int]:
        return [rng.randrange(10, 500) for _ in range(count)]

    a = tokens(200)
    sequence = [a, tokens(300), tokens(300), tokens(300), a[:192] + tokens(40)]
    sequence += [tokens(300), tokens(300), tokens(300), a[:192] + tokens(40)]
    with ServerThread(_hybrid_small_blocks(tmp_path)) as running, running.channel() as chan:
        for prompt in sequence:
            outcome = generate(chan, prompt, temperature=0, max_tokens=N, ignore_eos=True)
            assert outcome.error is None, outcome.error.details()
            assert outcome.tokens == reference.greedy(prompt, N)
        assert _serving(chan)
        stats = running.server.engine.prefix_stats()
    assert stats.disk_hits + stats.ram_hits >= 1


def test_flags_of_the_issue_in_thread_mode_too(tmp_path):
    reference = Reference(demo_model_path("hybrid"))
    rng = random.Random(23)
    a = [rng.randrange(10, 500) for _ in range(200)]
    others = [[rng.randrange(10, 500) for _ in range(300)] for _ in range(6)]
    config = replace(_hybrid_small_blocks(tmp_path), engine_mode="thread")
    sequence = [a, *others[:3], a[:192] + others[3][:40], *others[3:], a[:192] + others[0][:40]]
    with ServerThread(config) as running, running.channel() as chan:
        for prompt in sequence:
            outcome = generate(chan, prompt, temperature=0, max_tokens=N, ignore_eos=True)
            assert outcome.error is None, outcome.error.details()
            assert outcome.tokens == reference.greedy(prompt, N)
        assert _serving(chan)
