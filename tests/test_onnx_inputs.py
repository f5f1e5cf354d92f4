"""ONNX files as users bring them: weights in an external data file (what
torch's dynamo exporter writes, and any model over 2 GB needs), and a batch
fixed at export (torch.onnx.export without dynamic_axes)."""

import json

import onnx
import pytest
import torch

from deploy import config, export, pipeline
from deploy.errors import InputFileError, ShapeError


class Net(torch.nn.Module):
    def __init__(self, hard_coded_batch: bool = False):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.fc = torch.nn.Linear(8 * 8 * 8, 5)
        self.hard = hard_coded_batch

    def forward(self, x):
        y = torch.relu(self.conv(x))
        y = y.reshape(1, -1) if self.hard else y.flatten(1)
        return self.fc(y)


def _export(path, dynamic: bool, hard: bool = False):
    torch.manual_seed(0)
    torch.onnx.export(Net(hard).eval(), (torch.randn(1, 3, 8, 8),), str(path), opset_version=17, dynamo=False,
                      input_names=["x"], output_names=["y"],
                      dynamic_axes={"x": {0: "n"}, "y": {0: "n"}} if dynamic else None)
    return path


def _cfg(path, buckets):
    return config.from_dict({"model": {"source": str(path), "inputs": [{"name": "x", "shape": [3, 8, 8]}]},
                             "llvm": {"buckets": buckets, "tune_buckets": [], "trials": 0}})


def _external(tmp_path):
    src = _export(tmp_path / "inline.onnx", dynamic=True)
    model = onnx.load(str(src))
    dest = tmp_path / "user" / "net.onnx"
    dest.parent.mkdir()
    onnx.save(model, str(dest), save_as_external_data=True, all_tensors_to_one_file=True,
              location="net.onnx.data", size_threshold=0)
    assert (dest.parent / "net.onnx.data").stat().st_size > 1000
    return dest


def test_external_data_through_every_stage(tmp_path, llvm_target):
    path = _external(tmp_path)
    summary = pipeline.run(_cfg(path, [1, 3]), llvm_target, tmp_path / "ws", db_root=tmp_path / "db")
    assert summary["validation"]["passed"]
    m = json.loads((tmp_path / "ws" / "export" / "manifest.json").read_text())
    assert m["external_data"] is False  # small enough: saved with its weights inline, hashed as one file
    assert set(m["files"]) == {"model.onnx"}


def test_a_model_over_the_protobuf_limit_keeps_its_data_file(tmp_path, llvm_target, monkeypatch):
    """Above 2 GB (the limit lowered here) the export folder holds the graph
    and one data file, both hashed; every later stage reads them."""
    monkeypatch.setattr(export, "PROTOBUF_LIMIT", 1000)
    path = _external(tmp_path)
    summary = pipeline.run(_cfg(path, [2]), llvm_target, tmp_path / "ws", db_root=tmp_path / "db")
    assert summary["validation"]["passed"]
    m = json.loads((tmp_path / "ws" / "export" / "manifest.json").read_text())
    assert m["external_data"] is True and set(m["files"]) == {"model.onnx", export.DATA_FILE}
    (tmp_path / "ws" / "export" / export.DATA_FILE).write_bytes(b"tampered")
    with pytest.raises(Exception, match="sha256|changed|modified|tamper"):
        export.load(tmp_path / "ws" / "export")


def test_missing_external_data_is_one_line(tmp_path):
    path = _external(tmp_path)
    (path.parent / "net.onnx.data").unlink()
    with pytest.raises(InputFileError, match="external data .* is missing") as e:
        export.run(_cfg(path, [1]), tmp_path / "export")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "export").exists()


def test_fixed_batch_is_made_symbolic_when_the_graph_allows(tmp_path, llvm_target):
    path = _export(tmp_path / "fixed.onnx", dynamic=False)
    summary = pipeline.run(_cfg(path, [1, 4]), llvm_target, tmp_path / "ws", db_root=tmp_path / "db")
    assert summary["validation"]["passed"]
    m = json.loads((tmp_path / "ws" / "export" / "manifest.json").read_text())
    assert m["fixed_batch"] is None and m["origin"]["batch"] == "made symbolic (was fixed at 1)"


def test_a_graph_that_hard_codes_its_batch_builds_that_bucket_only(tmp_path, llvm_target):
    path = _export(tmp_path / "hard.onnx", dynamic=False, hard=True)
    with pytest.raises(ShapeError, match="batch is fixed at 1") as e:
        pipeline.run(_cfg(path, [1, 4]), llvm_target, tmp_path / "ws", db_root=tmp_path / "db")
    assert "BUCKETS=1" in str(e.value) and "\n" not in str(e.value)
    summary = pipeline.run(_cfg(path, [1]), llvm_target, tmp_path / "ws2", db_root=tmp_path / "db")
    assert summary["validation"]["passed"]


def test_an_operator_the_importer_refuses_is_one_line_naming_it(tmp_path, capsys):
    """Pads computed from the data (no simplification can fold them): TVM's
    importer prints the operator's inputs and raises; the run prints one
    line naming the stage, the operator and TVM's message, the trace in a log."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    from deploy import cli

    nodes = [helper.make_node("Abs", ["x"], ["a"]), helper.make_node("ReduceMax", ["a"], ["m"], keepdims=0),
             helper.make_node("Ceil", ["m"], ["c"]), helper.make_node("Cast", ["c"], ["ci"], to=TensorProto.INT64),
             helper.make_node("Unsqueeze", ["ci", "ax"], ["cu"]), helper.make_node("Tile", ["cu", "reps"], ["pads"]),
             helper.make_node("Pad", ["x", "pads"], ["y"])]
    inits = [numpy_helper.from_array(np.array([0], "int64"), "ax"), numpy_helper.from_array(np.array([8], "int64"), "reps")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 4, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", "c", "h", "w"])], inits)
    path = tmp_path / "dynpad.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    ws = tmp_path / "ws"
    rc = cli.main(["run", "-m", str(path), "--input", "x:3x4x4", "--target", "llvm", "--buckets", "1",
                   "--trials", "0", "--workdir", str(ws)])
    out, err = capsys.readouterr()
    assert rc == 2
    (line,) = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert "frontend: TVM's ONNX importer failed on bucket 1 at operator Pad: ValueError: Dynamic pads" in line
    assert "full trace in" in line and (ws / "logs" / "frontend.log").is_file()
    assert "Error converting operator" not in out + err


def test_inputs_left_out_of_the_config_are_read_from_a_graph_that_fixes_them(tmp_path):
    """torch.onnx.export with dynamic axes on the batch only (or none) fixes
    every other dimension: the config need not repeat them."""
    from deploy.errors import ConfigError

    def cfg_for(path):
        return config.from_dict({"model": {"source": str(path)},
                                 "llvm": {"buckets": [1], "tune_buckets": [], "trials": 0}})

    want = (config.InputSpec("x", (3, 8, 8), "float32"),)
    assert export.run(cfg_for(_export(tmp_path / "net.onnx", dynamic=True)), tmp_path / "e1").inputs == want
    # no dynamic axes at all: the batch fixed at 1 is made symbolic, as with declared inputs
    art = export.run(cfg_for(_export(tmp_path / "fixed.onnx", dynamic=False)), tmp_path / "e2")
    assert art.inputs == want
    m = json.loads((tmp_path / "e2" / "manifest.json").read_text())
    assert m["fixed_batch"] is None and m["origin"]["batch"] == "made symbolic (was fixed at 1)"
    # a dimension past the batch left open in the graph: one line naming the input and its dims
    model = onnx.load(str(tmp_path / "net.onnx"))
    model.graph.input[0].type.tensor_type.shape.dim[2].dim_param = "h"
    onnx.save(model, str(tmp_path / "open.onnx"))
    with pytest.raises(ConfigError, match=r"ONNX input 'x' leaves a shape past the batch open") as e:
        export.run(cfg_for(tmp_path / "open.onnx"), tmp_path / "e3")
    assert "got ['n', 3, 'h', 8]" in str(e.value) and str(e.value).endswith("for each of its inputs: x")
    assert "\n" not in str(e.value) and not (tmp_path / "e3").exists()


def test_a_graph_input_the_config_could_not_describe_is_one_line(tmp_path):
    """An element type the pipeline does not take, or a scalar input (no
    batch axis): named, whether the inputs are declared or not."""
    from onnx import TensorProto, helper

    for name, elem, shape, message in (("u8", TensorProto.UINT8, [1, 4], "element type .* UINT8"),
                                       ("s", TensorProto.FLOAT, [], "is a scalar: it has no batch axis")):
        graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                                  [helper.make_tensor_value_info("x", elem, shape)],
                                  [helper.make_tensor_value_info("y", elem, shape)])
        path = tmp_path / f"{name}.onnx"
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
        cfg = config.from_dict({"model": {"source": str(path)}, "llvm": {"buckets": [1], "trials": 0}})
        with pytest.raises(ShapeError, match=message) as e:
            export.run(cfg, tmp_path / f"e-{name}")
        assert "\n" not in str(e.value) and not (tmp_path / f"e-{name}").exists()
