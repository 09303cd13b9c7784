"""The benchmark's workload: prompts, request shapes and the statistics it reports.

Prompt sources: random token ids (`make_prompts`, any length: the sweep's and the long
prompts), copy-heavy text (`copy_prompts`), chat and genai-style text (`chat_prompts`,
`chat_prompt`, `system_texts`), and natural text for a real model (`natural_prompts`).
Shared by the raw-engine loop (raw.py) and the gRPC load driver (load.py), so both run
exactly the same prompts. Imports nothing heavy: raw.py runs it next to MLX, load.py next
to grpc.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import _checkout  # noqa: F401  (before any `servicer` import)

T = TypeVar("T")

# Warm-up requests use their own prompts, so a worker with a prompt cache gets no head start.
WARMUP_SEED = "warmup"

# A round during which the hypervisor took more than this share of the machine's CPU time
# measured the neighbours as much as the worker: it does not count when cleaner ones exist.
STEAL_LIMIT = 0.05


@dataclass(frozen=True)
class Shape:
    """One request shape: prompt length and new tokens (always ignore_eos, temperature 0)."""

    prompt_tokens: int = 128
    max_tokens: int = 128


def model_vocab_size(model_dir: Path) -> int:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    for section in (config, config.get("text_config") or {}):
        if isinstance(section.get("vocab_size"), int):
            return int(section["vocab_size"])
    raise ValueError(f"{model_dir}/config.json names no vocab_size")


def make_prompts(
    count: int, length: int, vocab_size: int, seed: int | str = 0, start: int = 0
) -> list[list[int]]:
    """Prompts `start` .. `start + count - 1` of the sequence that `seed` names.

    Each prompt depends only on (seed, index), so any run gets the same prompts in the same
    order. They are random token ids (no shared prefixes, so no prompt-cache hits), clear of
    the lowest ids, where tokenizers keep their special tokens.
    """
    low = min(max(8, vocab_size // 16), vocab_size - 1)
    prompts = []
    for index in range(start, start + count):
        rng = random.Random(f"{seed}/{index}")
        prompts.append([rng.randrange(low, vocab_size) for _ in range(length)])
    return prompts


# Held-out text: none of it is in the demo corpus, so copying it takes induction, not memory.
PASSAGES: tuple[str, ...] = (
    "The lighthouse keeper wrote the weather in a green notebook every evening, even when "
    "nothing changed, because his father had done the same for forty years.",
    "Maria planted tomatoes along the fence, basil between them, and marigolds at the ends "
    "to keep the beetles away from the young leaves.",
    "The committee met on Thursday and agreed to paint the town hall blue, although nobody "
    "could say who had suggested blue in the first place.",
    "A bicycle chain needs oil every few hundred miles, more often in the rain, and it will "
    "tell you with a dry squeak when you have forgotten.",
    "Our neighbour keeps bees on the roof of his garage and sells the honey in small jars "
    "with hand written labels that say the month it was taken.",
    "The museum closed its east wing for repairs, so the dinosaur skeleton was moved into "
    "the lobby where children now eat their lunch beneath it.",
)


def copy_prompts(tokenizer: Any) -> list[list[int]]:
    """Copy-heavy prompts (the answer repeats spans of the prompt): each passage then its
    first words again, then each passage in a chat request to repeat it."""
    start_again, repeat_request = [], []
    for passage in PASSAGES:
        opening = " ".join(passage.split()[:4])
        start_again.append(tokenizer.encode(f"{passage}\n\n{opening}", add_special_tokens=False))
        request = f"{passage}\n\nRepeat the text above."
        repeat_request.append(chat_prompt(tokenizer, None, request))
    return start_again + repeat_request


def chat_prompts(tokenizer: Any) -> list[list[int]]:
    """Genai-style prompts on the demo text: the demo test prompts, openings of every 5th
    corpus paragraph, and the first chat questions (in the chat template)."""
    from servicer.demos.text import TEST_PROMPTS, _read_corpus

    prose, chats = _read_corpus()
    texts = [*TEST_PROMPTS, *(" ".join(p.split()[:5]) for p in prose[::5])]
    prompts = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
    return prompts + [chat_prompt(tokenizer, None, user) for user, _ in chats[:6]]


def chat_prompt(tokenizer: Any, system: str | None, question: str) -> list[int]:
    """Token ids as the router sends them: the model's own chat template."""
    messages = [{"role": "system", "content": system}] if system is not None else []
    messages.append({"role": "user", "content": question})
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def system_texts(tokenizer: Any, count: int, tokens: int, seed: str) -> list[str]:
    """`count` different system prompts of about `tokens` tokens of demo text."""
    from servicer.demos.text import TEST_PROMPTS

    texts = []
    for i in range(count):
        rng, words = random.Random(f"{seed}-{i}"), []
        while len(tokenizer.encode(" ".join(words), add_special_tokens=False)) < tokens:
            words.append(rng.choice(TEST_PROMPTS))
        texts.append(" ".join(words))
    return texts


# --------------------------------------------------------------------------- natural text
# For a real model: what it continues by copying from its prompt (code, a passage again) and
# what it does not (prose).

# The start of a module whose continuation repeats identifiers from the prompt.
REAL_CODE: tuple[str, ...] = (
    '''"""Inventory management: items, stock levels and orders."""

from dataclasses import dataclass


@dataclass
class Item:
    sku: str
    name: str
    price: float
    quantity: int = 0


class Inventory:
    """Items by SKU."""

    def __init__(self) -> None:
        self.items: dict[str, Item] = {}

    def add_item(self, item: Item) -> None:
        self.items[item.sku] = item

    def remove_item(self, sku: str) -> None:
        del self.items[sku]

    def get_item(self, sku: str) -> Item:
        return self.items[sku]

    def restock(self, sku: str, amount: int) -> None:
        item = self.get_item(sku)
        item.quantity += amount

''',
    '''import math


class Vector:
    """A vector in three dimensions."""

    def __init__(self, x: float, y: float, z: float) -> None:
        self.x = x
        self.y = y
        self.z = z

    def __add__(self, other: "Vector") -> "Vector":
        return Vector(self.x + other.x, self.y + other.y, self.z + other.z)

    def __sub__(self, other: "Vector") -> "Vector":
        return Vector(self.x - other.x, self.y - other.y, self.z - other.z)

    def __mul__(self, scale: float) -> "Vector":
        return Vector(self.x * scale, self.y * scale, self.z * scale)

''',
    '''class BankAccount:
    """A bank account with deposits, withdrawals and a history."""

    def __init__(self, owner: str, balance: float = 0.0) -> None:
        self.owner = owner
        self.balance = balance
        self.history: list[tuple[str, float]] = []

    def deposit(self, amount: float) -> None:
        if amount <= 0:
            raise ValueError("deposit must be positive")
        self.balance += amount
        self.history.append(("deposit", amount))

''',
)
# Openings of prose the model continues freely (nothing in the prompt to copy).
REAL_PROSE: tuple[str, ...] = (
    "The first snow of the year came early to the village, and",
    "When I was twelve my grandmother taught me how to",
    "The history of the printing press begins in",
)


def real_passages() -> list[str]:
    """Two paragraphs of the demo corpus (natural text), then their first 8 words again."""
    text = (
        Path(__file__).resolve().parent.parent / "servicer" / "demos" / "corpus.txt"
    ).read_text()
    paragraphs = [p.strip() for p in text.split("\n\n") if len(p.strip()) >= 200]
    out = []
    for i in (0, 2, 4):
        passage = f"{paragraphs[i]} {paragraphs[i + 1]}"
        out.append(f"{passage}\n\n{' '.join(passage.split()[:8])}")
    return out


def natural_prompts(tokenizer: Any) -> dict[str, list[list[int]]]:
    """Code, a passage then its start, and prose, through a real model's tokenizer, BOS first
    (as the worker receives a prompt)."""
    bos = tokenizer.bos_token_id

    def encode(text: str) -> list[int]:
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        return ids if bos is None else [bos, *ids]

    texts = {"code": REAL_CODE, "passage, then its start": real_passages(), "prose": REAL_PROSE}
    return {name: [encode(t) for t in chosen] for name, chosen in texts.items()}


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _cpu_ticks(stat: Path) -> tuple[int, int] | None:
    """(steal, all) jiffies from the first line of /proc/stat; None where there is none."""
    try:
        fields = stat.read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    if fields[:1] != ["cpu"] or len(fields) < 9:
        return None
    ticks = [int(value) for value in fields[1:9]]  # user .. steal; guest is inside user
    return ticks[7], sum(ticks)


class StealMeter:
    """The share of the machine's CPU time a hypervisor gave to other guests while measuring.

    On a shared virtual machine this moves a run's speed by tens of percent from one minute
    to the next; a ratio measured through it says more about the neighbours than the worker.
    `share()` is None where the kernel does not report it (not Linux).
    """

    def __init__(self, stat: Path = Path("/proc/stat")) -> None:
        self._stat = stat
        self._start = _cpu_ticks(stat)

    def share(self) -> float | None:
        end = _cpu_ticks(self._stat)
        if self._start is None or end is None:
            return None
        steal, total = end[0] - self._start[0], end[1] - self._start[1]
        return steal / total if total > 0 else 0.0


def disturbed(steal_share: float | None) -> bool:
    return steal_share is not None and steal_share > STEAL_LIMIT


def counted_runs(runs: Sequence[T], was_disturbed: Callable[[T], bool]) -> list[T]:
    """The runs the hypervisor left alone, or all of them when it disturbed every one."""
    return [run for run in runs if not was_disturbed(run)] or list(runs)


@dataclass
class RequestRecord:
    """What one request did, seen from whoever sent it (times in seconds)."""

    start: float
    end: float = 0.0
    ttft: float | None = None
    tokens: int = 0
    # Gap between successive arrivals divided by the tokens that arrived, once per token
    # (the same convention as the worker's inter-token metric).
    itl: list[float] = field(default_factory=list)
    error: str | None = None
    cached_tokens: int = 0  # prompt tokens the worker reported as reused from its cache


def note_token(record: RequestRecord, now: float) -> None:
    """One more token of a request arrived at `now` (the raw engine's loops)."""
    if record.ttft is None:
        record.ttft = now - record.start
    else:
        record.itl.append(now - record.end)
    record.end = now
    record.tokens += 1


@dataclass
class LevelStats:
    """One measured run of N requests at one concurrency."""

    concurrency: int
    requests: int
    seconds: float
    output_tokens: int
    tokens_per_s: float
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    ttft_max_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    e2e_p50_ms: float | None
    errors: int
    cached_tokens: int = 0
    error_samples: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_records(
        cls,
        concurrency: int,
        records: Sequence[RequestRecord],
        expected_tokens: int | None = None,
        **extra: Any,
    ) -> LevelStats:
        """Aggregate; a request is an error if it failed or (with expected_tokens) came up short."""
        seconds = max(r.end for r in records) - min(r.start for r in records) if records else 0.0
        tokens = sum(r.tokens for r in records)
        errors = [
            r
            for r in records
            if r.error is not None or (expected_tokens is not None and r.tokens != expected_tokens)
        ]
        ok = [r for r in records if r.error is None]
        ttfts = [r.ttft for r in ok if r.ttft is not None]
        itl = [gap for r in ok for gap in r.itl]
        e2e = [r.end - r.start for r in ok]
        samples = sorted(
            {r.error or f"{r.tokens} tokens, expected {expected_tokens}" for r in errors}
        )

        def ms(value: float | None) -> float | None:
            return None if value is None else value * 1000

        return cls(
            concurrency=concurrency,
            requests=len(records),
            seconds=seconds,
            output_tokens=tokens,
            tokens_per_s=tokens / seconds if seconds > 0 else 0.0,
            ttft_p50_ms=ms(percentile(ttfts, 50)),
            ttft_p90_ms=ms(percentile(ttfts, 90)),
            ttft_max_ms=ms(max(ttfts)) if ttfts else None,
            itl_p50_ms=ms(percentile(itl, 50)),
            itl_p99_ms=ms(percentile(itl, 99)),
            e2e_p50_ms=ms(percentile(e2e, 50)),
            errors=len(errors),
            cached_tokens=sum(r.cached_tokens for r in records),
            error_samples=samples[:5],
            extra=dict(extra),
        )
