"""Everything an engine builds from its model before it can step: the weights, sampling,
the admission guard's limits, the prefix cache and the BatchGenerator (engine thread only)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import BatchGenerator

from ..admission import Admission, MemoryModel
from ..engine_config import EngineConfig
from ..messages import ModelInfo
from .constraints import GrammarFactory
from .memory import device_memory_bytes, measure, weights_bytes
from .model import LoadedModel, load_model, log_blas_hint
from .prefix.disk_tier import DiskTier, model_identity
from .prefix.store import CacheLayout, PrefixStore
from .sampling import SamplingFactory


@dataclass
class EngineParts:
    """What the engine steps with, built once on its thread."""

    loaded: LoadedModel
    sampling: SamplingFactory
    admission: Admission
    prefix: PrefixStore | None
    has_thinking: bool


def build_parts(config: EngineConfig, info: ModelInfo) -> EngineParts:
    """Load the model `info` describes and build everything around it."""
    lockstep = config.lockstep
    log_blas_hint()
    if config.faults is not None:
        config.faults.before_load()
    group = lockstep.group if lockstep is not None else None
    loaded = load_model(Path(info.model_dir), config.adapter_path, group)
    seed = config.sampling_seed
    if seed is None:
        seed = int.from_bytes(os.urandom(4), "little")
    if lockstep is not None:
        seed = lockstep.shared_seed(seed)
    tokenizer = loaded.tokenizer
    eos = info.eos_token_ids[0] if info.eos_token_ids else 0
    sampling = SamplingFactory(
        info.vocab_size,
        GrammarFactory(tokenizer._tokenizer, info.vocab_size, eos),
        seed,
        think_start=tokenizer.think_start_tokens,
        think_end=tokenizer.think_end_tokens,
    )
    admission = _admission(config, loaded)
    return EngineParts(
        loaded,
        sampling,
        admission,
        _prefix_store(config, admission, loaded, info),
        bool(tokenizer.think_start_tokens and tokenizer.think_end_tokens),
    )


def _admission(config: EngineConfig, loaded: LoadedModel) -> Admission:
    limit = config.max_kv_memory
    if limit is None:
        limit = max(device_memory_bytes() // 2 - weights_bytes(loaded.model), 64 << 20)
    return Admission(measure(loaded.model), limit)


def _prefix_store(
    config: EngineConfig, admission: Admission, loaded: LoadedModel, info: ModelInfo
) -> PrefixStore | None:
    if config.prompt_cache_size <= 0:
        return None
    max_bytes = config.prompt_cache_bytes
    shared = config.lockstep is not None
    if max_bytes is None:
        # Ranks must evict alike, so a distributed engine does not size it per machine.
        max_bytes = 1 << 30 if shared else min(admission.limit_bytes // 4, 1 << 30)
    layout = CacheLayout.of(loaded.model)
    block = config.prompt_cache_block
    interval = config.prompt_cache_snapshot_interval
    if interval is None:
        interval = snapshot_interval(admission.memory, block)
    disk = None
    if config.prompt_cache_dir is not None and not shared:  # ranks cannot share disk timing
        model_dir = Path(info.model_dir)
        model_id = model_identity(model_dir, config.adapter_path, block, layout.classes)
        disk = DiskTier(
            Path(config.prompt_cache_dir),
            model_id,
            config.prompt_cache_disk_bytes,
            faults=config.faults,
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


def new_generator(model: nn.Module, config: EngineConfig, stream: mx.Stream) -> BatchGenerator:
    """The engine's BatchGenerator (the raw-engine bench builds its reference with this too)."""
    return BatchGenerator(
        model,
        completion_batch_size=config.completion_batch_size,
        prefill_batch_size=config.prefill_batch_size,
        prefill_step_size=config.prefill_step_size,
        stream=stream,
    )


def warm_up(generator: BatchGenerator, token: int) -> None:
    """One short request through the whole path, so the first real one pays no JIT."""
    (uid,) = generator.insert([[token] * 4], max_tokens=[2])
    for _ in range(16):
        _, responses = generator.next()
        if any(r.uid == uid and r.finish_reason for r in responses):
            return
    generator.remove([uid])
