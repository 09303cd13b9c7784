"""The family registry (servicer/vision_families.py) is the one place a vision-language family
is named: the handlers, the engine, the demos and the benches read it, a family's own demo
module builds it, and `--model demo:vlm:FAMILY` serves any of them."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
from support import ROOT

from servicer.model_files import ModelLoadError, ModelSpec, resolve_model_dir
from servicer.vision_families import FAMILIES, SERVED_FAMILIES

PACKAGE = ROOT / "servicer"


def _files_naming(name: str) -> set[str]:
    """The package's modules (generated code aside) holding `name` as a string literal."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        if "proto" in path.relative_to(PACKAGE).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and node.value == name:
                found.add(str(path.relative_to(ROOT)))
                break
    return found


# Names that are a family's and something else's too, where the other one is named.
_ALSO_NAMED_FOR_ANOTHER_REASON = {
    "gemma3": {
        "servicer/demos/text.py",  # the gemma3 text demo kind, which the gemma3 VLM builds on
        "servicer/model_files.py",  # demo:vlm's family
        "servicer/demos/gemma4.py",  # its tokenizer and token embeddings: the gemma3 text demo's
    },
    "qwen2_vl": {"servicer/demos/vision.py"},  # the demo builder's default family
    "pixtral": {"servicer/demos/mistral3.py"},  # Mistral 3's vision tower is a Pixtral one
    # mlx-lm's llama4 text model, which the engine fixes for batching as it does text models
    "llama4": {"servicer/engine/arch_fixes.py", "servicer/engine/mlx_lm_compat.py"},
}


@pytest.mark.parametrize("family", SERVED_FAMILIES)
def test_a_family_is_named_in_the_registry_and_its_demo_alone(family):
    demo = FAMILIES[family].demo
    allowed = {"servicer/vision_families.py", f"servicer/demos/{demo}.py"}
    allowed |= _ALSO_NAMED_FOR_ANOTHER_REASON.get(family, set())
    assert _files_naming(family) <= allowed


@pytest.mark.parametrize("family", SERVED_FAMILIES)
def test_every_family_has_its_demo_build(family):
    module = importlib.import_module(f"servicer.demos.{FAMILIES[family].demo}")
    assert module.FAMILY.model_type == family
    assert FAMILIES[family].positions in ("plain", "mrope")


def test_demo_vlm_names_any_served_family_and_nothing_else():
    first = SERVED_FAMILIES[0]
    assert resolve_model_dir(ModelSpec(f"demo:vlm:{first}")).name.startswith(f"demo-vlm-{first}-")
    assert "gemma3" in resolve_model_dir(ModelSpec("demo:vlm")).name
    with pytest.raises(ModelLoadError, match="unknown demo VLM family 'nope'"):
        resolve_model_dir(ModelSpec("demo:vlm:nope"))


def test_the_family_table_stays_one_table():
    """No second table of families: the registry's names are the only family sets."""
    source = Path(PACKAGE / "engine" / "vision.py").read_text(encoding="utf-8")
    assert "FAMILIES" not in source.replace("family_of", "")


@pytest.mark.parametrize("family", SERVED_FAMILIES)
def test_every_demos_tokenizer_fits_its_model(family):
    """Every id the demo's tokenizer (as the worker loads it) can make is a row of the model:
    otherwise structured output is unavailable on it (llguidance needs the vocabulary)."""
    import json

    from transformers import AutoTokenizer

    from servicer.demos.vision import demo_vlm_path

    model_dir = demo_vlm_path(family=family)
    config = json.loads((model_dir / "config.json").read_text())
    vocab = config.get("vocab_size") or config["text_config"]["vocab_size"]
    assert len(AutoTokenizer.from_pretrained(str(model_dir))) <= vocab
