"""A plain decode step of the engine's batch runner (speculation, fused prefill and row groups,
as the engine builds it) hands MLX the operations of mlx-lm's own BatchGenerator step less the
split of its logprobs into a row each (decode_batch.StepRows), and nothing else: whatever the served
path costs beyond the raw engine is host work around the step, never more work on the device
(issue 39, part 3)."""

from __future__ import annotations

import importlib
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from servicer.demos.text import demo_model_path
from servicer.engine import EngineConfig
from servicer.engine.parts import batch_generator_settings, build_parts, new_runner
from servicer.model_files import ModelSpec, prepare_model_files

# What splitting a (rows, vocab) array into rows adds to a graph.
ROW_SPLIT = {"Split", "Squeeze", "Slice", "Reshape"}


class StepGraphs:
    """The operations (by name, with counts) of each graph mlx-lm's decode step launches."""

    def __init__(self, workdir: Path) -> None:
        self.graphs: list[Counter[str]] = []
        self._file = workdir / "step.dot"

    def __getattr__(self, name: str) -> Any:
        return self._async_eval if name == "async_eval" else getattr(mx, name)

    def _async_eval(self, *args: Any) -> None:
        mx.export_to_dot(str(self._file), *[a for _, a in tree_flatten(list(args))])
        lines = self._file.read_text().splitlines()
        self.graphs.append(Counter(line.split('"')[1] for line in lines if "label =" in line))
        mx.async_eval(*args)


def _step_graphs(
    runner: Any, rows: int, new_row: Any, monkeypatch: Any, module: str
) -> list[Counter]:
    """The graphs of three decode steps of `runner` (ours, or mlx-lm's BatchGenerator), seen
    at the `mx` of `module` (the step's)."""
    from mlx_lm.sample_utils import greedy_sampler

    # The module, not a package's function of the same name (mlx_lm.generate).
    step_module = importlib.import_module(module)

    prompts = [[(7 * row + i) % 200 + 3 for i in range(40)] for row in range(rows)]
    caches = [new_row() for _ in range(rows)] if new_row is not None else None
    runner.insert(prompts, max_tokens=[40] * rows, caches=caches, samplers=[greedy_sampler] * rows)
    for _ in range(8):  # the prompts through, every row decoding
        runner.next()
    with tempfile.TemporaryDirectory() as workdir:
        spy = StepGraphs(Path(workdir))
        with monkeypatch.context() as patch:
            patch.setattr(step_module, "mx", spy)
            for _ in range(3):
                runner.next()
    runner.close()
    return spy.graphs


@pytest.mark.parametrize("speculate", [True, False])
@pytest.mark.parametrize("kind", ["llama", "gemma3", "hybrid"])
@pytest.mark.parametrize("rows", [1, 4, 32])
def test_a_plain_decode_step_launches_the_raw_engines_operations(
    kind, rows, speculate, monkeypatch
):
    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator

    from servicer.engine.speculation.ngram import PromptLookup

    # Prompt lookup finds nothing (prose, mostly): every step is a plain one. A verify's step
    # and the one after it (rows then at different lengths) are speculation's own.
    monkeypatch.setattr(PromptLookup, "draft", lambda self, tokens, pending, ks: [[] for _ in ks])

    path = demo_model_path(kind)
    config = EngineConfig()
    stream = mx.new_stream(mx.default_device())
    raw_model, _ = load(str(path))
    # Every prompt in one prefill, as the runner takes what it is given (the plan's to cap).
    settings = {**batch_generator_settings(config, stream), "prefill_batch_size": rows}
    raw_generator = BatchGenerator(raw_model, **settings)
    raw = _step_graphs(raw_generator, rows, None, monkeypatch, "mlx_lm.generate")

    parts = build_parts(config, prepare_model_files(ModelSpec(str(path))).info)
    assert parts.speculation is not None  # speculation is on by default
    ours = new_runner(parts, config, stream, speculate=speculate)
    served = _step_graphs(ours, rows, parts.new_row, monkeypatch, "servicer.engine.decode_batch")
    assert len(raw) == len(served) == 3
    for raw_graph, served_graph in zip(raw, served, strict=True):
        assert not served_graph - raw_graph  # nothing mlx-lm's step does not launch
        # ...and less: the logprobs evaluated as one array, not split into a row each.
        split = raw_graph - served_graph
        assert set(split) <= ROW_SPLIT
        assert split.total() >= rows
    assert sum(raw[0].values()) > 100  # the whole forward, not a fragment of it
