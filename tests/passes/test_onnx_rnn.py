"""passes/onnx_rnn.py: LSTM, GRU and RNN nodes unrolled into ONNX operators
compute what ONNX Runtime computes for the nodes themselves, over every
attribute the rewrite takes; and what it refuses, it refuses in one line."""

import itertools
import re

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from deploy.errors import UnsupportedOperatorError
from deploy.passes import onnx_rnn

SEQ, BATCH, INPUT, HIDDEN = 5, 3, 4, 6


def _model(op, direction="forward", layout=0, initial=False, peephole=False, lens=False, opset=17, seq=SEQ,
           **attrs):
    """One recurrent node over input x, every output a graph output."""
    rng = np.random.default_rng(0)
    gates, dirs = onnx_rnn.OPS[op], 2 if direction == "bidirectional" else 1
    w = {"W": rng.normal(0, 0.5, (dirs, gates * HIDDEN, INPUT)),
         "R": rng.normal(0, 0.5, (dirs, gates * HIDDEN, HIDDEN)),
         "B": rng.normal(0, 0.5, (dirs, 2 * gates * HIDDEN))}
    state = [BATCH, dirs, HIDDEN] if layout else [dirs, BATCH, HIDDEN]
    if initial:
        w["h0"] = rng.normal(0, 0.5, state)
        if op == "LSTM":
            w["c0"] = rng.normal(0, 0.5, state)
    if peephole:
        w["P"] = rng.normal(0, 0.5, (dirs, 3 * HIDDEN))
    inits = [numpy_helper.from_array(v.astype(np.float32), k) for k, v in w.items()]
    if lens:
        inits.append(numpy_helper.from_array(np.full(BATCH, seq, np.int32), "lens"))
    names = ["x", "W", "R", "B", "lens" if lens else "", "h0" if initial else "", "c0" if initial else "",
             "P" if peephole else ""]
    names = names[: 6 if op != "LSTM" else 8]
    outs = ["y", "y_h"] + (["y_c"] if op == "LSTM" else [])
    node = helper.make_node(op, names, outs, name="rnn", hidden_size=HIDDEN, direction=direction,
                            **({"layout": layout} if layout else {}), **attrs)
    x_shape = [BATCH, seq, INPUT] if layout else [seq, BATCH, INPUT]
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, shape) for o, shape in
                               zip(outs, [[BATCH, seq, dirs, HIDDEN] if layout else [seq, dirs, BATCH, HIDDEN],
                                          state, state])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), x_shape


def _run(model, x):
    import onnxruntime as ort

    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})


def _without(model, attribute: str):
    """A copy of `model` whose (first) node lacks that attribute."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    kept = [a for a in out.graph.node[0].attribute if a.name != attribute]
    del out.graph.node[0].attribute[:]
    out.graph.node[0].attribute.extend(kept)
    return out


def _inputs(x_shape):
    return np.random.default_rng(1).normal(0, 1, x_shape).astype(np.float32)


def _assert_computes(rewritten, model, x):
    """The rewrite's outputs are the node's (`_reference`), every one."""
    for want, got in zip(_reference(model, x), _run(rewritten, x), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _reference(model, x):
    """ONNX Runtime's outputs of the node; for layout 1 (batch first), which
    it does not run, those of the same node at layout 0 over x transposed,
    transposed back."""
    node = model.graph.node[0]
    if not any(a.name == "layout" and a.i == 1 for a in node.attribute):
        return _run(model, x)
    twin = _without(model, "layout")
    for t in twin.graph.initializer:
        if t.name in ("h0", "c0"):
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).transpose(1, 0, 2).copy(), t.name))
    for vi in (*twin.graph.input, *twin.graph.output):
        vi.type.tensor_type.ClearField("shape")
    y, *states = _run(twin, x.transpose(1, 0, 2).copy())
    return [y.transpose(2, 0, 1, 3)] + [s.transpose(1, 0, 2) for s in states]


def _check(model, x_shape):
    rewritten, counts = onnx_rnn.decompose(model, {"x": x_shape})
    assert counts == {model.graph.node[0].op_type: 1}
    assert not onnx_rnn.recurrent_nodes(rewritten.graph)
    parts = {"Split": lambda n: len(n.output), "Concat": lambda n: len(n.input)}
    assert all(parts[n.op_type](n) <= onnx_rnn.GROUP for n in rewritten.graph.node if n.op_type in parts)
    onnx.checker.check_model(rewritten)
    _assert_computes(rewritten, model, _inputs(x_shape))


CASES = [  # (op, attributes)
    *[(op, dict(direction=d, layout=lay, initial=i)) for op, d, lay, i in
      itertools.product(["LSTM", "GRU", "RNN"], ["forward", "reverse", "bidirectional"], [0, 1], [False, True])],
    ("LSTM", dict(peephole=True, initial=True)),
    ("LSTM", dict(peephole=True, direction="bidirectional")),
    ("GRU", dict(linear_before_reset=1, initial=True)),
    ("GRU", dict(linear_before_reset=1, direction="bidirectional")),
    ("LSTM", dict(clip=0.5, initial=True)),
    ("GRU", dict(clip=0.5, initial=True)),
    ("RNN", dict(activations=["Relu"], initial=True)),
    ("RNN", dict(activations=["Sigmoid", "Relu"], direction="bidirectional")),
    ("LSTM", dict(activations=["Sigmoid", "Relu", "Tanh"], initial=True)),
    ("GRU", dict(activations=["Tanh", "Sigmoid"], initial=True)),
    ("LSTM", dict(lens=True, initial=True)),
    ("GRU", dict(opset=11, direction="bidirectional", initial=True)),
    # longer than one Split or Concat takes (onnx_rnn.GROUP): in two and three levels
    ("LSTM", dict(seq=37, direction="bidirectional", layout=1)),
    ("GRU", dict(seq=300, linear_before_reset=1, opset=11)),
    ("RNN", dict(seq=16, direction="reverse")),
]


@pytest.mark.parametrize("op, attrs", CASES, ids=[f"{op}-{a}" for op, a in CASES])
def test_rewrite_computes_what_onnxruntime_computes(op, attrs):
    _check(*_model(op, **attrs))


@pytest.mark.parametrize("attrs, message", [
    (dict(activations=["HardSigmoid", "Tanh", "Tanh"]), "activations"),
    (dict(activations=["Sigmoid", "Tanh", "Tanh"], direction="bidirectional"), "3 activations for 2 direction(s)"),
    (dict(opset=10), "opset 10 (the rewrite needs opset 11 or later)"),
    (dict(activations=["Sigmoid", "Tanh", "Tanh"], activation_alpha=[0.1]), "activation_alpha"),
    (dict(input_forget=1), "input_forget=1"),
])
def test_refused_in_one_line(attrs, message):
    model, x_shape = _model("LSTM", **attrs)
    with pytest.raises(UnsupportedOperatorError) as refused:  # (the frontend's early check)
        onnx_rnn.check(model)
    line = str(refused.value)
    assert line.startswith("1 recurrent node(s) cannot be rewritten for TVM: LSTM 'rnn' with ") and message in line
    with pytest.raises(UnsupportedOperatorError, match=re.escape(message)):
        onnx_rnn.decompose(model, {"x": x_shape})


def test_shorter_sequences_refused():
    model, x_shape = _model("GRU", lens=True)
    lens = next(t for t in model.graph.initializer if t.name == "lens")
    lens.CopyFrom(numpy_helper.from_array(np.array([SEQ, 2, SEQ], np.int32), "lens"))
    with pytest.raises(UnsupportedOperatorError, match="shorter than the input's 5 steps"):
        onnx_rnn.decompose(model, {"x": x_shape})


def test_dynamic_sequence_length_refused():
    model, _ = _model("RNN")
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "seq"
    with pytest.raises(UnsupportedOperatorError, match="sequence length must be static"):
        onnx_rnn.decompose(model, {})


def test_tvm_has_no_rnn_converters():
    """The workaround's reason: fails once TVM's Relax ONNX frontend converts
    these operators itself (then compare its converters and drop ours)."""
    from deploy.tvm_compat import onnx_frontend

    assert not set(onnx_rnn.OPS) & set(onnx_frontend._get_convert_map())


def test_refused_node_is_one_line_at_the_frontend(capsys, tmp_path):
    from tests.test_errors import error_line, run_cli

    lstm, _ = _model("LSTM", activations=["Sigmoid", "Softsign", "Tanh"])
    node = lstm.graph.node[0]
    node.input[0], node.output[0], node.output[2] = "x_seq", "", ""
    nodes = [helper.make_node("Transpose", ["x"], ["x_seq"], perm=[1, 0, 2]), node,
             helper.make_node("Transpose", ["y_h"], ["out"], perm=[1, 0, 2])]  # batch first, as PyTorch exports
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", SEQ, INPUT])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["n", 1, HIDDEN])],
                              list(lstm.graph.initializer))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / "lstm.onnx"
    onnx.save(model, str(path))
    ws = tmp_path / "ws"
    assert run_cli(capsys, "export", "-m", path, "--input", f"x:{SEQ}x{INPUT}", "--workdir", ws)[0] == 0
    rc, _, err = run_cli(capsys, "frontend", "-m", path, "--input", f"x:{SEQ}x{INPUT}", "--workdir", ws,
                         "--target", "llvm")
    assert rc == 2
    assert "1 recurrent node(s) cannot be rewritten for TVM: LSTM 'rnn' with activations" in error_line(err)
    assert not (ws / "frontend").exists()


@pytest.mark.filterwarnings("ignore:Exporting a model to ONNX with a batch_size")
@pytest.mark.parametrize("make", [
    lambda: torch.nn.RNN(4, 6, num_layers=2, nonlinearity="relu", bidirectional=True, batch_first=True),
    lambda: torch.nn.LSTM(4, 6, batch_first=True, bidirectional=True),
    lambda: torch.nn.GRU(4, 6, num_layers=2),
], ids=["rnn-relu-bidirectional", "lstm-bidirectional", "gru-seq-first"])
def test_pytorch_export_rewritten_matches_pytorch(make, tmp_path):
    """torch.nn's recurrent modules as PyTorch exports them (initial states
    made in the graph, which onnxslim folds for a static batch; here the
    shape inference of the rewrite sees them as they are)."""
    torch.manual_seed(0)
    net = make().eval()
    x = torch.randn(3, SEQ, 4)
    path = tmp_path / "net.onnx"
    torch.onnx.export(net, (x,), str(path), opset_version=17, dynamo=False, input_names=["x"])
    model = onnx.load(str(path))
    rewritten, counts = onnx_rnn.decompose(model, {"x": list(x.shape)})
    assert sum(counts.values()) >= 1 and not onnx_rnn.recurrent_nodes(rewritten.graph)
    want = net(x)[0].detach().numpy()
    np.testing.assert_allclose(_run(rewritten, x.numpy())[0], want, rtol=1e-4, atol=1e-5)


def _weights_concatenated(model):
    """W made in the graph from two halves, as torch's dynamo exporter makes
    a large LSTM's weights (onnxslim folds them at static shapes)."""
    w = next(t for t in model.graph.initializer if t.name == "W")
    halves = np.split(numpy_helper.to_array(w), 2, axis=1)
    kept = [t for t in model.graph.initializer if t.name != "W"]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept + [numpy_helper.from_array(h, f"W{k}") for k, h in enumerate(halves)])
    model.graph.node.insert(0, helper.make_node("Concat", ["W0", "W1"], ["W"], axis=1))
    return model


def test_weights_computed_in_the_graph_are_refused_only_if_still_there_once_simplified():
    import onnxslim

    model, x_shape = _model("LSTM", initial=True)
    model = _weights_concatenated(model)
    onnx_rnn.check(model)  # (the frontend's early check: no refusal)
    with pytest.raises(UnsupportedOperatorError, match="LSTM 'rnn' with its W weights computed in the graph"):
        onnx_rnn.decompose(model, {"x": x_shape})
    rewritten, _ = onnx_rnn.decompose(onnxslim.slim(model), {"x": x_shape})
    _assert_computes(rewritten, model, _inputs(x_shape))


def test_weights_read_elsewhere_stay_and_the_rest_go_with_their_graph_inputs():
    """An initializer another node reads (here a graph output made from R)
    is kept; W and B, also listed as graph inputs (as exporters before IR 4
    did), go from both lists."""
    model, x_shape = _model("GRU", initial=True)
    model.graph.node.append(helper.make_node("Identity", ["R"], ["r_out"]))
    model.graph.output.append(helper.make_tensor_value_info("r_out", TensorProto.FLOAT, None))
    model.graph.input.extend(helper.make_tensor_value_info(t.name, TensorProto.FLOAT, list(t.dims))
                             for t in model.graph.initializer if t.name in ("W", "B"))
    rewritten, _ = onnx_rnn.decompose(model, {"x": x_shape})
    names = {t.name for t in rewritten.graph.initializer}
    assert "R" in names and not {"W", "B"} & names
    assert [i.name for i in rewritten.graph.input] == ["x"]


def test_hidden_size_taken_from_r_when_absent():
    model, x_shape = _model("RNN", initial=True)
    rewritten, _ = onnx_rnn.decompose(_without(model, "hidden_size"), {"x": x_shape})
    _assert_computes(rewritten, model, _inputs(x_shape))  # (ONNX Runtime itself needs hidden_size)
