"""The load test against the raw module, and where it writes."""

import json
from pathlib import Path

from ..test_errors import error_line, run_cli


def test_loadtest_writes_a_report(capsys, tmp_path, tiny_package):
    out = tmp_path / "lt"
    rc, _, err = run_cli(capsys, "loadtest", "--package", tiny_package[0], "--concurrency", "1,3",
                         "--duration-s", "1", "--warmup-s", "0.3", "--raw-seconds", "0.1", "--out", out,
                         "--client-procs", 2, "--no-warmup")
    assert rc == 0, err
    report = json.loads((out / "results.json").read_text())
    assert [lv["concurrency"] for lv in report["levels"]] == [1, 3]
    for lv in report["levels"]:
        assert lv["samples_per_s"] > 0 and lv["statuses"] == {"ok": lv["requests"]}
        assert lv["p50_ms"] <= lv["p99_ms"] and lv["ok_p50_ms"] == lv["p50_ms"]  # no errors: the same answers
        # Server side: a request spends part of its client-side latency in the server, part of that queued.
        assert 0 < lv["queue_ms"] < lv["server_ms"] <= lv["ok_mean_ms"] * 1.5 and lv["batch_ms"] > 0
        assert 0 < lv["batcher_busy"] <= 1.05 and 0 < lv["loop_busy"] <= 1.05 and lv["loop_cpu_us"] > 0
    assert report["client_processes"] == 2
    assert '"warmup": false' in (out / "server.log").read_text()  # --no-warmup reached the server
    assert set(report["raw"]["buckets"]) == {"1", "4"} and report["raw"]["best_samples_per_s"] > 0
    four = report["raw"]["buckets"]["4"]  # the host copy alone, timed apart from the run
    assert 0 < four["staging_median_ms"] < four["run_bucket_median_ms"] and four["staging_gb_per_s"] > 0
    assert report["server_exit_status"] == 0 and report["target_check"] is None
    assert "| concurrency | samples/s |" in (out / "results.md").read_text()
    assert "| concurrency | in server (ms) | queued (ms) | batch run (ms) |" in (out / "results.md").read_text()
    foreign = tmp_path / "mine"
    foreign.mkdir()
    rc, _, err = run_cli(capsys, "loadtest", "--package", tiny_package[0], "--out", foreign)
    assert rc == 2 and "not written by loadtest" in error_line(err)


def test_loadtest_paths_are_the_checkouts():
    """The default results folder and the server's working directory are the
    checkout's (one REPO_ROOT, in deploy/artifacts.py)."""
    from deploy import artifacts
    from deploy.serving import loadtest

    repo = Path(__file__).resolve().parents[2]
    out = loadtest.default_out({"model": "m", "target": {"kind": "llvm"}})
    assert out.parent.parent.parent == repo / "results" and out.name == "m-loadtest"
    assert artifacts.REPO_ROOT == repo and (artifacts.REPO_ROOT / "deploy" / "__main__.py").is_file()
