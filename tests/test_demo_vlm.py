"""The demo vision-language model: deterministic, in the shape the router expects, loaded and
run by mlx-vlm offline, with varied greedy output that depends on the image."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest

from servicer.demos import gemma3 as demo_vlm_gemma3
from servicer.demos import llava as demo_vlm_llava
from servicer.demos import mistral3 as demo_vlm_mistral3
from servicer.demos import qwen2_5_vl as demo_vlm_qwen2_5
from servicer.demos import text as demo_model
from servicer.demos.qwen2_vl import (
    CHAT_TEMPLATE,
    FAMILY,
    IMAGE_ANCHOR,
    IMAGE_PAD,
    VISION_END,
    VISION_PAD,
    VISION_START,
    VISION_TOKENS,
)
from servicer.demos.vision import (
    FAMILIES,
    TEST_PROMPTS,
    build_name,
    build_vlm,
    demo_vlm_path,
    get_family,
    is_finished_build,
)
from servicer.vision_families import FAMILIES as VISION_FAMILIES

MODEL_TYPE, TEXT_KIND, VLM_RECIPE_VERSION = (
    FAMILY.model_type,
    FAMILY.text_kind,
    FAMILY.recipe_version,
)

NO_MLX_VLM = "mlx-vlm is not importable (pip install 'mlx-grpc-worker[vision]')"

GREEDY_TOKENS = 32
IMAGE_SIDE = 112  # a multiple of 28 inside the pixel bounds: not resized, 8x8 patches
IMAGE_TOKENS = (IMAGE_SIDE // 28) ** 2


def _digests(path: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.iterdir())
        if p.is_file()
    }


@pytest.fixture(scope="session")
def text_model() -> Path:
    return demo_model.demo_model_path(TEXT_KIND)


@pytest.fixture(scope="session")
def built() -> Path:
    return demo_vlm_path()


@pytest.fixture(scope="module")
def images():
    import numpy as np
    from PIL import Image

    noise = np.random.default_rng(1).integers(0, 256, (IMAGE_SIDE, IMAGE_SIDE, 3), np.uint8)
    ramp = np.linspace(0, 255, IMAGE_SIDE, dtype=np.float32)
    gradient = np.stack(
        [
            np.add.outer(ramp, ramp) / 2,
            np.add.outer(ramp, 255 - ramp) / 2,
            255 - np.add.outer(ramp, ramp) / 2,
        ],
        axis=-1,
    ).astype(np.uint8)
    return Image.fromarray(noise), Image.fromarray(gradient)


@pytest.fixture(scope="module")
def loaded(built: Path):
    mlx_vlm = pytest.importorskip("mlx_vlm", reason=NO_MLX_VLM)
    return mlx_vlm.load(str(built))


def test_cache_layout(built: Path) -> None:
    assert built.name == build_name()
    # The qwen2_vl name predates the families, and stays (caches are keyed on it).
    name = f"demo-vlm-qwen2_vl-s0-{VLM_RECIPE_VERSION}-llama-{demo_model.RECIPE_VERSION}"
    assert build_name() == build_name(family="qwen2_vl") == name
    assert built.parent == demo_model.default_cache_dir()
    assert MODEL_TYPE in built.name and demo_model.RECIPE_VERSION in built.name
    assert is_finished_build(built)
    before = {p.name: p.stat().st_mtime_ns for p in built.iterdir()}
    assert demo_vlm_path() == built
    assert {p.name: p.stat().st_mtime_ns for p in built.iterdir()} == before


def test_builds_are_deterministic(built: Path, text_model: Path, tmp_path: Path) -> None:
    first = build_vlm(tmp_path / "a", text_model=text_model)
    second = build_vlm(tmp_path / "b", text_model=text_model)
    assert _digests(first) == _digests(second) == _digests(built)
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
    # Another seed draws another vision tower (the text model given stays the same).
    other = build_vlm(tmp_path / "c", seed=1, text_model=text_model)
    assert _digests(other)["model.safetensors"] != _digests(first)["model.safetensors"]


def test_config_and_tokens_for_the_router(built: Path) -> None:
    from tokenizers import Tokenizer

    config = json.loads((built / "config.json").read_text())
    tokenizer = Tokenizer.from_file(str(built / "tokenizer.json"))
    ids = {tok: tokenizer.token_to_id(tok) for tok in VISION_TOKENS}
    assert config["model_type"] == "qwen2_vl"  # the router knows the family by this
    assert config["vocab_size"] == tokenizer.get_vocab_size()
    # The router expands with vision_token_id; mlx-vlm places features at image_token_id.
    assert config["vision_token_id"] == ids[VISION_PAD]
    assert config["image_token_id"] == ids[IMAGE_PAD]
    assert config["vision_start_token_id"] == ids[VISION_START]
    assert config["vision_end_token_id"] == ids[VISION_END]
    assert config["vision_config"]["patch_size"] == 14
    # Each vision token encodes to itself, and the anchor to exactly three tokens.
    anchor = tokenizer.encode(IMAGE_ANCHOR, add_special_tokens=False).ids
    assert anchor == [ids[VISION_START], ids[IMAGE_PAD], ids[VISION_END]]
    pre = json.loads((built / "preprocessor_config.json").read_text())
    assert (pre["patch_size"], pre["merge_size"], pre["temporal_patch_size"]) == (14, 2, 2)
    assert pre["min_pixels"] <= IMAGE_SIDE**2 <= pre["max_pixels"]
    tok_config = json.loads((built / "tokenizer_config.json").read_text())
    assert tok_config["chat_template"] == CHAT_TEMPLATE


def test_chat_template_renders_one_anchor_per_image(built: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(built))
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image"},
                {"type": "text", "text": "Compare"},
                {"type": "image_url", "image_url": {"url": "data:,"}},
            ],
        },
        {"role": "assistant", "content": "Both are blue."},
        {"role": "user", "content": "Thanks."},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        f"<|begin|><|user|>{IMAGE_ANCHOR}Compare{IMAGE_ANCHOR}<|end|>"
        "<|assistant|>Both are blue.<|end|><|user|>Thanks.<|end|><|assistant|>"
    )


def _prompt(processor, config, question: str) -> str:
    from mlx_vlm.prompt_utils import apply_chat_template

    return apply_chat_template(processor, config, question, num_images=1)


def _greedy(
    model, processor, prompt: str, image, max_tokens: int = GREEDY_TOKENS
) -> tuple[list[int], int]:
    """Greedy tokens (EOS not stopping them) and the prompt's image-token count."""
    import mlx.core as mx
    from mlx_vlm.generate import generate_step
    from mlx_vlm.utils import prepare_inputs

    inputs = prepare_inputs(processor, images=[image], prompts=prompt)
    input_ids = inputs["input_ids"]
    extra = {
        k: v for k, v in inputs.items() if k not in ("input_ids", "pixel_values", "attention_mask")
    }
    tokens = [
        int(tok)
        for tok, _ in generate_step(
            input_ids,
            model,
            inputs["pixel_values"],
            inputs.get("attention_mask"),
            max_tokens=max_tokens,
            temperature=0.0,
            **extra,
        )
    ]
    image_token_id = getattr(model.config, "image_token_id", None)
    if image_token_id is None:  # gemma3's name for it
        image_token_id = model.config.image_token_index
    image_tokens = int(mx.sum(input_ids == image_token_id).item())
    return tokens, image_tokens


@pytest.mark.parametrize("question", TEST_PROMPTS)
def test_mlx_vlm_greedy_output_is_varied_and_depends_on_the_image(
    loaded, images, question: str
) -> None:
    model, processor = loaded
    prompt = _prompt(processor, model.config, question)
    assert prompt.count(IMAGE_ANCHOR) == 1
    outputs = []
    for image in images:
        tokens, image_tokens = _greedy(model, processor, prompt, image)
        assert image_tokens == IMAGE_TOKENS
        assert len(tokens) == GREEDY_TOKENS
        assert len(set(tokens)) >= 8, processor.tokenizer.decode(tokens)
        outputs.append(tokens)
    first, second = outputs
    assert first != second, processor.tokenizer.decode(first)
    # Greedy is deterministic.
    assert _greedy(model, processor, prompt, images[0])[0] == first


def test_mlx_vlm_generate_runs(loaded, images) -> None:
    from mlx_vlm import stream_generate

    model, processor = loaded
    prompt = _prompt(processor, model.config, TEST_PROMPTS[0])
    expected, _ = _greedy(model, processor, prompt, images[1])
    results = list(
        stream_generate(
            model, processor, prompt, image=[images[1]], max_tokens=GREEDY_TOKENS, temperature=0.0
        )
    )
    # The high-level API stops at EOS (and its last result only repeats the last token when
    # it stops at the length); up to there it agrees with generate_step.
    got = [r.token for r in results][:GREEDY_TOKENS]
    assert results[-1].finish_reason in ("stop", "length")
    assert got == expected[: len(got)]
    if len(got) < GREEDY_TOKENS:
        assert got[-1] == processor.tokenizer.eos_token_id


def test_language_model_is_the_text_demo(loaded, text_model: Path) -> None:
    """Without an image, mlx-vlm's Qwen2-VL runs the text demo exactly: greedy tokens equal
    mlx-lm's on the llama demo model (multimodal RoPE reduces to RoPE on text)."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step as text_step
    from mlx_vlm.generate import generate_step as vlm_step

    model, processor = loaded
    text, tokenizer = load(str(text_model))
    for prompt in demo_model.TEST_PROMPTS[:3]:
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        assert processor.tokenizer.encode(prompt, add_special_tokens=False) == ids
        steps = vlm_step(mx.array([ids]), model, None, None, max_tokens=16, temperature=0.0)
        expected = text_step(mx.array(ids), text, max_tokens=16)
        assert [int(t) for t, _ in steps] == [int(t) for t, _ in expected]


# --------------------------------------------------------------------------- gemma3

GEMMA3_TOKENS = 20


@pytest.fixture(scope="session")
def gemma3_text_model() -> Path:
    return demo_model.demo_model_path(demo_vlm_gemma3.FAMILY.text_kind)


@pytest.fixture(scope="session")
def gemma3_built() -> Path:
    return demo_vlm_path(family="gemma3")


@pytest.fixture(scope="module")
def gemma3_loaded(gemma3_built: Path):
    mlx_vlm = pytest.importorskip("mlx_vlm", reason=NO_MLX_VLM)
    return mlx_vlm.load(str(gemma3_built))


@pytest.fixture(scope="module")
def gemma3_images():
    """Two solid colours and noise, none of them the vision tower's size."""
    import numpy as np
    from PIL import Image

    noise = np.random.default_rng(2).integers(0, 256, (48, 64, 3), np.uint8)
    return (
        Image.new("RGB", (64, 48), (220, 30, 30)),
        Image.new("RGB", (64, 48), (20, 40, 230)),
        Image.fromarray(noise),
    )


def test_families() -> None:
    assert set(FAMILIES) == set(VISION_FAMILIES)
    assert get_family().model_type == MODEL_TYPE
    assert get_family("gemma3") is demo_vlm_gemma3.FAMILY
    assert get_family("mistral3") is demo_vlm_mistral3.FAMILY
    assert get_family("llava") is demo_vlm_llava.FAMILY
    assert get_family("qwen2_5_vl") is demo_vlm_qwen2_5.FAMILY
    assert get_family("llava").tokens_per_image == demo_vlm_llava.TOKENS_PER_IMAGE == 16
    assert get_family("gemma3").tokens_per_image == demo_vlm_gemma3.MM_TOKENS_PER_IMAGE
    assert get_family("gemma3").image_token == demo_vlm_gemma3.IMAGE_TOKEN
    with pytest.raises(ValueError, match="unknown demo VLM family"):
        get_family("nope")


def test_gemma3_cache_layout(gemma3_built: Path) -> None:
    assert gemma3_built.name == build_name(family="gemma3") != build_name()
    assert gemma3_built.parent == demo_model.default_cache_dir()
    assert gemma3_built.name.startswith("demo-vlm-gemma3-s0-")
    assert gemma3_built.name.endswith(f"-gemma3-{demo_model.RECIPE_VERSION}")
    assert is_finished_build(gemma3_built, family="gemma3")
    assert demo_vlm_path(family="gemma3") == gemma3_built


def test_gemma3_builds_are_deterministic(
    gemma3_built: Path, gemma3_text_model: Path, tmp_path: Path
) -> None:
    first = build_vlm(tmp_path / "a", text_model=gemma3_text_model, family="gemma3")
    second = build_vlm(tmp_path / "b", text_model=gemma3_text_model, family="gemma3")
    assert _digests(first) == _digests(second) == _digests(gemma3_built)
    assert "video_preprocessor_config.json" not in _digests(first)
    other = build_vlm(tmp_path / "c", seed=1, text_model=gemma3_text_model, family="gemma3")
    assert _digests(other)["model.safetensors"] != _digests(first)["model.safetensors"]
    # Each family takes its own text kind.
    with pytest.raises(ValueError, match="not a gemma3 demo build"):
        build_vlm(tmp_path / "d", text_model=demo_model.demo_model_path(TEXT_KIND), family="gemma3")


@pytest.mark.parametrize("family", ["gemma3", "mistral3", "llava", "qwen2_5_vl"])
def test_building_imports_no_mlx(family: str, tmp_path: Path) -> None:
    """The builder writes with safetensors' numpy API: no MLX outside the engine."""
    import subprocess
    import sys

    text_model = demo_model.demo_model_path(get_family(family).text_kind)
    code = (
        "import sys\n"
        "from servicer.demos.vision import build_vlm\n"
        f"build_vlm({str(tmp_path / 'g')!r}, text_model={str(text_model)!r},"
        f" family={family!r})\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    assert is_finished_build(tmp_path / "g", family=family)


def test_gemma3_config_and_tokens(gemma3_built: Path, gemma3_text_model: Path) -> None:
    from safetensors.numpy import load_file
    from tokenizers import Tokenizer

    g = demo_vlm_gemma3
    config = json.loads((gemma3_built / "config.json").read_text())
    tokenizer = Tokenizer.from_file(str(gemma3_built / "tokenizer.json"))
    ids = {tok: tokenizer.token_to_id(tok) for tok in g.FAMILY.vision_tokens}
    base = demo_model.VOCAB_SIZE
    assert ids == {g.BOI_TOKEN: base, g.EOI_TOKEN: base + 1, g.IMAGE_TOKEN: base + 2}
    assert config["model_type"] == "gemma3"
    assert config["vocab_size"] == config["text_config"]["vocab_size"] == base + 3
    assert config["image_token_index"] == ids[g.IMAGE_TOKEN]
    assert (config["boi_token_index"], config["eoi_token_index"]) == (base, base + 1)
    # N image tokens pool the vision tower's patches evenly.
    n = g.MM_TOKENS_PER_IMAGE
    assert config["mm_tokens_per_image"] == config["text_config"]["mm_tokens_per_image"] == n
    vision = config["vision_config"]
    patches = vision["image_size"] // vision["patch_size"]
    assert patches % math.isqrt(n) == 0 and math.isqrt(n) ** 2 == n
    assert tokenizer.encode(g.IMAGE_ANCHOR, add_special_tokens=False).ids == [ids[g.BOI_TOKEN]]
    expanded = tokenizer.encode(g.IMAGE_SEQUENCE, add_special_tokens=False).ids
    assert expanded.count(ids[g.IMAGE_TOKEN]) == n
    processor = json.loads((gemma3_built / "processor_config.json").read_text())
    assert processor["image_seq_length"] == n
    # The language model is the text demo's, tensor for tensor (plus three embedding rows).
    weights = load_file(str(gemma3_built / "model.safetensors"))
    text = load_file(str(gemma3_text_model / "model.safetensors"))
    for name, value in text.items():
        ours = weights[f"language_model.{name}"]
        assert (ours[: len(value)] == value).all(), name
    assert weights["multi_modal_projector.mm_input_projection_weight"].shape == (
        vision["hidden_size"],
        config["text_config"]["hidden_size"],
    )


def test_gemma3_chat_template_renders_one_anchor_per_image(gemma3_built: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gemma3_built))
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image"},
                {"type": "text", "text": "Compare"},
                {"type": "image_url", "image_url": {"url": "data:,"}},
            ],
        },
        {"role": "assistant", "content": "Both are blue."},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    anchor = demo_vlm_gemma3.IMAGE_ANCHOR
    assert anchor == "<start_of_image>"
    assert text == (
        f"<|begin|><|user|>{anchor}Compare{anchor}<|end|>"
        "<|assistant|>Both are blue.<|end|><|assistant|>"
    )
    assert get_family("gemma3").chat_template == tokenizer.chat_template


def test_gemma3_processor_expands_each_anchor(gemma3_loaded, gemma3_images) -> None:
    g = demo_vlm_gemma3
    model, processor = gemma3_loaded
    assert type(processor).__module__ == "mlx_vlm.models.gemma3.processing_gemma3"
    assert processor.image_token_id == model.config.image_token_index
    text = f"<|begin|><|user|>{g.IMAGE_ANCHOR}Compare{g.IMAGE_ANCHOR}<|end|><|assistant|>"
    out = processor(text=text, images=list(gemma3_images[:2]))
    decoded = processor.tokenizer.decode(out["input_ids"][0].tolist())
    assert decoded == text.replace(g.IMAGE_ANCHOR, g.IMAGE_SEQUENCE)
    assert out["input_ids"][0].tolist().count(processor.image_token_id) == 2 * g.MM_TOKENS_PER_IMAGE
    assert tuple(out["pixel_values"].shape) == (2, 3, g.IMAGE_SIZE, g.IMAGE_SIZE)


def _chat(question: str) -> str:
    return f"<|begin|><|user|>{question}<|end|><|assistant|>"


def test_gemma3_loads_as_text_model_with_mlx_lm(
    gemma3_loaded, gemma3_built: Path, gemma3_text_model: Path
) -> None:
    """mlx-lm loads the VLM checkpoint as its text model: greedy tokens equal mlx-vlm's
    without an image, and the text demo's own."""
    import mlx_lm
    from mlx_vlm import stream_generate

    model, processor = gemma3_loaded
    text, tokenizer = mlx_lm.load(str(gemma3_built))
    assert type(text).__module__ == "mlx_lm.models.gemma3"
    demo, demo_tokenizer = mlx_lm.load(str(gemma3_text_model))
    prompts = [*demo_model.TEST_PROMPTS[:2], *(_chat(q) for q in TEST_PROMPTS)]
    for prompt in prompts:
        expected = [
            r.token
            for r in mlx_lm.stream_generate(text, tokenizer, prompt, max_tokens=GEMMA3_TOKENS)
        ]
        assert len(set(expected)) >= 4, tokenizer.decode(expected)
        demo_tokens = mlx_lm.stream_generate(demo, demo_tokenizer, prompt, max_tokens=GEMMA3_TOKENS)
        assert [r.token for r in demo_tokens] == expected
        results = list(
            stream_generate(model, processor, prompt, max_tokens=GEMMA3_TOKENS, temperature=0.0)
        )
        # mlx-vlm's last result repeats the last token when it stops at the length.
        assert [r.token for r in results][:GEMMA3_TOKENS] == expected, prompt


@pytest.mark.parametrize("question", TEST_PROMPTS)
def test_gemma3_greedy_output_depends_on_the_image(
    gemma3_loaded, gemma3_images, question: str
) -> None:
    g = demo_vlm_gemma3
    model, processor = gemma3_loaded
    for prompt in (_chat(g.IMAGE_ANCHOR + question), _chat(question + g.IMAGE_ANCHOR)):
        outputs = []
        for image in gemma3_images:
            tokens, image_tokens = _greedy(model, processor, prompt, image, GEMMA3_TOKENS)
            assert image_tokens == g.MM_TOKENS_PER_IMAGE
            assert len(set(tokens)) >= 4, processor.tokenizer.decode(tokens)
            outputs.append(tuple(tokens))
        assert len(set(outputs)) >= 2, [processor.tokenizer.decode(t) for t in outputs]
        # Greedy is deterministic.
        again, _ = _greedy(model, processor, prompt, gemma3_images[2], GEMMA3_TOKENS)
        assert tuple(again) == outputs[2]


# --------------------------------------------------------------------------- mistral3

MISTRAL3_TOKENS = 20
M3 = demo_vlm_mistral3


@pytest.fixture(scope="session")
def mistral3_built() -> Path:
    return demo_vlm_path(family="mistral3")


@pytest.fixture(scope="module")
def mistral3_loaded(mistral3_built: Path):
    mlx_vlm = pytest.importorskip("mlx_vlm", reason=NO_MLX_VLM)
    return mlx_vlm.load(str(mistral3_built))


@pytest.fixture(scope="module")
def mistral3_images():
    """Two solid colours and noise at 64x48 (a 2x3 token grid, not resized), and noise at
    112x112 (shrunk to 84x84: 3x3)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(3)
    return (
        Image.new("RGB", (64, 48), (220, 30, 30)),
        Image.new("RGB", (64, 48), (20, 40, 230)),
        Image.fromarray(rng.integers(0, 256, (48, 64, 3), np.uint8)),
        Image.fromarray(rng.integers(0, 256, (112, 112, 3), np.uint8)),
    )


def test_mistral3_cache_layout_and_determinism(
    mistral3_built: Path, text_model: Path, tmp_path: Path
) -> None:
    assert mistral3_built.name == build_name(family="mistral3")
    assert mistral3_built.name.startswith("demo-vlm-mistral3-s0-")
    assert mistral3_built.name.endswith(f"-llama-{demo_model.RECIPE_VERSION}")
    assert is_finished_build(mistral3_built, family="mistral3")
    first = build_vlm(tmp_path / "a", text_model=text_model, family="mistral3")
    second = build_vlm(tmp_path / "b", text_model=text_model, family="mistral3")
    assert _digests(first) == _digests(second) == _digests(mistral3_built)
    other = build_vlm(tmp_path / "c", seed=1, text_model=text_model, family="mistral3")
    assert _digests(other)["model.safetensors"] != _digests(first)["model.safetensors"]
    gemma3_text = demo_model.demo_model_path(demo_vlm_gemma3.FAMILY.text_kind)
    with pytest.raises(ValueError, match="not a llama demo build"):
        build_vlm(tmp_path / "d", text_model=gemma3_text, family="mistral3")


def test_mistral3_config_and_tokens(mistral3_built: Path, text_model: Path) -> None:
    from safetensors.numpy import load_file
    from tokenizers import Tokenizer

    config = json.loads((mistral3_built / "config.json").read_text())
    tokenizer = Tokenizer.from_file(str(mistral3_built / "tokenizer.json"))
    ids = {tok: tokenizer.token_to_id(tok) for tok in M3.FAMILY.vision_tokens}
    base = demo_model.VOCAB_SIZE
    assert [ids[tok] for tok in M3.FAMILY.vision_tokens] == [base, base + 1, base + 2]
    assert config["model_type"] == "mistral3"
    assert config["text_config"]["model_type"] == "mistral"
    assert config["vocab_size"] == config["text_config"]["vocab_size"] == base + 3
    assert config["image_token_index"] == ids[M3.IMAGE_TOKEN]
    assert config["spatial_merge_size"] == 2 and config["vision_config"]["patch_size"] == 14
    assert tokenizer.encode(M3.IMAGE_ANCHOR, add_special_tokens=False).ids == [base]
    # Token grids: shrunk to fit 84 pixels (never enlarged), sides rounded up to 28.
    assert M3.image_grid(112, 112) == M3.image_grid(84, 84) == (3, 3)
    assert M3.image_grid(48, 64) == (2, 3) and M3.image_grid(10, 10) == (1, 1)
    assert M3.image_grid(40, 200) == (1, 3)  # 16 x 84 after shrinking
    assert M3.tokens_per_image(48, 64) == 8 and M3.tokens_per_image(112, 112) == 12
    seq = tokenizer.encode(M3.image_sequence(2, 3), add_special_tokens=False).ids
    assert seq == [base] * 3 + [base + 1] + [base] * 3 + [base + 2]
    # The language model is the text demo's, tensor for tensor (plus three embedding rows).
    weights = load_file(str(mistral3_built / "model.safetensors"))
    text = load_file(str(text_model / "model.safetensors"))
    for name, value in text.items():
        assert (weights[f"language_model.{name}"][: len(value)] == value).all(), name
    merger = weights["multi_modal_projector.patch_merger.merging_layer.weight"]
    assert merger.shape == (64, 64 * 4)


def test_mistral3_chat_template_renders_one_anchor_per_image(mistral3_built: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(mistral3_built))
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image"},
                {"type": "text", "text": "Compare"},
                {"type": "image_url", "image_url": {"url": "data:,"}},
            ],
        },
        {"role": "assistant", "content": "Both are blue."},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|begin|><|user|>[IMG]Compare[IMG]<|end|><|assistant|>Both are blue.<|end|><|assistant|>"
    )
    assert get_family("mistral3").chat_template == tokenizer.chat_template


def test_mistral3_processor_expands_each_anchor(mistral3_loaded, mistral3_images) -> None:
    model, processor = mistral3_loaded
    assert type(processor).__module__ == "mlx_vlm.models.mistral3.processing_mistral3"
    assert processor.image_token_id == model.config.image_token_index
    text = f"<|begin|><|user|>{M3.IMAGE_ANCHOR}Compare{M3.IMAGE_ANCHOR}<|end|><|assistant|>"
    out = processor(text=text, images=[mistral3_images[3], mistral3_images[2]])
    decoded = processor.tokenizer.decode(out["input_ids"][0].tolist())
    first, second = M3.image_sequence(3, 3), M3.image_sequence(2, 3)
    assert first == "[IMG][IMG][IMG][IMG_BREAK]" * 2 + "[IMG][IMG][IMG][IMG_END]"
    assert decoded == f"<|begin|><|user|>{first}Compare{second}<|end|><|assistant|>"
    assert out["image_sizes"].tolist() == [[84, 84], [56, 84]]
    assert tuple(out["pixel_values"].shape) == (2, 3, 84, 84)  # padded to the largest


def _run_ids(ids: list[int]) -> list[tuple[int, int]]:
    """(start, end) of each image's run: its first [IMG] to its [IMG_END], inclusive."""
    image, brk, end = (demo_model.VOCAB_SIZE + i for i in range(3))
    starts = [
        i for i, t in enumerate(ids) if t == image and (i == 0 or ids[i - 1] not in (image, brk))
    ]
    return list(zip(starts, [i + 1 for i, t in enumerate(ids) if t == end], strict=True))


def test_mistral3_input_embeddings(mistral3_loaded, mistral3_images) -> None:
    """mlx-vlm's merge: image features replace the [IMG] tokens only; every other position
    (breaks and ends too) keeps its token embedding, so one image's run embeds alone as in
    the whole prompt. image_sizes is required; the text model's positions are plain RoPE."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_vlm.models.cache import KVCache

    model, processor = mistral3_loaded
    text = f"<|begin|><|user|>{M3.IMAGE_ANCHOR}Compare{M3.IMAGE_ANCHOR}<|end|><|assistant|>"
    out = processor(text=text, images=[mistral3_images[3], mistral3_images[2]])
    ids, pixels, sizes = out["input_ids"], out["pixel_values"], out["image_sizes"]
    merged = model.get_input_embeddings(ids, pixels, image_sizes=sizes).inputs_embeds
    plain = model.language_model.model.embed_tokens(ids)
    row = ids[0].tolist()
    for i, token in enumerate(row):
        unchanged = bool(mx.array_equal(merged[0, i], plain[0, i]).item())
        assert unchanged == (token != processor.image_token_id), (i, token)
    runs = _run_ids(row)
    assert [end - start for start, end in runs] == [12, 8]
    for k, (start, end) in enumerate(runs):
        height, width = sizes[k].tolist()
        alone = model.get_input_embeddings(
            ids[:, start:end], pixels[k : k + 1, :, :height, :width], image_sizes=[(height, width)]
        ).inputs_embeds
        assert mx.array_equal(alone[0], merged[0, start:end]).item(), k
    with pytest.raises(TypeError):
        model.get_input_embeddings(ids[:, slice(*runs[0])], pixels[:1])  # no image_sizes
    # Plain 1-D RoPE: a prefill in two chunks over a cache equals the whole one.
    language = model.language_model
    assert all(type(layer.self_attn.rope) is nn.RoPE for layer in language.layers)
    whole = language(ids, inputs_embeds=merged).logits
    cache = [KVCache() for _ in language.layers]
    parts = [
        language(ids[:, s], inputs_embeds=merged[:, s], cache=cache).logits
        for s in (slice(0, 10), slice(10, None))
    ]
    assert mx.allclose(mx.concatenate(parts, axis=1), whole, atol=1e-5).item()


def test_mistral3_loads_as_text_model_with_mlx_lm(
    mistral3_loaded, mistral3_built: Path, text_model: Path
) -> None:
    """mlx-lm loads the VLM checkpoint as its text model: greedy tokens equal mlx-vlm's
    without an image, and the llama text demo's own."""
    import mlx_lm
    from mlx_vlm import stream_generate

    model, processor = mistral3_loaded
    text, tokenizer = mlx_lm.load(str(mistral3_built))
    assert type(text).__module__ == "mlx_lm.models.mistral3"
    assert type(text.language_model).__module__ == "mlx_lm.models.llama"
    demo, demo_tokenizer = mlx_lm.load(str(text_model))
    prompts = [*demo_model.TEST_PROMPTS[:2], *(_chat(q) for q in TEST_PROMPTS)]
    for prompt in prompts:
        expected = [
            r.token
            for r in mlx_lm.stream_generate(text, tokenizer, prompt, max_tokens=MISTRAL3_TOKENS)
        ]
        assert len(set(expected)) >= 4, tokenizer.decode(expected)
        demo_tokens = mlx_lm.stream_generate(
            demo, demo_tokenizer, prompt, max_tokens=MISTRAL3_TOKENS
        )
        assert [r.token for r in demo_tokens] == expected
        results = list(
            stream_generate(model, processor, prompt, max_tokens=MISTRAL3_TOKENS, temperature=0.0)
        )
        # mlx-vlm's last result repeats the last token when it stops at the length.
        assert [r.token for r in results][:MISTRAL3_TOKENS] == expected, prompt


@pytest.mark.parametrize("question", TEST_PROMPTS)
def test_mistral3_greedy_output_depends_on_the_image(
    mistral3_loaded, mistral3_images, question: str
) -> None:
    model, processor = mistral3_loaded
    for prompt in (_chat(M3.IMAGE_ANCHOR + question), _chat(question + M3.IMAGE_ANCHOR)):
        outputs = []
        for image in mistral3_images:
            tokens, image_tokens = _greedy(model, processor, prompt, image, MISTRAL3_TOKENS)
            rows, cols = M3.image_grid(image.height, image.width)
            assert image_tokens == rows * cols
            assert len(set(tokens)) >= 4, processor.tokenizer.decode(tokens)
            outputs.append(tuple(tokens))
        assert len(set(outputs)) >= 3, [processor.tokenizer.decode(t) for t in outputs]
        # Greedy is deterministic.
        again, _ = _greedy(model, processor, prompt, mistral3_images[2], MISTRAL3_TOKENS)
        assert tuple(again) == outputs[2]


# --------------------------------------------------------------------------- llava

LLAVA_TOKENS = 20
LV = demo_vlm_llava


@pytest.fixture(scope="session")
def llava_built() -> Path:
    return demo_vlm_path(family="llava")


@pytest.fixture(scope="module")
def llava_loaded(llava_built: Path):
    mlx_vlm = pytest.importorskip("mlx_vlm", reason=NO_MLX_VLM)
    return mlx_vlm.load(str(llava_built))


@pytest.fixture(scope="module")
def llava_images():
    """Two solid colours and noise at 64x48 (resized and cropped to 56x56), and noise at 56x56."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(4)
    return (
        Image.new("RGB", (64, 48), (220, 30, 30)),
        Image.new("RGB", (64, 48), (20, 40, 230)),
        Image.fromarray(rng.integers(0, 256, (48, 64, 3), np.uint8)),
        Image.fromarray(rng.integers(0, 256, (56, 56, 3), np.uint8)),
    )


def test_llava_cache_layout_and_determinism(
    llava_built: Path, text_model: Path, tmp_path: Path
) -> None:
    assert llava_built.name == build_name(family="llava")
    assert llava_built.name.startswith("demo-vlm-llava-s0-")
    assert llava_built.name.endswith(f"-llama-{demo_model.RECIPE_VERSION}")
    assert is_finished_build(llava_built, family="llava")
    first = build_vlm(tmp_path / "a", text_model=text_model, family="llava")
    second = build_vlm(tmp_path / "b", text_model=text_model, family="llava")
    assert _digests(first) == _digests(second) == _digests(llava_built)
    other = build_vlm(tmp_path / "c", seed=1, text_model=text_model, family="llava")
    assert _digests(other)["model.safetensors"] != _digests(first)["model.safetensors"]
    gemma3_text = demo_model.demo_model_path(demo_vlm_gemma3.FAMILY.text_kind)
    with pytest.raises(ValueError, match="not a llama demo build"):
        build_vlm(tmp_path / "d", text_model=gemma3_text, family="llava")


def test_llava_config_and_tokens(llava_built: Path, text_model: Path) -> None:
    from safetensors.numpy import load_file
    from tokenizers import Tokenizer

    from servicer.vision_families import vision_spec

    config = json.loads((llava_built / "config.json").read_text())
    tokenizer = Tokenizer.from_file(str(llava_built / "tokenizer.json"))
    base = demo_model.VOCAB_SIZE
    assert tokenizer.token_to_id(LV.IMAGE_TOKEN) == base
    assert config["model_type"] == "llava"
    assert config["text_config"]["model_type"] == "llama"
    assert config["vocab_size"] == config["text_config"]["vocab_size"] == base + 1
    assert config["image_token_index"] == base
    assert config["vision_config"]["model_type"] == "clip_vision_model"
    assert (config["vision_config"]["image_size"], config["vision_config"]["patch_size"]) == (
        56,
        14,
    )
    assert config["vision_feature_select_strategy"] == "default"
    assert tokenizer.encode(LV.IMAGE_ANCHOR, add_special_tokens=False).ids == [base]
    # The handler's spec: the anchor is the image token, repeated once per patch.
    hf_tokenizer = _hf_tokenizer(llava_built)
    spec = vision_spec(config, hf_tokenizer)
    assert spec is not None and spec.family == "llava"
    assert spec.anchor == (base,) and spec.run(spec.tokens(None)) == [base] * 16
    # The language model is the text demo's, tensor for tensor (plus an embedding row).
    weights = load_file(str(llava_built / "model.safetensors"))
    text = load_file(str(text_model / "model.safetensors"))
    for name, value in text.items():
        assert (weights[f"language_model.{name}"][: len(value)] == value).all(), name
    assert weights["vision_tower.vision_model.embeddings.position_embedding.weight"].shape == (
        17,
        64,
    )
    assert weights["multi_modal_projector.linear_1.weight"].shape == (128, 64)


def _hf_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def test_llava_chat_template_renders_one_anchor_per_image(llava_built: Path) -> None:
    tokenizer = _hf_tokenizer(llava_built)
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image"},
                {"type": "text", "text": "Compare"},
                {"type": "image_url", "image_url": {"url": "data:,"}},
            ],
        },
        {"role": "assistant", "content": "Both are blue."},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|begin|><|user|><image>Compare<image><|end|><|assistant|>Both are blue.<|end|>"
        "<|assistant|>"
    )
    assert get_family("llava").chat_template == tokenizer.chat_template


def test_llava_processor_expands_each_anchor(llava_loaded, llava_built: Path, llava_images) -> None:
    """mlx-vlm's LlavaProcessor repeats <image> once per patch; the image processor it uses is
    the one transformers' PIL backend loads (the handler's), pixel for pixel."""
    import numpy as np
    from transformers import AutoImageProcessor

    model, processor = llava_loaded
    assert type(processor).__module__ == "mlx_vlm.models.llava.processing_llava"
    assert processor.image_token_id == model.config.image_token_index
    text = f"<|begin|><|user|>{LV.IMAGE_ANCHOR}Compare{LV.IMAGE_ANCHOR}<|end|><|assistant|>"
    out = processor(text=text, images=[llava_images[2], llava_images[3]])
    decoded = processor.tokenizer.decode(np.asarray(out["input_ids"][0]).tolist())
    assert decoded == text.replace(LV.IMAGE_ANCHOR, LV.IMAGE_TOKEN * LV.TOKENS_PER_IMAGE)
    assert tuple(out["pixel_values"].shape) == (2, 3, LV.IMAGE_SIZE, LV.IMAGE_SIZE)
    ours = AutoImageProcessor.from_pretrained(str(llava_built), backend="pil")
    for k, image in enumerate(llava_images[2:]):
        mine = ours(images=[image], return_tensors="np")["pixel_values"]
        assert np.array_equal(mine[0], np.asarray(out["pixel_values"][k])), k


def test_llava_text_stack_loads_with_mlx_lm(
    llava_loaded, llava_built: Path, text_model: Path
) -> None:
    """mlx-lm loads the checkpoint's text model two ways, mlx_lm.load (its llava model type
    is its mistral3 wrapper around llama) and the worker's text-stack loader (llama alone,
    from text_config): greedy tokens equal each other, mlx-vlm's without an image, and the
    llama text demo's own."""
    import mlx_lm
    from mlx_vlm import stream_generate

    from servicer.engine.model import load_text_stack, text_stack_config

    model, processor = llava_loaded
    wrapped, tokenizer = mlx_lm.load(str(llava_built))
    assert type(wrapped.language_model).__module__ == "mlx_lm.models.llama"
    assert text_stack_config(llava_built) is None  # mlx-lm loads llava itself
    alone, alone_tokenizer = load_text_stack(llava_built)
    assert type(alone).__module__ == "mlx_lm.models.llama"
    demo, demo_tokenizer = mlx_lm.load(str(text_model))
    prompts = [*demo_model.TEST_PROMPTS[:2], *(_chat(q) for q in TEST_PROMPTS)]
    for prompt in prompts:
        expected = [
            r.token
            for r in mlx_lm.stream_generate(alone, alone_tokenizer, prompt, max_tokens=LLAVA_TOKENS)
        ]
        assert len(set(expected)) >= 4, tokenizer.decode(expected)
        for other, other_tokenizer in ((wrapped, tokenizer), (demo, demo_tokenizer)):
            tokens = mlx_lm.stream_generate(other, other_tokenizer, prompt, max_tokens=LLAVA_TOKENS)
            assert [r.token for r in tokens] == expected, prompt
        results = list(
            stream_generate(model, processor, prompt, max_tokens=LLAVA_TOKENS, temperature=0.0)
        )
        # mlx-vlm's last result repeats the last token when it stops at the length.
        assert [r.token for r in results][:LLAVA_TOKENS] == expected, prompt


def _greedy_ids(model, tokenizer, prompt: str) -> list[int]:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    ids = mx.array(tokenizer.encode(prompt, add_special_tokens=False))
    return [int(t) for t, _ in generate_step(ids, model, max_tokens=LLAVA_TOKENS)]


def test_text_stack_loader_serves_unknown_families_and_quantized_checkpoints(
    llava_built: Path, tmp_path: Path
) -> None:
    """A model type mlx-lm lacks, with a text_config it knows, loads through the text-stack
    loader (the worker's load_model picks it); a quantized checkpoint too, with the greedy
    tokens of mlx-lm's own load of it."""
    import shutil

    import mlx.nn as nn
    import mlx_lm
    from mlx_lm.convert import convert

    from servicer.engine.model import load_model, load_text_stack, text_stack_config

    quantized = tmp_path / "q4"
    convert(str(llava_built), str(quantized), quantize=True, q_group_size=32, q_bits=4)
    reference, tokenizer = mlx_lm.load(str(quantized))
    for source in (llava_built, quantized):
        renamed = tmp_path / f"{source.name}-next"
        shutil.copytree(source, renamed)
        config = json.loads((renamed / "config.json").read_text())
        (renamed / "config.json").write_text(json.dumps({**config, "model_type": "llava_next"}))
        assert text_stack_config(renamed) == config["text_config"]
        loaded = load_model(renamed, None)
        assert type(loaded.model).__module__ == "mlx_lm.models.llama"
        want = mlx_lm.load(str(source))[0]
        for prompt in (_chat(TEST_PROMPTS[0]), demo_model.TEST_PROMPTS[0]):
            assert _greedy_ids(loaded.model, loaded.tokenizer, prompt) == _greedy_ids(
                want, tokenizer, prompt
            )
    alone, _ = load_text_stack(quantized)
    assert isinstance(alone.model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    assert isinstance(alone.model.embed_tokens, nn.QuantizedEmbedding)
    prompt = _chat(TEST_PROMPTS[1])
    assert _greedy_ids(alone, tokenizer, prompt) == _greedy_ids(reference, tokenizer, prompt)


def _llava_greedy(model, processor, prompt: str, image) -> tuple[list[int], int]:
    """Greedy tokens and the prompt's image-token count. (mlx-vlm's prepare_inputs, so its
    generate too, fails on LLaVA images with transformers 5: its LlavaProcessor hands the
    tokenizer's padding argument to the image processor; the processor called directly works.)"""
    import mlx.core as mx
    from mlx_vlm.generate import generate_step

    out = processor(text=prompt, images=[image])
    ids, pixels = mx.array(out["input_ids"]), mx.array(out["pixel_values"])
    steps = generate_step(ids, model, pixels, mx.ones_like(ids), max_tokens=LLAVA_TOKENS)
    image_tokens = int(mx.sum(ids == model.config.image_token_index).item())
    return [int(token) for token, _ in steps], image_tokens


@pytest.mark.parametrize("question", TEST_PROMPTS)
def test_llava_greedy_output_depends_on_the_image(
    llava_loaded, llava_images, question: str
) -> None:
    model, processor = llava_loaded
    for prompt in (_chat(LV.IMAGE_ANCHOR + question), _chat(question + LV.IMAGE_ANCHOR)):
        outputs = []
        for image in llava_images:
            tokens, image_tokens = _llava_greedy(model, processor, prompt, image)
            assert image_tokens == LV.TOKENS_PER_IMAGE
            assert len(set(tokens)) >= 4, processor.tokenizer.decode(tokens)
            outputs.append(tuple(tokens))
        assert len(set(outputs)) >= 3, [processor.tokenizer.decode(t) for t in outputs]
        # Greedy is deterministic.
        again, _ = _llava_greedy(model, processor, prompt, llava_images[2])
        assert tuple(again) == outputs[2]
