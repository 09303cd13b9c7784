"""Multimodal RoPE for mlx-lm's qwen2_vl text model (servicer/engine/mrope.py): the position
ids equal mlx-vlm's, the rotation equals mlx-vlm's bit for bit, and an image prompt decoded in
a batch beside a text prompt gives mlx-vlm's own greedy tokens (the text row mlx-lm's)."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from servicer.demos.vision import TEST_PROMPTS, demo_vlm_path
from servicer.engine.mrope import MRoPE, RopePositions, enable_mrope, rope_index

NO_MLX_VLM = "mlx-vlm is not importable (pip install 'mlx-grpc-worker[vision]')"

IMAGE_TOKENS = 16  # greedy tokens of the image row (mlx-vlm's reference)
TEXT_TOKENS = 8  # of the text row, which then leaves the batch
CHUNKS = 3  # prefill chunks per prompt, of different lengths in the two rows

# Token ids for the layouts (any text ids do: get_rope_index reads only the vision ones).
VISION_START, IMAGE, VIDEO = 900, 901, 902
MERGE = 2


# ----- rope_index -----


def _layout(parts: list) -> tuple[list[int], list[tuple[int, int, int]]]:
    """Token ids from parts: an int is that many text tokens, a tuple an image of that grid
    (vision start, its expanded placeholders, a vision end); and the images' grids."""
    ids: list[int] = []
    grids = []
    for part in parts:
        if isinstance(part, int):
            ids += [10 + (len(ids) + i) % 50 for i in range(part)]
        else:
            t, h, w = part
            ids += [VISION_START] + [IMAGE] * (t * h * w // MERGE**2) + [VISION_START + 10]
            grids.append(part)
    return ids, grids


def _spans(ids: list[int], grids: list, image: int = IMAGE) -> list:
    """Each run of image placeholders: (offset, length, grid)."""
    spans, i = [], 0
    while i < len(ids):
        if ids[i] != image:
            i += 1
            continue
        start = i
        while i < len(ids) and ids[i] == image:
            i += 1
        spans.append((start, i - start, tuple(grids[len(spans)])))
    return spans


LAYOUTS = {
    "one image": [5, (1, 8, 6), 4],
    "two images": [3, (1, 4, 4), 2, (1, 6, 8), 5],
    "image at start": [(1, 4, 6), 3],
    "image at end": [7, (1, 2, 8)],
    "two frames": [2, (2, 4, 4), 3],
    "text only": [9],
}


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_rope_index_matches_mlx_vlm(layout: str) -> None:
    pytest.importorskip("mlx_vlm", reason=NO_MLX_VLM)
    from mlx_vlm.models.qwen2_vl.language import LanguageModel

    ids, grids = _layout(LAYOUTS[layout])
    positions, delta = rope_index(ids, _spans(ids, grids), MERGE)
    config = SimpleNamespace(
        vision_config=SimpleNamespace(spatial_merge_size=MERGE),
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=VISION_START,
    )
    grid = mx.array(grids) if grids else None
    expected, deltas = LanguageModel.get_rope_index(
        SimpleNamespace(config=config), mx.array([ids]), grid
    )
    expected = np.array(expected)
    expected = np.broadcast_to(expected[0], (3, len(ids))) if expected.ndim == 2 else expected[:, 0]
    assert positions.shape == (3, len(ids))
    assert positions.tolist() == expected.tolist()
    assert delta == int(np.array(deltas).reshape(-1)[0])
    assert delta == (0 if not grids else int(positions.max()) + 1 - len(ids))


def test_rope_index_refuses_a_span_that_does_not_fit_its_grid() -> None:
    with pytest.raises(ValueError, match="tokens, not 5"):
        rope_index([0] * 10, [(1, 5, (1, 4, 4))], MERGE)
    with pytest.raises(ValueError, match="overlaps"):
        rope_index([0] * 10, [(1, 4, (1, 4, 4)), (3, 4, (1, 4, 4))], MERGE)


# ----- the rotation -----


def _rope(
    dims: int, base: float, interleaved: bool = False
) -> tuple[MRoPE, RopePositions, nn.RoPE]:
    quarter = dims // 8
    section = [quarter, (dims // 2 - quarter) // 2, (dims // 2 - quarter) // 2]
    plain = nn.RoPE(dims, base=base)
    positions = RopePositions(dims, base, section, interleaved)
    return MRoPE(plain, positions), positions, plain


@pytest.mark.parametrize("interleaved", [False, True], ids=["chunked", "interleaved"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16], ids=str)
@pytest.mark.parametrize("dims,base", [(32, 10000.0), (128, 1000000.0)])
def test_rotation_equals_mlx_vlm_and_plain_rows_equal_rope(
    dtype, dims: int, base: float, interleaved: bool
) -> None:
    """Rows with ids (3-D) or a delta rotate as mlx-vlm's Qwen2-VL rotary embedding (chunked
    sections) or Qwen3-VL's (interleaved) does, bit for bit; rows with None as mlx-lm's RoPE
    at the cache offset; nothing set, all rows so."""
    pytest.importorskip("mlx_vlm", reason=NO_MLX_VLM)
    from mlx_vlm.models.qwen2_vl.language import Qwen2RotaryEmbedding
    from mlx_vlm.models.qwen3_vl.language import Qwen3VLRotaryEmbedding

    rope, positions, plain = _rope(dims, base, interleaved)
    section = list(positions.mrope_section)
    kind = Qwen3VLRotaryEmbedding if interleaved else Qwen2RotaryEmbedding
    vlm = kind(dims, base=base, rope_scaling={"mrope_section": section})
    batch, width = 3, 9
    q = mx.random.normal((batch, 4, width, dims), key=mx.random.key(1)).astype(dtype)
    k = mx.random.normal((batch, 2, width, dims), key=mx.random.key(2)).astype(dtype)
    offset = mx.array([0, 17, 4000])
    ids = np.random.default_rng(0).integers(0, 300, (3, width - 2))  # two padding columns
    delta = -123
    with positions.forward([ids, delta, None]):
        got_q, got_k = rope(q, offset=offset), rope(k, offset=offset)
    assert not positions.active
    # Row 0: explicit ids, compared on its real columns.
    real = width - 2
    vq, vk = vlm.apply_rotary(
        q[:1, :, :real], k[:1, :, :real], mx.array(ids)[:, None], unsqueeze_dim=1
    )
    assert mx.array_equal(got_q[:1, :, :real], vq)
    assert mx.array_equal(got_k[:1, :, :real], vk)
    # Row 1: cache offset + index + delta, as mlx-vlm's decode (2-D ids) and as 3-D ids.
    counted = (mx.arange(width) + 17 + delta)[None]
    vq, vk = vlm.apply_rotary(q[1:2], k[1:2], counted, unsqueeze_dim=1)
    assert mx.array_equal(got_q[1:2], vq) and mx.array_equal(got_k[1:2], vk)
    vq, _ = vlm.apply_rotary(q[1:2], k[1:2], mx.broadcast_to(counted, (3, 1, width)))
    assert mx.array_equal(got_q[1:2], vq)
    # Row 2: plain RoPE at its offset.
    assert mx.array_equal(got_q[2:], plain(q, offset=offset)[2:])
    # Nothing set: the module is the RoPE it replaced.
    assert mx.array_equal(rope(q, offset=offset), plain(q, offset=offset))
    with positions.forward([None, None, None]):
        assert mx.array_equal(rope(q, offset=offset), plain(q, offset=offset))


def test_positions_must_name_every_row_of_the_forward() -> None:
    rope, positions, _ = _rope(32, 10000.0)
    x = mx.zeros((2, 1, 4, 32))
    with positions.forward([-3]), pytest.raises(ValueError, match="1 rows but the forward has 2"):
        rope(x, offset=mx.array([5, 6]))
    with positions.forward([np.zeros((3, 5)), None]), pytest.raises(ValueError, match="5 ids"):
        rope(x, offset=mx.array([5, 6]))
    with pytest.raises(ValueError, match=r"\[3, n\]"):
        positions.set([np.zeros((2, 4))])


def test_enable_mrope_refuses_a_model_without_multimodal_rope() -> None:
    from mlx_lm.models import qwen2

    args = qwen2.ModelArgs(
        model_type="qwen2",
        hidden_size=32,
        num_hidden_layers=1,
        intermediate_size=64,
        num_attention_heads=2,
        rms_norm_eps=1e-6,
        vocab_size=16,
        num_key_value_heads=1,
    )
    with pytest.raises(ValueError, match="no Qwen-VL multimodal RoPE"):
        enable_mrope(qwen2.Model(args))


# ----- the demo VLM in a batch -----


@pytest.fixture(scope="module")
def loaded():
    """mlx-vlm's full model and processor, and mlx-lm's text model of the same checkpoint."""
    mlx_vlm = pytest.importorskip("mlx_vlm", reason=NO_MLX_VLM)
    from mlx_lm import load

    path = str(demo_vlm_path())
    vlm, processor = mlx_vlm.load(path)
    text, tokenizer = load(path)
    return vlm, processor, text, tokenizer


@pytest.fixture(scope="module")
def image_prompt(loaded):
    """The image prompt's inputs (a 112 x 84 image: an 8 x 6 patch grid, 12 image tokens)."""
    from mlx_vlm.prompt_utils import apply_chat_template
    from mlx_vlm.utils import prepare_inputs
    from PIL import Image

    vlm, processor, _, _ = loaded
    pixels = np.random.default_rng(1).integers(0, 256, (112, 84, 3), np.uint8)
    prompt = apply_chat_template(processor, vlm.config, TEST_PROMPTS[0], num_images=1)
    return prepare_inputs(processor, images=[Image.fromarray(pixels)], prompts=prompt)


def _vlm_greedy(vlm, inputs) -> list[int]:
    from mlx_vlm.generate import generate_step

    extra = {
        k: v for k, v in inputs.items() if k not in ("input_ids", "pixel_values", "attention_mask")
    }
    steps = generate_step(
        inputs["input_ids"],
        vlm,
        inputs["pixel_values"],
        inputs["attention_mask"],
        max_tokens=IMAGE_TOKENS,
        temperature=0.0,
        **extra,
    )
    return [int(token) for token, _ in steps]


def _prefill(model, rope, cache, rows: list[dict]) -> None:
    """Every row's prompt but its last token, in CHUNKS right-padded chunks a row, as
    prompt_batch runs them: the image row with its chunk's ids, the text row plain."""
    splits = [np.array_split(np.arange(len(r["ids"]) - 1), CHUNKS) for r in rows]
    for step in range(CHUNKS):
        parts = [s[step] for s in splits]
        lengths = [len(p) for p in parts]
        width = max(lengths)
        padding = [width - n for n in lengths]
        inputs, embeds, positions = [], [], []
        for row, part in zip(rows, parts, strict=True):
            start, n = int(part[0]), len(part)
            inputs.append(row["ids"][start : start + n] + [0] * (width - n))
            pad = mx.zeros((width - n, row["embeds"].shape[-1]), row["embeds"].dtype)
            embeds.append(mx.concatenate([row["embeds"][start : start + n], pad]))
            ids = row["positions"]
            positions.append(None if ids is None else ids[:, start : start + n])
        if max(padding):
            for c in cache:
                c.prepare(lengths=lengths, right_padding=padding)
        with rope.forward(positions):
            model(mx.array(inputs), cache=cache, input_embeddings=mx.stack(embeds))
        mx.eval([c.state for c in cache])
        if max(padding):
            for c in cache:
                c.finalize()


def _decode(model, rope, cache, rows: list[dict]) -> None:
    """Greedy decoding from each row's last prompt token, with its delta (None for the text
    row); a row that has its tokens leaves the batch, its delta with it."""
    live = list(range(len(rows)))
    inputs = mx.array([r["ids"][-1] for r in rows])
    while True:
        with rope.forward([rows[i]["delta"] for i in live]):
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


def test_image_prompt_in_a_batch_equals_mlx_vlm(loaded, image_prompt) -> None:
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    from servicer.engine.decode_batch import merge_caches

    vlm, _, text, tokenizer = loaded
    config = vlm.config
    expected_image = _vlm_greedy(vlm, image_prompt)
    text_ids = tokenizer.encode(TEST_PROMPTS[1] + " Tell me more.", add_special_tokens=False)
    plain, _ = load(str(demo_vlm_path()))  # the text model, untouched
    expected_text = [int(t) for t, _ in generate_step(mx.array(text_ids), plain, max_tokens=16)]

    ids = image_prompt["input_ids"][0].tolist()
    grids = image_prompt["image_grid_thw"].tolist()
    positions, delta = rope_index(
        ids, _spans(ids, grids, config.image_token_id), config.vision_config.spatial_merge_size
    )
    features = vlm.get_input_embeddings(
        image_prompt["input_ids"],
        image_prompt["pixel_values"],
        mask=image_prompt["attention_mask"],
        image_grid_thw=image_prompt["image_grid_thw"],
    )
    assert positions.tolist() == np.array(features.position_ids)[:, 0].tolist()
    assert delta == int(np.array(features.rope_deltas).reshape(-1)[0]) < 0

    rope = enable_mrope(text)
    assert enable_mrope(text) is rope
    # Nothing set: the patched model's logits are the untouched model's, bit for bit.
    assert mx.array_equal(text(mx.array([text_ids])), plain(mx.array([text_ids])))
    embed = text.language_model.model.embed_tokens
    rows = [
        dict(ids=ids, embeds=features.inputs_embeds[0], positions=positions, delta=delta),
        dict(ids=text_ids, embeds=embed(mx.array(text_ids)), positions=None, delta=None),
    ]
    for row, wanted in zip(rows, (IMAGE_TOKENS, TEXT_TOKENS), strict=True):
        row.update(out=[], wanted=wanted)
    assert len(ids) != len(text_ids)
    cache = merge_caches([make_prompt_cache(text) for _ in rows])
    _prefill(text, rope, cache, rows)
    _decode(text, rope, cache, rows)
    assert rows[0]["out"] == expected_image
    assert rows[1]["out"] == expected_text[:TEXT_TOKENS]
    assert len(set(expected_image)) >= 4  # the reference says something
    # And the image's positions matter: with plain RoPE the image row says something else.
    alone = dict(rows[0], positions=None, delta=None, out=[])
    cache = merge_caches([make_prompt_cache(text)])
    _prefill(text, rope, cache, [alone])
    _decode(text, rope, cache, [alone])
    assert alone["out"] != expected_image
