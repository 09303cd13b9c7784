"""Prompt KV between workers (handler side; no MLX): the router's prefill/decode split, and a
prompt cache several workers share.

Every block a worker with `--prompt-cache-shared` (or a `--kv-transfer` mode) keeps is
written through to its disk tier as a file named by the block's key. So moving KV is moving
files, which the disk tier already writes atomically, checksums and loads off the engine thread:
- `shared`: the workers share one directory. Before a request goes to the engine, the handlers
  look there for its prompt's blocks by name (`SharedBlocks.find`), check each header against
  the prompt, and hand what they found to the engine, which loads it as a disk hit.
- `pull`: a prefill worker names its prompt's blocks in `kv_transfer_params_json`, keeps their
  files open until fetched or `pin_s` passes, and serves them on its block server; the decode
  worker fetches them over one connection, checks them and puts them in its own directory.
Any fault is a local prefill (counted), never a wrong token: a file is used only when its
checksum, model identity, key, parent and tokens are the ones the prompt names.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import ssl
import struct
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from prometheus_client.core import CounterMetricFamily

from .engine.prefix.disk_tier import read_block, read_header
from .engine.prefix.keys import ROOT, block_key
from .messages import EngineStartupError, FoundBlock, GenerationRequest, ImageInput
from .validation import RequestError

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "both")
TRANSFERS = ("pull", "shared")
CONNECTORS = {"pull": "NixlConnector", "shared": "SharedStorageConnector"}
PARAMS_MARK = "mlx_grpc_worker_blocks"  # this worker's kind of kv_transfer_params_json
_SUFFIX = ".blk"
_LENGTH = struct.Struct("<Q")
MAX_REQUEST_BYTES = 1 << 20  # a block server request (JSON of keys)
KEEPALIVE_S = 1.0
MANIFEST_FRESH_S = 600.0  # a PD worker's entry in a shared directory this old is gone


@dataclass(frozen=True)
class KvTransferOptions:
    role: str = "both"  # prefill | decode | both
    transfer: str | None = None  # pull | shared | None (no connector)
    host: str = "127.0.0.1"  # the block server's address, as peers reach it
    port: int = 0  # the block server's port (0: any free one)
    # A prefill's answer waits this long for its blocks' files, at most: smg 1.13 takes a
    # prefill leg silent for 3 s for a failed one.
    publish_wait_s: float = 1.5
    fetch_timeout_s: float = 10.0  # a decode request waits this long for a peer's blocks
    pin_s: float = 60.0  # a prefill's files stay open for its decode this long at most


@dataclass
class KvTransferCounters:
    fetched_blocks: int = 0
    fetched_bytes: int = 0
    fetch_seconds: float = 0.0
    failures: int = 0  # transfers that ended in a local prefill
    found_blocks: int = 0  # blocks found in the shared directory for requests


class KvTransferCollector:
    """The transfer counters as Prometheus counters (read from the metrics HTTP thread)."""

    HELP = {
        "fetched_blocks": "Prompt blocks fetched from prefill workers",
        "fetched_bytes": "Bytes of the prompt blocks fetched from prefill workers",
        "fetch_seconds": "Seconds spent fetching prompt blocks from prefill workers",
        "failures": "KV transfers that failed, their prompts prefilled here instead",
        "found_blocks": "Prompt blocks found for requests in the shared directory or fetched",
    }

    def __init__(self, counters: KvTransferCounters) -> None:
        self._counters = counters

    def collect(self) -> Iterator[CounterMetricFamily]:
        for name, text in self.HELP.items():
            value = getattr(self._counters, name)
            yield CounterMetricFamily(f"mlx_worker_kv_transfer_{name}", text, value=value)


class SharedBlocks:
    """One model's block files in a disk tier directory, found by the prompt's block names."""

    def __init__(self, directory: Path, block_size: int) -> None:
        self.dir = directory
        self.model_id = directory.name  # the disk tier namespaces by the model's identity
        self.block_size = block_size

    def path(self, key: bytes) -> Path:
        return self.dir / f"{key.hex()}{_SUFFIX}"

    def find(self, prompt: list[int], keys: tuple[bytes, ...]) -> tuple[FoundBlock, ...]:
        """The prompt's blocks on disk from its start: its full blocks while their files are
        there, then the longest partial block where the first one is missing."""
        found: list[FoundBlock] = []
        size = self.block_size
        parent: bytes | None = None
        for i, key in enumerate(keys):
            block = self.checked(key, parent, tuple(prompt[i * size : (i + 1) * size]))
            if block is None:
                break
            found.append(block)
            parent = key
        start = len(found) * size
        window = prompt[start : start + size]
        longest = min(len(window), size - 1)
        for length in range(longest, 0, -1):
            tokens = tuple(window[:length])
            block = self.checked(block_key(parent or ROOT, tokens), parent, tokens)
            if block is not None:
                found.append(block)
                break
        return tuple(found)

    def checked(
        self, key: bytes, parent: bytes | None, tokens: tuple[int, ...]
    ) -> FoundBlock | None:
        """The block file for `key`, when there is one of this model whose header names this
        key, parent and tokens (its contents are checked when it loads)."""
        path = self.path(key)
        try:
            block, size = read_header(path, self.model_id)
        except Exception:  # absent, partial, foreign or corrupt: not found
            return None
        if block.key != key or block.parent != parent or block.tokens != tokens:
            return None
        return FoundBlock(key, parent, tokens, str(path), size, block.snapshot)

    def covers(self, prompt: list[int], found: tuple[FoundBlock, ...]) -> bool:
        """Whether `found` holds all a hit on `prompt` can use (all but its last token)."""
        return sum(len(block.tokens) for block in found) >= len(prompt) - 1

    def chain(
        self, prompt: list[int], keys: tuple[bytes, ...], named: list[bytes]
    ) -> list[tuple[bytes, bytes | None, tuple[int, ...]]] | None:
        """`named` as blocks of this prompt: (key, parent, tokens) each, its full blocks in
        order and at most one partial block last; None when they are not."""
        size, out = self.block_size, []
        parent: bytes | None = None
        for i, key in enumerate(named):
            window = tuple(prompt[i * size : (i + 1) * size])
            if i < len(keys) and key == keys[i]:
                out.append((key, parent, window))
                parent = key
                continue
            if i != len(named) - 1:
                return None
            for length in range(min(len(window), size - 1), 0, -1):
                if block_key(parent or ROOT, window[:length]) == key:
                    return [*out, (key, parent, window[:length])]
            return None
        return out

    def _image_path(self, mm_hash: str) -> Path:
        name = hashlib.blake2b(mm_hash.encode(), digest_size=16).hexdigest()
        return self.dir / "images" / name

    def name_images(self, images: dict[str, bytes]) -> None:
        """Record the keys of the router's images (by its hash), for a decode worker."""
        for mm_hash, key in images.items():
            path = self._image_path(mm_hash)
            with contextlib.suppress(OSError):
                path.parent.mkdir(exist_ok=True)
                tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
                tmp.write_text(key.hex())
                os.replace(tmp, path)

    def image_keys(self, hashes: list[str]) -> dict[str, bytes]:
        found = {}
        for mm_hash in hashes:
            with contextlib.suppress(OSError, ValueError):
                found[mm_hash] = bytes.fromhex(self._image_path(mm_hash).read_text())
        return found

    def accept(self, data: bytes, key: bytes, parent: bytes | None, tokens: tuple) -> FoundBlock:
        """A fetched file, checked whole (checksum, model, key, parent, tokens), published
        in this directory; ValueError when it does not hold."""
        path = self.path(key)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.fetch.tmp")
        tmp.write_bytes(data)
        try:
            block = read_block(tmp, self.model_id)
            if block.key != key or block.parent != parent or block.tokens != tokens:
                raise ValueError("the file holds another block")
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()
        return FoundBlock(key, parent, tokens, str(path), len(data), block.snapshot)


class BlockServer:
    """The prefill side of `pull`: serves block files to decode workers over TCP, keeping the
    files a finished prefill named open (so eviction cannot take them) until fetched or
    `pin_s` passes. One request per connection: a length-prefixed JSON
    {"transfer": id, "keys": [hex]}, answered by each file's length and bytes (length 0: none)."""

    def __init__(
        self, blocks: SharedBlocks, options: KvTransferOptions, tls: ssl.SSLContext | None
    ) -> None:
        self.blocks = blocks
        self.options = options
        self.tls = tls
        self.port = 0
        self._pins: dict[str, tuple[float, dict[str, int]]] = {}  # transfer -> deadline, fds
        self._server: asyncio.Server | None = None

    async def start(self) -> int:
        host, port = self.options.host, self.options.port
        self._server = await asyncio.start_server(self._serve, host, port, ssl=self.tls)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for transfer in list(self._pins):
            self._unpin(transfer)

    def pin(self, found: tuple[FoundBlock, ...]) -> str:
        """Keep these files open for a decode worker; returns the transfer's id."""
        self._expire()
        fds = {}
        for block in found:
            with contextlib.suppress(OSError):
                fds[block.key.hex()] = os.open(block.path, os.O_RDONLY)
        transfer = uuid.uuid4().hex
        self._pins[transfer] = (time.monotonic() + self.options.pin_s, fds)
        return transfer

    def _unpin(self, transfer: str) -> None:
        _, fds = self._pins.pop(transfer, (0.0, {}))
        for fd in fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)

    def _expire(self) -> None:
        now = time.monotonic()
        for transfer in [t for t, (deadline, _) in self._pins.items() if deadline < now]:
            self._unpin(transfer)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
            if length > MAX_REQUEST_BYTES:
                return
            ask = json.loads(await reader.readexactly(length))
            transfer, keys = str(ask.get("transfer", "")), [str(k) for k in ask["keys"]]
            fds = self._pins.get(transfer, (0.0, {}))[1]
            for key in keys:
                data = await asyncio.to_thread(self._read, fds.get(key), key)
                writer.write(_LENGTH.pack(len(data)) + data)
                await writer.drain()
            self._unpin(transfer)  # fetched
        except (OSError, ValueError, KeyError, TypeError, asyncio.IncompleteReadError) as exc:
            log.debug("block server: a request failed: %s", exc)
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    def _read(self, fd: int | None, key: str) -> bytes:
        try:
            if fd is not None:
                return os.pread(fd, os.fstat(fd).st_size, 0)
            return self.blocks.path(bytes.fromhex(key)).read_bytes()
        except (OSError, ValueError):
            return b""


async def fetch_blocks(
    host: str,
    port: int,
    transfer: str,
    keys: list[str],
    timeout_s: float,
    tls: ssl.SSLContext | None = None,
) -> list[bytes]:
    """Block files from a peer's block server, in the order of `keys` (empty: it has none)."""

    async def fetch() -> list[bytes]:
        reader, writer = await asyncio.open_connection(host, port, ssl=tls)
        try:
            ask = json.dumps({"transfer": transfer, "keys": keys}).encode()
            writer.write(_LENGTH.pack(len(ask)) + ask)
            await writer.drain()
            files = []
            for _ in keys:
                (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
                files.append(await reader.readexactly(length))
            return files
        finally:
            writer.close()

    return await asyncio.wait_for(fetch(), timeout_s)


class KvTransfer:
    """A worker's side of moving prompt KV: what GetServerInfo advertises, blocks found or
    fetched for a request before it goes to the engine, and a prefill's answer held until
    its blocks are published (and, for `pull`, named in its kv_transfer_params_json)."""

    def __init__(self, options: KvTransferOptions, block_size: int, kv_cache_dtype: str) -> None:
        self.options = options
        self.block_size = block_size
        self.kv_cache_dtype = kv_cache_dtype
        self.engine_id = uuid.uuid4().hex
        self.counters = KvTransferCounters()
        self.blocks: SharedBlocks | None = None
        self.server: BlockServer | None = None
        self.model_id = ""
        self._client_tls: ssl.SSLContext | None = None
        self._manifest: Path | None = None  # this PD worker's entry in a shared directory
        self._touched = 0.0

    async def attach(
        self,
        shared_dir: str,
        tls_cert: Path | None = None,
        tls_key: Path | None = None,
        model_name: str = "",
    ) -> None:
        """The engine is warm; `shared_dir` is its disk tier's directory when blocks are
        written through ("": none, and nothing here does anything). With the gRPC port's
        certificate and key, the block server speaks TLS, and this worker's fetches trust
        that certificate (a pair shares one, or one CA)."""
        if not shared_dir or not self.block_size:
            return
        self.blocks = SharedBlocks(Path(shared_dir), self.block_size)
        self.model_id = self.blocks.model_id
        if self.options.transfer == "shared" and self.options.role != "both":
            self._manifest = Path(shared_dir).parent / "workers" / f"{self.engine_id}.json"
            await asyncio.to_thread(self._check_pairs, model_name)
        server_tls = None
        if tls_cert is not None and tls_key is not None:
            server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            server_tls.load_cert_chain(tls_cert, tls_key)
            self._client_tls = ssl.create_default_context(cafile=str(tls_cert))
            self._client_tls.check_hostname = False  # peers are named by address; the chain holds
        if self.options.transfer == "pull" and self.options.role != "decode":
            self.server = BlockServer(self.blocks, self.options, server_tls)
            port = await self.server.start()
            log.info("block server for decode workers on %s:%d", self.options.host, port)

    def _check_pairs(self, model_name: str) -> None:
        """A PD worker on a shared directory: EngineStartupError when a worker of the other
        role serves the same model with another KV layout there (their blocks could never be
        shared); else this worker's own entry, for the next to check."""
        assert self._manifest is not None
        me = {"model": model_name, "layout": self.model_id, "role": self.options.role}
        me |= {"block_size": self.block_size, "kv_cache_dtype": self.kv_cache_dtype}
        self._manifest.parent.mkdir(exist_ok=True)
        for path in self._manifest.parent.glob("*.json"):
            try:
                if time.time() - path.stat().st_mtime > MANIFEST_FRESH_S:
                    continue
                peer = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            role = peer.get("role")
            other = role not in (me["role"], "both")
            if other and peer.get("model") == model_name and peer.get("layout") != self.model_id:
                raise EngineStartupError(
                    f"a mismatched PD pair: the {role} worker {path.stem} on this prompt cache "
                    f"directory serves {model_name} with another KV layout (block size "
                    f"{peer.get('block_size')}, KV cache {peer.get('kv_cache_dtype')}; here "
                    f"{self.block_size}, {self.kv_cache_dtype}, or other model files): start "
                    "both with the same model files, --prompt-cache-block and --kv-bits"
                )
        tmp = self._manifest.with_suffix(".tmp")
        tmp.write_text(json.dumps(me))
        os.replace(tmp, self._manifest)
        self._touched = time.monotonic()

    def _touch(self) -> None:
        """Keep this worker's entry fresh (at most once a minute)."""
        if self._manifest is not None and time.monotonic() - self._touched > 60:
            self._touched = time.monotonic()
            with contextlib.suppress(OSError):
                os.utime(self._manifest)

    async def close(self) -> None:
        if self._manifest is not None:
            with contextlib.suppress(OSError):
                self._manifest.unlink()
        if self.server is not None:
            await self.server.close()

    def server_info(self) -> dict[str, Any]:
        """GetServerInfo's KV fields, from which the router picks its PD mode and pairs."""
        transfer = self.options.transfer
        if transfer is None:
            return {}
        return {
            "kv_connector": CONNECTORS[transfer],
            "kv_role": "kv_both",  # smg 1.13 takes a "kv_producer" prefill worker for unavailable
            "kv_engine_id": self.engine_id,
            "kv_cache_dtype": self.kv_cache_dtype,
        }

    async def prepare(
        self, request: Any, job: GenerationRequest, time_left_s: float | None
    ) -> GenerationRequest:
        """The request's prompt blocks another worker holds, for the engine to load: fetched
        from the peer its kv_transfer_params_json names, or found in the shared directory."""
        blocks = self.blocks
        if blocks is None or (not job.block_keys and len(job.store_prompt) < 2):
            return job
        self._touch()
        params = _params(request)
        if params is not None and self.options.role != "prefill":
            found = await self._pull(job, params, time_left_s)
        else:
            found = await asyncio.to_thread(blocks.find, job.store_prompt, job.block_keys)
        self.counters.found_blocks += len(found)
        how = "fetched" if params is not None else "shared"
        log.debug("request %r: %d prompt blocks %s", job.request_id, len(found), how)
        job.found_blocks = found
        covered = sum(len(block.tokens) for block in found)
        if any(_pixelless(image) and image.end > covered for image in job.images):
            message = "the router sent no pixels, and the prefill worker's KV past them is lost"
            raise RequestError(grpc.StatusCode.UNAVAILABLE, message)
        return job

    async def _pull(self, job: GenerationRequest, params: dict, deadline_s: float | None) -> tuple:
        blocks = self.blocks
        assert blocks is not None
        if params.get("model") != self.model_id:
            self._failed(job, "the prefill worker serves another model or KV layout")
            return ()
        keys = [k for k in params.get("keys", []) if isinstance(k, str)]
        try:
            named = [bytes.fromhex(k) for k in keys]
        except ValueError:
            named = []
        chain = blocks.chain(job.store_prompt, job.block_keys, named) if named else None
        if not chain:
            self._failed(job, "its kv_transfer_params name blocks of another prompt")
            return ()
        timeout = self.options.fetch_timeout_s
        if deadline_s is not None:
            timeout = min(timeout, deadline_s / 2)
        started = time.perf_counter()
        try:
            host, port = str(params["host"]), int(params["port"])
            tls = (self._client_tls or ssl.create_default_context()) if params.get("tls") else None
            transfer = str(params.get("transfer", ""))
            files = await fetch_blocks(host, port, transfer, keys, timeout, tls)
            found = await asyncio.to_thread(self._accept_all, files, chain)
        except Exception as exc:  # whatever went wrong: a local prefill
            self._failed(job, f"{type(exc).__name__}: {exc}")
            return ()
        counters = self.counters
        counters.fetched_blocks += len(found)
        counters.fetched_bytes += sum(len(f) for f in files)
        counters.fetch_seconds += time.perf_counter() - started
        return found

    def _accept_all(self, files: list[bytes], chain: list[tuple]) -> tuple[FoundBlock, ...]:
        """The fetched files that hold, in order, up to the first that is missing."""
        assert self.blocks is not None
        found = []
        for data, (key, parent, tokens) in zip(files, chain, strict=True):
            if not data:
                break
            found.append(self.blocks.accept(data, key, parent, tokens))
        return tuple(found)

    def _failed(self, job: GenerationRequest, why: str) -> None:
        self.counters.failures += 1
        log.warning(
            "KV transfer for %r failed, its prompt is prefilled here: %s", job.request_id, why
        )

    def keepalive_s(self) -> float | None:
        """How often a PD worker's answer says it is still at work until its first token (an
        empty chunk, even unstreamed): smg 1.13 fails a prefill or decode leg that sends
        nothing for 3 s (its blocks may still be fetched, its prompt wait behind others)."""
        return KEEPALIVE_S if self.options.role in ("prefill", "decode") else None

    async def image_keys(self, request: Any) -> dict[str, bytes]:
        """The keys a prefill worker gave the router's images (by the router's hash), for a
        decode leg that comes without their pixels: from its kv_transfer_params_json (`pull`)
        or the shared directory."""
        if self.blocks is None or "mm_inputs" not in _fields(request):
            return {}
        params = _params(request)
        if params is not None:
            named = params.get("images", {})
            return {str(h): bytes.fromhex(str(k)) for h, k in named.items()} if named else {}
        hashes = list(request.mm_inputs.mm_hashes)
        if not hashes or request.mm_inputs.HasField("pixel_values"):
            return {}
        return await asyncio.to_thread(self.blocks.image_keys, hashes)

    async def publish(self, request: Any, job: GenerationRequest, complete: Any) -> None:
        """A prefill worker's answer: once its prompt's blocks are files (at most
        `publish_wait_s`), and for `pull` named in its kv_transfer_params_json."""
        blocks = self.blocks
        if blocks is None or self.options.role != "prefill":
            return
        images = _router_image_keys(request, job)
        if images and self.options.transfer == "shared":
            await asyncio.to_thread(blocks.name_images, images)
        prompt, keys = job.store_prompt, job.block_keys
        deadline = time.monotonic() + self.options.publish_wait_s
        while True:
            found = await asyncio.to_thread(blocks.find, prompt, keys)
            if blocks.covers(prompt, found) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.005)
        if self.server is None or not found or "kv_transfer_params_json" not in _fields(complete):
            return
        params = {
            PARAMS_MARK: 1,
            "engine_id": self.engine_id,
            "model": self.model_id,
            "host": self.options.host,
            "port": self.server.port,
            "transfer": self.server.pin(found),
            "tls": self.server.tls is not None,
            "keys": [block.key.hex() for block in found],
            "images": {mm_hash: key.hex() for mm_hash, key in images.items()},
        }
        complete.kv_transfer_params_json = json.dumps(params)


def _router_image_keys(request: Any, job: GenerationRequest) -> dict[str, bytes]:
    """The router's hash of each image it processed itself -> the key the worker gave it."""
    if "mm_inputs" not in _fields(request) or not request.mm_inputs.mm_hashes:
        return {}
    hashes = list(request.mm_inputs.mm_hashes)
    images = [image for image in job.images if not image.spans]  # videos aside
    if len(hashes) != len(images):
        return {}
    return {h: image.key for h, image in zip(hashes, images, strict=True)}


def _pixelless(image: ImageInput) -> bool:
    """An image of a decode leg, served only from the prefill's blocks."""
    return image.pixel_values is None and not any(n.startswith("pixel") for n, _ in image.extra)


def _fields(message: Any) -> Any:
    return message.DESCRIPTOR.fields_by_name


def _params(request: Any) -> dict | None:
    """This worker's kind of kv_transfer_params_json on a request (None: none)."""
    if "kv_transfer_params_json" not in _fields(request) or not request.kv_transfer_params_json:
        return None
    try:
        params = json.loads(request.kv_transfer_params_json)
    except ValueError:
        return None
    return params if isinstance(params, dict) and params.get(PARAMS_MARK) == 1 else None
