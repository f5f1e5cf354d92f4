"""Golden tests: tiny models through every stage on llvm, compared with ONNX
Runtime and PyTorch by the validate stage."""

import json

import numpy as np
import pytest
import torch

import deploy
import models
from deploy import artifacts, pipeline
from deploy.errors import ShapeError

from .conftest import make_config

# Every registry model is run through the whole pipeline: the tiny ones here,
# the corpus at its small size in test_corpus.py.
GOLDEN = ["tiny_cnn", "tiny_mlp", "tiny_vit"]


def test_every_registered_model_is_covered():
    from .test_corpus import CORPUS

    assert sorted(GOLDEN + CORPUS) == sorted(models.names())


def test_tiny_cnn_package(tiny_package):
    folder, summary, _, _ = tiny_package
    m = json.loads((folder / "manifest.json").read_text())
    assert m["stage"] == "package" and m["target"]["kind"] == "llvm"
    assert set(m["buckets"]) == {"1", "4"}
    assert m["validation"]["passed"] is True
    assert m["inputs"] == [{"name": "input", "shape": [3, 16, 16], "dtype": "float32"}]
    assert m["outputs"] == [{"name": "output", "shape": [10], "dtype": "float32"}]
    for b in m["buckets"].values():
        assert artifacts.sha256_file(folder / b["file"]) == b["sha256"]
    report = json.loads((folder / "validation.json").read_text())
    assert set(report["buckets"]["4"]) == {"onnxruntime", "pytorch"}
    assert summary["validation"]["passed"]
    # every stage left its manifest
    ws = folder.parent
    for stage in ("export", "frontend", "optimize", "package"):
        assert (ws / stage / "manifest.json").is_file()
    assert not [p for p in ws.iterdir() if ".tmp-" in p.name]


@pytest.mark.parametrize("name", ["tiny_mlp", "tiny_vit"])
def test_golden_models(name, tmp_path, llvm_target):
    cfg = make_config(name, buckets=[2])
    summary = pipeline.run(cfg, llvm_target, tmp_path / "ws", db_root=tmp_path / "db")
    assert summary["validation"]["passed"]
    assert summary["validation"]["worst_rel_l2"] < 1e-4


def test_predictor_matches_pytorch_across_buckets(tiny_package):
    folder, _, cfg, _ = tiny_package
    pred = deploy.load(folder)
    model = models.build("tiny_cnn", seed=cfg.model.seed)
    x = np.random.default_rng(3).standard_normal((11, 3, 16, 16)).astype("float32")  # 4+4+3: split and padded
    out = pred({"input": x})["output"]
    with torch.no_grad():
        ref = model(torch.from_numpy(x)).numpy()
    assert out.shape == (11, 10)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)
    assert pred.bucket_for(1) == 1 and pred.bucket_for(3) == 4 and pred.bucket_for(9) == 4
    np.testing.assert_allclose(pred(x[:1])["output"], ref[:1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda p, x: p({"inp": x}), "unknown input name"),
        (lambda p, x: p({}), "missing input"),
        (lambda p, x: p(x.astype("float64")), "wrong dtype"),
        (lambda p, x: p(x[:, :2]), "wrong shape"),
        (lambda p, x: p(x[0]), "wrong shape"),
        (lambda p, x: p(x, x), "wrong number of inputs"),
        (lambda p, x: p(x[:0]), "empty batch"),
    ],
)
def test_predictor_rejects_bad_inputs(tiny_package, call, message):
    pred = deploy.load(tiny_package[0])
    x = np.zeros((2, 3, 16, 16), "float32")
    with pytest.raises(ShapeError, match=message):
        call(pred, x)


def test_onnx_file_source(tmp_path, llvm_target):
    """A user's ONNX file with its input shapes from the config."""
    from deploy import config

    model = models.build("tiny_cnn", seed=1)
    path = tmp_path / "user.onnx"
    torch.onnx.export(model, (torch.randn(1, 3, 16, 16),), str(path), opset_version=18, dynamo=False,
                      input_names=["pixels"], output_names=["logits"], dynamic_axes={"pixels": {0: "n"}})
    cfg = config.from_dict({
        "model": {"source": str(path), "inputs": [{"name": "pixels", "shape": [3, 16, 16]}]},
        "llvm": {"buckets": [3], "tune_buckets": [3], "trials": 0},
    })
    summary = pipeline.run(cfg, llvm_target, tmp_path / "ws", db_root=tmp_path / "db")
    assert summary["validation"]["passed"]
    m = json.loads((tmp_path / "ws" / "package" / "manifest.json").read_text())
    assert m["model"] == "user" and m["inputs"][0]["name"] == "pixels" and m["outputs"][0]["name"] == "logits"
    report = json.loads((tmp_path / "ws" / "package" / "validation.json").read_text())
    assert set(report["buckets"]["3"]) == {"onnxruntime"}  # no PyTorch model for an ONNX source


def test_fp16_nhwc_on_llvm(tmp_path, llvm_target):
    """The fp16 and layout phases on the CPU, validated with fp16 tolerances."""
    cfg = make_config("tiny_cnn", buckets=[2], tune_buckets=[2], precision="fp16", layout="NHWC")
    summary = pipeline.run(cfg, llvm_target, tmp_path / "ws", db_root=tmp_path / "db", dump_ir=True)
    assert summary["validation"]["passed"]
    m = json.loads((tmp_path / "ws" / "optimize" / "manifest.json").read_text())
    phases = [p["phase"] for p in m["report"]["2"]]
    assert phases == ["input", "fold_batchnorm", "inference", "constant_folding", "layout", "fast_math",
                      "mixed_precision", "epilogues", "fusion", "pack_weights"]
    assert m["report"]["2"][phases.index("mixed_precision")]["ops"].get("astype", 0) > 0
    assert len(list((tmp_path / "ws" / "optimize" / "ir" / "b2").glob("*.py"))) == 9


def test_batchnorm_is_folded_into_conv(tmp_path, llvm_target):
    """An ONNX graph with an explicit BatchNormalization (PyTorch's exporter
    folds it already, other exporters do not): onnxslim folds it into the
    convolution before import (the optimize stage's fold_batchnorm phase is
    the second line, for graphs onnxslim cannot simplify)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from deploy import config, export, frontend, optimize

    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.standard_normal((8, 3, 3, 3)).astype("float32"), "w"),
        numpy_helper.from_array(rng.uniform(0.5, 1.5, 8).astype("float32"), "scale"),
        numpy_helper.from_array(rng.standard_normal(8).astype("float32"), "bias"),
        numpy_helper.from_array(rng.standard_normal(8).astype("float32") * 0.1, "mean"),
        numpy_helper.from_array(rng.uniform(0.5, 1.5, 8).astype("float32"), "var"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c", "scale", "bias", "mean", "var"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "bn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 8, 8, 8])], inits)
    path = tmp_path / "bn.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    cfg = config.from_dict({"model": {"source": str(path), "inputs": [{"name": "x", "shape": [3, 8, 8]}]},
                            "llvm": {"buckets": [2], "tune_buckets": [2], "trials": 0}})
    ex = export.run(cfg, tmp_path / "export")
    fe = frontend.run(cfg.llvm, ex, tmp_path / "frontend")
    opt = optimize.run(cfg.llvm, llvm_target, fe, tmp_path / "optimize")
    report = {e["phase"]: e["ops"] for e in opt.manifest["report"]["2"]}
    assert fe.manifest["simplified"]["2"] == {"nodes_before": 2, "nodes_after": 1, "slim": "ok"}
    assert "nn.batch_norm" not in report["input"] and report["input"]["nn.conv2d"] == 1
    summary = pipeline.run(cfg, llvm_target, tmp_path / "ws", db_root=tmp_path / "db")
    assert summary["validation"]["passed"]


def test_validation_failure_is_reported(tmp_path, tiny_package):
    """A tolerance no build can meet: the run fails with a per-output report."""
    import dataclasses
    import shutil

    from deploy import config, export, validate
    from deploy.errors import ToleranceError

    folder, _, cfg, _ = tiny_package
    pkg = tmp_path / "package"
    shutil.copytree(folder, pkg)
    strict = config.Tolerance(rtol=0.0, atol=0.0, max_rel_l2=0.0)
    with pytest.raises(ToleranceError, match=r"bucket 1 output 'output' vs onnxruntime"):
        validate.run(cfg, strict, pkg, export.load(folder.parent / "export"))
    m = json.loads((pkg / "manifest.json").read_text())
    assert m["validation"]["passed"] is False and m["validation"]["failures"]
    report = json.loads((pkg / "validation.json").read_text())
    assert report["buckets"]["4"]["pytorch"]["output"]["passed"] is False
    assert dataclasses.asdict(strict) == report["tolerance"]


def test_per_kernel_profile(tmp_path, tiny_package, llvm_target):
    from deploy import optimize
    from deploy.bench import profile

    folder, _, cfg, _ = tiny_package
    opt = optimize.load(folder.parent / "optimize")
    rep = profile.run(cfg.llvm, llvm_target, opt, None, 4, tmp_path / "profile", iters=3)
    names = {k["kernel"] for k in rep["kernels"]}
    assert any("conv2d" in n for n in names) and any("matmul" in n for n in names)
    assert abs(sum(k["share"] for k in rep["kernels"]) - 1.0) < 1e-6
    conv = next(k for k in rep["kernels"] if "conv2d" in k["kernel"])
    assert conv["flops"] > 0 and conv["gflops_per_s"] > 0 and conv["calls_per_run"] >= 1
    assert (tmp_path / "profile" / "profile.md").read_text().count("|") > 10
    assert profile.load(tmp_path / "profile")["bucket"] == 4


def test_profile_timeline_is_a_chrome_trace(tmp_path, tiny_package, llvm_target):
    import types

    from deploy import optimize
    from deploy.bench import profile
    from deploy.tvm_compat import VirtualMachine, load_module, tensor, tvm

    folder, _, cfg, _ = tiny_package
    opt = optimize.load(folder.parent / "optimize")
    rep = profile.run(cfg.llvm, llvm_target, opt, None, 4, tmp_path / "profile", iters=2,
                      trace=tmp_path / "t" / "trace.json")
    trace = json.loads((tmp_path / "t" / "trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    kernels = {k["kernel"]: k["calls_per_run"] for k in rep["kernels"]}
    # 3 runs, every kernel call of each, in order and not overlapping, on one lane (no copies on the CPU)
    assert len(spans) == 3 * sum(kernels.values()) and {e["name"] for e in spans} == set(kernels)
    assert {e["tid"] for e in spans} == {profile.KERNEL_LANE} and all(e["dur"] > 0 for e in spans)
    assert all(a["ts"] + a["dur"] <= b["ts"] for a, b in zip(spans, spans[1:]))
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert "kernels (stream 0)" in names and rep["trace"] == str(tmp_path / "t" / "trace.json")
    # on a GPU the copies get their own lane: the same code with a CPU device standing in
    vm = VirtualMachine(load_module(str(tmp_path / "profile" / "module.so")), tvm.cpu())
    args = [tensor(np.zeros([4, *i["shape"]], i["dtype"]), tvm.cpu()) for i in
            json.loads((folder / "manifest.json").read_text())["inputs"]]
    events = profile.timeline(vm, tvm.cpu(), args, profile.kernel_costs(opt.load_module(4)), 2,
                              types.SimpleNamespace(kind="cuda"))
    copies = [e for e in events if e["tid"] == profile.COPY_LANE]
    assert [e["name"] for e in copies] == ["inputs host->device", "outputs device->host"] * 2
    assert all(e["args"]["bytes"] > 0 for e in copies)
    assert "host<->device copies" in json.dumps(profile.chrome_trace(events, rep))


def test_buckets_imported_and_optimized_in_parallel_processes_match_one_by_one(tmp_path, llvm_target, monkeypatch):
    """Large models' buckets go to parallel processes (frontend and optimize);
    the modules are the same files as made one after another."""
    from deploy import export, frontend, optimize

    cfg = make_config("tiny_cnn", buckets=[1, 2])
    ex = export.run(cfg, tmp_path / "export")
    fe1 = frontend.run(cfg.llvm, ex, tmp_path / "fe1")
    one = optimize.run(cfg.llvm, llvm_target, fe1, tmp_path / "one")
    assert fe1.manifest["processes"] == one.manifest["processes"] == 1  # a tiny model: not worth a process
    monkeypatch.setattr(frontend, "PARALLEL_BYTES", 0)
    monkeypatch.setattr(optimize, "PARALLEL_MODULE_BYTES", 0)
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    fe2 = frontend.run(cfg.llvm, ex, tmp_path / "fe2")
    two = optimize.run(cfg.llvm, llvm_target, fe2, tmp_path / "two")
    assert fe2.manifest["processes"] == two.manifest["processes"] == 2
    for b in (1, 2):
        assert fe2.modules[b].read_text() == fe1.modules[b].read_text()
        assert two.module_path(b).read_text() == one.module_path(b).read_text()
    assert two.manifest["report"] == one.manifest["report"]
    assert fe2.manifest["simplified"] == fe1.manifest["simplified"]


def test_untuned_comparison_is_built_when_asked_and_reused_after(tmp_path, tiny_package, llvm_target):
    """The before/after line: built with compare_untuned=True, reused by a
    later run of the same optimized modules (the default), never with False."""
    import dataclasses
    import shutil

    from deploy import build, export, optimize, pipeline

    folder, _, cfg, work = tiny_package
    ws = pipeline.Workspace(tmp_path / "ws")
    shutil.copytree(folder.parent, ws.root)
    profile = cfg.profile("llvm")
    package = build.load(ws.package)
    tuned = dataclasses.replace(package, manifest={**package.manifest, "buckets": {
        b: {**m, "tuned_kernels": 1 if b == "1" else 0} for b, m in package.manifest["buckets"].items()}})
    exported, opt = export.load(ws.export), optimize.load(ws.optimize)

    def measure(compare):
        return pipeline.measure_before_after(cfg, profile, llvm_target, exported, opt, tuned, ws, compare)

    assert measure(None)["1"]["untuned"] is None and not ws.untuned.exists()  # nothing built unasked
    assert set(measure(False)["1"]) == {"tuned"}
    built = measure(True)
    assert built["1"]["untuned"]["build"] == "built" and "untuned" not in built["4"]  # bucket 4 has no records
    assert measure(None)["1"]["untuned"]["build"] == "cached"
    line = pipeline.format_summary({"package": "p", "buckets": {"1": {"tuned_kernels": 1, "kernels": 6}},
                                    "latency": {"1": measure(None)["1"]}, "validation": None})
    assert "a cached build" in line
    (ws.root / pipeline.UNTUNED_KEY).write_text('{"modules": {}}')  # other modules since: not reused
    assert measure(None)["1"]["untuned"] is None
    assert "not compared; UNTUNED=1" in pipeline.format_summary(
        {"package": "p", "buckets": {"1": {"tuned_kernels": 1, "kernels": 6}}, "latency": {"1": {
            "tuned": {"median_ms": 1.0}, "untuned": None}}, "validation": None})


def test_the_users_alternatives_are_timed_beside_the_package(capsys, tmp_path):
    """`make tune` ends with PyTorch eager (and what else is named) on the same
    inputs beside each bucket's latency; an ONNX file has no PyTorch model, so
    ONNX Runtime stands in; a name it does not know is refused before any work."""
    from .test_errors import error_line, export_tiny, run_cli

    ws = tmp_path / "ws"
    rc, out, _ = run_cli(capsys, "run", "-m", "tiny_cnn", "--target", "llvm", "--buckets", "1", "--trials", "0",
                         "--workdir", ws, "--db-root", tmp_path / "db", "--alternatives", "torch-eager,onnxruntime")
    assert rc == 0
    summary = json.loads((ws / "summary.json").read_text())
    alt = summary["latency"]["1"]["alternatives"]
    assert set(alt) == {"torch-eager", "onnxruntime-cpu"} and all(a["median_ms"] > 0 for a in alt.values())
    assert "torch-eager " in out and "in turns with it): the package is" in out
    assert all(a["package_ms"] > 0 for a in alt.values())  # the package timed in the same rounds
    assert summary["finished"] is True

    # stopped while an alternative compiles (a device chunk at its time limit): the package's own
    # latency, measured before, is in the summary already
    from deploy.bench import latency as bench_latency

    def stopped(*a, **k):
        raise KeyboardInterrupt

    real, bench_latency.alternatives = bench_latency.alternatives, stopped
    try:
        rc, _, _ = run_cli(capsys, "run", "-m", "tiny_cnn", "--target", "llvm", "--buckets", "1", "--trials", "0",
                           "--workdir", ws, "--db-root", tmp_path / "db", "--alternatives", "torch-eager")
    finally:
        bench_latency.alternatives = real
    assert rc != 0
    summary = json.loads((ws / "summary.json").read_text())
    assert summary["finished"] is False and summary["latency"]["1"]["tuned"]["median_ms"] > 0
    assert "alternatives" not in summary["latency"]["1"] and summary["validation"]["passed"]

    onnx = tmp_path / "net.onnx"
    export_tiny(onnx)
    rc, out, _ = run_cli(capsys, "run", "-m", onnx, "--input", "x:3x16x16", "--target", "llvm", "--buckets", "1",
                         "--trials", "0", "--workdir", tmp_path / "ws2", "--db-root", tmp_path / "db")
    assert rc == 0
    assert set(json.loads((tmp_path / "ws2" / "summary.json").read_text())["latency"]["1"]["alternatives"]) == \
        {"onnxruntime-cpu"}

    rc, _, err = run_cli(capsys, "run", "-m", "tiny_cnn", "--target", "llvm", "--workdir", tmp_path / "ws3",
                         "--alternatives", "tensorrt")
    assert rc == 2 and "unknown alternative(s) tensorrt" in error_line(err)
    assert not (tmp_path / "ws3").exists()


def test_debug_kernels_names_the_kernel_that_faults(tmp_path, tiny_package, llvm_target):
    from deploy import optimize
    from deploy.bench import profile
    from deploy.errors import KernelFaultError
    from deploy.tvm_compat import VirtualMachine, load_module, tensor, tvm

    folder, _, cfg, _ = tiny_package
    opt = optimize.load(folder.parent / "optimize")
    rep = profile.run(cfg.llvm, llvm_target, opt, None, 4, tmp_path / "ws" / "profile", iters=1, debug_kernels=True)
    calls = sum(k["calls_per_run"] for k in rep["kernels"])
    mod = opt.load_module(4)
    costs = profile.kernel_costs(mod)
    vm = VirtualMachine(load_module(str(tmp_path / "ws" / "profile" / "module.so")), tvm.cpu())
    args = [tensor(np.zeros([4, *i["shape"]], i["dtype"]), tvm.cpu()) for i in
            json.loads((folder / "manifest.json").read_text())["inputs"]]
    assert profile.run_synchronized(vm, tvm.cpu(), args, costs, mod, tmp_path / "faults") == calls

    class Faulting:  # a device whose second kernel's synchronization reports a fault, as CUDA's would
        n = 0

        def sync(self):
            Faulting.n += 1
            if Faulting.n == 2:
                raise RuntimeError("CUDA: an illegal memory access was encountered")

    seen = []
    vm.set_instrument(lambda f, sym, before, ret, *a: (before and seen.append(sym)) or 0)
    vm["main"](*args)
    vm.set_instrument(None)
    second = [s for s in seen if s in costs][1]
    with pytest.raises(KernelFaultError) as e:
        profile.run_synchronized(vm, Faulting(), args, costs, mod, tmp_path / "faults")
    msg = str(e.value)
    assert f"kernel '{second}' faulted (call 2" in msg and "illegal memory access" in msg
    assert "float32[4" in msg and "\n" not in msg
    tir = (tmp_path / "faults" / f"{second}.tir").read_text()
    assert "illegal memory access" in tir and "T.prim_func" in tir


def test_manifest_records_device_memory_and_a_package_that_cannot_fit_is_refused(tiny_package, capsys):
    import types

    from deploy import cli, runtime
    from deploy.errors import TargetError

    folder, _, _, _ = tiny_package
    m = runtime.check_package(folder)
    params = sum(p.numel() * 4 for p in models.build("tiny_cnn").parameters())  # fp32, batchnorm folded or not
    for b in m["buckets"].values():
        assert 0.5 * params <= b["memory"]["weights_bytes"] <= 1.5 * params
        assert b["memory"]["workspace_bytes"] > 0
    need = runtime.device_memory(m)
    assert need == sum(b["memory"]["weights_bytes"] + b["memory"]["workspace_bytes"] for b in m["buckets"].values())
    assert cli.main(["info", str(folder)]) == 0
    assert "device memory once loaded" in capsys.readouterr().out

    cuda = {**m, "target": {**m["target"], "kind": "cuda"}}
    runtime.check_fits(cuda, types.SimpleNamespace(available_global_memory=need))
    with pytest.raises(TargetError, match="do not fit the GPU's free memory") as e:
        runtime.check_fits(cuda, types.SimpleNamespace(available_global_memory=need - 1))
    assert "\n" not in str(e.value)
    runtime.check_fits(m, types.SimpleNamespace(available_global_memory=0))  # the CPU: not checked
    old = {**cuda, "buckets": {k: {kk: vv for kk, vv in v.items() if kk != "memory"} for k, v in m["buckets"].items()}}
    assert runtime.device_memory(old) is None
    runtime.check_fits(old, types.SimpleNamespace(available_global_memory=0))  # built before memory was recorded
