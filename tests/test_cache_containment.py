"""A fault in the prompt cache or in planning fails one request or makes it a miss; the engine
and every other request go on."""

from __future__ import annotations

import random
import threading
from dataclasses import replace

import grpc
import pytest
from conftest import Reference, demo_config
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support import ServerThread, WorkerProcess, generate, wait_until
from test_prefix_store import text_tokens

from servicer.demos.text import demo_model_path
from servicer.engine.prefix import disk_link
from servicer.faults import ENV_VAR, FaultPlan

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
        stats = running.server.prefix_stats()
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


def _with_faults(config, spec: str):
    return replace(config, engine=replace(config.engine, faults=FaultPlan.parse(spec)))


def _text(reference: Reference, count: int, salt: int) -> list[int]:
    return text_tokens(reference, count, salt=salt)


@pytest.mark.parametrize(
    ("fault", "fails"), [("fetch:2", False), ("build:1", False), ("plan:2", True)]
)
def test_a_planning_fault_serves_one_request_cold_or_fails_it_alone(
    fault, fails, demo_dir, reference
):
    base = _text(reference, 600, salt=40)
    prompts = [base + _text(reference, 20, salt=41 + i) for i in range(3)]
    config = _with_faults(demo_config(demo_dir, prompt_cache_block=64), fault)
    with ServerThread(config) as running, running.channel() as chan:
        first = generate(chan, prompts[0], temperature=0, max_tokens=N, ignore_eos=True)
        faulty = generate(chan, prompts[1], temperature=0, max_tokens=N, ignore_eos=True)
        after = generate(chan, prompts[2], temperature=0, max_tokens=N, ignore_eos=True)
        assert _serving(chan)
        stats = running.server.prefix_stats()
    assert first.tokens == reference.greedy(prompts[0], N)
    if fails:
        assert faulty.code == grpc.StatusCode.INTERNAL
        assert "injected plan fault" in faulty.error.details()
    else:
        assert faulty.error is None and faulty.complete.cached_tokens == 0  # served cold
        assert faulty.tokens == reference.greedy(prompts[1], N)
        assert stats.faults >= 1
    assert after.error is None and after.complete.cached_tokens >= 512
    assert after.tokens == reference.greedy(prompts[2], N)


def test_a_fault_taking_in_a_block_from_disk_is_a_miss(demo_dir, reference, tmp_path, monkeypatch):
    """A block that cannot be taken in drops the blocks under it from the index: the request
    waiting for them goes on at once (cold past the fault), not after the load timeout."""
    monkeypatch.setattr(disk_link, "LOAD_TIMEOUT_S", 3600.0)  # the engine thread is ours
    prompts = [_text(reference, 600, salt=50 + i) for i in range(4)]
    config = demo_config(
        demo_dir,
        prompt_cache_block=64,
        prompt_cache_dir=str(tmp_path),
        prompt_cache_bytes=700_000,  # about one prompt: the others go to disk
    )
    config = replace(_with_faults(config, "collect:1"), engine_mode="thread")
    with ServerThread(config) as running, running.channel() as chan:
        for prompt in prompts[1:]:
            generate(chan, prompt, temperature=0, max_tokens=2, ignore_eos=True)
        assert wait_until(lambda: running.server.prefix_stats().disk_blocks > 0, 30)
        again = [
            generate(chan, p, temperature=0, max_tokens=N, ignore_eos=True, timeout=60)
            for p in prompts[1:3]
        ]
        assert _serving(chan)
        stats = running.server.prefix_stats()
    assert [o.tokens for o in again] == [reference.greedy(p, N) for p in prompts[1:3]]
    assert stats.disk_faults >= 1
    assert again[1].complete.cached_tokens >= 512  # the tier goes on serving


def test_a_failing_reader_thread_ends_every_stream_and_the_worker(demo_dir, prompts):
    with WorkerProcess("--model", str(demo_dir), env={ENV_VAR: "reader:6"}) as worker:
        worker.wait_ready()
        outcomes: list = []
        with grpc.insecure_channel(worker.address) as chan:
            callers = [
                threading.Thread(
                    target=lambda i=i: outcomes.append(
                        generate(chan, prompts[i], max_tokens=500, ignore_eos=True, timeout=30)
                    )
                )
                for i in range(4)
            ]
            for caller in callers:
                caller.start()
            for caller in callers:
                caller.join(60)
        assert worker.wait(60) == 1
    assert [o.code for o in outcomes] == [grpc.StatusCode.UNAVAILABLE] * 4
    assert all("reading the engine process's output failed" in o.error.details() for o in outcomes)


def test_a_block_file_of_another_mlx_lm_version_is_a_miss(
    demo_dir, reference, tmp_path, monkeypatch
):
    import mlx_lm

    prompt = _text(reference, 600, salt=60)
    config = replace(
        demo_config(demo_dir, prompt_cache_block=64, prompt_cache_dir=str(tmp_path)),
        engine_mode="thread",  # the version below is read in this process
    )
    monkeypatch.setattr(mlx_lm, "__version__", "0.0.1-another")
    with ServerThread(config) as first, first.channel() as chan:
        generate(chan, prompt, temperature=0, max_tokens=2, ignore_eos=True)
    assert list(tmp_path.rglob("*.blk"))  # written at shutdown
    monkeypatch.undo()
    with ServerThread(config) as second, second.channel() as chan:
        assert second.server.prefix_stats().disk_blocks == 0
        again = generate(chan, prompt, temperature=0, max_tokens=N, ignore_eos=True)
    assert again.complete.cached_tokens == 0
    assert again.tokens == reference.greedy(prompt, N)


def test_a_failed_step_with_reused_blocks_leaks_no_pin_or_reservation(demo_dir, reference):
    """A step fails while a request that reused cached blocks is in it: it fails with the
    step, its blocks are unpinned and its memory is released, so the next ones run."""
    base = _text(reference, 600, salt=70)
    prompts = [base + _text(reference, 20, salt=71 + i) for i in range(4)]
    config = demo_config(
        demo_dir, prompt_cache_block=64, max_kv_memory=1_500_000, prompt_cache_bytes=2_000_000
    )
    with ServerThread(_with_faults(config, "step:6")) as running, running.channel() as chan:
        first = generate(chan, prompts[0], temperature=0, max_tokens=2, ignore_eos=True)
        failed = generate(chan, prompts[1], temperature=0, max_tokens=N, ignore_eos=True)
        after = [
            generate(chan, p, temperature=0, max_tokens=N, ignore_eos=True) for p in prompts[2:]
        ]
        stats = running.server.prefix_stats()
        assert _serving(chan)
    assert first.error is None
    assert failed.code == grpc.StatusCode.INTERNAL
    assert [o.tokens for o in after] == [reference.greedy(p, N) for p in prompts[2:]]
    assert all(o.complete.cached_tokens >= 512 for o in after)
    assert stats.pinned_blocks == 0
