"""The demo checkpoint builder: loadable offline, varied output, deterministic, cached once."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from support import SLOW

from servicer.demos import common
from servicer.demos import text as demo_model
from servicer.demos.text import (
    BOS_TOKEN,
    CHAT_TEMPLATE,
    DEMO_MODEL_KIND,
    EOS_TOKEN,
    SPECIAL_TOKENS,
    TEST_PROMPTS,
    VOCAB_SIZE,
    build_model,
    build_name,
    demo_model_path,
    is_finished_build,
)

MODEL_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("demo-cache")


@pytest.fixture(scope="session")
def built(cache_dir: Path) -> Path:
    return demo_model_path(DEMO_MODEL_KIND, cache_dir=cache_dir)


@pytest.fixture(scope="session")
def loaded(built: Path):
    from mlx_lm import load

    return load(str(built))


def _greedy(model, prompt: list[int], n: int) -> list[int]:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    # generate_step never stops at EOS, which is what "ignoring EOS" needs.
    return [int(tok) for tok, _ in generate_step(mx.array(prompt), model, max_tokens=n)]


def _short_recipe_build(path: Path, seed: int) -> Path:
    """The real recipe cut to a few steps: cheap enough to build several times."""
    recipe = dataclasses.replace(demo_model._RECIPES[DEMO_MODEL_KIND], steps=3, warmup_steps=1)
    path.mkdir()
    demo_model._build_into(path, DEMO_MODEL_KIND, recipe, seed)
    return path


def test_cache_layout(built: Path, cache_dir: Path) -> None:
    assert built == cache_dir / build_name(DEMO_MODEL_KIND, 0)
    assert DEMO_MODEL_KIND in built.name and "s0" in built.name
    assert demo_model.RECIPE_VERSION in built.name
    assert is_finished_build(built)
    assert sorted(p.name for p in built.iterdir()) == sorted(MODEL_FILES)
    # No temporary build directories are left behind.
    assert [p.name for p in cache_dir.iterdir() if p.name.endswith(".tmp")] == []


def test_second_call_reuses_the_build(built: Path, cache_dir: Path) -> None:
    before = {name: (built / name).stat().st_mtime_ns for name in MODEL_FILES}
    dir_before = built.stat().st_mtime_ns
    assert demo_model_path(DEMO_MODEL_KIND, cache_dir=cache_dir) == built
    assert build_model(built) == built
    assert {name: (built / name).stat().st_mtime_ns for name in MODEL_FILES} == before
    assert built.stat().st_mtime_ns == dir_before


def test_cache_dir_defaults_to_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(common.CACHE_ENV, str(tmp_path))
    assert common.default_cache_dir() == tmp_path
    monkeypatch.delenv(common.CACHE_ENV)
    assert common.default_cache_dir() == Path.home() / ".cache" / "mlx-grpc-worker"


def test_config(built: Path) -> None:
    config = json.loads((built / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["vocab_size"] == VOCAB_SIZE
    assert config["num_hidden_layers"] == 2 and config["hidden_size"] == 128
    assert config["tie_word_embeddings"] is True
    generation = json.loads((built / "generation_config.json").read_text())
    assert generation["eos_token_id"] == config["eos_token_id"] == SPECIAL_TOKENS.index(EOS_TOKEN)
    assert config["bos_token_id"] == SPECIAL_TOKENS.index(BOS_TOKEN)


def test_loads_and_generates_with_mlx_lm(loaded) -> None:
    from mlx_lm import generate

    model, tokenizer = loaded
    assert tokenizer.eos_token_id == SPECIAL_TOKENS.index(EOS_TOKEN)
    text = generate(model, tokenizer, prompt=TEST_PROMPTS[0], max_tokens=8, verbose=False)
    assert isinstance(text, str) and text


def test_greedy_output_is_varied(loaded) -> None:
    model, tokenizer = loaded
    assert len(TEST_PROMPTS) == 8 and len(set(TEST_PROMPTS)) == 8
    distinct = {}
    for text in TEST_PROMPTS:
        prompt = tokenizer.encode(text, add_special_tokens=False)
        distinct[text] = len(set(_greedy(model, prompt, 32)))
    assert min(distinct.values()) >= 8, distinct


def test_chat_prompts_can_end_with_eos(loaded) -> None:
    model, tokenizer = loaded
    questions = ["Hello, who are you?", "Why is the sky blue?", "How do I make tea?"]
    ended = 0
    for question in questions:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True
        )
        ended += tokenizer.eos_token_id in _greedy(model, list(prompt), 32)
    assert ended >= 1


def test_transformers_tokenizer(built: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(built))
    assert len(tokenizer) == VOCAB_SIZE
    assert tokenizer.bos_token == BOS_TOKEN and tokenizer.eos_token == EOS_TOKEN
    for token in SPECIAL_TOKENS:
        assert tokenizer.convert_tokens_to_ids(token) == SPECIAL_TOKENS.index(token)
        assert tokenizer.encode(token, add_special_tokens=False) == [SPECIAL_TOKENS.index(token)]
    for text in [*TEST_PROMPTS, "  two  spaces\nand a newline", "Café, naïve, 東京 — ok? 123"]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text


def test_chat_template(built: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(built))
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Why is the sky blue?"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|begin|><|system|>Be brief.<|end|><|user|>Hi there<|end|>"
        "<|assistant|>Hello.<|end|><|user|>Why is the sky blue?<|end|><|assistant|>"
    )
    # transformers 5 returns a BatchEncoding here, 4.x a plain list.
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ids = list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    assert ids[-1] == tokenizer.convert_tokens_to_ids("<|assistant|>")
    config = json.loads((built / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE


def test_a_fresh_build_equals_the_shared_caches_byte_for_byte(built: Path) -> None:
    """Two full builds, byte for byte: this session's, in its own cache directory, and the one
    the other tests use from the shared cache (built there once, maybe by an earlier run of this
    recipe version: a difference means the recipe changed without a new RECIPE_VERSION, or the
    build is not deterministic)."""
    shared = demo_model_path(DEMO_MODEL_KIND)
    assert shared != built and shared.name == built.name
    for name in MODEL_FILES:
        assert (shared / name).read_bytes() == (built / name).read_bytes(), name


@SLOW  # a second full build in this process (~30 s); the test above compares two builds too
def test_full_rebuild_is_byte_identical(built: Path, tmp_path: Path) -> None:
    again = build_model(tmp_path / "again", DEMO_MODEL_KIND, seed=0)
    for name in MODEL_FILES:
        assert (again / name).read_bytes() == (built / name).read_bytes(), name


def test_seed_changes_weights_not_tokenizer(tmp_path: Path) -> None:
    first = _short_recipe_build(tmp_path / "a", seed=0)
    same = _short_recipe_build(tmp_path / "b", seed=0)
    other = _short_recipe_build(tmp_path / "c", seed=1)
    weights = (first / "model.safetensors").read_bytes()
    assert (same / "model.safetensors").read_bytes() == weights
    assert (other / "model.safetensors").read_bytes() != weights
    assert (other / "tokenizer.json").read_bytes() == (first / "tokenizer.json").read_bytes()


def test_build_refuses_a_foreign_directory(tmp_path: Path) -> None:
    (tmp_path / "junk.txt").write_text("not a model")
    with pytest.raises(FileExistsError):
        build_model(tmp_path)


def test_unknown_kind() -> None:
    with pytest.raises(ValueError, match="unknown demo model kind"):
        build_name("no-such-kind")


def test_cli_prints_the_path(built: Path, capsys: pytest.CaptureFixture[str]) -> None:
    demo_model.main(["--kind", DEMO_MODEL_KIND, "--out", str(built)])
    assert capsys.readouterr().out.strip() == str(built)


# The other kinds share the tokenizer and recipe; what differs is the cache they make.
OTHER_KINDS = {
    "hybrid": ["ArraysCache", "KVCache"],
    "gemma3": ["RotatingKVCache", "KVCache"],
}


@pytest.mark.parametrize("kind", sorted(OTHER_KINDS))
def test_other_kinds(kind: str, built: Path) -> None:
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    # The shared cache (as the server would use it), so only the first run pays the builds.
    path = demo_model_path(kind)
    assert path.name == build_name(kind, 0) and is_finished_build(path)
    model, tokenizer = load(str(path))
    assert [type(c).__name__ for c in make_prompt_cache(model)] == OTHER_KINDS[kind]
    distinct = {}
    for text in TEST_PROMPTS:
        prompt = tokenizer.encode(text, add_special_tokens=False)
        distinct[text] = len(set(_greedy(model, prompt, 32)))
    assert min(distinct.values()) >= 8, distinct
    # Same tokenizer files for every kind.
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (path / name).read_bytes() == (built / name).read_bytes()
