"""No silent hang (issue 38): a step that makes no progress past its bound fails every request
with UNAVAILABLE, turns health NOT_SERVING and ends the worker with a non-zero exit, with the
engine in a thread or in its own process."""

from __future__ import annotations

from dataclasses import replace

import grpc
import pytest
from conftest import demo_config
from grpc_health.v1 import health_pb2
from support import ServerThread, WorkerProcess, generate, wait_until

from servicer.engine.watchdog import StepWatch
from servicer.faults import ENV_VAR, FaultPlan
from servicer.lifecycle import Phase

STEP_TIMEOUT_S = 2.0
SLACK_S = 20.0  # the bound may be 8x a slow first step; then the report and the exit


def test_the_bound_is_the_floor_or_a_multiple_of_the_longest_step():
    watch = StepWatch(2.0, factor=8.0)
    assert watch.overdue() is None  # idle: no step runs
    watch.begin()
    watch.end()
    assert watch.bound_s == 2.0
    watch.longest_s = 0.5
    assert watch.bound_s == 4.0
    watch.begin()
    watch._began -= 5.0  # type: ignore[operator]  # a step that began 5 s ago
    reason = watch.overdue()
    assert reason is not None and "no progress for 5" in reason
    watch.end()
    assert watch.overdue() is None and watch.longest_s >= 5.0


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_a_hung_step_fails_the_request_and_turns_health_not_serving(demo_dir, prompts, mode):
    config = demo_config(demo_dir, step_timeout_s=STEP_TIMEOUT_S, faults=FaultPlan.parse("hang:5"))
    config = replace(config, engine_mode=mode)
    with ServerThread(config) as running, running.channel() as chan:
        # Within its deadline the request ends UNAVAILABLE; a watchdog too slow to fire would
        # leave it DEADLINE_EXCEEDED.
        deadline = STEP_TIMEOUT_S + SLACK_S
        outcome = generate(chan, prompts[0], max_tokens=100, ignore_eos=True, timeout=deadline)
        assert outcome.code == grpc.StatusCode.UNAVAILABLE
        assert "no progress" in outcome.error.details()
        assert wait_until(lambda: running.exit_code is not None, timeout=30)
        assert running.exit_code == 1
        server = running.server
        assert server.health_status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert server.lifecycle.phase is Phase.STOPPED


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_a_hung_step_ends_the_worker_process_non_zero(demo_dir, prompts, mode):
    args = ("--model", str(demo_dir), "--engine-mode", mode, "--step-timeout", "2")
    with WorkerProcess(*args, env={ENV_VAR: "hang:5"}) as worker:
        worker.wait_ready()
        deadline = STEP_TIMEOUT_S + SLACK_S
        with grpc.insecure_channel(worker.address) as chan:
            outcome = generate(chan, prompts[0], max_tokens=100, ignore_eos=True, timeout=deadline)
        assert outcome.code == grpc.StatusCode.UNAVAILABLE, worker.output
        assert "no progress" in outcome.error.details()
        assert worker.wait(60) == 1
    assert "no progress" in worker.output
