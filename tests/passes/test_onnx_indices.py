"""deploy/passes/onnx_indices.py: the values an integer input that indexes a
table may take, recorded in the package's manifest and checked on every
request (TVM's gather reads out of bounds where they are not)."""

import json

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

import deploy
from deploy import config, pipeline
from deploy.errors import ShapeError
from deploy.passes import onnx_indices


def _graph(nodes, inputs, tables: dict, outputs=("y",)):
    """A model of `nodes` over int64 `inputs` [2, 3] and float tables {name: shape}."""
    inits = [helper.make_tensor(n, TensorProto.FLOAT, s, np.zeros(s, "float32").ravel().tolist())
             for n, s in tables.items()]
    ins = [helper.make_tensor_value_info(n, t, [2, 3]) for n, t in inputs]
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs]
    return helper.make_model(helper.make_graph(nodes, "g", ins, outs, inits))


I64 = TensorProto.INT64


def test_an_input_that_indexes_a_table_may_take_its_rows():
    m = _graph([helper.make_node("Gather", ["emb", "ids"], ["y"])], [("ids", I64)], {"emb": [100, 8]})
    assert onnx_indices.input_ranges(m) == {"ids": (-100, 100)}


def test_through_casts_and_reshapes_along_the_gathered_axis():
    nodes = [helper.make_node("Cast", ["ids"], ["i32"], to=TensorProto.INT32),
             helper.make_node("Unsqueeze", ["i32", "ax"], ["u"]),
             helper.make_node("Gather", ["emb", "u"], ["y"], axis=1)]
    m = _graph(nodes, [("ids", I64)], {"emb": [8, 30]})
    m.graph.initializer.append(helper.make_tensor("ax", I64, [1], [0]))
    assert onnx_indices.input_ranges(m) == {"ids": (-30, 30)}


def test_the_smallest_of_the_tables_an_input_indexes():
    nodes = [helper.make_node("Gather", ["big", "ids"], ["a"]), helper.make_node("Gather", ["small", "ids"], ["y"])]
    m = _graph(nodes, [("ids", I64)], {"big": [100, 4], "small": [7, 4]})
    assert onnx_indices.input_ranges(m) == {"ids": (-7, 7)}


def test_what_is_not_an_inputs_value_used_as_an_index_is_left_alone():
    nodes = [helper.make_node("Add", ["ids", "one"], ["shifted"]),  # an index computed from the input
             helper.make_node("Gather", ["emb", "shifted"], ["a"]),
             helper.make_node("Cast", ["pos"], ["f"], to=TensorProto.FLOAT),  # (a float: no index)
             helper.make_node("Gather", ["emb", "f"], ["a2"]),
             helper.make_node("Gather", ["mask", "pos"], ["y"]),  # the mask gathered from, not an index
             ]
    m = _graph(nodes, [("ids", I64), ("mask", I64), ("pos", I64)], {"emb": [10, 4]})
    m.graph.initializer.append(helper.make_tensor("one", I64, [], [1]))
    assert onnx_indices.input_ranges(m) == {"pos": (-2, 2)}  # (its table: the mask's first axis, [2, 3])


class _Tagger(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.tokens, self.types = torch.nn.Embedding(50, 8), torch.nn.Embedding(2, 8)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, ids, types):
        return self.head(self.tokens(ids) + self.types(types))


def _export_tagger(path, batch_free: bool = True):
    axes = {"dynamic_axes": {"ids": {0: "n"}, "types": {0: "n"}}} if batch_free else {}
    torch.onnx.export(_Tagger(), (torch.zeros(1, 6, dtype=torch.long), torch.zeros(1, 6, dtype=torch.long)),
                      str(path), opset_version=17, dynamo=False, input_names=["ids", "types"],
                      output_names=["logits"], **axes)


def _tagger_config(path, **model):
    return config.from_dict({
        "model": {"source": str(path), "inputs": [{"name": "ids", "shape": [6], "dtype": "int64"},
                                                  {"name": "types", "shape": [6], "dtype": "int64"}], **model},
        "llvm": {"buckets": [2], "tune_buckets": [2], "trials": 0},
    })


@pytest.fixture(scope="module")
def tagger(tmp_path_factory, llvm_target):
    """A token tagger from a user's ONNX file, through every stage on llvm."""
    work = tmp_path_factory.mktemp("tagger")
    path = work / "tagger.onnx"
    _export_tagger(path)
    summary = pipeline.run(_tagger_config(path), llvm_target, work / "ws", db_root=work / "db")
    assert summary["validation"]["passed"]
    return work / "ws" / "package", path


def test_the_manifest_records_each_inputs_range(tagger):
    m = json.loads((tagger[0] / "manifest.json").read_text())
    assert {i["name"]: i.get("range") for i in m["inputs"]} == {"ids": [-50, 50], "types": [-2, 2]}


@pytest.mark.parametrize("ids, types, got", [(49, 2, "values 0..2"), (50, 0, "values 0..50"), (-51, 0, "values -51..0")])
def test_a_request_outside_a_table_is_one_line(tagger, ids, types, got):
    pred = deploy.load(tagger[0])
    x, t = np.zeros((2, 6), "int64"), np.zeros((2, 6), "int64")
    x[1, 3], t[0, 0] = ids, types
    with pytest.raises(ShapeError, match=f"outside the table it indexes \\| got {got} \\| expected "):
        pred({"ids": x, "types": t})


def test_the_edges_of_a_table_compute_what_onnx_runtime_computes(tagger):
    import onnxruntime as ort

    pred = deploy.load(tagger[0])
    x = np.array([[0, 49, -1, -50, 7, 3], [1, 2, 3, 4, 5, 6]], "int64")
    t = np.array([[0, 1, -1, -2, 0, 1], [1, 1, 0, 0, 1, 0]], "int64")
    ref = ort.InferenceSession(str(tagger[1])).run(None, {"ids": x, "types": t})[0]
    np.testing.assert_allclose(pred({"ids": x, "types": t})["logits"], ref, rtol=1e-5, atol=1e-5)


def test_tvm_still_takes_gather_indices_unchecked():
    """TVM 0.27's importer converts Gather to `take` in "fast" mode, which
    does not check its indices (the reason for this module). Fails once it
    converts it to a mode that does."""
    from deploy.tvm_compat import from_onnx

    m = _graph([helper.make_node("Gather", ["emb", "ids"], ["y"])], [("ids", I64)], {"emb": [100, 8]})
    m.graph.output[0].CopyFrom(helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, 8]))
    onnx.checker.check_model(m)
    mod = from_onnx(m, shape_dict={"ids": [2, 3]}, dtype_dict={"ids": "int64"}, keep_params_in_input=False)
    assert 'mode="fast"' in mod.script()


def test_the_server_answers_an_id_outside_the_table_with_a_400(tagger):
    import httpx

    from deploy.serving import serve

    server = serve.start(config.serve_config(port=0), tagger[0])
    try:
        url = server.url + "/v2/models/tagger/infer"

        def body(ids):
            return {"inputs": [{"name": "ids", "shape": [1, 6], "datatype": "INT64", "data": ids},
                               {"name": "types", "shape": [1, 6], "datatype": "INT64", "data": [0] * 6}]}

        assert httpx.post(url, json=body([1, 2, 3, 4, 5, 49])).status_code == 200
        bad = httpx.post(url, json=body([1, 2, 3, 4, 5, 30522]))
        assert bad.status_code == 400
        assert "input 'ids' has values outside the table it indexes | got values 1..30522" in bad.text
        assert httpx.post(url, json=body([1, 2, 3, 4, 5, 6])).status_code == 200  # (the server still serves)
    finally:
        server.stop()


def test_an_export_from_before_the_ranges_gets_them_from_its_graph(tagger):
    """A workdir's export made before ranges were recorded: the build reads
    them from the graph, so its package still checks."""
    import dataclasses

    from deploy import export

    ex = export.load(tagger[0].parent / "export")
    old = dataclasses.replace(ex, manifest={k: v for k, v in ex.manifest.items() if k != "index_ranges"})
    assert old.index_ranges == ex.index_ranges == {"ids": (-50, 50), "types": (-2, 2)}


def test_a_padding_value_outside_the_table_is_refused(tagger, tmp_path):
    from deploy import export

    def cfg(pad):
        return _tagger_config(tagger[1], dims=[{"name": "seq", "inputs": ["ids", "types"], "buckets": [6], "pad": pad}])

    with pytest.raises(config.ConfigError, match="pad 2 is outside the table input 'types' indexes"):
        export.run(cfg(2), tmp_path / "bad")
    assert not (tmp_path / "bad").exists()
    assert export.run(cfg(1), tmp_path / "ok").index_ranges["types"] == (-2, 2)


def test_a_fixed_batch_graph_with_a_small_table_is_still_made_batch_free(tmp_path):
    """export.symbolic_batch runs the graph in ONNX Runtime on random ids:
    inside the tables (a 2-row token-type table refused ids up to 9)."""
    from deploy import export

    path = tmp_path / "fixed.onnx"
    _export_tagger(path, batch_free=False)
    inputs = (config.InputSpec("ids", (6,), "int64"), config.InputSpec("types", (6,), "int64"))
    assert export.symbolic_batch(onnx.load(str(path)), inputs, 1) is not None


def test_a_package_from_before_the_check_says_so_once_at_load(tagger, tmp_path, caplog):
    """A package built before any range was recorded (no "input_ranges" in
    its manifest, no input with a "range") still loads and runs, with one
    warning that its ids are not checked; this build's package, and one
    from between (ranges, no key), load without it."""
    import logging
    import shutil

    assert json.loads((tagger[0] / "manifest.json").read_text())["input_ranges"] is True
    between, old = tmp_path / "between", tmp_path / "old"
    for folder, strip_ranges in ((between, False), (old, True)):
        shutil.copytree(tagger[0], folder)
        m = json.loads((folder / "manifest.json").read_text())
        del m["input_ranges"]
        for i in m["inputs"]:
            if strip_ranges:
                i.pop("range")
        (folder / "manifest.json").write_text(json.dumps(m))
    with caplog.at_level(logging.WARNING, logger="deploy"):
        deploy.load(tagger[0])
        deploy.load(between)
        assert "predates the check" not in caplog.text
        pred = deploy.load(old)
        x = np.zeros((2, 6), "int64")
        assert pred({"ids": x, "types": x})["logits"].shape == (2, 6, 3)
    assert caplog.text.count("predates the check of integer inputs") == 1  # (at load, not at each call)
