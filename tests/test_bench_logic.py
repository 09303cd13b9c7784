"""The benchmark's own bookkeeping: hypervisor steal, and which rounds count."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import report
from support import ROOT
from workload import StealMeter, disturbed


def _stat(path: Path, steal: int, busy: int) -> None:
    # user nice system idle iowait irq softirq steal guest guest_nice
    path.write_text(f"cpu  {busy} 0 0 1000 0 0 0 {steal} 0 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n")


def test_steal_share_is_the_stolen_part_of_all_cpu_time(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    _stat(stat, steal=100, busy=500)
    meter = StealMeter(stat)
    _stat(stat, steal=130, busy=770)  # 300 more jiffies in all, 30 of them stolen
    assert meter.share() == 0.1
    assert disturbed(meter.share())
    assert not disturbed(0.01)
    assert not disturbed(None)


def test_steal_share_is_unknown_without_proc_stat(tmp_path: Path) -> None:
    assert StealMeter(tmp_path / "missing").share() is None


def test_disturbed_rounds_count_only_when_no_clean_one_exists() -> None:
    clean = {"tokens_per_s": 400.0, "ratio": 0.94, "steal_share": 0.0, "disturbed": False}
    noisy = {"tokens_per_s": 250.0, "ratio": 0.55, "steal_share": 0.2, "disturbed": True}
    also_clean = {"tokens_per_s": 410.0, "ratio": 0.96, "steal_share": 0.01, "disturbed": False}
    level = {"extra": {"rounds": [noisy, clean, also_clean]}}
    assert report._median_round_ratio(level) == 0.95
    assert report._median_round_ratio({"extra": {"rounds": [noisy]}}) == 0.55
    cell = report._rounds([noisy, clean])
    assert cell == "~~250 (0.55, steal 20%)~~ / 400 (0.94)"


def test_raw_engine_process_answers_one_run_per_command(demo_dir: Path) -> None:
    from workers import RawProcess
    from workload import Shape

    command = [sys.executable, str(ROOT / "bench" / "raw.py"), "--serve", "--model", str(demo_dir)]
    shape = Shape(prompt_tokens=12, max_tokens=5)
    with RawProcess(command) as raw:
        first = raw.run(2, shape, warm_up=True, requests=3, seed=1)
        again = raw.run(2, shape, requests=3, seed=1)
        timed = raw.run(1, shape, min_requests=2, min_seconds=0.0, seed="x")
    assert (first.requests, first.output_tokens, first.errors) == (3, 15, 0)
    assert (again.requests, again.output_tokens) == (3, 15)
    assert timed.requests == 2
    assert "steal_share" in first.extra


def test_the_engine_loop_bench_runs_both_loops_on_the_same_prompts(
    demo_dir: Path, tmp_path: Path
) -> None:
    """As a script: it exits 0 (the interpreter's teardown beside MLX's threads aborted it
    two runs in three) and writes one cell a level."""
    args = ["--model", str(demo_dir), "--levels", "1", "--rounds", "2", "--requests", "4"]
    args += ["--max-tokens", "5", "--out", str(tmp_path)]
    script = ROOT / "bench" / "engine_loop.py"
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    (saved,) = tmp_path.glob("engine-loop-*.json")
    (cell,) = json.loads(saved.read_text())["cells"]
    assert cell["c"] == 1 and len(cell["ratios"]) == 2
    assert all(r > 0 for r in cell["raw_tokens_per_s"] + cell["engine_tokens_per_s"])
    assert set(cell["ttft_p50_ms"]) == {"raw", "engine"}
    assert cell["errors"] == {"raw": 0, "engine": 0}  # every request got its 5 tokens
    assert all(cell["host_us_per_token"][who] > 0 for who in ("raw", "engine"))


def test_bursts_are_summarised_by_the_median_one_and_all_stay_listed() -> None:
    from load import summarize_bursts

    def burst(ratio: float, errors: int = 0) -> dict:
        return {"requests": 16, "max_over_p50": ratio, "ttft_p50_ms": 50.0, "errors": errors}

    bursts = [burst(2.0), burst(1.1), burst(1.4, errors=1), burst(1.2), burst(1.7)]
    summary = summarize_bursts(bursts)
    assert summary["max_over_p50"] == 1.4
    assert summary["worst"] == 2.0
    assert summary["errors"] == 1 and summary["requests"] == 80
    assert summary["bursts"] == bursts
    assert summarize_bursts(bursts[:2])["max_over_p50"] == 2.0  # the higher of two


@pytest.mark.parametrize(
    "script",
    sorted(
        path.name
        for path in (ROOT / "bench").glob("*.py")
        if "def main(" in path.read_text() or "__main__" in path.read_text()
    ),
)
def test_every_bench_script_prints_its_help(script: str) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout


def test_model_argument_takes_a_directory_or_the_real_models_short_name(tmp_path: Path) -> None:
    import workers

    assert workers.resolve_model(None) is None
    (tmp_path / "config.json").write_text("{}")
    assert workers.resolve_model(str(tmp_path)) == tmp_path.resolve()
    with pytest.raises(SystemExit, match=r"config\.json"):
        workers.resolve_model(str(tmp_path / "nowhere"))
    # `real` runs the shared script and takes the directory it prints last.
    script = tmp_path / "real_model.sh"
    script.write_text(f"echo building; echo {tmp_path}\n")
    assert workers.resolve_model("real", script) == tmp_path.resolve()
    with pytest.raises(SystemExit, match="absent here"):
        workers.resolve_model("real", tmp_path / "missing.sh")


def test_measured_processes_get_openblas_only_when_it_is_installed(tmp_path: Path) -> None:
    import workers

    assert workers.blas_env(tmp_path / "libopenblas.so.0") == {}
    library = tmp_path / "libopenblas.so.0"
    library.write_bytes(b"")
    env = workers.blas_env(library)
    if env:  # nothing preloaded in this process already
        assert env == {"LD_PRELOAD": str(library), "OPENBLAS_NUM_THREADS": "1"}


def test_a_misspelt_part_in_only_is_an_error_not_an_empty_run(capsys) -> None:
    import bench

    with pytest.raises(SystemExit):
        bench.parse_args(["--only", "prefixx"])
    assert "unknown parts in --only: prefixx" in capsys.readouterr().err
    assert "prefix" not in bench.parse_args(["--only", "prefix"]).skip


def test_bench_only_naming_nothing_and_bad_levels_are_errors(capsys) -> None:
    import bench

    with pytest.raises(SystemExit):
        bench.parse_args(["--only", ","])
    assert "--only" in capsys.readouterr().err
    for bad in ("0,8", "1,x", ","):
        with pytest.raises(SystemExit):
            bench.parse_args(["--levels", bad])
        assert "--levels" in capsys.readouterr().err
    assert bench.parse_args(["--levels", "1, 8,"]).levels == [1, 8]


def test_a_setup_no_name_matches_is_an_error_not_an_empty_run(capsys) -> None:
    import speculation

    with pytest.raises(SystemExit):
        speculation.main(["--setups", "prompt lokup"])  # before any model is built
    assert "matches no setup" in capsys.readouterr().err
    with pytest.raises(ValueError, match="matches no setup"):
        speculation.setup_names([])
    assert speculation.setup_names(["prompt lookup"]) == [
        "demo llama, prompt lookup",
        "demo hybrid, prompt lookup",
        "demo gemma3, prompt lookup",
    ]
    assert speculation.setup_names(["real"]) == []  # the real model alone
    assert speculation.setup_names(None) == list(speculation.SETUPS)


def test_a_misspelt_long_prompt_worker_is_an_error(capsys) -> None:
    import long_prompt

    for bad in ("ours,ours_of", ","):
        with pytest.raises(SystemExit):
            long_prompt.main(["--model", "nowhere", "--workers", bad])
        assert "--workers" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("module", "option"),
    [("nightly", "--concurrency"), ("faces", "--levels"), ("step_profile", "--levels")],
)
def test_levels_that_name_no_level_are_errors(module: str, option: str, capsys) -> None:
    import importlib

    entry = importlib.import_module(module)
    run = entry.parse_args if module == "nightly" else entry.main
    for bad in (",", "1,four", "0"):
        with pytest.raises(SystemExit) as exited:
            run([option, bad])
        assert exited.value.code == 2
        assert option in capsys.readouterr().err


def test_a_misspelt_family_or_cell_is_an_error() -> None:
    import families

    with pytest.raises(SystemExit, match="no config for"):
        families.architectures("llama,llamma")
    assert families.architectures("llama") == ["llama"]
    with pytest.raises(SystemExit, match="unknown cells"):
        families.main(["--only", "llama", "--cells", "nope"])


def test_the_family_matrix_names_each_cell_a_strict_run_fails_on():
    import families

    results = {
        "llama": {"cells": {"defaults": {"status": "exact"}, "kv8": {"status": "refused"}}},
        "gemma2": {"cells": {"defaults": {"status": "wrong"}, "kv8": {"status": "skipped"}}},
        "qwen3": {"cells": {"defaults": {"status": "near-tie"}, "kv8": {"status": "hang"}}},
    }
    assert families.failing(results) == ["gemma2 / defaults", "qwen3 / defaults", "qwen3 / kv8"]
    assert families.failing({"llama": results["llama"]}) == []


def test_a_partial_family_run_keeps_the_other_cells_and_the_summary_reads_them():
    """A run of a few cells (the scheduling settings, say) merges into the last full run's
    results; a real model without the newer cells is summarised by the cells it has."""
    import families

    earlier = {"cells": {"defaults": {"status": "exact"}, "stall0": {"status": "wrong"}}}
    new = {"cells": {"stall0": {"status": "exact"}}}
    merged = families.merge_result(earlier, new)
    assert merged["cells"] == {"defaults": {"status": "exact"}, "stall0": {"status": "exact"}}
    assert families.merge_result(None, new) == new
    real = {"cells": {"defaults": {"status": "refused"}}}
    assert families._not_exact(real, ["defaults", "stall0"]) == "refused defaults"


def test_a_bench_run_from_another_checkout_measures_that_checkouts_code(tmp_path: Path) -> None:
    """The venv installs this checkout's package in editable mode; a bench module run from a
    copy of the code (a worktree of the code before a change) must import the copy's."""
    import shutil

    copy = tmp_path / "checkout"
    shutil.copytree(
        ROOT / "servicer", copy / "servicer", ignore=shutil.ignore_patterns("__pycache__")
    )
    (copy / "bench").mkdir()
    for module in (ROOT / "bench").glob("*.py"):  # not its venvs and results
        shutil.copy(module, copy / "bench" / module.name)
    probe = copy / "bench" / "which_package.py"
    probe.write_text("import workload\nimport servicer\nprint(servicer.__file__)\n")
    done = subprocess.run(
        [sys.executable, str(probe)], capture_output=True, text=True, timeout=120, check=True
    )
    assert Path(done.stdout.strip()).resolve().is_relative_to(copy.resolve()), done.stdout


def test_every_bench_module_that_imports_the_package_imports_the_checkout_first() -> None:
    import re

    for module in sorted((ROOT / "bench").glob("*.py")):
        text = module.read_text()
        found = re.search(r"^\s*(from servicer|import servicer)\b", text, flags=re.MULTILINE)
        if found is None:
            continue
        guard = text.find("import _checkout")
        assert 0 <= guard < found.start(), f"{module.name} imports servicer before _checkout"


def test_the_step_profile_finds_both_steps_launch_and_wait_lines() -> None:
    """mlx-lm's step (the raw engine) and the engine's own (decode_batch) each have a launch
    and a wait line, and a sample there, or in MLX below it, counts in that bucket."""
    import step_profile

    lines = step_profile.step_lines()
    assert sorted(lines.values()) == [step_profile.LAUNCH] * 2 + [step_profile.WAIT] * 2
    assert any("mlx_lm/generate.py" in line for line in lines)
    assert any("servicer/engine/decode_batch.py" in line for line in lines)
    for line, name in lines.items():
        thread = "thread (1): mlx-engine;run (servicer/engine/engine.py:285)"
        assert step_profile.bucket(f"{thread};{line}") == name
        assert step_profile.bucket(f"{thread};{line};mlx::core::eval (libmlx.so)") == name
    assert step_profile.bucket("t;_step (mlx_lm/generate.py:1)") == "mlx-lm step"


@pytest.mark.parametrize(
    ("family", "text_type", "outcome"),
    [
        ("gemma3", None, "images"),
        ("idefics3", None, "images"),  # served: its own text stack type need not be mlx-lm's
        ("paligemma", "gemma", "text only"),  # mlx-lm has its text model; the images are refused
        ("molmo", None, "text or refused"),  # the checkpoint's text_config decides
        ("florence2", "florence2", "text or refused"),
    ],
)
def test_the_vision_census_says_what_the_worker_does_at_start(family, text_type, outcome):
    pytest.importorskip("mlx_vlm")
    from vision_census import decide

    found = decide(family, text_type)
    assert found.outcome == outcome
    assert bool(found.reason) == (outcome != "images")
