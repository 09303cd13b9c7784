"""Starting the workers the benchmarks measure, and the virtual environments they need.

Our worker runs from the project's own venv (`python -m servicer`); smg-grpc-servicer's
MLX servicer needs mlx-lm < 0.32, so it gets its own venv under bench/, installed on first
use from the package registry. Every worker gets a free loopback port chosen here and is
ready when `MlxEngine/HealthCheck` says healthy (both workers answer it).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import _checkout  # noqa: F401  (before any `servicer` import)
import grpc
from workload import LevelStats, Shape

from servicer.proto import mlx_engine_pb2 as pb
from servicer.proto import mlx_engine_pb2_grpc as pb_grpc
from servicer.sysinfo import cpu_seconds, free_port

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
SMG_VENV = BENCH / ".venv-smg"
SMG_SERVICER_VERSION = "0.14.1"
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
# The shared tools beside the project (the real model's builder); absent outside this workshop.
SHARED_TOOLS = ROOT.parent / "shared" / "tools"
REAL_MODEL_SCRIPT = SHARED_TOOLS / "real_model.sh"
# MLX's CPU matmuls are several times faster with OpenBLAS than with the BLAS it links to; every
# process a bench measures gets it when the library is installed, so raw and served compare alike.
OPENBLAS = Path("/usr/lib/x86_64-linux-gnu/libopenblas.so.0")


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def blas_env(library: Path = OPENBLAS) -> dict[str, str]:
    """The environment that preloads OpenBLAS (one thread: MLX runs its own) when it is
    installed and nothing is preloaded already; empty otherwise."""
    if not library.exists() or os.environ.get("LD_PRELOAD"):
        return {}
    return {"LD_PRELOAD": str(library), "OPENBLAS_NUM_THREADS": "1"}


def process_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """A measured process's environment: ours, offline, OpenBLAS preloaded when it exists."""
    return {**os.environ, **OFFLINE_ENV, **blas_env(), **(extra or {})}


def add_common_args(parser: argparse.ArgumentParser, side_by_side: str) -> None:
    """The options every part that starts workers takes: the model, the peer, our flags."""
    parser.add_argument(
        "--model",
        help="mlx-lm model directory, or `real` for the real model (google/gemma-3-270m, "
        "built by ../shared/tools/real_model.sh; `real:smollm2-135m-instruct` for its chat "
        "model; default: the demo model)",
    )
    parser.add_argument("--side-by-side", action="store_true", help=side_by_side)
    parser.add_argument(
        "--smg-version",
        default=SMG_SERVICER_VERSION,
        help=f"smg-grpc-servicer version for --side-by-side (default {SMG_SERVICER_VERSION})",
    )
    parser.add_argument(
        "--worker-flags",
        default="",
        help="extra flags for our worker, e.g. '--stream-interval 4' (recorded in the report)",
    )


def parse_levels(text: str) -> list[int]:
    """A `--levels`/`--concurrency` value, `1,8,32` -> [1, 8, 32] (an argparse `type`): at
    least one level, each 1 or more, so a slip is an error rather than an empty run."""
    try:
        found = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        found = []
    if not found or min(found) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give levels of 1 or more, e.g. 1,8,32")
    return found


def model_or_demo(model: Path | None) -> Path:
    """A resolved `--model`, or the demo model when none was given."""
    if model is None:
        from servicer.demos.text import demo_model_path

        return demo_model_path()
    return model.expanduser().resolve()


def resolve_model(model: str | None, script: Path = REAL_MODEL_SCRIPT) -> Path | None:
    """`--model`: None (the demo model), `real` (the real model, built or found by the shared
    script, which prints its directory last), `real:NAME` (the script's MODEL=NAME, e.g.
    `real:smollm2-135m-instruct`, the chat model), or an mlx-lm model directory."""
    if model is None:
        return None
    name = None
    if model.startswith("real:"):
        model, name = "real", model.removeprefix("real:")
    if model != "real":
        path = Path(model).expanduser().resolve()
        if not (path / "config.json").exists():
            raise SystemExit(
                f"--model {model}: no config.json there (give a model directory or `real`)"
            )
        return path
    if not script.exists():
        raise SystemExit(
            f"--model real needs {script} (the shared tools beside the project), which is "
            "absent here: pass the model directory instead"
        )
    log(f"--model real: {script} (builds the model the first time, a minute or two)")
    env = {**os.environ, "MODEL": name} if name else None
    done = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{script} failed (code {done.returncode}):\n{done.stderr[-2000:]}")
    return Path(lines[-1]).expanduser().resolve()


# --------------------------------------------------------------------------- metrics


def scrape_metrics(port: int, names: Sequence[str]) -> dict[str, float]:
    """The worker's unlabelled samples `names` from its Prometheus endpoint on `port` (0.0
    for a name it does not report)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    found = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in found and not sample.labels:
                found[sample.name] = float(sample.value)
    return found


# --------------------------------------------------------------------------- venvs


def ensure_venv(path: Path, requirements: Sequence[str]) -> Path:
    """A venv at `path` with `requirements` installed; returns its python.

    Installs once: a stamp file records what was installed, and a venv whose stamp matches
    is reused as it is.
    """
    python = path / "bin" / "python"
    stamp = path / ".bench-requirements"
    wanted = "\n".join(requirements) + "\n"
    if python.exists() and stamp.exists() and stamp.read_text() == wanted:
        return python
    log(f"installing {' '.join(requirements)} into {path.relative_to(ROOT)} (once)")
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--upgrade", "pip"], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", *requirements], check=True)
    stamp.write_text(wanted)
    return python


def mlx_requirement() -> str:
    """MLX for a side venv: the same version as ours, with the same backend."""
    version = importlib.metadata.version("mlx")
    if platform.system() == "Darwin":
        return f"mlx=={version}"
    installed = {dist.metadata["Name"].lower() for dist in importlib.metadata.distributions()}
    for extra in ("cuda13", "cuda12"):
        if f"mlx-{extra.replace('cuda', 'cuda-')}" in installed:
            return f"mlx[{extra}]=={version}"
    return f"mlx[cpu]=={version}"


def smg_servicer_python(version: str = SMG_SERVICER_VERSION) -> Path:
    """The python of bench/.venv-smg, with smg-grpc-servicer's MLX servicer installed."""
    return ensure_venv(SMG_VENV, [f"smg-grpc-servicer[mlx]=={version}", mlx_requirement()])


# --------------------------------------------------------------------------- workers


@dataclass
class Worker:
    """A worker process on a loopback port; its output goes to a log file."""

    name: str
    command: list[str]
    port: int
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 300, wait: bool = True) -> Worker:
        """Start the process; with `wait`, return once its health check says healthy."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(
                self.command,
                cwd=ROOT,
                env=process_env({"PYTHONUNBUFFERED": "1", **self.env}),
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        if wait:
            self._wait_healthy(timeout)
        return self

    def wait_metadata(self, timeout: float = 300) -> None:
        """Wait until the worker answers GetModelInfo (ours does while it still loads the
        weights: a router started now registers it at once)."""
        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(self.address) as channel:
            stub = pb_grpc.MlxEngineStub(channel)
            while time.monotonic() < deadline:
                try:
                    stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
                    return
                except grpc.RpcError:
                    time.sleep(0.2)
        raise RuntimeError(f"{self.name} gave no model info after {timeout:.0f} s")

    def _wait_healthy(self, timeout: float) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(self.address) as channel:
            stub = pb_grpc.MlxEngineStub(channel)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"{self.name} exited with code {self.proc.returncode}:\n{self.tail()}"
                    )
                try:
                    if stub.HealthCheck(pb.HealthCheckRequest(), timeout=2).healthy:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"{self.name} was not healthy after {timeout:.0f} s:\n{self.tail()}")

    def cpu_seconds(self) -> float:
        """User + system CPU time of the worker process so far (0 when unknown)."""
        assert self.proc is not None
        return cpu_seconds(self.proc.pid)

    def tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout: float = 30) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.resume()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def pause(self) -> None:
        """Stop the process (SIGSTOP) while another is measured: not even a timer of its
        runs. `resume` before talking to it again."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)

    def __enter__(self) -> Worker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RawProcess:
    """bench/raw.py --serve: the raw engine in its own process, one run per request."""

    def __init__(self, command: list[str]) -> None:
        self.command = command
        self.proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> RawProcess:
        self.proc = subprocess.Popen(
            self.command,
            cwd=ROOT,
            env=process_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        return self

    def run(self, concurrency: int, shape: Shape, **options: object) -> LevelStats:
        assert self.proc is not None and self.proc.stdin is not None
        assert self.proc.stdout is not None
        command = {"concurrency": concurrency, **asdict(shape), **options}
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the raw engine exited with code {self.proc.wait()}")
        return LevelStats(**json.loads(line))

    def __exit__(self, *exc: object) -> None:
        if self.proc is None:
            return
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


@dataclass(frozen=True)
class BatchConfig:
    completion_batch_size: int = 32
    prefill_batch_size: int = 8

    def flags(self) -> list[str]:
        return [
            "--completion-batch-size",
            str(self.completion_batch_size),
            "--prefill-batch-size",
            str(self.prefill_batch_size),
        ]


def raw_process(model: Path, batch: BatchConfig) -> RawProcess:
    """bench/raw.py --serve on `model` with the workers' batch settings."""
    command = [sys.executable, str(BENCH / "raw.py"), "--serve", "--model", str(model)]
    return RawProcess([*command, *batch.flags()])


def our_worker(
    model: Path, batch: BatchConfig, log_dir: Path, tag: str, flags: Sequence[str] = ()
) -> Worker:
    port = free_port()
    command = [sys.executable, "-m", "servicer", "--model", str(model), "--port", str(port)]
    command += [*batch.flags(), "--log-level", "warning", *flags]
    return Worker("mlx-grpc-worker", command, port, log_dir / f"ours-{tag}.log")


def smg_worker(python: Path, model: Path, batch: BatchConfig, log_dir: Path, tag: str) -> Worker:
    port = free_port()
    command = [str(python), "-m", "smg_grpc_servicer.mlx.server", "--model", str(model)]
    command += ["--host", "127.0.0.1", "--port", str(port), *batch.flags()]
    return Worker("smg-grpc-servicer", command, port, log_dir / f"smg-{tag}.log")
