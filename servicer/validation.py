"""Turning a GenerateRequest into a GenerationRequest, or a clear gRPC error.

Everything is checked here, before the engine sees it: bad input never reaches MLX.
Proto3 zero values mean "unset" for the scalar fields the router always fills
(top_p, repetition_penalty), so 0 keeps its neutral meaning there.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from .engine.prefix.keys import adapter_keyed, block_keys, image_keyed
from .faces import MLX_FACE, Face
from .lifecycle import Lifecycle, Phase
from .messages import (
    Constraint,
    GenerationRequest,
    ImageInput,
    ModelInfo,
    PenaltySpec,
    SamplingSpec,
)

MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
LOGIT_BIAS_BOUND = 100.0  # |logit_bias| the engine applies (OpenAI's range)
# Below this a temperature is greedy: 1 / temperature would overflow float32 near 1e-39 and
# turn "almost greedy" into uniform noise.
GREEDY_TEMPERATURE = 1e-6
# Compiles a grammar on the model's vocabulary (`GrammarChecker.compile`): the compiled grammar
# the engine starts from, or ValueError saying why it cannot run here.
GrammarCheck = Callable[[str], Any]


class RequestError(Exception):
    """A request the worker refuses, with the status and message the client gets."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def not_serving(lifecycle: Lifecycle) -> RequestError:
    """What a request gets while the worker does not serve. While it starts,
    RESOURCE_EXHAUSTED: the smg router retries it (on another worker when it has one) without
    counting it against the worker's circuit breaker, which UNAVAILABLE would open for a
    minute after ten refusals. Shutting down or failed: UNAVAILABLE, so the router takes the
    worker out."""
    starting = lifecycle.phase in (Phase.STARTING, Phase.LOADING)
    code = grpc.StatusCode.RESOURCE_EXHAUSTED if starting else grpc.StatusCode.UNAVAILABLE
    return RequestError(code, lifecycle.refusal)


# A prompt's ids -> the ids with its images' placeholder runs in, and the images placed.
ExpandImages = Callable[[list[int]], tuple[list[int], tuple[ImageInput, ...]]]


def _invalid(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


@dataclass(frozen=True)
class Limits:
    """What the model and the operator allow a request to ask for."""

    vocab_size: int
    context_length: int
    eos_token_ids: tuple[int, ...]
    max_prompt_tokens: int | None = None
    has_thinking: bool = False
    check_grammar: GrammarCheck | None = None  # the server's GrammarChecker's compile
    # Put before prompts that do not start with it: the BOS of a model whose tokenizer adds
    # one to every encoding (None: never).
    bos_token_id: int | None = None

    @classmethod
    def for_model(
        cls,
        info: ModelInfo,
        max_prompt_tokens: int | None = None,
        has_thinking: bool = False,
        check_grammar: GrammarCheck | None = None,
        prepend_bos: bool = True,
    ) -> Limits:
        return cls(
            info.vocab_size,
            info.context_length,
            info.eos_token_ids,
            max_prompt_tokens,
            has_thinking,
            check_grammar,
            info.bos_token_id if prepend_bos and info.adds_bos else None,
        )

    @property
    def prompt_limit(self) -> int:
        """The longest prompt accepted: one token of room must stay for generation."""
        limit = self.context_length - 1
        if self.max_prompt_tokens is not None:
            limit = min(limit, self.max_prompt_tokens)
        return limit


MAX_SAMPLES = 16  # n: rows one request may ask for
# Fields one face carries and the other lacks read as their proto3 default on the other.
Params = Any  # the SamplingParams of either face (mlx_engine_pb2 or vllm_engine_pb2)


def _has(message: Any, name: str) -> bool:
    return name in message.DESCRIPTOR.fields_by_name and message.HasField(name)


def _finite(name: str, value: float) -> float:
    if not math.isfinite(value):
        raise _invalid(f"{name} must be a finite number, got {value}")
    return value


def prompt_ids(
    request: Any, limits: Limits, text_ids: list[int] | None = None
) -> tuple[list[int], bool]:
    """The prompt's token ids, and whether the model's BOS was put before them; `text_ids`
    is the worker's own encoding of a `text` input.

    A model whose tokenizer starts every encoding with its BOS writes garbage without it,
    and the smg router tokenizes raw-text completions without special tokens: so ids that
    do not start with that BOS get it (one, never two)."""
    kind = request.WhichOneof("input")
    if kind == "text":
        if text_ids is None:
            raise _invalid("text input is not available on this worker")
        ids = text_ids
    else:
        ids = list(request.tokenized.input_ids) if kind == "tokenized" else []
    if not ids:
        raise _invalid(
            "the prompt is empty: send tokenized.input_ids or text with at least one token"
        )
    bos = limits.bos_token_id
    added = bos is not None and ids[0] != bos
    if added:
        ids = [bos, *ids]
    params = request.sampling_params
    if _has(params, "truncate_prompt_tokens"):
        keep = params.truncate_prompt_tokens
        if keep == -1:
            keep = limits.prompt_limit
        elif keep < 1:
            raise _invalid(f"truncate_prompt_tokens must be -1 or at least 1, got {keep}")
        ids = ids[-keep:]  # the prompt's end: what the model answers to
    vocab = limits.vocab_size
    bad = next((t for t in ids if t >= vocab), None)
    if bad is not None:
        raise _invalid(f"token id {bad} is outside the vocabulary (size {vocab})")
    limit = limits.prompt_limit
    if len(ids) > limit:
        with_bos = " with the model's BOS put first" if added else ""
        raise _invalid(
            f"the prompt has {len(ids)} tokens{with_bos}; this worker accepts at most {limit} "
            f"(context length {limits.context_length})"
        )
    return ids, added


def refuse_media(request: Any) -> None:
    """The vLLM face carries images and other media beside the prompt's placeholder tokens.
    This worker serves text models: the placeholders without their media would be answered
    as text, wrongly, so such a request is refused (empty media fields are no media)."""
    if "mm_inputs" not in request.DESCRIPTOR.fields_by_name:
        return
    if request.mm_inputs.ByteSize() or request.extra_mm_inputs or request.media_refs.items:
        raise _invalid("multimodal inputs are not supported: this worker serves text models")


def sampling_spec(params: Params, vocab_size: int) -> SamplingSpec:
    temperature = params.temperature if params.HasField("temperature") else 1.0
    if _finite("temperature", temperature) < 0:
        raise _invalid(f"temperature must be >= 0, got {temperature}")
    top_p = _finite("top_p", params.top_p) or 1.0
    if not 0 < top_p <= 1:
        raise _invalid(f"top_p must be in (0, 1], got {top_p}")
    min_p = _finite("min_p", params.min_p)
    if not 0 <= min_p <= 1:
        raise _invalid(f"min_p must be in [0, 1], got {min_p}")
    # A top_k that keeps the whole vocabulary filters nothing.
    top_k = params.top_k if params.top_k < vocab_size else 0
    if temperature < GREEDY_TEMPERATURE:  # greedy ignores every filter; one sampler serves all
        return SamplingSpec(temperature=0.0)
    seed = params.seed if params.HasField("seed") else None
    return SamplingSpec(temperature, top_p, top_k, min_p, seed)


def penalty_spec(params: Params, vocab_size: int) -> PenaltySpec:
    repetition = _finite("repetition_penalty", params.repetition_penalty) or 1.0
    if repetition <= 0:
        raise _invalid(f"repetition_penalty must be > 0, got {repetition}")
    frequency = _finite("frequency_penalty", params.frequency_penalty)
    presence = _finite("presence_penalty", params.presence_penalty)
    bias = []
    for token, value in sorted(params.logit_bias.items()):
        if not 0 <= token < vocab_size:
            raise _invalid(
                f"logit_bias token {token} is outside the vocabulary (size {vocab_size})"
            )
        # Clamped to the OpenAI range, as vLLM's server does: a bias of 1e38 swamps every
        # logit's digits, and several tokens would each read logprob 0.
        value = _finite(f"logit_bias[{token}]", value)
        bias.append((token, min(LOGIT_BIAS_BOUND, max(-LOGIT_BIAS_BOUND, value))))
    return PenaltySpec(repetition, frequency, presence, tuple(bias))


@dataclass(frozen=True)
class TextOptions:
    """What the handler does with decoded text: stop strings, found from the `min_tokens`-th
    generated token on, cut from the text unless `include_stop`."""

    stops: tuple[str, ...] = ()
    include_stop: bool = False
    min_tokens: int = 0


def text_options(params: Params) -> TextOptions | None:
    stops = tuple(params.stop)
    if len(stops) > MAX_STOP_STRINGS:
        raise _invalid(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
    for stop in stops:
        if not stop or len(stop) > MAX_STOP_CHARS:
            raise _invalid(f"each stop string needs 1 to {MAX_STOP_CHARS} characters")
    if not stops and not getattr(params, "return_text", False):
        return None
    return TextOptions(stops, params.include_stop_str_in_output, params.min_tokens)


def closed_objects(schema: str) -> str:
    """The schema with `additionalProperties: false` wherever an object lists its properties
    and says nothing of others (vLLM's strict mode): a tool call's arguments then end after
    the listed keys instead of inviting a weak model to add keys forever."""
    try:
        document = json.loads(schema)
    except ValueError:
        return schema  # llguidance says what is wrong with it

    def close(node: Any) -> None:
        if isinstance(node, dict):
            if "properties" in node and "additionalProperties" not in node:
                node["additionalProperties"] = False
            for value in node.values():
                close(value)
        elif isinstance(node, list):
            for value in node:
                close(value)

    close(document)
    return json.dumps(document)


def _grammar(kind: str, source: Any) -> str:
    """The llguidance grammar of one constraint field (ValueError when it does not parse)."""
    import llguidance  # only requests with a constraint pay for the import

    if kind == "json_object":
        kind, source = "json_schema", '{"type": "object"}'
    if kind == "json_schema":
        # Compact JSON unless the schema's own x-guidance says otherwise: free whitespace
        # lets a weak model pad forever instead of finishing the object.
        return llguidance.LLMatcher.grammar_from_json_schema(
            closed_objects(source), defaults={"whitespace_flexible": False, "item_separator": ", "}
        )
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(source)
    if kind == "lark_grammar":
        return llguidance.LLMatcher.grammar_from_lark(source)
    if kind == "grammar":  # GBNF / EBNF as the router sends it, or Lark
        return llguidance.grammar_from("grammar", source)
    if kind == "choice":
        if not source.choices:
            raise ValueError("choice needs at least one string")
        return llguidance.grammar_from("choice", json.dumps(list(source.choices)))
    raise _invalid(f"{kind} constraints are not supported by this worker")


def constraint(params: Params, check: GrammarCheck | None = None) -> Constraint | None:
    kind = params.WhichOneof("constraint")
    if kind is None or (kind == "json_object" and not params.json_object):
        return None  # json_object false asks for no constraint
    import llguidance

    try:
        grammar = _grammar(kind, getattr(params, kind))
    except RequestError:
        raise
    except Exception as exc:  # the converters raise their own error types
        raise _invalid(f"invalid {kind}: {exc}") from None
    if check is None:  # no vocabulary to compile it on yet: its syntax only
        error = llguidance.LLMatcher.validate_grammar(grammar)
        if error:
            raise _invalid(f"invalid {kind}: {error}")
        return Constraint(kind, grammar)
    try:
        compiled = check(grammar)
    except ValueError as exc:
        raise _invalid(f"invalid {kind}: {exc}") from None
    return Constraint.checked(kind, grammar, compiled)


def embed_prompt(request_id: str, ids: list[int], limits: Limits) -> list[int]:
    """An Embed call's prompt, checked like a Generate call's (the model's BOS put first when
    its tokenizer adds one)."""
    if not request_id:
        raise _invalid("request_id is empty")
    if not ids:
        raise _invalid("the input is empty: send tokenized.input_ids with at least one token")
    bos = limits.bos_token_id
    if bos is not None and ids[0] != bos:
        ids = [bos, *ids]
    vocab = limits.vocab_size
    bad = next((t for t in ids if t >= vocab), None)
    if bad is not None:
        raise _invalid(f"token id {bad} is outside the vocabulary (size {vocab})")
    if len(ids) > limits.context_length:
        raise _invalid(
            f"the input has {len(ids)} tokens; this worker embeds at most "
            f"{limits.context_length} (context length)"
        )
    return ids


def sample_count(params: Params) -> int:
    """How many rows (`n`) one request asks for from its prompt."""
    n = params.n or 1
    if n > MAX_SAMPLES:
        raise _invalid(f"n must be at most {MAX_SAMPLES}, got {n}")
    return n


def _top_logprobs(params: Params) -> int | None:
    if _has(params, "prompt_logprobs"):
        raise _invalid("prompt_logprobs is not supported by this worker; leave it unset")
    if not params.HasField("logprobs"):
        return None
    if not 0 <= params.logprobs <= MAX_TOP_LOGPROBS:
        raise _invalid(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {params.logprobs}")
    return params.logprobs


def _max_tokens(params: Params, room: int) -> int:
    """Tokens the request may generate: its max_tokens clamped to the context's room (the row
    then ends `length`), the room when unset."""
    max_tokens = room
    if params.HasField("max_tokens"):
        if params.max_tokens == 0:
            raise _invalid("max_tokens must be at least 1")
        max_tokens = min(params.max_tokens, room)
    if params.min_tokens > max_tokens:
        raise _invalid(f"min_tokens ({params.min_tokens}) is above max_tokens ({max_tokens})")
    return max_tokens


def _thinking_budget(params: Params, limits: Limits) -> int | None:
    if not _has(params, "thinking_budget"):
        return None
    if not limits.has_thinking:
        raise _invalid("thinking_budget: this model has no reasoning-section markers")
    return params.thinking_budget


def _with_images(
    prompt: list[int], expand_images: ExpandImages | None, limits: Limits
) -> tuple[list[int], tuple[ImageInput, ...], list[int]]:
    """The prompt with its images' placeholder runs, the images, and the prompt as the prefix
    store names it (empty: no images)."""
    if expand_images is None:
        return prompt, (), []
    prompt, images = expand_images(prompt)
    if len(prompt) > limits.prompt_limit:
        raise _invalid(
            f"the prompt has {len(prompt)} tokens with its images' placeholders; this worker "
            f"accepts at most {limits.prompt_limit}"
        )
    return prompt, images, image_keyed(prompt, [(i.offset, i.length, i.key) for i in images])


@dataclass(frozen=True, slots=True)
class RequestContext:
    """What the handler knows of one Generate call beyond its message, carried to
    `build_request`: the face it came through, the served adapter it is for, and its input
    as the worker prepared it."""

    face: Face = MLX_FACE
    adapter: str = ""  # the served adapter it is for ("": the base model)
    adapter_key: str = ""  # the adapter's name in the prefix store (its weights' digest)
    ticket: int = 0  # the engine's name for it
    text_ids: list[int] | None = None  # the worker's encoding of a `text` input
    # Its images, fetched and processed, to put in its prompt (None: media is refused).
    images: ExpandImages | None = None


@dataclass(frozen=True, slots=True)
class Handoff:
    """How the engine hands every request's tokens back, and names its prompt's blocks (the
    worker's settings). After the first token: `stream_interval` tokens per streamed chunk, and
    at least `window_s` between two chunks (the finish never waits). `block_size`: tokens per
    prefix block (0: the worker keeps no prefixes)."""

    stream_interval: int = 1
    window_s: float = 0.0
    block_size: int = 0


def build_request(
    request: Any, context: RequestContext, limits: Limits, handoff: Handoff = Handoff()
) -> tuple[GenerationRequest, TextOptions | None]:
    """Validate and normalise; raises RequestError with the status to send.

    A unary call needs its handler only for the first token (time-to-first-token metric) and
    the finish, unless it watches for stop strings. An adapter's blocks are its own: its
    prompt is named with its `adapter_key`."""
    if not request.request_id:
        raise _invalid("request_id is empty")
    if context.images is None:
        refuse_media(request)
    prompt, bos_added = prompt_ids(request, limits, context.text_ids)
    prompt, images, keyed = _with_images(prompt, context.images, limits)
    adapter = context.adapter
    keyed = adapter_keyed(keyed or prompt, context.adapter_key or adapter) if adapter else keyed
    params = request.sampling_params
    max_tokens = _max_tokens(params, limits.context_length - len(prompt))
    sample_count(params)
    top_logprobs = _top_logprobs(params)
    grammar = constraint(params, limits.check_grammar)
    stop = {t for t in params.stop_token_ids if t < limits.vocab_size}
    if not params.ignore_eos or grammar is not None:  # a finished grammar ends with EOS
        stop.update(limits.eos_token_ids)
    text = text_options(params)
    job = GenerationRequest(
        ticket=context.ticket,
        request_id=request.request_id,
        prompt=prompt,
        max_tokens=max_tokens,
        sampling=sampling_spec(params, limits.vocab_size),
        penalties=penalty_spec(params, limits.vocab_size),
        stop_token_ids=frozenset(stop),
        top_logprobs=top_logprobs,
        constraint=grammar,
        thinking_budget=_thinking_budget(params, limits),
        tokens_per_handoff=(
            handoff.stream_interval if request.stream or text is not None else sys.maxsize
        ),
        handoff_window_s=handoff.window_s,
        block_keys=block_keys(keyed or prompt, handoff.block_size) if handoff.block_size else (),
        bos_added=bos_added,
        min_tokens=params.min_tokens,
        stop_strings=text.stops if text is not None else (),
        images=images,
        keyed_prompt=keyed,
        adapter=adapter,
    )
    return job, text
