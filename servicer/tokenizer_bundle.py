"""The tokenizer archive the router fetches with GetTokenizer (when started without a model path).

A zip of the model directory's tokenizer and config files, streamed in chunks of at most
64 KiB; the archive's SHA-256 hex digest rides on the last chunk only. For a family whose
image token the router looks up by another spelling, the router gets a respelled copy
(`router_tokenizer`), as this archive and as GetModelInfo's tokenizer_path.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import logging
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from .demos.common import build_atomically, default_cache_dir
from .vision_families import FAMILIES

log = logging.getLogger(__name__)

CHUNK_BYTES = 64 * 1024

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "tiktoken.model",
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",
)
TOKENIZER_PATTERNS = ("*.jinja", "*.tiktoken", "*.model")


@dataclass(frozen=True)
class TokenizerArchive:
    data: bytes
    sha256: str

    def chunks(self, size: int = CHUNK_BYTES) -> Iterator[bytes]:
        for start in range(0, len(self.data), size):
            yield self.data[start : start + size]


def tokenizer_files(model_dir: Path) -> list[Path]:
    """The files that go into the archive, in a stable order."""
    chosen = {name: model_dir / name for name in TOKENIZER_FILES if (model_dir / name).is_file()}
    for pattern in TOKENIZER_PATTERNS:
        for path in sorted(model_dir.glob(pattern)):
            if path.is_file():
                chosen.setdefault(path.name, path)
    return list(chosen.values())


def build_archive(model_dir: Path) -> TokenizerArchive:
    files = tokenizer_files(model_dir)
    if not files:
        raise FileNotFoundError(f"no tokenizer files in {model_dir}")
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for path in files:
            # A fixed timestamp keeps the archive (and its digest) stable across restarts.
            entry = zipfile.ZipInfo(path.name, date_time=(1980, 1, 1, 0, 0, 0))
            entry.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(entry, path.read_bytes())
    data = buffer.getvalue()
    return TokenizerArchive(data=data, sha256=hashlib.sha256(data).hexdigest())


class ArchiveBuild:
    """The archive, built once off the event loop; concurrent callers share the build, and a
    failed build is tried again by the next caller."""

    def __init__(self) -> None:
        self._task: asyncio.Task[TokenizerArchive] | None = None

    async def get(self, model_dir: Path) -> TokenizerArchive:
        task = self._task
        if task is None or (task.done() and task.exception()):
            task = self._task = asyncio.ensure_future(asyncio.to_thread(build_archive, model_dir))
        return await asyncio.shield(task)


# The files that spell added tokens: added tokens, special-token lists, chat templates.
_SPELLING_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.json",
)
ROUTER_TOKENIZERS = "router-tokenizers"  # the copies' folder in the worker's cache


def renamed_token(files: Mapping[str, bytes], old: str, new: str) -> dict[str, bytes]:
    """The tokenizer `files` (name -> contents) with the added token `old` spelled `new`
    wherever a file spells it; other files as they are. ValueError unless tokenizer.json has
    `old` as an added token and not `new` (both plain: no quote or backslash)."""
    if any(c in token for token in (old, new) for c in '"\\'):
        raise ValueError(f"cannot respell {old!r} as {new!r} in JSON text")
    added = {t.get("content") for t in json.loads(files["tokenizer.json"])["added_tokens"]}
    if old not in added or new in added:
        raise ValueError(f"tokenizer.json must have {old!r} and not {new!r} as added tokens")
    spells = set(_SPELLING_FILES)
    return {
        name: data.replace(old.encode(), new.encode())
        if name in spells or name.endswith(".jinja")
        else data
        for name, data in files.items()
    }


def retyped_config(files: Mapping[str, bytes], model_type: str) -> dict[str, bytes]:
    """The tokenizer `files` with config.json's model_type `model_type` (KeyError: none)."""
    config = json.loads(files["config.json"])
    return {**files, "config.json": json.dumps({**config, "model_type": model_type}).encode()}


def router_tokenizer(
    model_dir: Path, model_type: str, image_token: str, cache_dir: Path | None = None
) -> Path | None:
    """The router's copy of `model_dir`'s tokenizer files with `image_token` respelled and
    config.json's model_type renamed, where its family needs either
    (`VisionFamily.router_image_token`, `router_model_type`; None elsewhere, or when it cannot
    be made).
    Written once into the worker's cache, named by its contents, by an atomic rename; the
    checkpoint itself is never touched."""
    family = FAMILIES.get(model_type)
    new = family.router_image_token if family is not None else None
    new = None if new == image_token else new
    retyped = family.router_model_type if family is not None else None
    if new is None and retyped is None:
        return None
    try:
        files = {path.name: path.read_bytes() for path in tokenizer_files(model_dir)}
        files = renamed_token(files, image_token, new) if new is not None else files
        files = retyped_config(files, retyped) if retyped is not None else files
        digest = hashlib.sha256()
        for name in sorted(files):
            digest.update(f"{name}:{len(files[name])}:".encode())
            digest.update(files[name])
        target = (cache_dir or default_cache_dir()) / ROUTER_TOKENIZERS / digest.hexdigest()[:32]

        def write(tmp: Path) -> None:
            for name, data in files.items():
                (tmp / name).write_bytes(data)

        return build_atomically(target, _written, write, "router tokenizer")
    except (OSError, KeyError, ValueError) as exc:
        log.warning("no router tokenizer for %s: images via the router fail: %s", model_dir, exc)
        return None


def _written(path: Path) -> bool:
    return (path / "tokenizer.json").is_file()  # a copy appears whole, by rename
