"""The prefix store's disk tier: blocks evicted from RAM, in files that outlive the process.

Disk I/O never runs on the engine thread: a writer thread takes blocks from a bounded queue
(a full queue drops the write and counts it), a loader thread reads blocks back for a
waiting request, and the engine picks up both kinds of results at its next step. Every file
is written under a temporary name, fsynced and renamed, carries a SHA-256 of its contents
(checked on load) and the model's identity; any fault is a miss, never wrong output. The
directory is namespaced by that identity and locked: one worker owns it, or (`shared`) every
worker on it shares it, each writing its blocks through and finding the others' by name.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import importlib
import json
import logging
import os
import queue
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ...faults import FaultPlan
from ...ratelimit import RateLimitedLog

log = logging.getLogger(__name__)

MAGIC = b"MLXPBLK1"
FORMAT = 2
_SUFFIX = ".blk"
STALE_TMP_S = 600.0  # a shared directory's partial file this old has lost its writer
ARRAY_DTYPES = {  # MLX dtype name -> (numpy dtype to read the bytes back as, MLX view or None)
    "float32": ("float32", None),
    "float16": ("float16", None),
    "bfloat16": ("uint16", "bfloat16"),
    "int32": ("int32", None),
    "uint32": ("uint32", None),
    "int64": ("int64", None),
    "uint8": ("uint8", None),
    "int8": ("int8", None),
    "bool": ("bool", None),
}


class DiskTierError(RuntimeError):
    """The directory cannot be used at all (another worker holds it)."""


@dataclass(frozen=True)
class DiskEntry:
    path: Path


@dataclass(frozen=True)
class BlockFile:
    """What a file says about its block, and its payload when loaded."""

    key: bytes
    parent: bytes | None
    start: int
    tokens: tuple[int, ...]
    snapshot: bool
    meta: dict[str, Any]
    arrays: list[np.ndarray] = field(default_factory=list)


@dataclass
class Completion:
    """What a disk thread finished, for the engine thread to take in (and count)."""

    kind: str  # "written", "write_failed", "loaded", "load_failed"
    key: bytes
    path: Path | None = None
    nbytes: int = 0
    block: BlockFile | None = None
    seconds: float = 0.0
    snapshot: bool = False  # a written file holds the snapshot
    fault: str | None = None  # the kind of fault, for a failure
    message: str = ""


@dataclass
class DiskCounters:
    """Counted on the engine thread only (the disk threads report through completions)."""

    dropped_writes: int = 0
    faults: dict[str, int] = field(default_factory=dict)


def encode(block: BlockFile, model_id: str, arrays: list[memoryview]) -> list[bytes]:
    """The file's pieces: magic, header, arrays, and the SHA-256 of everything before it."""
    header = {
        "format": FORMAT,
        "model": model_id,
        "key": block.key.hex(),
        "parent": block.parent.hex() if block.parent is not None else None,
        "start": block.start,
        "tokens": list(block.tokens),
        "snapshot": block.snapshot,
        "meta": block.meta,
    }
    head = json.dumps(header, separators=(",", ":")).encode()
    pieces = [MAGIC, struct.pack("<I", len(head)), head, *(bytes(a) for a in arrays)]
    digest = hashlib.sha256()
    for piece in pieces:
        digest.update(piece)
    return [*pieces, digest.digest()]


def _parse_header(head: bytes, model_id: str) -> dict[str, Any]:
    header = json.loads(head)
    if header.get("format") != FORMAT or header.get("model") != model_id:
        raise ValueError("a block file of another model or format")
    return header


def _block(header: dict[str, Any], arrays: list[np.ndarray] | None = None) -> BlockFile:
    parent = bytes.fromhex(header["parent"]) if header["parent"] else None
    return BlockFile(
        bytes.fromhex(header["key"]),
        parent,
        int(header["start"]),
        tuple(header["tokens"]),
        bool(header["snapshot"]),
        header["meta"],
        arrays or [],
    )


def _file_size(head_length: int, header: dict[str, Any]) -> int:
    payload = sum(int(a["nbytes"]) for a in header["meta"]["arrays"])
    return len(MAGIC) + 4 + head_length + payload + 32


def read_header(path: Path, model_id: str) -> tuple[BlockFile, int]:
    """A file's header (the size is checked, the contents are not); ValueError when it is
    not a whole block file of this model."""
    with open(path, "rb") as file:
        if file.read(len(MAGIC)) != MAGIC:
            raise ValueError("not a block file")
        (length,) = struct.unpack("<I", file.read(4))
        header = _parse_header(file.read(length), model_id)
    size = _file_size(length, header)
    if path.stat().st_size != size:
        raise ValueError(f"truncated: {path.stat().st_size} of {size} bytes")
    return _block(header), size


def read_block(path: Path, model_id: str) -> BlockFile:
    """A whole block file, checked against its SHA-256; ValueError when it does not hold."""
    data = path.read_bytes()
    if len(data) < len(MAGIC) + 36 or hashlib.sha256(data[:-32]).digest() != data[-32:]:
        raise ValueError("checksum mismatch")
    if data[: len(MAGIC)] != MAGIC:
        raise ValueError("not a block file")
    (length,) = struct.unpack("<I", data[len(MAGIC) : len(MAGIC) + 4])
    offset = len(MAGIC) + 4
    header = _parse_header(data[offset : offset + length], model_id)
    if len(data) != _file_size(length, header):
        raise ValueError("its arrays do not fill it")
    offset += length
    arrays = []
    for spec in header["meta"]["arrays"]:
        numpy_dtype = ARRAY_DTYPES[spec["dtype"]][0]
        count = int(spec["nbytes"])
        raw = np.frombuffer(data, dtype=np.uint8, count=count, offset=offset)
        arrays.append(raw.view(numpy_dtype).reshape(spec["shape"]))
        offset += count
    return _block(header, arrays)


class DiskTier:
    """One model's block files under `root`, a writer and a loader thread, and what they
    finished for the engine to pick up."""

    def __init__(
        self,
        root: Path,
        model_id: str,
        max_bytes: int,
        queue_size: int = 64,
        faults: FaultPlan | None = None,
        shared: bool = False,
    ) -> None:
        self.model_id = model_id
        self.shared = shared
        self.max_bytes = max_bytes
        self.dir = root / model_id
        self.counters = DiskCounters()
        self.faults = faults
        self._log = RateLimitedLog(log, 30.0)
        self._lock_file: Any = None
        # Written through, a long prompt's blocks come at once: the queue holds them all.
        self._writes: queue.Queue[Any] = queue.Queue(queue_size * 64 if shared else queue_size)
        self._loads: queue.Queue[Any] = queue.Queue()
        self._done: deque[Completion] = deque()
        self._threads: list[threading.Thread] = []
        self.usable = False
        self.reason = ""
        self._wake: Callable[[], None] = lambda: None  # wakes the engine (on_done)

    def on_done(self, wake: Callable[[], None]) -> None:
        """`wake` is called (from a disk thread) whenever a write or a load finishes."""
        self._wake = wake

    # ----- startup -----

    def open(self) -> None:
        """Create and lock the directory (DiskTierError if another worker holds it); any
        other failure leaves the tier unusable (every lookup on it a miss) and says why."""
        try:
            if self.faults is not None:
                self.faults.before_disk_open()
            self.dir.mkdir(parents=True, exist_ok=True)
            lock_path = self.dir / "lock"
            self._lock_file = open(lock_path, "a+")  # noqa: SIM115 (held for the process)
            try:
                mode = fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX
                fcntl.flock(self._lock_file, mode | fcntl.LOCK_NB)
            except BlockingIOError:
                self._lock_file.close()
                self._lock_file = None
                raise DiskTierError(
                    f"the prompt cache directory {self.dir} is in use by another worker; give "
                    "each worker its own --prompt-cache-dir, or start all of them with "
                    "--prompt-cache-shared"
                ) from None
            probe = self.dir / f".probe-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except DiskTierError:
            raise
        except OSError as exc:
            self.reason = f"the prompt cache directory {self.dir} cannot be used: {exc}"
            self._count("directory")
            log.error("%s; the disk tier is off (every lookup there is a miss)", self.reason)
            return
        self.usable = True
        for name, target in (("writer", self._write_loop), ("loader", self._load_loop)):
            thread = threading.Thread(target=target, name=f"prompt-cache-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def scan(self, budget_s: float = 30.0) -> list[tuple[BlockFile, Path, int]]:
        """Every whole block file of this model, parents before children; partial and foreign
        files are removed. Stops after `budget_s` (the rest stays unindexed)."""
        if not self.usable:
            return []
        started = time.monotonic()
        found = []
        for path in self.dir.iterdir():
            if time.monotonic() - started > budget_s:
                log.warning("prompt cache scan stopped after %.0f s; the rest is skipped", budget_s)
                break
            if path.name.endswith(".tmp"):  # a write that never finished (its writer was killed)
                if not self.shared or _age_s(path) > STALE_TMP_S:
                    _unlink(path)
                continue
            if path.suffix != _SUFFIX:
                continue
            try:
                block, size = read_header(path, self.model_id)
            except Exception as exc:  # any file that cannot be read whole is a miss
                self.fault("corrupt", f"ignoring prompt cache file {path.name}: {exc}")
                _unlink(path)
                continue
            found.append((block, path, size))
        found.sort(key=lambda item: item[0].start)
        total = sum(size for _, _, size in found)
        log.info(
            "prompt cache on disk: %d blocks, %.2f GiB, in %.1f s",
            len(found),
            total / 2**30,
            time.monotonic() - started,
        )
        return found

    # ----- from the engine thread -----

    def write(self, block: BlockFile, arrays: list[Any], wait_s: float = 0.0) -> bool:
        """Queue a block for writing; False (and counted) when the queue stays full for
        `wait_s` (the engine never waits; only the flush at shutdown does)."""
        if not self.usable:
            return False
        try:
            self._writes.put(("write", block, arrays), block=wait_s > 0, timeout=wait_s or None)
        except queue.Full:
            self.counters.dropped_writes += 1
            return False
        return True

    def delete(self, entry: DiskEntry) -> None:
        if self.usable:
            try:
                self._writes.put_nowait(("delete", [entry.path], None))
            except queue.Full:
                _unlink(entry.path)  # small and rare: do it here rather than leak it

    def delete_all(self, paths: list[Path], wait_s: float = 1.0) -> None:
        """Delete many files on the writer thread (one job, after the writes queued before
        it); here, should the queue stay full for `wait_s`."""
        if not self.usable:
            return
        try:
            self._writes.put(("delete", paths, None), timeout=wait_s)
        except queue.Full:
            for path in paths:
                _unlink(path)

    def load(self, key: bytes, entry: DiskEntry) -> None:
        self._loads.put((key, entry.path))

    def _finished(self, done: Completion) -> None:
        """A write or load finished: the engine may be idle, waiting for just this (a load),
        or with figures to publish (a write)."""
        self._done.append(done)
        self._wake()

    def completed(self) -> list[Completion]:
        """What the threads finished since the last call; their faults are counted here."""
        done = []
        while self._done:
            item = self._done.popleft()
            if item.fault is not None:
                self.fault(item.fault, item.message)
            done.append(item)
        return done

    def fault(self, kind: str, message: str) -> None:
        """A fault of this tier (engine thread): counted, and logged at most every 30 s."""
        self._count(kind)
        self._log.warning(kind, "%s", message)

    def _count(self, kind: str) -> None:
        self.counters.faults[kind] = self.counters.faults.get(kind, 0) + 1

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish the queued writes (at most `timeout_s`), stop the threads, unlock."""
        deadline = time.monotonic() + timeout_s
        for q in (self._writes, self._loads):
            with contextlib.suppress(queue.Full):
                q.put(None, timeout=max(0.1, deadline - time.monotonic()))
        for thread in self._threads:
            thread.join(max(0.1, deadline - time.monotonic()))
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None

    # ----- the threads -----

    def _write_loop(self) -> None:
        while (job := self._writes.get()) is not None:
            kind, target, arrays = job
            if kind == "delete":
                for path in target:
                    _unlink(path)
                continue
            block: BlockFile = target
            path = self.dir / f"{block.key.hex()}{_SUFFIX}"
            try:
                nbytes = self._write_file(path, encode(block, self.model_id, arrays))
            except OSError as exc:
                kind = "disk_full" if exc.errno == errno.ENOSPC else "write"
                message = f"prompt cache write failed ({kind}): {exc}"
                self._finished(Completion("write_failed", block.key, fault=kind, message=message))
                continue
            written = Completion("written", block.key, path, nbytes, snapshot=block.snapshot)
            self._finished(written)

    def _write_file(self, path: Path, pieces: list[bytes]) -> int:
        if self.faults is not None:
            self.faults.before_disk_write()
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as file:
                for piece in pieces:
                    file.write(piece)
                file.flush()
                os.fsync(file.fileno())
            os.replace(tmp, path)
        except OSError:
            _unlink(tmp)
            raise
        return sum(len(piece) for piece in pieces)

    def _load_loop(self) -> None:
        while (job := self._loads.get()) is not None:
            key, path = job
            started = time.perf_counter()
            try:
                block = read_block(path, self.model_id)
                if block.key != key:
                    raise ValueError("the file holds another block")
            except Exception as exc:  # any file that cannot be read whole is a miss
                kind = "corrupt" if isinstance(exc, ValueError) else "read"
                message = f"prompt cache file {path.name} unusable: {exc}"
                _unlink(path)
                self._finished(Completion("load_failed", key, path, fault=kind, message=message))
                continue
            seconds = time.perf_counter() - started
            self._finished(Completion("loaded", key, path, block=block, seconds=seconds))


def _age_s(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except OSError:
        return 0.0


def _unlink(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


def model_identity(
    model_dir: Path, adapter_path: str | None, block_size: int, layers: tuple[str, ...]
) -> str:
    """A digest of what decides a block's contents and how it is read back: config, tokenizer
    files, the weights (their sizes, safetensors headers and samples of their bytes, not all
    of them), the adapter, the block size, the cache class of each layer (`layers`), and the
    versions of MLX and mlx-lm (an upgrade may change what a cache's state holds)."""
    versions = f"mlx {_version('mlx.core')} mlx-lm {_version('mlx_lm')}"
    digest = hashlib.sha256(f"format {FORMAT} block {block_size} {versions}".encode())
    digest.update(" ".join(layers).encode())
    dirs = [model_dir] + ([Path(adapter_path)] if adapter_path else [])
    for directory in dirs:
        for path in sorted(directory.iterdir()):
            if not path.is_file():
                continue
            digest.update(path.name.encode())
            if path.suffix == ".safetensors":
                _sample(path, digest)
            elif path.suffix in (".json", ".jinja", ".model", ".txt"):
                digest.update(path.read_bytes())
    return digest.hexdigest()[:32]


def _version(module: str) -> str:
    return str(getattr(importlib.import_module(module), "__version__", "unknown"))


def _sample(path: Path, digest: Any, piece: int = 1 << 20) -> None:
    size = path.stat().st_size
    digest.update(str(size).encode())
    with open(path, "rb") as file:
        for offset in sorted({0, max(0, size // 2 - piece // 2), max(0, size - piece)}):
            file.seek(offset)
            digest.update(file.read(piece))
