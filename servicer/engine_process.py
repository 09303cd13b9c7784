"""The engine in a child process of its own (the default): the gRPC process keeps handlers,
validation, text and metrics; the child runs the scheduler, the loop and every MLX object, so
serving and stepping stop sharing one GIL.

They talk over a socket pair in length-prefixed frames encoded with msgspec: requests and
aborts go to the child, one frame per hand-off (every row's events of the steps since the
last) comes back. The child exits when its socket closes, so it never outlives the server,
and the server learns of the child's death at once (end of file).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Iterable
from typing import Any

import msgspec

from .engine_config import EngineConfig
from .messages import (
    EmbedRequest,
    EngineCapabilities,
    EngineStartupError,
    GenerationRequest,
    ModelInfo,
    StepOutput,
    Wire,
)
from .outbox import Outbox

log = logging.getLogger(__name__)
LOG_LEVEL_ENV = "MLX_GRPC_WORKER_ENGINE_LOG_LEVEL"

# Frame kinds, server -> child
CONFIG, SUBMIT, ABORT, STOP, EMBED, FLUSH = b"C", b"Q", b"A", b"X", b"E", b"L"
# child -> server
READY, FAILED, STEP = b"R", b"F", b"S"
_HEADER = struct.Struct("<Ic")  # payload length, kind


class Started(Wire, frozen=True):
    """The child's answer once its engine is warm (or could not start)."""

    capabilities: EngineCapabilities | None
    error: str | None = None


class Channel:
    """Frames over one end of a socket pair; `send` may be called from several threads."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._send_lock = threading.Lock()
        self._encoder = msgspec.msgpack.Encoder()

    def send(self, kind: bytes, payload: Any = None, raw: bytes | None = None) -> None:
        data = raw if raw is not None else self._encoder.encode(payload)
        with self._send_lock:
            self.sock.sendall(_HEADER.pack(len(data), kind) + data)

    def receive(self) -> tuple[bytes, bytes] | None:
        """The next frame, or None at end of file."""
        header = self._read(_HEADER.size)
        if header is None:
            return None
        length, kind = _HEADER.unpack(header)
        data = self._read(length)
        return None if data is None else (kind, data)

    def _read(self, count: int) -> bytes | None:
        chunks, left = [], count
        while left:
            try:
                chunk = self.sock.recv(min(left, 1 << 20))
            except OSError:
                return None
            if not chunk:
                return None
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


DECODE_STEP = msgspec.msgpack.Decoder(StepOutput)
DECODE_STARTED = msgspec.msgpack.Decoder(Started)
DECODE_REQUEST = msgspec.msgpack.Decoder(GenerationRequest)
DECODE_TICKETS = msgspec.msgpack.Decoder(list[int])
DECODE_EMBED = msgspec.msgpack.Decoder(EmbedRequest)
DECODE_TICKET = msgspec.msgpack.Decoder(int)


class EngineProcess:
    """The handlers' engine handle for an engine in a child process. Construct, `start(info)`,
    then `wait_ready()`; output reaches `sink` (the Outbox) from a reader thread."""

    def __init__(self, config: EngineConfig, sink: Outbox) -> None:
        self.config = config
        self._sink = sink
        self._proc: subprocess.Popen[bytes] | None = None
        self._channel: Channel | None = None
        self._reader = threading.Thread(target=self._read, name="engine-reader", daemon=True)
        self._ready = threading.Event()
        self._started: Started | None = None
        self._info: ModelInfo | None = None
        self._stopping = False
        self.failure: str | None = None

    # ----- the handle -----

    def start(self, info: ModelInfo) -> None:
        self._info = info
        parent, child = socket.socketpair()
        # The engine logs at the worker's level unless its own is set (DEBUG traces each
        # prefill step's timing without the handlers' debug output).
        level = os.environ.get(LOG_LEVEL_ENV) or logging.getLevelName(
            logging.getLogger().getEffectiveLevel()
        )
        env = {**os.environ, "PYTHONUNBUFFERED": "1", LOG_LEVEL_ENV: str(level)}
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "servicer.engine.child", str(child.fileno())],
            pass_fds=(child.fileno(),),
            env=env,
        )
        child.close()
        log.info("engine process %d started", self._proc.pid)
        self._channel = Channel(parent)
        self._channel.send(CONFIG, raw=pickle.dumps((self.config, info)))
        self._reader.start()

    def wait_ready(self, timeout: float | None = None) -> ModelInfo:
        if not self._ready.wait(timeout):
            raise EngineStartupError("the engine did not become ready in time")
        started = self._started
        if started is None or started.capabilities is None:
            reason = started.error if started is not None else self.failure
            raise EngineStartupError(reason or "the engine process exited while starting")
        assert self._info is not None
        return self._info

    @property
    def capabilities(self) -> EngineCapabilities:
        assert self._started is not None and self._started.capabilities is not None
        return self._started.capabilities

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None and self.failure is None

    def submit(self, request: GenerationRequest) -> None:
        self._send(SUBMIT, request)

    def abort(self, tickets: Iterable[int]) -> None:
        self._send(ABORT, list(tickets))

    def embed(self, request: EmbedRequest) -> None:
        self._send(EMBED, request)

    def flush_cache(self, ticket: int) -> None:
        self._send(FLUSH, ticket)

    def shutdown(self, timeout: float | None = None) -> None:
        """End every request with `abort` and stop the child (killed if it does not stop)."""
        self._stopping = True
        self._send(STOP, None)
        self.join(timeout)
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(10)
        if self._channel is not None:
            self._channel.close()

    def join(self, timeout: float | None = None) -> None:
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout)
        if self._reader.is_alive() and self._reader is not threading.current_thread():
            self._reader.join(timeout)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _send(self, kind: bytes, payload: Any) -> None:
        if self._channel is None:
            return
        with contextlib.suppress(OSError):  # the child is gone; the reader reports it
            self._channel.send(kind, payload)

    # ----- the reader thread -----

    def _read(self) -> None:
        """Frames from the child until its socket closes. However it ends, the end is
        reported: a stop, or the fatal path (never a stream left waiting)."""
        assert self._channel is not None
        faults = self.config.faults
        broken: str | None = None
        try:
            while (frame := self._channel.receive()) is not None:
                kind, data = frame
                if kind == STEP:
                    if faults is not None:
                        faults.before_call("reader")
                    self._sink.put(DECODE_STEP.decode(data), due=True)
                elif kind in (READY, FAILED):
                    self._started = DECODE_STARTED.decode(data)
                    self._ready.set()
        except BaseException as exc:
            broken = f"reading the engine process's output failed: {type(exc).__name__}: {exc}"
            log.exception("engine reader failed")
        finally:
            self._ended(broken)

    def _ended(self, broken: str | None = None) -> None:
        """The child's socket closed, or reading it failed (`broken`): a clean stop, or a
        death the handlers must hear of (the child is killed if it still runs)."""
        if broken is not None and self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
        code = self._proc.wait() if self._proc is not None else None
        if self._stopping and code == 0 and broken is None:
            return
        self.failure = broken or f"the engine process exited (code {code})"
        log.error("%s", self.failure)
        self._ready.set()
        self._sink.put(StepOutput(fatal=self.failure), due=True)
