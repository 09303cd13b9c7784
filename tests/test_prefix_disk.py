"""The prefix store's disk tier: blocks survive a restart; every fault is a miss, a metric and
a log line, never a crash, a hang or wrong output; one worker owns a directory."""

from __future__ import annotations

import logging
import os
import random
import signal
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from conftest import Reference, demo_config
from support import ServerThread, WorkerProcess, generate, make_request, slow, wait_until
from test_prefix_store import BLOCK, store_config, text_tokens

from servicer.demos.text import demo_model_path
from servicer.engine import EngineStartupError
from servicer.faults import FaultPlan
from servicer.proto import mlx_engine_pb2_grpc as pb_grpc

N = 12


def disk_config(model_dir: Path, directory: Path, faults: str | None = None, **engine):
    config = store_config(model_dir, prompt_cache_dir=str(directory), **engine)
    if faults is not None:
        config = replace(config, engine=replace(config.engine, faults=FaultPlan.parse(faults)))
    return config


def _run(running: ServerThread, prompt: list[int], max_tokens: int = N):
    with running.channel() as chan:
        outcome = generate(chan, prompt, temperature=0, max_tokens=max_tokens, ignore_eos=True)
    assert outcome.error is None, outcome.error
    return outcome


def _stats(running: ServerThread):
    return running.server.prefix_stats()


def _block_files(directory: Path) -> list[Path]:
    return sorted(directory.rglob("*.blk"))


@pytest.mark.parametrize("kind", ["llama", "hybrid"])
def test_a_restart_on_the_same_directory_serves_earlier_prefixes_from_disk(kind, tmp_path):
    model_dir = demo_model_path(kind)
    reference = Reference(model_dir)
    prompt = text_tokens(reference, 1500, salt=11)
    with ServerThread(disk_config(model_dir, tmp_path)) as first:
        cold = _run(first, prompt)
    assert cold.complete.cached_tokens == 0
    assert _block_files(tmp_path)  # written at shutdown
    with ServerThread(disk_config(model_dir, tmp_path)) as second:
        assert _stats(second).disk_blocks >= 5
        again = _run(second, prompt)
        stats = _stats(second)
    assert again.complete.cached_tokens >= 1280
    assert stats.disk_hits == 1 and stats.disk_tokens >= 1280
    assert again.tokens == cold.tokens == reference.greedy(prompt, N)


def test_blocks_evicted_from_ram_come_back_from_disk(demo_dir, reference, tmp_path):
    # RAM holds about two 1500-token prompts' blocks; the third pushes the first to disk.
    config = disk_config(demo_dir, tmp_path, prompt_cache_bytes=3_500_000)
    prompts = [text_tokens(reference, 1500, salt=s) for s in (12, 13, 14)]
    with ServerThread(config) as running:
        for prompt in prompts:
            _run(running, prompt)
        assert wait_until(lambda: _stats(running).disk_blocks >= 4, timeout=30)
        again = _run(running, prompts[0] + text_tokens(reference, 10, salt=15))
        stats = _stats(running)
    assert stats.evictions >= 4
    assert again.complete.cached_tokens >= 1280
    assert stats.disk_hits >= 1
    assert again.tokens == reference.greedy(prompts[0] + text_tokens(reference, 10, salt=15), N)


def _damage(files: list[Path], how: str) -> None:
    for path in files:
        data = path.read_bytes()
        if how == "truncated":
            path.write_bytes(data[: len(data) // 2])
        elif how == "corrupted":
            flipped = bytearray(data)
            flipped[len(flipped) // 2] ^= 0xFF
            path.write_bytes(bytes(flipped))


# make test: a truncated file; a flipped byte (checksum) and another model's files are slow.
@pytest.mark.parametrize("how", ["truncated", slow("corrupted"), slow("foreign")])
def test_a_damaged_or_foreign_file_is_a_miss_never_wrong_output(
    how, demo_dir, reference, tmp_path, caplog
):
    prompt = text_tokens(reference, 1500, salt=16)
    with ServerThread(disk_config(demo_dir, tmp_path)) as first:
        _run(first, prompt)
    files = _block_files(tmp_path)
    assert files
    if how == "foreign":  # another model's files, renamed into this model's directory
        other = Reference(demo_model_path("gemma3"))
        other_prompt = text_tokens(other, 1500, salt=16)
        elsewhere = tmp_path / "other"
        with ServerThread(disk_config(demo_model_path("gemma3"), elsewhere)) as running:
            _run(running, other_prompt)
        for ours, theirs in zip(files, _block_files(elsewhere), strict=False):
            ours.write_bytes(theirs.read_bytes())
    else:
        _damage(files, how)
    caplog.set_level(logging.WARNING, logger="servicer.engine")
    with ServerThread(disk_config(demo_dir, tmp_path)) as second:
        again = _run(second, prompt)
        stats = _stats(second)
    assert again.tokens == reference.greedy(prompt, N)
    assert again.complete.cached_tokens < 256  # nothing usable survived
    assert stats.disk_faults >= 1
    assert any("prompt cache" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("fault", ["diskfull", slow("diskro")])
def test_a_full_or_read_only_disk_is_a_miss_and_serving_goes_on(
    fault, demo_dir, reference, tmp_path, caplog
):
    caplog.set_level(logging.WARNING, logger="servicer.engine")
    config = disk_config(demo_dir, tmp_path, faults=fault, prompt_cache_bytes=1_000_000)
    prompts = [text_tokens(reference, 1200, salt=s) for s in (17, 18, 19)]
    with ServerThread(config) as running:
        outcomes = [_run(running, p) for p in prompts]
        stats = _stats(running)
    assert [o.tokens for o in outcomes] == [reference.greedy(p, N) for p in prompts]
    assert stats.disk_faults >= 1 and stats.disk_blocks == 0
    assert not _block_files(tmp_path)
    assert any("prompt cache" in r.getMessage() for r in caplog.records)


def test_a_directory_that_cannot_exist_is_a_miss(demo_dir, reference, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    prompt = text_tokens(reference, 600, salt=20)
    with ServerThread(disk_config(demo_dir, blocker / "cache")) as running:
        outcome = _run(running, prompt)
        stats = _stats(running)
    assert outcome.tokens == reference.greedy(prompt, N)
    assert stats.disk_faults >= 1


def test_a_second_worker_on_the_same_directory_is_refused(demo_dir, tmp_path):
    with ServerThread(disk_config(demo_dir, tmp_path)):
        second = ServerThread(disk_config(demo_dir, tmp_path), wait_ready=False).start()
        with pytest.raises(EngineStartupError, match="in use by another worker"):
            second.run(second.server.wait_ready(120))
        second.stop()


def test_a_worker_killed_while_writing_leaves_nothing_the_next_start_trips_on(
    demo_dir, reference, tmp_path
):
    args = (
        "--model",
        str(demo_dir),
        "--prompt-cache-dir",
        str(tmp_path),
        "--prompt-cache-block",
        str(BLOCK),
        "--prompt-cache-bytes",
        "1000000",
    )
    prompts = [text_tokens(reference, 1000, salt=s) for s in range(21, 29)]
    with WorkerProcess(*args) as worker:
        worker.wait_ready()
        with grpc.insecure_channel(worker.address) as chan:
            for prompt in prompts[:6]:
                generate(chan, prompt, temperature=0, max_tokens=2, ignore_eos=True)
        os.kill(worker.proc.pid, signal.SIGKILL)  # writes may be half done
        worker.wait(30)
    model_dirs = [p for p in tmp_path.iterdir() if p.is_dir()]
    (model_dir,) = model_dirs
    (model_dir / f".{'ab' * 16}.blk.1234.tmp").write_bytes(b"MLXPBLK1 half a write")
    (model_dir / f"{'cd' * 16}.blk").write_bytes(b"MLXPBLK1")  # torn
    with WorkerProcess(*args) as worker:
        worker.wait_ready()
        assert "prompt cache on disk:" in worker.output
        with grpc.insecure_channel(worker.address) as chan:
            outcome = generate(chan, prompts[0], temperature=0, max_tokens=N, ignore_eos=True)
        worker.terminate()
        assert worker.wait(60) == 0
    assert outcome.tokens == reference.greedy(prompts[0], N)
    assert not list(model_dir.glob("*.tmp"))


def test_concurrent_ram_hits_disk_hits_misses_and_cancels_on_the_hybrid_model(tmp_path):
    model_dir = demo_model_path("hybrid")
    reference = Reference(model_dir)
    bases = [text_tokens(reference, 700, salt=30 + i) for i in range(6)]
    config = disk_config(model_dir, tmp_path, prompt_cache_bytes=2_000_000)
    rng = random.Random(5)
    with ServerThread(config) as running:
        for base in bases:  # the early ones end up on disk, the late ones in RAM
            _run(running, base, max_tokens=2)
        assert wait_until(lambda: _stats(running).disk_blocks > 0, timeout=30)
        jobs = []
        for i in range(36):
            base = bases[i % len(bases)] if i % 4 else text_tokens(reference, 300, salt=50 + i)
            prompt = base + text_tokens(reference, rng.randrange(5, 40), salt=60 + i)
            cancel = rng.randrange(2, N) if i % 7 == 0 else None
            jobs.append((prompt, cancel))
        stub = pb_grpc.MlxEngineStub(running.channel())

        def run(job):
            prompt, cancel = job
            request = make_request(prompt, temperature=0, max_tokens=N, ignore_eos=True)
            call = stub.Generate(request, timeout=300)
            tokens: list[int] = []
            try:
                for response in call:
                    if response.HasField("chunk"):
                        tokens.extend(response.chunk.token_ids)
                        if cancel is not None and len(tokens) >= cancel:
                            call.cancel()
                            break
            except grpc.RpcError as error:
                assert error.code() == grpc.StatusCode.CANCELLED
            return prompt, tokens, cancel

        with ThreadPoolExecutor(len(jobs)) as pool:
            results = list(pool.map(run, jobs))
        stats = _stats(running)
    for prompt, tokens, cancel in results:
        expected = reference.greedy(prompt, N)
        assert tokens == expected[: len(tokens)]
        if cancel is None:
            assert len(tokens) == N
    assert stats.ram_hits >= 1 and stats.disk_hits >= 1 and stats.misses >= 1


def test_blocks_loaded_for_a_waiting_request_stay_until_it_joins(demo_dir, reference, tmp_path):
    # RAM holds about half of the prompt's blocks; the rest come back from disk for the second
    # run and must not be evicted again before it uses them.
    prompt = text_tokens(reference, 600, salt=70)
    config = replace(
        demo_config(
            demo_dir,
            prompt_cache_block=64,
            prompt_cache_dir=str(tmp_path),
            prompt_cache_bytes=300_000,
        ),
        engine_mode="thread",
    )
    with ServerThread(config) as running:
        _run(running, prompt)
        assert wait_until(lambda: _stats(running).disk_blocks >= 4, timeout=30)
        again = _run(running, prompt)
        stats = _stats(running)
    assert again.complete.cached_tokens >= 576
    assert stats.disk_hits == 1
    assert again.tokens == reference.greedy(prompt, N)
