"""The prefix index's children in token order (pure, no MLX): the same answers as reading
every child, from a few comparisons however many prompts are stored."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from servicer.engine.prefix import children as children_module
from servicer.engine.prefix.children import Children, common_length
from servicer.engine.prefix.index import BlockIndex
from servicer.engine.prefix.keys import block_keys


@dataclass(eq=False)
class Leaf:
    tokens: tuple[int, ...]


def _random_tokens(rng: random.Random) -> tuple[int, ...]:
    # Three symbols and short lengths: many children share prefixes, some are prefixes.
    return tuple(rng.randrange(3) for _ in range(rng.randint(1, 7)))


@pytest.mark.parametrize("seed", range(20))
def test_children_answer_as_reading_every_child(seed):
    rng = random.Random(seed)
    children: Children[Leaf] = Children()
    held: dict[tuple[int, ...], Leaf] = {}
    for _ in range(300):
        tokens = _random_tokens(rng)
        if tokens in held and rng.random() < 0.4:
            children.pop(repr(tokens).encode())
            del held[tokens]
        elif tokens not in held:
            held[tokens] = Leaf(tokens)
            children.add(repr(tokens).encode(), held[tokens])
        query = _random_tokens(rng) + _random_tokens(rng)
        node, shared = children.longest_common(query)
        best = max((common_length(t, query) for t in held), default=0)
        assert shared == best
        assert (node is None) == (best == 0)
        if node is not None:
            assert common_length(node.tokens, query) == best
        prefixes = [leaf.tokens for leaf in children.prefixes(query)]
        assert prefixes == sorted((t for t in held if query[: len(t)] == t), key=len, reverse=True)
    assert len(children) == len(held)
    assert {leaf.tokens for leaf in children.values()} == set(held)


def _reference_match(index: BlockIndex, prompt: list[int]) -> int:
    """The rule read off every child (what the index did before it kept them in order)."""
    limit, block = len(prompt) - 1, index.block_size
    best, node, children = 0, None, index._roots
    keys = block_keys(prompt, block)
    while True:
        start = node.end if node is not None else 0
        if node is not None and (index.cuttable or node.snapshot):
            best = max(best, min(node.end, limit))
        for child in children.values():
            shared = common_length(child.tokens, prompt[start : start + len(child.tokens)])
            whole = shared == len(child.tokens)
            if index.cuttable and shared:
                best = max(best, min(start + shared, limit))
            elif whole and child.snapshot and shared < block and start + shared <= limit:
                best = max(best, start + shared)
        depth = node.end // block if node is not None else 0
        if depth >= len(keys) or children.get(keys[depth]) is None:
            break
        node = children.get(keys[depth])
        if node.end > limit + (1 if index.cuttable else 0):
            break
        children = node.children
    return best if best >= index.min_reuse else 0


@pytest.mark.parametrize("cuttable", [True, False])
@pytest.mark.parametrize("seed", range(10))
def test_the_longest_reusable_prefix_is_the_one_every_child_gives(seed, cuttable):
    rng = random.Random(seed)
    block = rng.choice([4, 8, 32])
    index = BlockIndex(block, cuttable)
    index.min_reuse = 1
    stem = [rng.randrange(4) for _ in range(3 * block)]
    stored = []
    for _ in range(60):
        tokens = stem[: rng.randint(0, 2 * block)] + [rng.randrange(4) for _ in range(block)]
        stored.append(tokens)
        parent = None
        for start in range(0, len(tokens), block):
            parent = index.add(parent, tuple(tokens[start : start + block]))
            index.set_ram(parent, object(), 1, rng.random() < 0.5)
    for _ in range(100):
        base = rng.choice(stored)
        prompt = base[: rng.randint(1, len(base))] + [rng.randrange(4) for _ in range(3)]
        match = index.match(prompt, block_keys(prompt, block))
        assert match.length == _reference_match(index, prompt), prompt


def test_a_lookup_among_thousands_of_prompt_ends_reads_a_few(monkeypatch):
    # Prompts shorter than a block are all roots: a lookup and a kept prompt end used to
    # compare tokens with every one of them (every request, slower the longer a worker ran).
    rng = random.Random(7)
    index = BlockIndex(256, cuttable=True)
    prompts = [[rng.randrange(50_000) for _ in range(128)] for _ in range(5_000)]
    for prompt in prompts:
        index.set_ram(index.add(None, tuple(prompt)), object(), 1, False)
    reads = 0

    def counting(a, b):
        nonlocal reads
        reads += 1
        return common_length(a, b)

    monkeypatch.setattr(children_module, "common_length", counting)
    prompt = [*prompts[1234][:100], 1, 2, 3]
    assert index.match(prompt, block_keys(prompt, 256)).length == 100
    start = index.add(None, tuple(prompts[99][:50]))  # an earlier prompt's start
    index.set_ram(start, object(), 1, False)
    assert index.shorter_ends(index.add(None, tuple(prompts[99]))) == [start]
    assert reads <= 12


def test_a_child_leaves_by_identity_among_equal_tokens():
    children: Children[Leaf] = Children()
    first, second = Leaf((1, 2)), Leaf((1, 2))
    children.add(b"a", first)
    children.add(b"b", second)
    children.pop(b"a")
    assert children.longest_common((1, 2, 3)) == (second, 2)
    assert list(children.prefixes((1, 2, 3))) == [second]
