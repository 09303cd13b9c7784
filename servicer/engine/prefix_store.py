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
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

from ..blocks import ROOT, block_key
from ..messages import GenerationRequest, PrefixCacheStats
from .block_data import BlockData, arrays_of
from .block_index import BlockIndex, Match, Node
from .disk_tier import DiskTier
from .prefix_disk import DiskLink

log = logging.getLogger(__name__)

RAM, DISK = "ram", "disk"


@dataclass(frozen=True)
class CacheLayout:
    """Which of the model's cache layers hold attention KV (cuttable at any token)."""

    layers: int
    kv: tuple[int, ...]

    @classmethod
    def of(cls, model: Any) -> CacheLayout:
        caches = make_prompt_cache(model)
        kv = tuple(i for i, c in enumerate(caches) if type(c) is KVCache)
        return cls(len(caches), kv)

    @property
    def cuttable(self) -> bool:
        return len(self.kv) == self.layers


@dataclass
class TierCounts:
    hits: int = 0
    tokens: int = 0


@dataclass
class StoreCounters:
    misses: int = 0
    evictions: int = 0
    by_tier: dict[str, TierCounts] = field(
        default_factory=lambda: {RAM: TierCounts(), DISK: TierCounts()}
    )


@dataclass(frozen=True)
class Hit:
    """A private cache for a request, the blocks it came from (pinned), and what it covers."""

    cache: list[Any]
    nodes: tuple[Node, ...]
    length: int


class PrefixStore:
    def __init__(
        self,
        layout: CacheLayout,
        block_size: int,
        snapshot_interval: int,
        max_bytes: int,
        max_blocks: int = 1 << 20,
        disk: DiskTier | None = None,
    ) -> None:
        """Blocks evicted from RAM go to `disk` when there is one."""
        self.layout = layout
        self.block_size = block_size
        self.snapshot_interval = max(block_size, snapshot_interval // block_size * block_size)
        self.max_bytes = max_bytes
        self.max_blocks = max_blocks
        self.index = BlockIndex(block_size, layout.cuttable)
        self.counters = StoreCounters()
        self.disk = DiskLink(self.index, disk) if disk is not None else None
        if self.disk is not None:
            self.disk.index_files()

    # ----- finding -----

    def match(self, request: GenerationRequest) -> Match:
        return self.index.match(request.prompt, request.block_keys)

    def fetch(self, request: GenerationRequest, from_disk: bool = False) -> Hit | None:
        """A private cache for the longest reusable prefix in RAM (None: a miss). The blocks
        are pinned until `release`. `from_disk`: some of them were loaded for it."""
        match = self.match(request)
        if match.on_disk:  # they could not be loaded in time: the part in RAM, if any
            keep = next(i for i, node in enumerate(match.nodes) if node.ram is None)
            match = self._shorter(match, keep)
        if not match.length:
            self.counters.misses += 1
            return None
        counts = self.counters.by_tier[DISK if from_disk else RAM]
        counts.hits += 1
        counts.tokens += match.length
        self.index.touch(match.nodes)
        self.index.pin(match.nodes)
        return Hit(self._build(match), match.nodes, match.length)

    def _shorter(self, match: Match, count: int) -> Match:
        """The longest usable match within the first `count` of its blocks."""
        for depth in range(count, 0, -1):
            node = match.nodes[depth - 1]
            if self.layout.cuttable or node.snapshot:
                return Match(match.nodes[:depth], min(node.end, match.length))
        return Match()

    def release(self, nodes: tuple[Node, ...]) -> None:
        self.index.unpin(nodes)

    def _build(self, match: Match) -> list[Any]:
        length = match.length
        cache: list[Any] = [None] * self.layout.layers
        for j, layer in enumerate(self.layout.kv):
            keys = mx.concatenate([node.ram.kv[j][0] for node in match.nodes], axis=2)
            values = mx.concatenate([node.ram.kv[j][1] for node in match.nodes], axis=2)
            kv = KVCache()
            kv.state = (keys[..., :length, :], values[..., :length, :], length)
            cache[layer] = kv
        if not self.layout.cuttable:
            states = match.nodes[-1].ram.states
            assert states is not None, "a non-cuttable match ends at a snapshot"
            for layer, state in states.items():
                cache[layer] = copy.deepcopy(state)
        return cache

    # ----- keeping -----

    def snapshot_points(self, request: GenerationRequest, start: int) -> list[int]:
        """Where a prompt's prefill should stop for a snapshot (positions after `start`): every
        `snapshot_interval`, and the end of the longest prefix it shares with an earlier
        prompt (where the next one like it will want to resume)."""
        if self.layout.cuttable:
            return []
        end = len(request.prompt) - 1
        points = set(range(self.snapshot_interval, end, self.snapshot_interval))
        shared = self.index.shared_length(request.prompt, request.block_keys)
        if 0 < shared < end:
            points.add(shared)
        return sorted(p for p in points if p > start)

    def keep(self, tokens: list[int], cache: list[Any], snapshot: bool) -> None:
        """Store the blocks of `cache`, which holds exactly `tokens`; with `snapshot`, the
        uncuttable state at its end too. Blocks already kept are not kept again."""
        if not tokens:
            return
        length, size = len(tokens), self.block_size
        parent: Node | None = None
        pending: list[tuple[Node, BlockData]] = []
        for start in range(0, length, size):
            end = min(start + size, length)
            piece = tuple(tokens[start:end])
            key = block_key(parent.key if parent is not None else ROOT, piece)
            node = self.index.get(key)
            states = end == length and snapshot and not self.layout.cuttable
            if (
                node is None
                or (node.ram is None and node.disk is None)
                or (states and not node.snapshot)
            ):
                data = BlockData(self._kv_slices(cache, start, end))
                if states:
                    data.states = {i: copy.deepcopy(cache[i]) for i in self._state_layers()}
                node = self.index.add(parent, piece, states, key)
                pending.append((node, data))
            parent = node
        if pending:
            mx.eval([arrays_of(data) for _, data in pending])
            for node, data in pending:
                self.index.set_ram(node, data, data.nbytes, data.states is not None)
        assert parent is not None
        if self.layout.cuttable and len(parent.tokens) < size:
            self._drop_shorter_tails(parent)
        self.index.touch(parent.chain())
        self.enforce_budget()

    def _drop_shorter_tails(self, tail: Node) -> None:
        """A tail that starts another tail holds nothing the longer one lacks (attention state
        can be cut anywhere): a prompt's end, once its output is kept after it."""
        for node in self.index.siblings(tail):
            shorter = len(node.tokens) < len(tail.tokens)
            starts = tail.tokens[: len(node.tokens)] == node.tokens
            if shorter and starts and node.pins == 0 and node.disk is None:
                self.index.remove(node)

    def _state_layers(self) -> list[int]:
        kv = set(self.layout.kv)
        return [i for i in range(self.layout.layers) if i not in kv]

    def _kv_slices(self, cache: list[Any], start: int, end: int) -> list[tuple[mx.array, mx.array]]:
        slices = []
        for layer in self.layout.kv:
            keys, values, _ = cache[layer].state
            # A copy of its own: a slice would keep the whole source buffer alive.
            slices.append(
                (
                    mx.contiguous(keys[..., start:end, :]),
                    mx.contiguous(values[..., start:end, :]),
                )
            )
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
            index.drop_ram(node, keep=self.disk is not None)
            if self.disk is not None:
                self.disk.spill(node, data)
            self.counters.evictions += 1

    # ----- the disk tier, when there is one -----

    def collect(self) -> list[float]:
        """What the disk threads finished; returns the disk load times since the last call."""
        if self.disk is None:
            return []
        self.disk.collect()
        self.enforce_budget()
        return self.disk.take_load_seconds()

    @property
    def loading(self) -> bool:
        """Some waiting request waits for blocks from disk."""
        return self.disk is not None and self.disk.loading

    def ready(self, request: GenerationRequest) -> bool:
        if self.disk is None:
            return True
        return self.disk.ready(request, lambda: self.match(request))

    def admitted(self, ticket: int) -> bool:
        return self.disk.admitted(ticket) if self.disk is not None else False

    def forget(self, ticket: int) -> None:
        if self.disk is not None:
            self.disk.forget(ticket)

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()

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
            dropped_writes=self.disk.disk.counters.dropped_writes if self.disk else 0,
            disk_faults=sum(self.disk.disk.counters.faults.values()) if self.disk else 0,
        )
