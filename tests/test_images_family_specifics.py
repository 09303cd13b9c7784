"""What one vision-language family does that the others do not, beside the checks every family
gets (tests/test_images_families.py): the worker's own processors against mlx-vlm's, bit for
bit (InternVL's and Kimi-VL's numpy builds of MLX code, Aya Vision's PIL build); Llama 4's,
mlx-vlm's with the global tile mlx-vlm leaves out; LFM2-VL's and Llama 4's processors run
without MLX; GLM-4V's partial multimodal RoPE; Gemma 4's refusal of images that
attend both ways; the tiling of the images the family checks ask about; and smg's refusal of
LLaVA-OneVision under a name holding "llava"."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import demo_config
from support import SMG, ServerThread
from test_images import data_url, needs_vlm, png
from test_images_families import QUESTION, quirks
from vlm_support import chat_through_a_router, loaded, reference, what_the_worker_gets

from servicer.server import ModelSpec

# mlx-vlm's Kimi-VL processor reads pixels with Pillow's deprecated getdata.
pytestmark = [needs_vlm, pytest.mark.filterwarnings("ignore:Image.Image.getdata")]


def vlm_dir_of(family: str) -> Path:
    from servicer.demos.vision import demo_vlm_path

    return demo_vlm_path(family=family)


def workers_processor(vlm_dir: Path):
    """The processor the worker runs for the checkpoint (servicer.images)."""
    from transformers import AutoTokenizer

    from servicer.images import _processor
    from servicer.vision_families import vision_spec

    config = json.loads((vlm_dir / "config.json").read_text())
    return _processor(vlm_dir, vision_spec(config, AutoTokenizer.from_pretrained(str(vlm_dir))))


# family: (prompt text, images, their sides' range, the first image's size or None, keywords
# mlx-vlm's processor takes)
PROCESSORS = {
    # transformers' AyaVisionProcessor, its PIL image processor.
    "aya_vision": ("<image>", 12, (8, 300), None, {"add_special_tokens": False}),
    # servicer.numpy_processors: mlx-vlm's tiling (which normalises with MLX) in numpy.
    "internvl_chat": ("<|user|><image>Hi<|end|>", 24, (8, 400), None, {"return_tensors": "np"}),
    # servicer.numpy_processors: mlx-vlm's native patches in numpy, the first image past the
    # patch limit.
    "kimi_vl": (
        "<|media_start|>image<|media_content|><|media_pad|><|media_end|>Hi",
        16,
        (28, 300),
        (1500, 1200),
        {},
    ),
}


@pytest.mark.parametrize("family", PROCESSORS)
def test_the_workers_processor_is_mlx_vlms_bit_for_bit(family):
    """On images of many sizes and aspect ratios (every fourth a square: ties), the worker's
    processor makes mlx-vlm's pixels bit for bit, and its prompt and other inputs alike."""
    from PIL import Image

    text, count, sides, first, keywords = PROCESSORS[family]
    vlm_dir = vlm_dir_of(family)
    _, processor = loaded(str(vlm_dir))
    mine = workers_processor(vlm_dir)
    rng = np.random.default_rng(0)
    for i in range(count):
        w, h = (int(v) for v in rng.integers(*sides, 2))
        w, h = first if i == 0 and first else (h if i % 4 == 0 else w, h)
        image = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        want = processor(text=text, images=[image], **keywords)
        got = mine(text=text, images=[image], **{"return_tensors": "np", **keywords})
        pixels = np.asarray(want["pixel_values"])
        assert pixels.dtype == np.asarray(got["pixel_values"]).dtype == np.float32
        assert np.array_equal(
            pixels.view(np.uint32), np.asarray(got["pixel_values"]).view(np.uint32)
        )
        for key in set(want) & set(got) - {"pixel_values", "attention_mask"}:
            assert np.asarray(want[key]).tolist() == np.asarray(got[key]).tolist(), key


def test_llama4s_processor_is_mlx_vlms_with_the_global_tile():
    """mlx-vlm 0.7.10's Llama 4 processor writes a global tile's <|patch|> run for a tiled
    image but makes no such tile (its model's merge then reads past the features): the
    worker's makes mlx-vlm's prompt and local tiles bit for bit, then the whole image resized
    to one tile (PIL bicubic, mlx-vlm's normalisation), so the features fill the runs; a
    one-tile image's output is mlx-vlm's untouched."""
    from mlx_vlm.models.llama4.processing_llama4 import Llama4Processor
    from PIL import Image

    vlm_dir = vlm_dir_of("llama4")
    untouched = Llama4Processor.from_pretrained(str(vlm_dir))
    mine = workers_processor(vlm_dir)
    patch, size = mine.tokenizer.convert_tokens_to_ids("<|patch|>"), untouched.image_processor.size
    per_tile = (size // untouched.patch_size) ** 2 // untouched.downsample_ratio
    rng, grids = np.random.default_rng(0), set()
    sizes = [(64, 48), (30, 90), (96, 40), (200, 50), (40, 160), (300, 90), (56, 56), (90, 30)]
    sizes += [tuple(int(v) for v in rng.integers(8, 400, 2)) for _ in range(16)]
    for w, h in sizes:
        image = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        want = untouched(text="<|image|>", images=[image], add_special_tokens=False)
        got = mine(text="<|image|>", images=[image], return_tensors="np", add_special_tokens=False)
        ids = np.asarray(got["input_ids"]).reshape(-1)
        assert np.asarray(want["input_ids"]).reshape(-1).tolist() == ids.tolist()
        local, pixels = np.asarray(want["pixel_values"]), np.asarray(got["pixel_values"])
        assert pixels.dtype == local.dtype == np.float32
        assert int((ids == patch).sum()) == len(pixels) * per_tile  # the runs, filled
        grids.add(len(local))
        if len(local) == 1:  # one tile: no global tile, mlx-vlm's output as it is
            assert np.array_equal(pixels.view(np.uint32), local.view(np.uint32))
            continue
        assert len(pixels) == len(local) + 1
        assert np.array_equal(pixels[:-1].view(np.uint32), local.view(np.uint32))
        whole = np.asarray(image.resize((size, size), Image.Resampling.BICUBIC), np.float32)
        whole = ((whole / 255.0 - 0.5) / 0.5).transpose(2, 0, 1)
        assert np.array_equal(pixels[-1], whole)
    assert {1, 2, 3, 4} <= grids  # one tile and several, both ways


# family: for the two images tests/test_images_families.py asks about alone, the tower inputs
# (tiles and the whole image, or patches) and the image tokens mlx-vlm's processor makes.
TILING = {
    "aya_vision": ([1, 4], [4, 16]),  # 1x1; 1x3 and the whole image; 4 tokens a tile
    "internvl_chat": ([1, 4], [4, 16]),  # 1x1; 1x3 and the thumbnail; 4 tokens a tile
    "llama4": ([1, 4], [4, 16]),  # 1x1; 3x1 and the global tile; 4 tokens a tile
    "kimi_vl": ([48, 40], [12, 10]),  # 14-pixel patches, a token a 2x2 block
    "lfm2_vl": ([7, 1], [108, 4]),  # 3x2 tiles and the thumbnail; the image whole
    "llava_onevision": ([5, 3], [37, 33]),  # the whole image and 2x2 tiles, 2x1 tiles
    "llava_next": ([5, 4], [37, 45]),  # the whole image and 2x2 tiles, 3x1 tiles
    "idefics3": ([5, 3], [20, 12]),  # 2x2 tiles, 2x1 tiles, each and the whole image
    "smolvlm": ([5, 3], [20, 12]),
}


@pytest.mark.parametrize("family", TILING)
def test_the_family_checks_ask_about_images_tiled_differently(family):
    ref = reference(family, quirks(family).image_last)
    views, tokens = [], []
    for image in quirks(family).alone:
        prompt, pixels, _ = ref.inputs(QUESTION, [png(*image)])
        views.append(pixels.shape[1] if pixels.ndim == 5 else pixels.shape[0])
        tokens.append(prompt.count(ref.spec.image_token_id))
    assert (views, tokens) == TILING[family]


@pytest.mark.parametrize(
    ("family", "anchor", "size", "views"),
    [("lfm2_vl", "<image>", (64, 48), 7), ("llama4", "<|image|>", (30, 90), 4)],
    ids=["lfm2_vl", "llama4"],
)
def test_the_handler_runs_mlx_vlms_processor_without_mlx(family, anchor, size, views):
    """The worker's LFM2-VL and Llama 4 processors are mlx-vlm's modules, loaded without the
    mlx_vlm package (Llama 4's with its global tile added): a process that builds one and
    expands an image imports no MLX."""
    import subprocess
    import sys

    probe = (
        "import sys, json, pathlib\n"
        "from PIL import Image\n"
        "from transformers import AutoTokenizer\n"
        "from servicer.images import _processor\n"
        "from servicer.vision_families import vision_spec\n"
        f"path = pathlib.Path({str(vlm_dir_of(family))!r})\n"
        "spec = vision_spec(json.loads((path / 'config.json').read_text()),"
        " AutoTokenizer.from_pretrained(str(path)))\n"
        f"out = _processor(path, spec)(text={anchor!r}, images=[Image.new('RGB', {size})],"
        " return_tensors='np', add_special_tokens=False)\n"
        "print(out['pixel_values'].shape[0], sorted(m for m in sys.modules"
        " if m == 'mlx' or m.startswith(('mlx.', 'mlx_vlm', 'mlx_lm'))))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.split("\n")[-2] == f"{views} []"


def test_a_gemma4_checkpoint_whose_images_attend_both_ways_is_served_as_text():
    """Google's Gemma 4 checkpoints set text_config.use_bidirectional_attention "vision"
    (mlx-vlm then lets an image's tokens attend to each other both ways): the worker's prefill
    is causal, so such a checkpoint is served as text, the reason logged; the demo is causal."""
    from servicer.vision_families import vision_refusal

    config = json.loads((vlm_dir_of("gemma4") / "config.json").read_text())
    assert vision_refusal(config) is None
    config["text_config"]["use_bidirectional_attention"] = "vision"
    assert "attend both ways" in (vision_refusal(config) or "")


@pytest.mark.parametrize("family", ["glm4v", "glm4v_moe"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_glm4v_partial_rotation_equals_mlx_vlm(family: str, dtype: str) -> None:
    """GLM-4V's multimodal RoPE over half the head (mlx-lm's glm4 rope: even/odd pairs;
    glm4_moe's: half-split) as the engine's MRoPE applies it equals mlx-vlm's, bit for bit,
    for a row of 3-D ids and a row of cache offset + delta; the other half passes through."""
    import importlib

    import mlx.core as mx
    import mlx.nn as nn

    from servicer.engine.mrope import MRoPE, RopePositions

    language = importlib.import_module(f"mlx_vlm.models.{family}.language")
    head, section = 32, [2, 3, 3]
    config = SimpleNamespace(rope_theta=10000.0, partial_rotary_factor=0.5, head_dim=head)
    config.__dict__.update(max_position_embeddings=4096, rope_scaling=None)
    vlm_rope = language.GLM4VRotaryEmbedding(config)
    plain = nn.RoPE(head // 2, traditional=family == "glm4v", base=10000.0)
    positions = RopePositions(head // 2, 10000.0, section)
    rope = MRoPE(plain, positions)
    kind = getattr(mx, dtype)
    q = mx.random.normal((2, 4, 7, head), key=mx.random.key(1)).astype(kind)
    k = mx.random.normal((2, 2, 7, head), key=mx.random.key(2)).astype(kind)
    ids = np.random.default_rng(0).integers(0, 300, (3, 7))
    with positions.forward([ids, -40]):
        got_q, got_k = rope(q, offset=mx.array([0, 57])), rope(k, offset=mx.array([0, 57]))
    counted = np.broadcast_to(np.arange(7) + 57 - 40, (3, 7))
    for row, row_ids in enumerate((ids, counted)):
        cos, sin = vlm_rope(q, mx.array(row_ids)[:, None])
        want_q, want_k = language.apply_multimodal_rotary_pos_emb(
            q[row : row + 1], k[row : row + 1], cos, sin, section
        )
        assert mx.array_equal(got_q[row : row + 1], want_q)
        assert mx.array_equal(got_k[row : row + 1], want_k)


@pytest.mark.skipif(SMG is None, reason="the smg router is a dev dependency")
def test_the_router_refuses_llava_onevision_under_the_demo_name(tmp_path):
    """smg 1.13 takes a served name holding "llava" for a LLaVA it processes itself, and
    finds no vision processor for this one: 400 before the worker sees anything (served
    under another name, tests/test_images_families.py's, it sends media references)."""
    vlm_dir = vlm_dir_of("llava_onevision")
    model = ModelSpec(str(vlm_dir), "mlx-grpc-worker-demo-vlm-llava_onevision")
    config = dataclasses.replace(demo_config(vlm_dir), protocols=("vllm",), model=model)
    url = data_url(png(46, (64, 48)))
    with ServerThread(config) as running, what_the_worker_gets(running) as sent:
        response = chat_through_a_router(running, tmp_path / "smg.log", QUESTION, url)
    assert response.status_code == 400, response.text
    assert "No vision processor found" in response.text
    assert sent == []


def transformers_packing(tiles, size, pinpoints, tile, newline):
    """transformers' LlavaNextModel.pack_image_features for one image, in numpy, step for step
    as torch does it (features [1 + n, side^2, hidden], the image's size (height, width))."""
    from transformers.image_processing_utils import select_best_resolution

    side = round(tiles.shape[1] ** 0.5)
    best_h, best_w = select_best_resolution(list(size), pinpoints)
    rows, cols = best_h // tile, best_w // tile
    grid = tiles[1:].reshape(rows, cols, side, side, -1).transpose(4, 0, 2, 1, 3)
    grid = grid.reshape(grid.shape[0], rows * side, cols * side)  # flatten(1, 2).flatten(2, 3)
    (height, width), (h, w) = size, grid.shape[1:]
    if width / height > w / h:
        pad = (h - int(round(height * (w / width), 7))) // 2
        grid = grid[:, pad : h - pad, :]
    else:
        pad = (w - int(round(width * (h / height), 7))) // 2
        grid = grid[:, :, pad : w - pad]
    ends = np.broadcast_to(newline[:, None, None], (*grid.shape[:-1], 1))
    grid = np.concatenate([grid, ends], axis=-1)
    return np.concatenate([tiles[0], grid.reshape(grid.shape[0], -1).T])


# (tile, patch, pinpoints): llava-v1.6's (336-pixel CLIP tiles) and the demo's.
LLAVA_NEXT_CONFIGS = [
    (336, 14, [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]),
    (42, 14, [[42, 84], [84, 42], [84, 84], [126, 42], [42, 126]]),
]
LLAVA_NEXT_SIZES = [(48, 64), (90, 30), (88, 99), (336, 336), (500, 333), (47, 1128), (1080, 1920)]


@pytest.mark.parametrize("config", LLAVA_NEXT_CONFIGS, ids=["llava-v1.6", "demo"])
def test_llava_next_features_are_transformers_packing_and_the_processors_count(config):
    """servicer.engine.anyres packs a LLaVA-NeXT image's tile features exactly as transformers does
    (each feature tagged by its tile, patch and channel), as many as transformers' processor
    expands `<image>` to ("default": the CLS token dropped); mlx-vlm's LLaVA-OneVision packing
    is the same but for its crop, which truncates where transformers rounds first: at 88 x 99
    and 47 x 1128 on llava-v1.6's tiles it crops a row a side more or less than the processor
    counts."""
    import mlx.core as mx
    from mlx_vlm.models.llava_onevision import llava_onevision
    from transformers.models.llava_next.processing_llava_next import LlavaNextProcessor

    from servicer.engine import anyres

    tile, patch, pinpoints = config
    side = tile // patch
    counter = SimpleNamespace(
        image_processor=SimpleNamespace(image_grid_pinpoints=pinpoints),
        patch_size=patch,
        num_additional_image_tokens=1,
    )
    counter._get_unpadded_features = lambda *a: LlavaNextProcessor._get_unpadded_features(
        counter, *a
    )
    truncated = []
    for size in LLAVA_NEXT_SIZES:
        rows, cols = anyres.grid(size, pinpoints, tile)
        n = 1 + rows * cols
        tiles = np.arange(n * side * side * 2, dtype=np.float64).reshape(n, side * side, 2)
        newline = np.array([-1.0, -2.0])
        want = transformers_packing(tiles, size, pinpoints, tile, newline)
        assert np.array_equal(anyres.pack(tiles, size, pinpoints, tile, newline), want)
        count = LlavaNextProcessor._get_number_of_features(counter, *size, tile, tile) - 1
        assert want.shape[0] == count, size
        grid = want[side * side :]
        cells = tiles[1:].reshape(rows, cols, side, side, 2).transpose(4, 0, 2, 1, 3)
        cropped = llava_onevision.unpad_image(cells.reshape(2, rows * side, cols * side), size)
        if cropped.shape[1] * (cropped.shape[2] + 1) != grid.shape[0]:
            truncated.append(size)
    assert truncated == ([(88, 99), (47, 1128)] if tile == 336 else [])
    size = (90, 30)
    rows, cols = anyres.grid(size, pinpoints, tile)
    tiles = mx.arange((1 + rows * cols) * side * side * 2).reshape(-1, side * side, 2)
    newline = mx.array([-1, -2])
    packed = anyres.pack(tiles, size, pinpoints, tile, newline)
    assert np.array_equal(
        np.array(packed), anyres.pack(np.array(tiles), size, pinpoints, tile, np.array(newline))
    )


def test_the_routers_copy_of_a_llava_next_checkpoint_names_another_model_type(tmp_path):
    """smg 1.13 expands a checkpoint whose config.json says llava_next itself, not as the
    processor does (17 image tokens for its 37 on the demo): the router's copy names another
    model type, the tokenizer files as they are, so it sends media references."""
    from servicer.tokenizer_bundle import router_tokenizer
    from servicer.vision_families import FAMILIES

    vlm_dir = vlm_dir_of("llava_next")
    copy = router_tokenizer(vlm_dir, "llava_next", "<image>", cache_dir=tmp_path)
    config = json.loads((copy / "config.json").read_text())
    assert config == json.loads((vlm_dir / "config.json").read_text()) | {
        "model_type": FAMILIES["llava_next"].router_model_type
    }
    assert (copy / "tokenizer.json").read_bytes() == (vlm_dir / "tokenizer.json").read_bytes()
