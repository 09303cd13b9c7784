"""Everything an engine builds from its model before it can step: the weights, sampling,
the admission guard's limits, the prefix cache and the batch runner (engine thread only)."""

from __future__ import annotations

import importlib.metadata
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from ..admission import Admission, MemoryModel
from ..engine_config import EngineConfig
from ..messages import ModelInfo
from ..model_files import ModelLoadError, ModelSpec, resolve_model_dir
from .adapters import AdapterError, AdapterSet, load_adapters
from .cache_kinds import check_quantization, grouped, kind_of, make_row_cache
from .constraints import GrammarFactory
from .fused_prefill import enable_fused_prefill
from .lockstep import Lockstep
from .memory import device_memory_bytes, measure, weights_bytes
from .mlx_lm_compat import missing_touch_points
from .model import LoadedModel, load_model, log_blas_hint
from .prefix.disk_tier import DiskTier, model_identity
from .prefix.store import AnyPrefixStore, CacheLayout, NoPrefixStore, PrefixStore
from .runner import BatchRunner
from .sampling import SamplingFactory
from .speculation import (
    DraftModel,
    DraftSource,
    PromptLookup,
    SpeculationConfig,
    SpeculationCounters,
    SpeculativeRunner,
    check_draft_compatible,
    draft_supported,
    speculation_supported,
)
from .vision import VisionEncoder, VisionUnavailable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Speculation:
    """How the engine speculates: "ngram" (prompt lookup) or "draft" (with `draft`, a
    second model sharing the target's tokenizer)."""

    kind: str
    draft: nn.Module | None = None
    config: SpeculationConfig = field(default_factory=SpeculationConfig)

    def source(self) -> DraftSource:
        """A fresh draft source (it keeps per-row state: one per runner)."""
        if self.kind == "draft":
            assert self.draft is not None
            return DraftModel(self.draft)
        return PromptLookup()


@dataclass
class EngineParts:
    """What the engine steps with, built once on its thread."""

    loaded: LoadedModel
    sampling: SamplingFactory
    admission: Admission
    prefix: AnyPrefixStore
    has_thinking: bool
    speculation: Speculation | None = None  # None: off (not asked for, or not possible)
    # One request's empty caches: quantized attention layers with --kv-bits (None: mlx-lm's)
    new_row: Callable[[], list[Any]] | None = None
    fused_prefill: bool = False  # a prefill chunk rides in the decoding rows' forward
    group_rows: bool = False  # decoding rows of very different lengths attend in groups
    vision: VisionEncoder | None = None  # a vision-language model's image side
    adapters: AdapterSet | None = None  # LoRA adapters served beside the base (--adapter)


def build_parts(
    config: EngineConfig, info: ModelInfo, lockstep: Lockstep | None = None, crossed: bool = False
) -> EngineParts:
    """Load the model `info` describes and build everything around it (with a `lockstep`:
    this rank's shard, and what every rank must hold alike). `crossed`: every request comes
    over a process boundary (the engine process), its grammar uncompiled, as a follower
    rank's come in rank 0's plans."""
    log_blas_hint()
    if config.faults is not None:
        config.faults.before_load()
    group = lockstep.group if lockstep is not None else None
    loaded = load_model(Path(info.model_dir), config.adapter_path, group)
    adapters = _adapters(config, loaded, lockstep is not None)  # weights before memory
    seed = config.sampling_seed
    if seed is None:
        seed = int.from_bytes(os.urandom(4), "little")
    if lockstep is not None:
        seed = lockstep.shared_seed(seed)
    tokenizer = loaded.tokenizer
    eos = info.eos_token_ids[0] if info.eos_token_ids else 0
    sampling = SamplingFactory(
        info.vocab_size,
        GrammarFactory(
            tokenizer._tokenizer,
            info.vocab_size,
            eos,
            build_at_load=crossed or (lockstep is not None and not lockstep.leads),
        ),
        seed,
        think_start=tokenizer.think_start_tokens,
        think_end=tokenizer.think_end_tokens,
    )
    shared = lockstep is not None
    speculation = _speculation(config, loaded, shared)
    new_row = _quantized_rows(config, loaded)
    row = new_row() if new_row is not None else make_prompt_cache(loaded.model)
    admission = _admission(config, loaded, speculation, row)
    vision = _vision(config, info, loaded, shared)
    fused, groups_rows = _packed_forwards(config, loaded, shared, vision)
    return EngineParts(
        loaded,
        sampling,
        admission,
        _prefix_store(config, admission, loaded, info, CacheLayout.of(row), shared),
        bool(tokenizer.think_start_tokens and tokenizer.think_end_tokens),
        speculation,
        new_row,
        fused,
        groups_rows,
        vision,
        adapters,
    )


def _adapters(config: EngineConfig, loaded: LoadedModel, shared: bool) -> AdapterSet | None:
    """The LoRA adapters `config.adapters` names, onto the loaded model (None: none named); one
    that does not fit the base stops the engine from starting, with the reason. Their weights
    are the model's from here on, so the admission guard counts them with the base's."""
    if not config.adapters:
        return None
    if shared:
        raise ModelLoadError("--adapter is not supported with --distributed")
    if config.adapter_path is not None:
        raise ModelLoadError(
            "--adapter cannot be combined with --adapter-path (the adapters serve on the base "
            "model as its files hold it)"
        )
    try:
        adapters = load_adapters(loaded.model, {name: Path(path) for name, path in config.adapters})
    except AdapterError as exc:
        raise ModelLoadError(f"cannot serve the adapters: {exc}") from exc
    for index, spec in adapters.specs.items():
        log.info(
            "adapter %r (%d): %s rank %d from %s", spec.name, index, spec.kind, spec.rank, spec.path
        )
    return adapters


def _packed_forwards(
    config: EngineConfig, loaded: LoadedModel, shared: bool, vision: VisionEncoder | None
) -> tuple[bool, bool]:
    """Whether a prefill chunk rides in the decoding rows' forward (fused prefill) and whether
    decoding rows of very different lengths attend in groups: where asked and the model's
    attention is covered. Not over several ranks (one model there keeps mlx-lm's forwards:
    every rank must step alike), nor with multimodal RoPE, which sets one position entry per
    row of a forward (a packed forward and row groups run rows apart)."""
    if shared or (vision is not None and vision.rope is not None):
        return False, False
    fused = (
        config.fuse_prefill and not missing_touch_points() and enable_fused_prefill(loaded.model)
    )
    if fused:
        log.info("fused prefill: a prompt's chunk goes through the decoding rows' forward")
    # The attention's class swap is fused prefill's.
    groups = config.group_rows and not missing_touch_points() and enable_fused_prefill(loaded.model)
    return fused, groups


def _vision(
    config: EngineConfig, info: ModelInfo, loaded: LoadedModel, shared: bool
) -> VisionEncoder | None:
    """The image side of a model whose files say it serves images; it must load, or the
    engine does not start (the handlers already advertise images)."""
    if not info.supports_vision:
        return None
    if shared:
        raise ModelLoadError("images are not served with --distributed yet")
    try:
        vision = VisionEncoder.load(Path(info.model_dir), loaded.model, config.encoder_cache_bytes)
    except VisionUnavailable as exc:
        raise ModelLoadError(f"cannot serve the images of {info.model_dir}: {exc}") from exc
    log.info("serving images: %s's vision encoder loaded with mlx-vlm", info.model_type)
    return vision


def _quantized_rows(config: EngineConfig, loaded: LoadedModel) -> Callable[[], list[Any]] | None:
    """With --kv-bits, one request's caches with its attention layers quantized, checked on
    the model's real cache shapes before any request can fail on them."""
    bits = config.kv_bits
    if bits is None:
        return None
    model = loaded.model
    group_size = kv_group_size(cache_head_sizes(model), config.kv_group_size)
    try:
        why = check_quantization(model, bits, group_size)
        dequantize = why is not None
        _dry_run(model, make_row_cache(model, bits, group_size, dequantize))
    except Exception as exc:
        raise ModelLoadError(f"--kv-bits {bits} --kv-group-size {group_size}: {exc}") from exc
    how = "attention on the quantized data (QuantizedRowCache)"
    if dequantize:
        how = f"stored quantized and dequantized for attention (DequantizingRowCache): {why}"
    log.info("KV cache quantized: %d bits, groups of %d, %s", bits, group_size, how)
    return lambda: make_row_cache(model, bits, group_size, dequantize)


AUTO_GROUP_SIZES = (64, 32)  # tried in this order when --kv-group-size is not given


def kv_group_size(head_sizes: set[int], asked: int | None) -> int:
    """The quantization group for attention layers whose key and value vectors have
    `head_sizes`: `asked` if it divides them all, otherwise an error naming the flag; with
    none asked, the largest of AUTO_GROUP_SIZES that divides them all."""
    sizes = ", ".join(str(n) for n in sorted(head_sizes))
    if asked is not None:
        if any(n % asked for n in head_sizes):
            raise ModelLoadError(
                f"--kv-group-size {asked} does not divide this model's attention head size "
                f"({sizes}); choose one that does, or leave it out to pick one"
            )
        return asked
    for group in AUTO_GROUP_SIZES:
        if not any(n % group for n in head_sizes):
            return group
    raise ModelLoadError(
        f"--kv-bits: this model's attention head size ({sizes}) is not a multiple of "
        f"{' or '.join(str(g) for g in AUTO_GROUP_SIZES)}, so its KV cache cannot be quantized"
    )


def cache_head_sizes(model: nn.Module) -> set[int]:
    """The key and value vector sizes of the layers --kv-bits quantizes (plain KVCache),
    read off a one-token forward: models derive them in ways no config field says."""
    caches = make_prompt_cache(model)
    _dry_run(model, caches)
    return {
        int(array.shape[-1])
        for cache in caches
        if kind_of(cache).quantize and cache.keys is not None
        for array in (cache.keys, cache.values)
    }


def _dry_run(model: nn.Module, caches: list[Any]) -> None:
    """One token through the model with `caches`: what a prefill of them would meet."""
    logits = model(mx.array([[0]]), cache=caches)
    mx.eval(logits, [c.state for c in caches if getattr(c, "keys", None) is not None])


def _speculation(
    config: EngineConfig, loaded: LoadedModel, shared: bool = False
) -> Speculation | None:
    """What `--speculate` asks for (off, and the log names the layer kind, for a model with
    a cache kind that cannot roll back per row, and on the ranks of a distributed group, the
    `shared` engine); a draft model that does not share the target's tokenizer, or cannot
    draft, fails startup."""
    if config.speculate is None:
        return None
    if shared:
        log.info("speculative decoding stays off: not supported with --distributed (yet)")
        return None
    supported, reason = speculation_supported(loaded.model)
    if not supported:
        log.info("speculative decoding stays off: %s", reason)
        return None
    if missing := missing_touch_points():
        log.warning(
            "speculative decoding stays off: this mlx-lm (%s) lacks %s (servicer/engine/"
            "mlx_lm_compat.py)",
            importlib.metadata.version("mlx-lm"),
            ", ".join(missing),
        )
        return None
    draft = None
    if config.speculate == "draft":
        assert config.draft_model is not None
        draft_dir = resolve_model_dir(ModelSpec(config.draft_model))
        drafter = load_model(draft_dir, None)
        check_draft_compatible(loaded.tokenizer, drafter.tokenizer)
        draft = drafter.model
        supported, reason = draft_supported(draft)
        if not supported:
            raise ModelLoadError(f"the draft model {config.draft_model} cannot draft: {reason}")
    log.info(
        "speculative decoding: %s, up to %d draft tokens a row, off while more than %d rows "
        "decode (the cap counts every decoding row, drafting or not)",
        config.speculate if draft is None else f"draft model {config.draft_model}",
        config.speculation.k_max,
        config.speculation.max_rows,
    )
    return Speculation(config.speculate, draft, config.speculation)


def _admission(
    config: EngineConfig, loaded: LoadedModel, speculation: Speculation | None, row: list[Any]
) -> Admission:
    """What requests cost (what one request's caches `row` hold: quantized bytes with
    --kv-bits; a draft model's cache counts beside the target's) and the limit."""
    memory = measure(loaded.model, row)
    weights = weights_bytes(loaded.model)
    if speculation is not None and speculation.draft is not None:
        draft = measure(speculation.draft)
        memory = MemoryModel(
            memory.per_token + draft.per_token,
            memory.fixed_bytes + draft.fixed_bytes,
            memory.allocation_step,
        )
        weights += weights_bytes(speculation.draft)
    limit = config.max_kv_memory
    if limit is None:
        limit = max(device_memory_bytes() // 2 - weights, 64 << 20)
    return Admission(memory, limit)


def _prefix_store(
    config: EngineConfig,
    admission: Admission,
    loaded: LoadedModel,
    info: ModelInfo,
    layout: CacheLayout,
    shared: bool,
) -> AnyPrefixStore:
    """`shared`: every rank of a distributed group holds the same store."""
    if config.prompt_cache_size <= 0:
        return NoPrefixStore()
    max_bytes = config.prompt_cache_bytes
    if max_bytes is None:
        # Ranks must evict alike, so a distributed engine does not size it per machine.
        max_bytes = 1 << 30 if shared else min(admission.limit_bytes // 4, 1 << 30)
    block = config.block_size  # the handlers name blocks by the same setting
    interval = config.prompt_cache_snapshot_interval
    if interval is None:
        interval = snapshot_interval(admission.memory, block)
    disk = None
    if config.prompt_cache_dir is not None and not shared:  # ranks cannot share disk timing
        model_dir = Path(info.model_dir)
        model_id = model_identity(model_dir, config.adapter_path, block, layout.describe())
        disk = DiskTier(
            Path(config.prompt_cache_dir),
            model_id,
            config.prompt_cache_disk_bytes,
            faults=config.faults,
            shared=config.prompt_cache_shared,
        )
        disk.open()
    return PrefixStore(
        layout,
        block,
        interval,
        max_bytes,
        config.prompt_cache_size,
        disk,
        config.faults,
        special_tokens(loaded),
    )


def special_tokens(loaded: LoadedModel) -> frozenset[int]:
    """The tokenizer's special tokens (role markers, end of turn, ...)."""
    decoder = getattr(loaded.tokenizer._tokenizer, "added_tokens_decoder", {})
    return frozenset(int(i) for i, token in decoder.items() if getattr(token, "special", False))


SNAPSHOT_SHARE = 0.25  # snapshots may add at most this share to a long prompt's KV bytes


def snapshot_interval(memory: MemoryModel, block: int) -> int:
    """Tokens between snapshots: one snapshot (the model's uncuttable state) costs at most
    SNAPSHOT_SHARE of the KV bytes of the tokens between two of them."""
    per_token = sum(bytes_ for bytes_, window in memory.per_token if window is None)
    if memory.fixed_bytes == 0 and not any(window for _, window in memory.per_token):
        return block  # nothing uncuttable: no snapshots are taken anyway
    windows = sum(bytes_ * window for bytes_, window in memory.per_token if window)
    snapshot = memory.fixed_bytes + windows
    tokens = snapshot / (SNAPSHOT_SHARE * max(per_token, 1))
    return max(block, -(-int(tokens) // block) * block)


def runner_settings(config: EngineConfig, stream: mx.Stream) -> dict[str, Any]:
    """The batch runner's arguments an engine setting gives (its batch sizes are the
    scheduler's to keep)."""
    return {"prefill_step_size": config.prefill_step_size, "stream": stream}


def batch_generator_settings(config: EngineConfig, stream: mx.Stream) -> dict[str, Any]:
    """mlx-lm's BatchGenerator's arguments for the same setting (the raw-engine reference,
    which keeps its own waiting line by the batch sizes)."""
    return {
        **runner_settings(config, stream),
        "completion_batch_size": config.completion_batch_size,
        "prefill_batch_size": config.prefill_batch_size,
    }


def new_runner(
    parts: EngineParts,
    config: EngineConfig,
    stream: mx.Stream,
    counters: SpeculationCounters | None = None,
    speculate: bool = True,
) -> BatchRunner:
    """The engine's batch runner for `parts`, speculating when `parts.speculation` says so
    and `speculate` (its `counters` go on across runners)."""
    kwargs = runner_settings(config, stream)
    kwargs["vision"], kwargs["adapters"] = parts.vision, parts.adapters
    kwargs["fuse_prefill"] = parts.fused_prefill
    kwargs["grouping"] = grouped if parts.group_rows else None
    model, speculation = parts.loaded.model, parts.speculation
    if speculation is None or not speculate:
        return BatchRunner(model, **kwargs)
    return SpeculativeRunner(
        model,
        source=speculation.source(),
        speculation=speculation.config,
        counters=counters,
        **kwargs,
    )


def warm_up(
    runner: BatchRunner, token: int, new_row: Callable[[], list[Any]] | None = None
) -> None:
    """One short request through the whole path, so the first real one pays no JIT."""
    caches = [new_row()] if new_row is not None else None
    (uid,) = runner.insert([[token] * 4], max_tokens=[2], caches=caches)
    for _ in range(16):
        _, responses = runner.next()
        if any(r.uid == uid and r.finish_reason for r in responses):
            return
    runner.remove([uid])
