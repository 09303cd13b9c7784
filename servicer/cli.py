"""Command line: `mlx-grpc-worker` / `python -m servicer`."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import sys
import tempfile
import threading
from collections.abc import Callable, Coroutine
from functools import partial
from pathlib import Path
from types import MappingProxyType
from typing import Any

from .engine_config import (
    KV_BITS,
    KV_GROUP_SIZES,
    EngineConfig,
    SpeculationConfig,
)
from .faces import parse_protocols
from .faults import ENV_VAR as FAULTS_ENV_VAR
from .faults import FaultPlan
from .handlers import HandlerOptions
from .kv_transfer import ROLES, TRANSFERS, KvTransferOptions
from .media import MediaPolicy
from .model_files import ModelSpec
from .server import ServerConfig, run_follower, run_worker


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative(text: str) -> float:
    value = float(text)
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _at_least_one(text: str) -> float:
    value = float(text)
    if not 1.0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 1, got {text}")
    return value


_UNITS = MappingProxyType({"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40})


def _size(text: str) -> int:
    """Bytes, with an optional K/M/G/T suffix (powers of 1024)."""
    number, unit = text.strip().upper().rstrip("IB").rstrip("B"), ""
    if number and number[-1] in _UNITS:
        number, unit = number[:-1], number[-1]
    try:
        value = int(float(number) * _UNITS[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 512M or 8G)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
    return value


def _adapter(text: str) -> tuple[str, str, int | None]:
    """NAME=PATH[@PORT] -> (name, path, port or None)."""
    name, sep, rest = text.partition("=")
    path, at, port = rest.rpartition("@") if "@" in rest else (rest, "", "")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"not NAME=PATH[@PORT]: {text!r}")
    if at and not port.isdigit():
        raise argparse.ArgumentTypeError(f"the port of {text!r} is not a number")
    return name.strip(), path.strip(), int(port) if at else None


def adapter_ports(adapters: list[tuple[str, str, int | None]], port: int) -> tuple:
    """Each adapter's (name, port): its own, or the next after `port` in order (0: any free
    port); a name or port used twice is refused."""
    names = [name for name, _, _ in adapters]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise SystemExit(f"--adapter: each name once (used twice: {', '.join(twice)})")
    ports = [
        (name, p if p is not None else (port + 1 + i if port else 0))
        for i, (name, _, p) in enumerate(adapters)
    ]
    taken = [p for _, p in ports if p] + ([port] if port else [])
    if len(taken) != len(set(taken)):
        raise SystemExit(f"--adapter: each address its own port (ports: {sorted(taken)})")
    return tuple(ports)


def _default(config: type, name: str) -> Any:
    """The default of field `name` of the config dataclass `config`: a flag that sets that
    field takes its default from there, never a copy of its own."""
    for each in dataclasses.fields(config):
        if each.name == name:
            if each.default_factory is not dataclasses.MISSING:
                return each.default_factory()
            assert each.default is not dataclasses.MISSING, f"{config.__name__}.{name}"
            return each.default
    raise AssertionError(f"{config.__name__} has no field {name!r}")


def _on_off(value: bool) -> str:
    return "on" if value else "off"


def _size_text(value: int) -> str:
    """`value` bytes as `_size` reads them: 32G, 16M, 512."""
    for unit, scale in sorted(_UNITS.items(), key=lambda item: -item[1]):
        if value % scale == 0:
            return f"{value // scale}{unit}"
    raise AssertionError("a scale of 1 divides every value")


def _number(value: float) -> str:
    return f"{value:g}"


def _flag(
    parser: argparse.ArgumentParser,
    config: type,
    flag: str,
    field: str,
    text: str,
    show: Callable[[Any], str] | None = None,
    **options: Any,
) -> None:
    """Add `flag`, which sets field `field` of the config dataclass `config` and takes its
    default from there (`_default`); with `show`, a "{}" in its help `text` is that default as
    `show` writes it."""
    default = _default(config, field)
    text = text.format(show(default)) if show is not None else text
    parser.add_argument(flag, default=default, help=text, **options)


def _add_kv_transfer_flags(parser: argparse.ArgumentParser) -> None:
    """Prompt KV between workers: the router's prefill/decode split (vLLM face)."""
    kv = partial(_flag, parser, KvTransferOptions)
    kv(
        "--kv-role",
        "role",
        "this worker's part in the router's PD mode: prefill, decode or both (default %(default)s)",
        choices=ROLES,
    )
    kv(
        "--kv-transfer",
        "transfer",
        "how a decode worker gets a prefill worker's prompt KV: pull (from its block server) "
        "or shared (one --prompt-cache-dir both mount); implies --prompt-cache-shared "
        "(default: none, the decode worker prefills again)",
        choices=TRANSFERS,
    )
    kv(
        "--kv-transfer-host",
        "host",
        "the block server's address as decode workers reach it (default %(default)s)",
    )
    kv(
        "--kv-transfer-port",
        "port",
        "the block server's port (default: any free port; it is named in each answer)",
        type=int,
    )


def _add_media_flags(parser: argparse.ArgumentParser) -> None:
    """Images of a vision model's requests (vLLM face): where they may come from, how many and
    how large."""
    media = partial(_flag, parser, MediaPolicy)
    media(
        "--allowed-media-hosts",
        "allowed_hosts",
        "image URLs over http(s) are fetched from these hosts only (comma-separated names, "
        "*.suffix, * for any public host, IPs or CIDRs; a loopback, private or link-local "
        "address only when listed itself; default: none, data: URLs only)",
        type=lambda text: tuple(h.strip() for h in text.split(",") if h.strip()),
    )
    media(
        "--media-dir",
        "media_dir",
        "file:// image URLs are read from under this directory only (default: none)",
        type=Path,
    )
    media(
        "--max-images",
        "max_images",
        "most images a request may carry (default %(default)s)",
        type=_positive,
    )
    media(
        "--max-image-bytes",
        "max_bytes",
        "largest image file (default {})",
        _size_text,
        type=_size,
    )
    media(
        "--max-image-pixels",
        "max_pixels",
        "largest image, width x height (default %(default)s)",
        type=_positive,
    )
    _add_video_flags(parser)
    media(
        "--media-fetch-timeout",
        "fetch_timeout_s",
        "seconds a request's images may take to fetch (default %(default)s)",
        type=_non_negative,
    )


def _add_video_flags(parser: argparse.ArgumentParser) -> None:
    """Videos of a vision model's requests (Qwen3-VL, Qwen2.5-VL): how many, how large, how
    long."""
    media = partial(_flag, parser, MediaPolicy)
    media(
        "--max-videos",
        "max_videos",
        "most videos a request may carry (Qwen3-VL, Qwen2.5-VL; default %(default)s)",
        type=_positive,
    )
    media(
        "--max-video-bytes",
        "max_video_bytes",
        "largest video file (default {})",
        _size_text,
        type=_size,
    )
    media(
        "--max-video-frames",
        "max_video_frames",
        "most frames sampled from a video (the worker's sampling, or the router's) "
        "(default %(default)s)",
        type=_positive,
    )
    media(
        "--max-video-seconds",
        "max_video_seconds",
        "longest video, in seconds (default {})",
        _number,
        type=_non_negative,
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="mlx-grpc-worker",
        description="Serve an MLX model over the SMG router's mlx.grpc.engine.MlxEngine gRPC API.",
        allow_abbrev=False,  # a prefix of one flag is never read as another
    )
    engine, handlers, server, speculation = (
        partial(_flag, parser, config)
        for config in (EngineConfig, HandlerOptions, ServerConfig, SpeculationConfig)
    )
    parser.add_argument(
        "--model",
        help="local mlx-lm model directory, Hugging Face hub id, or demo:KIND for a built-in "
        "demo model (llama, hybrid, gemma3; built on first use, no download); omit for "
        "demo:llama",
    )
    parser.add_argument("--served-model-name", help="name reported to the router")
    engine(
        "--adapter-path",
        "adapter_path",
        "one LoRA adapter directory merged into the model at load",
    )
    parser.add_argument(
        "--adapter",
        action="append",
        type=_adapter,
        default=[],
        metavar="NAME=PATH[@PORT]",
        help="serve a LoRA/DoRA adapter (mlx-lm's format) beside the base model as NAME, on a "
        "port of its own (PORT; default: --port + 1, + 2, ... in order); repeatable",
    )
    host = _default(ServerConfig, "host")
    parser.add_argument("--host", default=host, help=f"address to bind (default {host})")
    port = _default(ServerConfig, "port")
    parser.add_argument(
        "--port", type=int, default=port, help=f"port to bind (default {port}; 0: any free port)"
    )
    server(
        "--protocols",
        "protocols",
        "router services to answer: mlx (default), vllm, or mlx,vllm. The smg router "
        "takes a port that answers vllm for a vLLM worker and then sends it n > 1, stop "
        "strings, structured output, embeddings, load polls and KV event subscriptions",
        type=_protocols,
    )
    handlers(
        "--embedding-pooling",
        "embedding_pooling",
        "how Embed pools the model's hidden states: last (the last token's) or mean "
        "(default %(default)s)",
        choices=["last", "mean"],
    )
    _add_media_flags(parser)
    _add_kv_transfer_flags(parser)
    engine(
        "--encoder-cache-size",
        "encoder_cache_bytes",
        "image features kept for images seen again (default {})",
        _size_text,
        type=_size,
    )
    engine(
        "--completion-batch-size",
        "completion_batch_size",
        "most requests decoding at once (default %(default)s)",
        type=_positive,
    )
    engine(
        "--prefill-batch-size",
        "prefill_batch_size",
        "most prompts prefilled together (default %(default)s)",
        type=_positive,
    )
    engine(
        "--prefill-step-size",
        "prefill_step_size",
        "prompt tokens processed per prefill step (default %(default)s)",
        type=_positive,
    )
    engine(
        "--max-prefill-stall-ms",
        "max_prefill_stall_ms",
        "while requests decode, a step prefills only as much prompt as fits this many "
        "milliseconds, learned as the worker runs (default {}; 0: full "
        "--prefill-step-size "
        "chunks, as mlx-lm does)",
        _number,
        type=_non_negative,
    )
    engine(
        "--max-prefill-stall-widen",
        "max_prefill_stall_widen",
        "while prompts queue up faster than the budget lets them in, the budget widens "
        "step by step up to this many times --max-prefill-stall-ms, and narrows back once "
        "the line is empty (default {}; 1: never widen)",
        _number,
        type=_at_least_one,
    )
    engine(
        "--fuse-prefill",
        "fuse_prefill",
        "put a prompt's prefill chunk through the same forward as the decoding rows' "
        "step, one read of the weights for both, on models with a standard attention "
        "(Llama, Qwen2/3, Gemma 3 text; outputs bit-identical; default {}: "
        "measure it on your machine, bench/fused_step.py)",
        _on_off,
        action=argparse.BooleanOptionalAction,
    )
    engine(
        "--group-rows",
        "group_rows",
        "decoding rows of very different lengths (a long prompt beside short streams) "
        "attend in groups instead of one batch padded to the longest row, on models with a "
        "standard attention (Llama, Qwen2/3, Gemma 3 text; default {})",
        _on_off,
        action=argparse.BooleanOptionalAction,
    )
    handlers(
        "--max-prompt-tokens",
        "max_prompt_tokens",
        "refuse longer prompts (default: the model's context length - 1)",
        type=_positive,
    )
    engine(
        "--prompt-cache-size",
        "prompt_cache_size",
        "prompt blocks kept in RAM for prefix reuse (default %(default)s; 0 turns prefix "
        "reuse off)",
        type=int,
    )
    engine(
        "--prompt-cache-bytes",
        "prompt_cache_bytes",
        "bytes the kept prompt blocks may hold in RAM, e.g. 4G (default: a quarter of "
        "--max-kv-memory, at most 1G)",
        type=_size,
    )
    engine(
        "--prompt-cache-block",
        "prompt_cache_block",
        "tokens per prompt block (default %(default)s)",
        type=_positive,
    )
    engine(
        "--prompt-cache-snapshot-interval",
        "prompt_cache_snapshot_interval",
        "tokens between snapshots of recurrent and sliding-window state during prefill "
        "(default: chosen from the model so they add at most a quarter to a prompt's KV bytes)",
        type=_positive,
    )
    engine(
        "--prompt-cache-dir",
        "prompt_cache_dir",
        "keep prompt blocks evicted from RAM in this directory, across restarts "
        "(default: no disk tier)",
    )
    parser.add_argument(
        "--prompt-cache-shared",
        action="store_true",
        help="share --prompt-cache-dir with other workers of the same model: each writes its "
        "blocks through and reuses the others' (default: one worker owns the directory)",
    )
    engine(
        "--prompt-cache-disk-bytes",
        "prompt_cache_disk_bytes",
        "bytes the disk tier may hold (default {})",
        _size_text,
        type=_size,
    )
    engine(
        "--max-kv-memory",
        "max_kv_memory",
        "KV and recurrent-state bytes running requests may reserve, e.g. 8G (default: "
        "half the device's memory less the weights); a request that cannot fit alone gets "
        "RESOURCE_EXHAUSTED",
        type=_size,
    )
    handlers(
        "--max-queued-requests",
        "max_queued_requests",
        "refuse new requests with RESOURCE_EXHAUSTED while this many wait (default %(default)s)",
        type=_positive,
    )
    handlers(
        "--max-load-wait",
        "max_load_wait_s",
        "seconds a request that arrives while the model loads waits for it, within the "
        "call's own deadline, before it is refused with RESOURCE_EXHAUSTED (default "
        "{}; 0: refuse at once)",
        _number,
        type=_non_negative,
    )
    handlers(
        "--stream-interval",
        "stream_interval",
        "tokens per streamed chunk after the first (default %(default)s); more sends fewer "
        "messages "
        "and leaves more CPU to the engine",
        type=_positive,
    )
    handlers(
        "--stream-window-ms",
        "stream_window_ms",
        "after the first token, a token waits at most this long for more tokens to share "
        "its chunk (default {}; 0: every token as soon as it is sampled); a model "
        "slower than this per token streams every token at once",
        _number,
        type=_non_negative,
        metavar="MS",
    )
    handlers(
        "--prepend-bos",
        "prepend_bos",
        "put the model's BOS before a prompt whose ids do not start with it, when the "
        "model's tokenizer adds one to every encoding (Gemma, Llama; never for models with "
        "no BOS, such as Qwen); the smg router sends raw-text completions without it "
        "(default {}; --no-prepend-bos sends the ids as they come)",
        _on_off,
        action=argparse.BooleanOptionalAction,
    )
    engine(
        "--kv-bits",
        "kv_bits",
        "keep the attention layers' KV cache quantized to this many bits, about 0.53x "
        "(8) or 0.28x (4) of float16's bytes, so --max-kv-memory admits about 1.9x or 3.5x "
        "the requests (default: the model's dtype; recurrent state stays as it is)",
        type=int,
        choices=KV_BITS,
    )
    engine(
        "--kv-group-size",
        "kv_group_size",
        "values that share one scale and bias in the quantized KV cache; must divide "
        "the model's attention head size (default: the largest of 64 and 32 that does)",
        type=int,
        choices=KV_GROUP_SIZES,
    )
    parser.add_argument(
        "--speculate",
        choices=["ngram", "draft", "off"],
        help="speculative decoding: ngram drafts from n-gram matches in the request's own "
        "prompt and output (no extra model; the default: each batch size drafts only while "
        "it measures that drafting pays); draft drafts with --draft-model; off never drafts. "
        "Off by itself where the model's caches cannot roll back, and with --distributed",
    )
    engine(
        "--draft-model",
        "draft_model",
        "a smaller model sharing the target's tokenizer that drafts for speculative "
        "decoding: a directory, hub id or demo:KIND (implies --speculate draft)",
    )
    speculation(
        "--speculate-k",
        "k_max",
        "most draft tokens a request verifies in one step (default %(default)s; adapts per "
        "request to its acceptance)",
        type=_positive,
    )
    speculation(
        "--speculate-max-batch",
        "max_rows",
        "with more decoding requests than this in the batch (drafting or not) a step "
        "runs without drafts, since verifying then costs more than it saves (default %(default)s, "
        "measured on a CPU; GPUs pay to larger batches); at or below it each step drafts "
        "only when it measures that it pays",
        type=_positive,
    )
    engine(
        "--step-timeout",
        "step_timeout_s",
        "seconds one engine step may run (at least; 8x the longest step so far when "
        "that is more) before the worker takes it for a hang: every request fails with "
        "UNAVAILABLE and the worker exits non-zero (default {}; 0: no watchdog)",
        _number,
        type=_non_negative,
    )
    server(
        "--max-message-bytes",
        "max_message_bytes",
        "largest gRPC message accepted or sent (default {})",
        _size_text,
        type=_positive,
    )
    server(
        "--metrics-port",
        "metrics_port",
        "serve Prometheus metrics on http://HOST:PORT/metrics (default: off)",
        type=int,
    )
    parser.add_argument("--tls-cert", type=Path, help="PEM certificate chain: serve over TLS")
    parser.add_argument("--tls-key", type=Path, help="PEM private key for --tls-cert")
    server(
        "--shutdown-grace",
        "shutdown_grace_s",
        "seconds in-flight requests get to finish after SIGTERM (default {})",
        _number,
        type=float,
    )
    server(
        "--engine-mode",
        "engine_mode",
        "process: the engine runs in a child process, so serving and stepping do not "
        "share one GIL (default); thread: in the server's own process (embedding; a "
        "--distributed worker always does this)",
        choices=["process", "thread"],
    )
    parser.add_argument(
        "--distributed",
        action="store_true",
        help="serve one model sharded over the processes of an mx.distributed group (start "
        "them with mlx.launch); rank 0 serves gRPC, the others follow its steps",
    )
    parser.add_argument(
        "--distributed-backend",
        default="any",
        choices=["any", "ring", "jaccl", "mpi", "nccl"],
        help="mx.distributed backend (default: the first that works)",
    )
    parser.add_argument(
        "--distributed-timeout",
        type=float,
        default=60.0,
        help="seconds without lockstep progress before a rank gives up on its peers and exits "
        "(default 60; startup may take ten times as long)",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="logging level (default info)",
    )
    args = parser.parse_args(argv)
    if (args.tls_cert is None) != (args.tls_key is None):
        parser.error("--tls-cert and --tls-key go together")
    if args.draft_model is not None and args.speculate in (None, "draft"):
        args.speculate = "draft"
    elif args.draft_model is not None:
        parser.error("--draft-model drafts for --speculate draft, not --speculate ngram")
    if args.speculate == "draft" and args.draft_model is None:
        parser.error("--speculate draft needs --draft-model PATH|demo:KIND")
    if args.speculate not in (None, "off") and args.distributed:
        parser.error("--speculate is not supported with --distributed (yet): leave it off")
    if args.speculate is None:
        args.speculate = "off" if args.distributed else "ngram"
    if args.kv_transfer is not None:
        args.prompt_cache_shared = True
        if args.prompt_cache_dir is None and args.kv_transfer == "pull":
            args.prompt_cache_dir = tempfile.mkdtemp(prefix="mlx-grpc-worker-kv-")
    if args.prompt_cache_shared and args.prompt_cache_dir is None:
        parser.error("--prompt-cache-shared and --kv-transfer shared need --prompt-cache-dir")
    return args


def _protocols(text: str) -> tuple[str, ...]:
    try:
        return parse_protocols(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _media_policy(args: argparse.Namespace) -> MediaPolicy:
    return MediaPolicy(
        allowed_hosts=args.allowed_media_hosts,
        media_dir=args.media_dir,
        max_bytes=args.max_image_bytes,
        max_pixels=args.max_image_pixels,
        max_images=args.max_images,
        max_videos=args.max_videos,
        max_video_bytes=args.max_video_bytes,
        max_video_frames=args.max_video_frames,
        max_video_seconds=args.max_video_seconds,
        fetch_timeout_s=args.media_fetch_timeout,
    )


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    engine = EngineConfig(
        adapter_path=args.adapter_path,
        adapters=tuple((name, path) for name, path, _ in args.adapter),
        completion_batch_size=args.completion_batch_size,
        prefill_batch_size=args.prefill_batch_size,
        prefill_step_size=args.prefill_step_size,
        max_prefill_stall_ms=args.max_prefill_stall_ms,
        max_prefill_stall_widen=args.max_prefill_stall_widen,
        fuse_prefill=args.fuse_prefill,
        group_rows=args.group_rows,
        prompt_cache_size=args.prompt_cache_size,
        prompt_cache_bytes=args.prompt_cache_bytes,
        prompt_cache_block=args.prompt_cache_block,
        prompt_cache_snapshot_interval=args.prompt_cache_snapshot_interval,
        prompt_cache_dir=args.prompt_cache_dir,
        prompt_cache_disk_bytes=args.prompt_cache_disk_bytes,
        prompt_cache_shared=args.prompt_cache_shared,
        max_kv_memory=args.max_kv_memory,
        kv_bits=args.kv_bits,
        kv_group_size=args.kv_group_size,
        speculate=None if args.speculate == "off" else args.speculate,
        draft_model=args.draft_model,
        speculation=SpeculationConfig(k_max=args.speculate_k, max_rows=args.speculate_max_batch),
        step_timeout_s=args.step_timeout,
        encoder_cache_bytes=args.encoder_cache_size,
        faults=FaultPlan.parse(faults) if (faults := os.environ.get(FAULTS_ENV_VAR)) else None,
    )
    handlers = HandlerOptions(
        media=_media_policy(args),
        max_prompt_tokens=args.max_prompt_tokens,
        max_queued_requests=args.max_queued_requests,
        stream_interval=args.stream_interval,
        stream_window_ms=args.stream_window_ms,
        prepend_bos=args.prepend_bos,
        max_load_wait_s=args.max_load_wait,
        embedding_pooling=args.embedding_pooling,
        kv=KvTransferOptions(
            role=args.kv_role,
            transfer=args.kv_transfer,
            host=args.kv_transfer_host,
            port=args.kv_transfer_port,
        ),
    )
    return ServerConfig(
        model=ModelSpec(args.model, args.served_model_name),
        engine_mode=args.engine_mode,
        engine=engine,
        handlers=handlers,
        host=args.host,
        port=args.port,
        shutdown_grace_s=args.shutdown_grace,
        max_message_bytes=args.max_message_bytes,
        metrics_port=args.metrics_port,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        protocols=args.protocols,
        adapter_ports=adapter_ports(args.adapter, args.port),
    )


# transformers says at import that PyTorch is missing (it is not needed here): nothing a user
# of the worker can act on, so it stays out of the log, in this process and the engine's.
QUIET_TRANSFORMERS = {"TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    for name, value in QUIET_TRANSFORMERS.items():
        os.environ.setdefault(name, value)
    rank = (
        f"[rank {os.environ['MLX_RANK']}] " if args.distributed and "MLX_RANK" in os.environ else ""
    )
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s %(levelname)s {rank}%(name)s: %(message)s",
    )
    config = config_from_args(args)
    if not args.distributed:
        sys.exit(_run_loop(run_worker(config)))
    sys.exit(_run_distributed(config, args))


def _run_distributed(config: ServerConfig, args: argparse.Namespace) -> int:
    from .engine.lockstep import Lockstep, connect

    # Joining the group and loading the shards block in native code when a peer never shows
    # up; only exiting the process ends that.
    startup = threading.Timer(10 * args.distributed_timeout, _give_up_starting)
    startup.daemon = True
    startup.start()
    lockstep = Lockstep(
        connect(args.distributed_backend),
        timeout_s=args.distributed_timeout,
        heartbeat_s=min(0.5, args.distributed_timeout / 4),
    )
    if lockstep.leads:
        code = _run_loop(run_worker(config, on_ready=startup.cancel, lockstep=lockstep))
    else:
        code = run_follower(config, lockstep, on_ready=startup.cancel)
    # A peer may still hold a collective open: leave without waiting on native teardown.
    logging.shutdown()
    os._exit(code)


def _run_loop(main: Coroutine[Any, Any, int]) -> int:
    """Run the server's event loop: uvloop where installed (less CPU per streamed message)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def _give_up_starting() -> None:
    logging.getLogger(__name__).critical("the distributed group did not start in time; exiting")
    logging.shutdown()
    os._exit(1)
