"""The engine in its own process: killing either process leaves no hang and no orphan."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support import BackgroundGenerate, WorkerProcess, wait_until

ENGINE_PID = re.compile(r"engine process (\d+) started")


def _engine_pid(worker: WorkerProcess) -> int:
    match = ENGINE_PID.search(worker.output)
    assert match, worker.output
    return int(match.group(1))


def _gone(pid: int) -> bool:
    """No such process, or only its zombie (nothing reaps orphans in some containers)."""
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    return "State:\tZ" in state


def _serving(address: str) -> bool | None:
    """True or False from the standard health service; None when nothing answers."""
    try:
        with grpc.insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            status = stub.Check(health_pb2.HealthCheckRequest(), timeout=0.5).status
    except grpc.RpcError:
        return None
    return status == health_pb2.HealthCheckResponse.SERVING


def test_a_killed_engine_process_ends_streams_with_a_status_and_the_server_exits_1(
    demo_dir, prompts
):
    with WorkerProcess("--model", str(demo_dir)) as worker:
        worker.wait_ready()
        engine = _engine_pid(worker)
        with grpc.insecure_channel(worker.address) as channel:
            calls = [
                BackgroundGenerate(channel, prompts[i], max_tokens=3000, ignore_eos=True)
                for i in range(3)
            ]
            assert all(call.started.wait(60) for call in calls)
            # A health check beside three streams may miss its 0.5 s on a loaded machine.
            assert wait_until(lambda: _serving(worker.address) is True, timeout=30)
            os.kill(engine, signal.SIGKILL)
            # How soon is the bench's business (about 15 ms here); this says only that it is.
            assert wait_until(lambda: _serving(worker.address) is not True, timeout=30)
            for call in calls:
                call.join(60)
        assert worker.wait(60) == 1
    for call in calls:
        assert call.outcome.code == grpc.StatusCode.UNAVAILABLE
        assert "engine process exited" in call.outcome.error.details()


def test_no_engine_process_outlives_a_killed_server(demo_dir, prompts):
    with WorkerProcess("--model", str(demo_dir)) as worker:
        worker.wait_ready()
        engine = _engine_pid(worker)
        with grpc.insecure_channel(worker.address) as channel:
            call = BackgroundGenerate(channel, prompts[0], max_tokens=3000, ignore_eos=True)
            assert call.started.wait(60)
            worker.proc.kill()
            worker.proc.wait(10)
            assert wait_until(lambda: _gone(engine), timeout=30)
            call.join(30)
    assert call.outcome.code == grpc.StatusCode.UNAVAILABLE
