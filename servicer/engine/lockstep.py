"""One model across several processes (mx.distributed): every rank steps the same batch.

Rank 0 decides every change to the batch (inserts with their sampling parameters, aborts,
cancels, shutdown) and shares it with the other ranks before the step that uses it, with one
fixed-size all_sum per step (a second only for a large payload). Each rank writes the share's
sequence number into its own slot, so a collective that "succeeds" without a peer is caught.
Rank 0 shares at least every `heartbeat_s` even when idle; a watchdog on every rank ends the
process when no share completes for `timeout_s` (a dead or frozen peer can leave a collective
blocked forever in C++, where nothing else can interrupt it).
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import mlx.core as mx
import msgspec
import numpy as np

log = logging.getLogger(__name__)
T = TypeVar("T")

_MAGIC = 0x4D4C5853
_CAPACITY = 4096  # bytes shared every step; larger plans take a second all_sum


class LockstepBroken(RuntimeError):
    """A share came back wrong: a peer is gone or the ranks disagree."""


def connect(backend: str = "any") -> mx.distributed.Group:
    """Join the distributed group (environment set by `mlx.launch` or by hand)."""
    group = mx.distributed.init(strict=True, backend=backend)
    log.info("distributed group: rank %d of %d (%s)", group.rank(), group.size(), backend)
    return group


class Lockstep:
    def __init__(self, group: mx.distributed.Group, timeout_s: float, heartbeat_s: float) -> None:
        self.group = group
        self.rank = group.rank()
        self.size = group.size()
        self.timeout_s = timeout_s
        self.heartbeat_s = heartbeat_s
        self._header = 12 + 4 * self.size  # magic, sequence, length, then one ack per rank
        self._sequence = 0
        self._last_progress = time.monotonic()
        self._watching = False
        self._encoder = msgspec.msgpack.Encoder()

    @property
    def leads(self) -> bool:
        return self.rank == 0

    def share(self, plan: T | None, kind: type[T]) -> T:
        """Rank 0's plan, on every rank (the other ranks pass None); `kind` is its type, in
        which it travels (msgpack, positional)."""
        self._sequence += 1
        sequence = self._sequence
        buffer = np.zeros(_CAPACITY, np.uint8)
        payload = b""
        if self.leads:
            payload = self._encoder.encode(plan)
            buffer[:12] = np.frombuffer(
                struct.pack("<III", _MAGIC, sequence, len(payload)), np.uint8
            )
            if len(payload) <= _CAPACITY - self._header:
                buffer[self._header : self._header + len(payload)] = np.frombuffer(
                    payload, np.uint8
                )
        slot = 12 + 4 * self.rank
        buffer[slot : slot + 4] = np.frombuffer(struct.pack("<I", sequence), np.uint8)
        summed = np.array(mx.distributed.all_sum(mx.array(buffer), group=self.group))
        magic, got, length = struct.unpack("<III", summed[:12].tobytes())
        acks = struct.unpack(f"<{self.size}I", summed[12 : self._header].tobytes())
        if magic != _MAGIC or got != sequence or any(ack != sequence for ack in acks):
            raise LockstepBroken(
                f"share {sequence} came back invalid (acks {acks}): a rank is gone or out of step"
            )
        if length <= _CAPACITY - self._header:
            data = summed[self._header : self._header + length].tobytes()
        else:
            big = np.frombuffer(payload, np.uint8) if self.leads else np.zeros(length, np.uint8)
            data = np.array(mx.distributed.all_sum(mx.array(big), group=self.group)).tobytes()
        self._last_progress = time.monotonic()
        return msgspec.msgpack.decode(data, type=kind)

    def progress(self) -> None:
        """A step finished: the ranks are still moving together."""
        self._last_progress = time.monotonic()

    def shared_seed(self, seed: int) -> int:
        """Rank 0's `seed` on every rank: unseeded sampling draws the same on all of them."""
        mine = seed % 2**31 if self.leads else 0
        return int(mx.distributed.all_sum(mx.array(mine, dtype=mx.int32), group=self.group).item())

    def watch(self, on_stall: Callable[[str], None]) -> None:
        """Start the watchdog: a share or step that stalls past the timeout ends the process."""
        self._last_progress = time.monotonic()
        if self._watching:
            return
        self._watching = True
        threading.Thread(target=self._watchdog, args=(on_stall,), daemon=True).start()

    def _watchdog(self, on_stall: Callable[[str], None]) -> None:
        while True:
            time.sleep(min(0.1, self.timeout_s / 10))
            stalled = time.monotonic() - self._last_progress
            if stalled > self.timeout_s:
                reason = (
                    f"rank {self.rank}: no lockstep progress for {stalled:.1f} s "
                    "(a rank died or stopped answering)"
                )
                log.critical("%s; exiting", reason)
                try:
                    on_stall(reason)
                finally:
                    os._exit(1)
