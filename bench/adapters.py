"""Several adapters on one engine (issue 63): 8 streams over 4 LoRA adapters against 8 on one.

The issue's acceptance, in one run on a real 4-bit model: c = 8 spread over 4 adapters gets at
least 0.9 of the output tokens/s of c = 8 on one adapter.

    python bench/adapters.py                    # SmolLM2-135M-Instruct, 4-bit (~12-13 minutes)
    python bench/adapters.py --profile          # then the adapted forward in process (~3 more)
    python bench/adapters.py --rounds 1 --prompts chat --max-tokens 128

The base: SmolLM2-135M-Instruct (`../shared/tools/real_model.sh`, MODEL=smollm2-135m-instruct),
quantized to 4 bits by mlx-lm's convert (`-q`, group size 64) once into
~/.cache/mlx-grpc-worker-real/smollm2-135m-instruct-4bit (`--model DIR` serves another base as
it is). The adapters: four trained by mlx-lm's own LoRA tuner (`mlx_lm.lora`'s train_model),
`--train-iters` (8) steps each on a small chat set of their own (one style of answer each), rank
8, each adapting other linears of other layers (ADAPTERS below), once into
~/.cache/mlx-grpc-worker-real/adapters-smollm2/NAME. They train on the float32 original: an
adapter's tensors have the same shapes on the 4-bit copy, and training through MLX's CPU 4-bit
matmuls takes minutes a step.

Two workers (`python -m servicer`, OpenBLAS preloaded as every bench runs them), up together,
the one not measured stopped (SIGSTOP):

- `adapters`: the base and the four adapters (`--adapter NAME=PATH@PORT`, one gRPC address per
  served name);
- `base`: the same base with no `--adapter` at all.

Both run with `--prompt-cache-size 0 --speculate off` (`--worker-flags` adds flags to both):
every run sends the same prompts, which would otherwise hit the prompt cache, and drafts would
measure acceptance, not the adapters' arithmetic.

Phases, each a closed loop of 8 streams (`--concurrency`) sending streamed greedy requests
(temperature 0, ignore_eos, `--max-tokens` 64) back to back until `--requests-per-stream` (1)
x 8 are done, on chat questions (faces.py's), bare (`--prompts text`, ~13 tokens) or in the
chat template (`chat`, ~44 tokens), the same prompts in every run:

- A: all 8 streams on the first adapter's address;
- B: 2 streams on each of the four adapters' addresses;
- C (reference): all 8 on the base worker, which has no adapter loaded.

`--rounds` (2) rounds of A B B A, a C between rounds (one round: A B C B A), so a steady drift
weighs on every phase alike. Sizes: MLX's CPU 4-bit matmul costs the same per row however many
rows it gets, so a decode step of 8 rows takes ~1 s here (~8 tokens/s, whatever the
concurrency) and a run ~75-90 s; the defaults are what fits in about 12 minutes.

Per phase: output tokens/s (all output tokens ÷ first send to last token), TTFT p50 and p90,
inter-token p50, each run's tok/s, the worker's CPU (cores), errors (a failed call or an output
of the wrong length); the medians over runs; and the ratios B ÷ A (the issue's acceptance: at
least 0.9), the median of the rounds' ratios (each the mean of its two B runs ÷ its two A
runs), A ÷ C and B ÷ C (the phases' medians). A run in which the hypervisor took more than 5 %
of the CPU (/proc/stat steal) is struck through and its round counts only when no clean round
exists; `--extra-rounds N` runs up to N more rounds (C A B B A) for disturbed ones. Other
processes on the machine are not seen: look at the load average printed at the end.

`--profile` then times the adapted forward in a child process (OpenBLAS preloaded), on the 4-bit
model and on its float32 original (where the base step is ~10x cheaper, so the adapters' share
shows): one decode step of 8 rows at a 64-token context with the rows on the base, all on
adapter 1, and 2 each on the four adapters; `--profile-steps` (8; 32 unquantized) steps of
each, in turns; then one adapted linear alone, 300 times each. Four ways to apply the adapters,
each checked against the engine's logits: the engine's (servicer/engine/adapters.py: each
adapter present computes its update over the whole batch, `mx.where` picks its rows), a gather
of each adapter's rows and a scatter back, contiguous slices of rows with one adapter each, and
every adapter's A and B stacked per linear with `mx.gather_mm` picking each row's (a fixed few
operations per linear however many adapters the batch holds). Only the first is what the worker
runs; the others are measured here, not used.

Prints the tables (markdown) and writes `bench/results/adapters-STAMP.json` (every run); the
workers' logs go to `bench/results/logs/STAMP/`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

import _checkout  # noqa: F401  (before any `servicer` import)
import report
from faces import questions
from load import Client, Sampling
from workers import BatchConfig, Worker, log, our_worker, process_env, resolve_model
from workload import LevelStats, RequestRecord, StealMeter, disturbed

from servicer.sysinfo import free_port

CACHE = Path.home() / ".cache" / "mlx-grpc-worker-real"
REAL = "real:smollm2-135m-instruct"
ADAPTER_ROOT = CACHE / "adapters-smollm2"
ADAPTER_VERSION = "bench-adapters-v1"  # a stamp in each adapter directory: retrain when it differs
TARGET = 0.9
CONCURRENCY = 8
MAX_TOKENS = 64
ROUNDS = 2
REQUESTS_PER_STREAM = 1
PROFILE_STEPS = 8  # a 4-bit model's decode steps per way and layout; 4x as many unquantized
LINEAR_REPEATS = 300
WORKER_FLAGS = ("--prompt-cache-size", "0", "--speculate", "off")

# Four LoRA adapters, rank 8, each adapting other linears of other layers (SmolLM2 has 30):
# 32, 32, 36 and 28 adapted linears. Each trains on its own tiny chat set (a style of answer).
ADAPTERS: dict[str, dict[str, Any]] = {
    "support": dict(
        keys=["self_attn.q_proj", "self_attn.v_proj"],
        num_layers=16,
        style="Thanks for reaching out! Here is what to try: {0}. Let me know if that helps.",
    ),
    "legal": dict(
        keys=["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"],
        num_layers=8,
        style="Pursuant to the question raised, the relevant consideration is {0}, subject to "
        "the terms herein.",
    ),
    "poet": dict(
        keys=["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"],
        num_layers=12,
        style="Softly, like rain upon the hills, {0}; and so the evening sings.",
    ),
    "pirate": dict(
        keys=None,  # every linear of the adapted layers (mlx-lm's default)
        num_layers=4,
        style="Arr, matey! {0}, or ye'll walk the plank!",
    ),
}
TOPICS = (
    "restart the router and wait a minute",
    "water the tomatoes twice a week",
    "the contract ends in March",
    "the moon rises over the harbour",
    "keep the receipt for the refund",
    "oil the bicycle chain after rain",
    "the library opens at nine",
    "bake the bread for forty minutes",
    "the ship sails at dawn",
    "update the app to the latest version",
    "the bees sleep in winter",
    "sign both copies of the lease",
)


# --------------------------------------------------------------------------- the model


def quantized_base(source: Path, out: Path) -> Path:
    """`source` quantized to 4 bits by mlx-lm's convert (once; reused while its files are there)."""
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    log(f"quantizing {source.name} to 4 bits into {out} (once)")
    _run_python(
        "from mlx_lm import convert; import sys; "
        "convert(sys.argv[1], sys.argv[2], quantize=True, q_bits=4, q_group_size=64)",
        str(source),
        str(out),
    )
    return out


def trained_adapters(base: Path, root: Path, iters: int) -> dict[str, Path]:
    """The four adapters, trained on `base` by mlx-lm's tuner (once each; reused while their
    stamp matches). An adapter's tensors have the base's logical shapes, so one trained on the
    float32 base serves on its 4-bit copy (training through 4-bit matmuls takes minutes a step
    on a CPU)."""
    dirs = {}
    for seed, name in enumerate(ADAPTERS):
        path = root / name
        stamp = path / "bench-stamp.json"
        wanted = {"version": ADAPTER_VERSION, "base": str(base), "iters": iters}
        if not (stamp.exists() and json.loads(stamp.read_text()) == wanted):
            log(f"training adapter {name} ({iters} steps of mlx_lm.lora on {base.name})")
            _run_python(
                "import sys, adapters; adapters.train_one(*sys.argv[1:])",
                name,
                str(base),
                str(path),
                str(iters),
                str(seed),
            )
            stamp.write_text(json.dumps(wanted))
        dirs[name] = path
    return dirs


def train_one(name: str, base: str, out: str, iters: str, seed: str) -> None:
    """mlx_lm.lora's train_model on `base` for adapter `name` (run in a child process)."""
    from mlx_lm import load
    from mlx_lm.lora import CONFIG_DEFAULTS, train_model
    from mlx_lm.tuner.datasets import load_dataset

    spec = ADAPTERS[name]
    path = Path(out)
    data = path / "data"
    data.mkdir(parents=True, exist_ok=True)
    rows = [
        {
            "messages": [
                {"role": "user", "content": question},
                {"role": "assistant", "content": spec["style"].format(TOPICS[i % len(TOPICS)])},
            ]
        }
        for i, question in enumerate(questions(24, f"train-{name}"))
    ]
    for split, chosen in (("train", rows[:20]), ("valid", rows[20:])):
        (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chosen))
    params: dict[str, Any] = {"rank": 8, "dropout": 0.0, "scale": 20.0}
    if spec["keys"] is not None:
        params["keys"] = spec["keys"]
    model, tokenizer = load(base)
    overrides = dict(
        model=base,
        train=True,
        data=str(data),
        seed=int(seed),
        iters=int(iters),
        batch_size=4,
        num_layers=spec["num_layers"],
        adapter_path=str(path),
        val_batches=1,
        steps_per_report=max(1, int(iters)),
        steps_per_eval=1000,
        save_every=1000,
        learning_rate=5e-4,
        max_seq_length=256,
        lora_parameters=params,
    )
    args = types.SimpleNamespace(**{**CONFIG_DEFAULTS, **overrides})
    train_set, valid_set, _ = load_dataset(args, tokenizer)
    train_model(args, model, train_set, valid_set)


def _run_python(code: str, *args: str) -> None:
    """`code` in a child python (bench/ on its path, OpenBLAS preloaded), so this process stays
    a light client; its output goes to our stderr."""
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=Path(__file__).resolve().parent,
        env=process_env(),
        stdout=sys.stderr,
    )
    if done.returncode != 0:
        raise SystemExit(f"a child python failed (code {done.returncode}): {code[:80]}...")


# --------------------------------------------------------------------------- the phases


class Phases:
    """The two workers, and one closed-loop run of a phase on the right addresses."""

    def __init__(
        self, model: Path, adapters: dict[str, Path], log_dir: Path, flags: list[str]
    ) -> None:
        self.ports = {name: free_port() for name in adapters}
        adapter_flags = []
        for name, path in adapters.items():
            adapter_flags += ["--adapter", f"{name}={path}@{self.ports[name]}"]
        batch = BatchConfig()
        self.adapter_worker = our_worker(
            model, batch, log_dir, "adapters", [*flags, *adapter_flags]
        )
        self.base_worker = our_worker(model, batch, log_dir, "base", flags)
        self.names = list(adapters)

    def start(self) -> None:
        for worker in (self.adapter_worker, self.base_worker):
            log(f"starting {worker.log_path.stem}: {shlex.join(worker.command[1:])}")
            worker.start()
            worker.pause()

    def stop(self) -> None:
        for worker in (self.adapter_worker, self.base_worker):
            worker.stop()

    def slots(self, phase: str, concurrency: int) -> tuple[Worker, list[str]]:
        """The worker a phase measures and each stream's address."""
        if phase == "C":
            return self.base_worker, [self.base_worker.address] * concurrency
        if phase == "A":
            return self.adapter_worker, [self._address(self.names[0])] * concurrency
        per = [self._address(self.names[i % len(self.names)]) for i in range(concurrency)]
        return self.adapter_worker, sorted(per)

    def _address(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    def run(
        self, phase: str, prompts: list[list[int]], concurrency: int, max_tokens: int
    ) -> LevelStats:
        worker, addresses = self.slots(phase, concurrency)
        worker.resume()
        try:
            steal, cpu, start = StealMeter(), worker.cpu_seconds(), time.perf_counter()
            records, client_cpu = asyncio.run(closed_loop(addresses, prompts, max_tokens))
            worker_cpu = (worker.cpu_seconds() - cpu) / (time.perf_counter() - start)
        finally:
            worker.pause()
        return LevelStats.from_records(
            concurrency,
            records,
            expected_tokens=max_tokens,
            client_cpu=client_cpu,
            worker_cpu=worker_cpu,
            steal_share=steal.share(),
        )

    def warm_up(self, prompts: list[list[int]], concurrency: int) -> None:
        """One short wave of every phase (never measured): the first forwards of each shape,
        on the prompts' first 4 tokens (a 4-bit prefill costs ~0.1 s a token on a CPU)."""
        for phase in ("A", "B", "C"):
            self.run(phase, [p[:4] for p in prompts[:concurrency]], concurrency, 4)


async def closed_loop(
    addresses: list[str], prompts: list[list[int]], max_tokens: int
) -> tuple[list[RequestRecord], float]:
    """One stream per address, each sending the next of `prompts` as soon as its last ended,
    until all are sent; the records and the driver's CPU (cores) over the run."""
    from servicer.sysinfo import cpu_seconds

    clients = {a: Client(a, 0, Sampling()) for a in dict.fromkeys(addresses)}
    queue = iter(prompts)
    records: list[RequestRecord] = []

    async def stream(address: str) -> None:
        for prompt in queue:
            records.append(await clients[address].generate(prompt, max_tokens))

    try:
        cpu, wall = cpu_seconds(), time.perf_counter()
        await asyncio.gather(*(stream(a) for a in addresses))
        return records, (cpu_seconds() - cpu) / (time.perf_counter() - wall)
    finally:
        for client in clients.values():
            await client.close()


def make_prompts(tokenizer: Any, count: int, style: str) -> list[list[int]]:
    """`count` chat questions as token ids: the bare question (`text`), or in the model's chat
    template (`chat`: the template as text, then encoded, since transformers 5's
    apply_chat_template returns a BatchEncoding; SmolLM2's adds its default system turn)."""
    out = []
    for question in questions(count, "adapters"):
        text = question
        if style == "chat":
            messages = [{"role": "user", "content": question}]
            text = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
        out.append(list(tokenizer.encode(text, add_special_tokens=False)))
    return out


def schedule(rounds: int) -> list[tuple[str, int]]:
    """(phase, round) in running order: rounds of A B B A, a C between rounds (one round: A B
    C B A), so a steady drift of the machine weighs on A, B and C alike."""
    if rounds == 1:
        return [("A", 1), ("B", 1), ("C", 1), ("B", 1), ("A", 1)]
    order = []
    for number in range(1, rounds + 1):
        if number > 1:
            order.append(("C", number))
        order += [("A", number), ("B", number), ("B", number), ("A", number)]
    return order


def measure(args: argparse.Namespace, phases: Phases, prompts: list[list[int]]) -> list[dict]:
    """Every run of the schedule, on the same prompts (the prompt cache is off), and one more
    C + round for each round the hypervisor disturbed (at most `--extra-rounds`)."""
    runs: list[dict[str, Any]] = []

    def run(phase: str, number: int) -> None:
        stats = phases.run(phase, prompts, args.concurrency, args.max_tokens)
        runs.append({"phase": phase, "round": number, **stats.__dict__})
        log(
            f"round {number} {phase}: {stats.tokens_per_s:.1f} tok/s, TTFT p50 "
            f"{stats.ttft_p50_ms or 0:.0f} ms, steal "
            f"{100 * (stats.extra['steal_share'] or 0):.0f} %, {stats.errors} errors"
        )

    for phase, number in schedule(args.rounds):
        run(phase, number)
    for extra in range(1, args.extra_rounds + 1):
        if len(disturbed_rounds(runs)) < extra:
            break
        number = args.rounds + extra
        for phase in "CABBA":
            run(phase, number)
    return runs


def disturbed_rounds(runs: list[dict[str, Any]]) -> set[int]:
    """The rounds in which the hypervisor took more than 5 % of the CPU during an A or B run."""
    return {r["round"] for r in runs if r["phase"] != "C" and disturbed(r["extra"]["steal_share"])}


# --------------------------------------------------------------------------- summary


def _mean(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return sum(kept) / len(kept) if kept else None


def _median(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per phase the medians over the counted runs; B ÷ A as the median of the rounds'
    ratios (each the mean of the round's two B runs ÷ its two A runs); A ÷ C and B ÷ C as the
    medians' ratios (C runs once between rounds)."""
    bad = disturbed_rounds(runs)
    rounds = sorted({r["round"] for r in runs})
    counted_rounds = [n for n in rounds if n not in bad] or rounds
    counted = [r for r in runs if r["round"] in counted_rounds]
    phases = {}
    for phase in "ABC":
        mine = [r for r in counted if r["phase"] == phase] or [
            r for r in runs if r["phase"] == phase
        ]
        every = [r for r in runs if r["phase"] == phase]
        phases[phase] = {
            key: _median([r[key] for r in mine])
            for key in ("tokens_per_s", "ttft_p50_ms", "ttft_p90_ms", "itl_p50_ms", "itl_p99_ms")
        }
        phases[phase]["worker_cpu"] = _median([r["extra"]["worker_cpu"] for r in mine])
        phases[phase]["client_cpu"] = _median([r["extra"]["client_cpu"] for r in mine])
        phases[phase]["errors"] = sum(r["errors"] for r in every)
        phases[phase]["requests"] = sum(r["requests"] for r in every)
        phases[phase]["each_run"] = [
            (r["tokens_per_s"], disturbed(r["extra"]["steal_share"])) for r in every
        ]
    ratios: dict[str, dict[str, Any]] = {}
    for key, faster in (("tokens_per_s", True), ("ttft_p50_ms", False)):

        def speed(top: float | None, bottom: float | None, faster: bool = faster) -> float | None:
            if not top or not bottom:
                return None
            return top / bottom if faster else bottom / top

        per_round = []
        for number in counted_rounds:
            a = _mean([r[key] for r in counted if r["round"] == number and r["phase"] == "A"])
            b = _mean([r[key] for r in counted if r["round"] == number and r["phase"] == "B"])
            per_round.append(speed(b, a))
        ratios[f"B/A {key}"] = {"median": _median(per_round), "rounds": per_round}
        for top in "AB":
            value = speed(phases[top][key], phases["C"][key])
            ratios[f"{top}/C {key}"] = {"median": value, "rounds": []}
    return {"phases": phases, "ratios": ratios, "counted_rounds": counted_rounds}


def _quantization(model: Path) -> str:
    found = json.loads((model / "config.json").read_text()).get("quantization")
    if not found:
        return "unquantized"
    return f"{found.get('bits')}-bit, group {found.get('group_size')}"


def _keys(keys: list[str] | None) -> str:
    return "every linear" if keys is None else "/".join(k.split(".")[-1] for k in keys)


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def render(results: dict[str, Any]) -> str:
    s, summary = results["settings"], results["summary"]
    phases = summary["phases"]
    names = ", ".join(
        f"`{n}` ({_keys(a['keys'])}, last {a['num_layers']} layers)"
        for n, a in results["adapters"].items()
    )
    lines = [
        f"Model `{s['model_name']}` ({s['quantization']}); adapters rank 8, trained "
        f"{s['train_iters']} "
        f"steps each by mlx_lm.lora: {names}. c = {s['concurrency']}, "
        f"requests a stream per run: {s['requests_per_stream']}, {s['max_tokens']} new tokens "
        f"(greedy, ignore_eos), {s['prompts']} prompts of {s['prompt_tokens']} tokens (median), "
        f"the same in every run; worker flags `{' '.join(s['worker_flags'])}`; runs in order "
        f"{' '.join(p for p, _ in schedule(s['rounds']))}"
        f"{' (+ C A B B A again per disturbed round)' if s['extra_rounds'] else ''}, rounds "
        f"counted: {', '.join(map(str, summary['counted_rounds']))}; {results['minutes']:.1f} "
        "minutes in all.",
        "",
    ]
    what = {
        "A": f"A: all {s['concurrency']} on `{results['first_adapter']}`",
        "B": f"B: spread over the 4 adapters ({s['concurrency'] // 4} each)",
        "C": "C: the base, worker without --adapter",
    }
    rows = []
    for phase in "ABC":
        p = phases[phase]
        rows.append(
            [
                what[phase],
                _fmt(p["tokens_per_s"]),
                _fmt(p["ttft_p50_ms"], 0),
                _fmt(p["ttft_p90_ms"], 0),
                _fmt(p["itl_p50_ms"], 1),
                " / ".join(f"~~{v:.1f}~~" if bad else f"{v:.1f}" for v, bad in p["each_run"]),
                _fmt(p["worker_cpu"], 2),
                f"{p['errors']} of {p['requests']}",
            ]
        )
    headers = [
        "phase",
        "tok/s",
        "TTFT p50 ms",
        "TTFT p90 ms",
        "ITL p50 ms",
        "each run tok/s (struck: steal > 5 %)",
        "worker CPU",
        "errors",
    ]
    lines += [report.markdown_table(headers, rows), ""]
    rows = []
    for pair, label in (("B/A", "B ÷ A"), ("A/C", "A ÷ C"), ("B/C", "B ÷ C")):
        cells = [label]
        for key in ("tokens_per_s", "ttft_p50_ms"):
            found = summary["ratios"][f"{pair} {key}"]
            each = ", ".join(_fmt(v, 3) for v in found["rounds"])
            cells.append(f"**{_fmt(found['median'], 3)}**" + (f" ({each})" if each else ""))
        rows.append(cells)
    headers = ["ratio", "tok/s", "TTFT p50, as a speed"]
    lines += [
        "Ratios: B ÷ A the median of the rounds' (each the mean of its two B runs ÷ its two A "
        "runs, listed); A ÷ C and B ÷ C the phases' medians' ratio. TTFT as the bottom's ÷ the "
        "top's, so above 1 is faster too:",
        "",
        report.markdown_table(headers, rows),
    ]
    b_a = summary["ratios"]["B/A tokens_per_s"]["median"]
    verdict = "yes" if b_a is not None and b_a >= TARGET else "**no**"
    lines += ["", f"B ÷ A ≥ {TARGET}: {verdict}"]
    for found in results.get("profile") or []:
        lines += ["", render_profile(found)]
    return "\n".join(lines)


# --------------------------------------------------------------------------- profile


def profile_in_child(model: Path, adapter_dirs: dict[str, Path], steps: int) -> dict[str, Any]:
    """`profile` in a child python with OpenBLAS preloaded (as the workers run)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "profile.json"
        dirs = json.dumps({name: str(path) for name, path in adapter_dirs.items()})
        _run_python(
            "import json, sys, adapters; found = adapters.profile(sys.argv[1], "
            "json.loads(sys.argv[2]), int(sys.argv[3])); "
            "open(sys.argv[4], 'w').write(json.dumps(found))",
            str(model),
            dirs,
            str(steps),
            str(out),
        )
        return json.loads(out.read_text())


def profile(model_dir: str, adapter_dirs: dict[str, str], steps: int) -> dict[str, Any]:
    """One decode step of 8 rows with the rows' adapters as each phase has them, as the engine
    runs it and two ways that touch only each adapter's own rows."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from servicer.engine.adapters import MultiLoRALinear, load_adapters

    model, _ = load(str(model_dir))
    adapter_set = load_adapters(model, adapter_dirs)
    layers = [m for _, m in model.named_modules() if isinstance(m, MultiLoRALinear)]
    rows = CONCURRENCY
    context = 64
    cache = make_prompt_cache(model)
    prompt = mx.array([[100 + (7 * i + r) % 5000 for i in range(context)] for r in range(rows)])
    mx.eval(model(prompt, cache=cache))
    token = mx.array([[42]] * rows)

    def step() -> mx.array:
        for c in cache:  # the same context every step
            c.offset = context
        logits = model(token, cache=cache)
        mx.eval(logits)
        return logits

    layouts = {
        "base rows (no adapter)": [0] * rows,
        "all on adapter 1": [1] * rows,
        "2 each on adapters 1-4": [1 + i // 2 for i in range(rows)],
    }
    modes = {
        "where (the engine)": None,
        "gather + scatter": _gathered,
        "sorted slices": _sliced,
        "stacked, gather_mm": _stacked,
    }
    timings: dict[str, dict[str, list[float]]] = {}
    original = MultiLoRALinear.__call__
    try:
        quantized = any(isinstance(m.linear, nn.QuantizedLinear) for m in layers)
        steps = steps if quantized else 4 * steps
        for _ in range(steps):
            for mode, call in modes.items():
                MultiLoRALinear.__call__ = original if call is None else call
                for layout, ids in layouts.items():
                    if call is not None and layout == "base rows (no adapter)":
                        continue
                    with adapter_set.forward(ids):
                        start = time.perf_counter()
                        step()
                        elapsed = time.perf_counter() - start
                    timings.setdefault(mode, {}).setdefault(layout, []).append(elapsed * 1000)
        # Whether the other ways give the engine's logits (layout B, the same step).
        agree = {}
        for mode, call in modes.items():
            MultiLoRALinear.__call__ = original if call is None else call
            with adapter_set.forward(layouts["2 each on adapters 1-4"]):
                agree[mode] = step()
        differ = {
            mode: float(mx.abs(value - agree["where (the engine)"]).max())
            for mode, value in agree.items()
        }
    finally:
        MultiLoRALinear.__call__ = original
    # One adapted linear alone (the one most adapters target), 8 rows of one token, each way
    # in turns.
    layer = max(layers, key=lambda m: len(m.updates))
    x = mx.random.normal((rows, 1, next(iter(layer.updates.values())).lora_a.shape[0]))
    mx.eval(x)
    linear_ms: dict[str, dict[str, list[float]]] = {"base layer alone": {}}
    try:
        for _ in range(LINEAR_REPEATS):
            linear_ms["base layer alone"].setdefault("-", []).append(
                _once(lambda: mx.eval(layer.linear(x)))
            )
            for mode, call in modes.items():
                MultiLoRALinear.__call__ = original if call is None else call
                for layout, ids in list(layouts.items())[1:]:
                    with adapter_set.forward(ids):
                        took = _once(lambda: mx.eval(layer(x)))
                    linear_ms.setdefault(mode, {}).setdefault(layout, []).append(took)
    finally:
        MultiLoRALinear.__call__ = original
    per_layer = {m: {k: statistics.median(v) for k, v in d.items()} for m, d in linear_ms.items()}
    result = {
        "model": Path(model_dir).name,
        "rows": rows,
        "context": context,
        "adapted_linears": len(layers),
        "steps": steps,
        "step_ms": {m: {k: statistics.median(v) for k, v in d.items()} for m, d in timings.items()},
        "one_linear_ms": per_layer,
        "logits_max_abs_diff_vs_engine": differ,
        "one_linear": f"{type(layer.linear).__name__} with {len(layer.updates)} adapter(s)",
    }
    return result


def _once(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000


def _gathered(self: Any, x: Any) -> Any:
    """Each present adapter's update on its own rows only: take them, update, scatter back."""
    y = self.linear(x)
    present = self.adapters.masks(x)
    if not present:
        return y
    out = y
    for index, mask in present:
        update = self.updates.get(str(index))
        if update is None:
            continue
        if mask is None:
            out = out + (update.scale * ((x @ update.lora_a) @ update.lora_b)).astype(x.dtype)
            continue
        rows = _rows_of(self.adapters, index)
        z = (x[rows] @ update.lora_a) @ update.lora_b
        out = out.at[rows].add((update.scale * z).astype(x.dtype))
    return out


def _stacked(self: Any, x: Any) -> Any:
    """Every adapter of this linear stacked ([adapters + 1, in, r], [.., r, out], index 0 the
    base's zero update), each row's picked by `mx.gather_mm` with the rows' adapter indices: a
    fixed handful of operations per linear however many adapters the batch holds (what
    Punica's and S-LoRA's batched kernels do)."""
    import mlx.core as mx

    y = self.linear(x)
    present = self.adapters.masks(x)
    if not present:
        return y
    stack = self.__dict__.get("_bench_stack")
    if stack is None:
        count = len(self.adapters.names) + 1
        some = next(iter(self.updates.values()))
        inputs, outputs = some.lora_a.shape[0], some.lora_b.shape[1]
        rank = max(u.lora_a.shape[1] for u in self.updates.values())
        a = [mx.zeros((inputs, rank), dtype=some.lora_a.dtype)] * count
        b = [mx.zeros((rank, outputs), dtype=some.lora_b.dtype)] * count
        scales = [0.0] * count
        for key, update in self.updates.items():
            pad = rank - update.lora_a.shape[1]
            a[int(key)] = mx.pad(update.lora_a, [(0, 0), (0, pad)])
            b[int(key)] = mx.pad(update.lora_b, [(0, pad), (0, 0)])
            scales[int(key)] = update.scale
        stack = (mx.stack(a), mx.stack(b), mx.array(scales, dtype=some.lora_b.dtype))
        mx.eval(stack)
        self.__dict__["_bench_stack"] = stack
    a, b, scales = stack
    ids = _row_index(self.adapters)
    z = mx.gather_mm(mx.gather_mm(x, a, rhs_indices=ids), b, rhs_indices=ids)
    return y + (scales[ids].reshape(-1, *([1] * (z.ndim - 1))) * z).astype(x.dtype)


def _row_index(adapters: Any) -> Any:
    """Each row's adapter index (uint32, 0 the base), for this forward's masks."""
    import mlx.core as mx

    key = adapters._masks
    cached = adapters.__dict__.get("_bench_index")
    if cached is None or cached[0] is not key:
        spans = _spans(adapters)
        ids = [index for index, (lo, hi) in spans for _ in range(lo, hi)]
        cached = (key, mx.array(ids, dtype=mx.uint32))
        adapters.__dict__["_bench_index"] = cached
    return cached[1]


def _sliced(self: Any, x: Any) -> Any:
    """Rows sorted by adapter (as a scheduler could keep them): each adapter's update on its
    contiguous slice, the slices concatenated."""
    import mlx.core as mx

    y = self.linear(x)
    present = self.adapters.masks(x)
    if not present:
        return y
    spans = _spans(self.adapters)
    parts = []
    for index, (lo, hi) in spans:
        update = self.updates.get(str(index))
        if update is None or index == 0:
            parts.append(y[lo:hi])
            continue
        z = (x[lo:hi] @ update.lora_a) @ update.lora_b
        parts.append(y[lo:hi] + (update.scale * z).astype(x.dtype))
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)


def _rows_of(adapters: Any, index: int) -> Any:
    import mlx.core as mx

    cache = adapters.__dict__.setdefault("_bench_rows", {})
    key = (adapters._masks, index)
    if key not in cache:
        cache.clear()
        mask = dict(adapters._masks)[index]
        cache[key] = mx.array([i for i, hit in enumerate(mask.reshape(-1).tolist()) if hit])
    return cache[key]


def _spans(adapters: Any) -> list[tuple[int, tuple[int, int]]]:
    """(index, (first row, end)) of each run of rows with one adapter, in row order."""
    rows = adapters._shape[0]
    ids = [0] * rows
    for index, mask in adapters._masks:
        hits = [True] * rows if mask is None else mask.reshape(-1).tolist()
        for i, hit in enumerate(hits):
            if hit:
                ids[i] = index
    spans, start = [], 0
    for i in range(1, rows + 1):
        if i == rows or ids[i] != ids[start]:
            spans.append((ids[start], (start, i)))
            start = i
    return spans


def _differences(found: dict[str, float]) -> str:
    differ = {k: v for k, v in found.items() if v}
    if not differ:
        return "equal, bit for bit"
    return ", ".join(f"{k} differs by up to {v:.2g}" for k, v in differ.items())


def render_profile(found: dict[str, Any]) -> str:
    layouts = ["base rows (no adapter)", "all on adapter 1", "2 each on adapters 1-4"]
    rows = []
    for mode, by_layout in found["step_ms"].items():
        rows.append([mode, *(_fmt(by_layout.get(k), 2) for k in layouts)])
    headers = ["one decode step, ms (median)", *layouts]
    lines = [
        f"In process, `{found['model']}`: one decode step of {found['rows']} rows at a "
        f"{found['context']}-token "
        f"context, {found['adapted_linears']} adapted linears, median of {found['steps']} "
        "steps in turns:",
        "",
        report.markdown_table(headers, rows),
        "",
        f"One adapted linear alone ({found['one_linear']}), {found['rows']} rows of one "
        f"token, ms (median of {LINEAR_REPEATS} in turns; the base layer alone "
        f"{_fmt(found['one_linear_ms']['base layer alone']['-'], 3)}):",
        "",
        report.markdown_table(
            ["one linear, ms", *layouts[1:]],
            [
                [mode, *(_fmt(by_layout.get(k), 3) for k in layouts[1:])]
                for mode, by_layout in found["one_linear_ms"].items()
                if mode != "base layer alone"
            ],
        ),
        "",
        "Logits of the other ways against the engine's (2 each on 4 adapters): "
        + _differences(found["logits_max_abs_diff_vs_engine"])
        + ".",
    ]
    return "\n".join(lines)


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model",
        help="an mlx-lm model directory to serve as it is, the adapters trained on it into "
        "DIR/../adapters-NAME (default: SmolLM2-135M-Instruct from "
        "../shared/tools/real_model.sh, quantized to 4 bits once)",
    )
    parser.add_argument(
        "--rounds", type=int, default=ROUNDS, help=f"rounds of A B B A (default {ROUNDS})"
    )
    parser.add_argument(
        "--extra-rounds",
        type=int,
        default=0,
        help="at most this many rounds (C A B B A, ~7 minutes each) run again when the "
        "hypervisor disturbed one (default 0: the disturbed runs are only struck through)",
    )
    parser.add_argument("--concurrency", type=int, default=CONCURRENCY, help="streams (8)")
    parser.add_argument(
        "--max-tokens", type=int, default=MAX_TOKENS, help=f"new tokens a request ({MAX_TOKENS})"
    )
    parser.add_argument(
        "--requests-per-stream",
        type=int,
        default=REQUESTS_PER_STREAM,
        help=f"requests a stream per run (default {REQUESTS_PER_STREAM})",
    )
    parser.add_argument(
        "--train-iters", type=int, default=8, help="training steps per adapter (default 8)"
    )
    parser.add_argument(
        "--worker-flags",
        default="",
        help=f"flags for both workers, after `{' '.join(WORKER_FLAGS)}` (a flag here wins)",
    )
    parser.add_argument(
        "--prompts",
        choices=["text", "chat"],
        default="text",
        help="the bare chat questions (text, ~14 tokens; default) or in the chat template "
        "(chat, ~44 tokens with SmolLM2's default system turn: a run's prefill ~3x longer)",
    )
    parser.add_argument("--profile", action="store_true", help="the in-process profile too")
    parser.add_argument(
        "--profile-steps", type=int, default=PROFILE_STEPS, help=f"default {PROFILE_STEPS}"
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    if min(args.rounds, args.concurrency, args.max_tokens, args.requests_per_stream) < 1:
        parser.error("--rounds, --concurrency, --max-tokens and --requests-per-stream: 1 or more")
    if args.concurrency % len(ADAPTERS):
        parser.error(f"--concurrency must spread evenly over {len(ADAPTERS)} adapters")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.time()

    if args.model:
        model = train_on = Path(args.model).expanduser().resolve()
        adapter_root = model.parent / f"adapters-{model.name}"
    else:
        source = resolve_model(REAL)
        assert source is not None
        model, train_on = quantized_base(source, CACHE / f"{source.name}-4bit"), source
        adapter_root = ADAPTER_ROOT
    adapter_dirs = trained_adapters(train_on, adapter_root, args.train_iters)

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    flags = [*WORKER_FLAGS, *shlex.split(args.worker_flags)]
    prompts = make_prompts(tokenizer, args.requests_per_stream * args.concurrency, args.prompts)
    settings = {
        "model": str(model),
        "model_name": model.name,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "requests_per_stream": args.requests_per_stream,
        "rounds": args.rounds,
        "train_iters": args.train_iters,
        "worker_flags": flags,
        "target": TARGET,
        "quantization": _quantization(model),
        "prompts": args.prompts,
        "prompt_tokens": statistics.median(len(p) for p in prompts),
        "extra_rounds": args.extra_rounds,
    }
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "machine": report.machine_info(),
        "settings": settings,
        "adapters": {
            n: {"path": str(adapter_dirs[n]), "keys": a["keys"], "num_layers": a["num_layers"]}
            for n, a in ADAPTERS.items()
        },
        "first_adapter": next(iter(ADAPTERS)),
    }
    phases = Phases(model, adapter_dirs, args.out / "logs" / stamp, flags)
    with contextlib.ExitStack() as stack:
        stack.callback(phases.stop)
        phases.start()
        log("warming up both workers (a wave of every phase)")
        phases.warm_up(make_prompts(tokenizer, args.concurrency, "text"), args.concurrency)
        results["runs"] = measure(args, phases, prompts)
    results["summary"] = summarise(results["runs"])
    results["minutes"] = (time.time() - started) / 60
    if args.profile:
        results["profile"] = []
        for profiled in dict.fromkeys([model, train_on]):
            log(f"profiling the adapted forward on {profiled.name} (a child process)")
            results["profile"].append(profile_in_child(profiled, adapter_dirs, args.profile_steps))
    results["machine"]["load_average_end"] = report.machine_info()["load_average"]
    print(render(results))
    print(f"\nMachine: {report.machine_line(results)}")
    report.save_json(args.out, "adapters", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
