"""The model corpus through every stage: each registry model at its small
size (narrower, smaller inputs: the 2-core CI machine's budget; the full
sizes run in scripts/corpus.py, results under results/*/corpus-*), on llvm
validated against ONNX Runtime and PyTorch, and built for cuda:sm_90 here
(no GPU needed: the cross-compile runs every TIR pass). A model whose
operators TVM's ONNX frontend lacks (an entry marked `expect="unsupported"`)
must end in the one-line unsupported-operator error."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import models
from deploy import config, pipeline, targets
from deploy.errors import UnsupportedOperatorError

# tiny_* are the fast golden models of test_pipeline_llvm.py.
CORPUS = [n for n in models.names() if not n.startswith("tiny_")]


def _cfg(name, kind, **profile):
    return config.from_dict({"model": {"source": name, "size": "small", **profile.pop("model", {})},
                             kind: {"trials": 0, **profile}})


def test_corpus_is_large_and_varied():
    kinds = {models.get(n).kind for n in CORPUS}
    assert len(CORPUS) >= 20 and {"cnn", "transformer", "rnn"} <= kinds
    for n in CORPUS:
        spec = models.get(n)
        assert spec.small is not None, f"{n} has no small variant for the test suite"
        assert spec.expect in ("build", "unsupported")


@pytest.mark.parametrize("name", CORPUS)
def test_llvm_every_stage_validated(name, tmp_path, llvm_target):
    cfg = _cfg(name, "llvm", buckets=[1, 2])
    if models.get(name).expect == "unsupported":
        with pytest.raises(UnsupportedOperatorError, match="not supported by TVM's ONNX frontend"):
            pipeline.run(cfg, llvm_target, tmp_path / "ws", db_root=tmp_path / "db")
        return
    summary = pipeline.run(cfg, llvm_target, tmp_path / "ws", db_root=tmp_path / "db", compare_untuned=False)
    assert summary["validation"]["passed"], summary["validation"]
    report = json.loads((tmp_path / "ws" / "package" / "validation.json").read_text())
    assert set(report["buckets"]["2"]) == {"onnxruntime", "pytorch"}


@pytest.fixture(scope="module")
def sm90():
    return targets.resolve("cuda:sm_90")


@pytest.mark.parametrize("name", [n for n in CORPUS if models.get(n).expect == "build"])
def test_cuda_sm90_builds(name, tmp_path, sm90):
    if sm90.has_device:
        pytest.skip("this machine has a GPU: the gpu-marked corpus run covers it")
    cfg = _cfg(name, "cuda", buckets=[1])  # the CUDA defaults: fp16, fp32 accumulation, NHWC
    pipeline.run(cfg, sm90, tmp_path / "ws", db_root=tmp_path / "db")
    m = json.loads((tmp_path / "ws" / "package" / "manifest.json").read_text())
    b = m["buckets"]["1"]
    assert b["kernels"] > 0 and sum(b["schedules"].values()) == b["kernels"]
    assert m["precision"] == "fp16"


# On the GPU machine: one model of each family, both precisions (the whole
# corpus at full size is scripts/corpus.py's run, results/h200/*/corpus-*).
GPU_SUBSET = ["mobilenet_v3", "resnext", "convnext", "unet", "vit", "bert", "gpt"]


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp16", "fp32"])
@pytest.mark.parametrize("name", GPU_SUBSET)
def test_gpu_corpus_validated(name, precision, tmp_path):
    target = targets.resolve("cuda")
    cfg = _cfg(name, "cuda", buckets=[1, 4], precision=precision)
    summary = pipeline.run(cfg, target, tmp_path / "ws", db_root=tmp_path / "db", compare_untuned=False)
    assert summary["validation"]["passed"], summary["validation"]


@pytest.mark.parametrize("name", ["mobilenet_v3", "convnext", "bert"])
def test_dynamo_exporter_every_stage(name, tmp_path, llvm_target):
    """torch.export-based export (torch's default since 2.9: opset 18+, may
    write external data) through every stage."""
    cfg = _cfg(name, "llvm", buckets=[1, 3], model={"exporter": "dynamo"})
    summary = pipeline.run(cfg, llvm_target, tmp_path / "ws", db_root=tmp_path / "db", compare_untuned=False)
    assert summary["validation"]["passed"]
    m = json.loads((tmp_path / "ws" / "export" / "manifest.json").read_text())
    assert m["origin"]["exporter"] == "dynamo" and m["opset"] >= 18


def test_a_resumed_run_with_other_settings_is_refused_in_one_line(tmp_path, capsys):
    """scripts/corpus.py adds rows to a saved corpus.json only under the
    same settings: one saved with `wgmma_gemm` off (or from before the
    key, when it was off) is not resumed under the default, which is on in
    fp16; the refusal is one line, exit 2, the file untouched. On llvm the
    CUDA-only options do not count. --force under other settings starts
    over."""
    from .conftest import load_script

    corpus = load_script("corpus")
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "out"
    out.mkdir()
    saved = {"target": "cuda sm_90", "size": "small", "exporter": "torchscript", "layout": "default",
             "flat_gemm": False, "implicit_gemm": False, "fused_attention": None,
             "results": [{"model": "tiny_mlp", "precision": "fp16"}]}
    for wgmma in ({"wgmma_gemm": False}, {}):
        (out / "corpus.json").write_text(json.dumps({**saved, **wgmma}))
        before = (out / "corpus.json").read_text()
        assert corpus.main(["--target", "cuda:sm_90", "--size", "small", "--models", "tiny_mlp",
                            "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "other settings" in err and "wgmma_gemm null" in err
        assert (out / "corpus.json").read_text() == before
    # on llvm: a corpus saved when --wgmma-gemm was store_true (false) resumes; its done row is kept
    rows = json.loads((root / "results/cpu/2026-12-05/corpus-wgmma-default/llvm.json").read_text())["results"]
    row = next(r for r in rows if r["model"] == "tiny_mlp")
    arch = targets.resolve("llvm").arch
    (out / "corpus.json").write_text(json.dumps({**saved, "target": f"llvm {arch}", "wgmma_gemm": False,
                                                 "results": [row]}))
    assert corpus.main(["--target", "llvm", "--size", "small", "--models", "tiny_mlp", "--out", str(out)]) == 0
    assert json.loads((out / "corpus.json").read_text())["results"] == [row]
    # --force under other settings starts over: the saved rows (another model's too) are not kept
    other = {**row, "model": "tiny_cnn"}
    (out / "corpus.json").write_text(json.dumps({**saved, "target": f"llvm {arch}", "layout": "NCHW",
                                                 "results": [row, other]}))
    # (a run builds in a process pool: the script itself, not its module)
    subprocess.run([sys.executable, "scripts/corpus.py", "--target", "llvm", "--size", "small", "--models",
                    "tiny_mlp", "--out", str(out), "--work", str(tmp_path / "work"), "--force"],
                   cwd=root, check=True, capture_output=True, timeout=600)
    report = json.loads((out / "corpus.json").read_text())
    assert [r["model"] for r in report["results"]] == ["tiny_mlp"] and report["layout"] == "default"
    assert report["results"][0]["outcome"] == "validated"
    # a batch: a corpus saved before --batch (at batch 1) resumes at 1, not at 32; a batch of 0 is refused
    (out / "corpus.json").write_text(json.dumps({**saved, "target": f"llvm {arch}", "results": [row]}))
    assert corpus.main(["--target", "llvm", "--size", "small", "--models", "tiny_mlp", "--out", str(out)]) == 0
    before = (out / "corpus.json").read_text()
    for batch, model, why in (("32", "tiny_mlp", "batch 32"), ("0", "tiny_mlp", "not a batch"),
                              ("1", "tiny_mlp,swin", "unknown model 'swin'")):
        assert corpus.main(["--target", "llvm", "--size", "small", "--models", model, "--batch", batch,
                            "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and why in err and (out / "corpus.json").read_text() == before


# The convolutional models whose large-batch buckets on sm_90 get the implicit GEMMs by default
# (at every batch where no database was tuned on direct convolutions: tuning/graph.py), the wgmma kernel
# taking their gathers: built here as on the H200.
LARGE_BATCH = ["resnet50", "mobilenet_v3", "unet", "densenet"]


@pytest.mark.parametrize("name", LARGE_BATCH)
def test_cuda_sm90_builds_at_a_large_batch(name, tmp_path, sm90):
    if sm90.has_device:
        pytest.skip("this machine has a GPU: the gpu-marked corpus run covers it")
    pipeline.run(_cfg(name, "cuda", buckets=[32], tune_buckets=[]), sm90, tmp_path / "ws", db_root=tmp_path / "db")
    b = json.loads((tmp_path / "ws" / "package" / "manifest.json").read_text())["buckets"]["32"]
    assert b["kernels"] > 0 and sum(b["schedules"].values()) == b["kernels"] and not b["fallbacks"], b
    opt = json.loads((tmp_path / "ws" / "optimize" / "manifest.json").read_text())
    assert "implicit_gemm" in [p["phase"] for p in opt["report"]["32"]]
    assert b["schedules"].get("wgmma-gemm", 0) > 0, b["schedules"]
