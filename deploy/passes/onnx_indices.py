"""The values an integer input may take: graph inputs that index a table
through `Gather` (token ids into an embedding, token type ids), each with the
range ONNX gives its table, [-n, n) for n rows along the gathered axis.

Why: TVM 0.27's ONNX importer converts Gather to `take` in its "fast" mode,
which does not check its indices: a token id at or beyond the vocabulary
reads memory outside the table (on the CPU a segfault or a silent wrong
answer; on the GPU an illegal address, after which the process's CUDA
context fails every later call). ONNX Runtime and PyTorch raise an error for
such an input. The package records these ranges in its manifest and checks
each request against them before running it (runtime.Predictor.check_inputs),
so an id out of range is one line (a 400 from the server), not a crash.
tests/passes/test_onnx_indices.py::test_tvm_still_takes_gather_indices_unchecked
fails once TVM's importer checks them itself.

An input counts where it reaches Gather's indices through operators that
move values without changing them (PASS_THROUGH); an index computed from it
(a position id = cumsum of a mask) is not an input's value and is left to
the graph. Where an input indexes several tables, the smallest range holds.
Not followed: an input sliced, split or concatenated on its way to the
indices, and GatherElements and GatherND (TVM does not check theirs
either).
A dimension's padding value must lie in the tables of the inputs it pads
(export._check_pads).
"""

from __future__ import annotations

import collections

# Operators whose output holds their first input's values, rearranged (a Cast
# among integer types keeps them too; a Cast to float ends the walk)
PASS_THROUGH = ("Identity", "Unsqueeze", "Squeeze", "Reshape", "Flatten", "Expand", "Transpose", "Cast")
_INT_TYPES = {2, 3, 4, 5, 6, 7, 12, 13}  # onnx.TensorProto's uint8 ... uint64


def input_ranges(model) -> dict[str, tuple[int, int]]:
    """{input name: (lowest, one past the highest) value it may take} for the
    integer graph inputs of `model` (an onnx.ModelProto) that index a table
    of static size."""
    graph = model.graph
    initializers = {t.name for t in graph.initializer}
    users = collections.defaultdict(list)  # tensor -> [(node, input position)]
    for node in graph.node:
        for pos, name in enumerate(node.input):
            users[name].append((node, pos))
    ranges = {}
    for inp in graph.input:
        if inp.name in initializers or inp.type.tensor_type.elem_type not in _INT_TYPES:
            continue
        rows, todo, seen = None, [inp.name], set()
        while todo:
            tensor = todo.pop()
            if tensor in seen:
                continue
            seen.add(tensor)
            for node, pos in users[tensor]:
                if node.op_type == "Gather" and pos == 1:
                    n = _rows(graph, node)
                    if n is not None:
                        rows = n if rows is None else min(rows, n)
                elif node.op_type in PASS_THROUGH and pos == 0 and _keeps_ints(node):
                    todo.extend(node.output)
        if rows is not None:
            ranges[inp.name] = (-rows, rows)
    return ranges


def _keeps_ints(node) -> bool:
    if node.op_type != "Cast":
        return True
    return any(a.name == "to" and a.i in _INT_TYPES for a in node.attribute)


def _rows(graph, gather) -> int | None:
    """The static extent of a Gather's data along its axis (None: unknown)."""
    axis = next((a.i for a in gather.attribute if a.name == "axis"), 0)
    shape = _shape(graph, gather.input[0])
    if shape is None or not -len(shape) <= axis < len(shape):
        return None
    n = shape[axis]
    return n if isinstance(n, int) and n > 0 else None


def _shape(graph, name: str) -> list | None:
    for t in graph.initializer:
        if t.name == name:
            return list(t.dims)
    for node in graph.node:
        if node.op_type == "Constant" and name in node.output:
            value = next((a.t for a in node.attribute if a.name == "value"), None)
            return list(value.dims) if value is not None else None
    for info in (*graph.value_info, *graph.input):
        if info.name == name and info.type.tensor_type.HasField("shape"):
            dims = info.type.tensor_type.shape.dim
            return [d.dim_value if d.HasField("dim_value") else None for d in dims]
    return None
