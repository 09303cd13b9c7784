"""The worker as a process: startup failures, readiness, SIGTERM drain, exit codes."""

from __future__ import annotations

import socket
from pathlib import Path

import grpc
import pytest
from support import BackgroundGenerate, WorkerProcess, generate, server_info, wait_until

from servicer.sysinfo import LOWEST_CHOSEN_PORT, free_port

DEFAULT_PORT = 50051
PORT_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
MODES = pytest.mark.parametrize("mode", ["process", "thread"])


def test_missing_model_path_exits_non_zero_with_the_reason(tmp_path):
    missing = tmp_path / "no-such-model"
    with WorkerProcess("--model", str(missing)) as worker:
        assert worker.wait(120) != 0
    assert "does not exist" in worker.output
    assert str(missing) in worker.output


def test_directory_without_a_model_exits_non_zero(tmp_path):
    with WorkerProcess("--model", str(tmp_path)) as worker:
        assert worker.wait(120) != 0
    assert "config.json" in worker.output


def test_port_in_use_exits_non_zero(demo_dir):
    with WorkerProcess("--model", str(demo_dir)) as first:
        first.wait_ready()
        with WorkerProcess("--model", str(demo_dir), "--port", str(first.port)) as second:
            assert second.wait(120) != 0
        assert "cannot listen" in second.output


def test_waiting_for_a_worker_that_exits_fails_at_once(demo_dir):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        worker = WorkerProcess("--model", str(demo_dir), "--port", str(held.getsockname()[1]))
        with worker, pytest.raises(AssertionError, match=r"(?s)worker exited:.*cannot listen"):
            worker.wait_ready(timeout=170)


@pytest.mark.skipif(not PORT_RANGE.exists(), reason="no Linux ephemeral port range to read")
def test_a_chosen_port_lies_below_the_ports_the_kernel_hands_out_itself():
    """A port the kernel hands out (to a bind to port 0, or as an outgoing connection's source
    port) can be taken between a test choosing it and a worker binding it."""
    floor = int(PORT_RANGE.read_text().split()[0])
    assert all(LOWEST_CHOSEN_PORT <= free_port() < floor for _ in range(50))


@MODES
def test_sigterm_lets_in_flight_requests_finish_and_exits_zero(demo_dir, prompts, mode):
    args = ("--model", str(demo_dir), "--shutdown-grace", "60", "--engine-mode", mode)
    with WorkerProcess(*args) as worker:
        worker.wait_ready()
        with grpc.insecure_channel(worker.address) as channel:
            caller = BackgroundGenerate(
                channel, prompts[0], temperature=0, max_tokens=2000, ignore_eos=True
            )
            assert caller.started.wait(60)
            worker.terminate()
            assert wait_until(lambda: "shutting down" in worker.output)
            late = generate(channel, prompts[1], max_tokens=4, timeout=10)
            assert caller.is_alive()  # still draining when the late request was refused
            caller.join(120)
        assert worker.wait(60) == 0
    assert late.code == grpc.StatusCode.UNAVAILABLE
    assert "shutting down" in late.error.details()
    long = caller.outcome
    assert long.error is None
    assert long.complete.finish_reason == "length"
    assert long.complete.completion_tokens == 2000
    assert "PyTorch was not found" not in worker.output  # noise a user cannot act on


@MODES
def test_sigterm_past_the_grace_period_ends_requests_with_abort(demo_dir, prompts, mode):
    args = ("--model", str(demo_dir), "--shutdown-grace", "0.5", "--engine-mode", mode)
    with WorkerProcess(*args) as worker:
        worker.wait_ready()
        with grpc.insecure_channel(worker.address) as channel:
            params = {"temperature": 0, "max_tokens": 3000, "ignore_eos": True}
            callers = [
                BackgroundGenerate(channel, prompts[2], stream=stream, **params)
                for stream in (True, False)
            ]
            assert callers[0].started.wait(60)  # the stream's first chunk
            assert wait_until(lambda: server_info(channel).active_requests == 2)
            worker.terminate()
            for caller in callers:
                caller.join(120)
        assert worker.wait(60) == 0
    for outcome in (caller.outcome for caller in callers):
        assert outcome.error is None
        assert outcome.complete.finish_reason == "abort"
        assert 0 < outcome.complete.completion_tokens < 3000


def test_default_port_and_host(demo_dir):
    if not _can_bind(DEFAULT_PORT):
        pytest.skip(f"port {DEFAULT_PORT} is taken on this machine")
    with WorkerProcess("--model", str(demo_dir), any_port=False) as worker:
        worker.wait_ready()
        assert worker.port == DEFAULT_PORT
        assert f"on 127.0.0.1:{DEFAULT_PORT}" in worker.output
        with grpc.insecure_channel(f"127.0.0.1:{DEFAULT_PORT}") as channel:
            assert server_info(channel).server_type == "mlx-grpc-worker"


def _can_bind(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
