"""Speculation never grows the worker without bound (issue 38), whatever the model.

Recurrent models whose layers ignore per-row lengths (mlx-lm's RWKV-7, Mamba 1, Bailing
linear) once made the verify's rollback replay forever, stacking unevaluated forwards: the
worker grew by gigabytes with no token served (it never even finished its warm-up). Here one
such model, tiny and random, is served with --speculate ngram in a subprocess watched for
time and memory: every request finishes with mlx-lm's own greedy tokens. Models whose layers
read other layers' KV (afm7, gemma3n) serve with speculation off instead of failing.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
import mlx.core as mx
import psutil
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache
from prometheus_client.parser import text_string_to_metric_families
from support import WorkerProcess, generate

from servicer.demos.text import demo_model_path
from servicer.engine.cache_kinds import adopt
from servicer.engine.speculation import speculation_supported
from servicer.sysinfo import free_port

RSS_LIMIT = 2 << 30  # the worker and its engine process together
TIME_LIMIT_S = 120.0
MAX_TOKENS = 24
RWKV7 = {
    "model_type": "rwkv7",
    "hidden_size": 64,
    "intermediate_size": 128,
    "norm_eps": 1e-5,
    "head_dim": 32,
    "num_hidden_layers": 2,
    "a_low_rank_dim": 8,
    "v_low_rank_dim": 8,
    "gate_low_rank_dim": 8,
    "decay_low_rank_dim": 8,
}
# Tiny configs of models that share KV across layers (cache.keys_and_values()).
KV_SHARING = {
    "afm7": {
        "model_type": "afm7",
        "vocab_size": 512,
        "hidden_dim": 128,
        "num_layers": 4,
        "num_kv_reuse_layers": 8,
        "num_heads": 8,
        "num_kv_heads": 4,
    },
}


def _model(config: dict[str, Any]) -> Any:
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    return model_class(args_class.from_dict(config))


@pytest.fixture(scope="module")
def rwkv7_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight RWKV-7 (its layers ignore per-row lengths) with the demo tokenizer."""
    demo = demo_model_path()
    base = json.loads((demo / "config.json").read_text())
    config = {**RWKV7, **{k: base[k] for k in ("vocab_size", "bos_token_id", "eos_token_id")}}
    target = tmp_path_factory.mktemp("rwkv7")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (demo / name).exists():
            shutil.copy(demo / name, target / name)
    mx.random.seed(0)
    model = _model(config)
    mx.save_safetensors(str(target / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (target / "config.json").write_text(json.dumps(config))
    return target


def _greedy(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    """mlx-lm's own greedy continuation of each prompt, alone."""
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    model, _ = load(str(model_dir))
    out = []
    for prompt in prompts:
        steps = generate_step(
            mx.array(prompt), model, max_tokens=MAX_TOKENS, sampler=lambda x: mx.argmax(x, -1)
        )
        out.append([int(token) for token, _ in steps])
    return out


class Watch:
    """Kills the worker once it passes the RSS or time limit, and says which."""

    def __init__(self, worker: WorkerProcess) -> None:
        self.worker, self.peak, self.verdict = worker, 0, ""
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(5)

    def _run(self) -> None:
        assert self.worker.proc is not None
        root, began = psutil.Process(self.worker.proc.pid), time.monotonic()
        while not self._done.wait(0.2):
            try:
                procs = [root, *root.children(recursive=True)]
                rss = sum(p.memory_info().rss for p in procs)
            except psutil.Error:
                return
            self.peak = max(self.peak, rss)
            if rss > RSS_LIMIT or time.monotonic() - began > TIME_LIMIT_S:
                self.verdict = f"killed: RSS {rss >> 20} MiB after {time.monotonic() - began:.0f} s"
                self.worker.kill()
                return


def test_a_model_that_ignores_row_lengths_speculates_within_bounds(rwkv7_dir, prompts):
    # Equal lengths: mlx-lm's batched prefill pads none of them (these layers ignore padding).
    batch = [p[:16] + p[1:9] for p in prompts[:3]]  # repeats: prompt lookup drafts
    want = _greedy(rwkv7_dir, batch)
    assert len({t for row in want for t in row}) >= 8  # varied, so equality says something
    metrics_port = free_port()
    args = ("--model", str(rwkv7_dir), "--speculate", "ngram", "--metrics-port", str(metrics_port))
    with WorkerProcess(*args) as worker, Watch(worker) as watch:
        worker.wait_ready(TIME_LIMIT_S)
        outcomes: list[Any] = [None] * len(batch)

        def ask(i: int) -> None:
            with grpc.insecure_channel(worker.address) as chan:
                outcomes[i] = generate(
                    chan, batch[i], temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True
                )

        callers = [threading.Thread(target=ask, args=(i,)) for i in range(len(batch))]
        for caller in callers:
            caller.start()
        for caller in callers:
            caller.join(TIME_LIMIT_S)
        assert not watch.verdict, watch.verdict
        body = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    for outcome, tokens in zip(outcomes, want, strict=True):
        assert outcome is not None and outcome.error is None, outcome and outcome.error
        assert outcome.tokens == tokens
    assert watch.peak < RSS_LIMIT
    figures = {
        sample.name: sample.value
        for family in text_string_to_metric_families(body)
        for sample in family.samples
    }
    assert figures["mlx_worker_speculation_drafted_tokens_total"] > 0  # it did speculate


def test_a_replay_of_its_own_width_rolls_back_without_advance():
    """RWKV-7 and Mamba 1 never call `advance`: a row that kept all it was fed in a forward
    as wide as it is cut there, so the rollback's replays end (one per length at most)."""
    layer = ArraysCache(1)
    layer[0] = mx.array([[1.0], [2.0]])
    cache = adopt(layer, 4, padding_inert=False)
    cache.checkpoint([3, 2])  # a verify: row 1 padded by one
    cache[0] = mx.array([[10.0], [20.0]])
    assert cache.rollback([3, 2]) == [1]  # row 1's state saw the padding: it replays
    assert cache[0][:, 0].tolist() == [10.0, 2.0]
    cache.checkpoint([0, 2])  # its replay, as wide as its tokens
    cache[0] = mx.array([[30.0], [40.0]])
    assert cache.rollback([0, 2]) == []
    assert cache[0][:, 0].tolist() == [10.0, 40.0]


@pytest.mark.parametrize("kind", sorted(KV_SHARING))
def test_models_that_share_kv_across_layers_serve_with_speculation_off(kind):
    supported, reason = speculation_supported(_model(KV_SHARING[kind]))
    assert not supported
    assert "keys_and_values" in reason
