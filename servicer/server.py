"""Assembling the worker: gRPC server, health, reflection, engine, and the lifecycle.

Order of life: bind and answer health as NOT_SERVING; resolve and read the model's files (the
metadata RPCs answer from then on); load and warm the engine; flip to SERVING. On SIGTERM:
NOT_SERVING, refuse new work, let in-flight requests finish within the grace period, end the
rest with `abort`, stop. A dead engine means NOT_SERVING and exit 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from .adapter_faces import MlxEngineFace, adapter_keys
from .engine_config import EngineConfig
from .engine_handle import EngineHandle
from .engine_process import EngineProcess
from .faults import FaultPlan
from .grammar import GrammarChecker
from .handlers import HandlerOptions, Handlers
from .kv_transfer import KvTransferCollector
from .lifecycle import Lifecycle, Phase
from .messages import EngineLoad, EngineStartupError, ModelInfo, PrefixCacheStats
from .metrics import WorkerMetrics
from .model_files import ModelFiles, ModelLoadError, ModelSpec, prepare_model_files
from .outbox import Outbox
from .proto import mlx_engine_pb2, mlx_engine_pb2_grpc, vllm_engine_pb2, vllm_engine_pb2_grpc
from .sysinfo import freeze_startup_heap, thaw_startup_heap
from .vllm_face import VllmEngineFace

if TYPE_CHECKING:
    from .engine.lockstep import Lockstep

log = logging.getLogger(__name__)

ENGINE_SERVICE = mlx_engine_pb2.DESCRIPTOR.services_by_name["MlxEngine"].full_name
VLLM_SERVICE = vllm_engine_pb2.DESCRIPTOR.services_by_name["VllmEngine"].full_name
SERVICES = {"mlx": ENGINE_SERVICE, "vllm": VLLM_SERVICE}
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass(frozen=True)
class ServerConfig:
    model: ModelSpec = field(default_factory=ModelSpec)
    # "process": the engine runs in a child process (the default); "thread": in this one
    # (for embedding; a distributed worker always runs its engine here).
    engine_mode: str = "process"
    engine: EngineConfig = field(default_factory=EngineConfig)
    handlers: HandlerOptions = field(default_factory=HandlerOptions)
    host: str = "127.0.0.1"
    port: int = 50051
    shutdown_grace_s: float = 30.0
    # Room for the router's video tensors: float32 pixel values, 12 bytes per pixel per frame
    # (Qwen3-VL's [t*h*w, 1536]), 64 MiB fitting some 5.5 M pixel-frames (32 frames at 416 px).
    max_message_bytes: int = 64 * 1024 * 1024
    metrics_port: int | None = None  # None: no /metrics endpoint
    tls_cert: Path | None = None
    tls_key: Path | None = None
    # The router's services this port answers: "mlx", "vllm" or both (the smg router takes a
    # port that answers VllmEngine for vLLM, and sends it n, stop strings, constraints,
    # embeddings, load polls and KV event subscriptions).
    protocols: tuple[str, ...] = ("mlx",)
    # Each adapter served beside the base model listens on a port of its own, answering its
    # name (EngineConfig.adapters has their paths): (name, port) pairs.
    adapter_ports: tuple[tuple[str, int], ...] = ()


def resolve_files(config: ServerConfig) -> ModelFiles:
    """The model's files, resolved and read (blocking), with the testing delay if one is set."""
    faults: FaultPlan | None = config.engine.faults
    if faults is not None:
        faults.before_resolve()
    return prepare_model_files(config.model)


def make_engine(
    config: ServerConfig, outbox: Outbox, lockstep: Lockstep | None = None
) -> EngineHandle:
    """The engine in a child process, or (thread mode; distributed, with its `lockstep`)
    in this one."""
    if config.engine_mode == "process" and lockstep is None:
        return EngineProcess(config.engine, outbox)
    from .engine import Engine  # MLX comes into this process only in thread mode

    return Engine(config.engine, outbox, lockstep=lockstep)


class WorkerServer:
    """One engine behind one gRPC port. Several can live in one process. With a `lockstep`
    (--distributed, rank 0) the engine runs in this process and shares its plans."""

    def __init__(self, config: ServerConfig, lockstep: Lockstep | None = None) -> None:
        self.config = config
        self.lifecycle = Lifecycle()
        self.outbox = Outbox(self._wake_loop)
        self.engine = make_engine(config, self.outbox, lockstep)
        self.metrics = WorkerMetrics(self.load, lambda: self.servicer.figures())
        self.servicer = Handlers(  # the handlers every address and face shares
            self.engine,
            self.lifecycle,
            self._on_fatal,
            config.handlers,
            self.metrics,
            block_size=config.engine.block_size,
            max_running_requests=config.engine.completion_batch_size,
            kv_cache_dtype=f"int{config.engine.kv_bits}" if config.engine.kv_bits else "auto",
        )
        self.metrics.registry.register(KvTransferCollector(self.servicer.kv.counters))
        self.metrics_port: int | None = None
        self.health = health.aio.HealthServicer()
        self.health_status = NOT_SERVING  # what both standard health services report
        self.port = 0
        self.exit_code = 0
        self.files: ModelFiles | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = asyncio.Event()
        self._preparing: asyncio.Task[ModelFiles] | None = None
        self._grammar: asyncio.Task[GrammarChecker] | None = None
        self._server: grpc.aio.Server | None = None
        self._adapter_servers: list[grpc.aio.Server] = []
        self.adapter_ports: dict[str, int] = {}  # each served adapter's bound port

    @property
    def services(self) -> tuple[str, ...]:
        """The full names of the router services this port answers."""
        return tuple(SERVICES[name] for name in self.config.protocols)

    def load(self) -> EngineLoad:
        """Requests waiting for a first token, and decoding (for metrics and tests)."""
        return self.servicer.load()

    def prefix_stats(self) -> PrefixCacheStats | None:
        """The prefix store's figures as the engine last published them."""
        return self.servicer.prefix_stats()

    # ----- engine -> loop -----

    def _wake_loop(self) -> None:
        """From the engine thread: output is due (the outbox wakes the loop once per take)."""
        assert self._loop is not None
        # A closed loop means the process is on its way out; nobody is left to tell.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._pick_up)

    def _pick_up(self) -> None:
        out = self.outbox.take()
        if out is not None:
            self.servicer.dispatch(out)

    def _on_fatal(self, reason: str) -> None:
        log.critical("engine failed, the worker stops: %s", reason)
        self.lifecycle.advance(Phase.FAILED, reason)
        self.exit_code = 1
        self._stopping.set()

    async def _set_health(self, status: health_pb2.HealthCheckResponse.ServingStatus) -> None:
        self.health_status = status
        for service in ("", *self.services):
            await self.health.set(service, status)

    # ----- lifecycle -----

    async def start(self) -> int:
        """Bind and start answering (health NOT_SERVING), then resolve the model's files and
        start loading the engine in the background."""
        self._loop = asyncio.get_running_loop()
        config = self.config
        server, self.port = listen(config, self.servicer, self.health, config.port)
        # Every address listens before any starts: one taken is an error, nothing half served.
        adapters = [
            listen(config, self.servicer, self.health, port, adapter=name)
            for name, port in config.adapter_ports
        ]
        self.adapter_ports = {
            name: port for (name, _), (_, port) in zip(config.adapter_ports, adapters, strict=True)
        }
        if config.metrics_port is not None:
            self.metrics_port = self.metrics.serve(config.host, config.metrics_port)
        await self._set_health(NOT_SERVING)
        for each, _ in ((server, self.port), *adapters):
            await each.start()
        self._server = server
        self._adapter_servers = [each for each, _ in adapters]
        self._preparing = asyncio.create_task(self._prepare())
        return self.port

    async def _prepare(self) -> ModelFiles:
        """Resolve and read the model's files, then start the engine on them."""
        try:
            files = await asyncio.to_thread(resolve_files, self.config)
        except (ModelLoadError, OSError) as exc:
            self.lifecycle.advance(Phase.FAILED, f"cannot serve the model: {exc}")
            raise EngineStartupError(str(exc)) from exc
        self.files = files
        keys = await asyncio.to_thread(adapter_keys, self.config.engine.adapters)
        self.servicer.set_model(files, keys)
        self.lifecycle.advance(Phase.LOADING)
        log.info(
            "loading %s (metadata answers now; health NOT_SERVING until warm)",
            files.info.served_model_name,
        )
        self.engine.start(files.info)
        info = files.info
        eos = info.eos_token_ids[0] if info.eos_token_ids else 0
        self._grammar = asyncio.ensure_future(
            asyncio.to_thread(GrammarChecker, files.tokenizer, info.vocab_size, eos)
        )
        return files

    async def wait_ready(self, timeout: float | None = None) -> ModelInfo:
        """Wait for the files, then for the engine to load and warm up; report SERVING."""
        assert self._preparing is not None, "start() first"
        try:
            await asyncio.wait_for(asyncio.shield(self._preparing), timeout)
            info = await asyncio.to_thread(self.engine.wait_ready, timeout)
        except EngineStartupError as exc:
            self.lifecycle.advance(Phase.FAILED, f"cannot serve the model: {exc}")
            raise
        assert self._grammar is not None
        grammar = await self._grammar
        capabilities = self.engine.capabilities
        self.servicer.attach(
            capabilities.admission,
            capabilities.has_thinking,
            grammar.compile,
            capabilities.embedding_size,
        )
        tls = (self.config.tls_cert, self.config.tls_key)
        name = info.served_model_name
        try:
            await self.servicer.kv.attach(capabilities.shared_cache_dir, *tls, model_name=name)
        except EngineStartupError as exc:
            self.lifecycle.advance(Phase.FAILED, f"cannot serve the model: {exc}")
            raise
        freeze_startup_heap()  # the handlers' side of the same (the engine froze its own)
        self.lifecycle.advance(Phase.SERVING)
        await self._set_health(SERVING)
        return info

    def request_shutdown(self) -> None:
        if not self._stopping.is_set():
            log.info(
                "shutting down: finishing %d requests (grace %.1f s)",
                self.servicer.active_requests,
                self.config.shutdown_grace_s,
            )
        self._stopping.set()

    async def serve_until_stopped(self) -> int:
        await self._stopping.wait()
        await self.stop()
        return self.exit_code

    async def stop(self) -> None:
        """Drain: NOT_SERVING, refuse new work, finish or abort what is in flight, close."""
        await self._set_health(NOT_SERVING)
        self.lifecycle.advance(Phase.DRAINING)
        self.servicer.kv_events.close()  # subscriptions end cleanly; routers stop listening
        await self._drain()
        for server in (self._server, *self._adapter_servers):
            if server is not None:
                await server.stop(grace=1.0)
        await self.servicer.kv.close()
        if self._preparing is not None and not self._preparing.done():
            self._preparing.cancel()
        await asyncio.to_thread(self.engine.shutdown, 30.0)
        thaw_startup_heap()
        self.lifecycle.advance(Phase.STOPPED)
        self.metrics.close()

    async def _drain(self) -> None:
        """In-flight requests get the grace period to finish; the rest end with `abort`."""
        if self.exit_code == 0 and self.engine.alive:
            await self.servicer.wait_idle(self.config.shutdown_grace_s)
        if self.servicer.active_requests:
            log.info("ending %d requests still running", self.servicer.active_requests)
            self.servicer.abort_all()
            await self.servicer.wait_idle(5.0)


def listen(
    config: ServerConfig, handlers: Handlers, health_servicer: Any, port: int, adapter: str = ""
) -> tuple[grpc.aio.Server, int]:
    """A gRPC server answering the router's services through `handlers`, as the address of
    the base model or of the served `adapter` answers them, with health and reflection, bound
    to `port` (not started)."""
    limit = config.max_message_bytes
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            ("grpc.so_reuseport", 0),  # a port in use is an error, not a shared port
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ]
    )
    if "mlx" in config.protocols:
        face = MlxEngineFace(handlers, adapter)
        mlx_engine_pb2_grpc.add_MlxEngineServicer_to_server(face, server)
    if "vllm" in config.protocols:
        vllm_face = VllmEngineFace(handlers, adapter)
        vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(vllm_face, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    services = tuple(SERVICES[name] for name in config.protocols)
    reflection.enable_server_reflection(
        (*services, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    address = f"{config.host}:{port}"
    try:
        if config.tls_cert is not None and config.tls_key is not None:
            credentials = grpc.ssl_server_credentials(
                [(config.tls_key.read_bytes(), config.tls_cert.read_bytes())]
            )
            return server, server.add_secure_port(address, credentials)
        return server, server.add_insecure_port(address)
    except RuntimeError as exc:
        raise OSError(f"cannot listen on {address}: {exc}") from exc


async def run_worker(
    config: ServerConfig,
    on_ready: Callable[[], None] = lambda: None,
    lockstep: Lockstep | None = None,
) -> int:
    """The process's main coroutine: serve until SIGTERM/SIGINT or an engine failure (with a
    `lockstep`: as rank 0 of a distributed group)."""
    server = WorkerServer(config, lockstep)
    try:
        port = await server.start()
    except OSError as exc:
        log.error("%s", exc)
        return 1
    log.info(
        "listening on %s:%d; preparing %s (health NOT_SERVING until it is warm)",
        config.host,
        port,
        config.model.describe(),
    )
    try:
        info = await server.wait_ready()
    except EngineStartupError as exc:
        log.error("cannot serve: %s", exc)
        await server.stop()
        return 1
    on_ready()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, server.request_shutdown)
    log.info(
        "ready: serving %s on %s:%d%s (context %d tokens, vocab %d, KV limit %.0f MiB)%s",
        info.served_model_name,
        config.host,
        port,
        " with TLS" if config.tls_cert else "",
        info.context_length,
        info.vocab_size,
        server.engine.capabilities.admission.limit_bytes / 2**20,
        f"; metrics on http://{config.host}:{server.metrics_port}/metrics"
        if server.metrics_port
        else "",
    )
    code = await server.serve_until_stopped()
    log.info("stopped (exit code %d)", code)
    return code


class _Discard:
    """A follower's engine output: nobody reads it."""

    def put(self, out: object, due: bool) -> None:
        pass

    def delivered(self, timeout: float) -> bool:
        return True


def run_follower(
    config: ServerConfig, lockstep: Lockstep, on_ready: Callable[[], None] = lambda: None
) -> int:
    """A rank past 0 of a distributed group: the same engine steps as rank 0, and nothing else.

    It serves no gRPC, health or metrics. It ends when rank 0 shares its stop (exit 0), or
    when the lockstep breaks (exit 1). A signal here only arms a deadline for that stop.
    """
    assert not lockstep.leads
    from .engine import Engine

    engine = Engine(config.engine, _Discard(), lockstep=lockstep)

    def on_signal(signum: int, frame: object) -> None:
        deadline = config.shutdown_grace_s + lockstep.timeout_s
        log.info("signal %d: waiting up to %.0f s for rank 0 to stop the group", signum, deadline)
        timer = threading.Timer(deadline, lambda: os._exit(1))
        timer.daemon = True
        timer.start()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    try:
        engine.start(resolve_files(config).info)
        engine.wait_ready()
    except (EngineStartupError, ModelLoadError, OSError) as exc:
        log.error("cannot serve: %s", exc)
        return 1
    on_ready()
    log.info("ready: rank %d of %d follows rank 0", lockstep.rank, lockstep.size)
    engine.join()
    if engine.failure is not None:
        log.error("%s", engine.failure)
        return 1
    log.info("stopped with rank 0")
    return 0
