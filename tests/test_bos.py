"""The BOS a model's tokenizer puts first: the worker adds it to ids that lack it (as the smg
router sends raw-text completions), never a second one, and never for a model with none.

Differential: every case runs through the real server, and its output is compared token for
token with mlx-lm's greedy output for the ids the engine should have received."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import Reference, demo_config
from support import ServerThread, generate

from servicer.client import RemoteTokenizer
from servicer.codec import TextCodec
from servicer.demos.text import BOS_TOKEN, demo_model_path
from servicer.model_files import ModelSpec, adds_bos, load_tokenizer, prepare_model_files
from servicer.tokenizer_bundle import build_archive

N = 8


@pytest.fixture(scope="module")
def bos_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo llama with a tokenizer that puts its BOS before every encoding, the way
    Gemma's and Llama's tokenizer.json post-processors do."""
    from tokenizers import Tokenizer, processors

    target = tmp_path_factory.mktemp("bos") / "model"
    shutil.copytree(demo_model_path("llama"), target)
    tokenizer = Tokenizer.from_file(str(target / "tokenizer.json"))
    bos = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS_TOKEN} $A",
                pair=f"{BOS_TOKEN} $A $B",
                special_tokens=[(BOS_TOKEN, bos)],
            ),
        ]
    )
    tokenizer.save(str(target / "tokenizer.json"))
    config_path = target / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["add_bos_token"] = True
    config_path.write_text(json.dumps(config))
    return target


@pytest.fixture(scope="module")
def bos_reference(bos_dir: Path) -> Reference:
    return Reference(bos_dir)


def _prepended(running: ServerThread) -> float:
    value = running.server.metrics.registry.get_sample_value("mlx_worker_bos_added_total")
    return value or 0.0


def test_which_tokenizers_add_a_bos(bos_dir):
    bos_info = prepare_model_files(ModelSpec(str(bos_dir))).info
    assert bos_info.adds_bos and bos_info.bos_token_id is not None
    for kind in ("llama", "hybrid", "gemma3"):  # the demo tokenizers add nothing
        assert not prepare_model_files(ModelSpec(f"demo:{kind}")).info.adds_bos
    tokenizer = load_tokenizer(bos_dir)
    assert not adds_bos(tokenizer, tokenizer.bos_token_id + 1)  # not that token


@pytest.mark.parametrize("prepend", [True, False])
def test_the_engine_gets_one_bos_and_the_counts_include_it(bos_dir, bos_reference, prepend):
    import random

    rng = random.Random(7)
    tokenizer = bos_reference.tokenizer
    bos = tokenizer.bos_token_id
    config = replace(demo_config(bos_dir), engine_mode="thread")
    config = replace(config, handlers=replace(config.handlers, prepend_bos=prepend))
    with ServerThread(config) as running, running.channel() as chan:
        for _ in range(3):
            plain = [rng.randrange(3, 500) for _ in range(rng.randrange(4, 24))]
            for ids, expected in (
                (plain, [bos, *plain] if prepend else plain),
                ([bos, *plain], None),
            ):
                expected = expected or ids  # ids that start with the BOS stay as they are
                outcome = generate(chan, ids, max_tokens=N, temperature=0, ignore_eos=True)
                assert outcome.error is None, outcome.error
                assert outcome.tokens == bos_reference.greedy(expected, N)
                assert outcome.complete.prompt_tokens == len(expected)
                assert outcome.complete.cached_tokens <= len(expected)
        assert _prepended(running) == (3 if prepend else 0)


def test_a_model_without_a_bos_never_gets_one(demo_dir, reference, prompts):
    config = replace(demo_config(demo_dir), engine_mode="thread")
    with ServerThread(config) as running, running.channel() as chan:
        for prompt in prompts[:3]:
            outcome = generate(chan, prompt, max_tokens=N, temperature=0, ignore_eos=True)
            assert outcome.tokens == reference.greedy(prompt, N)
            assert outcome.complete.prompt_tokens == len(prompt)
        assert _prepended(running) == 0


def test_text_is_encoded_with_one_bos(bos_dir):
    tokenizer = load_tokenizer(bos_dir)
    bos = tokenizer.bos_token_id
    codec = TextCodec(tokenizer)
    assert codec.encode("The river")[0] == bos
    assert codec.encode("The river")[1] != bos
    assert codec.encode(f"{BOS_TOKEN}The river") == codec.encode("The river")  # not two


def test_the_client_encodes_as_mlx_lm_and_reads_chat_template_jinja(bos_dir, tmp_path):
    from mlx_lm import load

    _, wrapper = load(str(bos_dir))
    client = RemoteTokenizer.from_archive(build_archive(bos_dir).data)
    assert client.encode("The river") == list(wrapper.encode("The river"))  # with the BOS
    # The layout current Gemma, Qwen and Llama repositories ship: the template in its own file.
    moved = tmp_path / "model"
    shutil.copytree(bos_dir, moved)
    config = json.loads((moved / "tokenizer_config.json").read_text())
    (moved / "chat_template.jinja").write_text(config.pop("chat_template"))
    (moved / "tokenizer_config.json").write_text(json.dumps(config))
    client = RemoteTokenizer.from_archive(build_archive(moved).data)
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    expected = wrapper.apply_chat_template(messages, add_generation_prompt=True)
    assert client.encode_chat("Tell me about the sea.") == list(expected)
