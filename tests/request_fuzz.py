"""Request fuzz: bad input gets a clear error with the right gRPC status, never a crash, a hang
or a lost request, on both faces (MlxEngine and VllmEngine) of one worker.

One worker (`--protocols mlx,vllm` on a demo model) gets, for each seed, a few hundred random
requests in batches, CONCURRENCY at a time: every RPC of both services, mostly malformed or
extreme (NaN, infinite, negative and huge sampling values; empty, huge and out-of-vocabulary
prompts; odd unicode; n > 1 with seeds; stop strings and stop ids; logprobs; malformed JSON
schemas, regexes and grammars; truncation; duplicate request ids; aborts of unknown and
in-flight ids; streams the client cancels). Each call must end within DEADLINE_S with OK or a
status of ALLOWED and a non-empty message; a request whose every value is valid must be served
and one with an invalid value refused; an accepted Generate call ends each of its n rows with
one GenerateComplete. After every batch the worker must be alive and SERVING with nothing left
in flight, and a fixed greedy request must return the tokens it returned at the start, on both
faces.

A vision-language model (`--kinds vlm`, the demo Gemma 3 VLM; `vlm:FAMILY`, any served family's
demo; or a checkpoint's directory) also gets vLLM-face Generate calls with image parts (media
references, one anchor per image in the prompt): valid PNG/JPEG/WEBP/GIF/BMP data: URLs of
random small sizes (a few fixed images reused, so that prefixes and features hit), undecodable,
truncated and oversized images, schemes not allowed, too many images, anchors and images that
do not pair up, other modalities and mm_inputs. Valid ones must be served (`prompt_tokens`
counting each image's expansion); a bad one refused with the status its problem has
(INVALID_ARGUMENT, or RESOURCE_EXHAUSTED for a limit) and, for one image, a message naming its
index; and after every batch a fixed greedy image request must return its tokens too.

`python tests/request_fuzz.py --seeds 20` (or `make fuzz-requests SEEDS=20`) prints what each
RPC answered and every finding (seed, batch and request: `--first-seed S --seeds 1` draws the
same requests again; `--trace PATH` writes every call as a JSON line); `--kinds gemma3,hybrid`
fuzzes the other demo kinds, `--kinds PATH` a model directory (a real tokenizer and vocabulary;
`--worker-args "--max-prompt-tokens 1024"` keeps a CPU's prefills within the deadline).
tests/test_request_fuzz.py runs one small seed in CI.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import dataclasses
import functools
import io
import itertools
import json
import math
import random
import re
import shlex
import struct
import sys
import threading
import time
import urllib.parse
import zlib
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TextIO

import grpc
import numpy as np
from google.protobuf import text_format
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support import WorkerProcess, wait_until

from servicer.proto import (
    common_pb2,
    mlx_engine_pb2,
    mlx_engine_pb2_grpc,
    vllm_engine_pb2,
    vllm_engine_pb2_grpc,
)

DEADLINE_S = 60.0  # a call still running after this long is a hang
SETTLE_S = 30.0  # after a batch, nothing may stay in flight longer than this
ABORT_GRACE_S = 15.0  # a call its client aborted ends within this long
CONCURRENCY = 6
BATCH = 25
REQUESTS = 300  # per seed
ALLOWED = frozenset(
    {
        "OK",
        "INVALID_ARGUMENT",
        "OUT_OF_RANGE",
        "FAILED_PRECONDITION",
        "RESOURCE_EXHAUSTED",
        "UNIMPLEMENTED",
        "ALREADY_EXISTS",
        "NOT_FOUND",
        "CANCELLED",  # only where the client cancelled
    }
)
STREAMS = frozenset({"Generate", "GetTokenizer", "SubscribeKvEvents"})
OK, REFUSED, ANY = "ok", "refused", "any"  # what a request must get
LOG_ERRORS = ("Traceback", " ERROR ", " CRITICAL ")
FACES: dict[str, tuple[Any, Any]] = {
    "mlx": (mlx_engine_pb2, mlx_engine_pb2_grpc.MlxEngineStub),
    "vllm": (vllm_engine_pb2, vllm_engine_pb2_grpc.VllmEngineStub),
}
KNOWN_GOOD_TOKENS = 16
KNOWN_GOOD_PROMPT = [8 + (i * 37) % 400 for i in range(300)]  # past a prefix block (256)
NAN, INF = math.nan, math.inf
F32_MAX = 3.4028234e38
UNICODE = (
    "a", "the ", " ", "\n", "\r\n", "\t", "é", "e\u0301", "ß", "İ", "中文", "ﷺ", "🙂",
    "👩\u200d👩\u200d👧", "\u202e", "\ufeff", "\uffff", "\U0010ffff", "\x00", "\u0085",
    "<|begin|>", "<|end|>", "<|user|>", "<think>",
)  # fmt: skip
WORDS = ("the", "sea", "river", "runs", "over", "stones", "wind", "light", "and", "a", "hill")


class Unset:
    def __repr__(self) -> str:
        return "unset"


UNSET = Unset()  # leave the field out


def short(value: Any, width: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= width else f"{text[:width]}...({len(text)} chars)"


@dataclass(frozen=True)
class Limits:
    """The model as GetModelInfo describes it: what the worker accepts."""

    vocab: int
    context: int
    prompt_limit: int
    bos: int | None  # put before prompts that do not start with it (None: never)
    vision: Vision | None = None  # how its prompts hold images (None: a text model)

    def final_prompt(
        self, ids: list[int], truncate: Any = UNSET, limit: int | None = None
    ) -> tuple[list[int], str | None]:
        """The prompt the worker runs, and why it must refuse it (None: it must accept it)."""
        if not ids:
            return ids, "empty prompt"
        if self.bos is not None and ids[0] != self.bos:
            ids = [self.bos, *ids]
        if truncate is not UNSET:
            if truncate < 1 and truncate != -1:
                return ids, f"truncate_prompt_tokens={truncate}"
            ids = ids[-(self.prompt_limit if truncate == -1 else truncate) :]
        if any(t >= self.vocab for t in ids):
            return ids, "an out-of-vocabulary token"
        if len(ids) > (limit or self.prompt_limit):
            return ids, f"a prompt of {len(ids)} tokens"
        return ids, None


Option = Any  # a value, or a function of the Draw that makes one


class Draw:
    """The random values of one request, and which of them make it bad (the worker must refuse
    it) or odd (any allowed answer will do)."""

    def __init__(self, rng: random.Random, limits: Limits) -> None:
        self.rng = rng
        self.limits = limits
        self.p_bad = rng.choice((0.0, 0.0, 0.0, 0.03, 0.1, 0.3))
        self.p_odd = rng.choice((0.0, 0.05, 0.15))
        self.bad: list[str] = []
        self.odd: list[str] = []
        self.refusals: list[tuple[str, str]] = []  # (status, what its message says) per bad

    def one(self, options: Sequence[Option]) -> Any:
        value = self.rng.choice(options)
        return value(self) if callable(value) else value

    def pick(
        self, name: str, good: Sequence[Option], bad: Sequence[Option] = (), odd: Sequence = ()
    ) -> Any:
        roll = self.rng.random()
        if bad and roll < self.p_bad:
            value = self.one(bad)
            self.bad.append(f"{name}={short(value)}")
        elif odd and roll < self.p_bad + self.p_odd:
            value = self.one(odd)
            self.odd.append(f"{name}={short(value)}")
        else:
            value = self.one(good)
        return value

    def mark(self, name: str, options: Sequence[Option], odd: bool = False) -> Any:
        """A value that always makes the request bad (or odd)."""
        value = self.one(options)
        (self.odd if odd else self.bad).append(f"{name}={short(value)}")
        return value

    def refuse(self, why: str, code: str, says: str) -> None:
        """A bad value whose refusal must have this status and a message matching `says`
        (checked where every bad value of the request says so)."""
        self.bad.append(why)
        self.refusals.append((code, says))

    def chance(self, p: float) -> bool:
        return self.rng.random() < p

    def token(self) -> int:
        return self.rng.randrange(self.limits.vocab)

    def tokens(self, low: int, high: int) -> list[int]:
        return [self.token() for _ in range(self.rng.randint(low, high))]

    def text(self, low: int, high: int, pieces: Sequence[str] = UNICODE) -> str:
        return "".join(self.rng.choice(pieces) for _ in range(self.rng.randint(low, high)))

    def words(self, low: int, high: int) -> str:
        return " ".join(self.text(1, 1, WORDS) for _ in range(self.rng.randint(low, high)))

    @property
    def expect(self) -> str:
        return REFUSED if self.bad else ANY if self.odd else OK

    @property
    def why(self) -> tuple[str, ...]:
        return (*self.bad, *self.odd)


@dataclass
class Batch:
    """Requests sent together: the ids they share and the ids an Abort names."""

    tag: str
    ids: list[str] = field(default_factory=list)
    shared: set[str] = field(default_factory=set)  # carried by two requests at once
    aborted: set[str] = field(default_factory=set)


@dataclass
class Case:
    """One call and how the client behaves during it."""

    face: str
    method: str
    request: Any
    expect: str = OK
    why: tuple[str, ...] = ()
    rows: int = 1  # Generate: n
    max_tokens: int | None = None
    cancel_after: int | None = None  # the client cancels after this many messages
    abort_after: int | None = None  # ... or sends Abort for its own id
    cancel_at_s: float | None = None  # ... or cancels after this long
    abort_at_s: float | None = None  # ... or sends Abort after this long
    refusals: tuple[tuple[str, str], ...] = ()  # a refusal must be one of these (status, regex)
    prompt_tokens: int | None = None  # Generate: what each GenerateComplete must count
    label: str = ""  # what its images were (valid, or their first problem)
    bad_images: frozenset[int] = frozenset()  # the indices a refusal may name

    @property
    def rpc(self) -> str:
        return f"{self.face}.{self.method}"

    @property
    def client(self) -> str:
        """What the client does during the call, if anything."""
        acts = (
            ("cancels after {} messages", self.cancel_after),
            ("aborts after {} messages", self.abort_after),
            ("cancels after {} s", self.cancel_at_s),
            ("aborts after {} s", self.abort_at_s),
        )
        return "; ".join(text.format(value) for text, value in acts if value is not None)


# ----- the values of each field: (good, bad[, odd]) -----

SAMPLING: dict[str, tuple[tuple, tuple]] = {
    "temperature": (
        (UNSET, UNSET, 0.0, 1e-39, 0.3, 0.7, 1.0, 1.5, 1e30, F32_MAX),
        (-0.5, -1e-30, NAN, INF, -INF, 1e39),
    ),
    "top_p": ((UNSET, 0.0, 1e-7, 0.5, 0.95, 1.0), (-0.1, 1.0001, 2.0, NAN, INF, -INF)),
    "top_k": ((UNSET, 0, 1, 5, 40, 511, 512, 513, 2**32 - 1), ()),
    "min_p": ((UNSET, 0.0, 0.05, 0.5, 1.0), (-0.01, 1.5, NAN, INF)),
    "repetition_penalty": (
        (UNSET, 0.0, 1e-6, 0.5, 1.0, 1.3, 100.0, 1e30),
        (-1.0, -1e-9, NAN, INF, -INF),
    ),
    "frequency_penalty": ((UNSET, 0.0, -2.0, 0.5, 2.0, 1e30, -1e30, F32_MAX), (NAN, INF, -INF)),
    "presence_penalty": ((UNSET, 0.0, -2.0, 0.5, 2.0, 1e30, -1e30, -F32_MAX), (NAN, INF, -INF)),
    "seed": ((UNSET, 0, 1, 42, -1, 2**31 - 1, -(2**31)), ()),
    "logprobs": ((UNSET, UNSET, 0, 1, 5, 20), (-1, 21, 2**31 - 1, -(2**31))),
    "ignore_eos": ((False, True), ()),
}
JSON_SCHEMAS = (
    (
        '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}',
        '{"type": "string", "maxLength": 5}',
        '{"enum": ["yes", "no"]}',
        '{"type": "array", "items": {"type": "boolean"}, "maxItems": 3}',
        '{"type": "object"}',
    ),
    (
        "", "{", "[]", "null", '"string"', "\x00", '{"type": "nonsense"}', '{"properties": 5}',
        '{"type": "string", "pattern": "("}', '{"$ref": "#/definitions/missing"}',
        '{"type": "object", "required": 7}',
    ),
    (
        "{}", '{"type": "integer", "minimum": 5, "maximum": 1}', '{"not": {}}',
        '{"type": "array", "items": ' * 200 + "{}" + "}" * 200,
        '{"type": "string", "pattern": "\\\\p{Emoji}+"}', '{"x-guidance": {"bad": 1}}',
    ),
)  # fmt: skip
REGEXES = (
    ("[a-z]{1,8}", "yes|no", "[0-9]+", ".{0,5}", "(the|sea)( (the|sea)){0,3}"),
    ("(", "[a-", "(?P<x", "a{5,2}", "*a"),
    # llguidance compiles these two on every vocabulary ("\\" at the end, and "a**"): odd.
    (
        "\\",
        "a**",
        "",
        "a{99999}",
        "(a|b)*c{200}",
        "\\p{L}+",
        "(?i)abc",
        "(?=a)b",
        "🙂+",
        "\\x00",
        "[^\\s\\S]",
    ),
)
GRAMMARS = (
    ('root ::= "yes" | "no"', "root ::= [a-z]+", 'start: "a"+', 'root ::= "x" root | "y"'),
    (
        "root ::= undefined_rule",
        "::= ::=",
        "",
        "%import foo",
        "root ::= (",
        "\x00",
        "root ::= root",
    ),
    (
        "root ::= ",
        'root ::= "a" root',
        "start: /[a-z]+/",
        "root ::= [^\\x00-\\x7f]",
    ),
)
LARK = (
    ('start: "x" | "y"', "start: /[0-9]+/", 'start: "a" b\nb: "b"'),
    ("start: undefined", "%%%", "", "start: (", "start: /(/", "start: start"),
    ("start: ", 'start: "🙂"', 'start: %json {"type": "object"}'),
)
CHOICES = (
    (["red", "green"], ["yes"], ["the sea", "the river", "a hill"]),
    ([],),
    ([""], ["🙂", "\x00"], ["a" * 2000], [f"c{i}" for i in range(300)], ["same", "same"]),
)


# ----- one request of each kind -----


def request_id(d: Draw, batch: Batch) -> str:
    roll = d.rng.random()
    if roll < 0.03:
        d.bad.append("request_id=''")
        return ""
    if roll < 0.08 and batch.ids:  # two requests with one id, sent at once
        rid = d.rng.choice(batch.ids)
        batch.shared.add(rid)
        return rid
    rid = f"{batch.tag}-{len(batch.ids)}"
    if roll < 0.15:
        rid += d.text(1, 6)
    elif roll < 0.17:
        rid += "x" * 5000
    batch.ids.append(rid)
    return rid


def prompt_tokens(d: Draw) -> list[int]:
    """A prompt's ids, valid or not: the worker's rules judge them (Limits.final_prompt)."""
    limits = d.limits
    if d.chance(0.02):  # near the limit: a long prefill
        return d.tokens(limits.prompt_limit - 2, limits.prompt_limit + 1)
    if d.chance(0.002):  # past gRPC's message limit (16 MiB)
        return [2**32 - 1] * 4_000_000
    return d.one(
        (
            lambda d: d.tokens(1, 12),
            lambda d: d.tokens(1, 12),
            lambda d: d.tokens(1, 12),
            lambda d: d.tokens(12, 120),
            lambda d: d.tokens(12, 120),
            lambda d: [limits.bos or 0, *d.tokens(1, 30)],
            lambda d: KNOWN_GOOD_PROMPT[: d.one((1, 255, 256, 257, 300))] + d.tokens(0, 40),
            lambda d: [d.rng.randrange(8)] * d.rng.randint(1, 40),  # special tokens only
            lambda d: d.one(
                (
                    [],
                    lambda d: [*d.tokens(0, 8), limits.vocab + d.rng.randrange(1000)],
                    lambda d: [2**32 - 1, *d.tokens(0, 8)],
                    lambda d: [*d.tokens(1, 8), limits.vocab, *d.tokens(1, 8)],
                )
            ),
        )
    )


def prompt_input(d: Draw, request: Any, truncate: Any) -> list[int] | None:
    """Fill the request's input; returns the prompt the worker runs (None: text, whose length
    only the worker knows)."""
    if d.chance(0.12):
        text = d.pick(
            "text",
            (lambda d: d.words(1, 30),),
            (lambda d: "",),
            (lambda d: d.text(1, 60), lambda d: d.words(6000, 6000), lambda d: "\x00" * 9),
        )
        request.text = text
        if truncate is not UNSET and (truncate < 1 and truncate != -1):
            d.bad.append(f"truncate_prompt_tokens={truncate}")
        return None
    ids = prompt_tokens(d)
    request.tokenized.input_ids.extend(ids)
    if d.chance(0.2):
        request.tokenized.original_text = d.text(0, 20)
    final, problem = d.limits.final_prompt(ids, truncate)
    if problem is not None:
        d.bad.append(problem)
    return final


def sampling_numbers(d: Draw, params: Any) -> None:
    for name, (good, bad) in SAMPLING.items():
        value = d.pick(name, good, bad)
        if value is not UNSET:
            setattr(params, name, value)
    if d.chance(0.2):
        for _ in range(d.rng.randint(1, 4)):
            vocab = d.limits.vocab
            token = d.pick(
                "logit_bias token", (lambda d: d.token(), 0, vocab - 1), (vocab, -1, 2**31 - 1)
            )
            if token not in params.logit_bias:
                values = (0.0, 5.0, -5.0, 100.0, -100.0, 1e30, -1e30, F32_MAX)
                params.logit_bias[token] = d.pick("logit_bias value", values, (NAN, INF, -INF))


def lengths(d: Draw, params: Any, prompt: list[int] | None, rows: int) -> int | None:
    """max_tokens and min_tokens; returns the most tokens a row may generate (None: unknown).
    Many rows get few tokens: should their client's abort or cancel come too early to find
    them, they still end well within the deadline."""
    small = (1, 2, 5, 8, 16, 24, 64)
    good = small if rows > 4 else (UNSET, *small, 4096, 2**32 - 1)
    max_tokens = d.pick("max_tokens", good, (0,))
    if max_tokens is not UNSET:
        params.max_tokens = max_tokens
    room = None if prompt is None else d.limits.context - len(prompt)
    most = max_tokens if max_tokens is not UNSET else room
    if room is not None and most is not None:
        most = min(most, room)
    min_tokens = d.one((1, 3, 8, 100, 5000, 2**32 - 1)) if d.chance(0.15) else 0
    if min_tokens:
        params.min_tokens = min_tokens
        if most is not None and min_tokens > most and max_tokens != 0:
            d.bad.append(f"min_tokens={min_tokens} above max_tokens={most}")
        elif room is None:
            d.odd.append(f"min_tokens={min_tokens} after a text prompt")
    return most


def stops(d: Draw, params: Any) -> None:
    if d.chance(0.35):
        strings = d.pick(
            "stop",
            (lambda d: [d.text(1, 3) for _ in range(d.rng.randint(1, 4))], lambda d: ["\n"]),
            (lambda d: [""], lambda d: ["x" * 257], lambda d: ["a"] * 17, lambda d: ["b", ""]),
            (lambda d: ["🙂" * 256], lambda d: [" "] * 16),
        )
        params.stop.extend(strings)
        params.include_stop_str_in_output = d.chance(0.5)
    if d.chance(0.3):
        vocab = d.limits.vocab
        params.stop_token_ids.extend(
            d.one(
                (
                    lambda d: d.tokens(1, 4),
                    [1],
                    [vocab, 2**32 - 1],
                    lambda d: [d.rng.randrange(2**32) for _ in range(2000)],
                )
            )
        )


def constraint(d: Draw, params: Any, face: str) -> None:
    if not d.chance(0.3):
        return
    extra = ("lark_grammar",) if face == "mlx" else ("json_object", "choice", "structural_tag")
    kind = d.rng.choice(("json_schema", "regex", "grammar", *extra))
    if kind == "json_object":
        params.json_object = d.pick("json_object", (True,), (), (False,))
    elif kind == "choice":
        params.choice.choices.extend(d.pick("choice", *CHOICES))
        params.choice.SetInParent()
    elif kind == "structural_tag":
        params.structural_tag = d.mark("structural_tag", ("", "{}", lambda d: d.text(0, 10)))
    else:
        pools = {"json_schema": JSON_SCHEMAS, "regex": REGEXES, "grammar": GRAMMARS}
        setattr(params, kind, d.pick(kind, *pools.get(kind, LARK)))


def face_extras(d: Draw, request: Any, face: str) -> None:
    """The fields only one face carries."""
    params = request.sampling_params
    if face == "mlx":
        params.return_text = d.chance(0.3)
        if d.chance(0.05):
            params.thinking_budget = d.mark("thinking_budget", (0, 5, 2**32 - 1), odd=True)
        return
    for name in ("skip_special_tokens", "spaces_between_special_tokens"):
        setattr(params, name, d.chance(0.5))
    if d.chance(0.1):
        params.prompt_logprobs = d.mark("prompt_logprobs", (0, 1, 5, -1))
    if d.chance(0.1):
        params.grammar_from_first_token = True
    if d.chance(0.08):
        d.odd.append("vLLM-only request fields")
        request.data_parallel_rank = d.rng.choice((0, 1, -1))
        request.kv_transfer_params.remote_host = d.text(0, 5)
        request.kv_transfer_params_json = d.rng.choice(("", "{", '{"a": 1}'))
        request.mm_inputs.SetInParent()
        request.media_refs.SetInParent()
    if d.chance(0.04):
        d.bad.append("media beside the prompt")  # a text model answers its placeholders wrongly
        media = d.rng.choice(("mm_inputs", "extra_mm_inputs", "media_refs"))
        if media == "mm_inputs":
            request.mm_inputs.im_token_id = d.token()
        elif media == "extra_mm_inputs":
            request.extra_mm_inputs.add().mm_hashes.append(d.text(1, 8))
        else:
            request.media_refs.items.add(url=d.text(0, 10))


# ----- images (a vision-language model's vLLM face: kind vlm) -----

IMAGE = common_pb2.IMAGE
NOT_IMAGES = (common_pb2.MODALITY_UNSPECIFIED, common_pb2.AUDIO, common_pb2.VIDEO, 7)
SIDE = 4096  # a square image SIDE x SIDE has the worker's --max-image-pixels default
QUESTIONS = ("Describe this picture.", "What is in the image?", "Hi.")
INVALID, LIMIT = "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"
FIXED_IMAGES = (  # reused across requests (prefix and encoder cache hits): seed, size, mode, format
    (0, (64, 48), "RGB", "PNG"),
    (1, (32, 32), "RGB", "PNG"),
    (2, (100, 30), "RGBA", "PNG"),
    (3, (48, 64), "RGB", "JPEG"),
    (4, (20, 20), "L", "JPEG"),
)


@dataclass(frozen=True)
class Vision:
    """How the model's prompts hold images (any served family, from the registry): the chat
    template renders `anchor` (one or more ids) per image, which the worker expands into the
    image's run, of a length that may depend on the image (`run_of`); `vision_ids` are the
    family's image tokens, kept out of random image prompts."""

    anchor: tuple[int, ...]
    anchor_text: str
    placeholder: int
    vision_ids: frozenset[int]
    max_images: int
    chats: tuple[tuple[int, ...], ...]  # the router's prompts, one anchor each
    open_end: bool  # an image's run ends the expansion (a prompt may not end in one)
    preparer: Any  # the worker's own ImagePreparer: the run each image expands into

    @classmethod
    def load(cls, model_dir: Path, client: Client) -> Vision | None:
        """The vision of a checkpoint the worker serves images for (None: not one)."""
        from transformers import AutoTokenizer

        from servicer.images import ImagePreparer
        from servicer.media import MediaPolicy
        from servicer.vision_families import vision_spec

        info = client.stubs["vllm"].GetModelInfo(vllm_engine_pb2.GetModelInfoRequest(), timeout=30)
        config = json.loads((model_dir / "config.json").read_text())
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        spec = vision_spec(config, tokenizer)
        if not info.supports_vision or spec is None:
            return None
        server = client.stubs["vllm"].GetServerInfo(
            vllm_engine_pb2.GetServerInfoRequest(), timeout=30
        )
        limits = dict(item.partition("=")[::2] for item in server.mm_item_limits.split(","))
        chats = []
        for question in QUESTIONS:
            content = [{"type": "image"}, {"type": "text", "text": question}]
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
            )
            chats.append(tuple(tokenizer.encode(text, add_special_tokens=False)))
        ids = {*spec.anchor, *spec.before, *spec.after, spec.image_token_id, *spec.placeholder_ids}
        anchor_text = tokenizer.decode(list(spec.anchor))
        preparer = ImagePreparer(model_dir, spec, MediaPolicy())
        return cls(
            spec.anchor,
            anchor_text,
            spec.image_token_id,
            frozenset(ids),
            int(limits["image"]),
            tuple(chats),
            not spec.after,
            preparer,
        )

    def run_of(self, url: str) -> int | None:
        """The tokens an anchor becomes for the image at `url` (a valid data: URL), as the
        worker expands it (None: the family's processor refuses the image)."""
        from servicer.media import _decode, _read_data
        from servicer.validation import RequestError

        policy = self.preparer.policy
        image = _decode(_read_data(url, policy), policy).image
        try:
            processed = self.preparer._process(0, image)
        except RequestError:
            return None
        spec = self.preparer.spec
        return len(spec.before) + (len(processed.run) or processed.tokens) + len(spec.after)


def with_anchors(d: Draw, ids: list[int], anchors: int, anchor: tuple[int, ...]) -> list[int]:
    """`ids` (no anchor among them) with `anchors` anchors at random places between them."""
    places = sorted(d.rng.randint(0, len(ids)) for _ in range(anchors))
    out, at = [], 0
    for place in places:
        out += [*ids[at:place], *anchor]
        at = place
    return out + ids[at:]


def model_dir(kind: str) -> Path | None:
    if "/" in kind:
        return Path(kind)
    if kind == "vlm" or kind.startswith("vlm:"):
        from servicer.demos.vision import demo_vlm_path

        return demo_vlm_path(family=kind.partition(":")[2] or "gemma3")
    return None


def encode_image(seed: int, size: tuple[int, int], mode: str = "RGB", fmt: str = "PNG") -> bytes:
    """Random pixels (one grey for a big image), encoded."""
    from PIL import Image

    width, height = size
    if width * height > 1 << 20:  # a big one: no random pixels to compress
        image = Image.new("L", size, seed % 256)
    else:
        pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
        image = Image.fromarray(pixels).convert(mode)
    out = io.BytesIO()
    if fmt == "GIF":  # an animation: the worker takes its first frame
        image.save(out, format="GIF", save_all=True, append_images=[image.rotate(90)])
    else:
        image.save(out, format=fmt)
    return out.getvalue()


fixed_image = functools.cache(encode_image)  # the same bytes each time


def png_header(width: int, height: int, pixels: bytes | None = None) -> bytes:
    """A PNG that says it is width x height, its pixel data `pixels` (default: a few zeros)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    data = zlib.compress(b"\0" * 64) if pixels is None else pixels
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", data) + chunk(b"IEND", b"")
    )


def data_url(raw: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64," + base64.b64encode(raw).decode()


def truncated(raw: bytes, d: Draw) -> bytes:
    return raw[: d.rng.randint(12, len(raw) * 2 // 3)]


def broken_lines(url: str) -> str:
    """A base64 data URL with its payload in lines of 76 characters (as MIME writes it)."""
    header, _, payload = url.partition(",")
    return header + "," + "\n".join(payload[i : i + 76] for i in range(0, len(payload), 76))


def fresh_image(d: Draw) -> str:
    """A new image: random size, mode and format."""
    fmt = d.one(("PNG", "PNG", "JPEG", "JPEG", "WEBP", "GIF", "BMP"))
    modes = ("RGB", "L") if fmt in ("JPEG", "BMP") else ("RGB", "RGBA", "L", "LA", "P", "1")
    size = d.one(((1, 1), lambda d: (d.rng.randint(1, 160), d.rng.randint(1, 160))))
    raw = encode_image(d.rng.randrange(2**32), size, d.one(modes), fmt)
    return data_url(raw, "image/" + fmt.lower())


def fixed_url(d: Draw) -> str:
    seed, size, mode, fmt = d.one(FIXED_IMAGES)
    return data_url(fixed_image(seed, size, mode, fmt), "image/" + fmt.lower())


GOOD_IMAGES: tuple[Option, ...] = (
    fixed_url,
    fixed_url,
    fixed_url,
    fixed_url,
    fresh_image,
    fresh_image,
    lambda d: data_url(fixed_image(0, (64, 48)), "image/jpeg"),  # a PNG said to be a JPEG
    lambda d: "data:image/png," + urllib.parse.quote(fixed_image(1, (32, 32))),  # %-escaped bytes
    lambda d: data_url(fixed_image(6, (24, 16), "I;16")),  # 16-bit grey
    # just at the pixel limit (rarely: it is big to decode)
    lambda d: data_url(fixed_image(7, (SIDE, SIDE))) if d.chance(0.1) else fixed_url(d),
)
ODD_IMAGES: tuple[Option, ...] = (
    # Extreme aspect ratios: a family's processor or tower may refuse them (Qwen2-VL's
    # processor, LFM2-VL's tower in mlx-vlm too), others serve them.
    lambda d: data_url(fixed_image(5, d.one(((1, 256), (256, 1))))),
    lambda d: "DATA:IMAGE/PNG;BASE64," + data_url(fixed_image(1, (32, 32)))[22:],
    lambda d: data_url(fixed_image(1, (32, 32))).rstrip("="),  # no padding
    lambda d: broken_lines(data_url(fixed_image(2, (100, 30), "RGBA"))),
    lambda d: "data:image/png;name=a.png;base64," + data_url(fixed_image(0, (64, 48)))[22:],
)
# What is wrong, the status it gets, and the URL.
BAD_IMAGES: tuple[tuple[str, str, Option], ...] = (
    ("bad base64", INVALID, lambda d: "data:image/png;base64,*not base64*" + d.text(0, 4)),
    ("bytes that are no image", INVALID, lambda d: data_url(d.rng.randbytes(d.one((1, 3, 300))))),
    ("bytes that are no image", INVALID, "data:image/png;base64,AAAA"),
    ("an empty image", INVALID, "data:image/png;base64,"),
    ("a truncated PNG", INVALID, lambda d: data_url(truncated(fixed_image(0, (64, 48)), d))),
    (
        "a truncated JPEG",
        INVALID,
        lambda d: data_url(truncated(fixed_image(3, (48, 64), "RGB", "JPEG"), d), "image/jpeg"),
    ),
    ("not an image media type", INVALID, lambda d: "data:text/plain;" + fixed_url(d).split(";")[1]),
    ("a data URL without a comma", INVALID, "data:image/png;base64"),
    ("a TIFF", INVALID, lambda d: data_url(fixed_image(8, (16, 16), "RGB", "TIFF"), "image/tiff")),
    ("an SVG", INVALID, "data:image/svg+xml,<svg xmlns='http://www.w3.org/2000/svg'/>"),
    ("a 0x0 PNG", INVALID, lambda d: data_url(png_header(0, 0))),
    ("corrupt pixel data", INVALID, lambda d: data_url(png_header(64, 64, b"\x78\x9cjunk"))),
    ("a 100000x100000 PNG header", LIMIT, lambda d: data_url(png_header(100000, 100000))),
    ("pixels over the limit", LIMIT, lambda d: data_url(fixed_image(9, (SIDE + 1, SIDE)))),
    ("http to loopback, no hosts allowed", INVALID, "http://127.0.0.1:1/cat.png"),
    ("https, no hosts allowed", INVALID, "https://example.com/cat.png"),
    ("file:, no media dir", INVALID, lambda d: d.one(("file:///etc/passwd", "file:///tmp/a.png"))),
    ("ftp:", INVALID, "ftp://127.0.0.1/cat.png"),
    ("javascript:", INVALID, "javascript:alert(1)"),
    ("no URL", INVALID, lambda d: d.one(("", "cat.png", "//example.com/cat.png", "data"))),
)


def plain_tokens(d: Draw, low: int, high: int) -> list[int]:
    """Random ids, none of them an image token."""
    assert d.limits.vision is not None
    ids = d.limits.vision.vision_ids
    return [8 + t % 400 if t in ids else t for t in d.tokens(low, high)]


def image_url(d: Draw, index: int, p_bad: float, kinds: list[str], bad: set[int]) -> str:
    """One image's URL; `kinds` gets what was wrong or odd with it, `bad` its index if bad."""
    if d.chance(p_bad):
        why, code, url = d.rng.choice(BAD_IMAGES)
        d.refuse(f"image {index}: {why}", code, rf"\b(image|media) {index}\b")
        kinds.append(why)
        bad.add(index)
        return url(d) if callable(url) else url
    if d.chance(0.04):
        url = d.one(ODD_IMAGES)
        d.odd.append(f"image {index}: {short(url)}")
        kinds.append("an odd data URL")
        return url
    return d.one(GOOD_IMAGES)


def image_prompt(d: Draw, anchors: int, runs: int) -> list[int]:
    """A prompt with `anchors` image anchors: the router's chat prompt, or ids around them
    (`runs`: the tokens the images' runs take in all, where they are known)."""
    vision = d.limits.vision
    assert vision is not None
    marks = list(vision.anchor) * anchors
    if d.chance(0.03):  # expanded, just at the prompt limit or past it
        extra = 1 if d.limits.bos is not None else 0
        size = d.limits.prompt_limit + d.one((0, 0, 1)) - extra - runs
        ids = [8 + t % 400 for t in range(max(size, 1))]
        return with_anchors(d, ids, anchors, vision.anchor)
    shape = d.one(("chat", "chat", "chat", "random", "random", "end", "start", "known"))
    if shape == "chat":
        chat = list(d.one(vision.chats))
        width = len(vision.anchor)
        at = next(i for i in range(len(chat)) if tuple(chat[i : i + width]) == vision.anchor)
        return chat[:at] + marks + chat[at + width :]
    if shape == "end":  # an image the prompt's last token
        return plain_tokens(d, 1, 30) + marks
    if shape == "start":
        return marks + plain_tokens(d, 1, 30)
    if shape == "known":  # past the known prompt's prefix blocks
        return KNOWN_GOOD_PROMPT[:256] + marks + plain_tokens(d, 0, 20)
    return with_anchors(d, plain_tokens(d, 1, 60), anchors, vision.anchor)


def mm_garbage(d: Draw, request: Any) -> None:
    """The router's processed images, which this family never takes: garbage in them."""
    mm = request.mm_inputs
    assert d.limits.vision is not None
    mm.im_token_id = d.one((d.limits.vision.placeholder, 1, 2**32 - 1))
    if d.chance(0.5):
        mm.pixel_values.shape.extend(d.one(([1, 3, 4, 4], [], [0], [2**32 - 1])))
        mm.pixel_values.dtype = d.one(("float32", "bfloat16", "int8", "", "🙂"))
        mm.pixel_values.inline = d.rng.randbytes(d.one((0, 3, 192)))
    if d.chance(0.5):
        mm.mm_placeholders.add(offset=d.one((0, 5, 2**32 - 1)), length=d.one((0, 4, 2**32 - 1)))
    if d.chance(0.3):
        mm.mm_hashes.append(d.text(0, 6))
        mm.model_specific_tensors["image_grid_thw"].dtype = "int64"


@dataclass
class Images:
    """What image_input made: the prompt the worker runs, each anchor expanded (None: text,
    whose length only the worker knows), and what its images were (for the report)."""

    prompt: list[int] | None
    label: str
    bad: frozenset[int]  # the indices of its bad images


def image_input(d: Draw, request: Any) -> Images:
    """Fill a vLLM-face request with images, their anchors and its prompt."""
    vision = d.limits.vision
    assert vision is not None
    kinds: list[str] = []  # what was wrong or odd, for the report
    bad: set[int] = set()
    roll = d.rng.random()
    if roll < 0.05:
        count = d.rng.randint(vision.max_images + 1, vision.max_images + 4)
        d.refuse(f"{count} images", LIMIT, "too many images")
        kinds.append("too many images")
        bad.update(range(vision.max_images, count))
    elif roll < 0.12:
        count = vision.max_images
    else:
        count = d.one((1, 1, 1, 1, 1, 2, 2, 3))
    p_bad = d.one((0.0, 0.0, 0.0, 0.25, 0.6))
    runs = 0  # the tokens the valid images' runs take
    for index in range(count):
        modality = IMAGE
        if d.chance(0.03):
            modality = d.one(NOT_IMAGES)
            d.refuse(f"image {index}: modality {modality}", INVALID, rf"\bmedia {index}\b")
            kinds.append("not an image modality")
            bad.add(index)
        url = image_url(d, index, p_bad, kinds, bad)
        request.media_refs.items.add(modality=modality, url=url)
        if index not in bad:
            run = vision.run_of(url)
            if run is None:  # valid, but not for this family's processor (an aspect ratio)
                d.refuse(f"image {index}: its processor refuses it", INVALID, rf"\bimage {index}\b")
                kinds.append("refused by the processor")
                bad.add(index)
            else:
                runs += run
    anchors = count
    roll = d.rng.random()
    if roll < 0.05:
        anchors = count + d.rng.randint(1, 3)
    elif roll < 0.1:
        anchors = d.rng.randint(0, count - 1)
    if anchors != count:
        d.refuse(f"{anchors} anchors for {count} images", INVALID, "image anchors")
        kinds.append(f"{'more' if anchors > count else 'fewer'} anchors than images")
    if d.chance(0.02):
        mm_garbage(d, request)
        d.refuse("mm_inputs beside media references", INVALID, "mm_inputs|media references")
        kinds.append("mm_inputs")
    if d.chance(0.03):  # the anchor as text: the worker's tokenizer may make it the anchor
        request.text = f"{vision.anchor_text} " * anchors + d.words(1, 12)
        d.odd.append("anchors in a text prompt")
        return Images(None, [*kinds, "anchors in a text prompt"][0], frozenset(bad))
    ids = image_prompt(d, anchors, runs)
    strays = sorted(vision.vision_ids - {*vision.anchor})
    if strays and d.chance(0.03):  # an image's own tokens outside any image
        ids.insert(d.rng.randint(0, len(ids)), d.one(strays))
        d.odd.append("a stray image token")
        kinds.append("a stray image token")
    request.tokenized.input_ids.extend(ids)
    final, problem = d.limits.final_prompt(ids)
    width = len(vision.anchor)
    ends_in_image = vision.open_end and anchors and tuple(final[-width:]) == vision.anchor
    if ends_in_image and not bad and anchors == count and problem is None:
        d.refuse("the prompt ends in an image", INVALID, "ends inside an image")
        kinds.append("the prompt ends in an image")
    expanded = len(final) - anchors * len(vision.anchor) + runs
    if problem is not None or bad or anchors != count:
        expanded = len(final)  # refused before its length counts
    if problem is not None:
        d.bad.append(problem)
    elif expanded > d.limits.prompt_limit:
        d.refuse(f"a prompt of {expanded} tokens with its images", INVALID, "placeholders")
        kinds.append("expanded past the prompt limit")
    elif expanded > d.limits.prompt_limit - 4:
        kinds.append("expanded to the prompt limit")
    return Images([0] * expanded, kinds[0] if kinds else "valid", frozenset(bad))


def bound_work(d: Draw, case: Case, stream: bool) -> None:
    """A request that may generate for long gets a client that ends it early; so do a few
    others (cancels and aborts mid-stream)."""
    most = case.max_tokens if case.max_tokens is not None else 4096
    if case.expect == REFUSED or (most * case.rows <= 256 and not d.chance(0.15)):
        return
    roll = d.rng.random()
    if stream and roll < 0.3:
        case.cancel_after = d.rng.randint(1, 4)
    elif stream and roll < 0.6:
        case.abort_after = d.rng.randint(1, 4)
    elif roll < 0.8:
        case.abort_at_s = d.rng.choice((0.05, 0.2, 0.5, 1.5))
    else:
        case.cancel_at_s = d.rng.choice((0.0, 0.01, 0.05, 0.2, 0.5, 1.5))


def generate_case(d: Draw, batch: Batch, face: str, images: bool = False) -> Case:
    """`images`: a vision model's vLLM face, the request with image parts."""
    pb = FACES[face][0]
    request = pb.GenerateRequest(request_id=request_id(d, batch), stream=d.chance(0.6))
    params = request.sampling_params
    parts = None
    if images:
        d.p_bad = d.rng.choice((0.0, 0.0, 0.0, 0.02, 0.05))  # most bad values in the images
        parts = image_input(d, request)
        prompt = parts.prompt
        count = len(request.media_refs.items)
    else:
        truncate = d.pick(
            "truncate_prompt_tokens", (UNSET,) * 6 + (-1, 1, 3, 50, 2**31 - 1), (0, -2, -(2**31))
        )
        prompt = prompt_input(d, request, truncate)
        if truncate is not UNSET:
            params.truncate_prompt_tokens = truncate
    sampling_numbers(d, params)
    n = d.pick("n", (UNSET, UNSET, 0, 1, 2, 3, 4, 16), (17, 1000, 2**32 - 1))
    if n is not UNSET:
        params.n = n
    rows = 1 if n is UNSET else max(n, 1)
    most = lengths(d, params, prompt, rows)
    stops(d, params)
    constraint(d, params, face)
    face_extras(d, request, face)
    case = Case(face, "Generate", request, d.expect, d.why, rows, most)
    if parts is not None:
        case.label = parts.label
        # and any media face_extras put beside them
        case.bad_images = parts.bad | set(range(count, len(request.media_refs.items)))
        if len(d.refusals) == len(d.bad):  # every bad value is about the images
            case.refusals = tuple(d.refusals)
        if prompt is not None and case.expect != REFUSED:
            case.prompt_tokens = len(prompt)
    bound_work(d, case, request.stream)
    return case


def embed_case(d: Draw, batch: Batch) -> Case:
    rid = d.pick(
        "request_id",
        (lambda d: f"{batch.tag}-embed-{d.token()}", lambda d: d.text(1, 5)),
        ("",),
    )
    ids = prompt_tokens(d)
    _, problem = d.limits.final_prompt(ids, limit=d.limits.context)
    if problem is not None:
        d.bad.append(problem)
    request = vllm_engine_pb2.EmbedRequest(request_id=rid)
    request.tokenized.input_ids.extend(ids)
    return Case("vllm", "Embed", request, d.expect, d.why)


def abort_case(d: Draw, batch: Batch, face: str) -> Case:
    ids = d.one(
        (
            lambda d: [f"unknown-{d.token()}"],
            lambda d: d.rng.sample(batch.ids, min(len(batch.ids), d.rng.randint(1, 3))),
            lambda d: d.rng.sample(batch.ids, min(len(batch.ids), 1)) * 3,
            [""],
            [],
            lambda d: [d.text(1, 8)],
            lambda d: [f"unknown-{i}" for i in range(1000)],
        )
    )
    batch.aborted.update(ids)
    return Case(face, "Abort", FACES[face][0].AbortRequest(request_ids=ids))


def metadata_case(d: Draw, batch: Batch, face: str) -> Case:
    method = d.rng.choice(("HealthCheck", "GetModelInfo", "GetServerInfo", "GetTokenizer"))
    if method == "GetTokenizer":
        return Case(face, method, common_pb2.GetTokenizerRequest())
    return Case(face, method, getattr(FACES[face][0], f"{method}Request")())


def loads_case(d: Draw, batch: Batch) -> Case:
    request = vllm_engine_pb2.GetLoadsRequest()
    rank = d.pick("dp_rank", (UNSET, 0), (), (1, -1, 2**31 - 1))
    if rank is not UNSET:
        request.dp_rank = rank
    request.include.extend(d.one((["core"], [], ["all", "memory"], lambda d: [d.text(0, 5)])))
    return Case("vllm", "GetLoads", request, d.expect, d.why)


def kv_events_case(d: Draw, batch: Batch) -> Case:
    """A subscription the client ends after a moment (it never ends by itself)."""
    request = common_pb2.SubscribeKvEventsRequest(
        start_sequence_number=d.one((0, 0, 1, 2, 10, 1000, 2**63, 2**64 - 1)),
        load_records_before_first_batch=d.chance(0.5),
    )
    return Case("vllm", "SubscribeKvEvents", request, cancel_at_s=d.rng.uniform(0.1, 1.5))


def flush_case(d: Draw, batch: Batch) -> Case:
    timeout = d.one((0.0, 1.0, -1.0, NAN, INF, 1e30))
    return Case("vllm", "FlushCache", common_pb2.FlushCacheRequest(timeout_s=timeout))


def profile_case(d: Draw, batch: Batch) -> Case:
    """Profiling is not offered: UNIMPLEMENTED."""
    if d.chance(0.5):
        start = common_pb2.StartProfileRequest(output_dir=d.text(0, 10), num_steps=-1)
        return Case("vllm", "StartProfile", start, REFUSED)
    return Case("vllm", "StopProfile", common_pb2.StopProfileRequest(), REFUSED)


Builder = Callable[[Draw, Batch], Case]
BUILDERS: tuple[tuple[Builder, int], ...] = (
    (partial(generate_case, face="mlx"), 40),
    (partial(generate_case, face="vllm"), 40),
    (embed_case, 8),
    (partial(abort_case, face="mlx"), 4),
    (partial(abort_case, face="vllm"), 4),
    (partial(metadata_case, face="mlx"), 4),
    (partial(metadata_case, face="vllm"), 4),
    (loads_case, 3),
    (kv_events_case, 3),
    (flush_case, 1),
    (profile_case, 1),
)
# A vision model's also: vLLM-face Generate calls with image parts.
IMAGE_BUILDERS: tuple[tuple[Builder, int], ...] = (
    (partial(generate_case, face="vllm", images=True), 50),
)


def build_batch(
    rng: random.Random, limits: Limits, batch: Batch, size: int, every_kind: bool
) -> list[Case]:
    """Random kinds of requests, shuffled; with `every_kind`, one of each first (so that a
    short run calls every RPC)."""
    kinds = BUILDERS + (IMAGE_BUILDERS if limits.vision is not None else ())
    builders = [builder for builder, _ in kinds]
    weights = [weight for _, weight in kinds]
    chosen = builders[:size] if every_kind else []
    chosen += rng.choices(builders, weights, k=size - len(chosen))
    cases = [builder(Draw(rng, limits), batch) for builder in chosen]
    rng.shuffle(cases)
    return cases


# ----- running and judging -----


@dataclass
class Result:
    code: str = "OK"
    message: str = ""
    seconds: float = 0.0
    responses: list[Any] = field(default_factory=list)
    cancelled: bool = False  # by the client
    aborted_at: float | None = None  # when the client sent Abort for it
    seen_before_abort: int = 0  # messages it had then
    after_abort_s: float = 0.0  # how long it went on after that
    notes: list[str] = field(default_factory=list)


class Client:
    """Both faces of one worker, over one channel."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stubs = {face: stub(self.channel) for face, (_, stub) in FACES.items()}
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self._ids = itertools.count()

    def run(self, case: Case) -> Result:
        result = Result()
        method = getattr(self.stubs[case.face], case.method)
        started = time.monotonic()
        try:
            if case.method in STREAMS:
                self._stream(method, case, result)
            else:
                result.responses.append(method(case.request, timeout=DEADLINE_S))
        except grpc.RpcError as error:
            result.code, result.message = error.code().name, error.details() or ""
        ended = time.monotonic()
        result.seconds = ended - started
        if result.aborted_at is not None:
            result.after_abort_s = ended - result.aborted_at
        return result

    def _stream(self, method: Any, case: Case, result: Result) -> None:
        call = method(case.request, timeout=DEADLINE_S)

        def cancel() -> None:
            result.cancelled = True
            call.cancel()

        def abort() -> None:
            self.abort(case.face, [case.request.request_id], result)

        timers = [
            threading.Timer(delay, action)
            for delay, action in ((case.cancel_at_s, cancel), (case.abort_at_s, abort))
            if delay is not None
        ]
        for timer in timers:
            timer.start()
        try:
            for response in call:
                result.responses.append(response)
                if len(result.responses) == case.cancel_after:
                    cancel()
                if len(result.responses) == case.abort_after:
                    abort()
        finally:
            for timer in timers:
                timer.cancel()

    def abort(self, face: str, ids: list[str], result: Result) -> None:
        result.aborted_at = time.monotonic()
        result.seen_before_abort = len(result.responses)
        try:
            self.stubs[face].Abort(FACES[face][0].AbortRequest(request_ids=ids), timeout=10)
        except grpc.RpcError as error:
            result.notes.append(f"its Abort failed: {error.code().name} {error.details()}")

    def greedy(self, face: str, prompt: list[int], urls: Sequence[str] = ()) -> list[int]:
        pb = FACES[face][0]
        request = pb.GenerateRequest(
            request_id=f"known-good-{next(self._ids)}",
            tokenized=pb.TokenizedInput(input_ids=prompt),
            sampling_params=pb.SamplingParams(
                temperature=0, max_tokens=KNOWN_GOOD_TOKENS, ignore_eos=True
            ),
        )
        for url in urls:
            request.media_refs.items.add(modality=IMAGE, url=url)
        responses = list(self.stubs[face].Generate(request, timeout=DEADLINE_S))
        return list(responses[-1].complete.output_ids)

    def limits(self) -> Limits:
        info = self.stubs["mlx"].GetModelInfo(mlx_engine_pb2.GetModelInfoRequest(), timeout=30)
        request = mlx_engine_pb2.GenerateRequest(
            request_id="probe", tokenized=mlx_engine_pb2.TokenizedInput(input_ids=[5, 6])
        )
        request.sampling_params.max_tokens = 1
        probe = list(self.stubs["mlx"].Generate(request, timeout=DEADLINE_S))[-1].complete
        bos = info.bos_token_id if probe.prompt_tokens == 3 else None
        return Limits(info.vocab_size, info.max_context_length, info.max_req_input_len, bos)

    def in_flight(self) -> int:
        server = self.stubs["mlx"].GetServerInfo(mlx_engine_pb2.GetServerInfoRequest(), timeout=10)
        loads = self.stubs["vllm"].GetLoads(vllm_engine_pb2.GetLoadsRequest(), timeout=10)
        return max(server.active_requests, loads.loads[0].num_total_reqs)


def judge(case: Case, result: Result, batch: Batch, vocab: int) -> list[str]:
    """What is wrong with one call's answer."""
    code, problems = result.code, list(result.notes)
    if code == "DEADLINE_EXCEEDED":
        return [*problems, f"a hang: no answer within {DEADLINE_S:.0f} s"]
    if code not in ALLOWED:
        problems.append(f"status {code} ({result.message!r})")
    if code == "CANCELLED" and not result.cancelled:
        problems.append(f"CANCELLED though the client did not cancel ({result.message!r})")
    if code != "OK" and not result.message.strip():
        problems.append(f"status {code} with an empty message")
    rid = getattr(case.request, "request_id", None)
    neutral = (code == "CANCELLED" and result.cancelled) or (
        code == "ALREADY_EXISTS" and rid in batch.shared
    )
    if not neutral and case.expect == OK and code != "OK":
        problems.append(f"a valid request refused: {code} {result.message!r}")
    if case.expect == REFUSED and code == "OK":
        problems.append(f"an invalid request accepted ({', '.join(case.why)})")
    if case.refusals and code != "OK" and not neutral and not refused_as_drawn(case, result):
        wanted = " or ".join(f"{want} /{says}/" for want, says in case.refusals)
        problems.append(f"refused with {code} {result.message!r}, not {wanted}")
    named = re.match(r"(?:image|media) (\d+):", result.message) if case.label else None
    if named and int(named[1]) not in case.bad_images:  # whatever else was bad
        problems.append(f"a refusal naming a good image: {code} {result.message!r}")
    if case.method == "Generate" and code == "OK":
        abortable = result.aborted_at is not None or rid in batch.aborted or rid in batch.shared
        problems += judge_generate(case, result, abortable, vocab)
    if result.after_abort_s > ABORT_GRACE_S and abort_landed(result):
        problems.append(f"it went on {result.after_abort_s:.1f} s after its Abort")
    if case.method == "SubscribeKvEvents":
        numbers = [r.sequence_number for r in result.responses]
        if any(b != a + 1 for a, b in itertools.pairwise(numbers)):
            problems.append(f"KV event batches out of sequence: {numbers[:10]}")
    return problems


def refused_as_drawn(case: Case, result: Result) -> bool:
    """Whether a refusal has the status of one of the request's bad values and a message that
    says which (an image's index, for one image)."""
    return any(
        result.code == want and re.search(says, result.message) for want, says in case.refusals
    )


def finishes(result: Result) -> list[str]:
    return [
        r.complete.finish_reason for r in result.responses if r.WhichOneof("response") == "complete"
    ]


def abort_landed(result: Result) -> bool:
    """Whether the client's Abort surely came after the worker had the request (one sent at
    once may overtake it, and an Abort of an id not in flight does nothing)."""
    return result.seen_before_abort > 0 or "abort" in finishes(result)


def judge_generate(case: Case, result: Result, abortable: bool, vocab: int) -> list[str]:
    """An accepted Generate call: one GenerateComplete per row, sane tokens and counts."""
    found: dict[str, set[int]] = {}  # what is wrong -> the rows it is wrong with
    completes: Counter[int] = Counter()
    streamed: Counter[int] = Counter()
    finishes = {"stop", "length", "abort"} if abortable else {"stop", "length"}

    def note(what: str, index: int) -> None:
        found.setdefault(what, set()).add(index)

    for response in result.responses:
        kind = response.WhichOneof("response")
        part = getattr(response, kind)
        ids = part.token_ids if kind == "chunk" else part.output_ids
        streamed[part.index] += len(ids)
        if any(t >= vocab for t in ids):
            note(f"a token id past the vocabulary ({max(ids)})", part.index)
        values = [*part.output_logprobs.token_logprobs]
        values += [v for top in part.output_logprobs.top_logprobs for v in top.values]
        if any(math.isnan(v) for v in values):
            note("NaN logprobs", part.index)
        if kind == "complete":
            completes[part.index] += 1
            sent, counted = streamed[part.index], part.completion_tokens
            if part.finish_reason not in finishes:
                note(f"finish_reason {part.finish_reason!r}", part.index)
            if counted != sent:
                note(f"completion_tokens {counted} but {sent} tokens sent", part.index)
            if case.max_tokens is not None and counted > case.max_tokens:
                note(f"{counted} tokens, past max_tokens", part.index)
            if case.prompt_tokens is not None and part.prompt_tokens != case.prompt_tokens:
                note(f"prompt_tokens {part.prompt_tokens}, not {case.prompt_tokens}", part.index)
    problems = [f"rows {sorted(rows)}: {what}" for what, rows in found.items()]
    if sorted(completes.elements()) != list(range(case.rows)):
        problems.append(f"rows lost: completes {sorted(completes.elements())} of n={case.rows}")
    return problems


def describe(case: Case) -> str:
    """The request in one line, a long prompt cut short, and what the client did."""
    shown = type(case.request)()
    shown.CopyFrom(case.request)
    note = ""
    if "tokenized" in shown.DESCRIPTOR.fields_by_name and len(shown.tokenized.input_ids) > 40:
        note = f" [input_ids: {len(shown.tokenized.input_ids)} tokens, the first 20 shown]"
        del shown.tokenized.input_ids[20:]
    if "text" in shown.DESCRIPTOR.fields_by_name and len(shown.text) > 100:
        note += f" [text: {len(shown.text)} characters, the first 100 shown]"
        shown.text = shown.text[:100]
    for item in getattr(shown, "media_refs", vllm_engine_pb2.MediaRefs()).items:
        if len(item.url) > 100:
            item.url = f"{item.url[:60]}...({len(item.url)} chars)"
    if len(getattr(shown, "request_id", "")) > 100:
        note += f" [request_id: {len(shown.request_id)} characters, the first 100 shown]"
        shown.request_id = shown.request_id[:100]
    text = text_format.MessageToString(shown, as_one_line=True, as_utf8=True)
    client = f" [the client {case.client}]" if case.client else ""
    return (text if len(text) <= 1500 else text[:1500] + "...") + note + client


# ----- the worker -----


@dataclass
class Coverage:
    """What one kind's seeds sent, what came back, and what went wrong."""

    seeds: int = 0
    requests: int = 0
    batches: int = 0
    expected: dict[str, int] = field(default_factory=dict)  # ok / refused / any
    statuses: dict[str, dict[str, int]] = field(default_factory=dict)  # rpc -> code -> calls
    images: dict[str, dict[str, int]] = field(default_factory=dict)  # what -> code -> calls
    client_cancels: int = 0
    slowest_s: float = 0.0
    failures: list[str] = field(default_factory=list)

    def add(self, case: Case, result: Result) -> None:
        self.requests += 1
        self.expected[case.expect] = self.expected.get(case.expect, 0) + 1
        codes = self.statuses.setdefault(case.rpc, {})
        codes[result.code] = codes.get(result.code, 0) + 1
        if case.label:
            other = case.expect == REFUSED and not case.refusals
            codes = self.images.setdefault(case.label + (", a bad field" if other else ""), {})
            codes[result.code] = codes.get(result.code, 0) + 1
        self.client_cancels += result.cancelled and result.code == "CANCELLED"
        self.slowest_s = max(self.slowest_s, result.seconds)


class Watch:
    """The worker between batches: alive, SERVING, idle, and still the same engine."""

    def __init__(self, worker: WorkerProcess, client: Client, vision: Vision | None) -> None:
        self.worker = worker
        self.client = client
        self.vision = vision
        self.prompt = KNOWN_GOOD_PROMPT  # its blocks are in the prefix store: requests share them
        self.baseline = client.greedy("mlx", self.prompt)
        if vision is not None:  # and an image request, its image one the fuzz reuses
            self.image_prompt = list(vision.chats[0])
            self.image_urls = [data_url(fixed_image(*FIXED_IMAGES[0][:2]))]
            self.image_baseline = client.greedy("vllm", self.image_prompt, self.image_urls)
        self._log_seen = 0

    def problems(self) -> list[str]:
        worker, client = self.worker, self.client
        assert worker.proc is not None
        if worker.proc.poll() is not None:
            return [f"the worker exited ({worker.proc.returncode}): {worker.output[-2000:]}"]
        problems = []
        try:
            health = client.health.Check(health_pb2.HealthCheckRequest(), timeout=10)
            if health.status != health_pb2.HealthCheckResponse.SERVING:
                problems.append(f"grpc.health says {health.status}")
            for face, (pb, _) in FACES.items():
                answer = client.stubs[face].HealthCheck(pb.HealthCheckRequest(), timeout=10)
                if not answer.healthy:
                    problems.append(f"{face}.HealthCheck: {answer.message}")
            if not wait_until(lambda: client.in_flight() == 0, SETTLE_S, 0.1):
                problems.append(f"{client.in_flight()} requests in flight {SETTLE_S:.0f} s later")
            for face in FACES:
                tokens = client.greedy(face, self.prompt)
                if tokens != self.baseline:
                    problems.append(f"{face}: known-good greedy {tokens} != {self.baseline}")
            if self.vision is not None:
                tokens = client.greedy("vllm", self.image_prompt, self.image_urls)
                if tokens != self.image_baseline:
                    problems.append(f"known-good image greedy {tokens} != {self.image_baseline}")
        except grpc.RpcError as error:
            problems.append(f"the worker failed a check: {error.code().name} {error.details()}")
        return problems + self.logged_errors()

    def logged_errors(self) -> list[str]:
        lines = self.worker.lines[self._log_seen :]
        self._log_seen += len(lines)
        return [f"the worker logged: {line.strip()[:300]}" for line in lines if _error(line)]


def _error(line: str) -> bool:
    return any(marker in line for marker in LOG_ERRORS)


def fuzz_seed(
    kind: str,
    seed: int,
    requests: int,
    client: Client,
    watch: Watch,
    cover: Coverage,
    trace: TextIO | None = None,
) -> bool:
    """One seed's batches; False when the worker is gone."""
    rng = random.Random(f"{kind}/{seed}")
    limits = dataclasses.replace(client.limits(), vision=watch.vision)
    for number, start in enumerate(range(0, requests, BATCH)):
        batch = Batch(f"s{seed}b{number}")
        cases = build_batch(rng, limits, batch, min(BATCH, requests - start), number == 0)
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            results = list(pool.map(client.run, cases))
        where = f"{kind} seed {seed} batch {number}"
        for i, (case, result) in enumerate(zip(cases, results, strict=True)):
            cover.add(case, result)
            if trace is not None:
                trace.write(json.dumps(_traced(where, i, case, result)) + "\n")
            for problem in judge(case, result, batch, limits.vocab):
                cover.failures.append(f"{where} #{i} {case.rpc}: {problem} | {describe(case)}")
        cover.batches += 1
        for problem in watch.problems():
            cover.failures.append(f"{where}, after it: {problem}")
        if watch.worker.proc is not None and watch.worker.proc.poll() is not None:
            return False
    cover.seeds += 1
    return True


def _traced(where: str, i: int, case: Case, result: Result) -> dict[str, Any]:
    return {
        "where": f"{where} #{i}",
        "rpc": case.rpc,
        "expect": case.expect,
        "why": case.why,
        "code": result.code,
        "message": result.message[:300],
        "seconds": round(result.seconds, 3),
        "finishes": finishes(result) if case.method == "Generate" else [],
        "request": describe(case),
    }


def fuzz(
    kinds: list[str],
    seeds: list[int],
    requests: int = REQUESTS,
    trace: TextIO | None = None,
    worker_args: Sequence[str] = (),
) -> dict[str, Coverage]:
    """`worker_args`: more flags for each worker (a real model on a CPU prefills a prompt of
    its whole context in minutes: `--max-prompt-tokens 1024` keeps the calls within
    DEADLINE_S)."""
    report = {}
    for kind in kinds:
        cover = report[kind] = Coverage()
        model = kind if "/" in kind else f"demo:{kind}"  # a model directory, or a demo kind
        args = ("--model", model, "--protocols", "mlx,vllm", *worker_args)
        with WorkerProcess(*args) as worker:
            worker.wait_ready()
            client = Client(worker.address)
            where = model_dir(kind)
            vision = Vision.load(where, client) if where is not None else None
            watch = Watch(worker, client, vision)
            if (tokens := client.greedy("vllm", watch.prompt)) != watch.baseline:
                cover.failures.append(f"{kind}: the faces differ: {tokens} != {watch.baseline}")
            for seed in seeds:
                if not fuzz_seed(kind, seed, requests, client, watch, cover, trace):
                    break
            client.channel.close()
    return report


def print_report(report: dict[str, Coverage], seconds: float) -> None:
    for kind, cover in report.items():
        expected = ", ".join(f"{n} {what}" for what, n in sorted(cover.expected.items()))
        print(
            f"{kind}: {cover.seeds} seeds, {cover.requests} requests ({expected}), "
            f"{cover.client_cancels} cancelled by the client, slowest {cover.slowest_s:.1f} s, "
            f"{len(cover.failures)} failures"
        )
        codes = sorted({code for counts in cover.statuses.values() for code in counts})
        print(" | ".join(("rpc", *codes)))
        for rpc, counts in sorted(cover.statuses.items()):
            print(" | ".join((rpc, *(str(counts.get(code, 0)) for code in codes))))
        if cover.images:
            codes = sorted({code for counts in cover.images.values() for code in counts})
            print(" | ".join(("vllm.Generate with images", *codes)))
            for what, counts in sorted(cover.images.items()):
                print(" | ".join((what, *(str(counts.get(code, 0)) for code in codes))))
        for line in cover.failures[:20]:
            print("   ", line)
    print(f"{seconds:.0f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=10, help="seeds per kind (default 10)")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--requests", type=int, default=REQUESTS, help="per seed (default 300)")
    parser.add_argument(
        "--kinds",
        default="llama",
        help="demo kinds (llama, gemma3, hybrid, vlm, vlm:FAMILY) or model directories",
    )
    parser.add_argument("--worker-args", default="", help="more worker flags, one string")
    parser.add_argument("--json", type=Path, help="write the report here too")
    parser.add_argument("--trace", type=Path, help="write every call here, a JSON line each")
    args = parser.parse_args(argv)
    started = time.monotonic()
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    with contextlib.ExitStack() as stack:
        trace = stack.enter_context(args.trace.open("w")) if args.trace else None
        worker_args = shlex.split(args.worker_args)
        report = fuzz(args.kinds.split(","), seeds, args.requests, trace, worker_args)
    print_report(report, time.monotonic() - started)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({k: asdict(v) for k, v in report.items()}, indent=1))
    return 1 if any(cover.failures for cover in report.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
