"""Prompt blocks for prefix reuse: fixed-size token blocks named by a chained hash, so that
identical prefixes have identical names whichever request made them. Pure (no MLX); the handler side
names a request's blocks, the engine's prefix store keeps them."""

from __future__ import annotations

import hashlib
from array import array

KEY_BYTES = 16
ROOT = b"\0" * KEY_BYTES  # the empty prefix


def block_key(parent: bytes, tokens: list[int] | tuple[int, ...]) -> bytes:
    """A block's name: its tokens and everything before it (through `parent`'s name)."""
    digest = hashlib.blake2b(parent, digest_size=KEY_BYTES)
    digest.update(array("i", tokens).tobytes())
    return digest.digest()


def block_keys(tokens: list[int], block_size: int) -> tuple[bytes, ...]:
    """The names of the full blocks of `tokens`, in order."""
    keys = []
    parent = ROOT
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_key(parent, tokens[start : start + block_size])
        keys.append(parent)
    return tuple(keys)


# Image tokens' ids in the store's view: above any vocabulary, below 2**31 (KV events' ids).
IMAGE_ID_BASE = 1 << 30


def image_keyed(prompt: list[int], images: list[tuple[int, int, bytes]]) -> list[int]:
    """`prompt` with each image's placeholder run (offset, length, key) replaced by ids drawn
    from the image's key and the position in it: the same prompt with another image names
    other blocks from the image on; the same image names the same ones."""
    keyed = list(prompt)
    for offset, length, key in images:
        for i in range(length):
            digest = hashlib.blake2b(key + i.to_bytes(4, "little"), digest_size=4).digest()
            keyed[offset + i] = IMAGE_ID_BASE | (int.from_bytes(digest, "little") >> 2)
    return keyed


def adapter_keyed(prompt: list[int], adapter: str) -> list[int]:
    """`prompt` as an adapter's rows name their blocks: its first token replaced by an id drawn from
    the adapter's name and that token, so that no block of one adapter (or of the base model) is
    ever served to another; the same prompt under the same adapter names the same blocks."""
    if not prompt:
        return prompt
    seed = adapter.encode() + b"\0" + prompt[0].to_bytes(4, "little", signed=True)
    digest = hashlib.blake2b(seed, digest_size=4, person=b"adapter").digest()
    return [IMAGE_ID_BASE | (int.from_bytes(digest, "little") >> 2), *prompt[1:]]
