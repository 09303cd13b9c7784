"""Each structured-output grammar is compiled once a request, and, with the engine in the
server's process (thread mode), llguidance's tokenizer is built once: the handlers' check
compiles the grammar and the engine starts each row from a copy of it."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import llguidance
import msgspec
import pytest
from conftest import demo_config
from support import ServerThread, generate

import servicer.grammar
from servicer.messages import Constraint, GenerationRequest


class CountingMatcher:
    """llguidance's LLMatcher, counting every compilation of a grammar (a matcher built, or a
    grammar validated, which compiles it too); everything else is the class's own."""

    def __init__(self) -> None:
        self.real = llguidance.LLMatcher
        self.compiled = 0

    def __call__(self, *args: Any, **kwargs: Any) -> llguidance.LLMatcher:
        self.compiled += 1
        return self.real(*args, **kwargs)

    def validate_grammar(self, *args: Any, **kwargs: Any) -> Any:
        self.compiled += 1
        return self.real.validate_grammar(*args, **kwargs)

    def validate_grammar_with_warnings(self, *args: Any, **kwargs: Any) -> Any:
        self.compiled += 1
        return self.real.validate_grammar_with_warnings(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


@pytest.fixture
def counted(monkeypatch) -> tuple[CountingMatcher, list[int]]:
    """The compilations, and the llguidance tokenizers built (one entry each)."""
    matcher = CountingMatcher()
    monkeypatch.setattr(llguidance, "LLMatcher", matcher)
    built: list[int] = []
    real = servicer.grammar.llg_tokenizer

    def counting(*args: Any, **kwargs: Any) -> llguidance.LLTokenizer:
        built.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(servicer.grammar, "llg_tokenizer", counting)
    return matcher, built


def test_thread_mode_compiles_each_grammar_once(demo_dir: Path, prompts, counted):
    matcher, built = counted
    config = dataclasses.replace(demo_config(demo_dir, speculate=None), engine_mode="thread")
    with ServerThread(config) as server, server.channel() as channel:
        assert len(built) == 1  # the handlers' tokenizer; the engine uses theirs
        for seed, params in enumerate(
            [
                {"regex": r"[a-c]{3}-[0-9]{2}"},
                {"lark_grammar": 'start: "yes" | "no" | "maybe"'},
                {"json_schema": '{"type": "object", "properties": {"a": {"type": "integer"}}}'},
            ]
        ):
            before = matcher.compiled
            outcome = generate(
                channel, prompts[seed], temperature=1.0, seed=seed, max_tokens=32, **params
            )
            assert outcome.error is None and outcome.complete is not None
            assert matcher.compiled - before == 1, params
    assert len(built) == 1


def test_the_compiled_grammar_stays_on_this_side_of_a_process(demo_dir: Path, counted):
    """What crosses to the engine process (or another rank) is the grammar's text; the engine
    there compiles it on a tokenizer of its own."""
    from transformers import AutoTokenizer

    from servicer.engine.constraints import GrammarFactory

    matcher, built = counted
    hf = AutoTokenizer.from_pretrained(str(demo_dir))
    eos = hf.eos_token_id or 0
    checker = servicer.grammar.GrammarChecker(hf, len(hf), eos)
    grammar = llguidance.LLMatcher.grammar_from_regex("ab+")
    constraint = Constraint.checked("regex", grammar, checker.compile(grammar))
    assert matcher.compiled == 1
    request = GenerationRequest(1, "r", [1, 2], 4, constraint=constraint)
    crossed = msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=GenerationRequest)
    assert crossed.constraint == constraint and crossed.constraint.compiled is None

    factory = GrammarFactory(hf, len(hf), eos)
    assert len(built) == 1  # nothing built until a grammar comes uncompiled
    factory.processor(constraint)
    factory.processor(constraint)  # a second row of the request (n > 1): a copy too
    assert (matcher.compiled, len(built)) == (1, 1)
    factory.processor(crossed.constraint)
    assert (matcher.compiled, len(built)) == (2, 2)


def test_a_tokenizer_llguidance_cannot_read_leaves_the_engine_serving(monkeypatch):
    """In the engine process the factory builds its llguidance tokenizer at load; one that
    llguidance cannot read (qwen2 and qwen3_5 in the family matrix) must leave structured
    output unavailable, with the reason, not fail the engine's start."""
    from servicer.engine.constraints import GrammarFactory

    def unreadable(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("no byte tokens")

    monkeypatch.setattr(servicer.grammar, "llg_tokenizer", unreadable)
    factory = GrammarFactory(object(), 64, 0, build_at_load=True)  # the engine starts
    with pytest.raises(ValueError, match="structured output is unavailable"):
        factory.processor(Constraint("regex", "a+"))
