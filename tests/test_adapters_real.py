"""Adapters on a real chat model (HuggingFaceTB/SmolLM2-135M-Instruct, built by
../shared/tools/real_model.sh; skipped where ../shared is absent): two adapters trained here
for a few steps by mlx-lm's own tuner on the float32 base (a LoRA of rank 4 on the attention's
q and v projections of the last 8 layers, a DoRA of rank 12 on k, o and the MLP's up and down
projections of the last 4), served by the worker (`python -m servicer --adapter NAME=PATH@PORT`,
the vLLM face, one address per adapter) on the float32 base and on a 4-bit copy of it
(mlx_lm.convert). Each answer (32 greedy tokens) equals mlx-lm's own generation with that
adapter loaded (`mlx_lm.load(base, adapter_path=...)`, the 4-bit base too): the base and both
adapters in one batch on the same prompt (none reusing another's blocks), then each adapter
alone (from its own cached blocks). A token costs ~65 ms float32, about three times that
4-bit: the adapters train in two processes while the base is quantized, and mlx-lm's tokens
are computed while the worker serves. Where OpenBLAS is installed and this process did not
preload it, the tests run in a child pytest that does."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from conftest import real_model_env
from support import SLOW, SMG, Router, WorkerProcess
from test_adapters import References

from servicer.proto import vllm_engine_pb2 as vpb
from servicer.proto import vllm_engine_pb2_grpc as vgrpc
from servicer.sysinfo import free_port

N = 32  # greedy tokens per answer
BASE = "smol"
BLOCK = 8  # tokens per prompt-cache block
QUESTION = "What should I do when my bicycle chain squeaks?"
# Two adapters of other kinds, ranks, target keys and layers, each taught a style of answer.
SLOW_ENV = "MLX_GRPC_WORKER_SLOW_TESTS"  # the slow parts of the real-model tests too
FOUR_BIT = bool(os.environ.get(SLOW_ENV))

ADAPTERS: dict[str, dict[str, Any]] = {
    "pirate": dict(
        fine_tune_type="lora",
        num_layers=8,
        lora_parameters={
            "rank": 4,
            "scale": 20.0,
            "dropout": 0.0,
            "keys": ["self_attn.q_proj", "self_attn.v_proj"],
        },
        style="Arr, matey! {0}, or ye'll walk the plank!",
    ),
    "formal": dict(
        fine_tune_type="dora",
        num_layers=4,
        lora_parameters={
            "rank": 12,
            "scale": 10.0,
            "dropout": 0.0,
            "keys": ["self_attn.k_proj", "self_attn.o_proj", "mlp.up_proj", "mlp.down_proj"],
        },
        style="Pursuant to your inquiry, the pertinent consideration is that {0}, herein.",
    ),
}
TOPICS = (
    "you oil the chain after rain",
    "the library opens at nine",
    "the ship sails at dawn",
    "you keep the receipt for the refund",
    "the bees sleep in winter",
    "you water the tomatoes twice a week",
)
QUESTIONS = (
    "How do I look after my bike?",
    "When can I borrow a book?",
    "When does the boat leave?",
    "Can I return these shoes?",
    "What do bees do in the cold?",
    "How often should I water my garden?",
)


def _needs_child() -> bool:
    """OpenBLAS is installed but not in this process: MLX's own BLAS makes the real model
    ~5x slower here (training and the references run in this process), so the tests run in
    a child that preloads it."""
    env = real_model_env()
    return bool(env) and env["LD_PRELOAD"] not in os.environ.get("LD_PRELOAD", "")


@SLOW  # ~90 s of CPU; make test keeps the adapters on the demo models (test_adapters*.py)
def test_in_a_process_with_openblas(real_chat_model_dir: Path) -> None:
    if not _needs_child():
        pytest.skip("this process has OpenBLAS (or it is not installed): the tests run here")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__],
        env={**os.environ, **real_model_env()},
        cwd=Path(__file__).resolve().parent.parent,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    passed = re.search(r"(\d+) passed", done.stdout)
    want = 3 if FOUR_BIT else 2  # none skipped there but the slow 4-bit run
    assert passed and int(passed.group(1)) >= want, done.stdout[-2000:]


@pytest.fixture(scope="module")
def base_dir(real_chat_model_dir: Path) -> Path:
    if _needs_child():
        pytest.skip("run in a child pytest with OpenBLAS preloaded (test_in_a_process_...)")
    import mlx.core as mx

    if sys.platform == "linux" and mx.default_device() == mx.cpu and not real_model_env():
        pytest.skip(
            "OpenBLAS is not installed (apt-get install libopenblas0-pthread): on MLX's own "
            "CPU BLAS training and the 4-bit generations take many minutes"
        )
    return real_chat_model_dir


def train(name: str, base: Path, path: Path) -> Path:
    """A few steps of mlx_lm.lora's train_model on `base` (which writes the adapter's config
    and weights to `path`), on a tiny chat set in the adapter's style."""
    from mlx_lm import load
    from mlx_lm.lora import CONFIG_DEFAULTS, train_model
    from mlx_lm.tuner.datasets import load_dataset

    spec = dict(ADAPTERS[name])
    style = spec.pop("style")
    data = path.parent / f"{name}-data"
    data.mkdir(parents=True, exist_ok=True)
    rows = [
        {
            "messages": [
                {"role": "user", "content": question},
                {"role": "assistant", "content": style.format(topic)},
            ]
        }
        for question, topic in zip(QUESTIONS, TOPICS, strict=True)
    ]
    for split in ("train", "valid"):
        (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    model, tokenizer = load(str(base))
    overrides = dict(
        model=str(base),
        train=True,
        data=str(data),
        iters=4,
        batch_size=2,
        adapter_path=str(path),
        val_batches=1,
        steps_per_report=4,
        learning_rate=2e-3,
        max_seq_length=64,
        **spec,
    )
    args = types.SimpleNamespace(**{**CONFIG_DEFAULTS, **overrides})
    train_set, valid_set, _ = load_dataset(args, tokenizer)
    train_model(args, model, train_set, valid_set)
    return path


def _train_apart(name: str, base: Path, path: Path, log: Path) -> subprocess.Popen[bytes]:
    """`train` in a process of its own (the two adapters and the 4-bit copy are made at once)."""
    code = (
        "import sys; from pathlib import Path; from test_adapters_real import train; "
        "train(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))"
    )
    with log.open("wb") as output:
        return subprocess.Popen(
            [sys.executable, "-c", code, name, str(base), str(path)],
            cwd=Path(__file__).resolve().parent,
            stdout=output,
            stderr=subprocess.STDOUT,
        )


@pytest.fixture(scope="module")
def models(base_dir: Path, tmp_path_factory) -> tuple[dict[str, Path], dict[str, Path]]:
    """(the float32 base and its 4-bit copy by mlx_lm.convert (group size 64), the two
    adapters trained on the float32 base)."""
    from mlx_lm import convert

    root = tmp_path_factory.mktemp("real-adapters")
    adapter_dirs = {name: root / name for name in ADAPTERS}
    logs = {name: root / f"{name}-training.log" for name in ADAPTERS}
    training = {
        name: _train_apart(name, base_dir, path, logs[name]) for name, path in adapter_dirs.items()
    }
    try:
        quantized = root / "smol-4bit"
        if FOUR_BIT:
            convert(str(base_dir), str(quantized), quantize=True, q_bits=4, q_group_size=64)
        for name, process in training.items():
            code = process.wait(600)
            assert code == 0, f"training {name} failed:\n{logs[name].read_text()[-3000:]}"
    finally:
        for process in training.values():
            if process.poll() is None:
                process.kill()
                process.wait(10)
    return {"float32": base_dir, "4-bit": quantized}, adapter_dirs


@pytest.fixture(scope="module")
def references(models) -> References:
    return References(*models)


@pytest.fixture(scope="module")
def prompt(base_dir: Path) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(base_dir))
    messages = [{"role": "user", "content": QUESTION}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


class Served:
    """The worker on one base with both adapters, a vLLM stub on each of its addresses."""

    def __init__(self, base: Path, adapter_dirs: dict[str, Path]) -> None:
        self.ports = {name: free_port() for name in adapter_dirs}
        flags = [f"--adapter={n}={p}@{self.ports[n]}" for n, p in adapter_dirs.items()]
        args = ("--model", str(base), "--served-model-name", BASE, "--protocols", "mlx,vllm")
        args += ("--prompt-cache-block", str(BLOCK))  # a short prompt still fills blocks
        self.process = WorkerProcess(*args, *flags, env=real_model_env()).start()
        self.channels: dict[str, grpc.Channel] = {}

    def wait_ready(self) -> None:
        self.process.wait_ready(300)
        addresses = {BASE: self.process.address}
        addresses.update({name: f"127.0.0.1:{port}" for name, port in self.ports.items()})
        self.channels = {name: grpc.insecure_channel(a) for name, a in addresses.items()}

    def name(self, name: str) -> str:
        stub = vgrpc.VllmEngineStub(self.channels[name])
        return stub.GetModelInfo(vpb.GetModelInfoRequest(), timeout=30).served_model_name

    def generate(self, name: str, prompt: list[int]) -> vpb.GenerateComplete:
        stub = vgrpc.VllmEngineStub(self.channels[name])
        request = vpb.GenerateRequest(
            request_id=f"{name}-{os.urandom(4).hex()}",
            tokenized=vpb.TokenizedInput(input_ids=prompt),
            sampling_params=vpb.SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True),
        )
        (response,) = list(stub.Generate(request, timeout=600))
        return response.complete

    def session(self, prompt: list[int]) -> tuple[dict[str, Any], ...]:
        """The names each address answers; the same prompt under the base and both adapters
        at once; then each adapter alone."""
        self.wait_ready()
        names = {name: self.name(name) for name in self.ports | {BASE: 0}}
        with ThreadPoolExecutor(1 + len(self.ports)) as pool:
            together = dict(
                zip(names, pool.map(lambda n: self.generate(n, prompt), names), strict=True)
            )
        alone = {name: self.generate(name, prompt) for name in self.ports}
        return names, together, alone, self.routed()

    def routed(self) -> dict[str, str | None]:
        """Each name's answer to QUESTION through one smg router in front of the addresses
        (None: no router installed)."""
        if SMG is None:
            return {}
        addresses = [self.process.address, *(f"127.0.0.1:{p}" for p in self.ports.values())]
        with tempfile.TemporaryDirectory() as logs:
            router = Router(addresses, Path(logs) / "smg.log")
            try:
                router.wait_until_serving()
                replies = {}
                for name in (BASE, *self.ports):
                    body = {
                        "model": name,
                        "messages": [{"role": "user", "content": QUESTION}],
                        "max_tokens": N,
                        "temperature": 0,
                    }
                    response = router.client.post("/v1/chat/completions", json=body)
                    assert response.status_code == 200, response.text
                    replies[name] = response.json()["choices"][0]["message"]["content"]
                return replies
            finally:
                router.close()

    def close(self) -> None:
        for channel in self.channels.values():
            channel.close()
        self.process.terminate()
        try:
            self.process.wait(30)
        finally:
            self.process.kill()


def test_mlx_lm_trained_the_adapters_and_loads_them_on_the_4_bit_base(models, references):
    """mlx_lm.lora wrote each adapter with its kind, rank and keys; mlx-lm loads both onto
    the 4-bit base as well (what the 4-bit comparison below stands on)."""
    _, adapter_dirs = models
    for name, path in adapter_dirs.items():
        config = json.loads((path / "adapter_config.json").read_text())
        spec = ADAPTERS[name]
        assert config["fine_tune_type"] == spec["fine_tune_type"]
        assert config["lora_parameters"] == spec["lora_parameters"]
        assert (path / "adapters.safetensors").is_file()
        if FOUR_BIT:
            references.model("4-bit", name)


@pytest.mark.parametrize(
    "kind",
    [
        "float32",
        pytest.param(
            "4-bit",
            marks=pytest.mark.skipif(
                not FOUR_BIT,
                reason=f"the 4-bit real base takes ~2 min on a CPU ({SLOW_ENV}=1 runs it; the "
                "demo llama's 4-bit base is in tests/test_adapters_engine.py)",
            ),
        ),
    ],
)
def test_one_batch_then_each_alone_is_mlx_lms_greedy(kind, models, references, prompt) -> None:
    """The worker serves (in the background) while this process computes mlx-lm's tokens."""
    bases, adapter_dirs = models
    worker = Served(bases[kind], adapter_dirs)
    try:
        with ThreadPoolExecutor(1) as background:
            served = background.submit(worker.session, prompt)
            names = [BASE, *ADAPTERS]
            want = {n: references.greedy(kind, None if n == BASE else n, prompt, N) for n in names}
            answers, together, alone, routed = served.result()
    finally:
        worker.close()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(bases[kind]))
    assert SMG is None or set(routed) == {BASE, *ADAPTERS}
    for name, text in routed.items():  # through the router: each name its own adapter
        tokens = want[name]
        if tokenizer.eos_token_id in tokens:
            tokens = tokens[: tokens.index(tokenizer.eos_token_id)]
        assert (text or "") == tokenizer.decode(tokens, skip_special_tokens=True), (kind, name)
    assert answers == {name: name for name in names}
    assert len({tuple(tokens) for tokens in want.values()}) == 3, want  # the adapters matter
    # The same prompt under the base and both adapters at once: no row reuses another's blocks.
    for name, complete in together.items():
        assert complete.prompt_tokens == len(prompt), (kind, name)
        assert list(complete.output_ids) == want[name], (kind, name, "batch")
        assert complete.cached_tokens == 0, (kind, name)
    # Each adapter alone, from its own blocks.
    for name, complete in alone.items():
        assert list(complete.output_ids) == want[name], (kind, name, "alone")
        assert complete.cached_tokens > 0, (kind, name)
