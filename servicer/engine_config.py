"""The engine's settings: plain data that crosses to the engine process (no MLX here)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .faults import FaultPlan

DEFAULT_PREFILL_STEP = 2048  # prompt tokens per row a prefill step takes at most (a full chunk)
KV_BITS = (2, 3, 4, 5, 6, 8)  # what mx.quantize takes, and so what --kv-bits accepts
KV_GROUP_SIZES = (32, 64, 128)  # likewise for its group size, and --kv-group-size


@dataclass(frozen=True, slots=True)
class SpeculationConfig:
    """How a speculating generation batch drafts and verifies."""

    k_max: int = 4  # most draft tokens a row verifies in one step
    # With more rows than this in the batch a step runs without drafts: every row goes
    # through the verify forward (K+1 tokens each), which stops paying once that forward is
    # compute-bound. `make bench` part "speculation", MLX on a 2-core CPU with OpenBLAS: a
    # copying model (acceptance ~1) gains 1.9x at 2 rows and 1.3-1.5x at 4, loses at 8
    # (0.78x); a 0.75-acceptance draft model 1.1-1.4x at 4, 0.82-0.98x at 8. Below the cap
    # each step is costed (`StepClock`). GPUs stay memory-bound to larger batches: measure.
    max_rows: int = 4
    ewma: float = 0.3  # weight of the newest step in a row's acceptance estimate
    off_below: float = 0.15  # a row whose acceptance falls below this stops drafting...
    probe_every: int = 8  # ...and drafts again every this many steps to re-measure
    probe_k: int = 2  # draft tokens of such a probe
    costed: bool = True  # below max_rows, draft only where the clocks say it pays
    mode_window: int = 8  # steps per measurement of drafting against not (ModeClock)
    mode_gap: int = 4  # windows of the better mode before the other is re-measured, once it won

    def __post_init__(self) -> None:
        if self.k_max < 0 or self.max_rows < 0 or self.probe_every < 1:
            raise ValueError("k_max and max_rows must be >= 0, probe_every >= 1")
        if self.mode_window < 1 or self.mode_gap < 1:
            raise ValueError("mode_window and mode_gap must be >= 1")
        if not 0.0 < self.ewma <= 1.0:
            raise ValueError("ewma must be in (0, 1]")


@dataclass(frozen=True)
class EngineConfig:
    adapter_path: str | None = None  # one adapter merged into the model at load (mlx-lm's)
    # Adapters served side by side on the base model, rows of each in one batch: (name, path).
    adapters: tuple[tuple[str, str], ...] = ()
    completion_batch_size: int = 32
    prefill_batch_size: int = 8
    prefill_step_size: int = DEFAULT_PREFILL_STEP
    # While rows decode, a step prefills only what fits this stall (0: full chunks always),
    # widened up to this factor while prompts queue up (1: never).
    max_prefill_stall_ms: float = 50.0
    max_prefill_stall_widen: float = 4.0
    # A prompt's prefill chunk goes through the decoding rows' forward (one weight read for
    # both) where the model's attention is a standard one (servicer/engine/fused_prefill.py).
    # Off by default: on this project's CPU it gained nothing end to end on the real models
    # and made the demo's steps slower (bench/RESULTS.md, "Fused prefill").
    fuse_prefill: bool = False
    # Decoding rows of very different lengths attend in groups instead of one rectangle padded
    # to the longest row, where the model's attention is a standard one (engine/row_groups.py).
    group_rows: bool = True
    # A burst that is still arriving while nothing generates is admitted together: an idle
    # engine waits for as many requests as ended with the step that emptied its batch (their
    # clients come back together; a prefill batch at first), while they keep coming
    # `coalesce_quiet_s` apart, at most `coalesce_max_s`; a lone request after a lone one
    # starts at once.
    coalesce_quiet_s: float = 0.002
    coalesce_max_s: float = 0.010
    warmup: bool = True
    # Prompt-prefix reuse: blocks kept in RAM, and their bytes (None: a quarter of
    # max_kv_memory, at most 1 GiB). 0 blocks turns it off.
    prompt_cache_size: int = 65536
    prompt_cache_bytes: int | None = None
    prompt_cache_block: int = 256  # tokens per block
    # Tokens between snapshots of recurrent and sliding-window state (None: chosen from the
    # model so that they take at most about a quarter of a prompt's KV bytes).
    prompt_cache_snapshot_interval: int | None = None
    prompt_cache_dir: str | None = None  # the disk tier's directory (None: no disk tier)
    prompt_cache_disk_bytes: int = 32 << 30
    # Several workers share `prompt_cache_dir`: each writes its blocks through to it and finds
    # the others' there by name.
    prompt_cache_shared: bool = False
    # KV and recurrent state the running requests may reserve (None: half the device's
    # memory less the weights). A request that cannot fit alone is refused; one that cannot
    # fit beside the others waits.
    max_kv_memory: int | None = None
    # The attention layers' KV cache quantized to this many bits (None: the model's dtype), in
    # groups of `kv_group_size` values along each token's vector.
    kv_bits: int | None = None
    kv_group_size: int | None = None  # None: the largest of 64 and 32 that fits the model
    # Speculative decoding: "ngram" (prompt lookup, the default), "draft" (with `draft_model`,
    # a path or demo:KIND), or None (off), drafting and verifying as `speculation` says
    # (--speculate-k is its `k_max`, --speculate-max-batch its `max_rows`). Off where the
    # model's caches cannot roll back, and with --distributed (one model over several
    # processes).
    speculate: str | None = "ngram"
    draft_model: str | None = None
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)
    # The engine's own random stream for unseeded sampling (None: a fresh random seed).
    sampling_seed: int | None = None
    # A step (with its plan and hand-off) running longer than max(this, 8x the longest step
    # so far) is a stall: the worker fails every request and exits (0: no watchdog).
    step_timeout_s: float = 120.0
    # A vision model's image features kept by image key, for an image seen again (bytes).
    encoder_cache_bytes: int = 256 << 20
    faults: FaultPlan | None = None  # testing only

    @property
    def block_size(self) -> int:
        """Tokens per block of the prefix store (0: no prefix reuse), as the handlers name a
        prompt's blocks and report them in KV events; the engine's store follows the same
        settings."""
        return self.prompt_cache_block if self.prompt_cache_size > 0 else 0
