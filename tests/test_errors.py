"""Bad input: a one-line error, a non-zero exit, nothing half-written."""

import json
import shutil

import onnx
import pytest
import torch
from onnx import TensorProto, helper

import deploy
import models
from deploy import artifacts, cli
from deploy.errors import BuildError, StaleArtifactError

from .conftest import HAS_GPU


def run_cli(capsys, *argv):
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


def export_tiny(path, input_name="x", open_size=False):
    model = models.build("tiny_cnn", seed=0)
    axes = {0: "n", 2: "h", 3: "w"} if open_size else {0: "n"}
    torch.onnx.export(model, (torch.randn(1, 3, 16, 16),), str(path), opset_version=17, dynamo=False,
                      input_names=[input_name], output_names=["y"], dynamic_axes={input_name: axes})


def test_missing_onnx_file(capsys, tmp_path):
    rc, _, err = run_cli(capsys, "export", "-m", tmp_path / "missing.onnx", "--workdir", tmp_path / "ws")
    assert rc == 2 and "ONNX file not found" in error_line(err)
    assert not (tmp_path / "ws").exists()


def test_corrupt_onnx_file(capsys, tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x08\x07this is not a protobuf" * 10)
    rc, _, err = run_cli(capsys, "export", "-m", bad, "--input", "x:3x16x16", "--workdir", tmp_path / "ws")
    assert rc == 2 and "corrupt or invalid ONNX file" in error_line(err)
    assert not list((tmp_path / "ws").glob("export*")) if (tmp_path / "ws").exists() else True


def test_unsupported_operators_are_listed_with_counts(capsys, tmp_path):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])
    nodes = [
        helper.make_node("Relu", ["x"], ["a"]),
        helper.make_node("Swizzle", ["a"], ["b"], domain="com.example"),
        helper.make_node("Swizzle", ["b"], ["c"], domain="com.example"),
        helper.make_node("Swish", ["c"], ["y"]),
    ]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 24), helper.make_opsetid("com.example", 1)])
    path = tmp_path / "ops.onnx"
    onnx.save(model, str(path))
    ws = tmp_path / "ws"
    assert run_cli(capsys, "export", "-m", path, "--input", "x:4", "--workdir", ws)[0] == 0
    rc, _, err = run_cli(capsys, "frontend", "-m", path, "--input", "x:4", "--workdir", ws, "--target", "llvm")
    line = error_line(err)
    assert rc == 2
    assert "2 ONNX operator type(s)" in line and "com.example.Swizzle x2" in line and "Swish x1" in line
    assert not (ws / "frontend").exists()


def _shape_decided_if(path):
    """y = Relu(x) if x.shape[1] > 0 else Neg(x): an If whose condition the
    static shapes decide (DeBERTa's TorchScript helpers export such If
    nodes, which TVM's importer does not convert)."""
    branch = [helper.make_graph([helper.make_node(op, ["x"], [out])], out, [],
                                [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)])
              for op, out in (("Relu", "t"), ("Neg", "e"))]
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Gather", ["s", "one"], ["d"], axis=0),
             helper.make_node("Greater", ["d", "zero"], ["c"]),
             helper.make_node("If", ["c"], ["y"], then_branch=branch[0], else_branch=branch[1])]
    inits = [helper.make_tensor("one", TensorProto.INT64, [], [1]), helper.make_tensor("zero", TensorProto.INT64, [], [0])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


def test_an_if_that_static_shapes_decide_is_not_refused(capsys, tmp_path):
    path = tmp_path / "if.onnx"
    _shape_decided_if(path)
    ws = tmp_path / "ws"
    assert run_cli(capsys, "export", "-m", path, "--input", "x:4", "--workdir", ws)[0] == 0
    rc, _, err = run_cli(capsys, "frontend", "-m", path, "--input", "x:4", "--workdir", ws, "--target", "llvm",
                         "--buckets", "1,2")
    assert rc == 0, err
    m = json.loads((ws / "frontend" / "manifest.json").read_text())
    assert m["onnx_ops"]["If"] == 1 and m["simplified"]["2"]["nodes_after"] == 1


@pytest.mark.parametrize(
    "spec, message",
    [("x:3x8x8", "dim 2 of input 'x'"), ("x:3x16x16:int64", "dtype of input 'x'"),
     ("x:16x16", "rank of input 'x'"), ("z:3x16x16", "input names do not match"), ("x:3xAx16", "invalid --input")],
)
def test_wrong_shapes_dtypes_and_names(capsys, tmp_path, spec, message):
    path = tmp_path / "net.onnx"
    export_tiny(path)
    rc, _, err = run_cli(capsys, "export", "-m", path, "--input", spec, "--workdir", tmp_path / "ws")
    assert rc == 2 and message in error_line(err)
    assert not (tmp_path / "ws" / "export").exists()


def test_onnx_without_inputs_names_them(capsys, tmp_path):
    """Undeclared inputs are read from the graph (tests/test_onnx_inputs.py);
    where the graph leaves an image's size open, the line names the input."""
    path = tmp_path / "net.onnx"
    export_tiny(path, input_name="pixels", open_size=True)
    rc, _, err = run_cli(capsys, "export", "-m", path, "--workdir", tmp_path / "ws")
    line = error_line(err)
    assert rc == 2 and "ONNX input 'pixels' leaves a shape past the batch open" in line
    assert line.endswith("for each of its inputs: pixels")
    assert not (tmp_path / "ws" / "export").exists()


def test_bad_config_file(capsys, tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[model]\nsource = "tiny_cnn"\n[llvm]\nbucket = [1]\n')
    rc, _, err = run_cli(capsys, "run", "-m", "tiny_cnn", "--config", cfg, "--workdir", tmp_path / "ws")
    assert rc == 2 and "did you mean 'buckets'" in error_line(err)


def test_unknown_model_and_bad_flags(capsys, tmp_path):
    rc, _, err = run_cli(capsys, "run", "-m", "resnet5", "--workdir", tmp_path / "ws")
    assert rc == 2 and "did you mean 'resnet50'" in error_line(err)
    rc, _, err = run_cli(capsys, "run", "-m", "tiny_cnn", "--buckets", "1,x", "--workdir", tmp_path / "ws")
    assert rc == 2 and "--buckets" in error_line(err)
    rc, _, err = run_cli(capsys, "run", "-m", "tiny_cnn", "--precision", "int4", "--workdir", tmp_path / "ws")
    assert rc == 2 and "fp32 or fp16" in error_line(err)
    rc, _, err = run_cli(capsys, "run", "-m", "tiny_cnn", "--budget", "soon", "--workdir", tmp_path / "ws")
    assert rc == 2 and "duration" in error_line(err)
    rc, _, err = run_cli(capsys, "run", "-m", "tiny_cnn", "--checkpoint", tmp_path / "none.pt", "--workdir", tmp_path / "ws")
    assert rc == 2 and "checkpoint not found" in error_line(err)
    assert not (tmp_path / "ws" / "export").exists()


@pytest.mark.skipif(HAS_GPU, reason="checks the no-GPU message")
def test_cuda_without_gpu(capsys, tmp_path):
    rc, _, err = run_cli(capsys, "run", "-m", "tiny_cnn", "--target", "cuda", "--workdir", tmp_path / "ws")
    assert rc == 2 and "no CUDA GPU" in error_line(err)


def test_stage_without_predecessor(capsys, tmp_path):
    rc, _, err = run_cli(capsys, "optimize", "-m", "tiny_cnn", "--target", "llvm", "--workdir", tmp_path / "ws")
    assert rc == 2 and "no export artifact" in error_line(err) and "run it first" in error_line(err)


def test_tampered_package_is_never_loaded(capsys, tmp_path, tiny_package):
    pkg = tmp_path / "pkg"
    shutil.copytree(tiny_package[0], pkg)
    with open(pkg / "b1.so", "ab") as f:
        f.write(b"\0")
    with pytest.raises(StaleArtifactError, match="b1.so"):
        deploy.load(pkg)
    rc, _, err = run_cli(capsys, "info", pkg)
    assert rc == 2 and "does not match its manifest" in error_line(err)
    (pkg / "manifest.json").unlink()
    with pytest.raises(StaleArtifactError, match="did not finish"):
        deploy.load(pkg)


def test_package_from_another_tvm_is_refused(tmp_path, tiny_package):
    pkg = tmp_path / "pkg"
    shutil.copytree(tiny_package[0], pkg)
    m = json.loads((pkg / "manifest.json").read_text())
    m["versions"]["tvm"] = "0.26.0"
    (pkg / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(StaleArtifactError, match="another TVM version"):
        deploy.load(pkg)


def test_interrupted_stage_leaves_previous_artifact(tmp_path):
    final = tmp_path / "stage"
    with artifacts.staged_dir(final) as d:
        (d / "a.txt").write_text("old")
        artifacts.write_manifest(d, "demo", {})
    with pytest.raises(KeyboardInterrupt):
        with artifacts.staged_dir(final) as d:
            (d / "a.txt").write_text("half")
            raise KeyboardInterrupt
    assert (final / "a.txt").read_text() == "old"
    assert artifacts.read_manifest(final, "demo")["stage"] == "demo"
    assert [p.name for p in tmp_path.iterdir()] == ["stage"]


def test_frontend_artifact_from_another_onnx_is_stale(tmp_path, tiny_package):
    from deploy import export, frontend

    ws = tiny_package[0].parent
    other = tmp_path / "export"
    shutil.copytree(ws / "export", other)
    with open(other / "model.onnx", "ab") as f:
        f.write(b"\0")
    m = json.loads((other / "manifest.json").read_text())
    m["files"]["model.onnx"] = artifacts.sha256_file(other / "model.onnx")
    (other / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(StaleArtifactError, match="another ONNX file"):
        frontend.load(ws / "frontend", export.load(other))


def test_unsupported_ops_against_tvms_convert_map():
    import collections

    from deploy.frontend import unsupported_ops

    assert unsupported_ops(collections.Counter({("ai.onnx", "Conv"): 3})) == {}
    assert unsupported_ops(collections.Counter({("ai.onnx", "LSTM"): 2, ("ai.onnx", "Loop"): 1})) == {"LSTM": 2, "Loop": 1}


def _fails_on_two(n):
    if n == 2:
        try:
            raise ValueError("deep inside TVM")
        except ValueError as e:
            raise BuildError("build: bucket 2 failed") from e
    return n * 10


def test_a_worker_processes_failure_keeps_its_line_and_its_trace(tmp_path):
    """A failure in a worker process (buckets built or imported in parallel)
    is the same one-line error here, and the stage's log holds the worker's
    trace."""
    from deploy.errors import WorkerTrace, run_in_processes
    from deploy.pipeline import stage_guard

    assert run_in_processes(_fails_on_two, [1, 3], 2) == [10, 30]
    with pytest.raises(BuildError, match="full trace in") as info:
        with stage_guard(tmp_path, "build"):
            run_in_processes(_fails_on_two, [1, 2], 2)
    assert str(info.value).startswith("build: bucket 2 failed | full trace in")
    log = (tmp_path / "logs" / "build.log").read_text()
    assert "ValueError: deep inside TVM" in log and WorkerTrace.__name__ in log
