"""Typed messages that cross between the gRPC handlers and the engine (a thread, or a child
process: then they travel as positional msgpack arrays).

Plain Python only: the handler side never sees an MLX object. Requests go in through
`Engine.submit`; each engine hand-off carries every row's events in one `StepOutput`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

import msgspec

from .admission import Admission


class Wire(msgspec.Struct, array_like=True, gc=False):
    """A message that may cross the process boundary: encoded as a positional array (no field
    names on the wire), and never part of a reference cycle (no GC tracking)."""


class EngineStartupError(RuntimeError):
    """The engine could not load its model or build its batch runner."""


FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"


class SamplingSpec(Wire, frozen=True):
    """Validated sampling settings; equal specs share one sampler in the engine."""

    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # 1.0 means off
    top_k: int = 0  # 0 means off
    min_p: float = 0.0  # 0 means off
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class PenaltySpec(Wire, frozen=True):
    """Logits processors a request asked for; the neutral values build none."""

    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def active(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
            or bool(self.logit_bias)
        )


class Constraint(Wire, frozen=True, gc=True, dict=True):
    """Structured output: an llguidance grammar (already validated) the output must follow.

    The handlers' check compiles it on the model's vocabulary (`GrammarChecker.compile`); that
    compiled grammar rides along as `compiled`, outside the fields, so an engine in the same
    process starts each row from a copy of it and compiles nothing. It does not travel: after
    a process boundary (the engine process, another rank) `compiled` is None and the engine
    compiles `grammar` itself. (`dict=True` gives it room for that; it needs GC tracking.)"""

    kind: str  # "json_schema", "regex" or "lark_grammar"
    grammar: str

    @classmethod
    def checked(cls, kind: str, grammar: str, compiled: Any) -> Constraint:
        """A constraint with its grammar compiled by the handlers' check (an llguidance
        matcher at the grammar's start, never advanced)."""
        made = cls(kind, grammar)
        made.__dict__["compiled"] = compiled  # a frozen struct refuses setattr; not a field
        return made

    @property
    def compiled(self) -> Any:
        return self.__dict__.get("compiled")


class Tensor(Wire, frozen=True):
    """An array's bytes (C order), shape and numpy dtype name, for crossing to the engine."""

    data: bytes
    shape: tuple[int, ...]
    dtype: str


class ImageInput(Wire, frozen=True):
    """One image (or video) of a prompt, processed for the model's vision encoder: its
    placeholder run `prompt[offset : offset + length]`, the encoder's inputs, and `key`, a
    hash of exactly those inputs (the encoder cache's and the prefix store's name for it)."""

    offset: int
    length: int
    key: bytes
    pixel_values: Tensor | None  # None: a video's, in `extra` (pixel_values_videos)
    extra: tuple[tuple[str, Tensor], ...] = ()  # model-specific inputs (image_grid_thw)
    # A video's blocks of media tokens in its run, for its positions: (offset in the run,
    # length, t, h, w) each (empty: the whole run is one grid, image_grid_thw's).
    spans: tuple[tuple[int, int, int, int, int], ...] = ()

    @property
    def end(self) -> int:
        return self.offset + self.length


class FoundBlock(Wire, frozen=True):
    """A prompt block's file another worker wrote, found (and its header checked against
    the prompt) by the handlers: the engine's disk tier may load it."""

    key: bytes
    parent: bytes | None  # None: the prompt's first block
    tokens: tuple[int, ...]
    path: str
    size: int
    snapshot: bool


class GenerationRequest(Wire):
    """One validated request, ready for the engine to admit."""

    ticket: int  # engine-side identity, unique for the process lifetime
    request_id: str  # the client's id, for logs only
    prompt: list[int]
    max_tokens: int
    sampling: SamplingSpec = msgspec.field(default_factory=SamplingSpec)
    block_keys: tuple[bytes, ...] = ()  # the names of its prompt's full blocks (prefix reuse)
    penalties: PenaltySpec = msgspec.field(default_factory=PenaltySpec)
    stop_token_ids: frozenset[int] = frozenset()
    top_logprobs: int | None = None  # None: no logprobs; N >= 0: token logprob + top N
    constraint: Constraint | None = None
    thinking_budget: int | None = None  # tokens allowed inside the reasoning section
    # The handler wants this request's tokens this many at a time after the first (and at
    # its finish), so the engine may hold them back until then instead of waking the loop.
    tokens_per_handoff: int = 1
    # ...and at most every this many seconds (the first token and the finish never wait).
    handoff_window_s: float = 0.0
    bos_added: bool = False  # the worker put the model's BOS before ids that lacked it
    min_tokens: int = 0  # its stop tokens are masked until it has generated this many
    # n > 1: the tickets of samples 1..n-1 of this prompt (this request is sample 0). The
    # engine admits them once sample 0's prompt is through, so they reuse its prefix.
    sample_tickets: tuple[int, ...] = ()
    # Stop strings: the engine ends the row (finish `stop`) once its decoded text, counted
    # from the `min_tokens`-th token, holds one (the handlers trim the text they send).
    stop_strings: tuple[str, ...] = ()
    # Its images in prompt order, and the prompt as the prefix store names it: each image
    # token replaced by an id drawn from the image's key (empty: the prompt itself).
    images: tuple[ImageInput, ...] = ()
    keyed_prompt: list[int] = msgspec.field(default_factory=list)
    adapter: str = ""  # the served adapter's name ("": the base model)
    found_blocks: tuple[FoundBlock, ...] = ()  # its prompt's blocks on disk, parents first

    @property
    def store_prompt(self) -> list[int]:
        """The prompt as the prefix store sees it: two images never share a block name."""
        return self.keyed_prompt or self.prompt

    @property
    def cache_tokens(self) -> int:
        """The most tokens its cache may hold: the prompt and every new token."""
        return len(self.prompt) + self.max_tokens

    @property
    def n(self) -> int:
        """How many samples of the prompt it asks for."""
        return 1 + len(self.sample_tickets)

    def samples(self) -> list[GenerationRequest]:
        """Its n samples as requests of one row each: sample i has ticket i (sample 0 this
        request's) and, when seeded, seed + i."""
        tickets = (self.ticket, *self.sample_tickets)
        return [self._sample(i, ticket) for i, ticket in enumerate(tickets)]

    def _sample(self, index: int, ticket: int) -> GenerationRequest:
        sampling = self.sampling
        if index and sampling.seed is not None:
            sampling = msgspec.structs.replace(sampling, seed=sampling.seed + index)
        return msgspec.structs.replace(self, ticket=ticket, sampling=sampling, sample_tickets=())


class TokenLogprob(Wire, frozen=True):
    """The sampled token's log-probability and the N most likely alternatives."""

    logprob: float
    top_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]


class RowEvent(Wire):
    """What one request got from one engine step: a token, a finish, or both."""

    ticket: int
    token: int | None  # None for a finish with no new token (abort)
    finish_reason: str | None = None  # FINISH_* when this is the last event
    matched_stop_token_id: int | None = None
    logprob: TokenLogprob | None = None
    cached_tokens: int = 0


class FailureKind(Enum):
    INTERNAL = "internal"  # a step failed; the engine recovered
    UNAVAILABLE = "unavailable"  # the engine is gone or shutting down
    INVALID_ARGUMENT = "invalid_argument"  # the request's own grammar failed mid-generation


class RowFailure(Wire, frozen=True):
    """A request that ended with an error instead of a finish reason."""

    ticket: int
    kind: FailureKind
    message: str


class EmbedRequest(Wire, frozen=True):
    """A prompt to embed: its pooled final hidden state, beside generation."""

    ticket: int  # unique per process, from the handlers' ticket counter
    prompt: list[int]
    pooling: str = "last"  # "last" (the last token's hidden state) or "mean" (over the prompt)


class EmbedResult(Wire, frozen=True):
    ticket: int
    embedding: list[float] = []  # L2-normalised pooled final hidden state; empty on error
    error: str | None = None  # why it failed (the request fails, never the engine)


class KvBlockEvent(Wire, frozen=True):
    """A full prefix-store block entering or leaving a tier, or everything gone ("cleared")."""

    kind: str  # "stored", "removed" or "cleared"
    block_key: bytes = b""  # the block's key (prefix/keys.py), b"" for cleared
    parent_key: bytes = b""  # the parent block's key, b"" for a first block
    tokens: tuple[int, ...] = ()  # the block's token ids (stored only)
    tier: str = "ram"  # "ram" or "disk": where it was stored / removed from


class StepOutput(Wire):
    """Everything the engine produced since its last hand-off, handed over in one call."""

    events: list[RowEvent] = msgspec.field(default_factory=list)
    failures: list[RowFailure] = msgspec.field(default_factory=list)
    fatal: str | None = None  # set once, when the engine is about to die
    step_seconds: list[float] = msgspec.field(default_factory=list)  # each step's duration
    prefill_tokens: list[int] = msgspec.field(default_factory=list)  # each prefill's tokens
    over_budget: int = 0  # steps whose prefill held decoding rows up past the budget
    widened_steps: int = 0  # steps whose prefill ran with a budget widened by a queue
    fused_steps: int = 0  # steps whose prefill chunk rode in the decoding rows' forward
    images_encoded: int = 0  # images put through the vision encoder (not its cache)
    disk_load_seconds: list[float] = msgspec.field(default_factory=list)  # prompt-cache loads
    figures: EngineFigures | None = None  # the engine's figures, when they changed
    embeddings: list[EmbedResult] = msgspec.field(default_factory=list)
    kv_events: list[KvBlockEvent] = msgspec.field(default_factory=list)  # prefix store changes
    flushed: list[int] = msgspec.field(default_factory=list)  # tickets of flushes done

    def __bool__(self) -> bool:
        """Anything to hand over: any field set (each one `merge` folds)."""
        return any(getattr(self, name) for name in self.__struct_fields__)

    def merge(self, later: StepOutput) -> None:
        """Fold a later step's output into this one (the loop had not picked this one up)."""
        self.events.extend(later.events)
        self.failures.extend(later.failures)
        self.fatal = self.fatal or later.fatal
        self.step_seconds.extend(later.step_seconds)
        self.prefill_tokens.extend(later.prefill_tokens)
        self.over_budget += later.over_budget
        self.widened_steps += later.widened_steps
        self.fused_steps += later.fused_steps
        self.images_encoded += later.images_encoded
        self.disk_load_seconds.extend(later.disk_load_seconds)
        self.figures = later.figures or self.figures
        self.embeddings.extend(later.embeddings)
        self.kv_events.extend(later.kv_events)
        self.flushed.extend(later.flushed)


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """The model's identity, read from its files before the weights load (`model_files`)."""

    model_path: str  # what the user asked for (path or hub id)
    model_dir: str  # the local directory holding config and tokenizer files
    served_model_name: str
    model_type: str
    architectures: tuple[str, ...]
    vocab_size: int
    context_length: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    pad_token_id: int | None
    # The tokenizer puts bos_token_id before every encoding (add_bos_token, or a
    # post-processor that adds it): the model expects it at the start of every prompt.
    adds_bos: bool = False
    hidden_size: int = 0  # from config.json: the size of Embed's vectors (0: not said)
    supports_vision: bool = False  # its images are served (images.vision_spec)
    # The router's copy of the tokenizer (tokenizer_bundle.router_tokenizer): GetModelInfo's
    # tokenizer_path and GetTokenizer's files, where the family needs one (None: model_dir's).
    router_tokenizer_dir: str | None = None


class PrefixCacheStats(Wire, frozen=True):
    entries: int = 0  # blocks in RAM
    bytes: int = 0  # their bytes
    hits: int = 0
    misses: int = 0
    disk_blocks: int = 0
    disk_bytes: int = 0
    ram_hits: int = 0
    disk_hits: int = 0  # hits that needed blocks loaded from disk
    ram_tokens: int = 0  # prompt tokens reused
    disk_tokens: int = 0
    evictions: int = 0  # blocks that left RAM
    pinned_blocks: int = 0  # held by running requests
    faults: int = 0  # lookups served cold and blocks not kept because something failed
    snapshot_hits: int = 0  # hits that resumed from a snapshot (recurrent, sliding window)
    dropped_writes: int = 0  # disk writes dropped because the queue was full
    disk_faults: int = 0  # unreadable, corrupt or foreign files, failed writes, a bad directory


class SpeculationFigures(Wire, frozen=True):
    """Speculative decoding so far: steps, drafts and what they gave."""

    steps: int = 0
    speculative_steps: int = 0  # steps that verified at least one draft token
    cutoff_steps: int = 0  # steps without drafts: past the cap, or drafting did not pay
    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # of them, accepted
    emitted: int = 0  # tokens handed out
    per_row_step: dict[int, int] = msgspec.field(default_factory=dict)  # tokens -> times

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


class LoadCounts(Wire, frozen=True):
    """The engine's load after a step, as a router reads it (GetLoads answers from these)."""

    running: int = 0  # rows whose first token is out
    waiting: int = 0  # requests without one: in line, held samples of n > 1, in prefill
    waiting_tokens: int = 0  # prompt tokens of the requests in line (none admitted yet)
    used_tokens: int = 0  # tokens (prompt and generated) the batch's rows hold
    generated: int = 0  # tokens generated since the engine started
    prompt_tokens: int = 0  # prompt tokens of every row admitted so far (for the hit rate)


class EngineFigures(Wire, frozen=True):
    """The engine's own figures: its thread publishes them with its output when they change;
    everyone else reads the latest published ones, never the engine's objects."""

    prefix: PrefixCacheStats | None = None  # None: no prefix store
    prefill_budget_s: float = 0.0  # the prefill budget in force (0: none)
    speculation: SpeculationFigures | None = None  # None: no speculation
    load: LoadCounts = msgspec.field(default_factory=LoadCounts)


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """The requests in flight: waiting for a first token, or decoding (handler side)."""

    waiting: int
    running: int


class EngineCapabilities(Wire, frozen=True):
    """What a warm engine tells the handlers about itself."""

    admission: Admission
    has_thinking: bool  # the tokenizer marks a reasoning section
    embedding_size: int = 0  # the model's hidden size when it can embed (0: it cannot)
    # The shared prompt cache directory, its model's namespace ("": none), where the handlers
    # find other workers' blocks and wait for this one's (--prompt-cache-shared).
    shared_cache_dir: str = ""
