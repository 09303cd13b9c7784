"""The nightly's own logic: history reading, the verdict's rules and margins, the record, the
pictures and page, and one end-to-end night through the real router (skipped when genai-bench's
venv is not installed: `make nightly` installs it once)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import history
import nightly
import pytest

from servicer.faults import FaultPlan

ROOT = Path(__file__).resolve().parents[1]

MACHINE = {"cpu": "test cpu", "cores": 2, "gpu": "none", "memory_gib": 23}


def result(
    scenario: str = "D(100,100)",
    level: int = 1,
    tok_s: float = 0.5,
    times: float = 0.5,
    errors: int = 0,
    vetoes: int = 0,
) -> dict[str, Any]:
    """A result whose ratios to the raw engine are `tok_s` (tok/s) and `times` (the rest)."""
    ratio = {name: times for name in history.METRICS} | {"tok_s": tok_s}
    ours = {"tok_s": 100 * tok_s, "ttft_p50": 10.0, "errors": errors, "vetoes": vetoes}
    return {"scenario": scenario, "concurrency": level, "ours": ours, "ratio": {"raw": ratio}}


def record(*results: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {
        "date": "2026-11-24T00:00:00Z",
        "machine": MACHINE,
        "model": "demo",
        "quick": True,
        "results": list(results) or [result()],
        **fields,
    }


def marks(verdict: history.Verdict, metric: str = "tok_s") -> list[str]:
    return [row.mark for row in verdict.rows if row.metric == metric]


# --------------------------------------------------------------------------- history


def test_history_survives_new_and_missing_fields_and_torn_lines(tmp_path: Path) -> None:
    path = tmp_path / "h.jsonl"
    history.append_record(path, record())
    history.append_record(path, record(result(), future_field={"x": 1}))
    # A record from a later schema: a new per-result field, a new reference, a missing metric.
    later = record(result())
    later["results"][0]["ratio"]["peer2"] = {"tok_s": 0.4}
    later["results"][0]["ratio"]["raw"].pop("e2e")
    later["results"][0]["new_metric"] = 3.0
    history.append_record(path, later)
    with open(path, "a") as file:
        file.write('{"torn": \n')  # a crash mid-write
        file.write("[1, 2]\n")  # not a record
        file.write(json.dumps({"machine": MACHINE}) + "\n")  # no results at all
    records = history.read_history(path)
    assert len(records) == 4
    assert records[1]["future_field"] == {"x": 1}
    verdict = history.verdict(record(result()), records)
    assert not verdict.regressed
    assert history.read_history(tmp_path / "missing.jsonl") == []


def test_only_the_same_machine_model_and_mode_count() -> None:
    slow_elsewhere = [
        record(result(tok_s=2.0), machine={**MACHINE, "cpu": "other"}),
        record(result(tok_s=2.0), model="real"),
        record(result(tok_s=2.0), quick=False),
    ]
    verdict = history.verdict(record(result(tok_s=0.5)), slow_elsewhere)
    assert verdict.nights == 0
    assert marks(verdict) == ["new"]
    assert not verdict.regressed


def test_an_ad_hoc_run_is_a_mode_of_its_own(tmp_path: Path) -> None:
    """--scenario, --concurrency and the like make a series apart from the nightly's; records
    from before modes (only `quick`) still meet tonight's quick or full run."""
    assert nightly.parse_args(["--quick"]).mode == "quick"
    assert nightly.parse_args([]).mode == "full"
    adhoc = nightly.parse_args(["--scenario", "D(2000,200)", "--concurrency", "4,8"])
    assert adhoc.mode == "custom: D(2000,200) at c=4,8, 64 requests, 2 min, sglang"
    assert adhoc.scenarios == ["D(2000,200)"] and adhoc.levels == [4, 8]
    assert nightly.parse_args(["--quick", "--api-backend", "openai"]).mode.startswith("custom")
    old = record(result(tok_s=2.0))  # no "mode": quick
    assert history.verdict(record(result(tok_s=0.5), mode="quick"), [old]).regressed
    mine = record(result(tok_s=0.5), mode=adhoc.mode)
    assert history.verdict(mine, [old]).nights == 0
    assert history.verdict(mine, [record(result(tok_s=0.5), mode=adhoc.mode)]).nights == 1


def test_the_numbers_show_every_system_side_by_side(tmp_path: Path) -> None:
    raw = {"tok_s": 1000.0, "ttft_p50": 5.0, "tpot": 2.0, "errors": 0}
    ours = {"tok_s": 800.0, "ttft_p50": 6.5, "tpot": 2.5, "errors": 0, "vetoes": 1}
    smg = {"failed": "smg-grpc-servicer exited", "vetoes": 0}
    results = [{"scenario": "D(100,100)", "concurrency": 4, "raw": raw, "ours": ours, "smg": smg}]
    logs = tmp_path / "logs"
    logs.mkdir()
    veto = "\x1b[2m2026\x1b[0m WARN Worker vetoed by liveness\n"
    (logs / "router-ours.log").write_text(veto * 3)  # one in the run, two outside
    vetoes = nightly.router_vetoes(results, tmp_path)
    assert vetoes == {"ours": {"total": 3, "in_runs": 1}}
    text = nightly.numbers_text(results, vetoes)
    header, _, row = text.splitlines()[:3]
    assert "tok/s raw" in header and "tok/s smg" in header and "vetoes ours" in header
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[:5] == ["D(100,100)", "4", "1000.0", "800.0", "failed"]
    assert "TPOT p50 ms ours" in header and "2.50" in cells
    assert "outside the runs (start-up, probe, shut-down): mlx-grpc-worker 2" in text


def test_window_keeps_the_last_n_nights() -> None:
    past = [record(result(tok_s=2.0))] * 3 + [record(result(tok_s=0.5))] * 7
    verdict = history.verdict(record(result(tok_s=0.5)), past, window=7)
    assert verdict.nights == 7
    row = next(r for r in verdict.rows if r.metric == "tok_s")
    assert (row.median, row.low, row.high, row.nights) == (0.5, 0.5, 0.5, 7)


# --------------------------------------------------------------------------- verdict rules


def test_first_night_is_no_regression() -> None:
    verdict = history.verdict(record(), [])
    assert not verdict.regressed
    assert set(marks(verdict)) == {"new"}
    assert "first night" in history.verdict_summary(verdict)


def test_margin_below_the_recent_minimum() -> None:
    past = [record(result(tok_s=v)) for v in (0.50, 0.55, 0.60)]
    margin = history.METRICS["tok_s"].margin
    edge = 0.50 * (1 - margin)
    assert marks(history.verdict(record(result(tok_s=edge + 0.001)), past)) == ["ok"]
    low = history.verdict(record(result(tok_s=edge - 0.001)), past)
    assert marks(low) == ["REGRESSION"]
    assert low.regressed_scenarios() == ["D(100,100) c=1"]
    high = history.verdict(record(result(tok_s=0.60 * (1 + margin) + 0.01)), past)
    assert marks(high) == ["improved"]
    assert not high.regressed


def test_margins_differ_per_metric_and_can_be_overridden() -> None:
    past = [record(result(times=0.5))]
    # 45 % below: past TPOT's 40 % margin, within TTFT p50's 50 %.
    verdict = history.verdict(record(result(times=0.275)), past)
    assert marks(verdict, "tpot") == ["REGRESSION"]
    assert marks(verdict, "ttft_p50") == ["ok"]
    loose = history.verdict(
        record(result(times=0.275)), past, margins=dict.fromkeys(history.METRICS, 0.5)
    )
    assert not loose.regressed


def test_errors_and_vetoes_are_regressions_by_themselves() -> None:
    for bad in (result(errors=1), result(vetoes=2)):
        verdict = history.verdict(record(bad), [])  # even on the first night
        assert verdict.regressed
        assert marks(verdict, "errors") == ["REGRESSION"]
        assert "REGRESSION in D(100,100) c=1" in history.verdict_summary(verdict)


def test_a_failed_run_regresses_when_it_had_numbers_before() -> None:
    failed = {"scenario": "D(100,100)", "concurrency": 1, "ours": {"failed": "x"}, "ratio": {}}
    verdict = history.verdict(record(failed), [record(result())])
    assert verdict.regressed
    assert "failed: x" in history.verdict_summary(verdict)


def test_speed_ratio_is_higher_is_better_for_every_metric() -> None:
    assert history.speed_ratio("tok_s", 50, 100) == 0.5
    assert history.speed_ratio("ttft_p50", 20, 10) == 0.5  # twice the raw engine's time
    assert history.speed_ratio("tpot", None, 10) is None
    assert history.speed_ratio("e2e", 10, 0) is None


def test_table_names_every_scenario_and_level() -> None:
    past = [record(result(), result("D(1000,100)", 4))]
    tonight = record(result(tok_s=0.1), result("D(1000,100)", 4))
    verdict = history.verdict(tonight, past)
    table = history.verdict_table(verdict)
    assert "D(1000,100) | 4" in table and "REGRESSION" in table and "-80%" in table
    assert verdict.regressed_scenarios() == ["D(100,100) c=1"]


def test_slow_fault_parses() -> None:
    assert FaultPlan.parse("slow:20").step_delay_s == 0.02
    assert FaultPlan.parse("").step_delay_s == 0.0


# --------------------------------------------------------------------------- the command


def fake_measure(factor: float) -> nightly.Measure:
    """A night without processes: ours at `factor` of the raw engine's speed."""

    def measure(args: argparse.Namespace, model_dir: Path, out: Path) -> list[dict[str, Any]]:
        results = []
        for scenario in args.scenarios:
            for level in args.levels:
                raw = {"tok_s": 1000.0, "ttft_p50": 5.0, "ttft_p99": 8.0, "tpot": 2.0, "e2e": 200}
                ours = {k: v * factor if k == "tok_s" else v / factor for k, v in raw.items()}
                ours |= {"errors": 0, "vetoes": 0}
                results.append(
                    {"scenario": scenario, "concurrency": level, "raw": raw, "ours": ours}
                )
        return results

    return measure


def test_nights_append_judge_and_draw(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--quick", "--history", str(tmp_path / "h.jsonl"), "--out", str(tmp_path / "out")]
    (tmp_path / "config.json").write_text("{}")  # a model directory, named, never loaded
    argv += ["--model", str(tmp_path)]
    assert nightly.main(argv, fake_measure(0.5)) == 0
    assert "first night" in capsys.readouterr().out
    assert nightly.main(argv, fake_measure(0.5)) == 0
    assert "Verdict: no regression" in capsys.readouterr().out
    assert nightly.main(argv, fake_measure(0.2)) == 1
    text = capsys.readouterr().out
    assert "Verdict: REGRESSION in D(100,100) c=1, D(100,100) c=4" in text
    records = history.read_history(tmp_path / "h.jsonl")
    assert len(records) == 3
    assert records[0]["results"][0]["ratio"]["raw"]["tok_s"] == pytest.approx(0.5)
    assert records[0]["versions"]["mlx"] and records[0]["machine"]["cores"]
    last = sorted((tmp_path / "out").iterdir())[-1]
    page = (last / "index.html").read_text()
    assert "REGRESSION" in page and "trend-tok_s.png" in page
    for metric in history.METRICS:
        assert (last / f"trend-{metric}.png").stat().st_size > 10_000


GENAI_VENV = ROOT / "bench" / ".venv-genai" / "bin" / "genai-bench"


@pytest.mark.skipif(not GENAI_VENV.exists(), reason="genai-bench's venv is not installed")
def test_one_real_night_through_the_router(tmp_path: Path) -> None:
    """One tiny real night: the demo model, the router, genai-bench, the raw engine."""
    argv = ["--quick", "--concurrency", "1", "--max-requests", "2"]
    argv += ["--history", str(tmp_path / "h.jsonl"), "--out", str(tmp_path / "out")]
    assert nightly.main(argv) == 0
    (night,) = history.read_history(tmp_path / "h.jsonl")
    (only,) = night["results"]
    # genai-bench stops at the limit, but requests already under way finish and count.
    assert only["ours"]["errors"] == 0 and only["ours"]["requests"] >= 2
    assert 0 < only["ratio"]["raw"]["tok_s"] < 10


@pytest.mark.skipif(not GENAI_VENV.exists(), reason="genai-bench's venv is not installed")
def test_a_worker_that_does_not_start_is_a_recorded_regression(tmp_path: Path) -> None:
    broken = tmp_path / "model"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    argv = ["--quick", "--model", str(broken), "--history", str(tmp_path / "h.jsonl")]
    assert nightly.main([*argv, "--out", str(tmp_path / "out")]) == 1
    (night,) = history.read_history(tmp_path / "h.jsonl")
    assert [r["ours"]["failed"][:22] for r in night["results"]] == ["mlx-grpc-worker exited"] * 2
