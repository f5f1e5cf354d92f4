"""The latency diff on the CPU: runners on a tiny model, the trtexec parsers
on samples written from trtexec's documented output, and the report."""

import json

import numpy as np
import pytest

from deploy import export, validate
from deploy.bench import latency, trtexec
from deploy.bench import report as bench_report
from deploy.bench import runners as bench_runners
from deploy.errors import ConfigError, InputFileError

TRTEXEC_LOG = """\
[11/29/2026-10:12:00] [I] === Model Options ===
[11/29/2026-10:12:00] [I] Format: ONNX
[11/29/2026-10:12:00] [I] Model: resnet50_fp16.onnx
[11/29/2026-10:12:01] [I] === Performance summary ===
[11/29/2026-10:12:01] [I] Throughput: 2113.56 qps
[11/29/2026-10:12:01] [I] Latency: min = 0.458496 ms, max = 0.640869 ms, mean = 0.471163 ms, median = 0.469971 ms, percentile(90%) = 0.476074 ms, percentile(95%) = 0.479004 ms, percentile(99%) = 0.489746 ms
[11/29/2026-10:12:01] [I] Enqueue Time: min = 0.00292969 ms, max = 0.0231934 ms, mean = 0.00340739 ms, median = 0.00317383 ms, percentile(90%) = 0.00390625 ms, percentile(95%) = 0.00415039 ms, percentile(99%) = 0.00585938 ms
[11/29/2026-10:12:01] [I] H2D Latency: min = 0 ms, max = 0 ms, mean = 0 ms, median = 0 ms, percentile(90%) = 0 ms, percentile(95%) = 0 ms, percentile(99%) = 0 ms
[11/29/2026-10:12:01] [I] GPU Compute Time: min = 0.456543 ms, max = 0.638916 ms, mean = 0.469210 ms, median = 0.468018 ms, percentile(90%) = 0.474121 ms, percentile(95%) = 0.477051 ms, percentile(99%) = 0.487793 ms
[11/29/2026-10:12:01] [I] D2H Latency: min = 0 ms, max = 0 ms, mean = 0 ms, median = 0 ms, percentile(90%) = 0 ms, percentile(95%) = 0 ms, percentile(99%) = 0 ms
[11/29/2026-10:12:01] [I] Total Host Walltime: 3.00161 s
[11/29/2026-10:12:01] [I] Total GPU Compute Time: 2.98877 s
"""


def trtexec_times(n=50):
    rng = np.random.default_rng(0)
    out, t = [], 0.0
    for _ in range(n):
        c = 0.46 + float(rng.uniform(0, 0.03))
        out.append({"startEnqMs": t, "endEnqMs": t + 0.003, "startComputeMs": t + 0.003, "endComputeMs": t + 0.003 + c,
                    "computeMs": c, "latencyMs": c})
        t += c + 0.001
    return out


def test_percentiles():
    t = bench_runners.percentiles([1.0] * 98 + [5.0, 10.0], batch=8)
    assert t["p50_ms"] == 1.0 and t["p99_ms"] > 5 and t["max_ms"] == 10.0
    assert t["throughput_per_s"] == pytest.approx(8000.0)


def test_trtexec_summary_prefers_gpu_compute_time():
    s = trtexec.parse_trtexec_summary(TRTEXEC_LOG)
    assert s["p50_ms"] == pytest.approx(0.468018) and s["p99_ms"] == pytest.approx(0.487793)
    assert s["qps"] == pytest.approx(2113.56)
    only_latency = "\n".join(ln for ln in TRTEXEC_LOG.splitlines() if "GPU Compute" not in ln)
    assert trtexec.parse_trtexec_summary(only_latency)["p50_ms"] == pytest.approx(0.469971)
    with pytest.raises(InputFileError):
        trtexec.parse_trtexec_summary("[I] nothing here")


def test_trtexec_times():
    data = trtexec_times()
    ms = trtexec.parse_trtexec_times(data)
    assert len(ms) == 50 and all(0.46 <= m <= 0.49 for m in ms)
    with pytest.raises(InputFileError):
        trtexec.parse_trtexec_times([])


def _baseline(tmp_path, **meta):
    (tmp_path / "times.json").write_text(json.dumps(trtexec_times()))
    (tmp_path / "trtexec.log").write_text(TRTEXEC_LOG)
    m = {"name": "tensorrt-10-h200", "model": "resnet50", "batch": 1, "input_shape": [3, 224, 224],
         "precision": "fp16", "gpu": "NVIDIA H200", "times": "times.json", "summary": "trtexec.log", **meta}
    p = tmp_path / "baseline.json"
    p.write_text(json.dumps(m))
    return p


def test_baseline_is_loaded_and_mismatches_refused(tmp_path):
    p = _baseline(tmp_path)
    b = trtexec.load_baseline(p, "resnet50", 1, [3, 224, 224], "fp16")
    assert b["kind"] == "tensorrt" and b["timing"]["iterations"] == 50 and b["timing"]["trtexec_qps"] == 2113.56
    for args, what in [(("mobilenet_v2", 1, [3, 224, 224], "fp16"), "model"), (("resnet50", 8, [3, 224, 224], "fp16"), "batch"),
                       (("resnet50", 1, [3, 224, 224], "fp32"), "precision"), (("resnet50", 1, [3, 112, 112], "fp16"), "input_shape")]:
        with pytest.raises(ConfigError, match=f"another {what}"):
            trtexec.load_baseline(p, *args)
    with pytest.raises(InputFileError):
        trtexec.load_baseline(tmp_path / "none.json", "resnet50", 1, [3, 224, 224], "fp16")


def test_runners_on_a_tiny_model(tmp_path, tiny_package):
    folder, _, cfg, _ = tiny_package
    ex = export.load(folder.parent / "export")
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal((4, 3, 16, 16)).astype("float32")]
    reference = validate.references(cfg, ex, inputs)["onnxruntime"]
    factory = lambda: export.build_torch_model(cfg)  # noqa: E731
    runners = bench_runners.make_runners(
        ["tvm", "tvm-untuned", "onnxruntime", "torch-eager", "torch-eager-tf32", "torch-eager-fp16", "tensorrt"],
        package=folder, untuned=folder.parent / "no-untuned", onnx_path=ex.onnx_path, input_names=["input"],
        factory=factory, precision="fp32", compile_mode="default", fp16_onnx_path=None,
    )
    wrong = bench_runners.TorchRunner("torch-other-weights", lambda: __import__("models").build("tiny_cnn", seed=7))
    case = latency.case(4, "fp32", runners + [wrong], inputs, reference, cfg.tolerance, warmup=2, iters=10)
    rows = {r["name"]: r for r in case["runners"]}
    for name in ("tvm", "onnxruntime-cpu", "torch-eager"):
        assert rows[name]["status"] == "ok", rows[name]
        assert rows[name]["check"]["passed"] and rows[name]["timing"]["iterations"] == 10
    assert rows["tvm-untuned"]["status"] == "skipped" and "make tune" in rows["tvm-untuned"]["reason"]
    assert rows["tensorrt-fp32"]["status"] == "skipped" and "tensorrt" in rows["tensorrt-fp32"]["reason"]
    assert rows["torch-eager-fp16"]["status"] == "skipped"
    assert rows["torch-eager-tf32"]["status"] == "skipped" and "CUDA" in rows["torch-eager-tf32"]["reason"]
    assert rows["torch-other-weights"]["check"]["passed"] is False  # fast but wrong is flagged

    report = {"model": "tiny_cnn", "target": {}, "environment": bench_report.environment(), "cases": [case]}
    md = bench_report.markdown(report)
    assert "**differ**" in md and "skipped: tensorrt is not importable" in md and "tvm speed-up" in md
    with pytest.raises(ConfigError, match="unknown runner"):
        bench_runners.make_runners(["tvm", "tflite"], package=folder, untuned=folder, onnx_path=ex.onnx_path, input_names=["input"],
                           factory=factory, precision="fp32", compile_mode="default", fp16_onnx_path=None)


class _Turns(bench_runners.Runner):
    """A runner on a shared machine whose clock drops during round 2; it
    records its turns and can break on a given turn."""

    def __init__(self, name, ms, machine, break_on=None):
        self.name, self.ms, self.machine, self.break_on = name, ms, machine, break_on
        self.loaded, self.turns = False, 0

    def activate(self, inputs):
        self.loaded = True

    def infer(self):
        return [np.ones(3, "float32")]

    def time(self, warmup, iters):
        self.turns += 1
        self.machine["log"].append((self.name, iters, [r.loaded for r in self.machine["runners"]]))
        if self.turns == self.break_on:
            raise RuntimeError("device lost\nmore detail")
        slow = 2.0 if self.turns == 2 else 1.0
        return [self.ms * slow] * iters

    def deactivate(self):
        self.loaded = False


def test_rounds_take_turns_and_show_a_machine_that_changed():
    from deploy.config import Tolerances

    machine = {"log": []}
    a, b, c = _Turns("a", 1.0, machine), _Turns("b", 2.0, machine), _Turns("c", 3.0, machine, break_on=2)
    machine["runners"] = [a, b, c]
    rows = latency.run_all([a, b, c], [np.zeros((4, 3), "float32")], [np.ones(3, "float32")], Tolerances(),
                         warmup=1, iters=10, rounds=3)
    assert [(n, k) for n, k, _ in machine["log"]] == [("a", 4), ("b", 4), ("c", 4), ("a", 3), ("b", 3), ("c", 3),
                                                      ("a", 3), ("b", 3)]
    assert all(all(loaded) for _, _, loaded in machine["log"][:6])  # all loaded while they take turns
    by = {r["name"]: r for r in rows}
    assert by["a"]["timing"]["iterations"] == 10 and by["a"]["timing"]["round_p50_ms"] == [1.0, 2.0, 1.0]
    assert by["b"]["timing"]["round_p50_ms"] == [2.0, 4.0, 2.0]
    assert by["c"]["status"] == "failed" and by["c"]["reason"] == "round 2: RuntimeError: device lost"
    assert not any(r.loaded for r in (a, b, c))  # every runner released
    md = bench_report.markdown({"model": "m", "cases": [{"batch": 4, "precision": "fp32", "runners": rows}]})
    assert "| a | 1.000 |" in md and "| 1.000-2.000 |" in md and "p50 by round" in md

    class Interrupted(_Turns):
        def time(self, warmup, iters):
            raise KeyboardInterrupt

    stop = Interrupted("stop", 1.0, machine)
    with pytest.raises(KeyboardInterrupt):
        latency.run_all([a, stop, b], [np.zeros((4, 3), "float32")], [np.ones(3, "float32")], Tolerances(),
                      warmup=1, iters=10, rounds=2)
    assert not any(r.loaded for r in (a, stop, b))  # released all the same
    with pytest.raises(ConfigError, match="invalid rounds"):
        latency.run_all([a], [np.zeros((4, 3), "float32")], [np.ones(3, "float32")], Tolerances(),
                      warmup=1, iters=2, rounds=5)

    machine["log"].clear()
    rows = latency.run_all([a, b], [np.zeros((4, 3), "float32")], [np.ones(3, "float32")], Tolerances(),
                         warmup=1, iters=10, rounds=1)
    assert [(n, k) for n, k, _ in machine["log"]] == [("a", 10), ("b", 10)]
    assert machine["log"][1][2] == [False, True, False]  # one at a time: a released before b ran
    assert "round_p50_ms" not in rows[0]["timing"] and "p50 by round" not in bench_report.markdown(
        {"model": "m", "cases": [{"batch": 4, "precision": "fp32", "runners": rows}]})


def test_torch_fp32_is_strict_and_its_switches_are_restored():
    """torch-eager runs with TF32 off (TVM's fp32 is strict); whatever it
    sets around a call is put back, so runners taking turns do not leak it."""
    import torch

    model = lambda: torch.nn.Conv2d(3, 4, 3)  # noqa: E731
    seen = []
    r = bench_runners.TorchRunner("torch-eager", model)
    r.activate([np.zeros((1, 3, 8, 8), "float32")])
    was = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = True, True
    try:
        r.model.register_forward_hook(lambda *_: seen.append((torch.backends.cuda.matmul.allow_tf32,
                                                              torch.backends.cudnn.allow_tf32)))
        r.infer()
        r.time(0, 2)
        assert seen == [(False, False)] * 3 and r.precision == "fp32"
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32  # restored
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = was
    assert bench_runners.TorchRunner("torch-eager-tf32", model, tf32=True).precision == "tf32"  # its own tolerance


def test_report_and_plot_from_a_results_file(tmp_path):
    """A results file as an H200 run writes it, with a TensorRT baseline row."""
    def row(name, kind, p50):
        return {"name": name, "kind": kind, "status": "ok", "reason": None, "setup_s": 1.0, "check": {"passed": True, "rel_l2": 1e-3},
                "timing": bench_runners.percentiles([p50] * 20, 1)}

    report = {"model": "resnet50", "target": {"kind": "cuda"}, "environment": {"gpu": "NVIDIA H200"}, "cases": [{
        "batch": 1, "precision": "fp16", "warmup": 20, "iterations": 20, "runners": [
            row("tvm", "tvm", 2.0), row("torch-compile-max-autotune", "pytorch", 1.0), row("tensorrt-baseline", "tensorrt", 0.5),
            {"name": "tensorrt-fp16", "kind": "tensorrt", "status": "skipped", "reason": "tensorrt is not importable", "setup_s": None,
             "check": None, "timing": None}]}]}
    path = tmp_path / "results.json"
    path.write_text(json.dumps(report))
    bench_report.write(json.loads(path.read_text()), tmp_path / "out")
    md = (tmp_path / "out" / "results.md").read_text()
    assert "| tvm | 2.000 |" in md and "4.00x |" in md  # TVM vs the TensorRT baseline
    assert "vs TensorRT" in md and "skipped: tensorrt is not importable" in md
    png = (tmp_path / "out" / "results.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_cli_bench_refuses_a_baseline_for_another_batch(capsys, tmp_path, tiny_package):
    from deploy import cli

    folder = tiny_package[0]
    p = _baseline(tmp_path, model="tiny_cnn", batch=64, input_shape=[3, 16, 16], precision="fp32")
    rc = cli.main(["bench", "-m", "tiny_cnn", "--target", "llvm", "--buckets", "1,4", "--workdir", str(folder.parent),
                   "--baseline", str(p), "--runners", "tvm", "--iters", "5"])
    err = capsys.readouterr().err
    assert rc == 2 and "batch that is not benchmarked" in err


def test_cli_bench_writes_results(capsys, tmp_path, tiny_package):
    from deploy import cli

    folder = tiny_package[0]
    p = _baseline(tmp_path, model="tiny_cnn", batch=4, input_shape=[3, 16, 16], precision="fp32")
    rc = cli.main(["bench", "-m", "tiny_cnn", "--target", "llvm", "--buckets", "1,4", "--workdir", str(folder.parent),
                   "--baseline", str(p), "--runners", "tvm,onnxruntime", "--iters", "5", "--warmup", "1",
                   "--out", str(tmp_path / "out")])
    assert rc == 0, capsys.readouterr().err
    report = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [c["batch"] for c in report["cases"]] == [1, 4]
    names = [r["name"] for r in report["cases"][1]["runners"]]
    assert names == ["tvm", "onnxruntime-cpu", "tensorrt-10-h200"]
    assert "vs TensorRT" in (tmp_path / "out" / "results.md").read_text()


def test_bench_never_replaces_a_folder_it_did_not_write(tmp_path):
    keep = tmp_path / "mine"
    keep.mkdir()
    (keep / "notes.txt").write_text("keep me")
    report = {"model": "m", "target": {}, "environment": {}, "cases": []}
    with pytest.raises(ConfigError, match="not written by bench"):
        bench_report.write(report, keep)
    assert (keep / "notes.txt").read_text() == "keep me"


def test_unreadable_baseline_files_are_user_errors(tmp_path):
    p = _baseline(tmp_path, times="missing.json", summary=None)
    with pytest.raises(InputFileError, match="unreadable file"):
        trtexec.load_baseline(p, "resnet50", 1, [3, 224, 224], "fp16")
    (tmp_path / "bad.json").write_text("{not json")
    p = _baseline(tmp_path, times="bad.json", summary=None)
    with pytest.raises(InputFileError, match="not valid JSON"):
        trtexec.load_baseline(p, "resnet50", 1, [3, 224, 224], "fp16")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(InputFileError):
        trtexec.parse_trtexec_times(json.loads((tmp_path / "list.json").read_text()))
    (tmp_path / "arr.json").write_text("[]")
    with pytest.raises(InputFileError, match="JSON object"):
        trtexec.load_baseline(tmp_path / "arr.json", "resnet50", 1, [3, 224, 224], "fp16")


def _matmul_onnx(path):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((8, 4)).astype("float32"), "w")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Relu", ["y"], ["z"])],
                          "m", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
                          [helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 4])], [w])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_onnxruntime_fp16_converts_the_model_and_needs_the_cuda_provider(tmp_path):
    import onnx
    import onnxruntime as ort

    path = _matmul_onnx(tmp_path / "m.onnx")
    half = onnx.load_from_string(bench_runners.fp16_by_onnxruntime(path))
    assert half.graph.initializer[0].data_type == onnx.TensorProto.FLOAT16
    assert half.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT  # inputs stay fp32
    x = np.random.default_rng(1).standard_normal((2, 8)).astype("float32")
    got = ort.InferenceSession(half.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert got.dtype == np.float32 and np.allclose(got, want, rtol=1e-2, atol=1e-2)

    (r,) = bench_runners.make_runners(["onnxruntime-fp16"], package=tmp_path, untuned=tmp_path, onnx_path=path,
                                      input_names=["x"], factory=None, precision="fp16", compile_mode="default",
                                      fp16_onnx_path=None)
    # its outputs are checked with the fp16 tolerance (the H200's run called them different at rel_l2 7.8e-4,
    # checked as fp32)
    assert r.precision == "fp16" and bench_runners.ORTRunner(path, ["x"]).precision == "fp32"
    if bench_runners.ort_has_cuda():
        pytest.skip("this onnxruntime has its CUDA provider: the GPU run covers it")
    with pytest.raises(bench_runners.RunnerUnavailable, match="CUDA execution provider \\(onnxruntime-gpu\\)"):
        r.activate([x])
