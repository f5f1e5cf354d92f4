"""scripts/tune_failures.py: the tasks tuned across tune summaries, the
worst share of failed candidates first, and those that kept no valid one."""

from __future__ import annotations

import json

from ..conftest import load_script


def _summary(folder, tasks):
    folder.mkdir(parents=True)
    (folder / "tune-summary.json").write_text(json.dumps({"1": {"tasks": tasks}}))


def test_a_task_without_a_valid_candidate_is_named_and_the_worst_share_comes_first(tmp_path, capsys):
    _summary(tmp_path / "a", {
        "conv": {"new_trials": 64, "build_errors": 16, "run_errors": 0, "best_us": 10.0},
        "pool": {"new_trials": 32, "build_errors": 30, "run_errors": 2, "best_us": None},
        "old": {"new_trials": 0, "build_errors": 0, "run_errors": 0, "best_us": 5.0},
    })
    _summary(tmp_path / "b", {"gemm": {"new_trials": 4, "build_errors": 4, "run_errors": 0, "best_us": None}})
    assert load_script("tune_failures").main([str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "3 tasks tuned in 2 summaries; 2 with 8+ new trials; 1 of them kept no valid candidate"
    assert "100% of   32 failed  pool" in out[1] and "25% of   64 failed  conv" in out[2]
    assert out[3] == "  no valid candidate: pool b1 (a)"


def test_a_missing_folder_is_one_line_and_exit_2(tmp_path, capsys):
    assert load_script("tune_failures").main([str(tmp_path / "none")]) == 2
    assert capsys.readouterr().err.count("\n") == 1
