"""Several LoRA / DoRA adapters on one base in one batch (servicer/engine/adapters.py): each
adapted linear gives a row of adapter a what mlx-lm's LoRALinear / DoRALinear on adapter a
gives, bit for bit, and a base row the base layer's output; a batch mixing the base and four
adapters (three with known random weights, one trained by mlx-lm's tuner) on the demo llama,
float32 and 4-bit, gives every row mlx-lm's own greedy tokens with that adapter loaded; and
adapters that do not fit the base are refused, the model left as it was."""

from __future__ import annotations

import json
import math
import types
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.tuner.dora import DoRALinear
from mlx_lm.tuner.lora import LoRALinear
from mlx_lm.tuner.utils import linear_to_lora_layers

from servicer.demos.text import TEST_PROMPTS, demo_model_path
from servicer.engine.adapters import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    AdapterError,
    AdapterSet,
    LowRank,
    MultiLoRALinear,
    load_adapters,
)

STEPS = 24  # greedy tokens of mlx-lm's reference per row
CHUNKS = 3  # right-padded prefill chunks per prompt

# Known random adapters: different ranks, target keys, layer counts and kinds.
RANDOM_ADAPTERS: dict[str, dict[str, Any]] = {
    "attn": dict(rank=4, keys=["self_attn.q_proj", "self_attn.v_proj"], num_layers=1, scale=4.0),
    "all": dict(rank=8, keys=None, num_layers=2, scale=2.0),
    "dora": dict(
        rank=16,
        keys=["self_attn.k_proj", "self_attn.o_proj", "mlp.up_proj", "mlp.down_proj"],
        num_layers=-1,
        scale=3.0,
        dora=True,
    ),
}
TRAINED = "trained"  # trained for a few steps by mlx-lm's tuner, in the test
B_SIZE = 0.3  # B's entries are B_SIZE / sqrt(rank) normal: enough to change the greedy text

# (adapter, prompt, tokens wanted): rows leave the batch at different steps.
BATCH = [
    (None, 0, 24),
    ("attn", 1, 24),
    ("all", 2, 16),
    ("dora", 3, 24),
    (TRAINED, 4, 20),
    (None, 5, 12),
    ("attn", 6, 24),
    ("dora", 7, 8),
    ("all", 3, 24),
]


# ----- adapters in mlx-lm's format -----


def _write_config(path: Path, config: dict[str, Any]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / ADAPTER_CONFIG).write_text(json.dumps(config, indent=4))


def write_random_adapter(
    path: Path,
    model: nn.Module,
    *,
    rank: int,
    keys: list[str] | None,
    num_layers: int,
    scale: float,
    dora: bool = False,
    seed: int = 0,
) -> Path:
    """An adapter for `model` (left with mlx-lm's LoRA layers in) as `mlx_lm.lora` saves one:
    the trainable parameters mlx-lm's tuner makes, with known random values."""
    params: dict[str, Any] = {"rank": rank, "scale": scale, "dropout": 0.0}
    if keys is not None:
        params["keys"] = keys
    model.freeze()
    linear_to_lora_layers(model, num_layers, params, use_dora=dora)
    key = mx.random.key(seed)
    weights = {}
    for name, value in tree_flatten(model.trainable_parameters()):
        key, sub = mx.random.split(key)
        noise = mx.random.normal(value.shape, key=sub)
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "lora_a":
            weights[name] = noise / math.sqrt(value.shape[0])
        elif leaf == "lora_b":
            weights[name] = noise * (B_SIZE / math.sqrt(rank))
        else:  # DoRA's magnitude: near the base's row norms
            weights[name] = value * (1 + 0.2 * noise)
    _write_config(
        path,
        {
            "fine_tune_type": "dora" if dora else "lora",
            "num_layers": num_layers,
            "lora_parameters": params,
        },
    )
    mx.save_safetensors(str(path / ADAPTER_WEIGHTS), weights)
    return path


def train_adapter(path: Path, base: Path, data: Path) -> Path:
    """Five steps of mlx-lm's own LoRA training (mlx_lm.lora's train_model, which writes the
    config and the weights) on a tiny dataset."""
    from mlx_lm import load
    from mlx_lm.lora import CONFIG_DEFAULTS, train_model
    from mlx_lm.tuner.datasets import load_dataset

    data.mkdir(parents=True, exist_ok=True)
    lines = [f"{p} went on and on, and then it was over." for p in TEST_PROMPTS]
    for split in ("train", "valid"):
        (data / f"{split}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    model, tokenizer = load(str(base))
    overrides = dict(
        model=str(base),
        train=True,
        data=str(data),
        iters=5,
        batch_size=2,
        num_layers=1,
        adapter_path=str(path),
        val_batches=1,
        steps_per_report=5,
        learning_rate=1e-3,
        max_seq_length=64,
        lora_parameters={"rank": 8, "dropout": 0.0, "scale": 20.0},
    )
    args = types.SimpleNamespace(**{**CONFIG_DEFAULTS, **overrides})
    train_set, valid_set, _ = load_dataset(args, tokenizer)
    train_model(args, model, train_set, valid_set)
    return path


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory) -> dict[str, Path]:
    from mlx_lm import load

    root = tmp_path_factory.mktemp("adapters")
    base = demo_model_path("llama")
    dirs = {}
    for seed, (name, options) in enumerate(RANDOM_ADAPTERS.items()):
        model, _ = load(str(base))
        dirs[name] = write_random_adapter(root / name, model, seed=seed, **options)
    dirs[TRAINED] = train_adapter(root / TRAINED, base, root / "data")
    return dirs


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    """The demo llama (float32) and its 4-bit copy (mlx_lm.convert)."""
    from mlx_lm import convert

    base = demo_model_path("llama")
    quantized = tmp_path_factory.mktemp("q4") / "llama-4bit"
    convert(str(base), str(quantized), quantize=True, q_bits=4, q_group_size=64)
    return {"float32": base, "4-bit": quantized}


# ----- one layer -----


def _base_layer(kind: str, dtype: mx.Dtype) -> nn.Module:
    mx.random.seed(3)
    linear = nn.Linear(64, 48, bias=kind == "bias")
    linear.set_dtype(dtype)
    if kind == "quantized":
        return nn.QuantizedLinear.from_linear(linear, group_size=32, bits=4)
    return linear


def _mlx_lm_layer(base: nn.Module, dora: bool, rank: int, seed: int) -> nn.Module:
    layer = (DoRALinear if dora else LoRALinear).from_base(base, r=rank, scale=1.5 + seed)
    key = mx.random.key(seed)
    ka, kb, km = mx.random.split(key, 3)
    layer.lora_a = mx.random.normal(layer.lora_a.shape, key=ka) / 8
    layer.lora_b = mx.random.normal(layer.lora_b.shape, key=kb) / 4
    if dora:
        layer.m = layer.m * (1 + 0.3 * mx.random.normal(layer.m.shape, key=km))
    return layer


def _multi(base: nn.Module, layers: list[nn.Module]) -> tuple[MultiLoRALinear, AdapterSet]:
    adapters = AdapterSet()
    multi = MultiLoRALinear(base, adapters)
    for index, layer in enumerate(layers, start=1):
        m = layer.m if isinstance(layer, DoRALinear) else None
        multi.updates[str(index)] = LowRank.of(base, layer.lora_a, layer.lora_b, layer.scale, m)
        adapters.names[f"a{index}"] = index
    return multi, adapters


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=str)
@pytest.mark.parametrize("kind", ["plain", "bias", "quantized"])
def test_each_row_equals_mlx_lm_layer_bit_for_bit(kind: str, dtype: mx.Dtype) -> None:
    """Rows of adapter a get mlx-lm's LoRALinear / DoRALinear output on the same input, rows of
    the base the base layer's; nothing set (or only base rows), the layer is the base."""
    base = _base_layer(kind, dtype)
    layers = [
        _mlx_lm_layer(base, dora=False, rank=4, seed=1),
        _mlx_lm_layer(base, dora=True, rank=8, seed=2),
        _mlx_lm_layer(base, dora=False, rank=16, seed=3),
        _mlx_lm_layer(base, dora=True, rank=4, seed=4),
    ]
    multi, adapters = _multi(base, layers)
    x = mx.random.normal((7, 5, 64), key=mx.random.key(9)).astype(dtype)
    rows = [0, 1, 2, 3, 2, 4, 0]
    with adapters.forward(rows):
        got = multi(x)
    expected = [base(x), *(layer(x) for layer in layers)]
    for r, index in enumerate(rows):
        assert got.dtype == expected[index].dtype
        assert mx.array_equal(got[r], expected[index][r]), (r, index)
    assert not adapters.active
    assert mx.array_equal(multi(x), base(x))
    with adapters.forward([0] * 7):
        assert not adapters.active
        assert mx.array_equal(multi(x), base(x))
    with adapters.forward([2] * 7):  # one adapter on every row: its layer's output whole
        assert mx.array_equal(multi(x), layers[1](x))


def test_rows_must_fit_the_forward() -> None:
    base = _base_layer("plain", mx.float32)
    multi, adapters = _multi(base, [_mlx_lm_layer(base, dora=False, rank=4, seed=1)])
    with pytest.raises(ValueError, match=r"indices \[2\] are not loaded"):
        adapters.set([0, 2])
    x = mx.zeros((3, 2, 64))
    with adapters.forward([1, 0]), pytest.raises(ValueError, match="set for 2 rows"):
        multi(x)
    assert adapters.index(None) == 0 and adapters.index("a1") == 1
    with pytest.raises(KeyError, match="no adapter 'nope'"):
        adapters.index("nope")


# ----- the demo llama in a batch -----


def _prompt(tokenizer: Any, i: int) -> list[int]:
    """Prompts of different lengths (at least CHUNKS + 1 tokens)."""
    text = f"{TEST_PROMPTS[i]} {TEST_PROMPTS[(i + 3) % len(TEST_PROMPTS)] * (1 + i % 3)}"
    return list(tokenizer.encode(text, add_special_tokens=False))


class References:
    """mlx-lm's own models, the base alone or with one adapter (`mlx_lm.load`'s adapter_path),
    and their greedy tokens (generate_step, temperature 0)."""

    def __init__(self, bases: dict[str, Path], adapter_dirs: dict[str, Path]) -> None:
        self.bases, self.adapter_dirs = bases, adapter_dirs
        self._models: dict[tuple[str, str | None], Any] = {}

    def model(self, base: str, adapter: str | None) -> Any:
        from mlx_lm import load

        key = (base, adapter)
        if key not in self._models:
            path = None if adapter is None else str(self.adapter_dirs[adapter])
            self._models[key] = load(str(self.bases[base]), adapter_path=path)[0]
        return self._models[key]

    def greedy(self, base: str, adapter: str | None, prompt: list[int], n: int) -> list[int]:
        from mlx_lm.generate import generate_step

        steps = generate_step(mx.array(prompt), self.model(base, adapter), max_tokens=n)
        return [int(token) for token, _ in steps]


@pytest.fixture(scope="module")
def references(bases, adapter_dirs) -> References:
    return References(bases, adapter_dirs)


@pytest.fixture(scope="module", params=["float32", "4-bit"])
def served(request, bases, adapter_dirs) -> tuple[str, Any, Any, AdapterSet]:
    """(base kind, one base model with every adapter loaded, its tokenizer, the set)."""
    from mlx_lm import load

    model, tokenizer = load(str(bases[request.param]))
    plain = mx.array([_prompt(tokenizer, 1)])
    before = model(plain)
    adapters = load_adapters(model, adapter_dirs)
    assert adapters.names == {name: i for i, name in enumerate(adapter_dirs, start=1)}
    swapped = [m for _, m in model.named_modules() if isinstance(m, MultiLoRALinear)]
    assert len(swapped) == len(adapters.layers) == 14  # every linear of both layers
    # Nothing set, or only base rows: the model's logits are the base's, bit for bit.
    assert mx.array_equal(model(plain), before)
    with adapters.forward([0]):
        assert mx.array_equal(model(plain), before)
    return request.param, model, tokenizer, adapters


def test_mixed_batch_forward_equals_mlx_lm_bit_for_bit(served, references) -> None:
    """One forward over a right-padded batch mixing the base and every adapter: each row's
    logits are those of mlx-lm's model with that row's adapter on the same batch."""
    kind, model, tokenizer, adapters = served
    names = [None, "attn", "all", "dora", TRAINED, "attn", None, "dora"]
    prompts = [_prompt(tokenizer, i) for i in range(len(names))]
    width = max(len(p) for p in prompts)
    inputs = mx.array([p + [0] * (width - len(p)) for p in prompts])
    with adapters.forward([adapters.index(n) for n in names]):
        got = model(inputs)
    for name in set(names):
        expected = references.model(kind, name)(inputs)
        for r in (r for r, n in enumerate(names) if n == name):
            assert mx.array_equal(got[r], expected[r]), (kind, name, r)


def _prefill(model, adapters: AdapterSet, cache, rows: list[dict]) -> None:
    """Every row's prompt but its last token, in CHUNKS right-padded chunks a row, each
    forward with the rows' adapters."""
    splits = [np.array_split(np.arange(len(r["ids"]) - 1), CHUNKS) for r in rows]
    for step in range(CHUNKS):
        parts = [s[step] for s in splits]
        lengths = [len(p) for p in parts]
        width = max(lengths)
        padding = [width - n for n in lengths]
        inputs = [
            row["ids"][int(p[0]) : int(p[0]) + len(p)] + [0] * (width - len(p))
            for row, p in zip(rows, parts, strict=True)
        ]
        if max(padding):
            for c in cache:
                c.prepare(lengths=lengths, right_padding=padding)
        with adapters.forward([row["adapter"] for row in rows]):
            model(mx.array(inputs), cache=cache)
        mx.eval([c.state for c in cache])
        if max(padding):
            for c in cache:
                c.finalize()


def _decode(model, adapters: AdapterSet, cache, rows: list[dict]) -> None:
    """Greedy decoding from each row's last prompt token; a row that has its tokens leaves
    the batch, and its adapter index with it."""
    live = list(range(len(rows)))
    inputs = mx.array([r["ids"][-1] for r in rows])
    while True:
        with adapters.forward([rows[i]["adapter"] for i in live]):
            logits = model(inputs[:, None], cache=cache)[:, -1, :]
        tokens = mx.argmax(logits, axis=-1)
        for i, token in zip(live, tokens.tolist(), strict=True):
            rows[i]["out"].append(token)
        keep = [e for e, i in enumerate(live) if len(rows[i]["out"]) < rows[i]["wanted"]]
        if not keep:
            return
        if len(keep) < len(live):
            for c in cache:
                c.filter(keep)
        live = [live[e] for e in keep]
        inputs = tokens[mx.array(keep)]


def test_mixed_batch_decodes_each_adapters_greedy_tokens(served, references) -> None:
    """The base and four adapters in one batch (prefill in right-padded chunks, then decoding
    with rows leaving): every row gets mlx-lm's greedy tokens with its adapter loaded."""
    from mlx_lm.models.cache import make_prompt_cache

    from servicer.engine.decode_batch import merge_caches

    kind, model, tokenizer, adapters = served
    rows = [
        dict(name=name, adapter=adapters.index(name), ids=_prompt(tokenizer, p), wanted=n, out=[])
        for name, p, n in BATCH
    ]
    assert len({len(r["ids"]) for r in rows}) > 3
    cache = merge_caches([make_prompt_cache(model) for _ in rows])
    _prefill(model, adapters, cache, rows)
    _decode(model, adapters, cache, rows)
    base_tokens = {}
    for row in rows:
        expected = references.greedy(kind, row["name"], row["ids"], STEPS)
        assert row["out"] == expected[: row["wanted"]], (kind, row["name"])
        if row["name"] is None:
            base_tokens[tuple(row["ids"])] = expected
    # The adapters matter: a prompt of the base row under an adapter says something else.
    for name in [*RANDOM_ADAPTERS, TRAINED]:
        prompt = _prompt(tokenizer, 0)
        assert references.greedy(kind, name, prompt, STEPS) != base_tokens[tuple(prompt)], name


# ----- adapters that do not fit -----


@pytest.fixture
def base_model() -> Any:
    from mlx_lm import load

    return load(str(demo_model_path("llama")))[0]


def _copy_adapter(source: Path, path: Path, **config_changes: Any) -> Path:
    """`source`'s adapter at `path`, its config changed (a key set to None is removed)."""
    config = json.loads((source / ADAPTER_CONFIG).read_text())
    for key, value in config_changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    _write_config(path, config)
    (path / ADAPTER_WEIGHTS).write_bytes((source / ADAPTER_WEIGHTS).read_bytes())
    return path


def _retensor(path: Path, change) -> Path:
    weights = dict(mx.load(str(path / ADAPTER_WEIGHTS)))
    change(weights)
    mx.save_safetensors(str(path / ADAPTER_WEIGHTS), weights)
    return path


def _refused(model: nn.Module, adapters: dict[str, Path], *reasons: str) -> str:
    """Loading `adapters` fails with every reason in the message, the model untouched."""
    with pytest.raises(AdapterError) as raised:
        load_adapters(model, adapters)
    message = str(raised.value)
    for reason in reasons:
        assert reason in message, message
    assert not any(isinstance(m, MultiLoRALinear) for _, m in model.named_modules())
    return message


def test_adapters_that_do_not_fit_are_refused(base_model, adapter_dirs, tmp_path) -> None:
    good = adapter_dirs["attn"]
    q_a = "model.layers.1.self_attn.q_proj.lora_a"

    cases = {
        # The config says rank 8, the tensors are rank 4.
        "wrong rank": (
            _copy_adapter(
                good,
                tmp_path / "rank",
                lora_parameters={
                    "rank": 8,
                    "scale": 4.0,
                    "dropout": 0.0,
                    "keys": ["self_attn.q_proj", "self_attn.v_proj"],
                },
            ),
            [f"{q_a}: shape (128, 4), but this base and rank 8 need (128, 8)"],
        ),
        "layer past the model": (
            _retensor(
                _copy_adapter(good, tmp_path / "past"),
                lambda w: w.update({"model.layers.7.self_attn.q_proj.lora_a": w[q_a]}),
            ),
            [
                "model.layers.7.self_attn.q_proj.lora_a: this base has no module "
                "model.layers.7.self_attn.q_proj (an adapter for another base?)"
            ],
        ),
        "a layer its config does not adapt": (
            _retensor(
                _copy_adapter(good, tmp_path / "untargeted"),
                lambda w: w.update({"model.layers.0.self_attn.q_proj.lora_a": w[q_a]}),
            ),
            [
                "model.layers.0.self_attn.q_proj.lora_a: its config (num_layers, keys) does "
                "not adapt model.layers.0.self_attn.q_proj"
            ],
        ),
        "a DoRA tensor in a LoRA adapter": (
            _retensor(
                _copy_adapter(good, tmp_path / "magnitude"),
                lambda w: w.update({"model.layers.1.self_attn.q_proj.m": mx.ones((128,))}),
            ),
            ["model.layers.1.self_attn.q_proj.m: not a parameter of a lora adapter"],
        ),
        "more layers than the base": (
            _copy_adapter(good, tmp_path / "layers", num_layers=5),
            ["it adapts 5 layers but this base has 2"],
        ),
        "missing tensor": (
            _retensor(_copy_adapter(good, tmp_path / "missing"), lambda w: w.pop(q_a)),
            [f"{q_a}: missing"],
        ),
        "missing module": (
            _copy_adapter(
                good,
                tmp_path / "module",
                lora_parameters={
                    "rank": 4,
                    "scale": 4.0,
                    "dropout": 0.0,
                    "keys": ["self_attn.qkv_proj"],
                },
            ),
            ["no module 'self_attn.qkv_proj' in the adapted layers"],
        ),
        "an embedding": (
            _copy_adapter(
                good,
                tmp_path / "embedding",
                lora_parameters={
                    "rank": 4,
                    "scale": 4.0,
                    "dropout": 0.0,
                    "keys": ["model.embed_tokens"],
                },
            ),
            ["model.embed_tokens: Embedding layers take no adapters here"],
        ),
        "full fine-tune": (
            _copy_adapter(good, tmp_path / "full", fine_tune_type="full"),
            ["fine_tune_type 'full' is not an adapter"],
        ),
        "alpha, not scale": (
            _copy_adapter(good, tmp_path / "alpha", lora_parameters={"rank": 4, "alpha": 8}),
            ["lora_parameters.scale must be a number", "not 'alpha'"],
        ),
        "no config": (
            _copy_adapter(good, tmp_path / "noconfig"),
            [f"{ADAPTER_CONFIG} is missing"],
        ),
        "no weights": (
            _copy_adapter(good, tmp_path / "noweights"),
            [f"{ADAPTER_WEIGHTS} is missing"],
        ),
        "no directory": (tmp_path / "nowhere", ["no such adapter directory"]),
        "corrupt weights": (
            _copy_adapter(good, tmp_path / "corrupt"),
            ["is not a readable safetensors file"],
        ),
        "truncated weights": (
            _copy_adapter(good, tmp_path / "truncated"),
            ["is not a readable safetensors file"],
        ),
        "bad JSON": (_copy_adapter(good, tmp_path / "json"), ["is not readable JSON"]),
    }
    (tmp_path / "noconfig" / ADAPTER_CONFIG).unlink()
    (tmp_path / "noweights" / ADAPTER_WEIGHTS).unlink()
    (tmp_path / "corrupt" / ADAPTER_WEIGHTS).write_bytes(b"not a safetensors file at all")
    whole = (good / ADAPTER_WEIGHTS).read_bytes()
    (tmp_path / "truncated" / ADAPTER_WEIGHTS).write_bytes(whole[: len(whole) // 2])
    (tmp_path / "json" / ADAPTER_CONFIG).write_text("{not json")
    for case, (path, reasons) in cases.items():
        message = _refused(base_model, {"good": adapter_dirs["all"], case: path}, *reasons)
        assert repr(case) in message  # the error names the adapter
    x = mx.array([[5, 6, 7]])
    from mlx_lm import load

    assert mx.array_equal(base_model(x), load(str(demo_model_path("llama")))[0](x))


def test_an_adapter_for_another_base_is_refused(base_model, tmp_path) -> None:
    """An adapter trained on a wider llama: every tensor's shape says so."""
    from mlx_lm.models import llama

    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=256,
        num_hidden_layers=2,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=512,
        head_dim=64,
        tie_word_embeddings=True,
    )
    other = write_random_adapter(
        tmp_path / "other", llama.Model(args), rank=8, keys=None, num_layers=2, scale=1.0
    )
    message = _refused(
        base_model,
        {"other": other},
        "model.layers.0.mlp.down_proj.lora_a: shape (512, 8), but this base and rank 8 need "
        "(256, 8)",
        "model.layers.0.self_attn.k_proj.lora_b: shape (8, 128), but this base and rank 8 need "
        "(8, 64)",
        "more",  # 28 tensors, every one of another shape: the first few listed
    )
    assert message.count("\n") <= 14


def test_mixture_of_experts_layers_are_refused(tmp_path) -> None:
    """An adapter whose targets include SwitchLinear experts (mlx-lm's default keys of a MoE
    model) is refused, naming them."""
    from mlx_lm.models import mixtral

    args = mixtral.ModelArgs(
        model_type="mixtral",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_experts_per_tok=2,
        num_key_value_heads=1,
        num_local_experts=2,
    )
    model = mixtral.Model(args)
    path = tmp_path / "moe"
    _write_config(
        path, {"num_layers": 1, "lora_parameters": {"rank": 4, "scale": 1.0, "dropout": 0.0}}
    )
    mx.save_safetensors(str(path / ADAPTER_WEIGHTS), {"x": mx.zeros((1,))})
    _refused(
        model,
        {"moe": path},
        "model.layers.0.block_sparse_moe.switch_mlp.gate_proj: SwitchLinear (mixture-of-experts)",
    )


def test_adapters_join_a_loaded_set(base_model, adapter_dirs) -> None:
    """A second load joins the model's set (indices go on); a name already loaded is refused;
    adapters that share a layer share one MultiLoRALinear."""
    first = load_adapters(base_model, {"attn": adapter_dirs["attn"]})
    layers = dict(first.layers)
    assert len(layers) == 2  # q_proj and v_proj of the last layer
    second = load_adapters(base_model, {"all": adapter_dirs["all"]})
    assert second is first
    assert first.names == {"attn": 1, "all": 2}
    assert len(first.layers) == 14
    for path, layer in layers.items():
        assert first.layers[path] is layer and set(layer.updates) == {"1", "2"}
    with pytest.raises(AdapterError, match="'attn' is already loaded"):
        load_adapters(base_model, {"attn": adapter_dirs["dora"]})
    assert first.specs[2].rank == 8 and first.specs[2].keys is None
