"""The prefix store's index: a tree of token blocks, each held in RAM, on disk, or both, with
pins, least-recently-used order and the rule for the longest reusable prefix. Pure (no MLX):
what a block holds is opaque here.

A full block has `block_size` tokens; a tail (the end of a prompt or of an output) has fewer
and is always a leaf. Attention state (`kv`) can be cut anywhere, so a model whose layers are
all attention reuses any prefix the blocks cover. State that cannot be cut (recurrent layers,
sliding windows) is kept only at some block ends (`snapshot`), and a model with such layers
reuses only prefixes that end at one.

Every full block entering or leaving a tier is recorded as a `KvBlockEvent` (tails are not
blocks anyone else can name); the engine hands them out with its output.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ...messages import KvBlockEvent
from .children import Children
from .keys import ROOT, block_key

log = logging.getLogger(__name__)

PENDING_EVENTS = 10_000  # more events than this waiting for the engine is worth a warning
MIN_REUSE_TOKENS = 16  # the shortest prefix worth a hit (at most half a block)
STORED, REMOVED, CLEARED = "stored", "removed", "cleared"
RAM, DISK = "ram", "disk"


@dataclass(eq=False, slots=True)
class Node:
    key: bytes
    parent: Node | None
    tokens: tuple[int, ...]
    start: int  # position of its first token
    ram: Any = None  # what the RAM tier holds for it
    ram_bytes: int = 0
    ram_snapshot: bool = False  # the RAM copy holds the uncuttable state at its end
    disk: Any = None  # what the disk tier knows of its file
    disk_bytes: int = 0
    disk_snapshot: bool = False  # the file holds that state
    pins: int = 0
    children: Children[Node] = field(default_factory=Children)

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def snapshot(self) -> bool:
        """The uncuttable state at its end can be had: from RAM when the block is there (a
        RAM copy is what a hit uses), else from its file."""
        return self.ram_snapshot if self.ram is not None else self.disk_snapshot

    def chain(self) -> list[Node]:
        """This node and its ancestors, root first."""
        nodes: list[Node] = []
        node: Node | None = self
        while node is not None:
            nodes.append(node)
            node = node.parent
        return nodes[::-1]


@dataclass(frozen=True, slots=True)
class Match:
    """The longest reusable prefix of a prompt: the blocks it takes, in order (the last may
    be used only in part), and how many prompt tokens they cover."""

    nodes: tuple[Node, ...] = ()
    length: int = 0

    @property
    def on_disk(self) -> list[Node]:
        return [node for node in self.nodes if node.ram is None]


class BlockIndex:
    """Every block either tier holds, by key; the RAM tier's blocks in least-recently-used order."""

    def __init__(self, block_size: int, cuttable: bool) -> None:
        self.block_size = block_size
        self.cuttable = cuttable  # every layer's state can be cut at any token
        # A shorter prefix (a shared first word, a BOS, a chat template's opening) saves less
        # prefill than its cache costs to build and merge into a batch (yet counts as a hit).
        self.min_reuse = max(1, min(MIN_REUSE_TOKENS, block_size // 2))
        self._nodes: dict[bytes, Node] = {}
        self._roots: Children[Node] = Children()
        self._ram: OrderedDict[bytes, Node] = OrderedDict()
        self.ram_bytes = 0
        self.disk_bytes = 0
        self.disk_blocks = 0
        self.pinned_blocks = 0
        self.events: list[KvBlockEvent] = []  # since the engine last took them

    def __len__(self) -> int:
        return len(self._nodes)

    def get(self, key: bytes) -> Node | None:
        return self._nodes.get(key)

    @property
    def ram_blocks(self) -> int:
        return len(self._ram)

    def ram_nodes(self) -> list[Node]:
        """The RAM tier's blocks, parents before children."""
        return sorted(self._ram.values(), key=lambda node: node.start)

    # ----- finding -----

    def match(self, prompt: list[int], keys: tuple[bytes, ...]) -> Match:
        """The longest prefix of `prompt` that can be reused, at most all but its last token
        (which must go through the model to give the first new token), and none shorter than
        `min_reuse`. `keys` are the names of the prompt's full blocks."""
        limit = len(prompt) - 1
        path: list[Node] = []
        children = self._roots
        for key in keys:
            node = children.get(key)
            if node is None or node.end > limit + (1 if self.cuttable else 0):
                break
            path.append(node)
            children = node.children
        best = Match()
        for depth in range(len(path) + 1):
            chain = tuple(path[:depth])
            end = chain[-1].end if chain else 0
            if depth and (self.cuttable or chain[-1].snapshot):
                best = max(best, Match(chain, min(end, limit)), key=lambda m: m.length)
            parent = chain[-1].children if chain else self._roots
            tail = self._best_tail(parent, prompt, end, limit)
            if tail is not None and tail[1] > best.length:
                best = Match((*chain, tail[0]), tail[1])
        return best if best.length >= self.min_reuse else Match()

    def shared_length(self, prompt: list[int], keys: tuple[bytes, ...]) -> int:
        """How many leading tokens `prompt` shares with anything stored, snapshots or not:
        where a later prompt like it will want to resume."""
        children, shared = self._roots, 0
        for key in keys:
            node = children.get(key)
            if node is None:
                break
            shared, children = node.end, node.children
        _, extra = children.longest_common(tuple(prompt[shared : shared + self.block_size]))
        return shared + extra

    def _best_tail(
        self, children: Children[Node], prompt: list[int], start: int, limit: int
    ) -> tuple[Node, int] | None:
        """A block hanging off the matched path that covers more of the prompt: any common
        prefix when state can be cut, else a tail matched whole with its snapshot."""
        window = tuple(prompt[start : start + self.block_size])
        if self.cuttable:
            node, shared = children.longest_common(window)
            end = min(start + shared, limit)
            return (node, end) if node is not None and end > start else None
        for node in children.prefixes(window):  # longest first
            # A snapshot holds the state after all of its tokens: used whole or not at all.
            length = len(node.tokens)
            if node.snapshot and length < self.block_size and start + length <= limit:
                return node, start + length
        return None

    # ----- changing -----

    def add(self, parent: Node | None, tokens: tuple[int, ...], key: bytes | None = None) -> Node:
        """The node for `tokens` under `parent` (made if new; it holds nothing until a tier
        says so)."""
        key = key or block_key(parent.key if parent is not None else ROOT, tokens)
        node = self._nodes.get(key)
        if node is None:
            start = parent.end if parent is not None else 0
            node = Node(key, parent, tokens, start)
            self._nodes[key] = node
            (parent.children if parent is not None else self._roots).add(key, node)
        return node

    def set_ram(self, node: Node, payload: Any, nbytes: int, snapshot: bool) -> None:
        """The RAM tier holds `payload` for `node` (`snapshot`: with the state at its end)."""
        if node.ram is not None:
            self.ram_bytes -= node.ram_bytes
        else:
            self._event(STORED, node, RAM)
        node.ram, node.ram_bytes, node.ram_snapshot = payload, nbytes, snapshot
        self.ram_bytes += nbytes
        self._ram[node.key] = node
        self._ram.move_to_end(node.key)

    def drop_ram(self, node: Node, keep: bool = False) -> None:
        """Out of RAM; out of the index too unless it is on disk or `keep` (on its way)."""
        if node.ram is None:
            return
        self._event(REMOVED, node, RAM)
        self.ram_bytes -= node.ram_bytes
        node.ram, node.ram_bytes, node.ram_snapshot = None, 0, False
        self._ram.pop(node.key, None)
        if node.disk is None and not keep:
            self.remove(node)

    def set_disk(self, node: Node, entry: Any, nbytes: int, snapshot: bool) -> None:
        """The disk tier holds the file `entry` for `node` (`snapshot`: with the state)."""
        if node.disk is not None:
            self.disk_bytes -= node.disk_bytes
        else:
            self.disk_blocks += 1
            self._event(STORED, node, DISK)
        node.disk, node.disk_bytes, node.disk_snapshot = entry, nbytes, snapshot
        self.disk_bytes += nbytes

    def drop_disk(self, node: Node) -> Any:
        entry = node.disk
        if entry is not None:
            self._event(REMOVED, node, DISK)
            self.disk_bytes -= node.disk_bytes
            self.disk_blocks -= 1
            node.disk, node.disk_bytes, node.disk_snapshot = None, 0, False
            if node.ram is None:
                self.remove(node)
        return entry

    def remove(self, node: Node) -> list[Node]:
        """Take `node` and everything under it out of the index; returns them, deepest first."""
        gone = list(self._subtree(node))
        for each in gone:
            self._nodes.pop(each.key, None)
            if each.ram is not None:
                self._event(REMOVED, each, RAM)
                self.ram_bytes -= each.ram_bytes
                self._ram.pop(each.key, None)
            if each.disk is not None:
                self._event(REMOVED, each, DISK)
                self.disk_bytes -= each.disk_bytes
                self.disk_blocks -= 1
            if each.pins:
                self.pinned_blocks -= 1
                each.pins = 0
        siblings = node.parent.children if node.parent is not None else self._roots
        siblings.pop(node.key)
        return gone

    def clear(self) -> list[Any]:
        """Forget every block (a flush), with one "cleared" event; returns the disk tier's
        entries, whose files must go. The nodes are emptied and unpinned where they are: a
        request or a disk load holding one releases a node the index no longer knows, which
        changes nothing, and a load waiting for one sees nothing left to load."""
        entries = []
        for node in self._nodes.values():
            if node.disk is not None:
                entries.append(node.disk)
            node.ram, node.ram_bytes, node.ram_snapshot = None, 0, False
            node.disk, node.disk_bytes, node.disk_snapshot = None, 0, False
            node.pins = 0
        self._nodes, self._roots, self._ram = {}, Children(), OrderedDict()
        self.ram_bytes = self.disk_bytes = self.disk_blocks = self.pinned_blocks = 0
        self.events.append(KvBlockEvent(CLEARED))
        return entries

    def take_events(self) -> list[KvBlockEvent]:
        events, self.events = self.events, []
        return events

    def _event(self, kind: str, node: Node, tier: str) -> None:
        """A full block entered or left `tier`. Its key is block_key(parent's key, tokens):
        the index names every node that way."""
        if len(node.tokens) != self.block_size:
            return  # a tail: no block anyone else can name
        parent = node.parent.key if node.parent is not None else b""
        tokens = node.tokens if kind == STORED else ()
        self.events.append(KvBlockEvent(kind, node.key, parent, tokens, tier))
        if len(self.events) == PENDING_EVENTS:  # kept anyway: the engine takes them each step
            log.warning("%d prefix cache events wait for the engine", PENDING_EVENTS)

    def shorter_ends(self, tail: Node) -> list[Node]:
        """The other blocks under `tail`'s parent that `tail` begins with."""
        under = tail.parent.children if tail.parent is not None else self._roots
        return [other for other in under.prefixes(tail.tokens) if other is not tail]

    def _subtree(self, node: Node) -> Iterator[Node]:
        for child in list(node.children.values()):
            yield from self._subtree(child)
        yield node

    def touch(self, nodes: tuple[Node, ...] | list[Node]) -> None:
        """Used now: the deepest last, so it is the last of them to leave."""
        for node in nodes:
            if node.ram is not None:
                self._ram.move_to_end(node.key)

    def pin(self, nodes: tuple[Node, ...] | list[Node]) -> None:
        """Held by a running request, a load or a write: never evicted meanwhile."""
        for node in nodes:
            if node.pins == 0:
                self.pinned_blocks += 1
            node.pins += 1

    def unpin(self, nodes: tuple[Node, ...] | list[Node]) -> None:
        for node in nodes:
            if node.pins == 1:
                self.pinned_blocks -= 1
            node.pins = max(0, node.pins - 1)

    # ----- leaving -----

    def ram_victim(self) -> Node | None:
        """The least recently used RAM block that nothing pins and no RAM block hangs off."""
        for node in self._ram.values():
            if node.pins == 0 and not any(c.ram is not None for c in node.children.values()):
                return node
        return None

    def disk_victim(self) -> Node | None:
        """A disk-only block with nothing under it, least recently used first (RAM order
        says nothing about these; the oldest-added go first)."""
        for node in self._nodes.values():
            if node.disk is not None and node.ram is None and node.pins == 0 and not node.children:
                return node
        return None
