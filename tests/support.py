"""Test helpers: run the real worker on a loopback port, talk to it with a real client."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from servicer.proto import mlx_engine_pb2 as pb
from servicer.proto import mlx_engine_pb2_grpc as pb_grpc
from servicer.server import ServerConfig, WorkerServer
from servicer.sysinfo import free_port

ROOT = Path(__file__).resolve().parent.parent
SMG = shutil.which("smg", path=str(Path(sys.executable).parent)) or shutil.which("smg")

# The long cases: `make test-slow` (and `make test-all`) runs them, `make test` the rest, which
# keeps a fast slice of each long suite (one kind, one seed, ...).
SLOW = pytest.mark.slow


def slow(*values: Any, id: str | None = None) -> Any:
    """A parametrization only `make test-slow` runs (`pytest.param` marked slow)."""
    return pytest.param(*values, marks=SLOW, id=id)


class ServerThread:
    """A WorkerServer on its own asyncio loop in a background thread of the test process."""

    def __init__(self, config: ServerConfig, *, wait_ready: bool = True) -> None:
        self.config = config
        self._wait_ready = wait_ready
        self._thread = threading.Thread(target=self._main, name="test-server", daemon=True)
        self._bound = threading.Event()
        self._error: BaseException | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.server: WorkerServer | None = None
        self.port = 0
        self.exit_code: int | None = None

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # surfaced to the test by start()
            self._error = exc
            self._bound.set()

    async def _serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.server = WorkerServer(self.config)
        self.port = await self.server.start()
        self._bound.set()
        self.exit_code = await self.server.serve_until_stopped()

    def start(self) -> ServerThread:
        self._thread.start()
        self._bound.wait(120)
        if self._error is not None:
            raise self._error
        if self._wait_ready:
            self.run(self.server.wait_ready(120))  # type: ignore[union-attr]
        return self

    def run(self, coro: Any, timeout: float = 120) -> Any:
        """Run a coroutine on the server's loop and return its result."""
        assert self.loop is not None
        future: Future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result(timeout)

    def stop(self, timeout: float = 60) -> None:
        if self.loop is not None and self.server is not None and self._thread.is_alive():
            # A server that stopped itself (the fatal path) may close its loop between the
            # check and the call: then there is nothing left to ask.
            with contextlib.suppress(RuntimeError):
                self.loop.call_soon_threadsafe(self.server.request_shutdown)
        self._thread.join(timeout)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.address)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class Outcome:
    """Everything one Generate call produced."""

    chunks: list[pb.GenerateStreamChunk] = field(default_factory=list)
    complete: pb.GenerateComplete | None = None
    error: grpc.RpcError | None = None

    @property
    def tokens(self) -> list[int]:
        if self.chunks:
            return [t for chunk in self.chunks for t in chunk.token_ids]
        return list(self.complete.output_ids) if self.complete else []

    @property
    def code(self) -> grpc.StatusCode | None:
        return self.error.code() if self.error else None


_request_counter = iter(range(1, 1 << 62))


def make_request(
    prompt: list[int], *, stream: bool = True, request_id: str | None = None, **params: Any
) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=f"test-{next(_request_counter)}" if request_id is None else request_id,
        tokenized=pb.TokenizedInput(input_ids=prompt),
        sampling_params=pb.SamplingParams(**params),
        stream=stream,
    )


def generate(
    channel: grpc.Channel,
    prompt: list[int],
    *,
    stream: bool = True,
    request_id: str | None = None,
    timeout: float | None = 120,
    on_chunk: Callable[[pb.GenerateStreamChunk], None] | None = None,
    **params: Any,
) -> Outcome:
    """One Generate call, collected; gRPC errors are returned, not raised."""
    stub = pb_grpc.MlxEngineStub(channel)
    request = make_request(prompt, stream=stream, request_id=request_id, **params)
    outcome = Outcome()
    try:
        for response in stub.Generate(request, timeout=timeout):
            if response.HasField("chunk"):
                outcome.chunks.append(response.chunk)
                if on_chunk is not None:
                    on_chunk(response.chunk)
            else:
                assert outcome.complete is None, "two complete messages"
                outcome.complete = response.complete
    except grpc.RpcError as error:
        outcome.error = error
    return outcome


class BackgroundGenerate:
    """One Generate call on its own thread; `started` is set by its first chunk (streams only)."""

    def __init__(self, channel: grpc.Channel, prompt: list[int], **params: Any) -> None:
        self.outcome: Outcome | None = None
        self.started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(channel, prompt, params))
        self._thread.start()

    def _run(self, channel: grpc.Channel, prompt: list[int], params: dict[str, Any]) -> None:
        self.outcome = generate(channel, prompt, on_chunk=lambda _: self.started.set(), **params)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread.is_alive()


def server_info(channel: grpc.Channel) -> pb.GetServerInfoResponse:
    return pb_grpc.MlxEngineStub(channel).GetServerInfo(pb.GetServerInfoRequest(), timeout=10)


def wait_until(predicate: Callable[[], bool], timeout: float = 10, interval: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


class WorkerProcess:
    """The worker as a separate process (`python -m servicer`), for lifecycle tests."""

    READY = re.compile(r"ready: serving .* on [\d.]+:(\d+)")

    def __init__(
        self, *args: str, env: dict[str, str] | None = None, any_port: bool = True
    ) -> None:
        """`any_port`: bind a free port (`--port 0`) unless the arguments name one."""
        self.args = ["--port", "0", *args] if any_port and "--port" not in args else list(args)
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc: subprocess.Popen[str] | None = None
        self.lines: list[str] = []
        self.port = 0
        self._reader: threading.Thread | None = None
        self._ready = threading.Event()

    def start(self) -> WorkerProcess:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "servicer", *self.args],
            cwd=ROOT,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            match = self.READY.search(line)
            if match:
                self.port = int(match.group(1))
                self._ready.set()

    def wait_ready(self, timeout: float = 180) -> WorkerProcess:
        """Until the worker says it serves; a worker that exits first fails at once."""
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.2):
            exited = self.proc is not None and self.proc.poll() is not None
            if exited and self._reader is not None:
                self._reader.join(5)  # the last lines, a ready line among them perhaps
            if self._ready.is_set():
                break
            if exited or time.monotonic() > deadline:
                state = "exited" if exited else "did not become ready"
                raise AssertionError(f"worker {state}:\n" + self.output)
        return self

    def wait(self, timeout: float = 60) -> int:
        assert self.proc is not None
        code = self.proc.wait(timeout)
        if self._reader is not None:
            self._reader.join(5)
        return code

    def terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def __enter__(self) -> WorkerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.kill()


class Router:
    """The real SMG router (`smg launch`) in front of workers, with no --model-path: it
    fetches the tokenizer from the workers with GetTokenizer."""

    def __init__(
        self,
        worker_addresses: list[str],
        log_path: Path,
        *flags: str,
        connections: int = 32,
        pd: bool = False,
    ) -> None:
        """`pd`: the router's prefill/decode split, the first address the prefill worker and
        the second the decode worker."""
        assert SMG is not None, "the smg router is a dev dependency"
        urls = [f"grpc://{address}" for address in worker_addresses]
        workers = ["--worker-urls", *urls]
        if pd:
            workers = ["--pd-disaggregation", "--prefill", urls[0], "--decode", urls[1]]
        self.log_path = log_path
        self._log = log_path.open("w")
        http_port = free_port()
        self.metrics_port = free_port()
        self.proc = subprocess.Popen(
            [
                SMG,
                "launch",
                *workers,
                "--host",
                "127.0.0.1",
                "--port",
                str(http_port),
                "--prometheus-host",
                "127.0.0.1",
                "--prometheus-port",
                str(self.metrics_port),
                *flags,
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        self.client = httpx.Client(
            base_url=f"http://127.0.0.1:{http_port}",
            timeout=120,
            limits=httpx.Limits(max_connections=connections),
        )

    def wait_until_serving(self, timeout: float = 120) -> str:
        """The model name, once /v1/models lists it and the tokenizer has been fetched (until
        then chat completions get 503 tokenizer_not_ready)."""
        deadline = time.monotonic() + timeout
        model = None
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if model is None:
                    response = self.client.get("/v1/models")
                    if response.status_code == 200 and response.json().get("data"):
                        model = response.json()["data"][0]["id"]
                else:
                    body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
                    response = self.client.post(
                        "/v1/chat/completions", json={**body, "max_tokens": 1}
                    )
                    if response.status_code == 200:
                        return model
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"router never became ready:\n{self.log_tail()}")

    def metrics(self) -> str:
        """The router's own Prometheus page."""
        return httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).text

    def log_tail(self, chars: int = 4000) -> str:
        self._log.flush()
        return re.sub(r"\x1b\[[0-9;]*m", "", self.log_path.read_text())[-chars:]

    def close(self) -> None:
        self.client.close()
        # Killed at once: its graceful shutdown keeps the listener open ~5 s, and it is one
        # process (no children to leave behind).
        self.proc.kill()
        self.proc.wait(10)
        self._log.close()
