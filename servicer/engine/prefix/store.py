"""Prompt-prefix reuse in blocks: each block's attention KV once, whichever request made it,
plus snapshots of the state that cannot be cut (recurrent layers, sliding windows) at some
block ends; a RAM tier bounded in bytes, and an optional disk tier behind it (engine thread).

Blocks are taken when a prompt's prefill reaches a snapshot point or its last token, and when
a request finishes (prompt and output, for the next turn). A hit builds a private cache for the
request from its blocks; the blocks stay pinned until the request leaves the batch.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from ...faults import FaultPlan
from ...messages import GenerationRequest, KvBlockEvent, PrefixCacheStats
from ...ratelimit import RateLimitedLog
from ..cache_kinds import kind_of
from ..quantized_kv import QuantizedRowCache, quantization
from .data import BlockData, Part, arrays_of, concat, time_slice, tokens_in
from .disk_link import DiskLink
from .disk_tier import DiskTier
from .index import BlockIndex, Match, Node
from .keys import ROOT, block_key
from .snapshots import snapshot_points

log = logging.getLogger(__name__)

RAM, DISK = "ram", "disk"
# A snapshot point adds at least a block over this many past the previous one (see snapshots).
MIN_GAP_BLOCKS = 2


@dataclass(frozen=True)
class CacheLayout:
    """The class of each of the model's cache layers, which of them hold attention KV
    (cuttable at any token), how that KV is quantized ((bits, group size), or None), and the
    quantized layers' class (a QuantizedRowCache, or a DequantizingRowCache: the same stored
    data, handed back dequantized)."""

    classes: tuple[str, ...]
    kv: tuple[int, ...]
    quantized: tuple[int, int] | None = None
    quantized_row: type = QuantizedRowCache

    @classmethod
    def of(cls, caches: list[Any]) -> CacheLayout:
        """The layout of one request's caches, as the engine makes them."""
        kv = tuple(i for i, c in enumerate(caches) if kind_of(c).attention_kv)
        rows = [(q, type(c)) for c in caches if (q := quantization(c)) is not None]
        if not rows:
            return cls(tuple(type(c).__name__ for c in caches), kv)
        (quantized, row), *_ = rows
        return cls(tuple(type(c).__name__ for c in caches), kv, quantized, row)

    @property
    def layers(self) -> int:
        return len(self.classes)

    @property
    def cuttable(self) -> bool:
        return len(self.kv) == self.layers

    @property
    def state_layers(self) -> tuple[int, ...]:
        """The layers whose state is kept whole, at snapshots."""
        kv = set(self.kv)
        return tuple(i for i in range(self.layers) if i not in kv)

    def describe(self) -> tuple[str, ...]:
        """What decides how a block's KV is laid out: each layer's class, the quantization."""
        if self.quantized is None:
            return self.classes
        bits, group_size = self.quantized
        return (*self.classes, f"kv {bits} bits, groups of {group_size}")

    def kv_cache(self, keys: Part, values: Part, length: int) -> Any:
        """An attention layer's cache for one request holding `length` tokens."""
        if self.quantized is None:
            cache = KVCache()
            cache.state = (keys, values, length)
            return cache
        bits, group_size = self.quantized
        quantized = self.quantized_row(group_size=group_size, bits=bits)
        quantized.state = (keys, values, length, group_size, bits)
        return quantized


@dataclass
class TierCounts:
    hits: int = 0
    tokens: int = 0


@dataclass
class StoreCounters:
    misses: int = 0
    evictions: int = 0
    faults: int = 0  # hits that could not be served (a miss instead) and blocks not kept
    snapshot_hits: int = 0  # hits that resumed from a snapshot of the uncuttable state
    by_tier: dict[str, TierCounts] = field(
        default_factory=lambda: {RAM: TierCounts(), DISK: TierCounts()}
    )


class UnusableBlock(ValueError):
    """A block's data cannot serve the match the index promised: the request is a miss."""


@dataclass
class Pins:
    """A hit's blocks, pinned until released: once, whoever holds it then (the plan, then
    the row); later calls do nothing."""

    nodes: tuple[Node, ...]
    unpin: Callable[[tuple[Node, ...]], None] | None

    def release(self) -> None:
        unpin, self.unpin = self.unpin, None
        if unpin is not None:
            unpin(self.nodes)


@dataclass(frozen=True)
class Hit:
    """A private cache for a request, the blocks it came from (pinned), and what it covers."""

    cache: list[Any]
    pins: Pins
    length: int

    @property
    def nodes(self) -> tuple[Node, ...]:
        return self.pins.nodes

    def release(self) -> None:
        self.pins.release()


class PrefixStore:
    def __init__(
        self,
        layout: CacheLayout,
        block_size: int,
        snapshot_interval: int,
        max_bytes: int,
        max_blocks: int = 1 << 20,
        disk: DiskTier | None = None,
        faults: FaultPlan | None = None,
        message_markers: frozenset[int] = frozenset(),
    ) -> None:
        """Blocks evicted from RAM go to `disk` when there is one. `message_markers`: the
        tokenizer's special tokens, whose runs end chat messages (snapshots go there)."""
        self.layout = layout
        self.message_markers = message_markers
        self.faults = faults
        self._log = RateLimitedLog(log, 30.0)
        self.block_size = block_size
        self.snapshot_interval = max(block_size, snapshot_interval // block_size * block_size)
        self.max_bytes = max_bytes
        self.max_blocks = max_blocks
        self.index = BlockIndex(block_size, layout.cuttable)
        self.counters = StoreCounters()
        self._later: list[tuple[list[int], list[Any], bool]] = []
        self._link = DiskLink(self.index, layout, disk) if disk is not None else None
        if self._link is not None:
            self._link.index_files()
        # Where the handlers look for other workers' blocks ("": nowhere).
        self.shared_dir = str(disk.dir) if disk is not None and disk.usable and disk.shared else ""

    # ----- finding -----

    def match(self, request: GenerationRequest) -> Match:
        return self.index.match(request.store_prompt, request.block_keys)

    def fetch(self, request: GenerationRequest, from_disk: bool = False) -> Hit | None:
        """A private cache for the longest reusable prefix in RAM (None: a miss, also when
        anything goes wrong: the request is then served cold). The blocks are pinned until
        `release`. `from_disk`: some of them were loaded for it."""
        try:
            self._inject("fetch")
            return self._fetch(request, from_disk)
        except Exception as exc:
            self.counters.misses += 1
            self._fault("fetch", "a prompt cache lookup failed, the request is served cold", exc)
            return None

    def _fetch(self, request: GenerationRequest, from_disk: bool) -> Hit | None:
        match = self._usable(self.match(request))
        if not match.length:
            self.counters.misses += 1
            return None
        cache = self._build(match)
        counts = self.counters.by_tier[DISK if from_disk else RAM]
        counts.hits += 1
        counts.tokens += match.length
        self.counters.snapshot_hits += not self.layout.cuttable
        self.index.touch(match.nodes)
        self.index.pin(match.nodes)
        return Hit(cache, Pins(match.nodes, self.index.unpin), match.length)

    def _usable(self, match: Match) -> Match:
        """The longest part of `match` a hit can be built from now: its blocks in RAM and,
        for a model whose state cannot be cut, ending where RAM holds that state."""
        in_ram = next((i for i, node in enumerate(match.nodes) if node.ram is None), None)
        count = len(match.nodes) if in_ram is None else in_ram
        for depth in range(count, 0, -1):
            node = match.nodes[depth - 1]
            if self.layout.cuttable or node.ram_snapshot:
                return Match(match.nodes[:depth], min(node.end, match.length))
        return Match()

    def _build(self, match: Match) -> list[Any]:
        """The request's cache from its blocks' RAM copies; `UnusableBlock` when they cannot
        make one (the request is then served cold)."""
        self._inject("build")
        length = match.length
        cache: list[Any] = [None] * self.layout.layers
        for node in match.nodes:
            if len(node.ram.kv) != len(self.layout.kv):
                raise UnusableBlock(f"block at {node.start} holds {len(node.ram.kv)} KV layers")
        for j, layer in enumerate(self.layout.kv):
            keys = concat([node.ram.kv[j][0] for node in match.nodes])
            values = concat([node.ram.kv[j][1] for node in match.nodes])
            if min(tokens_in(keys), tokens_in(values)) < length:
                raise UnusableBlock(f"the blocks hold {tokens_in(keys)} of {length} tokens")
            cache[layer] = self.layout.kv_cache(
                time_slice(keys, 0, length), time_slice(values, 0, length), length
            )
        if not self.layout.cuttable:
            states = match.nodes[-1].ram.states
            if states is None or set(states) != set(self.layout.state_layers):
                raise UnusableBlock(f"the block ending at {length} holds no snapshot")
            for layer, state in states.items():
                cache[layer] = copy.deepcopy(state)
        return cache

    # ----- keeping -----

    def snapshot_points(self, request: GenerationRequest, start: int) -> list[int]:
        """Where a prompt's prefill should stop for a snapshot (positions after `start`)."""
        if self.layout.cuttable:
            return []
        prompt = request.store_prompt
        shared = self.index.shared_length(prompt, request.block_keys)
        return snapshot_points(
            prompt,
            start,
            self.snapshot_interval,
            shared,
            self.message_markers,
            min_gap=max(1, self.block_size // MIN_GAP_BLOCKS),
        )

    def keep(self, tokens: list[int], cache: list[Any], snapshot: bool) -> None:
        """Store the blocks of `cache`, which holds exactly `tokens`; with `snapshot`, the
        uncuttable state at its end too. Blocks already kept are not kept again. A failure
        keeps nothing (counted and logged); serving goes on."""
        try:
            self._inject("keep")
            self._keep(tokens, cache, snapshot)
        except Exception as exc:
            self._fault("keep", "keeping a prompt's blocks failed; they are not kept", exc)

    def keep_later(self, tokens: list[int], cache: list[Any], snapshot: bool) -> None:
        """`keep` at the next `keep_pending`: the engine hands a step's tokens over first (a
        keep's bookkeeping is a fraction of a step)."""
        self._later.append((tokens, cache, snapshot))

    def keep_pending(self) -> bool:
        """What `keep_later` was given, kept; True when block events wait to go out."""
        later, self._later = self._later, []
        for tokens, cache, snapshot in later:
            self.keep(tokens, cache, snapshot)
        return bool(self.index.events)

    def _keep(self, tokens: list[int], cache: list[Any], snapshot: bool) -> None:
        if not tokens:
            return
        length, size = len(tokens), self.block_size
        blocks: list[tuple[tuple[int, ...], bytes, BlockData | None]] = []
        parent_key = ROOT
        for start in range(0, length, size):  # everything that can fail, before the index
            end = min(start + size, length)
            piece = tuple(tokens[start:end])
            key = block_key(parent_key, piece)
            node = self.index.get(key)
            states = end == length and snapshot and not self.layout.cuttable
            data = None
            if (
                node is None
                or (node.ram is None and node.disk is None)
                or (states and not node.snapshot)
            ):
                data = BlockData(self._kv_slices(cache, start, end))
                if states:
                    data.states = {i: copy.deepcopy(cache[i]) for i in self.layout.state_layers}
            blocks.append((piece, key, data))
            parent_key = key
        # Queued behind the forward in flight, which the cache's arrays come from: waiting
        # for it here would leave the device idle while the next step is built.
        mx.async_eval([arrays_of(data) for _, _, data in blocks if data is not None])
        parent: Node | None = None
        for piece, key, data in blocks:
            parent = self.index.add(parent, piece, key)
            if data is not None:
                self.index.set_ram(parent, data, data.nbytes, data.states is not None)
                if self._link is not None and self._link.disk.shared:
                    self._link.publish(parent, data)
        assert parent is not None
        if self.layout.cuttable and len(parent.tokens) < size:
            self._drop_shorter_tails(parent)
        self.index.touch(parent.chain())
        self.enforce_budget()

    def _drop_shorter_tails(self, tail: Node) -> None:
        """A tail that starts another tail holds nothing the longer one lacks (attention state
        can be cut anywhere): a prompt's end, once its output is kept after it."""
        for node in self.index.shorter_ends(tail):
            if node.pins == 0 and node.disk is None:
                self.index.remove(node)

    def _kv_slices(self, cache: list[Any], start: int, end: int) -> list[tuple[Part, Part]]:
        slices = []
        for layer in self.layout.kv:
            keys, values = cache[layer].state[:2]
            slices.append((time_slice(keys, start, end), time_slice(values, start, end)))
        return slices

    def enforce_budget(self) -> None:
        """Least recently used blocks leave RAM first, a block's children before itself; to
        the disk tier when there is one."""
        index = self.index
        while index.ram_bytes > self.max_bytes or index.ram_blocks > self.max_blocks:
            node = index.ram_victim()
            if node is None:
                return  # everything left is pinned
            data = node.ram
            index.drop_ram(node, keep=self._link is not None)
            if self._link is not None:
                self._link.spill(node, data)
            self.counters.evictions += 1

    def _inject(self, kind: str) -> None:
        if self.faults is not None:
            self.faults.before_call(kind)

    def _fault(self, kind: str, message: str, exc: Exception) -> None:
        self.counters.faults += 1
        self._log.warning(kind, "%s: %s: %s", message, type(exc).__name__, exc, exc_info=exc)

    # ----- the disk tier (none: every answer is the RAM tier's) -----

    def collect(self) -> list[float]:
        """What the disk threads finished; returns the disk load times since the last call."""
        if self._link is None:
            return []
        self._link.collect()
        self.enforce_budget()
        return self._link.take_load_seconds()

    def close(self) -> None:
        if self._link is not None:
            self._link.close()

    def ready(self, request: GenerationRequest) -> bool:
        """Whether `request` may join the batch now (its blocks on disk are loaded, or there
        is nothing to load, or the load took too long); the first call starts the load."""
        return self._link is None or self._link.ready(request, lambda: self.match(request))

    @property
    def loading(self) -> bool:
        """Some waiting request's blocks are being loaded from disk."""
        return self._link is not None and self._link.loading

    def fetch_admitted(self, request: GenerationRequest) -> Hit | None:
        """`fetch` for a request that joins the batch now (the disk load's pins end)."""
        from_disk = self._link is not None and self._link.admitted(request.ticket)
        return self.fetch(request, from_disk)

    def forget(self, ticket: int) -> None:
        """A waiting request left (aborted or failed): its disk load's pins end."""
        if self._link is not None:
            self._link.admitted(ticket)

    def on_disk_done(self, wake: Callable[[], None]) -> None:
        """`wake` is called (from a disk thread) whenever a write or a load finishes."""
        if self._link is not None:
            self._link.on_done(wake)

    # ----- flushing, and what changed -----

    def flush(self) -> None:
        """Empty both tiers. Requests in flight keep working: each built its own cache from
        the blocks, and releasing a block the index forgot changes nothing. The files go on
        the writer thread, after the writes queued before them."""
        entries = self.index.clear()
        self._later.clear()
        if self._link is not None:
            self._link.forget_files(entries)

    def take_events(self) -> list[KvBlockEvent]:
        """The full blocks that entered or left a tier since the last call (engine thread;
        the disk threads' results become events when `collect` takes them in)."""
        return self.index.take_events()

    def stats(self) -> PrefixCacheStats:
        counters = self.counters
        ram, disk = counters.by_tier[RAM], counters.by_tier[DISK]
        return PrefixCacheStats(
            entries=self.index.ram_blocks,
            bytes=self.index.ram_bytes,
            hits=ram.hits + disk.hits,
            misses=counters.misses,
            disk_blocks=self.index.disk_blocks,
            disk_bytes=self.index.disk_bytes,
            ram_hits=ram.hits,
            disk_hits=disk.hits,
            ram_tokens=ram.tokens,
            disk_tokens=disk.tokens,
            evictions=counters.evictions,
            pinned_blocks=self.index.pinned_blocks,
            faults=counters.faults,
            snapshot_hits=counters.snapshot_hits,
            dropped_writes=self._link.disk.counters.dropped_writes if self._link else 0,
            disk_faults=sum(self._link.disk.counters.faults.values()) if self._link else 0,
        )


class NoPrefixStore:
    """The prompt cache turned off (`--prompt-cache-size 0`, or not possible): every lookup
    a miss, nothing kept, nothing to load."""

    loading = False
    shared_dir = ""

    def match(self, request: GenerationRequest) -> Match:
        return Match()

    def fetch(self, request: GenerationRequest, from_disk: bool = False) -> Hit | None:
        return None

    def fetch_admitted(self, request: GenerationRequest) -> Hit | None:
        return None

    def snapshot_points(self, request: GenerationRequest, start: int) -> list[int]:
        return []

    def keep_later(self, tokens: list[int], cache: list[Any], snapshot: bool) -> None:
        pass

    def keep_pending(self) -> bool:
        return False

    def ready(self, request: GenerationRequest) -> bool:
        return True

    def forget(self, ticket: int) -> None:
        pass

    def on_disk_done(self, wake: Callable[[], None]) -> None:
        pass

    def collect(self) -> list[float]:
        return []

    def flush(self) -> None:
        pass

    def take_events(self) -> list[KvBlockEvent]:
        return []

    def stats(self) -> PrefixCacheStats | None:
        return None

    def close(self) -> None:
        pass


AnyPrefixStore = PrefixStore | NoPrefixStore
