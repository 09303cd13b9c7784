"""The engine's batch runner: requests in, one step at a time, tokens and prompt progress out
(engine thread only).

A request prefills a chunk a step beside the decoding rows (the chunk is the caller's, each
step), then decodes. Which requests join, and when, is the scheduler's plan alone: the runner
keeps no waiting line and no caps of its own, so every setting is decided in one place.
The runner calls mlx-lm's models and cache classes directly; the rows, their progress and
the step are its own (`PromptBatch`, `DecodeBatch`).
Where `fuse_prefill` is set for a model `enable_fused_prefill` covers, one prompt's chunk goes
through the decoding rows' forward (fused_prefill). With LoRA adapters loaded (`adapters`,
adapters.py) each request names its adapter's index; every forward sets its rows' own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.generate import StopSequences
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import greedy_sampler
from mlx_lm.utils import maybe_set_recommended_wired_limit

from .adapters import AdapterSet
from .decode_batch import DecodeBatch, DecodeResponse
from .fused_prefill import FusingModel
from .prefill import PrefillWork
from .prompt_batch import PromptBatch, PromptProgress, PromptRow
from .row_inputs import RowContext, RowInputs
from .vision import VisionEncoder

DEFAULT_MAX_TOKENS = 128
CLEAR_EVERY = 512  # decode steps between frees of MLX's buffer cache


class BatchRunner:
    """The rows in prefill and the decoding rows; `next` runs one step."""

    def __init__(
        self,
        model: Any,
        *,
        prefill_step_size: int = 2048,
        stream: mx.Stream | None = None,
        sampler: Any = None,
        vision: VisionEncoder | None = None,
        adapters: AdapterSet | None = None,
        fuse_prefill: bool = False,
        grouping: Callable[[list[Any]], list[Any]] | None = None,
    ) -> None:
        """`fuse_prefill`: one prompt's chunk may ride in the decoding rows' forward (a model
        `enable_fused_prefill` covers); `grouping`: decoding rows of very different lengths
        attend in groups, `grouping` making the groups of each joining batch (row_groups)."""
        self.model = model
        self.vision = vision
        self.adapters = adapters  # the LoRA adapters loaded on the model, if any
        self.sampler = sampler or greedy_sampler
        self.prefill_step_size = prefill_step_size  # a step's chunk unless `next` is told one
        self._stream = stream or mx.new_stream(mx.default_device())
        self._next_uid = 0
        self.context = RowContext(vision.rope if vision is not None else None, adapters)
        self.prefill = PromptBatch(model, vision, self.context)
        self.decoding: DecodeBatch = self._new_decode_batch(grouping)
        self.fuse_prefill = fuse_prefill
        self.fused_steps = 0
        self.prompt_tokens = 0  # prompt tokens put through the model so far
        self.decode_steps = 0
        self.prefilled = PrefillWork()  # the last step's prefill work, exactly
        self.catch_up: int | None = None  # the step's draft catch-up allowance (speculation)
        self._wired_limit = maybe_set_recommended_wired_limit()

    def _new_decode_batch(self, grouping: Callable[[list[Any]], list[Any]] | None) -> DecodeBatch:
        return DecodeBatch.empty(self.model, self.sampler, context=self.context, grouping=grouping)

    @property
    def prefilling(self) -> bool:
        return len(self.prefill) > 0

    def close(self) -> None:
        if self._wired_limit is not None:
            mx.synchronize(self._stream)
            mx.set_wired_limit(self._wired_limit)
            self._wired_limit = None

    # ----- requests in and out -----

    def insert(self, prompts: list[list[int]], **kwargs: Any) -> list[int]:
        return self.insert_segments([[p] for p in prompts], **kwargs)

    def insert_segments(
        self,
        segments: list[list[list[int]]],
        max_tokens: list[int] | None = None,
        caches: list[list[Any] | None] | None = None,
        all_tokens: list[list[int]] | None = None,
        samplers: list[Any] | None = None,
        logits_processors: list[Sequence[Any] | None] | None = None,
        stop_sequences: list[StopSequences] | None = None,
        inputs: list[RowInputs] | None = None,
    ) -> list[int]:
        """Requests begin their prefill (the next step runs their first chunk), each prompt in
        segments (prefill stops at each segment's end, for a snapshot), with its inputs beside
        its tokens (images, multimodal RoPE, LoRA adapter), if any; their uids."""
        n = len(segments)
        options = {
            "max_tokens": max_tokens or [DEFAULT_MAX_TOKENS] * n,
            "caches": caches or [None] * n,
            "all_tokens": all_tokens or [[] for _ in range(n)],
            "samplers": samplers or [None] * n,
            "logits_processors": logits_processors or [()] * n,
            "stop_sequences": stop_sequences or [StopSequences()] * n,
            "inputs": inputs or [RowInputs() for _ in range(n)],
        }
        for name, values in options.items():
            if len(values) != n:
                raise ValueError(f"{name}: {len(values)} values for {n} prompts")
        self.context.check(options["inputs"])
        rows = []
        for i, prompt in enumerate(segments):
            row = {name: values[i] for name, values in options.items()}
            rows.append(_prompt_row(self, self._next_uid + i, prompt, row))
        with mx.stream(self._stream):
            self.prefill.add(rows)
        self._next_uid += n
        return [row.uid for row in rows]

    def _where(self, uids: Sequence[int]) -> dict[int, tuple[int, int]]:
        """Each uid's stage (0 prefill, 1 decoding) and position there."""
        wanted, found = set(uids), {}
        for stage, ids in enumerate((self.prefill.uids, self.decoding.uids)):
            for i, uid in enumerate(ids):
                if uid in wanted:
                    found[uid] = (stage, i)
        return found

    def extract_cache(self, uids: Sequence[int]) -> dict[int, tuple[list[Any], list[int]]]:
        """Each row's caches on their own and the tokens they hold."""
        results = {}
        for uid, (stage, i) in self._where(uids).items():
            if stage == 0:
                results[uid] = (self.prefill.extract_cache(i), self.prefill.rows[i].tokens)
            else:
                results[uid] = (self.decoding.extract_cache(i), self.decoding.tokens[i])
        return results

    def remove(self, uids: Sequence[int]) -> None:
        gone: list[set[int]] = [set(), set()]
        for stage, i in self._where(uids).values():
            gone[stage].add(i)
        if gone[0]:
            self.prefill.filter([i for i in range(len(self.prefill)) if i not in gone[0]])
        if gone[1]:
            self.decoding.filter([i for i in range(len(self.decoding)) if i not in gone[1]])

    # ----- one step -----

    def next(
        self, chunk: int | None = None, catch_up: int | None = None
    ) -> tuple[list[PromptProgress], list[DecodeResponse]]:
        """One step: a token for every decoding row, and up to `chunk` prompt tokens a row
        (default `prefill_step_size`) for the rows in prefill; `catch_up`: a draft model's
        catch-up tokens this step (None: no bound; speculation's)."""
        self.catch_up = catch_up
        with mx.stream(self._stream):
            return self._next(chunk or self.prefill_step_size)

    @property
    def caught_up(self) -> tuple[int, float]:
        """A draft model's catch-up in the last step: tokens and seconds (none here)."""
        return 0, 0.0

    def _next(self, chunk: int) -> tuple[list[PromptProgress], list[DecodeResponse]]:
        self.prefilled = PrefillWork()
        if self._fusable():
            return self._fused_step(chunk)
        responses = self._decode()
        progress = []
        starting = [i for i, row in enumerate(self.prefill.rows) if row.starting]
        for i in starting:
            row = self.prefill.rows[i]
            progress.append(PromptProgress(row.uid, (row.total, row.total), True, True))
        if starting:
            self.decoding.extend(self.prefill.start_decoding(starting, self.sampler))
        chunks, context = [], 0
        for row in self.prefill.rows:
            context = max(context, len(row.tokens))
            tokens, ended = row.take(chunk)
            chunks.append(tokens)
            progress.append(PromptProgress(row.uid, (row.done, row.total), ended, False))
        width = max((len(c) for c in chunks), default=0)
        self.prefilled = PrefillWork(len(chunks), width, context, len(starting))
        self.prompt_tokens += sum(len(c) for c in chunks)
        self.prefill.prompt(chunks)
        return progress, responses

    def _decode(self) -> list[DecodeResponse]:
        if not len(self.decoding):
            return []
        responses = self._step_decoding()
        self.decode_steps += 1
        if self.decode_steps % CLEAR_EVERY == 0:
            mx.clear_cache()
        return responses

    def _step_decoding(self) -> list[DecodeResponse]:
        return self.decoding.next()

    # ----- a prompt's chunk in the decoding rows' forward -----

    def _fusable(self) -> bool:
        if not self.fuse_prefill or len(self.prefill) != 1 or not len(self.decoding):
            return False
        row = self.prefill.rows[0]  # a packed forward sets no row's inputs
        return not row.starting and row.inputs.plain and self.decoding.plain

    def _fused_step(self, chunk: int) -> tuple[list[PromptProgress], list[DecodeResponse]]:
        row = self.prefill.rows[0]
        context = len(row.tokens)
        tokens, ended = row.take(chunk)
        progress = PromptProgress(row.uid, (row.done, row.total), ended, False)
        self.prefilled = PrefillWork(1, len(tokens), context)
        caches = self.prefill.prompt_cache
        fusing = FusingModel(self.model, mx.array([tokens]), caches)
        with self.decoding.forwards_through(fusing):
            responses = self._decode()
        if fusing.used:
            self.fused_steps += 1
            row.tokens += tokens
            mx.eval([c.state for c in caches])
            mx.clear_cache()
        else:  # the decoding step made no forward that could carry the chunk
            self.prefill.prompt([tokens])
        self.prompt_tokens += len(tokens)
        return [progress], responses


def _prompt_row(
    runner: BatchRunner, uid: int, prompt: list[list[int]], given: dict[str, Any]
) -> PromptRow:
    """Request `uid`'s row: its prompt's segments, the last token apart (it runs as the row
    starts decoding), and its per-request options (`given`, insert_segments' by name)."""
    parts = [list(s) for s in prompt if s]
    if not parts:
        raise ValueError(f"prompt {uid} is empty")
    if given["max_tokens"] <= 0:
        raise ValueError(f"prompt {uid}: max_tokens must be > 0")
    if len(parts[-1]) != 1:
        parts.append(parts[-1][-1:])
        parts[-2] = parts[-2][:-1]
    cache = given["caches"]
    if cache is None:
        cache = make_prompt_cache(runner.model)
    sampler = given["samplers"]
    return PromptRow(
        uid,
        parts,
        given["max_tokens"],
        cache,
        given["all_tokens"],
        runner.sampler if sampler is None else sampler,
        tuple(given["logits_processors"] or ()),
        given["stop_sequences"],
        given["inputs"],
    )
