"""Speculation on the real google/gemma-3-270m (five 512-token sliding-window layers to one
global): greedy output identical with prompt lookup, one prompt crossing the window so the
rings wrap while speculating. A few short generations only (a token costs ~0.2 s); skipped
where ../shared is absent."""

from __future__ import annotations

from pathlib import Path

from spec_support import Job, drive, generator_kwargs, passages, plain_generator

from servicer.engine.speculation import PromptLookup, SpeculationConfig, SpeculativeBatchGenerator

BOS = 2  # Gemma writes garbage without it


def test_real_gemma_greedy_identical_across_the_window(real_model_dir: Path) -> None:
    from mlx_lm import load

    model, tokenizer = load(str(real_model_dir))
    texts = passages()

    def ids(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    passage = ids(texts[0])[:48]
    short = [BOS, *passage, *passage[:16]]  # a passage, then its start again
    other = ids(texts[2])[:40]
    joining = [BOS, *other, *other[:12]]
    long = [BOS]
    for text in texts[3:]:
        long += ids(text)
        if len(long) > 600:
            break
    long = long[:600] + long[1:40]  # past the 512 window, then a repeat to look up

    def jobs() -> list[Job]:
        return [
            Job("short", short, 10),
            Job("long", long, 6),
            Job("joining", joining, 8, join_at=2),
        ]

    plain = drive(plain_generator(model), jobs())
    generator = SpeculativeBatchGenerator(
        model,
        source=PromptLookup(),
        speculation=SpeculationConfig(costed=False, max_rows=8),
        **generator_kwargs(),
    )
    spec = drive(generator, jobs())
    for name, want in plain.items():
        assert spec[name].tokens == want.tokens, name
        assert spec[name].all_tokens == want.all_tokens, name
    assert len(long) + 6 > 600
    stats = generator.speculation
    assert stats.drafted > 0 and stats.accepted > 0
