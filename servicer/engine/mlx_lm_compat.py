"""Every place the worker reaches into mlx-lm beyond its public API, in one list.

The batch, its prefill and its decode step are the engine's own (runner, prompt_batch,
decode_batch); from mlx-lm it takes models, loading, cache classes, samplers and tokenizers.
Beyond their public API it touches mlx-lm in six kinds of way (`Kind`), each touch point
listed in `TOUCH_POINTS` with where servicer/ uses it and what for:

- attributes of mlx-lm objects that are not its API: the batched caches' write position
  (`_idx`), a recurrent cache's per-row `lengths`, the Hugging Face tokenizer inside
  `TokenizerWrapper`, phi3small's `block_sparse` switch;
- a private method overridden and called (minimax_m3_vl's `_block_mask`);
- mlx-lm cache classes our caches derive from (`_BaseCache`, `ArraysCache`,
  `QuantizedKVCache`);
- class swaps: a loaded model's modules given a subclass of their class that adds our fix
  (arch_fixes, fused_prefill);
- copied forwards: each mlx-lm method a class swap overrides, reproduced or rewritten in
  ours; its upstream source is pinned by hash (`source_sha`), so an mlx-lm whose function
  changed fails one named test and our copy gets read against the new code;
- text the engine looks for in a model module's source (speculation.support).

tests/test_mlx_lm_compat.py tests each one's behaviour in the installed mlx-lm (one test id
per touch point), and scans servicer/ for private names of mlx-lm, class swaps and mlx-lm
base classes that this list lacks. `missing_touch_points` checks the ones speculation's
caches need (`gates`) at start: an mlx-lm that moved one turns speculation and fused prefill
off with a clear log line (`parts`), not a failed run.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
from dataclasses import dataclass
from enum import Enum
from functools import cache
from typing import Any


class Kind(Enum):
    ATTRIBUTE = "attribute"  # read or set on an mlx-lm object, not its API
    PRIVATE_METHOD = "private-method"  # a private method overridden and called
    BASE_CLASS = "base-class"  # an mlx-lm class ours derives from
    CLASS_SWAP = "class-swap"  # `module.__class__ = ...` on a loaded model's modules
    COPIED_FORWARD = "copied-forward"  # an mlx-lm method ours reproduces or rewrites
    SOURCE_TEXT = "source-text"  # text looked for in mlx-lm's source


@dataclass(frozen=True)
class TouchPoint:
    kind: Kind
    # What of mlx-lm: "module:Qualname" (a class, or Class.attribute); for SOURCE_TEXT
    # "package:text".
    upstream: str
    used_in: tuple[str, ...]  # "servicer path:where" for each place that uses it
    purpose: str
    ours: str = ""  # CLASS_SWAP, COPIED_FORWARD: our class or function, "module:Qualname"
    overrides: tuple[str, ...] = ()  # CLASS_SWAP: the target's methods the fix replaces
    reads: tuple[str, ...] = ()  # CLASS_SWAP: attributes the fix reads (besides its annotations)
    source_sha: str = ""  # COPIED_FORWARD: `source_hash` of the upstream function we copied
    gates: bool = False  # its absence turns speculation (and fused prefill) off at start

    @property
    def name(self) -> str:
        """A stable id: "kind:upstream"."""
        return f"{self.kind.value}:{self.upstream}"

    @property
    def attribute(self) -> str:
        """The last name of `upstream` (what servicer/ spells at the touch point)."""
        return self.upstream.split(":", 1)[1].rsplit(".", 1)[-1]


def resolve(path: str) -> Any:
    """The object at "module:Qualname"."""
    module, _, qualname = path.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split(".") if qualname else ():
        obj = getattr(obj, part)
    return obj


def source_hash(path: str) -> str:
    """The first 16 hex digits of the sha256 of `inspect.getsource` of "module:Qualname"."""
    return hashlib.sha256(inspect.getsource(resolve(path)).encode()).hexdigest()[:16]


_CACHE = "mlx_lm.models.cache"
_ARCH = "servicer/engine/arch_fixes.py"
_FUSED = "servicer/engine/fused_prefill.py"
_SPEC_CACHES = "servicer/engine/speculation/caches.py"


def _swap(model: str, target: str, fix: str, overrides: str, where: str, **kw: Any) -> TouchPoint:
    return TouchPoint(
        Kind.CLASS_SWAP,
        f"mlx_lm.models.{model}:{target}",
        (f"{_ARCH}:{where}", f"{_ARCH}:_swap_class"),
        kw.pop("purpose", f"{model} in a batch (arch_fixes.{fix})"),
        ours=f"servicer.engine.arch_fixes:{fix}",
        overrides=(overrides,),
        **kw,
    )


def _copied(model: str, function: str, ours: str, sha: str, purpose: str) -> TouchPoint:
    module = "fused_prefill" if ours.startswith("PackedAttention") else "arch_fixes"
    path = _FUSED if module == "fused_prefill" else _ARCH
    return TouchPoint(
        Kind.COPIED_FORWARD,
        f"mlx_lm.models.{model}:{function}",
        (f"{path}:{ours}",),
        purpose,
        ours=f"servicer.engine.{module}:{ours}",
        source_sha=sha,
    )


_PACKED_READS = ("q_proj", "k_proj", "v_proj", "o_proj", "n_heads", "n_kv_heads", "rope", "scale")


def _packed(model: str) -> TouchPoint:
    return TouchPoint(
        Kind.CLASS_SWAP,
        f"mlx_lm.models.{model}:Attention",
        (f"{_FUSED}:enable_fused_prefill",),
        "fused prefill and row groups: the attention takes a packed or grouped forward",
        ours="servicer.engine.fused_prefill:PackedAttention",
        overrides=("__call__",),
        reads=_PACKED_READS,
    )


TOUCH_POINTS: tuple[TouchPoint, ...] = (
    # ----- attributes
    TouchPoint(
        Kind.ATTRIBUTE,
        f"{_CACHE}:BatchKVCache._idx",
        (f"{_SPEC_CACHES}:RaggedKVCache.adopt",),
        "read: the batch's one write position, where every row ends (rows right-aligned at "
        "it, row b from left_padding[b]): a rolling-back cache takes the rows over as they are",
        gates=True,
    ),
    TouchPoint(
        Kind.ATTRIBUTE,
        f"{_CACHE}:RotatingKVCache._idx",
        (f"{_SPEC_CACHES}:RingKVCache.extract",),
        "set: a row given back as a rotating cache holding its last tokens in order has its "
        "write position just past them",
        gates=True,
    ),
    TouchPoint(
        Kind.ATTRIBUTE,
        f"{_CACHE}:ArraysCache.lengths",
        (
            f"{_SPEC_CACHES}:RecurrentCache.adopt",
            f"{_SPEC_CACHES}:RecurrentCache.checkpoint",
            f"{_SPEC_CACHES}:RecurrentCache.rollback",
        ),
        "read and set: per-row lengths that keep a verify's right padding out of the "
        "recurrent state (where the model honours them)",
        gates=True,
    ),
    TouchPoint(
        Kind.ATTRIBUTE,
        "mlx_lm.tokenizer_utils:TokenizerWrapper._tokenizer",
        ("servicer/engine/parts.py:build_parts", "servicer/engine/parts.py:special_tokens"),
        "the Hugging Face tokenizer inside mlx-lm's wrapper: llguidance's tokenizer for "
        "grammars (and the engine's stop-string text), the added tokens' special flags",
    ),
    TouchPoint(
        Kind.ATTRIBUTE,
        "mlx_lm.models.phi3small:Attention.block_sparse",
        (f"{_ARCH}:_phi3small",),
        "set False: the layers' own block-sparse path off; BlockSparseRowMasks's mask "
        "carries the sparsity",
    ),
    # ----- private methods
    TouchPoint(
        Kind.PRIVATE_METHOD,
        "mlx_lm.models.minimax_m3_vl:Attention._block_mask",
        (f"{_ARCH}:RowBlocks._block_mask",),
        "overridden (RowBlocks cuts key blocks at each row's positions) and called through "
        "super() for one sequence; Attention.__call__ calls it as (x, mask, offset, cache)",
    ),
    # ----- base classes
    TouchPoint(
        Kind.BASE_CLASS,
        f"{_CACHE}:_BaseCache",
        (
            "servicer/engine/quantized_kv.py:BatchQuantizedKVCache",
            f"{_SPEC_CACHES}:RaggedKVCache",
            f"{_SPEC_CACHES}:RingKVCache",
        ),
        "the cache protocol's base: our batched caches take its from_state",
    ),
    TouchPoint(
        Kind.BASE_CLASS,
        f"{_CACHE}:ArraysCache",
        (f"{_SPEC_CACHES}:RecurrentCache",),
        "recurrent state that rolls back: takes __init__, advance, filter, extend, prepare, "
        "finalize, make_mask, merge and state from it",
    ),
    TouchPoint(
        Kind.BASE_CLASS,
        f"{_CACHE}:QuantizedKVCache",
        ("servicer/engine/quantized_kv.py:QuantizedRowCache",),
        "one sequence's quantized KV (--kv-bits): takes __init__, step, keys_and_values, "
        "trim, make_mask, empty and is_trimmable from it",
    ),
    # ----- class swaps
    _swap("gemma2", "Attention", "GroupedScoresMask", "__call__", "_gemma2"),
    _swap("gpt_bigcode", "GPTBigCodeModel", "RowPositions", "__call__", "_gpt_bigcode"),
    _swap("afm7", "AFMModel", "RowQueryPositions", "__call__", "_afm7"),
    _swap("llama4", "Model", "WholeHistoryCaches", "make_cache", "_llama4"),
    _swap("llama4", "LlamaModel", "ChunkedRowMasks", "__call__", "_llama4"),
    _swap("llama4", "Attention", "RowTemperature", "__call__", "_llama4"),
    _swap("plamo3", "Model", "WindowPlusOneCaches", "make_cache", "_plamo3"),
    _swap("nemotron-nas", "Model", "AttentionLayerCaches", "make_cache", "_nemotron_nas"),
    _swap("nemotron-nas", "NemotronNASModel", "AttentionCachesOnly", "__call__", "_nemotron_nas"),
    _swap("phi3small", "Phi3Model", "BlockSparseRowMasks", "__call__", "_phi3small"),
    _swap("minimax_m3_vl", "Attention", "RowBlocks", "_block_mask", "_minimax_m3_vl"),
    *(
        TouchPoint(
            Kind.CLASS_SWAP,
            f"mlx_lm.models.{model}:{layer}",
            ("servicer/engine/vision.py:enable_deepstack",),
            "Qwen3-VL's deepstack: the first text layers add the tower's features of theirs "
            "to their output (a wrapper around the layer's own __call__, which it calls)",
            ours="servicer.engine.vision:_DeepstackLayer",
        )
        for model, layer in (("qwen3", "TransformerBlock"), ("qwen3_moe", "Qwen3MoeDecoderLayer"))
    ),
    *(_packed(model) for model in ("gemma3_text", "llama", "qwen2", "qwen3")),
    # ----- copied forwards: each method a class swap overrides
    _copied(
        "gemma2",
        "Attention.__call__",
        "GroupedScoresMask.__call__",
        "a62901768129867d",
        "wrapped: the batch's mask widened to the grouped scores this forward computes",
    ),
    _copied(
        "gpt_bigcode",
        "GPTBigCodeModel.__call__",
        "RowPositions.__call__",
        "43b201ccc3b015e8",
        "copied: learned positions read per row",
    ),
    _copied(
        "afm7",
        "AFMModel.__call__",
        "RowQueryPositions.__call__",
        "0cf0887072171086",
        "copied: the KV-reuse layers' queries at per-row positions",
    ),
    _copied(
        "afm7",
        "KVReuseTransformerBlock.__call__",
        "_kv_reuse_block",
        "3e8ad4e8962a7d01",
        "copied: the KV-reuse block with its queries at per-row positions",
    ),
    _copied(
        "afm7",
        "KVReuseAttention.__call__",
        "_kv_reuse_block",
        "eea23b69f1c1f9d8",
        "copied: the KV-reuse attention inside `_kv_reuse_block`",
    ),
    _copied(
        "llama4",
        "Model.make_cache",
        "WholeHistoryCaches.make_cache",
        "de2f60f45cf75484",
        "rewritten: plain KV caches for the chunked layers (ChunkedKVCache has no batch form)",
    ),
    _copied(
        "llama4",
        "LlamaModel.__call__",
        "ChunkedRowMasks.__call__",
        "926a6d9aee1d827c",
        "copied: the chunked layers' mask from per-row positions",
    ),
    _copied(
        "llama4",
        "Attention.__call__",
        "RowTemperature.__call__",
        "5024f14894fc35d2",
        "copied: temperature tuning from per-row positions",
    ),
    _copied(
        "plamo3",
        "Model.make_cache",
        "WindowPlusOneCaches.make_cache",
        "6170e98810aaa0ac",
        "wrapped: the sliding layers' windows one slot wider than mlx-lm 0.32 makes them",
    ),
    _copied(
        "nemotron-nas",
        "Model.make_cache",
        "AttentionLayerCaches.make_cache",
        "bb9dd04a3357328e",
        "rewritten: caches for the layers with real attention only",
    ),
    _copied(
        "nemotron-nas",
        "NemotronNASModel.__call__",
        "AttentionCachesOnly.__call__",
        "e743ac003d6142aa",
        "copied: each layer with real attention takes the next cache",
    ),
    _copied(
        "phi3small",
        "Phi3Model.__call__",
        "BlockSparseRowMasks.__call__",
        "b87d30cd040aaab7",
        "copied: one block-sparse mask a forward, from per-row positions",
    ),
    _copied(
        "minimax_m3_vl",
        "Attention._block_mask",
        "RowBlocks._block_mask",
        "6a1b3e739338c3fd",
        "copied: the indexer's key blocks cut at each row's positions",
    ),
    *(
        _copied(
            model,
            "Attention.__call__",
            "PackedAttention._segment",
            sha,
            "reproduced: the standard attention after its projections, per segment / row group",
        )
        for model, sha in (
            ("gemma3_text", "a293df9f54178d8a"),
            ("llama", "3b9b8774b647f7a4"),
            ("qwen2", "0d02f6cbda3a89f1"),
            ("qwen3", "789af9d8868081c1"),
        )
    ),
    # ----- source text
    TouchPoint(
        Kind.SOURCE_TEXT,
        "mlx_lm.models:cache.lengths",
        ("servicer/engine/speculation/support.py:padding_inert",),
        "a model module that says it reads per-row lengths honours them: right padding in a "
        "verify leaves a row's recurrent state alone",
    ),
    TouchPoint(
        Kind.SOURCE_TEXT,
        "mlx_lm.models:.keys_and_values(",
        ("servicer/engine/speculation/support.py:speculation_supported",),
        "a model module that says it reads another layer's KV (KV sharing): speculation off",
    ),
)


@cache
def _source(cls: type) -> str:
    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):
        return ""


def present(point: TouchPoint) -> bool:
    """Whether the installed mlx-lm still has what `point` names (its class, attribute or
    function; for an instance attribute, an assignment to it in the class's source)."""
    if point.kind is Kind.SOURCE_TEXT:
        return True
    module, _, qualname = point.upstream.partition(":")
    head, _, name = qualname.rpartition(".")
    try:
        owner = resolve(f"{module}:{head}")
    except (ImportError, AttributeError):
        return False
    if hasattr(owner, name):
        return True
    classes = owner.__mro__ if inspect.isclass(owner) else ()
    return any(f"self.{name} =" in _source(k) for k in classes if k is not object)


def missing_touch_points() -> list[str]:
    """The touch points speculation's caches need (`gates`) that the installed mlx-lm no
    longer has, as "Class.attribute"."""
    return [p.upstream.split(":", 1)[1] for p in TOUCH_POINTS if p.gates and not present(p)]
