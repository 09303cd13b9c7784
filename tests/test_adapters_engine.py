"""Several LoRA adapters served beside the base model by the real worker (engine/adapters.py
wired into the engine): the base and three adapters (two LoRA, one DoRA, known random
weights) on the demo llama, float32 and 4-bit, each adapter on its own address. Every answer
is mlx-lm's own greedy generation with that adapter loaded (`mlx_lm.load(base,
adapter_path=...)`): alone, and with rows of the base and all three adapters in one batch
(chunked, right-padded prefill; rows joining and leaving; the same prompt under every
adapter, each reusing only its own cached blocks), plain, verifying ngram drafts every step,
and with an 8-bit KV cache. An adapter that does not fit stops the worker from starting; a
request for an adapter that is not served fails alone."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import mlx.core as mx
import pytest
from conftest import demo_config
from mlx_lm.generate import generate_step
from support import BackgroundGenerate, ServerThread, generate
from test_adapters import RANDOM_ADAPTERS, References, _prompt, bases, write_random_adapter

from servicer.demos.text import demo_model_path
from servicer.engine import Engine, EngineConfig
from servicer.engine.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, AdapterSet
from servicer.engine.cache_kinds import make_row_cache
from servicer.engine_config import SpeculationConfig
from servicer.messages import EngineStartupError, FailureKind, GenerationRequest, SamplingSpec
from servicer.model_files import ModelSpec, prepare_model_files
from servicer.outbox import Outbox

__all__ = ["bases"]  # test_adapters' fixture: the demo llama, float32 and its 4-bit copy

N = 24  # greedy tokens per answer
NAMES = ("a", "b", "c")  # served adapters: test_adapters' "attn" (LoRA), "all" (LoRA), "dora"
KV_BITS, KV_GROUP = 8, 32  # the demo llama's head size is 32
# Drafts verified at every step, also with every row of the mixed batch decoding.
DRAFT_ALWAYS = SpeculationConfig(costed=False, max_rows=16)
MODES = {
    "plain": dict(speculate=None),
    "ngram": dict(speculation=DRAFT_ALWAYS),
    "kv8": dict(kv_bits=KV_BITS, kv_group_size=KV_GROUP, speculation=DRAFT_ALWAYS),
}
# The mixed batch: (adapter or None, prompt, tokens wanted). Prompt 1 under all four.
MIXED = [
    (None, 1, N),
    ("a", 1, N),
    ("b", 1, N),
    ("c", 1, N),
    ("a", 2, N),
    ("c", 4, 16),
    (None, 3, N),
    ("b", 5, 12),
]


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory) -> dict[str, Path]:
    """Adapters a, b and c for the demo llama, as mlx_lm.lora saves them."""
    from mlx_lm import load

    root = tmp_path_factory.mktemp("served-adapters")
    dirs = {}
    for seed, (name, options) in enumerate(zip(NAMES, RANDOM_ADAPTERS.values(), strict=True)):
        model, _ = load(str(demo_model_path("llama")))
        dirs[name] = write_random_adapter(root / name, model, seed=seed, **options)
    return dirs


class Greedy(References):
    """mlx-lm's greedy tokens with one adapter loaded (None: the base), optionally on the
    quantized KV caches the worker's --kv-bits makes (the same cache classes)."""

    def __init__(self, bases: dict[str, Path], adapter_dirs: dict[str, Path]) -> None:
        super().__init__(bases, adapter_dirs)
        self._tokens: dict[tuple[Any, ...], list[int]] = {}

    def tokens(self, base: str, adapter: str | None, prompt: list[int], n: int, kv8: bool):
        key = (base, adapter, tuple(prompt), n, kv8)
        if key not in self._tokens:
            model = self.model(base, adapter)
            cache = make_row_cache(model, KV_BITS, KV_GROUP) if kv8 else None
            steps = generate_step(mx.array(prompt), model, max_tokens=n, prompt_cache=cache)
            self._tokens[key] = [int(token) for token, _ in steps]
        return self._tokens[key]


@pytest.fixture(scope="module")
def greedy(bases, adapter_dirs) -> Greedy:
    return Greedy(bases, adapter_dirs)


class Rows:
    """The adapter index of every row of every forward that had an adapter row."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.seen: list[tuple[int, ...]] = []
        real = AdapterSet.set

        def spy(adapters: AdapterSet, rows: Any) -> None:
            self.seen.append(tuple(int(i) for i in rows))
            real(adapters, rows)

        monkeypatch.setattr(AdapterSet, "set", spy)

    def mixed(self, rows: int, kinds: int) -> bool:
        """Some forward ran at least `rows` rows of at least `kinds` adapters (the base one)."""
        return any(len(r) >= rows and len(set(r)) >= kinds for r in self.seen)


class Served:
    """A running worker with adapters a, b and c, each on its own address."""

    def __init__(self, running: ServerThread) -> None:
        self.running = running
        self._channels = {None: running.channel()}
        for name, port in running.server.adapter_ports.items():
            self._channels[name] = grpc.insecure_channel(f"127.0.0.1:{port}")

    def channel(self, adapter: str | None) -> grpc.Channel:
        return self._channels[adapter]

    def generate(self, adapter: str | None, prompt: list[int], n: int) -> Any:
        channel = self._channels[adapter]
        outcome = generate(channel, prompt, temperature=0, max_tokens=n, ignore_eos=True)
        assert outcome.error is None, (adapter, outcome.error)
        return outcome

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()


def adapters_config(base: Path, adapter_dirs: dict[str, Path], **engine: Any):
    config = demo_config(
        base,
        adapters=tuple((name, str(path)) for name, path in adapter_dirs.items()),
        prefill_step_size=8,  # prompts in several right-padded chunks
        prompt_cache_block=16,
        **engine,
    )
    return replace(
        config, engine_mode="thread", adapter_ports=tuple((name, 0) for name in adapter_dirs)
    )


@pytest.fixture(scope="module", params=list(MODES))
def mode(request) -> str:
    return request.param


@pytest.fixture(scope="module", params=["float32", "4-bit"])
def served(request, bases, adapter_dirs, mode) -> Iterator[tuple[str, str, Served]]:
    config = adapters_config(bases[request.param], adapter_dirs, **MODES[mode])
    with ServerThread(config) as running:
        worker = Served(running)
        try:
            yield request.param, mode, worker
        finally:
            worker.close()


def test_each_adapter_alone_and_all_in_one_batch_are_mlx_lms_greedy(
    served, greedy, reference, monkeypatch
) -> None:
    base, mode, worker = served
    kv8 = mode == "kv8"
    prompts = {i: _prompt(reference.tokenizer, i) for _, i, _ in MIXED}
    assert len({len(p) for p in prompts.values()}) >= 4
    want = {(name, i, n): greedy.tokens(base, name, prompts[i], n, kv8) for name, i, n in MIXED}
    assert len({tuple(want[None, 1, N]), *(tuple(want[x, 1, N]) for x in NAMES)}) == 4
    # Alone, one after another: the same prompt under the base and each adapter.
    for name in (None, *NAMES):
        outcome = worker.generate(name, prompts[1], N)
        assert outcome.tokens == want[name, 1, N], (base, mode, name)
        assert outcome.complete.cached_tokens == 0  # no other adapter's blocks
    # Together: the base and all three adapters in one batch, prompt 1 from each one's cache.
    rows = Rows(monkeypatch)
    with ThreadPoolExecutor(len(MIXED)) as pool:
        outcomes = list(
            pool.map(lambda job: worker.generate(job[0], prompts[job[1]], job[2]), MIXED)
        )
    for job, outcome in zip(MIXED, outcomes, strict=True):
        assert outcome.tokens == want[job], (base, mode, job)
        if job[1] == 1:
            assert outcome.complete.cached_tokens > 0, job  # its own blocks from before
    assert rows.mixed(6, 4), rows.seen[:8]
    figures = worker.running.server.servicer.figures().speculation
    if mode != "plain":
        assert figures is not None and figures.drafted > 0


LONG = 160  # tokens of a row that decodes while another prompt is prefilled


def test_a_prompt_rides_in_the_decoding_forward_only_where_no_row_has_an_adapter(
    bases, adapter_dirs, greedy, reference
) -> None:
    """Fused prefill with adapters loaded: a base prompt's chunks ride in the forward of base
    rows that decode; beside a row of an adapter, or for an adapter's prompt, they run apart
    (a packed forward sets no rows' adapters). Every answer is still mlx-lm's."""
    config = adapters_config(
        bases["float32"], adapter_dirs, speculate=None, fuse_prefill=True, prompt_cache_size=0
    )
    decoding_prompt, long_prompt = _prompt(reference.tokenizer, 0), _prompt(reference.tokenizer, 5)
    long_prompt = (long_prompt * 3)[:64]
    with ServerThread(config) as running:
        worker = Served(running)
        try:
            for first, second in ((None, None), ("a", None), (None, "b")):
                before = _fused_steps(running)
                params = dict(temperature=0, max_tokens=LONG, ignore_eos=True)
                decoding = BackgroundGenerate(worker.channel(first), decoding_prompt, **params)
                assert decoding.started.wait(60)
                joining = worker.generate(second, long_prompt, N)
                decoding.join(120)
                assert decoding.outcome is not None and decoding.outcome.error is None
                assert decoding.outcome.tokens == greedy.tokens(
                    "float32", first, decoding_prompt, LONG, False
                ), (first, second)
                want = greedy.tokens("float32", second, long_prompt, N, False)
                assert joining.tokens == want, (first, second)
                fused = _fused_steps(running) - before
                assert fused > 0 if first is second is None else fused == 0, (first, second)
        finally:
            worker.close()


def _fused_steps(running: ServerThread) -> float:
    registry = running.server.metrics.registry
    return registry.get_sample_value("mlx_worker_prefill_steps_fused_total") or 0.0


# ----- refusals -----


def test_an_adapter_that_does_not_fit_stops_the_worker_starting(adapter_dirs, tmp_path) -> None:
    base = demo_model_path("llama")
    cases = {
        "missing": (tmp_path / "nowhere", "no such adapter directory"),
        "broken": (tmp_path / "broken", "lora_parameters.rank must be a positive integer"),
    }
    (tmp_path / "broken").mkdir()
    source = adapter_dirs["a"]
    (tmp_path / "broken" / ADAPTER_CONFIG).write_text(
        (source / ADAPTER_CONFIG).read_text().replace('"rank": 4', '"rank": 0')
    )
    (tmp_path / "broken" / ADAPTER_WEIGHTS).write_bytes((source / ADAPTER_WEIGHTS).read_bytes())
    for name, (path, reason) in cases.items():
        dirs = {"a": adapter_dirs["a"], name: path}
        with (
            pytest.raises(EngineStartupError, match=f"adapter '{name}'.*{reason}"),
            ServerThread(adapters_config(base, dirs)),
        ):
            pass


def test_adapters_refuse_adapter_path_and_distributed(adapter_dirs) -> None:
    from servicer.engine.model import LoadedModel
    from servicer.engine.parts import _adapters
    from servicer.model_files import ModelLoadError

    config = EngineConfig(adapters=(("a", str(adapter_dirs["a"])),))
    loaded = LoadedModel(model=None, tokenizer=None)  # type: ignore[arg-type]
    with pytest.raises(ModelLoadError, match="not supported with --distributed"):
        _adapters(config, loaded, shared=True)
    with pytest.raises(ModelLoadError, match="cannot be combined with --adapter-path"):
        _adapters(replace(config, adapter_path=str(adapter_dirs["b"])), loaded, shared=False)
    assert _adapters(EngineConfig(), loaded, shared=True) is None


class Results:
    """What an engine run in this thread's test sends out: tokens and failures by ticket."""

    def __init__(self) -> None:
        self.tokens: dict[int, list[int]] = {}
        self.failures: dict[int, Any] = {}
        self.finished: set[int] = set()
        self._cond = threading.Condition()
        self.outbox = Outbox(self._woken)

    def _woken(self) -> None:
        out = self.outbox.take()
        if out is None:
            return
        with self._cond:
            for event in out.events:
                if event.token is not None:
                    self.tokens.setdefault(event.ticket, []).append(event.token)
                if event.finish_reason is not None:
                    self.finished.add(event.ticket)
            for failure in out.failures:
                self.failures[failure.ticket] = failure
                self.finished.add(failure.ticket)
            self._cond.notify_all()

    def wait(self, *tickets: int) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: set(tickets) <= self.finished, 120)


def _request(ticket: int, prompt: list[int], adapter: str = "") -> GenerationRequest:
    return GenerationRequest(
        ticket, f"r{ticket}", prompt, N, SamplingSpec(temperature=0.0), adapter=adapter
    )


@pytest.mark.parametrize("loaded", [True, False], ids=["adapters", "none"])
def test_a_request_for_an_adapter_not_served_fails_alone(
    loaded, adapter_dirs, greedy, prompts
) -> None:
    """Engine level (the handlers only send the names they serve): an unknown name fails its
    request with INVALID_ARGUMENT; the rows beside it go on."""
    served = tuple((n, str(p)) for n, p in adapter_dirs.items()) if loaded else ()
    results = Results()
    engine = Engine(EngineConfig(adapters=served, prompt_cache_size=0), results.outbox)
    engine.start(prepare_model_files(ModelSpec(str(demo_model_path("llama")))).info)
    engine.wait_ready(120)
    try:
        engine.submit(_request(1, prompts[0], "a" if loaded else ""))
        engine.submit(_request(2, prompts[1], "nope"))
        engine.submit(_request(3, prompts[2]))
        assert results.wait(1, 2, 3)
    finally:
        engine.shutdown(30)
    failure = results.failures[2]
    assert failure.kind == FailureKind.INVALID_ARGUMENT and 2 not in results.tokens
    assert "adapter 'nope' is not served here" in failure.message
    assert ("served: a, b, c" if loaded else "no adapters are loaded") in failure.message
    first = "a" if loaded else None
    assert results.tokens[1] == greedy.tokens("float32", first, prompts[0], N, False)
    assert results.tokens[3] == greedy.tokens("float32", None, prompts[2], N, False)


def test_adapter_weights_count_against_the_memory_left_to_requests(adapter_dirs) -> None:
    """The adapters are loaded before the admission guard weighs the model: its limit (half
    the device's memory less the weights) is smaller by exactly their bytes."""
    from servicer.engine.parts import build_parts

    info = prepare_model_files(ModelSpec(str(demo_model_path("llama")))).info
    served = tuple((n, str(p)) for n, p in adapter_dirs.items())
    plain = build_parts(EngineConfig(prompt_cache_size=0), info)
    with_adapters = build_parts(EngineConfig(prompt_cache_size=0, adapters=served), info)
    assert plain.adapters is None and with_adapters.adapters is not None
    assert sorted(with_adapters.adapters.names) == list(NAMES)
    added = sum(
        value.nbytes
        for path in adapter_dirs.values()
        for value in mx.load(str(path / ADAPTER_WEIGHTS)).values()
    )  # a DoRA adapter's magnitude becomes its norm scale: the same size
    dropped = plain.admission.limit_bytes - with_adapters.admission.limit_bytes
    assert dropped == added


# ----- rows in attention groups -----


def test_rows_in_attention_groups_take_their_adapters(adapter_dirs) -> None:
    """Long prompts joining short rows make a second attention group (row_groups: the
    projections still run over the whole batch, the attention per group): rows of the base
    and of every adapter, in both groups, get the tokens they get in one padded batch."""
    from mlx_lm import load
    from spec_support import drive, plain_generator, runner_kwargs
    from test_row_groups import grouping_runner, mixed_jobs, most_groups

    from servicer.engine import fused_prefill
    from servicer.engine.adapters import load_adapters
    from servicer.engine.row_inputs import RowInputs
    from servicer.engine.runner import BatchRunner

    model, tokenizer = load(str(demo_model_path("llama")))
    assert fused_prefill.enable_fused_prefill(model)
    adapters = load_adapters(model, adapter_dirs)
    jobs = mixed_jobs(tokenizer, 0)
    indices = {job.name: i % (1 + len(NAMES)) for i, job in enumerate(jobs)}
    assert len(set(indices.values())) == 1 + len(NAMES)

    def run(runner: Any, probe: Any = None) -> dict[str, Any]:
        insert = runner.insert
        by_prompt = {tuple(job.prompt): indices[job.name] for job in jobs}

        def with_adapters(prompts: list[list[int]], **kwargs: Any) -> list[int]:
            rows = [RowInputs(adapter=by_prompt[tuple(p)]) for p in prompts]
            return insert(prompts, inputs=rows, **kwargs)

        runner.insert = with_adapters
        return drive(runner, mixed_jobs(tokenizer, 0), probe)

    want = run(BatchRunner(model, adapters=adapters, **runner_kwargs()))  # one padded batch
    grouping = grouping_runner(model, adapters=adapters)
    probe = most_groups(grouping)
    got = run(grouping, probe)
    assert max(probe.seen) >= 2, "no step ran with its rows in two groups"
    for name, result in want.items():
        assert got[name].tokens == result.tokens, (name, indices[name])
    base = drive(plain_generator(model), mixed_jobs(tokenizer, 0))
    adapted = [name for name, index in indices.items() if index]
    assert any(base[name].tokens != want[name].tokens for name in adapted)


def test_adapter_path_still_applies_one_adapter_at_load(adapter_dirs, greedy, reference) -> None:
    """--adapter-path (mlx-lm's own adapter, applied as the model loads) serves as before: the
    base address answers with that adapter's greedy tokens."""
    config = demo_config(demo_model_path("llama"), adapter_path=str(adapter_dirs["c"]))
    prompt = _prompt(reference.tokenizer, 2)
    with ServerThread(replace(config, engine_mode="thread")) as running, running.channel() as chan:
        outcome = generate(chan, prompt, temperature=0, max_tokens=N, ignore_eos=True)
    assert outcome.error is None
    assert outcome.tokens == greedy.tokens("float32", "c", prompt, N, False)
