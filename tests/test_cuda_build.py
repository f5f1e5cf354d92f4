"""CUDA code generation on the CPU machine: an sm_90 build of a tiny model,
compiled here (no GPU needed), producing a package and its manifest."""

import json

import pytest

from deploy import pipeline, targets


def test_cross_compile_sm90(tmp_path):
    from deploy import config

    target = targets.resolve("cuda:sm_90")
    assert target.kind == "cuda" and target.arch == "sm_90"
    # Default trials: tuning is skipped (nothing to measure on), the build still runs.
    cfg = config.from_dict({"model": {"source": "tiny_cnn"}, "cuda": {"buckets": [1, 8]}})
    summary = pipeline.run(cfg, target, tmp_path / "ws", db_root=tmp_path / "db")
    m = json.loads((tmp_path / "ws" / "package" / "manifest.json").read_text())
    assert m["target"]["kind"] == "cuda" and json.loads(m["target"]["target"])["arch"] == "sm_90"
    assert m["gpu"]["compute_capability"] == "9.0"
    assert m["precision"] == "fp16" and m["layout"] == "NHWC" and m["cuda_graph"] is True
    assert set(m["buckets"]) == {"1", "8"}
    for b in m["buckets"].values():
        assert (tmp_path / "ws" / "package" / b["file"]).stat().st_size > 10_000
        assert b["kernels"] > 0
    if not target.has_device:
        assert summary["validation"] is None and summary["tuning"] is None  # nothing to run it on here
        assert not (tmp_path / "db").exists()


def test_unknown_target_string():
    from deploy.errors import TargetError

    with pytest.raises(TargetError, match="unknown target"):
        targets.resolve("cuda -arch=sm_90")


@pytest.mark.gpu
def test_gpu_short_tuning_chunk(tmp_path):
    """On the GPU machine: a short tuning chunk of tiny_cnn, validated on the GPU."""
    from deploy import config

    target = targets.resolve("cuda")
    cfg = config.from_dict({
        "model": {"source": "tiny_cnn"},
        "cuda": {"buckets": [1], "tune_buckets": [1], "trials": 16, "trials_per_task": 8,
                 "trials_per_iter": 8, "max_tasks": 2, "budget": "3m"},
    })
    summary = pipeline.run(cfg, target, tmp_path / "ws", db_root=tmp_path / "db")
    assert summary["validation"]["passed"]
    assert summary["tuning"]["1"]["new_trials"] > 0
    assert summary["latency"]["1"]["tuned"]["median_ms"] > 0


def test_tune_stage_refuses_a_target_without_device(capsys, tmp_path):
    from deploy import cli

    if targets.resolve("cuda:sm_90").has_device:
        pytest.skip("this machine has an sm_90 GPU")
    ws = tmp_path / "ws"
    for stage in ("export", "frontend", "optimize"):
        assert cli.main([stage, "-m", "tiny_cnn", "--target", "cuda:sm_90", "--buckets", "1", "--workdir", str(ws)]) == 0
    rc = cli.main(["tune", "-m", "tiny_cnn", "--target", "cuda:sm_90", "--buckets", "1", "--workdir", str(ws),
                   "--db-root", str(tmp_path / "db")])
    err = capsys.readouterr().err
    assert rc == 2 and "cannot tune for cuda sm_90 here" in err
    assert not (tmp_path / "db").exists() and not (ws / "tune").exists()
