"""LSTM, GRU and RNN nodes rewritten as the ONNX operators they are made of,
unrolled over the sequence.

A workaround: TVM 0.27's Relax ONNX frontend has no converter for these
three operators (nor has apache/tvm's main branch as of 2026-08), so every
model with a `torch.nn.LSTM`, `GRU` or `RNN` stopped at the frontend with
"not supported by TVM's ONNX frontend". The frontend stage runs this on each
bucket's graph once its shapes are static (after onnxslim), before TVM
imports it; tests/passes/test_onnx_rnn.py::test_tvm_has_no_rnn_converters
fails once TVM converts them itself.

Each direction of a recurrent node becomes:
- one MatMul of the whole sequence with the input weights and both biases
  added (`[S, B, I] x [I, gates*H]`: every step's input projection at once);
- per step, in the direction's order: the recurrent MatMul with the
  previous hidden state and the gates' elementwise operators (the optimize
  stage fuses them into the MatMul's epilogue);
- the steps' hidden states concatenated into Y, the last ones into Y_h
  (and Y_c), in the node's `layout`.
Equations, gate order and defaults are the ONNX operators' (LSTM-14, GRU-14,
RNN-14): peepholes, `clip`, `linear_before_reset`, initial states, forward,
reverse and bidirectional. ONNX Runtime runs the original and the rewritten
graph alike in the tests.

Shape-specialised, like the package: the sequence length must be static
(the batch need not be). Refused with a one-line UnsupportedOperatorError:
before any bucket is imported (`check`), activations other than Sigmoid,
Tanh and Relu (or with alpha/beta), `input_forget`, and opsets before 11;
in each bucket's simplified graph (`decompose`), weights computed in the
graph and per-sequence lengths other than the full one.
"""

from __future__ import annotations

import collections

import numpy as np

OPS = {"LSTM": 4, "GRU": 3, "RNN": 1}  # operator: gates
DEFAULT_ACTIVATIONS = {"LSTM": ("Sigmoid", "Tanh", "Tanh"), "GRU": ("Sigmoid", "Tanh"), "RNN": ("Tanh",)}
ACTIVATIONS = {"sigmoid": "Sigmoid", "tanh": "Tanh", "relu": "Relu"}  # (ONNX names them case-insensitively)
GROUP = 16  # the most steps one Split or Concat takes


def _attrs(node) -> dict:
    from onnx import helper

    out = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    for key in ("direction", "activations"):
        if key in out:
            v = out[key]
            out[key] = v.decode() if isinstance(v, bytes) else [s.decode() if isinstance(s, bytes) else s for s in v]
    return out


def _input(node, index: int) -> str:
    return node.input[index] if len(node.input) > index else ""


def _constants(graph) -> dict:
    """Initializers and Constant nodes' values, by name."""
    from onnx import numpy_helper

    values = {t.name: t for t in graph.initializer}
    for n in graph.node:
        if n.op_type == "Constant" and len(n.attribute) == 1 and n.attribute[0].name == "value":
            values[n.output[0]] = n.attribute[0].t
    return {k: numpy_helper.to_array(v) for k, v in values.items()}


def _is_recurrent(node) -> bool:
    return node.domain in ("", "ai.onnx") and node.op_type in OPS


def recurrent_nodes(graph) -> list:
    return [n for n in graph.node if _is_recurrent(n)]


def decomposed_ops(graph) -> collections.Counter:
    """(domain, op) counts of the nodes this rewrites (a graph's top level;
    inside an If or Loop body they stay unsupported)."""
    return collections.Counter(("ai.onnx", n.op_type) for n in recurrent_nodes(graph))


MIN_OPSET = 11  # the rewrite emits Slice (inputs from opset 10) and Clip (inputs from opset 11)


def _label(node) -> str:
    return f"{node.op_type} '{node.name or node.output[0] or node.op_type}'"


def _attribute_refusal(node, opset: int) -> str | None:
    """Why the node's attributes (or the model's opset) cannot be rewritten."""
    a = _attrs(node)
    directions = 2 if a.get("direction", "forward") == "bidirectional" else 1
    acts = a.get("activations")
    if acts is not None:
        if any(s.lower() not in ACTIVATIONS for s in acts):
            return f"activations {acts} (only Sigmoid, Tanh and Relu are rewritten)"
        if len(acts) != directions * len(DEFAULT_ACTIVATIONS[node.op_type]):
            return f"{len(acts)} activations for {directions} direction(s)"
    if "activation_alpha" in a or "activation_beta" in a:
        return "activation_alpha/activation_beta"
    if a.get("input_forget", 0):
        return "input_forget=1"
    if opset < MIN_OPSET:
        return f"opset {opset} (the rewrite needs opset {MIN_OPSET} or later)"
    return None


def _constant_refusal(node, constants: dict) -> str | None:
    """Why the node's weights cannot be rewritten: only known once the
    graph is simplified (the dynamo exporter builds a large LSTM's W, R and
    B with Slice and Concat, which onnxslim folds)."""
    for index, what in ((1, "W"), (2, "R"), (3, "B"), (7, "P")):
        name = _input(node, index)
        if name and name not in constants:
            return f"its {what} weights computed in the graph (a constant is expected)"
    lens = _input(node, 4)
    if lens and lens not in constants:
        return "per-sequence lengths given at run time (every sequence must have the full length)"
    return None


def _opset(model) -> int:
    return max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=1)


def check(model, constants: dict | None = None) -> None:
    """Raises UnsupportedOperatorError, one line naming each recurrent node
    this cannot rewrite: for its attributes; with `constants` (the graph's,
    once simplified), for weights computed in the graph too."""
    from ..errors import UnsupportedOperatorError

    opset = _opset(model)
    refused = [f"{_label(n)} with {why}" for n in recurrent_nodes(model.graph)
               if (why := _attribute_refusal(n, opset) or (constants is not None and _constant_refusal(n, constants)))]
    if refused:
        raise UnsupportedOperatorError(f"{len(refused)} recurrent node(s) cannot be rewritten for TVM: "
                                       + "; ".join(refused))


def _graph_inputs(graph) -> set[str]:
    """Every name the graph's nodes read, those of If/Loop/Scan bodies included."""
    names = set()
    for n in graph.node:
        names.update(n.input)
        for attr in n.attribute:
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                names |= _graph_inputs(sub)
    return names


class _Emitter:
    """ONNX nodes and constants of one rewritten node, their names prefixed."""

    def __init__(self, prefix: str, opset: int, dtype):
        self.prefix, self.opset, self.dtype = prefix, opset, dtype
        self.nodes, self.initializers, self.count, self.constants = [], [], 0, {}

    def _name(self, hint: str) -> str:
        self.count += 1
        return f"{self.prefix}/{hint}_{self.count}"

    def const(self, value, dtype=None) -> str:
        """An initializer of that value (one per distinct value: the steps
        share their weights, biases and slice bounds)."""
        from onnx import numpy_helper

        array = np.ascontiguousarray(value, dtype=dtype or self.dtype)
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in self.constants:
            self.constants[key] = self._name("const")
            self.initializers.append(numpy_helper.from_array(array, self.constants[key]))
        return self.constants[key]

    def op(self, op_type: str, *inputs: str, out: str | None = None, **attrs) -> str:
        from onnx import helper

        out = out or self._name(op_type)
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=self._name(op_type), **attrs))
        return out

    def _listing(self, op_type: str, x: str, attr: str, values: list[int], outs: list[str], **attrs) -> list[str]:
        """A node whose list argument (axes, split) is an input from opset 13
        on and an attribute before."""
        from onnx import helper

        if self.opset >= 13:
            inputs, attrs = [x, self.const(values, np.int64)], attrs
        else:
            inputs, attrs = [x], {**attrs, attr: values}
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=self._name(op_type), **attrs))
        return outs

    def unsqueeze(self, x: str, axis: int) -> str:
        return self._listing("Unsqueeze", x, "axes", [axis], [self._name("Unsqueeze")])[0]

    def squeeze(self, x: str, axis: int) -> str:
        return self._listing("Squeeze", x, "axes", [axis], [self._name("Squeeze")])[0]

    def _split(self, x: str, sizes: list[int]) -> list[str]:  # along axis 0
        return self._listing("Split", x, "split", sizes, [self._name("part") for _ in sizes], axis=0)

    def _slice(self, x: str, start: int, end: int, axis: int) -> str:
        return self.op("Slice", x, *(self.const([v], np.int64) for v in (start, end, axis)))

    def take(self, x: str, index: int, axis: int = 0) -> str:
        """x[index] along `axis`, that axis dropped (a Slice and a Squeeze:
        TVM imports a Gather as a `take` in its fast mode and warns of
        out-of-range indices at each one)."""
        return self.squeeze(self._slice(x, index, index + 1, axis), axis)

    def cols(self, x: str, start: int, end: int) -> str:  # x[..., start:end]
        return self._slice(x, start, end, -1)

    def steps(self, x: str, count: int) -> list[str]:
        """x's `count` rows along axis 0, each without that axis: Splits of
        at most GROUP parts (a Slice a step makes each step's slice a kernel
        of its own; one Split of 100 a kernel of 100 blocks, which DLight's
        inlining took 40 s to schedule), in levels."""
        if count <= GROUP:
            return [self.squeeze(o, 0) for o in self._split(x, [1] * count)]
        chunk = GROUP
        while -(-count // chunk) > GROUP:
            chunk *= GROUP
        sizes = [min(chunk, count - k) for k in range(0, count, chunk)]
        return [row for part, n in zip(self._split(x, sizes), sizes) for row in self.steps(part, n)]

    def rows(self, xs: list[str], hidden: int) -> str:
        """The [B, hidden] tensors `xs` stacked on a new axis 0: Concats of at
        most GROUP inputs, in levels (one of 100 Unsqueezes was a kernel of
        249 blocks and 205 parameters), and a Reshape of [len * B, hidden]."""
        flat = list(xs)
        while len(flat) > 1:
            groups = [flat[k:k + GROUP] for k in range(0, len(flat), GROUP)]
            flat = [g[0] if len(g) == 1 else self.op("Concat", *g, axis=0) for g in groups]
        return self.op("Reshape", flat[0], self.const([len(xs), -1, hidden], np.int64))

    def act(self, name: str, x: str, clip: float | None) -> str:
        if clip is not None:
            x = self.op("Clip", x, self.const(-clip), self.const(clip))
        return self.op(name, x)

    def add(self, a: str | None, b: str) -> str:
        return b if a is None else self.op("Add", a, b)


def _static_shapes(model, input_shapes: dict) -> dict:
    """Every tensor's static shape (None for a dimension not known), the
    graph inputs taken at `input_shapes`."""
    import onnx

    m = onnx.ModelProto()
    m.CopyFrom(model)
    for vi in m.graph.input:
        if vi.name in input_shapes:
            dims = vi.type.tensor_type.shape.dim
            for d, v in zip(dims, input_shapes[vi.name]):
                d.Clear()
                d.dim_value = int(v)
    m = onnx.shape_inference.infer_shapes(m)
    out = {}
    for vi in (*m.graph.input, *m.graph.value_info, *m.graph.output):
        out[vi.name] = [d.dim_value if d.HasField("dim_value") else None for d in vi.type.tensor_type.shape.dim]
    return out


def _unroll(node, e: _Emitter, constants: dict, seq: int) -> None:
    """`node`'s outputs computed by `e`'s nodes."""
    a = _attrs(node)
    op, gates = node.op_type, OPS[node.op_type]
    hidden = int(a.get("hidden_size", constants[_input(node, 2)].shape[-1]))  # (optional: R is [D, gates*H, H])
    direction = a.get("direction", "forward")
    steps_of = {"forward": [range(seq)], "reverse": [range(seq - 1, -1, -1)],
                "bidirectional": [range(seq), range(seq - 1, -1, -1)]}[direction]
    acts = [ACTIVATIONS[s.lower()] for s in a.get("activations", DEFAULT_ACTIVATIONS[op] * len(steps_of))]
    per = len(DEFAULT_ACTIVATIONS[op])
    clip = float(a["clip"]) if "clip" in a else None
    layout, lbr = int(a.get("layout", 0)), int(a.get("linear_before_reset", 0))
    W, R = constants[_input(node, 1)], constants[_input(node, 2)]
    B = constants[_input(node, 3)] if _input(node, 3) else np.zeros((len(steps_of), 2 * gates * hidden), W.dtype)
    P = constants[_input(node, 7)] if _input(node, 7) else None
    if _input(node, 4) and not np.all(constants[_input(node, 4)] == seq):
        from ..errors import UnsupportedOperatorError

        raise UnsupportedOperatorError(f"{_label(node)} with sequences shorter than the input's {seq} steps")

    x = _input(node, 0)
    if layout == 1:  # [B, S, I] -> [S, B, I]
        x = e.op("Transpose", x, perm=[1, 0, 2])
    h0, c0 = _input(node, 5), _input(node, 6)
    ys, last_h, last_c = [], [], []
    for d, steps in enumerate(steps_of):
        f, g, h_act = (acts[d * per:(d + 1) * per] + [None, None])[:3]
        gh = gates * hidden
        bias = B[d][:gh] + B[d][gh:]
        if op == "GRU" and lbr:  # the reset gate multiplies (H R_h^T + Rb_h): Rb_h stays out of the input part
            bias[2 * hidden:] = B[d][2 * hidden:gh]
        xw = e.op("Add", e.op("MatMul", x, e.const(W[d].T)), e.const(bias))  # [S, B, gates*H]
        if op == "GRU" and not lbr:  # (the reset gate multiplies H before its product with R_h)
            rt_zr, rt_h = e.const(R[d].T[:, :2 * hidden]), e.const(R[d].T[:, 2 * hidden:])
        else:
            rt = e.const(R[d].T)  # [H, gates*H], one constant a direction
        H = e.take(h0, d, axis=1 if layout else 0) if h0 else None
        C = e.take(c0, d, axis=1 if layout else 0) if (op == "LSTM" and c0) else None
        outs = {}
        xws = e.steps(xw, seq)
        for t in steps:
            xt = xws[t]  # [B, gates*H]
            if op == "RNN":
                H = e.act(f, e.add(None if H is None else e.op("MatMul", H, rt), xt), clip)
            elif op == "LSTM":
                pre = e.add(None if H is None else e.op("MatMul", H, rt), xt)
                gi, go, gf, gc = (e.cols(pre, k * hidden, (k + 1) * hidden) for k in range(4))
                if P is not None and C is not None:
                    gi = e.op("Add", gi, e.op("Mul", C, e.const(P[d][:hidden])))
                    gf = e.op("Add", gf, e.op("Mul", C, e.const(P[d][2 * hidden:])))
                i, cand = e.act(f, gi, clip), e.act(g, gc, clip)
                new_c = e.op("Mul", i, cand)
                if C is not None:
                    new_c = e.op("Add", e.op("Mul", e.act(f, gf, clip), C), new_c)
                C = new_c
                if P is not None:
                    go = e.op("Add", go, e.op("Mul", C, e.const(P[d][hidden:2 * hidden])))
                H = e.op("Mul", e.act(f, go, clip), e.op(h_act, C))
            else:  # GRU: z, r, h (a term of the hidden state is None before the first step)
                xz, xr, xh = (e.cols(xt, k * hidden, (k + 1) * hidden) for k in range(3))
                rec = None if H is None else e.op("MatMul", H, rt if lbr else rt_zr)
                rz, rr = (None, None) if rec is None else (e.cols(rec, 0, hidden), e.cols(rec, hidden, 2 * hidden))
                z, r = e.act(f, e.add(rz, xz), clip), e.act(f, e.add(rr, xr), clip)
                if lbr:  # r * (H R_h^T + Rb_h)
                    rb_h = e.const(B[d][gh + 2 * hidden:])
                    rh = e.op("Mul", r, rb_h if rec is None else e.op("Add", e.cols(rec, 2 * hidden, gh), rb_h))
                else:  # (r * H) R_h^T
                    rh = None if H is None else e.op("MatMul", e.op("Mul", r, H), rt_h)
                cand = e.act(g, e.add(rh, xh), clip)
                if H is None:
                    H = e.op("Sub", cand, e.op("Mul", z, cand))  # (1 - z) * h~
                else:
                    H = e.op("Add", cand, e.op("Mul", z, e.op("Sub", H, cand)))  # (1 - z) * h~ + z * H
            outs[t] = H
        ys.append(e.rows([outs[t] for t in range(seq)], hidden))  # [S, B, H]
        last_h.append(H)
        last_c.append(C)

    y, y_h, y_c = (_input_or_output(node, k) for k in range(3))
    if y:
        full = e.op("Concat", *(e.unsqueeze(v, 1) for v in ys), axis=1)  # [S, D, B, H]
        if layout:
            e.op("Transpose", full, out=y, perm=[2, 0, 1, 3])
        else:
            e.op("Identity", full, out=y)
    for name, states in ((y_h, last_h), (y_c if op == "LSTM" else "", last_c)):
        if name:
            stacked = e.op("Concat", *(e.unsqueeze(v, 0) for v in states), axis=0)  # [D, B, H]
            if layout:
                e.op("Transpose", stacked, out=name, perm=[1, 0, 2])
            else:
                e.op("Identity", stacked, out=name)


def _input_or_output(node, k: int) -> str:
    return node.output[k] if len(node.output) > k else ""


def decompose(model, input_shapes: dict):
    """(model, {op: count}): a copy of `model` with each top-level LSTM, GRU
    and RNN node rewritten; the model itself where it has none. Raises
    UnsupportedOperatorError where one cannot be (see `check`), or where
    its sequence length is not static at `input_shapes`."""
    import onnx

    from ..errors import UnsupportedOperatorError

    nodes = recurrent_nodes(model.graph)
    if not nodes:
        return model, {}
    constants = _constants(model.graph)
    check(model, constants)
    shapes = _static_shapes(model, input_shapes)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.node[:]
    opset = _opset(model)
    used_before = {n.input[k] for n in nodes for k in (1, 2, 3, 4, 7) if _input(n, k)}
    counts: collections.Counter = collections.Counter()
    for index, n in enumerate(model.graph.node):
        if not _is_recurrent(n):
            out.graph.node.append(n)
            continue
        x_shape = shapes.get(n.input[0])
        layout = int(_attrs(n).get("layout", 0))
        seq = x_shape[layout] if x_shape and len(x_shape) == 3 else None
        if not seq:
            raise UnsupportedOperatorError(f"{_label(n)} over an input of shape {x_shape} "
                                           "(its sequence length must be static)")
        e = _Emitter(f"{n.name or n.op_type}.unrolled{index}", opset, constants[n.input[1]].dtype)
        _unroll(n, e, constants, seq)
        out.graph.node.extend(e.nodes)
        out.graph.initializer.extend(e.initializers)
        counts[n.op_type] += 1
    # the weights no node reads any more go, with their graph-input entries (old exporters list initializers there)
    unused = used_before - _graph_inputs(out.graph) - {o.name for o in out.graph.output}
    for field in (out.graph.initializer, out.graph.input):
        kept = [t for t in field if t.name not in unused]
        del field[:]
        field.extend(kept)
    return out, dict(counts)
