"""Scale out: two worker processes behind one real SMG router.

Phase 1: 40 chat completions at concurrency 8 all succeed and both workers serve some.
Phase 2: one worker gets SIGTERM while it has requests in flight; it drains them (they finish
in full) and refuses new ones with UNAVAILABLE, which the router retries on the other worker,
so every request of the run still succeeds.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest
from support import SMG, Router, WorkerProcess, free_port, wait_until

pytestmark = pytest.mark.skipif(SMG is None, reason="the smg router is a dev dependency")

REQUESTS = 40
CONCURRENCY = 8
MAX_TOKENS = 48
SHUTDOWN_GRACE_S = 30  # long enough that no in-flight request is cut short

# The router settings the README recommends for a fleet, tightened for a quick test:
# - round_robin makes "both workers served some" certain (least_load / cache_aware are the
#   production choices; cache_aware pins these same-prefix prompts to one worker);
# - a 1 s health check with threshold 1 takes a stopping worker (NOT_SERVING) out of rotation
#   within about a second;
# - retries resend a request the worker refused (UNAVAILABLE -> 503: "the worker is shutting
#   down", or "tcp connect error" once it has exited) to another worker; without them those
#   requests fail with 503;
# - the circuit breaker stops routing to a worker after 2 failures, before health checks notice.
ROUTER_FLAGS = [
    "--policy", "round_robin",
    "--health-check-interval-secs", "1",
    "--health-failure-threshold", "1",
    "--health-check-timeout-secs", "2",
    "--retry-max-retries", "5",
    "--retry-initial-backoff-ms", "50",
    "--retry-max-backoff-ms", "1000",
    "--cb-failure-threshold", "2",
    "--cb-timeout-duration-secs", "10",
]  # fmt: skip


@dataclass
class Fleet:
    workers: list[WorkerProcess]
    metrics_ports: list[int]
    router: Router
    model: str

    def metric(self, index: int, name: str) -> float:
        """Sum of every sample of `name` on worker `index`'s /metrics."""
        text = httpx.get(f"http://127.0.0.1:{self.metrics_ports[index]}/metrics", timeout=10).text
        pattern = rf"^{name}(?:\{{[^}}]*\}})? ([0-9.e+-]+)$"
        return sum(float(value) for value in re.findall(pattern, text, re.M))

    def served(self, index: int) -> float:
        return self.metric(index, "mlx_worker_requests_total")

    def counts_reaching(self, total: float, timeout: float = 10) -> list[float]:
        """Requests each worker has counted, once they add up to `total` (a worker counts a
        request just after sending its last message, so the router may answer first)."""
        wait_until(lambda: self.served(0) + self.served(1) >= total, timeout, interval=0.05)
        return [self.served(0), self.served(1)]


@pytest.fixture(scope="module")
def fleet(demo_dir, tmp_path_factory) -> Iterator[Fleet]:
    ports = [free_port(), free_port()]
    workers = [
        WorkerProcess(
            "--model",
            str(demo_dir),
            "--metrics-port",
            str(port),
            "--shutdown-grace",
            str(SHUTDOWN_GRACE_S),
        ).start()
        for port in ports
    ]
    router = None
    try:
        for worker in workers:
            worker.wait_ready()
        # Workers first, so the router registers them without its 30 s retry.
        log_path = tmp_path_factory.mktemp("scale-out") / "smg.log"
        router = Router(
            [worker.address for worker in workers],
            log_path,
            *ROUTER_FLAGS,
            connections=4 * CONCURRENCY,
        )
        yield Fleet(workers, ports, router, router.wait_until_serving())
    finally:
        if router is not None:
            router.close()
        for worker in workers:
            worker.kill()


@dataclass
class Reply:
    index: int
    status: int | str
    usage: dict | None = None
    finish_reason: str | None = None
    detail: str = ""

    @property
    def complete(self) -> bool:
        return (
            self.status == 200
            and self.usage is not None
            and self.usage.get("prompt_tokens", 0) > 0
            and self.usage.get("completion_tokens") == MAX_TOKENS
            and self.finish_reason == "length"
        )


def _chat(fleet: Fleet, index: int) -> Reply:
    """One chat completion; odd indices stream. Failures are returned, never raised."""
    body = {
        "model": fleet.model,
        "messages": [{"role": "user", "content": f"Tell me about river number {index}."}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,  # every request runs to max_tokens: a cut-short one shows
    }
    client = fleet.router.client
    try:
        if index % 2 == 0:
            response = client.post("/v1/chat/completions", json=body)
            if response.status_code != 200:
                return Reply(index, response.status_code, detail=response.text[:300])
            reply = response.json()
            return Reply(index, 200, reply.get("usage"), reply["choices"][0]["finish_reason"])
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        usage, finish = None, None
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                return Reply(index, response.status_code, detail=response.read().decode()[:300])
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[len("data: ") :])
                usage = event.get("usage") or usage
                for choice in event.get("choices", []):
                    finish = choice.get("finish_reason") or finish
        return Reply(index, 200, usage, finish)
    except httpx.HTTPError as exc:
        return Reply(index, type(exc).__name__, detail=str(exc))


def _describe(replies: list[Reply], fleet: Fleet) -> str:
    bad = [reply for reply in replies if not reply.complete]
    return f"{len(bad)} of {len(replies)} requests failed: {bad[:5]}\n{fleet.router.log_tail()}"


def test_both_workers_serve_requests_through_one_router(fleet):
    before = fleet.counts_reaching(1)  # the router's readiness probe
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        replies = list(pool.map(lambda i: _chat(fleet, i), range(REQUESTS)))
    assert all(reply.complete for reply in replies), _describe(replies, fleet)
    after = fleet.counts_reaching(sum(before) + REQUESTS)
    served = [after[0] - before[0], after[1] - before[1]]
    assert sum(served) == REQUESTS, served
    assert min(served) > 0, f"one worker served everything: {served}"


def test_stopping_one_worker_mid_run_loses_no_request(fleet):
    stopping, remaining = fleet.workers
    before_remaining = fleet.served(1)
    replies: list[Reply] = []
    done = threading.Lock()

    def run(index: int) -> None:
        reply = _chat(fleet, index)
        with done:
            replies.append(reply)

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        futures = [pool.submit(run, 1000 + i) for i in range(REQUESTS)]
        # SIGTERM once the run is under way and the worker has requests decoding.
        assert wait_until(
            lambda: (
                len(replies) >= CONCURRENCY // 2
                and fleet.metric(0, "mlx_worker_running_requests")
                + fleet.metric(0, "mlx_worker_waiting_requests")
                > 0
            ),
            timeout=60,
            interval=0.05,
        ), f"the first worker never had requests in flight: {replies}"
        stopping.terminate()
        for future in futures:
            future.result(180)

    assert stopping.wait(SHUTDOWN_GRACE_S + 30) == 0, stopping.output[-3000:]
    assert all(reply.complete for reply in replies), _describe(replies, fleet)
    assert len(replies) == REQUESTS
    # It had requests in flight at SIGTERM, and finished them all within the grace period.
    drained = re.search(r"shutting down: finishing (\d+) requests", stopping.output)
    assert drained and int(drained.group(1)) > 0, stopping.output[-3000:]
    assert "still running" not in stopping.output, stopping.output[-3000:]
    # The rest went to the other worker.
    assert fleet.served(1) - before_remaining > 0
    assert remaining.proc is not None and remaining.proc.poll() is None
