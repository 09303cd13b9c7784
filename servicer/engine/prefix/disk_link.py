"""Between the prefix store's RAM tier and its disk tier (engine thread): blocks leaving RAM
are written out, blocks a waiting request needs are read back, files a previous run left are
indexed, and what the disk threads finished is taken in at each step."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as mlx_cache

from ...messages import FoundBlock, GenerationRequest
from .data import BlockData, Part, arrays_of
from .disk_tier import ARRAY_DTYPES, BlockFile, Completion, DiskEntry, DiskTier
from .index import BlockIndex, Match, Node
from .keys import ROOT, block_key

LOAD_TIMEOUT_S = 10.0  # a request waits this long for its blocks from disk, at most


class DiskLink:
    def __init__(self, index: BlockIndex, layout: Any, disk: DiskTier) -> None:
        self.index = index
        self.layout = layout  # the store's CacheLayout: what a loaded block must fit
        self.disk = disk
        self.load_seconds: list[float] = []  # disk loads finished since the last report
        self._loading: dict[int, tuple[tuple[Node, ...], float]] = {}  # ticket -> blocks

    def spill(self, node: Node, data: BlockData) -> None:
        """A block leaving RAM: to disk, unless its file holds all that RAM held (a file
        without the snapshot RAM had is written again). The node stays in the index (pinned)
        until the write is done; a write that cannot start drops it, unless a file is there."""
        if not _needs_file(node, data):
            return
        if not self.disk.usable:
            self.index.remove(node)
            return
        if not self._write_pinned(node, data) and node.disk is None:
            self.index.remove(node)

    def publish(self, node: Node, data: BlockData) -> None:
        """Write-through to a shared directory: the block goes to disk now and stays in RAM."""
        if self.disk.usable and _needs_file(node, data):
            self._write_pinned(node, data)

    def _write_pinned(self, node: Node, data: BlockData) -> bool:
        """Queue the block's write, the node pinned until it is done (`_written` unpins);
        False, and unpinned, when the write cannot start."""
        self.index.pin([node])
        if self._write(node, data):
            return True
        self.index.unpin([node])
        return False

    def adopt(self, found: tuple[FoundBlock, ...]) -> None:
        """Block files the handlers found for a request (another worker's, in a shared
        directory or fetched from a peer), parents first: into the index where it lacks them."""
        for block in found:
            parent = self.index.get(block.parent) if block.parent is not None else None
            if block.parent is not None and parent is None:
                return  # a gap: nothing past it can be reached
            node = self.index.add(parent, block.tokens, block.key)
            if node.disk is None:
                self.index.set_disk(node, DiskEntry(Path(block.path)), block.size, block.snapshot)

    def index_files(self) -> None:
        """Put the files a previous run left into the index (at startup)."""
        disk = self.disk
        for block, path, size in disk.scan():
            parent = self.index.get(block.parent) if block.parent is not None else None
            if block.parent is not None and parent is None:
                disk.delete(DiskEntry(path))  # its parent is gone: nothing can reach it
                continue
            key = block_key(parent.key if parent is not None else ROOT, block.tokens)
            if key != block.key:
                disk.delete(DiskEntry(path))
                continue
            node = self.index.add(parent, block.tokens, key)
            self.index.set_disk(node, DiskEntry(path), size, block.snapshot)
        self._enforce_disk_budget()

    def close(self, flush_s: float = 10.0) -> None:
        """Shutdown: RAM blocks not on disk yet go there (within `flush_s`), so a worker
        started on the same directory finds them."""
        disk = self.disk
        if disk.usable:
            deadline = time.monotonic() + flush_s
            for node in self.index.ram_nodes():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                if node.disk is None:
                    self._write(node, node.ram, wait_s=left)
        disk.close(max(1.0, flush_s))

    def forget_files(self, entries: list[DiskEntry]) -> None:
        """The index forgot these blocks (a flush): their files go. Writes still queued end
        with a block the index does not know, and `_written` deletes their files."""
        if entries:
            self.disk.delete_all([entry.path for entry in entries])

    def _write(self, node: Node, data: BlockData, wait_s: float = 0.0) -> bool:
        arrays: list[Any] = []
        meta = {
            "kv_layers": len(data.kv),
            "kv_parts": _parts(self.layout),
            "states": {
                str(layer): {"cls": type(state).__name__, "state": _flatten(state.state, arrays)}
                for layer, state in (data.states or {}).items()
            },
        }
        arrays = arrays_of(data.kv) + arrays
        meta["arrays"] = [
            {"dtype": str(a.dtype).split(".")[-1], "shape": list(a.shape), "nbytes": a.nbytes}
            for a in arrays
        ]
        parent = node.parent.key if node.parent is not None else None
        snapshot = data.states is not None
        block = BlockFile(node.key, parent, node.start, node.tokens, snapshot, meta)
        try:
            views = [memoryview(a) for a in arrays]
        except Exception:  # a dtype the buffer protocol cannot show: RAM only
            return False
        return self.disk.write(block, views, wait_s)

    def load(self, nodes: list[Node]) -> None:
        """Read these blocks back from disk (off the engine thread); `collect` installs them.
        The caller holds them pinned meanwhile, so nothing evicts them on arrival."""
        for node in nodes:
            if node.disk is not None and node.ram is None:
                self.disk.load(node.key, node.disk)

    def collect(self) -> None:
        """Take in what the disk threads finished: written files, and loaded blocks."""
        for done in self.disk.completed():
            node = self.index.get(done.key)
            if done.kind in ("written", "write_failed"):
                self._written(node, done)
            elif node is not None:
                if done.kind == "loaded" and done.block is not None and node.ram is None:
                    self._install(node, done)
                elif done.kind == "load_failed":
                    self.index.drop_disk(node)
        self._enforce_disk_budget()

    def _install(self, node: Node, done: Completion) -> None:
        """A loaded block into RAM, once it is checked against the model's layout; one that
        does not fit is a fault, and its file goes."""
        assert done.block is not None
        try:
            if self.disk.faults is not None:
                self.disk.faults.before_call("collect")
            data = _from_file(done.block, self.layout)
            mx.eval(arrays_of(data))
        except Exception as exc:  # any block that cannot be taken in is a miss
            self.disk.fault("install", f"prompt cache file for block {node.start} unusable: {exc}")
            entry = self.index.drop_disk(node)
            if entry is not None:
                self.disk.delete(entry)
            return
        self.index.set_ram(node, data, data.nbytes, data.states is not None)
        self.load_seconds.append(done.seconds)

    def _written(self, node: Node | None, done: Completion) -> None:
        if node is None:
            if done.path is not None:
                self.disk.delete(DiskEntry(done.path))  # dropped meanwhile
            return
        self.index.unpin([node])
        if done.kind == "written" and done.path is not None:
            self.index.set_disk(node, DiskEntry(done.path), done.nbytes, done.snapshot)
        elif node.ram is None and node.disk is None:
            self.index.remove(node)

    def _enforce_disk_budget(self) -> None:
        disk = self.disk
        while self.index.disk_bytes > disk.max_bytes:
            node = self.index.disk_victim()
            if node is None:
                return
            entry = self.index.drop_disk(node)
            if entry is not None:
                disk.delete(entry)

    def take_load_seconds(self) -> list[float]:
        seconds, self.load_seconds = self.load_seconds, []
        return seconds

    def ready(self, request: GenerationRequest, match: Callable[[], Match]) -> bool:
        """Whether `request` may join the batch: its prefix is in RAM, or there is nothing
        to load, or the load took too long (then it reuses what is in RAM). The first time,
        it starts the load and pins the whole prefix for the request until it joins."""
        loading = self._loading.get(request.ticket)
        if loading is None:
            if not self.disk.usable:
                return True
            self.adopt(request.found_blocks)
            found = match()
            on_disk = found.on_disk
            if not on_disk:
                return True
            self.index.pin(found.nodes)
            self._loading[request.ticket] = (found.nodes, time.monotonic())
            self.load(on_disk)
            return False
        nodes, started = loading
        waited = time.monotonic() - started
        # Settled: in RAM, no file, or out of the index (a block above it was not taken in).
        get = self.index.get
        settled = all(n.ram is not None or n.disk is None or get(n.key) is not n for n in nodes)
        return settled or waited > LOAD_TIMEOUT_S  # loaded, given up, or too slow

    @property
    def loading(self) -> bool:
        return bool(self._loading)

    def admitted(self, ticket: int) -> bool:
        """The request joins the batch now: its blocks are unpinned (its fetch, right after,
        pins what it uses); True when blocks were loaded from disk for it."""
        loading = self._loading.pop(ticket, None)
        if loading is not None:
            self.index.unpin(loading[0])
        return loading is not None

    def on_done(self, wake: Callable[[], None]) -> None:
        self.disk.on_done(wake)


def _needs_file(node: Node, data: BlockData) -> bool:
    """Whether `data` holds more than the node's file does (no file, or one without the
    snapshot `data` has)."""
    return node.disk is None or (data.states is not None and not node.disk_snapshot)


def _flatten(value: Any, arrays: list[Any]) -> Any:
    """A cache layer's `state` as JSON, its arrays replaced by their place in `arrays`."""
    if isinstance(value, mx.array):
        arrays.append(value)
        return {"array": len(arrays) - 1}
    if isinstance(value, list | tuple):
        return {"items": [_flatten(v, arrays) for v in value], "tuple": isinstance(value, tuple)}
    if value is None or isinstance(value, int | float | bool | str):
        return {"value": value}
    raise TypeError(f"cannot keep a {type(value).__name__} on disk")


def _unflatten(spec: Any, arrays: list[mx.array]) -> Any:
    if "array" in spec:
        return arrays[spec["array"]]
    if "items" in spec:
        items = [_unflatten(item, arrays) for item in spec["items"]]
        return tuple(items) if spec["tuple"] else items
    return spec["value"]


def _parts(layout: Any) -> int:
    """Arrays in a layer's keys (or values): a quantized triple, or one array."""
    return 3 if layout.quantized is not None else 1


def _pair(arrays: list[mx.array], parts: int) -> tuple[Part, Part]:
    if parts == 1:
        return arrays[0], arrays[1]
    return tuple(arrays[:parts]), tuple(arrays[parts:])


def _from_file(block: BlockFile, layout: Any) -> BlockData:
    """A loaded block file as a RAM block (on the engine thread: it makes MLX arrays),
    checked against the model's cache layout: ValueError when it does not fit."""
    meta = block.meta
    arrays = []
    for spec, raw in zip(meta["arrays"], block.arrays, strict=True):
        array = mx.array(np.ascontiguousarray(raw))
        view = ARRAY_DTYPES[spec["dtype"]][1]
        arrays.append(array.view(getattr(mx, view)) if view else array)
    count, parts = meta["kv_layers"], meta["kv_parts"]
    if count != len(layout.kv) or parts != _parts(layout):
        raise ValueError(f"{count} KV layers in {parts} parts, the model has another layout")
    kv_arrays, rest = arrays[: 2 * parts * count], arrays[2 * parts * count :]
    for array in kv_arrays:
        if array.ndim != 4 or array.shape[2] != len(block.tokens):
            raise ValueError(f"KV of shape {array.shape} for {len(block.tokens)} tokens")
    kv = [_pair(kv_arrays[2 * parts * i : 2 * parts * (i + 1)], parts) for i in range(count)]
    states = {}
    for layer, spec in meta["states"].items():
        index = int(layer)
        if index not in layout.state_layers or spec["cls"] != layout.classes[index]:
            raise ValueError(f"a {spec['cls']} state for layer {index}")
        cls = getattr(mlx_cache, spec["cls"])
        states[index] = cls.from_state(_unflatten(spec["state"], rest))
    if block.snapshot != bool(states) or (states and len(states) != len(layout.state_layers)):
        raise ValueError("its snapshot does not match its header")
    return BlockData(kv, states or None)
