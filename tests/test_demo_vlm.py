"""The demo vision-language model: deterministic, in the shape the router expects, loaded and
run by mlx-vlm offline, with varied greedy output that depends on the image."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from servicer import demo_model
from servicer.demo_vlm import (
    CHAT_TEMPLATE,
    IMAGE_ANCHOR,
    IMAGE_PAD,
    MODEL_TYPE,
    TEST_PROMPTS,
    TEXT_KIND,
    VISION_END,
    VISION_PAD,
    VISION_START,
    VISION_TOKENS,
    build_name,
    build_vlm,
    demo_vlm_path,
    is_finished_build,
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


def _greedy(model, processor, prompt: str, image) -> tuple[list[int], int]:
    """32 greedy tokens (EOS not stopping them) and the prompt's image-token count."""
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
            max_tokens=GREEDY_TOKENS,
            temperature=0.0,
            **extra,
        )
    ]
    image_tokens = int(mx.sum(input_ids == model.config.image_token_id).item())
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
