"""What servicer/ takes from mlx-lm beyond its public API (servicer/engine/mlx_lm_compat.py).

One test per touch point checks its behaviour in the installed mlx-lm (what our code
assumes of it, not only that the name is there): an mlx-lm upgrade that changes one fails
that test, by name. The scan tests read servicer/ with `ast` and fail on a private name of
mlx-lm, a class swap or an mlx-lm base class that the list lacks."""

from __future__ import annotations

import ast
import importlib
import inspect
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.models import cache as mlx_cache

import servicer
from servicer.engine import mlx_lm_compat
from servicer.engine.mlx_lm_compat import (
    TOUCH_POINTS,
    Kind,
    TouchPoint,
    missing_touch_points,
    resolve,
    source_hash,
)

ROOT = Path(servicer.__file__).resolve().parent.parent
CONFIGS = ROOT / "bench" / "families" / "configs"
BY_NAME = {p.name: p for p in TOUCH_POINTS}


def _ids(kind: Kind) -> list[TouchPoint]:
    return [p for p in TOUCH_POINTS if p.kind is kind]


def _param(kind: Kind):
    points = _ids(kind)
    return pytest.mark.parametrize("point", points, ids=[p.name for p in points])


def test_the_list_names_each_touch_point_once():
    assert len(BY_NAME) == len(TOUCH_POINTS)


# ----------------------------------------------------------------- start-up gate


def test_the_touch_points_speculation_needs_are_all_there():
    assert missing_touch_points() == []


def test_a_moved_touch_point_is_named(monkeypatch):
    gone = TouchPoint(
        Kind.ATTRIBUTE, f"{mlx_cache.__name__}:KVCache._gone_in_a_later_mlx_lm", (), "", gates=True
    )
    monkeypatch.setattr(mlx_lm_compat, "TOUCH_POINTS", (*TOUCH_POINTS, gone))
    assert missing_touch_points() == ["KVCache._gone_in_a_later_mlx_lm"]


# ----------------------------------------------------------------- attributes


def _kv(n: int, start: int = 0, heads: int = 2, dim: int = 4) -> mx.array:
    """(1, heads, n, dim) keys whose every entry is its token's position."""
    positions = mx.arange(start, start + n, dtype=mx.float32)
    return mx.broadcast_to(positions[None, None, :, None], (1, heads, n, dim))


def _batch_kv_idx() -> None:
    """`_idx` is the write position: every row ends at it, row b from left_padding[b]
    (RaggedKVCache.adopt takes [left_padding[b], _idx) as row b)."""
    rows = []
    for n in (2, 5):
        row = mlx_cache.KVCache()
        row.update_and_fetch(_kv(n), _kv(n))
        rows.append(row)
    batch = mlx_cache.BatchKVCache.merge(rows)
    assert batch._idx == 5
    batch.update_and_fetch(mx.concatenate([_kv(3, 2), _kv(3, 5)]), mx.zeros((2, 2, 3, 4)))
    assert batch._idx == 8  # advanced by the tokens written
    keys, _ = batch.keys_and_values()
    assert keys.shape[2] == batch._idx  # the written ones end there
    padding = batch.left_padding.tolist()
    assert padding == [3, 0]
    assert keys[0, 0, padding[0] : batch._idx, 0].tolist() == [0, 1, 2, 3, 4]
    assert keys[1, 0, padding[1] : batch._idx, 0].tolist() == list(range(8))
    batch.filter(mx.array([0]))  # a row leaves: the shared padding is cut, `_idx` with it
    assert batch._idx - batch.left_padding.item() == 5
    assert batch.offset.tolist() == [5]


def _rotating_idx() -> None:
    """A rotating cache holding its last `held` tokens in order, `_idx = held` and `offset`
    its position (RingKVCache.extract builds one so) goes on as one that saw every token."""
    window = 4
    grown = mlx_cache.RotatingKVCache(window)
    for p in range(6):
        grown.update_and_fetch(_kv(1, p), _kv(1, p))
    built = mlx_cache.RotatingKVCache(window)
    built.keys, built.values = _kv(window, 2), _kv(window, 2)
    built._idx = window
    built.offset = 6

    def visible(cache: mlx_cache.RotatingKVCache, keys: mx.array, n: int) -> list[list[int]]:
        mask = cache.make_mask(n, window_size=window, return_array=True)
        positions = keys[0, 0, :, 0].astype(mx.int32).tolist()
        if mask is None:
            return [sorted(positions)] * n
        mask = mx.broadcast_to(mask, (n, len(positions))).tolist()
        return [sorted(p for p, m in zip(positions, row, strict=True) if m) for row in mask]

    for step, n in ((6, 1), (7, 3), (10, 1)):  # a decode step, a chunk, a decode step
        seen = []
        for rotating in (grown, built):
            keys, _ = rotating.update_and_fetch(_kv(n, step), _kv(n, step))
            seen.append(visible(rotating, keys, n) if n == 1 else keys[0, 0, :, 0].tolist())
        assert seen[0] == seen[1], (step, n, seen)  # the same tokens (ring slots may differ)
        assert grown.offset == built.offset


def _arrays_lengths() -> None:
    """Per-row `lengths` mask each row's right padding (`make_mask`), count down as a
    forward advances, and follow the rows through filter and extend."""
    cache = mlx_cache.ArraysCache(1)
    cache.lengths = mx.array([2, 3])
    assert cache.make_mask(4).tolist() == [
        [True, True, False, False],
        [True, True, True, False],
    ]
    cache.advance(2)
    assert cache.lengths.tolist() == [0, 1]
    cache.cache = [mx.zeros((2, 3))]
    cache.filter(mx.array([1]))
    assert cache.lengths.tolist() == [1]
    other = mlx_cache.ArraysCache(1)
    other.cache, other.lengths = [mx.zeros((1, 3))], mx.array([4])
    cache.extend(other)
    assert cache.lengths.tolist() == [1, 4]
    assert cache.state[2] is cache.lengths  # saved and restored with the state
    cache.finalize()
    assert cache.lengths is None and cache.make_mask(2) is None


def _hf_tokenizer():
    from tokenizers import Tokenizer, models
    from transformers import AddedToken, PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "a": 1, "b": 2}
    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, "<unk>")))
    hf.add_special_tokens({"additional_special_tokens": [AddedToken("<|end|>", special=True)]})
    return hf


def _tokenizer_wrapper() -> None:
    """The wrapper's `_tokenizer` is the Hugging Face tokenizer it was made from, with the
    added tokens' special flags (parts.special_tokens) and what llguidance reads."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from transformers import PreTrainedTokenizerBase

    hf = _hf_tokenizer()
    wrapper = TokenizerWrapper(hf)
    assert wrapper._tokenizer is hf
    assert isinstance(wrapper._tokenizer, PreTrainedTokenizerBase)
    special = {t.content for t in wrapper._tokenizer.added_tokens_decoder.values() if t.special}
    assert special == {"<|end|>"}


@cache
def _build(arch: str):
    from mlx_lm.utils import _get_classes

    config = json.loads((CONFIGS / f"{arch}.json").read_text())
    config.pop("families", None)
    model_class, args_class = _get_classes(config)
    mx.random.seed(0)
    model = model_class(args_class.from_dict(config))
    model.set_dtype(mx.float32)
    return model


def _phi3small_block_sparse(monkeypatch: pytest.MonkeyPatch) -> None:
    """`block_sparse = False` sends a layer down its dense path (arch_fixes._phi3small)."""
    from mlx_lm.models import phi3small

    def no(*args, **kwargs):
        raise AssertionError("the block-sparse path ran")

    monkeypatch.setattr(phi3small.Attention, "_block_sparse_attention", no)
    model = _build("phi3small")
    sparse = [layer.self_attn for layer in model.model.layers if layer.self_attn.block_sparse]
    assert sparse, "no block-sparse layer in the config"
    with pytest.raises(AssertionError, match="block-sparse path"):
        model(mx.array([[1, 2, 3]]))
    for attention in sparse:
        attention.block_sparse = False
    mx.eval(model(mx.array([[1, 2, 3]])))


ATTRIBUTES: dict[str, Callable[..., None]] = {
    "attribute:mlx_lm.models.cache:BatchKVCache._idx": _batch_kv_idx,
    "attribute:mlx_lm.models.cache:RotatingKVCache._idx": _rotating_idx,
    "attribute:mlx_lm.models.cache:ArraysCache.lengths": _arrays_lengths,
    "attribute:mlx_lm.tokenizer_utils:TokenizerWrapper._tokenizer": _tokenizer_wrapper,
    "attribute:mlx_lm.models.phi3small:Attention.block_sparse": _phi3small_block_sparse,
}


@_param(Kind.ATTRIBUTE)
def test_attribute_behaves_as_used(point: TouchPoint, monkeypatch):
    check = ATTRIBUTES[point.name]
    check(monkeypatch) if "monkeypatch" in inspect.signature(check).parameters else check()


# ----------------------------------------------------------------- private methods


def _block_mask() -> None:
    """minimax_m3_vl's Attention calls `self._block_mask(x, mask, offset, cache)` and uses
    what it gives as the mask (RowBlocks overrides it with that signature)."""
    from mlx_lm.models.minimax_m3_vl import Attention

    from servicer.engine.arch_fixes import RowBlocks

    ours = list(inspect.signature(RowBlocks._block_mask).parameters)
    assert list(inspect.signature(Attention._block_mask).parameters) == ours
    calls = [
        node
        for node in ast.walk(ast.parse(inspect.getsource(Attention.__call__).strip()))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "_block_mask"
    ]
    assert len(calls) == 1 and len(calls[0].args) == len(ours) - 1


PRIVATE_METHODS = {"private-method:mlx_lm.models.minimax_m3_vl:Attention._block_mask": _block_mask}


@_param(Kind.PRIVATE_METHOD)
def test_private_method_behaves_as_used(point: TouchPoint):
    PRIVATE_METHODS[point.name]()


# ----------------------------------------------------------------- base classes


def _class_of(where: str) -> type:
    path, _, qualname = where.partition(":")
    module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
    return resolve(f"{module.__name__}:{qualname}")


def _inherited(cls: type, base: type) -> set[str]:
    """The names `cls` takes from `base` (or the mlx-lm classes above it) unchanged."""
    taken = set()
    for name in dir(cls):
        if name.startswith("__"):
            continue
        owner = next(k for k in cls.__mro__ if name in vars(k))
        if owner in base.__mro__ and owner.__module__.startswith("mlx_lm"):
            taken.add(name)
    return taken


def _base_cache() -> None:
    from servicer.engine.quantized_kv import BatchQuantizedKVCache

    row = mlx_cache.KVCache()
    row.update_and_fetch(mx.ones((1, 2, 3, 64)), mx.ones((1, 2, 3, 64)))
    batch = BatchQuantizedKVCache.merge([row], bits=8, group_size=64)
    again = BatchQuantizedKVCache.from_state(batch.state)  # no __init__, the state set
    assert type(again) is BatchQuantizedKVCache
    assert again.size() == batch.size() == 3
    assert again.offset.tolist() == batch.offset.tolist()


def _arrays_cache() -> None:
    from servicer.engine.speculation.caches import RecurrentCache

    rows = []
    for value in (1.0, 2.0):
        row = mlx_cache.ArraysCache(2)
        row[0], row[1] = mx.full((1, 3), value), mx.zeros((1, 2))
        rows.append(row)
    batch = RecurrentCache.adopt(mlx_cache.ArraysCache.merge(rows), padding_inert=True)
    assert batch.batch_size == 2 and not batch.empty() and batch[1].shape == (2, 2)
    assert batch[0][:, 0].tolist() == [1.0, 2.0]
    batch.prepare(lengths=[1, 2])
    assert batch.make_mask(2).tolist() == [[True, False], [True, True]]
    batch.finalize()
    assert batch.lengths is None
    assert batch.nbytes == batch[0].nbytes + batch[1].nbytes
    assert batch.state[0] == batch.cache


def _quantized_kv_cache() -> None:
    from servicer.engine.quantized_kv import QuantizedRowCache

    cache = QuantizedRowCache(group_size=64, bits=8)
    assert cache.empty() and cache.offset == 0 and cache.step > 0
    cache.update_and_fetch(mx.ones((1, 2, 5, 64)), mx.ones((1, 2, 5, 64)))
    keys, _ = cache.keys_and_values()
    assert keys[0].shape[2] == 5  # the filled part of a larger buffer
    assert cache.is_trimmable() and cache.trim(2) == 2 and cache.offset == 3
    assert cache.keys_and_values()[0][0].shape[2] == 3
    # make_mask is taken but not relied on: a row cache goes through a forward merged into a
    # batch cache (mlx-lm 0.32.2's QuantizedKVCache.make_mask raises a TypeError).


BASE_CLASSES: dict[str, tuple[Callable[[], None], set[str]]] = {
    "base-class:mlx_lm.models.cache:_BaseCache": (_base_cache, {"from_state"}),
    "base-class:mlx_lm.models.cache:ArraysCache": (
        _arrays_cache,
        {
            "batch_size",
            "empty",
            "finalize",
            "from_state",
            "is_trimmable",
            "make_mask",
            "merge",
            "nbytes",
            "prepare",
            "size",
            "state",
        },
    ),
    "base-class:mlx_lm.models.cache:QuantizedKVCache": (
        _quantized_kv_cache,
        {"empty", "from_state", "is_trimmable", "keys_and_values", "make_mask", "step", "trim"},
    ),
}


@_param(Kind.BASE_CLASS)
def test_base_class_gives_what_ours_take(point: TouchPoint):
    """What our subclasses take from the base unchanged is what was reviewed (a new method
    of a later mlx-lm, inherited unseen, fails here), and behaves as they use it."""
    check, reviewed = BASE_CLASSES[point.name]
    base = resolve(point.upstream)
    taken = set().union(*(_inherited(_class_of(w), base) for w in point.used_in))
    assert taken == reviewed
    check()


# ----------------------------------------------------------------- class swaps


@cache
def _assigned(cls: type) -> frozenset[str]:
    """Names a class defines: in its namespace, or assigned on `self` in its source."""
    names = set(vars(cls)) | set(vars(cls).get("__annotations__", {}))
    try:
        tree = ast.parse(inspect.getsource(cls).strip())
    except (OSError, TypeError, SyntaxError):
        return frozenset(names)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
        ):
            names.add(node.attr)
    return frozenset(names)


@_param(Kind.CLASS_SWAP)
def test_class_swap_target_still_fits_the_fix(point: TouchPoint):
    """The target class still has each method the fix overrides, with the same parameters,
    each pinned by a copied-forward entry; it sets every attribute the fix reads; and it has
    none of the fix's own helpers (the swap would shadow them)."""
    target, fix = resolve(point.upstream), resolve(point.ours)
    upstream = [k for k in target.__mro__ if k.__module__.startswith("mlx_lm")]
    for name in point.overrides:
        assert callable(getattr(target, name, None)), f"{name} is gone"
        ours = inspect.signature(getattr(fix, name)).parameters
        theirs = inspect.signature(getattr(target, name)).parameters
        assert list(ours) == list(theirs), name
        pin = f"{Kind.COPIED_FORWARD.value}:{point.upstream}.{name}"
        assert pin in BY_NAME, f"{pin} is not in the list"
    reads = (*getattr(fix, "__annotations__", {}), *point.reads)
    unset = [n for n in reads if not any(n in _assigned(k) for k in upstream)]
    assert not unset, f"{point.upstream} no longer sets {unset}"
    helpers = [
        n
        for n, v in vars(fix).items()
        if callable(v) and not n.startswith("__") and n not in point.overrides
    ]
    clash = [n for n in helpers if hasattr(target, n)]
    assert not clash, f"{point.upstream} now has {clash} too"


# ----------------------------------------------------------------- copied forwards


@_param(Kind.COPIED_FORWARD)
def test_copied_forward_matches_its_upstream(point: TouchPoint):
    now = source_hash(point.upstream)
    assert now == point.source_sha, (
        f"mlx-lm's {point.upstream} changed since {point.ours} was written against it: read "
        f"ours against the new code, then set its source_sha to {now!r}"
    )
    resolve(point.ours)  # ours is still there


# ----------------------------------------------------------------- source text


def _model_of(module: str) -> object:
    importlib.import_module(f"mlx_lm.models.{module}")
    return type("Model", (), {"__module__": f"mlx_lm.models.{module}"})()


def _lengths_text() -> None:
    """The models that honour per-row lengths are found by the text; one without is not."""
    from servicer.engine.speculation.support import padding_inert

    for honours in ("qwen3_next", "mamba2"):
        assert padding_inert(_model_of(honours)), honours
    assert not padding_inert(_model_of("mamba"))
    assert not padding_inert(_model_of("llama"))


def _kv_sharing_text() -> None:
    """The KV-sharing models read other layers' KV through `keys_and_values()`."""
    from servicer.engine.speculation.support import _uses

    for sharing in ("afm7", "gemma3n"):
        assert _uses(_model_of(sharing), ".keys_and_values("), sharing
    assert not _uses(_model_of("llama"), ".keys_and_values(")


SOURCE_TEXTS = {
    "source-text:mlx_lm.models:cache.lengths": _lengths_text,
    "source-text:mlx_lm.models:.keys_and_values(": _kv_sharing_text,
}


@_param(Kind.SOURCE_TEXT)
def test_source_text_still_marks_the_models(point: TouchPoint):
    SOURCE_TEXTS[point.name]()


# ----------------------------------------------------------------- the list is complete


def _servicer_files() -> list[Path]:
    base = ROOT / "servicer"
    return sorted(p for p in base.rglob("*.py") if "proto" not in p.relative_to(base).parts)


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


@cache
def mlx_lm_private_names() -> frozenset[str]:
    """Every private name mlx-lm defines (functions, classes, attributes set on objects)."""
    names = set()
    for path in Path(mlx_lm.__file__).parent.rglob("*.py"):
        try:
            tree = ast.parse(path.read_text())
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return frozenset(n for n in names if _is_private(n))


@dataclass(frozen=True)
class Reach:
    path: str  # relative to the repository
    line: int
    name: str


def _defines(cls: type, name: str) -> bool:
    return name in _assigned(cls)


def _mlx_lm_defines(classes: tuple[type, ...], name: str) -> bool:
    return any(k.__module__.startswith("mlx_lm") and _defines(k, name) for k in classes)


def _runtime_class(path: str, qualname: list[str]) -> type | None:
    if not qualname or path.endswith("__main__.py"):
        return None
    try:
        module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
        return resolve(f"{module.__name__}:{'.'.join(qualname)}")
    except (ImportError, AttributeError):
        return None


def scan(path: str, source: str) -> list[Reach]:
    """The places in one file that reach into mlx-lm privately: `from mlx_lm... import _x`,
    and `obj._x` / `getattr(obj, "_x")` where `_x` is a private name of mlx-lm's and not
    ours at that place. Ours: on `self` / `cls` / `super()`, when no mlx-lm class in the
    class's MRO (past the class itself, for super()) defines it and one of ours does; on any
    other object, when a class of this file defines it and no mlx-lm class above that one
    does."""
    tree = ast.parse(source)
    private = mlx_lm_private_names()
    here: dict[str, type | None] = {}  # our classes of this file that define a name

    def ours_in_file(name: str) -> bool:
        if name not in here:
            here[name] = None
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    cls = _runtime_class(path, [node.name])
                    mine = cls is not None and _defines(cls, name)
                    if mine and not _mlx_lm_defines(cls.__mro__, name):
                        here[name] = cls
        return here[name] is not None

    reaches: list[Reach] = []

    def reach(node: ast.AST, name: str, owner: ast.expr | None, classes: list[str]) -> None:
        if not _is_private(name) or name not in private:
            return
        if owner is not None and classes:
            is_self = isinstance(owner, ast.Name) and owner.id in ("self", "cls")
            is_super = (
                isinstance(owner, ast.Call)
                and isinstance(owner.func, ast.Name)
                and owner.func.id == "super"
            )
            cls = _runtime_class(path, classes) if is_self or is_super else None
            if cls is not None:
                above = cls.__mro__[1:] if is_super else cls.__mro__
                mine = any(_defines(k, name) for k in above if k.__module__.startswith("servicer"))
                if mine and not _mlx_lm_defines(above, name):
                    return
                reaches.append(Reach(path, node.lineno, name))
                return
        if owner is not None and ours_in_file(name):
            return
        reaches.append(Reach(path, node.lineno, name))

    def visit(node: ast.AST, classes: list[str]) -> None:
        if isinstance(node, ast.ClassDef):
            classes = [*classes, node.name]
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mlx_lm"):
            for alias in node.names:
                if _is_private(alias.name):
                    reaches.append(Reach(path, node.lineno, alias.name))
        elif isinstance(node, ast.Attribute):
            reach(node, node.attr, node.value, classes)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            reach(node, node.args[1].value, node.args[0], classes)
        for child in ast.iter_child_nodes(node):
            visit(child, classes)

    visit(tree, [])
    return reaches


def _listed(path: str, name: str) -> bool:
    return any(
        p.attribute == name and any(u.partition(":")[0] == path for u in p.used_in)
        for p in TOUCH_POINTS
    )


def _all_files() -> Iterator[tuple[str, str]]:
    for file in _servicer_files():
        yield str(file.relative_to(ROOT)), file.read_text()


def test_every_private_reach_into_mlx_lm_is_listed():
    unlisted = [
        f"{r.path}:{r.line} {r.name}"
        for path, source in _all_files()
        for r in scan(path, source)
        if not _listed(r.path, r.name)
    ]
    assert not unlisted, f"add these to mlx_lm_compat.TOUCH_POINTS: {unlisted}"


def test_the_scan_finds_a_new_reach():
    """The scan is not blind: a new private access to an mlx-lm object is found."""
    source = (
        "from mlx_lm.models.cache import _BaseCache\n"
        "def f(cache, tokenizer):\n"
        "    cache._idx = 3\n"
        "    return getattr(tokenizer, '_tokenizer')\n"
    )
    path = "servicer/engine/new_module.py"
    assert [(r.line, r.name) for r in scan(path, source)] == [
        (1, "_BaseCache"),
        (3, "_idx"),
        (4, "_tokenizer"),
    ]
    assert not _listed(path, "_idx")


def test_our_own_private_names_are_not_reaches():
    """A name of ours that mlx-lm also uses (quantized_kv's own `_idx`, the decode batch's
    `_num_tokens`) is not a reach; the speculating caches' reads of mlx-lm's `_idx` are."""
    found = {
        (r.path, r.name)
        for path, source in _all_files()
        if path.endswith(("quantized_kv.py", "decode_batch.py", "speculation/caches.py"))
        for r in scan(path, source)
    }
    assert ("servicer/engine/speculation/caches.py", "_idx") in found
    assert ("servicer/engine/speculation/caches.py", "_BaseCache") in found
    assert not any(name == "_num_tokens" for _, name in found)
    assert ("servicer/engine/quantized_kv.py", "_idx") not in found


def _swap_mixins(source: str) -> set[str]:
    """The classes a file's class swaps mix in: the first base of each `type(...)` made in a
    function that assigns `__class__`, or, where that base is the function's parameter, the
    class each call of the function passes for it."""
    tree = ast.parse(source)
    classes = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    mixins: set[str] = set()
    for func in ast.walk(tree):
        if not isinstance(func, ast.FunctionDef):
            continue
        swaps = any(
            isinstance(t, ast.Attribute) and t.attr == "__class__"
            for n in ast.walk(func)
            if isinstance(n, ast.Assign)
            for t in n.targets
        )
        if not swaps:
            continue
        params = [a.arg for a in func.args.args]
        for call in ast.walk(func):
            if not (isinstance(call, ast.Call) and getattr(call.func, "id", "") == "type"):
                continue
            first = call.args[1].elts[0] if len(call.args) == 3 else None
            if isinstance(first, ast.Name) and first.id in classes:
                mixins.add(first.id)
            elif isinstance(first, ast.Name) and first.id in params:
                at = params.index(first.id)
                for use in ast.walk(tree):
                    if isinstance(use, ast.Call) and getattr(use.func, "id", "") == func.name:
                        arg = use.args[at] if len(use.args) > at else None
                        if isinstance(arg, ast.Name):
                            mixins.add(arg.id)
    return mixins


def test_every_class_swap_is_listed():
    found = set()
    for path, source in _all_files():
        module = path.removesuffix(".py").replace("/", ".")
        swaps = any(
            isinstance(t, ast.Attribute) and t.attr == "__class__"
            for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.Assign)
            for t in n.targets
        )
        if swaps:
            mixins = _swap_mixins(source)
            assert mixins, f"{path} swaps a class the scan cannot follow"
            found |= {f"{module}:{m}" for m in mixins}
    listed = {p.ours for p in _ids(Kind.CLASS_SWAP)}
    assert found == listed


def test_every_mlx_lm_base_class_is_listed():
    found = set()
    for path, source in _all_files():
        if path.endswith("__main__.py") or "mlx_lm" not in source:
            continue
        for node in ast.parse(source).body:
            if isinstance(node, ast.ClassDef):
                cls = _runtime_class(path, [node.name])
                for base in cls.__bases__ if cls is not None else ():
                    if base.__module__.startswith("mlx_lm"):
                        found.add((f"{path}:{node.name}", base))
    listed = {(u, resolve(p.upstream)) for p in _ids(Kind.BASE_CLASS) for u in p.used_in}
    assert found == listed


def test_each_place_the_list_names_exists():
    """Every "path:where" of the list is a file of servicer/ with that function or class,
    and says the name it touches (for attributes, private methods and base classes)."""
    for point in TOUCH_POINTS:
        for use in point.used_in:
            path, _, where = use.partition(":")
            source = (ROOT / path).read_text()
            defined = {
                n.name
                for n in ast.walk(ast.parse(source))
                if isinstance(n, ast.FunctionDef | ast.ClassDef)
            }
            assert set(where.split(".")) <= defined, use
            if point.kind in (Kind.ATTRIBUTE, Kind.PRIVATE_METHOD, Kind.BASE_CLASS):
                assert point.attribute in source, use
