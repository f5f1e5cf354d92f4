import pytest

from deploy import config
from deploy.errors import ConfigError


def test_defaults_and_profile_selection():
    cfg = config.from_dict({"model": {"source": "resnet50"}})
    assert cfg.model.name == "resnet50"
    assert cfg.profile("cuda").precision == "fp16"
    assert cfg.profile("llvm").precision == "fp32"
    assert cfg.tolerance.fp16.max_rel_l2 > cfg.tolerance.fp32.max_rel_l2


def test_onnx_source_name_is_file_stem():
    cfg = config.from_dict({"model": {"source": "some/dir/net.onnx", "inputs": [{"name": "x", "shape": [3, 8, 8]}]}})
    assert cfg.model.name == "net"
    assert cfg.model.inputs[0].shape == (3, 8, 8)


@pytest.mark.parametrize(
    "data, message",
    [
        ({"model": {"source": "x", "sed": 1}}, "did you mean 'seed'"),
        ({"model": {"source": "x"}, "cuda": {"precison": "fp16"}}, "did you mean 'precision'"),
        ({"model": {"source": "x"}, "tolerence": {}}, "did you mean 'tolerance'"),
        ({"model": {"source": "x"}, "llvm": {"precision": "int8"}}, "expected fp32 or fp16"),
        ({"model": {"source": "x"}, "cuda": {"precision": "int8"}}, "expected fp32 or tf32 or fp16"),
        ({"model": {"source": "x"}, "llvm": {"precision": "tf32"}}, "TF32 is a CUDA tensor-core format"),
        ({"model": {"source": "x"}, "cuda": {"precision": "fp16", "accumulate": "tf32"}}, "invalid cuda.accumulate"),
        ({"model": {"source": "x"}, "llvm": {"buckets": [0, 2]}}, "buckets"),
        ({"model": {"source": "x"}, "llvm": {"buckets": [1, 2], "tune_buckets": [4]}}, "not built"),
        ({"model": {"source": "x"}, "llvm": {"trials": "many"}}, "wrong type"),
        ({"model": {"source": "x"}, "llvm": {"cuda_graph": 1}}, "wrong type"),
        ({"model": {"source": "x"}, "llvm": {"budget": "ten minutes"}}, "duration"),
        ({"model": {"source": "x", "opset": 9}}, "opset"),
        ({"model": {"source": "x", "inputs": [{"name": "a", "shape": [3, -1]}]}}, "positive"),
        ({"model": {"source": "x", "inputs": [{"name": "a", "shape": [3], "dtype": "float8"}]}}, "dtype"),
        ({"llvm": {}}, "missing section [model]"),
        ({"model": {}}, "missing key 'model.source'"),
        ({"model": {"source": "x", "name": "a b"}}, "model.name"),
    ],
)
def test_invalid_configs_are_rejected_with_one_line(data, message):
    with pytest.raises(ConfigError) as e:
        config.from_dict(data)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_durations():
    assert config.parse_duration("") is None
    assert config.parse_duration("90") == 90
    assert config.parse_duration("90s") == 90
    assert config.parse_duration("10m") == 600
    assert config.parse_duration("1h30m") == 5400
    with pytest.raises(ConfigError):
        config.parse_duration("10 minutes")


def test_overrides_apply_to_the_active_profile_only():
    cfg = config.from_dict({"model": {"source": "x"}})
    out = config.apply_overrides(cfg, "cuda", precision="fp32", buckets=[2, 4], trials=None)
    assert out.cuda.precision == "fp32"
    assert out.cuda.buckets == (2, 4)
    assert out.cuda.tune_buckets == (2,)  # tuned bucket follows the new buckets
    assert out.llvm == cfg.llvm
    with pytest.raises(ConfigError):
        config.apply_overrides(cfg, "llvm", precision="fp8")


def test_load_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        config.load(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\nsource = 1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        config.load(bad)


def test_shipped_configs_parse():
    from pathlib import Path

    import models

    paths = sorted((Path(__file__).parent.parent / "configs").glob("*.toml"))
    assert paths
    for p in paths:
        cfg = config.load(p)
        assert cfg.model.source in models.names(), p
        assert cfg.model.name == p.stem, p
    # a config per model whose settings differ from the defaults; the others run by registry name
    assert {p.stem for p in paths} <= set(models.names())


@pytest.mark.parametrize("flag, compare", [([], None), (["--untuned"], True), (["--no-untuned"], False)])
def test_run_no_untuned_flag_reaches_the_pipeline(flag, compare, monkeypatch, tmp_path):
    from deploy import cli, pipeline

    seen = {}

    def fake_run(cfg, target, workdir, db_root, **kw):
        seen.update(kw)
        raise SystemExit(0)

    monkeypatch.setattr(pipeline, "run", fake_run)
    with pytest.raises(SystemExit):
        cli.main(["run", "-m", "tiny_cnn", "--target", "llvm", "--workdir", str(tmp_path / "ws"), *flag])
    assert seen["compare_untuned"] is compare


def test_resnet50_cuda_databases_hold_the_configs_trials():
    """`make tune MODEL=resnet50` on an H200 builds from the committed batch-1
    and batch-64 databases (and `PRECISION=fp32 BUCKETS=1` from the fp32
    batch-1 one) without tuning only while each holds the config's
    `trials`: raising them (or replacing a database) must come with more tuning."""
    import lzma
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    cfg = config.load(root / "configs" / "resnet50.toml")
    assert cfg.cuda.split_k == 4 and list(cfg.cuda.tune_buckets) == [1, 64]
    # fp16 at both tuned buckets; fp32 at batch 1 (`PRECISION=fp32 BUCKETS=1`).
    for name in [f"fp16-nhwc-b{bucket}" for bucket in cfg.cuda.tune_buckets] + ["fp32-nhwc-b1"]:
        records = root / f"tuning_logs/resnet50/cuda-sm_90-nvidia-h200/{name}/database_tuning_record.json.xz"
        with lzma.open(records, "rt") as f:
            held = sum(1 for line in f if line.strip())
        assert held >= cfg.cuda.trials, (name, held, cfg.cuda.trials)
