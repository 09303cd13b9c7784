"""The real smg router finds the model however it and the worker are started, with the worker's
load held open by the `load:S` fault hook."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from support import SLOW, SMG, Router, WorkerProcess, free_port, wait_until

from servicer.faults import ENV_VAR

pytestmark = pytest.mark.skipif(SMG is None, reason="the smg router is a dev dependency")

NAME = "start-order-demo"
CHAT = {"messages": [{"role": "user", "content": "Tell me about the river."}], "max_tokens": 6}


@pytest.fixture
def launch(tmp_path) -> Iterator:
    started: list[WorkerProcess | Router] = []

    def worker(port: int, faults: str) -> WorkerProcess:
        args = ("--model", "demo:llama", "--served-model-name", NAME, "--port", str(port))
        process = WorkerProcess(*args, env={ENV_VAR: faults})
        started.append(process.start())
        return process

    def router(address: str) -> Router:
        running = Router([address], tmp_path / f"smg-{len(started)}.log")
        started.append(running)
        return running

    yield worker, router
    for item in reversed(started):
        item.kill() if isinstance(item, WorkerProcess) else item.close()


def _listed(router: Router) -> list[str]:
    try:
        response = router.client.get("/v1/models")
    except Exception:
        return []
    return [m["id"] for m in response.json().get("data", [])] if response.status_code == 200 else []


def _both_endpoints_answer(router: Router) -> None:
    chat = router.client.post("/v1/chat/completions", json={"model": NAME, **CHAT})
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["content"]
    completion = router.client.post(
        "/v1/completions", json={"model": NAME, "prompt": "The river", "max_tokens": 6}
    )
    assert completion.status_code == 200, completion.text
    assert completion.json()["choices"][0]["text"]


def _serves_once_ready(worker: WorkerProcess, router: Router) -> None:
    worker.wait_ready()
    # The router may have found the worker before it bound: it connects again every 30 s.
    assert wait_until(lambda: _listed(router) == [NAME], timeout=75, interval=0.5), (
        _listed(router),
        router.log_tail(),
    )
    _both_endpoints_answer(router)


def test_router_and_worker_started_together(launch):
    start_worker, start_router = launch
    port = free_port()
    # Slow files (a download, the demo model's first build), then a slow load.
    worker = start_worker(port, "resolve:5;load:5")
    router = start_router(f"127.0.0.1:{port}")
    _serves_once_ready(worker, router)
    assert "unknown" not in _listed(router)


@SLOW  # like the test above, ~30 s waiting for the router's next connection attempt
def test_router_first_and_the_worker_seconds_later(launch):
    start_worker, start_router = launch
    port = free_port()
    router = start_router(f"127.0.0.1:{port}")
    time.sleep(3)
    worker = start_worker(port, "load:4")
    _serves_once_ready(worker, router)


def test_a_request_while_loading_waits_for_the_model(launch):
    start_worker, start_router = launch
    port = free_port()
    worker = start_worker(port, "load:12")
    assert wait_until(lambda: "model files ready" in worker.output, timeout=60)
    router = start_router(f"127.0.0.1:{port}")
    assert wait_until(lambda: _listed(router) == [NAME], timeout=20, interval=0.2)
    # Six streams wait for the model (more than the router's wedge pile of 4, for longer than
    # its 3 s bound): the worker's empty chunks keep them from looking wedged.
    body = {"model": NAME, **CHAT, "stream": True}
    with ThreadPoolExecutor(6) as pool:
        early = list(
            pool.map(lambda _: router.client.post("/v1/chat/completions", json=body), range(6))
        )
    assert [r.status_code for r in early] == [200] * 6, early[0].text
    assert all('"finish_reason":"' in r.text for r in early), early[0].text
    assert "ready: serving" in worker.output
    assert "vetoed" not in router.log_tail(100_000)
    _both_endpoints_answer(router)
