"""Several LoRA / DoRA adapters on one base model, in one batch (engine thread only).

`load_adapters(model, {name: dir})` reads adapters as `mlx_lm.lora` trains them (a directory
with adapter_config.json and adapters.safetensors; fine_tune_type lora or dora, any rank, any
num_layers and keys), checks that each fits the base, and swaps every linear some adapter
targets (nn.Linear or nn.QuantizedLinear) for a `MultiLoRALinear`: the base layer, untouched,
and per adapter that targets it its A [in, r], B [r, out] and scale (a DoRA adapter's norm
scale too). Nothing is merged into the base weights; one model serves them all.

Which adapter each row of a forward takes is set on the returned `AdapterSet` before the
forward, one index per row (0: the base, no update), the way mrope.py's `RopePositions` is:
`with adapters.forward(rows): model(...)`. Each `MultiLoRALinear` then returns, for the rows
of adapter a, what mlx-lm's `LoRALinear` (or `DoRALinear`) on adapter a returns for the same
input, bit for bit: the update is computed over the whole batch in mlx-lm's order of
operations, and `mx.where` picks each row's value (a gather of the adapter's rows would change
the matmuls' shapes, and on some shapes their last bits). Rows of the base get the base
layer's output itself. With nothing set, or only base rows, a layer is its base layer (one
check of the set more, no array operation).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapters.safetensors"
BASE = 0  # the row index of the base model (no adapter)
_LINEAR = (nn.Linear, nn.QuantizedLinear)
# What mlx-lm's tuner makes LoRA layers of when an adapter names no keys (linear_to_lora_layers).
_LORA_KINDS = (*_LINEAR, SwitchLinear, QuantizedSwitchLinear, nn.Embedding, nn.QuantizedEmbedding)
_MAX_REASONS = 12  # reasons listed in one error


class AdapterError(ValueError):
    """An adapter that cannot serve on this base; the message says which and why."""


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    """One adapter's adapter_config.json, as far as serving reads it."""

    name: str
    path: Path
    dora: bool
    num_layers: int
    rank: int
    scale: float
    keys: tuple[str, ...] | None  # None: every linear of the adapted layers (mlx-lm's default)

    @property
    def kind(self) -> str:
        return "dora" if self.dora else "lora"


class LowRank(nn.Module):
    """One adapter's update of one linear: `lora_a` [in, r], `lora_b` [r, out] and `scale`, as
    in mlx-lm's LoRALinear; for DoRA also `norm_scale` [out], DoRALinear's m / ||W + scale ·
    Bᵀ Aᵀ|| by output row, computed once (its forward recomputes it each call, the same way)."""

    def __init__(
        self, lora_a: mx.array, lora_b: mx.array, scale: float, norm_scale: mx.array | None = None
    ) -> None:
        super().__init__()
        self.lora_a, self.lora_b, self.scale = lora_a, lora_b, scale
        if norm_scale is not None:
            self.norm_scale = norm_scale

    @classmethod
    def of(
        cls, linear: nn.Module, a: mx.array, b: mx.array, scale: float, m: mx.array | None = None
    ) -> LowRank:
        """The update of base `linear` by A `a`, B `b` and `scale`, and DoRA's magnitude `m`
        where given (its norm scale over the adapted weight, as DoRALinear.__call__ takes it)."""
        if m is None:
            return cls(a, b, scale)
        adapted = _dense_weight(linear) + (scale * b.T) @ a.T
        return cls(a, b, scale, m / mx.linalg.norm(adapted, axis=1))

    @property
    def dora(self) -> bool:
        return "norm_scale" in self


class AdapterSet:
    """The adapters loaded on one model, by name (indices from 1; 0 is the base), and which one
    each row of the next forward takes, read by every `MultiLoRALinear` of the model.

    Set before a forward and cleared after it (`forward` does both). The per-row
    indices are taken afresh each forward: a caller whose batch filters or extends its rows
    filters or extends its own list of indices the same way."""

    def __init__(self) -> None:
        self.names: dict[str, int] = {}
        self.specs: dict[int, AdapterSpec] = {}
        self.layers: dict[str, MultiLoRALinear] = {}  # module path -> the swapped layer
        self._rows = 0  # the rows the masks fit
        self._masks: tuple[tuple[int, mx.array | None], ...] = ()

    def __len__(self) -> int:
        return len(self.names)

    def index(self, name: str | None) -> int:
        """The row index of adapter `name` (None: the base)."""
        if name is None:
            return BASE
        if name not in self.names:
            raise KeyError(f"no adapter {name!r} is loaded (loaded: {sorted(self.names)})")
        return self.names[name]

    @property
    def active(self) -> bool:
        """Whether the next forward has a row of some adapter."""
        return bool(self._masks)

    def set(self, rows: Sequence[int]) -> None:
        """The next forward's adapter per row (batch axis), 0 for the base."""
        ids = np.asarray(list(rows), dtype=np.int64).reshape(-1, 1)
        bad = sorted({int(i) for i in ids.flat if not 0 <= i <= len(self.names)})
        if bad:
            raise ValueError(f"adapter indices {bad} are not loaded (0 to {len(self.names)})")
        present = sorted({int(i) for i in ids.flat} - {BASE})
        if not present:
            self.clear()
            return
        masks = []
        for index in present:
            hit = ids == index
            masks.append((index, None if hit.all() else mx.array(hit)[..., None]))
        self._rows = int(ids.shape[0])
        self._masks = tuple(masks)

    def clear(self) -> None:
        self._rows, self._masks = 0, ()

    @contextmanager
    def forward(self, rows: Sequence[int]) -> Iterator[None]:
        """`set(rows)` for the forwards run inside, cleared on leaving."""
        self.set(rows)
        try:
            yield
        finally:
            self.clear()

    def masks(self, x: mx.array) -> tuple[tuple[int, mx.array | None], ...]:
        """The adapters present in this forward, each with the rows (rows, tokens, 1) it takes
        (None: all of them); nothing when no row takes an adapter."""
        if not self._masks:
            return ()
        rows = self._rows
        if x.ndim < 3 or x.shape[0] != rows:
            raise ValueError(
                f"adapters were set for {rows} rows but a linear gets {list(x.shape)} (a "
                "forward that runs the batch's rows apart, in segments or groups, is not "
                "covered)"
            )
        return self._masks

    def add(self, spec: AdapterSpec, updates: Mapping[str, LowRank], model: nn.Module) -> int:
        """Adapter `spec` joins with its update of each linear (by module path); its index."""
        if spec.name in self.names:
            raise AdapterError(f"adapter {spec.name!r} is already loaded")
        index = len(self.names) + 1
        for path, update in updates.items():
            layer = self.layers.get(path)
            if layer is None:
                layer = self.layers[path] = MultiLoRALinear(_module_at(model, path), self)
                _put_module(model, path, layer)
            layer.updates[str(index)] = update
        self.names[spec.name] = index
        self.specs[index] = spec
        return index


class MultiLoRALinear(nn.Module):
    """A base linear (`linear`, unchanged) and the updates of the adapters that target it
    (`updates`, by index), each row getting its own adapter's from the shared `AdapterSet`."""

    def __init__(self, linear: nn.Module, adapters: AdapterSet) -> None:
        super().__init__()
        self.linear, self.adapters = linear, adapters
        self.updates: dict[str, LowRank] = {}

    def __call__(self, x: mx.array) -> mx.array:
        y = self.linear(x)
        present = self.adapters.masks(x)
        if not present:
            return y
        out, plain = y, None
        for index, mask in present:
            update = self.updates.get(str(index))
            if update is None:
                continue
            if update.dora:
                plain = self._plain(x, y) if plain is None else plain
                value = self._dora(x, plain, update)
            else:
                value = self._lora(x, y, update)
            if mask is None:
                out = value
                continue
            if y.ndim > 3:
                mask = mask.reshape(*mask.shape, *([1] * (y.ndim - 3)))
            out = mx.where(mask, value, out)
        return out

    @staticmethod
    def _lora(x: mx.array, y: mx.array, update: LowRank) -> mx.array:
        """mlx-lm's LoRALinear.__call__ (dropout is the identity when serving)."""
        z = (x @ update.lora_a) @ update.lora_b
        return y + (update.scale * z).astype(x.dtype)

    def _plain(self, x: mx.array, y: mx.array) -> mx.array:
        """DoRALinear's x @ Wᵀ, on the dequantized weight: the base layer's own output where
        that is the same thing (an unquantized linear without a bias)."""
        if isinstance(self.linear, nn.QuantizedLinear) or "bias" in self.linear:
            return x @ _dense_weight(self.linear).T
        return y

    def _dora(self, x: mx.array, plain: mx.array, update: LowRank) -> mx.array:
        """mlx-lm's DoRALinear.__call__, from its x @ Wᵀ (`plain`)."""
        out = update.norm_scale.astype(x.dtype) * self._lora(x, plain, update)
        if "bias" in self.linear:
            out = out + self.linear.bias
        return out


# ----- reading and checking adapters -----


def load_adapters(model: nn.Module, adapters: Mapping[str, str | Path]) -> AdapterSet:
    """Adapters `{name: directory}` onto `model` (as `mlx_lm.load` returns it), all checked
    before any is applied; their `AdapterSet` (the model's, where it has one already: these
    join it). Raises AdapterError naming the adapter and the reasons it does not fit."""
    found = {id(m.adapters): m.adapters for m in model.modules() if isinstance(m, MultiLoRALinear)}
    if len(found) > 1:
        raise AdapterError("the model's linears hold adapters of several adapter sets")
    adapter_set = next(iter(found.values())) if found else AdapterSet()
    plans = []
    for name, path in adapters.items():
        if not isinstance(name, str) or not name:
            raise AdapterError(f"an adapter needs a non-empty name, not {name!r}")
        if name in adapter_set.names:
            raise AdapterError(f"adapter {name!r} is already loaded")
        spec = read_adapter_config(name, Path(path))
        targets = adapter_targets(model, spec)
        plans.append((spec, _updates(model, spec, targets, _read_weights(spec))))
    for spec, updates in plans:
        adapter_set.add(spec, updates, model)
    return adapter_set


def read_adapter_config(name: str, path: Path) -> AdapterSpec:
    """Adapter `name`'s adapter_config.json in directory `path`, checked."""

    def refuse(reason: str) -> AdapterError:
        return AdapterError(f"adapter {name!r} ({path}): {reason}")

    if not path.is_dir():
        raise refuse("no such adapter directory")
    for file in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (path / file).is_file():
            raise refuse(f"{file} is missing")
    try:
        config = json.loads((path / ADAPTER_CONFIG).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise refuse(f"{ADAPTER_CONFIG} is not readable JSON ({e})") from None
    if not isinstance(config, dict):
        raise refuse(f"{ADAPTER_CONFIG} is not a JSON object")
    kind = config.get("fine_tune_type", "lora")
    if kind not in ("lora", "dora"):
        raise refuse(f"fine_tune_type {kind!r} is not an adapter (lora or dora)")
    params = config.get("lora_parameters")
    num_layers = config.get("num_layers")
    if not isinstance(params, dict) or not _is_int(num_layers):
        raise refuse(f"{ADAPTER_CONFIG} needs num_layers and lora_parameters (mlx-lm's format)")
    rank, scale, keys = params.get("rank"), params.get("scale"), params.get("keys")
    if not _is_int(rank) or rank <= 0:
        raise refuse(f"lora_parameters.rank must be a positive integer, not {rank!r}")
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale):
        hint = " (mlx-lm's format has 'scale', not 'alpha')" if "alpha" in params else ""
        raise refuse(f"lora_parameters.scale must be a number, not {scale!r}{hint}")
    if keys is not None and (
        not isinstance(keys, list) or not keys or not all(isinstance(k, str) for k in keys)
    ):
        raise refuse(f"lora_parameters.keys must be a list of module names, not {keys!r}")
    keys = None if keys is None else tuple(keys)
    return AdapterSpec(name, path, kind == "dora", num_layers, rank, float(scale), keys)


def adapter_targets(model: nn.Module, spec: AdapterSpec) -> dict[str, nn.Module]:
    """The base linears `spec` adapts, by module path, chosen as mlx-lm's tuner chooses them
    (linear_to_lora_layers: `keys` in each of the last `num_layers` layers, every layer for 0
    or less; `keys` that are whole paths of the model too); AdapterError if the base lacks
    layers or modules it names, or it targets layers serving cannot adapt."""
    layers = list(getattr(model, "layers", None) or [])
    if not layers:
        raise AdapterError(f"adapter {spec.name!r}: the model has no `layers` to adapt")
    if spec.num_layers > len(layers):
        raise AdapterError(
            f"adapter {spec.name!r}: it adapts {spec.num_layers} layers but this base has "
            f"{len(layers)} (an adapter for another base?)"
        )
    modules = _base_modules(model)
    paths = {id(m): p for p, m in modules.items()}
    per_layer = [{p: m for p, m in _base_modules(layer).items() if p} for layer in layers]
    keys = set(spec.keys) if spec.keys is not None else _default_keys(per_layer)
    count = spec.num_layers if spec.num_layers > 0 else len(layers)
    targets, matched = {}, set()
    for i in range(len(layers) - count, len(layers)):
        for key in keys & per_layer[i].keys():
            targets[f"{paths[id(layers[i])]}.{key}"] = per_layer[i][key]
            matched.add(key)
    for key in keys & modules.keys():
        targets[key] = modules[key]
        matched.add(key)
    named = set(spec.keys or ())  # keys an adapter names must each be somewhere it adapts
    reasons = [f"no module {k!r} in the adapted layers" for k in sorted(named - matched)]
    reasons += [
        _unsupported(p, m) for p, m in sorted(targets.items()) if not isinstance(m, _LINEAR)
    ]
    if not targets:
        reasons.append("it targets no module of this base")
    if reasons:
        raise _refusal(spec, reasons)
    return dict(sorted(targets.items()))


def _default_keys(per_layer: list[dict[str, nn.Module]]) -> set[str]:
    return {
        p
        for inside in per_layer
        for p, m in inside.items()
        if isinstance(m, _LORA_KINDS) or hasattr(m, "to_lora")
    }


def _unsupported(path: str, module: nn.Module) -> str:
    kind = type(module).__name__
    if isinstance(module, SwitchLinear | QuantizedSwitchLinear):
        return f"{path}: {kind} (mixture-of-experts) layers take no adapters here"
    if isinstance(module, nn.Embedding | nn.QuantizedEmbedding):
        return f"{path}: {kind} layers take no adapters here (only linear layers)"
    return f"{path}: {kind} is not a linear layer"


def _read_weights(spec: AdapterSpec) -> dict[str, mx.array]:
    file = spec.path / ADAPTER_WEIGHTS
    try:
        weights = mx.load(str(file), format="safetensors")
        mx.eval(list(weights.values()) if isinstance(weights, dict) else weights)
    except Exception as e:  # mlx raises several kinds for a bad file
        raise AdapterError(
            f"adapter {spec.name!r}: {file} is not a readable safetensors file ({e})"
        ) from None
    if not isinstance(weights, dict):
        raise AdapterError(f"adapter {spec.name!r}: {file} holds no named tensors")
    return weights


def _updates(
    model: nn.Module,
    spec: AdapterSpec,
    targets: Mapping[str, nn.Module],
    weights: Mapping[str, mx.array],
) -> dict[str, LowRank]:
    """Each target's update from the adapter's tensors, after checking that they are the ones
    it needs, with the base's shapes."""
    leaves = ("lora_a", "lora_b", "m") if spec.dora else ("lora_a", "lora_b")
    needed: dict[str, tuple[int, ...]] = {}
    for path, linear in targets.items():
        inputs, outputs = _dims(linear)
        shapes = {"lora_a": (inputs, spec.rank), "lora_b": (spec.rank, outputs), "m": (outputs,)}
        needed.update({f"{path}.{leaf}": shapes[leaf] for leaf in leaves})
    known = set(_base_modules(model))
    reasons = [
        _stray(name, spec.kind, targets, known) for name in sorted(weights.keys() - needed.keys())
    ]
    for name, shape in needed.items():
        tensor = weights.get(name)
        if tensor is None:
            reasons.append(f"{name}: missing")
        elif tuple(tensor.shape) != shape:
            reasons.append(
                f"{name}: shape {tuple(tensor.shape)}, but this base and rank {spec.rank} "
                f"need {shape}"
            )
        elif not mx.issubdtype(tensor.dtype, mx.floating):
            reasons.append(f"{name}: {tensor.dtype} is not a floating-point type")
    if reasons:
        raise _refusal(spec, reasons)
    updates = {
        path: LowRank.of(
            linear,
            weights[f"{path}.lora_a"],
            weights[f"{path}.lora_b"],
            spec.scale,
            weights.get(f"{path}.m") if spec.dora else None,
        )
        for path, linear in targets.items()
    }
    mx.eval([u.parameters() for u in updates.values()])
    return updates


def _stray(name: str, kind: str, targets: Mapping[str, nn.Module], known: set[str]) -> str:
    """Why a tensor the adapter's config does not call for is there, as far as can be told."""
    module = name.rsplit(".", 1)[0]
    if module in targets:
        return f"{name}: not a parameter of a {kind} adapter"
    if module in known:
        return f"{name}: its config (num_layers, keys) does not adapt {module}"
    return f"{name}: this base has no module {module} (an adapter for another base?)"


def _refusal(spec: AdapterSpec, reasons: list[str]) -> AdapterError:
    shown = reasons[:_MAX_REASONS]
    if len(reasons) > len(shown):
        shown.append(f"... and {len(reasons) - len(shown)} more")
    return AdapterError(
        f"adapter {spec.name!r} ({spec.path}, {spec.kind} rank {spec.rank}) does not fit "
        "this base:\n  " + "\n  ".join(shown)
    )


# ----- the model's modules -----


def _base_modules(root: nn.Module) -> dict[str, nn.Module]:
    """`root`'s modules by path, a swapped linear seen as its base layer and nothing inside."""
    modules = dict(root.named_modules())
    swapped = [p for p, m in modules.items() if isinstance(m, MultiLoRALinear)]
    for path in swapped:
        modules[path] = modules[path].linear
    prefixes = tuple(f"{p}." for p in swapped)
    return {p: m for p, m in modules.items() if not (prefixes and p.startswith(prefixes))}


def _dims(linear: nn.Module) -> tuple[int, int]:
    """A linear's (input, output) dimensions, a quantized one's logical ones."""
    outputs, inputs = linear.weight.shape
    if isinstance(linear, nn.QuantizedLinear):
        inputs = inputs * 32 // linear.bits
    return int(inputs), int(outputs)


def _dense_weight(linear: nn.Module) -> mx.array:
    """The weight [out, in], dequantized as DoRALinear does."""
    if not isinstance(linear, nn.QuantizedLinear):
        return linear.weight
    return mx.dequantize(
        linear.weight,
        linear.scales,
        linear.get("biases"),
        group_size=linear.group_size,
        bits=linear.bits,
        mode=linear.mode,
    )


def _module_at(root: nn.Module, path: str) -> Any:
    node: Any = root
    for part in path.split("."):
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


def _put_module(root: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, last = path.rpartition(".")
    parent = _module_at(root, parent_path) if parent_path else root
    if isinstance(parent, list):
        parent[int(last)] = module
    else:
        setattr(parent, last, module)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
