"""The prefix store's block events for routers (VllmEngine.SubscribeKvEvents).

Runs on the event loop. The engine reports each block that enters or leaves a tier of its
prefix store (`KvBlockEvent`); the hub numbers them into batches, keeps a mirror of the live
blocks (so a new subscriber starts from a snapshot, never waiting on the engine) and a short
history (so a router that reconnects resumes where it was), and fans each batch out to the
subscribers' bounded queues. A subscriber that falls behind loses its stream with DATA_LOSS,
which makes the smg router reset its view of this worker and subscribe again (a snapshot).

The router hashes the token ids of each block itself (`token_ids` of exactly `block_size`
tokens, from the prompt's start): `block_hash` is only the block's identity, for its children
(`parent_block_hash`) and its removal. RAM blocks are published as the device tier (they are
what a prompt reuses at once); disk blocks as the disk tier, which the router does not route on.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from .messages import KvBlockEvent
from .proto import common_pb2

HISTORY_BATCHES = 4096  # batches kept for a subscriber that resumes from a sequence number
QUEUE_BATCHES = 1024  # batches one subscriber may have waiting before it is cut off
TIERS = {"ram": common_pb2.KV_CACHE_TIER_DEVICE, "disk": common_pb2.KV_CACHE_TIER_DISK}
CACHE_LEVELS = {"ram": 0, "disk": 2}


def block_hash(key: bytes) -> int:
    """A block key's identity on the wire: its first 8 bytes as a signed int64."""
    return int.from_bytes(key[:8], "big", signed=True) if key else 0


class SubscriberLagged(Exception):
    """A subscriber's queue filled up: it must resubscribe."""


@dataclass(eq=False)  # each one is itself, in a set
class _Subscriber:
    queue: asyncio.Queue[common_pb2.KvEventBatch | None] = field(
        default_factory=lambda: asyncio.Queue(QUEUE_BATCHES)
    )
    lagged: bool = False


@dataclass(frozen=True, slots=True)
class _Live:
    parent: bytes
    tokens: tuple[int, ...]


class KvEventHub:
    """Numbered batches of block events, a mirror of the live blocks, and the subscribers."""

    def __init__(self, block_size: int = 0) -> None:
        self.block_size = block_size  # tokens per block (0: the worker keeps no prefixes)
        self._sequence = 0  # the last batch's number
        self._event_ids = 0
        self._live: dict[str, dict[bytes, _Live]] = {"ram": {}, "disk": {}}
        self._history: deque[common_pb2.KvEventBatch] = deque(maxlen=HISTORY_BATCHES)
        self._subscribers: set[_Subscriber] = set()

    @property
    def sequence(self) -> int:
        return self._sequence

    def live_blocks(self, tier: str = "ram") -> int:
        return len(self._live[tier])

    def publish(self, events: list[KvBlockEvent]) -> None:
        """One engine hand-off's events, as one batch to every subscriber."""
        if not events:
            return
        batch = common_pb2.KvEventBatch(timestamp=time.time())
        for event in events:
            self._apply(event, batch)
        if not batch.events:
            return
        self._sequence += 1
        batch.sequence_number = self._sequence
        self._history.append(batch)
        for subscriber in self._subscribers:
            if subscriber.lagged:
                continue
            try:
                subscriber.queue.put_nowait(batch)
            except asyncio.QueueFull:
                subscriber.lagged = True
                _drain(subscriber.queue)
                subscriber.queue.put_nowait(None)  # wakes it to end with DATA_LOSS

    def _apply(self, event: KvBlockEvent, batch: common_pb2.KvEventBatch) -> None:
        if event.kind == "cleared":
            for live in self._live.values():
                live.clear()
            self._add(batch).cleared.SetInParent()
            return
        live = self._live.get(event.tier)
        if live is None:
            return
        if event.kind == "stored":
            if event.block_key in live or len(event.tokens) != self.block_size:
                return
            live[event.block_key] = _Live(event.parent_key, tuple(event.tokens))
            self._stored(batch, event.tier, event.block_key, live[event.block_key])
        elif event.kind == "removed" and live.pop(event.block_key, None) is not None:
            removed = self._add(batch).removed
            removed.block_hashes.append(block_hash(event.block_key))
            removed.tier = TIERS[event.tier]
            removed.cache_level = CACHE_LEVELS[event.tier]

    def _add(self, batch: common_pb2.KvEventBatch) -> common_pb2.KvCacheEvent:
        self._event_ids += 1
        return batch.events.add(event_id=self._event_ids)

    def _stored(self, batch: common_pb2.KvEventBatch, tier: str, key: bytes, block: _Live) -> None:
        stored = self._add(batch).stored
        if block.parent:
            stored.parent_block_hash = block_hash(block.parent)
        stored.tier = TIERS[tier]
        stored.blocks.add(
            block_hash=block_hash(key),
            token_ids=block.tokens,
            block_size=self.block_size,
            cache_level=CACHE_LEVELS[tier],
        )

    def snapshot(self) -> common_pb2.KvEventBatch:
        """Everything live now, as one batch numbered like the last one sent: a clear, then
        every block, parents before children. Live batches go on from the next number."""
        batch = common_pb2.KvEventBatch(sequence_number=self._sequence, timestamp=time.time())
        self._add(batch).cleared.SetInParent()
        for tier, live in self._live.items():
            for key in _parents_first(live):
                self._stored(batch, tier, key, live[key])
        return batch

    async def subscribe(self, start_sequence: int) -> AsyncIterator[common_pb2.KvEventBatch]:
        """The batches after `start_sequence` (from the history), or a snapshot (0, or a
        number the history no longer reaches), then every new batch. Raises SubscriberLagged
        when this subscriber falls QUEUE_BATCHES behind."""
        subscriber = _Subscriber()
        self._subscribers.add(subscriber)
        try:
            for batch in self._catch_up(start_sequence):
                yield batch
            while (batch := await subscriber.queue.get()) is not None:
                yield batch
            if subscriber.lagged:
                raise SubscriberLagged(f"fell {QUEUE_BATCHES} batches behind; subscribe again")
        finally:
            self._subscribers.discard(subscriber)

    def _catch_up(self, start: int) -> list[common_pb2.KvEventBatch]:
        oldest = self._history[0].sequence_number if self._history else self._sequence + 1
        if 0 < start <= self._sequence and start + 1 >= oldest:
            return [b for b in self._history if b.sequence_number > start]
        return [self.snapshot()]

    def close(self) -> None:
        """End every subscription (the worker stops)."""
        for subscriber in self._subscribers:
            _drain(subscriber.queue)
            subscriber.lagged = False
            subscriber.queue.put_nowait(None)


def _drain(queue: asyncio.Queue[common_pb2.KvEventBatch | None]) -> None:
    while not queue.empty():
        queue.get_nowait()


def _parents_first(live: dict[bytes, _Live]) -> list[bytes]:
    depth: dict[bytes, int] = {}

    def depth_of(key: bytes) -> int:
        seen = []
        while key in live and key not in depth:
            seen.append(key)
            key = live[key].parent
        base = depth.get(key, -1)
        for i, k in enumerate(reversed(seen), start=1):
            depth[k] = base + i
        return depth.get(seen[0], base) if seen else base

    return sorted(live, key=depth_of)
