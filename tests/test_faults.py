"""Faults stay local: a failed step fails only its requests; a dead engine stops the process."""

from __future__ import annotations

import logging
import threading
from dataclasses import replace

import grpc
from conftest import demo_config
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support import ServerThread, WorkerProcess, generate, server_info, wait_until

from servicer.faults import ENV_VAR, FaultPlan
from servicer.lifecycle import Phase


def _with_faults(demo_dir, spec: str):
    config = demo_config(demo_dir)
    engine = type(config.engine)(**{**vars(config.engine), "faults": FaultPlan.parse(spec)})
    return replace(config, engine=engine)


def test_a_failed_step_fails_its_requests_and_the_engine_keeps_serving(
    demo_dir, reference, prompts
):
    with ServerThread(_with_faults(demo_dir, "step:5")) as running, running.channel() as chan:
        failed = generate(chan, prompts[0], temperature=0, max_tokens=50, ignore_eos=True)
        assert failed.code == grpc.StatusCode.INTERNAL
        assert "injected fault at step 5" in failed.error.details()
        assert len(failed.chunks) < 5  # it was streaming when the step failed
        after = generate(chan, prompts[1], temperature=0, max_tokens=20, ignore_eos=True)
        assert after.tokens == reference.greedy(prompts[1], 20)
        stub = health_pb2_grpc.HealthStub(chan)
        status = stub.Check(health_pb2.HealthCheckRequest(), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        assert server_info(chan).active_requests == 0
        errors = running.server.metrics.registry.get_sample_value(
            "mlx_worker_errors_total", {"kind": "engine_step"}
        )
        assert errors == 1


def test_repeated_step_failures_are_logged_rate_limited(demo_dir, prompts, caplog):
    spec = "step:" + ",".join(str(n) for n in range(1, 21))  # each request fails at its first
    caplog.set_level(logging.ERROR, logger="servicer.engine")
    config = replace(_with_faults(demo_dir, spec), engine_mode="thread")  # its log, here
    with ServerThread(config) as running, running.channel() as chan:
        codes = [
            generate(chan, prompts[i % 8], max_tokens=4, ignore_eos=True).code for i in range(20)
        ]
        assert codes == [grpc.StatusCode.INTERNAL] * 20
        ok = generate(chan, prompts[0], max_tokens=4, ignore_eos=True)
        assert ok.error is None  # step 21 and later are healthy
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert 1 <= len(tracebacks) <= 2, [r.getMessage() for r in tracebacks]


def test_engine_death_fails_every_waiting_call_and_exits_non_zero(demo_dir, prompts):
    env = {ENV_VAR: "die:40"}
    with WorkerProcess("--model", str(demo_dir), env=env) as worker:
        worker.wait_ready()
        outcomes: list = []
        with grpc.insecure_channel(worker.address) as chan:
            callers = [
                threading.Thread(
                    target=lambda i=i: outcomes.append(
                        generate(
                            chan, prompts[i], stream=i % 2 == 0, max_tokens=3000, ignore_eos=True
                        )
                    )
                )
                for i in range(4)
            ]
            for caller in callers:
                caller.start()
            for caller in callers:
                caller.join(60)
            assert worker.wait(60) == 1
            late = generate(chan, prompts[0], max_tokens=2, timeout=10)
    assert [o.code for o in outcomes] == [grpc.StatusCode.UNAVAILABLE] * 4
    assert all("injected engine death at step 40" in o.error.details() for o in outcomes)
    assert late.code == grpc.StatusCode.UNAVAILABLE  # nothing listens: no hang
    assert "engine thread died" in worker.output


def test_engine_death_turns_health_not_serving(demo_dir, prompts):
    with ServerThread(_with_faults(demo_dir, "die:3")) as running, running.channel() as chan:
        outcome = generate(chan, prompts[0], max_tokens=100, ignore_eos=True)
        assert outcome.code == grpc.StatusCode.UNAVAILABLE
        assert wait_until(lambda: running.exit_code is not None, timeout=30)
        assert running.exit_code == 1
        assert running.server.lifecycle.phase is Phase.STOPPED
        assert "injected engine death at step 3" in running.server.lifecycle.refusal
        assert not running.server.engine.alive
        assert running.server.health_status == health_pb2.HealthCheckResponse.NOT_SERVING
