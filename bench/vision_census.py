"""Every vision-language family mlx-vlm has, and what the worker does with a checkpoint of it at
start: serve its images (the families bench/vision_families.py checks cell by cell), serve it as
text only (the reason logged, `supports_vision` false, an image request INVALID_ARGUMENT), or
refuse to start (mlx-lm has no text model for it).

The decision is the worker's own (`servicer.vision_families.vision_refusal`, and mlx-lm's
model lookup as `servicer.engine.model` makes it), asked of the config each family's
checkpoints carry: its `model_type`, a `vision_config`, and the text model type mlx-vlm's
TextConfig defaults to.
A family is one of mlx-vlm's model packages with a vision tower (VisionModel or VisionConfig).

Usage: python bench/vision_census.py   (prints the table)
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import pkgutil
import sys
from collections import Counter
from dataclasses import dataclass

import _checkout  # noqa: F401  (before any `servicer` import)


@dataclass(frozen=True)
class Decision:
    family: str
    outcome: str  # "images", "text only", "text or refused"
    reason: str


def _text_model_type(module) -> str | None:
    config = getattr(module, "TextConfig", None)
    if config is None or not dataclasses.is_dataclass(config):
        return None
    for field in dataclasses.fields(config):
        if field.name == "model_type" and isinstance(field.default, str):
            return field.default
    return None


def decide(family: str, text_model_type: str | None) -> Decision:
    """What the worker does at start with a checkpoint of `family`."""
    from servicer.engine.model import _mlx_lm_knows
    from servicer.vision_families import vision_refusal

    config = {"model_type": family, "vision_config": {}}
    refusal = vision_refusal(config)
    if refusal is None:
        return Decision(family, "images", "")
    if _mlx_lm_knows(family) or _mlx_lm_knows(text_model_type):
        return Decision(family, "text only", refusal)
    # mlx-vlm's TextConfig default is often a placeholder: the checkpoint's own text_config
    # decides (idefics3 and smolvlm checkpoints name llama, which mlx-lm has).
    named = (
        f" (mlx-vlm's default text model type {text_model_type!r} is not one)"
        if text_model_type
        else ""
    )
    return Decision(
        family,
        "text or refused",
        f"text only if its text_config names a model type mlx-lm has{named}; else the worker "
        f"refuses to start: mlx-lm has no model for {family!r}",
    )


def census() -> list[Decision]:
    """One decision per mlx-vlm family with a vision tower (an import failure is noted)."""
    import mlx_vlm.models as models

    found = []
    for info in pkgutil.iter_modules(models.__path__):
        if not info.ispkg:
            continue
        try:
            module = importlib.import_module(f"mlx_vlm.models.{info.name}")
        except Exception as exc:  # a family needing packages the vision extra leaves out
            found.append(
                Decision(info.name, "text or refused", f"mlx-vlm cannot import it here: {exc}")
            )
            continue
        if hasattr(module, "VisionModel") or hasattr(module, "VisionConfig"):
            found.append(decide(info.name, _text_model_type(module)))
    return found


def summary(decisions: list[Decision]) -> str:
    counted = Counter(d.outcome for d in decisions)
    parts = ", ".join(f"{counted[o]} {o}" for o in ("images", "text only", "text or refused"))
    return f"{len(decisions)} mlx-vlm vision families: {parts}"


def markdown(decisions: list[Decision]) -> str:
    lines = [
        "## Every mlx-vlm vision family at start",
        "",
        f"{summary(decisions)} (`bench/vision_census.py`). `images`: served and checked above;",
        "`text only`: served as text, the reason logged, image requests INVALID_ARGUMENT;",
        "`text or refused`: as text when the checkpoint's text_config names a model mlx-lm has,",
        "else the worker does not start, with the reason.",
        "",
        "| family | at start | reason |",
        "|---|---|---|",
    ]
    lines += [f"| {d.family} | {d.outcome} | {d.reason} |" for d in decisions]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.parse_args(argv)
    print(markdown(census()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
