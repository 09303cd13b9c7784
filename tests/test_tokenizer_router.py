"""The router's copy of a Qwen2-VL tokenizer (servicer.tokenizer_bundle.router_tokenizer): the
image token spelled `<image>`, as smg's Qwen-VL spec looks it up, with the same ids, so the
prompt the router renders and encodes is the one the checkpoint's own tokenizer makes."""

from __future__ import annotations

import json

import pytest

from servicer.tokenizer_bundle import renamed_token, router_tokenizer, tokenizer_files

PAD, IMAGE = "<|image_pad|>", "<image>"
CHAT = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Bees?"}]}]


@pytest.fixture(scope="module")
def qwen_dir():
    from servicer.demos.vision import demo_vlm_path

    return demo_vlm_path(family="qwen2_vl")


def _files(model_dir) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in tokenizer_files(model_dir)}


def _prompt(model_dir) -> tuple[str, list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    text = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    return text, list(tokenizer.encode(text, add_special_tokens=False))


def test_the_image_token_is_respelled_everywhere_with_the_same_ids(qwen_dir, tmp_path):
    from tokenizers import Tokenizer

    before = _files(qwen_dir)
    after = renamed_token(before, PAD, IMAGE)
    assert set(after) == set(before)
    for name in ("config.json", "preprocessor_config.json", "generation_config.json"):
        assert after[name] == before[name]
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert PAD.encode() not in after[name] and IMAGE.encode() in after[name]
    for name in ("tokenizer_config.json", "chat_template.json"):
        assert b"<|vision_start|><image><|vision_end|>" in after[name]
    image_id = json.loads(before["config.json"])["image_token_id"]
    fast = Tokenizer.from_str(after["tokenizer.json"].decode())
    assert fast.token_to_id(IMAGE) == image_id and fast.token_to_id(PAD) is None
    for name, data in after.items():
        (tmp_path / name).write_bytes(data)
    text, ids = _prompt(tmp_path)
    original_text, original_ids = _prompt(qwen_dir)
    assert text.count(IMAGE) == 1 and text == original_text.replace(PAD, IMAGE)
    assert ids == original_ids and ids.count(image_id) == 1


def test_a_token_that_is_not_there_or_a_spelling_already_taken_is_refused(qwen_dir):
    files = _files(qwen_dir)
    with pytest.raises(ValueError, match="added tokens"):
        renamed_token(files, "<|no_such_token|>", IMAGE)
    with pytest.raises(ValueError, match="added tokens"):
        renamed_token(files, PAD, "<|vision_start|>")
    with pytest.raises(ValueError, match="JSON"):
        renamed_token(files, PAD, 'say "image"')


def test_the_copy_is_written_once_beside_the_checkpoint_never_into_it(qwen_dir, tmp_path):
    before = _files(qwen_dir)
    first = router_tokenizer(qwen_dir, "qwen2_vl", PAD, cache_dir=tmp_path)
    again = router_tokenizer(qwen_dir, "qwen2_5_vl", PAD, cache_dir=tmp_path)
    assert first is not None and first == again and first.parent.parent == tmp_path
    assert _files(first) == renamed_token(before, PAD, IMAGE)
    assert _files(qwen_dir) == before
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temporary left
    assert router_tokenizer(qwen_dir, "gemma3", PAD, cache_dir=tmp_path) is None
    assert router_tokenizer(qwen_dir, "qwen2_vl", "<|nothing|>", cache_dir=tmp_path) is None
