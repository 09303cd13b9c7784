"""The invariant under churn: every accepted request ends with exactly one terminal message.

64 concurrent clients mix streams, unary calls, client cancels, Abort calls, deadlines, bad
input and duplicate ids against one worker process, 3 rounds in make test and 12 in make
test-slow (bench/soak.py is the driver; run it longer there for nightly use). Afterwards the
worker is healthy and empty, its own request count agrees with the clients', and its resident
memory grew by less than RSS_BOUND_MIB.
"""

from __future__ import annotations

import asyncio

import grpc
import httpx
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from soak import soak
from support import WorkerProcess, free_port, server_info, slow, wait_until

from servicer.proto import mlx_engine_pb2 as pb
from servicer.proto import mlx_engine_pb2_grpc as pb_grpc

CLIENTS = 64
RSS_BOUND_MIB = 64  # growth allowed after the warm-up round (seen: about 10 MiB)


def _metrics(port: int) -> dict[str, float]:
    body = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


@pytest.mark.parametrize("rounds", [3, slow(12)])
def test_soak_accounts_for_every_request(demo_dir, rounds):
    metrics_port = free_port()
    with WorkerProcess("--model", str(demo_dir), "--metrics-port", str(metrics_port)) as worker:
        worker.wait_ready()
        process = psutil.Process(worker.proc.pid)
        warmup = asyncio.run(soak(worker.address, CLIENTS, 1, seed=100))
        assert warmup.violations == []
        rss_before = process.memory_info().rss / 2**20
        report = asyncio.run(soak(worker.address, CLIENTS, rounds, seed=1))
        rss_after = process.memory_info().rss / 2**20
        print(report.table(), f"\nRSS MiB {rss_before:.0f} -> {rss_after:.0f}")

        assert report.violations == []
        assert report.requests == CLIENTS * rounds
        assert rss_after - rss_before < RSS_BOUND_MIB

        with grpc.insecure_channel(worker.address) as channel:
            assert wait_until(lambda: server_info(channel).active_requests == 0)
            health = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10
            )
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            stub = pb_grpc.MlxEngineStub(channel)
            assert stub.HealthCheck(pb.HealthCheckRequest(), timeout=10).healthy

        calls = sum(r.requests for r in (warmup, report))
        calls += sum(r.endings.get("status:ALREADY_EXISTS", 0) for r in (warmup, report))
        # A deadline can pass inside gRPC before the handler ever runs (a loaded machine, a
        # 50 ms deadline); such a call never reached the worker, so it may be missing here.
        unseen = sum(r.endings.get("status:DEADLINE_EXCEEDED", 0) for r in (warmup, report))
        assert wait_until(
            lambda: _metrics(metrics_port)["mlx_worker_requests_total"] >= calls - unseen,
            timeout=30,
        ), (calls, unseen, _metrics(metrics_port))
        assert _metrics(metrics_port)["mlx_worker_requests_total"] <= calls
        values = _metrics(metrics_port)
        assert values["mlx_worker_running_requests"] == 0  # the engine holds no rows
        assert values["mlx_worker_waiting_requests"] == 0
