"""The copier's weights, built by hand: a copy (induction) circuit grafted onto the demo llama.

Training induction heads takes far more than a few CPU minutes (a fine-tune of the demo llama
on copy documents learned none in 200 steps), so the circuit is written down instead. The
model is mlx-lm's ``smollm3`` (llama with per-layer RoPE switched off), with the residual
stream widened from 128 to ``layout()["dim"]`` and three new layers in front of the llama's two:

1. **Positional layer** (RoPE): heads whose queries and keys are constant biases, so their
   scores depend only on the distance; each attends to exactly one earlier position (1..11
   back) and copies that token's code (below) into its own part of the stream. Its MLP
   counts, for each period p = 1..8, how many of the last 4 tokens equal those p further
   back (on one hash): a short loop.
2. **Induction layer** (no RoPE): head ``m`` matches hash ``m`` of the last 3 tokens
   against the 3 tokens before every earlier position (a 3-gram, like n = 3 lookup) and reads
   the token there plus the 3 before it. The MLP counts how many of the 3 really matched,
   and flags a loop. Two "echo" heads attend from ``<|assistant|>`` after ``<|end|>`` to
   the first token of a user turn, so a chat reply starts by repeating the user's message.
3. **Gate layer** (MLP only): writes the copied token's code into the boost part only when
   all 8 heads verified a full 3-token match and no loop of period <= 8 is running (or the
   echo fired).

The llama's layers follow, unchanged, with norm weights rescaled for the wider stream. The
lm_head (untied) adds ``code(t) . boost`` to the llama's logits. A constant dimension
(``z``) dominates the stream until the gate layer removes it, so every norm in the circuit
divides by the same number whatever the token; the circuit's parts sit at ``SCALE`` beside
an embedding of ~0.1, so the llama layers barely notice them: where the boost is off, the
logits stay within 0.1 of the llama's (greedy picks agree at 99.4 % of corpus positions).

A token's code: 8 independent hashes to 8 values, one one-hot block each (64 dims); the
first block keeps values 6 and 7 for ``<|begin|>``/``<|end|>`` and ``<|user|>``/``<|assistant|>``
(tied codes, which is what lets the echo run on into a plain copy).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

HEAD_DIM = 32
HASHES = 8
VALUES = 8
CODE = HASHES * VALUES
SLOTS = 3  # tokens matched: the current one and the two before it
LOOP_SLOTS = 4  # tokens compared with those one period back
LOOP_BLOCK = 1  # the hash they are compared on (block 0 has only 6 values for plain tokens)
OFFSETS = 11  # positions back the positional layer reads (3 for matching, up to 11 for loops)
MAX_PERIOD = OFFSETS - LOOP_SLOTS + 1  # loops of period 1..8 are detected
KV_HEADS = HASHES + 2  # one induction head per hash, two echo heads
Q_HEADS = 2 * KV_HEADS  # the llama's grouping: 2 query heads per key/value head
INTERMEDIATE = 256
SCALE = 0.005  # one code unit in the stream
Z_VALUE = 8.0
SHARP = 100.0  # silu(SHARP x) / SHARP is relu(x) to within 3e-4
RAMP = 0.1  # gates go from off to fully on over this much evidence
BOOST = 15.0  # logits per matching hash at the largest residual norm the llama produces
ATTENTION_MARGIN = 16.0  # attention logits between the intended position and any other
SPECIALS = {"<|begin|>": 6, "<|end|>": 6, "<|user|>": 7, "<|assistant|>": 7}  # block-0 values
_KERNEL_FREQS = 6  # RoPE frequency pairs the positional kernel uses
_KERNEL_GAP = 0.686  # its worst-case peak-to-runner-up gap per unit amplitude (checked)


def layout(base_dim: int) -> dict[str, int]:
    """Offset of every part of the stream (and "dim", the padded total)."""
    sizes = {
        "main": base_dim,
        "F": CODE,  # this token's code
        "P": CODE,  # 1 back
        "Q": CODE,  # 2 back
        "R": CODE,  # 3 back
        "H": (OFFSETS - SLOTS) * VALUES,  # LOOP_BLOCK only, 4..11 back (loop detection)
        "A": CODE,  # the induction heads' copied code
        "AE": CODE,  # the echo heads' copied code
        "VS": HASHES * SLOTS * VALUES,  # the 3 codes before the matched position, per head
        "K": HASHES,  # verified slots per head
        "LP": MAX_PERIOD,  # matched slots per loop period
        "LF": 1,  # loop flag
        "B": CODE,  # the boost the lm_head reads
        "Z": 1,
    }
    offsets, at = {}, 0
    for name, size in sizes.items():
        offsets[name], at = at, at + size
    offsets["dim"] = -(-at // HEAD_DIM) * HEAD_DIM
    return offsets


def token_codes(vocab: int, special_ids: Mapping[str, int], rng) -> np.ndarray:
    """(vocab, CODE) one-hot blocks; block 0 keeps values 6 and 7 for the chat markers."""
    values = rng.integers(0, VALUES, (vocab, HASHES))
    values[:, 0] = rng.integers(0, VALUES - 2, vocab)
    pairs = (("<|end|>", "<|begin|>"), ("<|assistant|>", "<|user|>"))
    for name, twin in pairs:
        values[special_ids[name]] = values[special_ids[twin]]
    for name, value in SPECIALS.items():
        values[special_ids[name], 0] = value
    codes = np.zeros((vocab, CODE), np.float32)
    for block in range(HASHES):
        codes[np.arange(vocab), block * VALUES + values[:, block]] = 1.0
    return codes


def _empty_layer(dim: int) -> dict[str, np.ndarray]:
    shapes = {
        "self_attn.q_proj": (Q_HEADS * HEAD_DIM, dim),
        "self_attn.k_proj": (KV_HEADS * HEAD_DIM, dim),
        "self_attn.v_proj": (KV_HEADS * HEAD_DIM, dim),
        "self_attn.o_proj": (dim, Q_HEADS * HEAD_DIM),
        "mlp.gate_proj": (INTERMEDIATE, dim),
        "mlp.up_proj": (INTERMEDIATE, dim),
        "mlp.down_proj": (dim, INTERMEDIATE),
    }
    layer = {}
    for name, shape in shapes.items():
        layer[f"{name}.weight"] = np.zeros(shape, np.float32)
        layer[f"{name}.bias"] = np.zeros(shape[0], np.float32)
    layer["input_layernorm.weight"] = np.zeros(dim, np.float32)
    layer["post_attention_layernorm.weight"] = np.zeros(dim, np.float32)
    return layer


def _relu_unit(
    layer: dict, unit: int, inputs: Iterable[tuple[int, float]], bias: float, out: int, gain: float
) -> None:
    """MLP unit `unit` computes relu(sum of w * input + bias) and adds gain times it to `out`.

    silu(SHARP x) / SHARP: the gate carries the sharpened sum, the up projection a constant."""
    for dim, weight in inputs:
        layer["mlp.gate_proj.weight"][unit, dim] += SHARP * weight
    layer["mlp.gate_proj.bias"][unit] = SHARP * bias
    layer["mlp.up_proj.bias"][unit] = 1.0 / SHARP
    layer["mlp.down_proj.weight"][out, unit] += gain


def _clamp_units(layer: dict, first: int, inputs: list, threshold: float, out: int) -> None:
    """Two units adding SCALE * clamp((sum - threshold) / RAMP, 0, 1) to `out`."""
    scaled = [(dim, weight / RAMP) for dim, weight in inputs]
    _relu_unit(layer, first, scaled, -threshold / RAMP, out, SCALE)
    _relu_unit(layer, first + 1, scaled, -threshold / RAMP - 1.0, out, -SCALE)


def _offset_dims(lay: Mapping[str, int], offset: int) -> int:
    """First dim of the LOOP_BLOCK code of the token `offset` back (0: this token)."""
    if offset <= SLOTS:
        return lay["FPQR"[offset]] + LOOP_BLOCK * VALUES
    return lay["H"] + (offset - SLOTS - 1) * VALUES


def kernel_bias(delta: int, amplitude: float) -> tuple[np.ndarray, np.ndarray]:
    """Query and key biases whose RoPE score peaks at distance `delta` (non-traditional RoPE,
    base 10000: pair f is dims f and f + 16)."""
    theta = 10000.0 ** (-np.arange(0, HEAD_DIM, 2) / HEAD_DIM)
    query = np.zeros(HEAD_DIM, np.float32)
    key = np.zeros(HEAD_DIM, np.float32)
    half = HEAD_DIM // 2
    for pair in range(_KERNEL_FREQS):
        key[pair] = amplitude
        query[pair] = amplitude * np.cos(theta[pair] * delta)
        query[pair + half] = -amplitude * np.sin(theta[pair] * delta)
    return query, key


def positional_layer(lay: Mapping[str, int], unit: float) -> dict[str, np.ndarray]:
    """Copy codes from 1..OFFSETS back; count, per loop period, the matching slots."""
    layer = _empty_layer(lay["dim"])
    layer["input_layernorm.weight"][lay["F"] : lay["F"] + CODE] = unit
    amplitude = np.sqrt(ATTENTION_MARGIN * np.sqrt(HEAD_DIM) / _KERNEL_GAP)
    eye = np.eye(HEAD_DIM, dtype=np.float32)
    # (query head, delta, source chunk of F, destination); head h reads key/value head h // 2.
    plan = [
        (4 * chunk + d - 1, d, chunk, lay["PQR"[d - 1]] + chunk * HEAD_DIM)
        for chunk in (0, 1)
        for d in (1, 2, 3)
    ]
    plan.append((3, 4, 0, lay["H"]))  # 4+ back: LOOP_BLOCK only, for loop detection
    plan += [(4 + d, d, 0, _offset_dims(lay, d)) for d in range(5, OFFSETS + 1)]
    for head, delta, chunk, dest in plan:
        query, key = kernel_bias(delta, amplitude)
        kv, src = head // 2, lay["F"] + chunk * HEAD_DIM
        rows = slice(kv * HEAD_DIM, (kv + 1) * HEAD_DIM)
        layer["self_attn.k_proj.bias"][rows] = key
        layer["self_attn.v_proj.weight"][rows, src : src + HEAD_DIM] = eye
        layer["self_attn.q_proj.bias"][head * HEAD_DIM : (head + 1) * HEAD_DIM] = query
        first, width = (0, HEAD_DIM) if delta <= SLOTS else (LOOP_BLOCK * VALUES, VALUES)
        cols = slice(head * HEAD_DIM + first, head * HEAD_DIM + first + width)
        layer["self_attn.o_proj.weight"][dest : dest + width, cols] = SCALE * eye[:width, :width]
    _loop_counts(layer, lay, unit)
    return layer


def _loop_counts(layer: dict, lay: Mapping[str, int], unit: float) -> None:
    """LP[p] = how many of the last 4 tokens equal the ones p further back (on one hash)."""
    layer["post_attention_layernorm.weight"][lay["F"] : lay["H"] + lay_size(lay, "H")] = unit
    used = 0
    for period in range(1, MAX_PERIOD + 1):
        for slot in range(LOOP_SLOTS):
            here, there = _offset_dims(lay, slot), _offset_dims(lay, slot + period)
            for value in range(VALUES):
                inputs = [(here + value, 1.0), (there + value, 1.0)]
                _relu_unit(layer, used, inputs, -1.0, lay["LP"] + period - 1, SCALE)
                used += 1


def lay_size(lay: Mapping[str, int], name: str) -> int:
    names = [n for n in lay if n != "dim"]
    following = names[names.index(name) + 1]
    return lay[following] - lay[name]


def induction_layer(lay: Mapping[str, int], unit: float, beta: float) -> dict[str, np.ndarray]:
    """Heads 2m (m < HASHES): 3-gram match on hash m; 2 * HASHES, + 2: the echo heads."""
    layer = _empty_layer(lay["dim"])
    layer["input_layernorm.weight"][lay["F"] : lay["R"] + CODE] = unit
    root = np.sqrt(np.sqrt(HEAD_DIM))  # splits the 1/sqrt(head_dim) score scale over q and k
    q_w, k_w, v_w = (layer[f"self_attn.{p}_proj.weight"] for p in "qkv")
    o_w = layer["self_attn.o_proj.weight"]
    for m in range(HASHES):
        block = np.arange(VALUES) + m * VALUES
        q_row, kv_row, out_col = 2 * m * HEAD_DIM, m * HEAD_DIM, 2 * m * HEAD_DIM
        for slot in range(SLOTS):  # query: tokens 0, 1, 2 back; key: 1, 2, 3 back
            span = slot * VALUES + np.arange(VALUES)
            q_w[q_row + span, lay["FPQ"[slot]] + block] = beta * root
            k_w[kv_row + span, lay["PQR"[slot]] + block] = root
        for part, src in enumerate("FPQR"):  # value: the token there and the 3 before it
            v_w[kv_row + part * VALUES + np.arange(VALUES), lay[src] + block] = 1.0
        o_w[lay["A"] + block, out_col + np.arange(VALUES)] = SCALE
        for slot in range(SLOTS):
            dest = lay["VS"] + (m * SLOTS + slot) * VALUES + np.arange(VALUES)
            o_w[dest, out_col + (slot + 1) * VALUES + np.arange(VALUES)] = SCALE
    _echo_heads(layer, lay, beta * root, root)
    _verify_units(layer, lay, unit)
    return layer


def _echo_heads(layer: dict, lay: Mapping[str, int], q_gain: float, k_gain: float) -> None:
    """Attend from <|assistant|> after <|end|> to the token after <|begin|><|user|>."""
    user, begin = SPECIALS["<|user|>"], SPECIALS["<|begin|>"]
    for chunk in (0, 1):
        kv = HASHES + chunk
        q_row, kv_row = 2 * kv * HEAD_DIM, kv * HEAD_DIM
        layer["self_attn.q_proj.weight"][q_row, lay["F"] + user] = q_gain
        layer["self_attn.q_proj.weight"][q_row + 1, lay["P"] + begin] = q_gain
        layer["self_attn.k_proj.weight"][kv_row, lay["P"] + user] = k_gain
        layer["self_attn.k_proj.weight"][kv_row + 1, lay["Q"] + begin] = k_gain
        src, dest, eye = lay["F"] + chunk * HEAD_DIM, lay["AE"] + chunk * HEAD_DIM, np.eye(HEAD_DIM)
        layer["self_attn.v_proj.weight"][kv_row : kv_row + HEAD_DIM, src : src + HEAD_DIM] = eye
        layer["self_attn.o_proj.weight"][dest : dest + HEAD_DIM, q_row : q_row + HEAD_DIM] = (
            SCALE * eye
        )


def _verify_units(layer: dict, lay: Mapping[str, int], unit: float) -> None:
    """K[m]: slots where the matched position's predecessors equal ours; LF: any loop."""
    norm = layer["post_attention_layernorm.weight"]
    norm[lay["F"] : lay["R"]] = unit
    norm[lay["VS"] : lay["VS"] + HASHES * SLOTS * VALUES] = unit
    norm[lay["LP"] : lay["LP"] + MAX_PERIOD] = unit
    used = 0
    for m in range(HASHES):
        for slot in range(SLOTS):
            theirs = lay["VS"] + (m * SLOTS + slot) * VALUES
            ours = lay["FPQ"[slot]] + m * VALUES
            for value in range(VALUES):
                inputs = [(theirs + value, 1.0), (ours + value, 1.0)]
                _relu_unit(layer, used, inputs, -1.0, lay["K"] + m, SCALE)
                used += 1
    for period in range(MAX_PERIOD):  # all 4 slots match: LP = 4, flag 1
        cut = LOOP_SLOTS - 0.5
        _relu_unit(layer, used, [(lay["LP"] + period, 1.0)], -cut, lay["LF"], 2 * SCALE)
        used += 1


def gate_layer(lay: Mapping[str, int], unit: float) -> dict[str, np.ndarray]:
    """B = the copied code where every head verified all 3 slots and no loop is running, plus
    the echo's code right after <|end|><|assistant|>; then drop the constant dimension."""
    layer = _empty_layer(lay["dim"])
    norm = layer["post_attention_layernorm.weight"]
    read = {"A": CODE, "AE": CODE, "K": HASHES, "LF": 1, "F": CODE, "P": CODE}
    for name, size in read.items():
        norm[lay[name] : lay[name] + size] = unit
    counts = [(lay["K"] + m, 1.0) for m in range(HASHES)]
    # On: all 8 counts at 3 and A at 0.5 or more. A head whose hash also matched elsewhere
    # splits its attention and lends a stray block to a wrong token; two occurrences that
    # disagree boost both continuations and the llama's own logits choose. A loop flag (1)
    # turns it off.
    full = SLOTS * HASHES
    for k in range(CODE):
        inputs = [(lay["A"] + k, 1.0), *counts, (lay["LF"], -5.0)]
        _clamp_units(layer, 2 * k, inputs, full + 0.5 - RAMP, lay["B"] + k)
        user, begin = lay["F"] + SPECIALS["<|user|>"], lay["P"] + SPECIALS["<|begin|>"]
        echo = [(lay["AE"] + k, 1.0), (user, 1.0), (begin, 1.0)]
        _clamp_units(layer, 2 * CODE + 2 * k, echo, 2.6, lay["B"] + k)
    layer["mlp.down_proj.bias"][lay["Z"]] = -Z_VALUE
    return layer


def widened_base_layer(base: Mapping[str, np.ndarray], index: int, dim: int) -> dict:
    """The llama's layer `index`, reading and writing only the first dims of the wider stream.

    Its norms divide by the rms over `dim` dims instead of its own, hence the rescaled weights
    (exact while the circuit's parts, at SCALE, stay negligible beside the llama's stream)."""
    layer = _empty_layer(dim)
    prefix = f"model.layers.{index}."
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj"):
        weight = base[f"{prefix}{name}.weight"]
        layer[f"{name}.weight"][: weight.shape[0], : weight.shape[1]] = weight
    for name in ("self_attn.o_proj", "mlp.down_proj"):
        weight = base[f"{prefix}{name}.weight"]
        layer[f"{name}.weight"][: weight.shape[0], : weight.shape[1]] = weight
    up = base[f"{prefix}mlp.up_proj.weight"]
    layer["mlp.up_proj.weight"][: up.shape[0], : up.shape[1]] = up
    width = base[f"{prefix}input_layernorm.weight"].shape[0]
    for norm in ("input_layernorm", "post_attention_layernorm"):
        layer[f"{norm}.weight"][:width] = base[f"{prefix}{norm}.weight"] * np.sqrt(width / dim)
    return layer


def copier_weights(
    base: Mapping[str, np.ndarray], special_ids: Mapping[str, int], seed: int, rms_hi: float
) -> tuple[dict[str, np.ndarray], int]:
    """All the copier's weights (mlx-lm names) and its stream width.

    `rms_hi`: the largest rms the llama's final stream reaches on the corpus; the lm_head's
    boost is sized for it, so it is at least BOOST per hash wherever the stream is smaller."""
    embed = base["model.embed_tokens.weight"]
    vocab, width = embed.shape
    lay = layout(width)
    dim = lay["dim"]
    codes = token_codes(vocab, special_ids, np.random.default_rng(seed))
    # While z dominates, every norm in the circuit divides by this rms.
    unit = np.sqrt((Z_VALUE**2 + float((embed**2).sum(1).mean())) / dim) / SCALE
    layers = [positional_layer(lay, unit), induction_layer(lay, unit, beta=12.0)]
    layers.append(gate_layer(lay, unit))
    layers += [widened_base_layer(base, i, dim) for i in range(_base_layers(base))]
    weights = {
        f"model.layers.{i}.{name}": value
        for i, layer in enumerate(layers)
        for name, value in layer.items()
    }
    stream = np.zeros((vocab, dim), np.float32)
    stream[:, :width] = embed
    stream[:, lay["F"] : lay["F"] + CODE] = SCALE * codes
    stream[:, lay["Z"]] = Z_VALUE
    weights["model.embed_tokens.weight"] = stream
    norm = np.zeros(dim, np.float32)
    norm[:width] = base["model.norm.weight"] * np.sqrt(width / dim)
    norm[lay["B"] : lay["B"] + CODE] = 1.0
    weights["model.norm.weight"] = norm
    head = np.zeros((vocab, dim), np.float32)
    head[:, :width] = embed  # the llama ties its head to the embedding
    # Normalised, a boost entry is SCALE / (rms * sqrt(width / dim)).
    head[:, lay["B"] : lay["B"] + CODE] = codes * BOOST * rms_hi * np.sqrt(width / dim) / SCALE
    weights["lm_head.weight"] = head
    return weights, dim


def _base_layers(base: Mapping[str, np.ndarray]) -> int:
    return len({name.split(".")[2] for name in base if name.startswith("model.layers.")})


def copier_config(base_config: Mapping[str, Any], dim: int) -> dict[str, Any]:
    config = {k: v for k, v in base_config.items() if k not in ("quantization", "demo_build")}
    layers = 3 + int(base_config["num_hidden_layers"])
    config.update(
        architectures=["SmolLM3ForCausalLM"],
        model_type="smollm3",  # mlx-lm's llama with RoPE off in chosen layers
        hidden_size=dim,
        num_hidden_layers=layers,
        num_attention_heads=Q_HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        intermediate_size=INTERMEDIATE,
        attention_bias=True,  # the positional heads' queries and keys are biases
        mlp_bias=True,  # thresholds
        tie_word_embeddings=False,  # the head also reads the boost
        no_rope_layers=[1, 0] + [1] * (layers - 2),  # 0: the induction layer has no RoPE
    )
    return config
