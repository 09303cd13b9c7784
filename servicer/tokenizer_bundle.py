"""The tokenizer archive the router fetches with GetTokenizer (when started without a model path).

A zip of the model directory's tokenizer and config files, streamed in chunks of at most
64 KiB; the archive's SHA-256 hex digest rides on the last chunk only.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

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
