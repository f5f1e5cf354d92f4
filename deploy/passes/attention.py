"""Attention as one kernel (`--fused-attention`): softmax(Q K^T * scale + bias) V.

A transformer exported to ONNX reaches Relax as separate operators: the QKV
projection's output reshaped and permuted into heads, Q scaled, K transposed,
two batched matmuls with a softmax between them, and the heads merged back.
After fusion that is eight kernels per layer, five of them only moving data:
ViT-S/16 fp16 at batch 32 spent 185 us a layer in them on the H200, 42% of
its kernel time, where the two matmuls take 60 us
(results/h200/2026-12-04/mma-gemm-design-space/vit-b32/profile.md).

This pass (CUDA, fp16, after mixed precision) finds

    O = matmul(softmax(f(matmul(Q, K^T))), V)

where `f` is any chain of casts, a multiplication or division by a scalar
constant, and the addition of a bias (an attention mask, a relative
position bias: anything that broadcasts to the scores), the softmax may be
followed by `where(isnan(P), c, P)` (torch's exported
scaled_dot_product_attention: a fully masked row's NaNs become c), Q, K^T and V are
[batch, heads, tokens, head_dim] (K^T [.., head_dim, tokens]) in fp16, the
head dimension a multiple of 16 up to 128, and at most MAX_KEYS keys. It
replaces the whole of it with one call of a PrimFunc of ours
(`attention_te`), which:

- reads Q, K and V through the layout operators that made them (reshape,
  permute_dims, strided_slice, squeeze, split, casts, a scalar scale),
  replayed inside the kernel from their common source: the QKV projection's
  output is read where it lies, with no copies;
- computes the scores, the softmax over them (the rows' maximum and sum in
  fp32, the probabilities cast to the dtype the model's matmul takes) and
  their product with V, a tile of query rows at a time;
- writes the result in the layout that follows it: [batch, tokens, heads,
  head_dim] where the model permutes the heads back (a reshape to
  [batch, tokens, heads * head_dim] is then a view), cast where the model
  casts it.

The scores of a tile of query rows stay in shared memory: on CUDA
`passes/attention_schedule.py` schedules the kernel (two `mma.sync` GEMMs
and a warp-per-row softmax between them). Elsewhere the kernel is the plain
computation TVM lowers as it is, which is what the tests run on the CPU to
check the rewrite against the unfused graph.

The kernel is marked opaque to fusion and carries ATTR, by which the build's
default chain (rule `fused-attention`) and the tuner (which leaves it out)
know it.

(Over 500 lines: the pattern, the operator chains it replays and the
kernel's computation are one rewrite's; each reads the others' details.)
"""

from __future__ import annotations

import math

from . import static_shape, tensor_dtype
from .schedule import OPAQUE

# PrimFunc attribute: the kernel's shape, {"q_rows", "keys", "head_dim", "tokens_first": whether the output is
# [batch, tokens, heads, head_dim] rather than [batch, heads, tokens, head_dim], "col_warps": col_warps()'s}
ATTR = "deploy.attention"
MAX_KEYS = 256  # keys whose scores a tile of query rows keeps in shared memory (passes/attention_schedule.py)
MAX_HEAD_DIM = 128
KEY_ALIGN = 16  # keys padded to a multiple of this (a tensor-core fragment)
ROW_TILE = 64  # query rows a thread block takes (passes/attention_schedule.py), rows padded to a multiple of it

# Operators replayed inside the kernel on the way from Q, K or V's source
LAYOUT_OPS = ("relax.reshape", "relax.permute_dims", "relax.strided_slice", "relax.squeeze", "relax.astype")
SCALAR_OPS = ("relax.multiply", "relax.divide")
# Operators after the product with V that the kernel's output absorbs
OUT_OPS = ("relax.permute_dims", "relax.reshape", "relax.astype")


def fuse_attention(shared_limit: int | None = None):
    """The Relax pass (see the module docstring). It rewrites the attention
    whose kernel fits `shared_limit` bytes of shared memory (by default the
    opt-in limit of the current target's architecture; nothing on a target
    without sm_80's `mma.sync`)."""
    from ..tvm_compat import relax, te, tvm
    from . import pruned, relax_function_pass
    from .attention_schedule import shared_bytes

    if shared_limit is None:
        from .mma_gemm import OPT_IN_SHARED_MEMORY, _arch, available

        target = tvm.target.Target.current(allow_none=True)
        ok = target is not None and available(target)
        shared_limit = OPT_IN_SHARED_MEMORY.get(_arch(target), 0) if ok else 0

    @relax.expr_functor.mutator
    class FuseAttention(relax.PyExprMutator):
        def __init__(self, mod):
            super().__init__(mod)
            self.users = _users(mod)
            self.shared_limit = shared_limit

        def visit_var_binding_(self, binding):
            value = binding.value
            if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and self._is_end(binding.var):
                new = self._rewrite(self.builder_.normalize(self.visit_expr(value)))
                if new is not None:
                    self.set_var_remap(binding.var, self.builder_.emit(new, binding.var.name))
                    return
            super().visit_var_binding_(binding)

        def _is_end(self, var) -> bool:
            """Whether `var` ends a chain of OUT_OPS (its one user is not one)."""
            users = self.users.get(var, [])
            return not (len(users) == 1 and _op(users[0]) in OUT_OPS)

        def _rewrite(self, call):
            match = _match(self, call)
            if match is None or shared_bytes(match[2]["keys"], match[2]["head_dim"], match[2]["col_warps"]) > shared_limit:
                return None
            sources, build, info, view = match
            inputs = [te.placeholder(static_shape(x), tensor_dtype(x), name=f"input{i}") for i, x in enumerate(sources)]
            out = build(*inputs)
            func = te.create_prim_func([*inputs, out]).without_attr("global_symbol").with_attrs(
                {"op_pattern": OPAQUE, ATTR: info, "tirx.noalias": True})
            # (the builder keeps one function of structurally equal ones: a
            # kernel for all the layers alike)
            gv = self.builder_.add_func(func, "fused_attention")
            fused = relax.call_tir(gv, relax.Tuple(sources), relax.TensorType([int(d) for d in out.shape], out.dtype))
            if view is None:
                return fused
            return relax.op.reshape(self.builder_.emit(fused), view)

    return pruned("FuseAttention", relax_function_pass("FuseAttention", FuseAttention, emits_functions=True))


def _op(value) -> str:
    from ..tvm_compat import relax, tvm

    if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op):
        return value.op.name
    return ""


def _users(mod) -> dict:
    """Each bound var of the module's Relax functions -> the values that read it."""
    from ..tvm_compat import relax

    users: dict = {}

    @relax.expr_functor.visitor
    class Users(relax.PyExprVisitor):
        def visit_var_binding_(self, binding):
            for v in _vars_in(binding.value):
                users.setdefault(v, []).append(binding.value)
            super().visit_var_binding_(binding)

        def visit_seq_expr_(self, seq):
            super().visit_seq_expr_(seq)
            for v in _vars_in(seq.body):
                users.setdefault(v, []).append(seq.body)

    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            Users().visit_expr(func)
    return users


def _vars_in(expr) -> list:
    from ..tvm_compat import relax

    if isinstance(expr, relax.Var):
        return [expr]
    if isinstance(expr, relax.Call):
        return [v for a in expr.args for v in _vars_in(a)]
    if isinstance(expr, relax.Tuple):
        return [v for f in expr.fields for v in _vars_in(f)]
    if isinstance(expr, relax.TupleGetItem):
        return _vars_in(expr.tuple_value)
    return []


def _ints(expr) -> list[int]:
    """A Relax tuple or shape of integers as a list."""
    from ..tvm_compat import relax

    if isinstance(expr, relax.ShapeExpr):
        return [int(v) for v in expr.values]
    if isinstance(expr, relax.Tuple):
        return [int(f.value) for f in expr.fields]
    return [int(v) for v in expr]


def _scalar(expr, mutator=None) -> float | None:
    """The number a one-element constant holds, also through a cast of one
    that mixed precision left bound to a var (MobileViT's scale: astype(6.0,
    float16)), as the cast rounds it; else None."""
    import numpy as np

    from ..tvm_compat import RelaxConstant

    if isinstance(expr, RelaxConstant) and expr.value.numpy().size == 1:
        return float(expr.value.numpy().reshape(()))
    value = _binding(mutator, expr) if mutator is not None else None
    if _op(value) == "relax.astype" and isinstance(value.args[0], RelaxConstant):
        c = _scalar(value.args[0])
        return None if c is None else float(np.asarray(c).astype(str(value.attrs.dtype)))
    return None


class _Chain:
    """A tensor as a chain of operators replayed from a source var: `steps`
    are (op name, attributes) applied in order to the source."""

    def __init__(self, source, steps: list):
        self.source, self.steps = source, steps

    def replay(self, x):
        from ..tvm_compat import tirx, topi

        for name, a in self.steps:
            if name == "relax.reshape":
                x = topi.reshape(x, a)
            elif name == "relax.permute_dims":
                x = topi.transpose(x, a)
            elif name == "relax.strided_slice":
                axes, begin, end, strides = a
                x = topi.strided_slice(x, begin, end, strides, axes=axes)
            elif name == "relax.squeeze":
                x = topi.squeeze(x, a)
            elif name == "relax.astype":
                x = topi.cast(x, a)
            elif name == "split":  # (a field of relax.split, as a slice)
                axis, begin, end = a
                x = topi.strided_slice(x, [begin], [end], [1], axes=[axis])
            else:  # relax.multiply / relax.divide by a scalar
                x = _scaled(x, tirx.const(a, x.dtype), name == "relax.multiply")
        return x


def _scaled(x, c, multiply: bool):
    from ..tvm_compat import te

    return te.compute(x.shape, lambda *i: x(*i) * c if multiply else x(*i) / c, name="scaled")


def _chain(mutator, expr) -> _Chain:
    """`expr` traced back through LAYOUT_OPS, scalar scales and split fields
    to the first value that is none of them."""
    from ..tvm_compat import relax

    steps = []
    while isinstance(expr, relax.Var):
        value = mutator.lookup_binding(expr)
        name = _op(value)
        if name in LAYOUT_OPS and static_shape(value.args[0]) is not None:
            rank = len(static_shape(value.args[0]))
            if name == "relax.reshape":
                step = static_shape(value)
            elif name == "relax.permute_dims":
                axes = value.attrs.axes
                step = [int(a) for a in axes] if axes is not None else list(range(rank))[::-1]
            elif name == "relax.squeeze":
                axis = value.attrs.axis
                step = [int(a) % rank for a in axis] if axis is not None else None
            elif name == "relax.astype":
                step = str(value.attrs.dtype)
            else:
                if len(value.args) > 4 and _ints(value.args[4]) and any(s != 1 for s in _ints(value.args[4])):
                    break  # (strided: left to the graph)
                axes, begin, end = (_ints(value.args[i]) for i in (1, 2, 3))
                step = (axes, begin, end, [1] * len(axes))
            steps.append((name, step))
            expr = value.args[0]
        elif name in SCALAR_OPS and (c := _scalar(value.args[1], mutator)) is not None:
            steps.append((name, c))
            expr = value.args[0]
        elif isinstance(value, relax.TupleGetItem) and _op(split := _split_of(mutator, value)) == "relax.split":
            shape = static_shape(split.args[0])
            if shape is None:
                break
            axis = int(split.attrs.axis) % len(shape)
            bounds = _split_bounds(split.attrs.indices_or_sections, shape[axis])
            steps.append(("split", (axis, *bounds[int(value.index)])))
            expr = split.args[0]
        else:
            break
    return _Chain(expr, steps[::-1])


def _split_of(mutator, item):
    """The value a TupleGetItem takes a field of (its var's binding)."""
    bound = _binding(mutator, item.tuple_value)
    return item.tuple_value if bound is None else bound


def _split_bounds(sections, extent: int) -> list[tuple[int, int]]:
    if isinstance(sections, int) or hasattr(sections, "value"):
        n = int(getattr(sections, "value", sections))
        size = math.ceil(extent / n)
        cuts = [min(size * i, extent) for i in range(1, n)]
    else:
        cuts = [int(getattr(c, "value", c)) for c in sections]
    edges = [0, *cuts, extent]
    return list(zip(edges[:-1], edges[1:]))


def _binding(mutator, expr):
    from ..tvm_compat import relax

    return mutator.lookup_binding(expr) if isinstance(expr, relax.Var) else None


def _match(mutator, call):
    """(source vars, te builder, the kernel's ATTR, view shape or None)
    where `call` ends an attention (a product with V, then OUT_OPS), else
    None."""
    out_steps = []
    x = call
    while _op(x) in OUT_OPS:  # walking back from the end of the chain
        out_steps.append(x)
        x = _binding(mutator, x.args[0])
    if _op(x) != "relax.matmul":
        return None
    pv = x
    p, v = pv.args
    p_value = _binding(mutator, p)
    p_dtype = tensor_dtype(p)
    if _op(p_value) == "relax.astype":
        if not _single_use(mutator, p):
            return None
        p = p_value.args[0]
        p_value = _binding(mutator, p)
    nan_fill = None  # where(isnan(P), c, P): what torch's exported scaled_dot_product_attention puts after its softmax
    if _op(p_value) == "relax.where":
        nan_fill = _nan_fill(mutator, p, p_value)
        if nan_fill is None:
            return None
        p = p_value.args[2]
        p_value = _binding(mutator, p)
        if len(mutator.users.get(p, [])) != 2:  # (the isnan and the where)
            return None
    elif not _single_use(mutator, p):
        return None
    if _op(p_value) != "relax.nn.softmax":
        return None
    shape = static_shape(p_value)
    if shape is None or len(shape) != 4 or int(p_value.attrs.axis) not in (-1, 3):
        return None
    # the scores: casts, a scalar scale, a bias, back to the matmul of Q and K^T
    score_steps, bias = [], None
    s = _binding(mutator, p_value.args[0])
    while s is not None and _op(s) != "relax.matmul":
        name = _op(s)
        if name == "relax.astype":
            score_steps.append(("cast", str(s.attrs.dtype)))
            s = _binding(mutator, s.args[0])
        elif name in SCALAR_OPS and (c := _scalar(s.args[1], mutator)) is not None:
            score_steps.append((name, c))
            s = _binding(mutator, s.args[0])
        elif name == "relax.add" and bias is None:
            lhs, rhs = s.args
            lhs_value = _binding(mutator, lhs)
            if lhs_value is not None and static_shape(lhs) == shape and _leads_to_scores(mutator, lhs_value):
                scores, bias = lhs_value, rhs
            else:
                scores, bias = _binding(mutator, rhs), lhs
            bias_shape = static_shape(bias)
            if bias_shape is None or not _broadcasts(bias_shape, shape):
                return None
            score_steps.append(("bias", None))
            s = scores
        else:
            return None
    if s is None:
        return None
    if tensor_dtype(s) == "float16":  # (scores accumulated in fp16, as the graph's matmul gives them)
        score_steps.append(("cast", "float16"))
    q, kt = s.args
    qs, ks, vs = static_shape(q), static_shape(kt), static_shape(v)
    if qs is None or ks is None or vs is None or len(qs) != 4 or len(ks) != 4 or len(vs) != 4:
        return None
    b, h, sq, d = qs
    sk = ks[3]
    if ks != [b, h, d, sk] or vs != [b, h, sk, d] or shape != [b, h, sq, sk]:
        return None
    if any(tensor_dtype(t) != "float16" for t in (q, kt, v)) or p_dtype != "float16":
        return None
    if d % 16 or d > MAX_HEAD_DIM or padded_keys(sk) > MAX_KEYS or not schedulable_rows(sq):
        return None
    out = _output(out_steps[::-1], tensor_dtype(pv))
    if out is None:
        return None
    bshd, out_casts, view = out
    chains = [_chain(mutator, t) for t in (q, kt, v)]
    sources = []
    for c in chains:
        if not any(c.source.same_as(s) for s in sources):
            sources.append(c.source)
    if bias is not None:
        sources.append(bias)
    index = [next(i for i, s in enumerate(sources) if s.same_as(c.source)) for c in chains]

    warps = col_warps(sk, d, mutator.shared_limit)

    def build(*tensors):
        return attention_te(*(chains[i].replay(tensors[index[i]]) for i in range(3)),
                            bias=tensors[-1] if bias is not None else None, score_steps=score_steps[::-1],
                            out_bshd=bshd, out_casts=out_casts, key_align=KEY_ALIGN * warps, nan_fill=nan_fill)

    return sources, build, {"q_rows": sq, "keys": sk, "head_dim": d, "tokens_first": bshd, "col_warps": warps}, view


def _nan_fill(mutator, p, where):
    """The scalar c of `p = where(isnan(x), c, x)` (x's NaNs, the rows whose
    every key is masked, replaced by c), if that is what `where` is and
    nothing else reads its isnan or its result; else None."""
    cond, fill, x = where.args
    isnan = _binding(mutator, cond)
    c = _scalar(fill, mutator)
    if _op(isnan) != "relax.isnan" or not isnan.args[0].same_as(x) or c is None:
        return None
    if not (_single_use(mutator, cond) and _single_use(mutator, p)):
        return None
    return c


def _single_use(mutator, var) -> bool:
    """Whether one value reads `var` (what the fused kernel replaces is then
    computed nowhere else)."""
    return len(mutator.users.get(var, [])) == 1


def schedulable_rows(q_rows: int) -> bool:
    """Whether passes/attention_schedule.py schedules a kernel of this many
    query rows. Workaround: where 64 does not divide an even row count
    above 64 (196, 198: ViTs without a class token, distilled ones), TVM
    0.27's compute_at finds the thread block's scope no longer a stage
    pipeline ("The region cover property holds for every of its child
    blocks") once the output's predicated rows join it, at every odd count
    it does not; that attention is left unfused.
    tests/passes/test_attention.py::test_tvm_cannot_schedule_even_row_counts
    fails once TVM schedules them."""
    return not (q_rows > ROW_TILE and q_rows % 2 == 0 and q_rows % ROW_TILE)


def _leads_to_scores(mutator, value) -> bool:
    """Whether `value` reaches a matmul through casts and scalar scales."""
    while value is not None and _op(value) in ("relax.astype", *SCALAR_OPS):
        value = _binding(mutator, value.args[0])
    return _op(value) == "relax.matmul"


def _broadcasts(shape: list[int], to: list[int]) -> bool:
    if len(shape) > len(to):
        return False
    return all(s in (1, t) for s, t in zip(shape[::-1], to[::-1]))


def padded_keys(keys: int, align: int = KEY_ALIGN) -> int:
    """Keys padded to `align` (KEY_ALIGN), as the kernel pads them."""
    return -(-keys // align) * align


def col_warps(keys: int, head_dim: int, shared_limit: int | None = None) -> int:
    """Warps that share each 16 query rows of the kernel (1, 2 or 4: a block
    of 4, 8 or 16 warps; attention_schedule.schedule), the keys padded to
    KEY_ALIGN times that many: the most whose padding adds no key to 2
    warps' (32) and whose GEMMs' column tiles, the padded keys and the head
    dimension, split evenly between them, and (given `shared_limit`) whose
    kernel's shared memory fits it (ViT's 197 keys fit an A100's opt-in
    166,912 bytes padded to 208, not to 224). Fewer registers a thread, more
    warps an SM: on the H200, ViT-S/16's 197 keys at batch 32 took 42.9 us
    in 8 warps, 78.7 in 4 and 45.5 in 16 (its keys padded to 256), BERT's
    128 keys 11.1 us in 16 warps, 11.7 in 8 and 14.3 in 4
    (results/h200/2026-12-05/attention-probe/)."""
    from .attention_schedule import shared_bytes

    for warps in (4, 2):
        if padded_keys(keys, KEY_ALIGN * warps) == padded_keys(keys, 2 * KEY_ALIGN) \
                and head_dim % (KEY_ALIGN * warps) == 0 \
                and (shared_limit is None or shared_bytes(keys, head_dim, warps) <= shared_limit):
            return warps
    return 1


def _output(steps: list, dtype: str):
    """(heads permuted behind the tokens?, the dtypes the product is cast to
    in order (its own first), the view after it or None) for OUT_OPS after
    the product with V: a permute to [batch, tokens, heads, head_dim] first,
    then reshapes and casts in any order; None for anything else."""
    bshd, view, casts = False, None, [dtype]
    for i, call in enumerate(steps):
        name = _op(call)
        if name == "relax.permute_dims":
            axes = call.attrs.axes
            if i != 0 or axes is None or [int(a) for a in axes] != [0, 2, 1, 3]:
                return None
            bshd = True
        elif name == "relax.astype":
            casts.append(str(call.attrs.dtype))
        else:
            view = static_shape(call)
            if view is None:
                return None
    return bshd, casts, view


def attention_te(q, kt, v, bias=None, score_steps=(), out_bshd: bool = False, out_casts=("float16",),
                 key_align: int = KEY_ALIGN, nan_fill: float | None = None):
    """The fused kernel's computation as TE stages (see the module docstring):
    q [B, H, Sq, D], kt [B, H, D, Sk], v [B, H, Sk, D] (fp16), `bias`
    broadcasting to the scores, `score_steps` applied to the fp32 scores in
    order (("cast", dtype), ("relax.multiply" | "relax.divide", c),
    ("bias", None)). Query rows are padded to a multiple of ROW_TILE and keys to
    KEY_ALIGN inside the kernel: padded keys score -inf (a zero
    probability), padded rows are never written. `out_casts`: the dtypes the
    fp32 product is cast to, in order. `key_align`: what the keys are padded
    to (a multiple of KEY_ALIGN; scripts/attention_probe.py's variants).
    `nan_fill`: the value a NaN probability becomes (a row whose every key
    is masked; the model's where(isnan(P), c, P)), else it stays NaN."""
    from ..tvm_compat import te, tirx

    b, h, sq, d = (int(x) for x in q.shape)
    sk = int(kt.shape[3])
    sqp, skp = -(-sq // ROW_TILE) * ROW_TILE, padded_keys(sk, key_align)
    f32, zero = "float32", tirx.const(0, q.dtype)
    minus_inf = tirx.const(float("-inf"), f32)  # (a row whose every key is masked to -inf stays NaN, as unfused)

    qp = te.compute((b, h, sqp, d), lambda n, m, i, c: tirx.if_then_else(i < sq, q[n, m, i, c], zero), name="attn_q")
    kp = te.compute((b, h, skp, d), lambda n, m, j, c: tirx.if_then_else(j < sk, kt[n, m, c, j], zero), name="attn_k")
    vp = te.compute((b, h, skp, d), lambda n, m, j, c: tirx.if_then_else(j < sk, v[n, m, j, c], zero), name="attn_v")
    rd = te.reduce_axis((0, d), name="rd")
    s = te.compute((b, h, sqp, skp), lambda n, m, i, j: te.sum(qp[n, m, i, rd].astype(f32) * kp[n, m, j, rd].astype(f32),
                                                                axis=rd), name="attn_s")

    def bias_at(n, m, i, j):
        rank = len(bias.shape)
        full = [n, m, tirx.min(i, sq - 1), tirx.min(j, sk - 1)][4 - rank:]
        return bias(*(0 if int(e) == 1 else ix for e, ix in zip(bias.shape, full)))

    def score(n, m, i, j):
        x = s(n, m, i, j)
        for name, arg in score_steps:
            if name == "cast":
                x = x.astype(arg)
            elif name == "bias":
                y = bias_at(n, m, i, j)
                dt = _dtype(x) if _dtype(x) == _dtype(y) else f32
                x = x.astype(dt) + y.astype(dt)
            else:
                c = tirx.const(arg, _dtype(x))
                x = x * c if name == "relax.multiply" else x / c
        return tirx.if_then_else(j < sk, x.astype(f32), minus_inf)

    rj = te.reduce_axis((0, skp), name="rj")
    mx = te.compute((b, h, sqp), lambda n, m, i: te.max(score(n, m, i, rj), axis=rj), name="attn_max")
    rj2 = te.reduce_axis((0, skp), name="rj2")
    total = te.compute((b, h, sqp), lambda n, m, i: te.sum(te.exp(score(n, m, i, rj2) - mx[n, m, i]), axis=rj2),
                       name="attn_sum")
    def probability(n, m, i, j):
        x = te.exp(score(n, m, i, j) - mx[n, m, i]) / total[n, m, i]
        if nan_fill is not None:
            x = tirx.if_then_else(tirx.isnan(x), tirx.const(nan_fill, f32), x)
        return x.astype(q.dtype)

    p = te.compute((b, h, sqp, skp), probability, name="attn_p")
    rv = te.reduce_axis((0, skp), name="rv")
    o = te.compute((b, h, sqp, d), lambda n, m, i, c: te.sum(p[n, m, i, rv].astype(f32) * vp[n, m, rv, c].astype(f32),
                                                              axis=rv), name="attn_o")
    def cast(x):  # the model's casts of the product, each one (fp16 and back rounds)
        for dtype in out_casts:
            x = x.astype(dtype)
        return x

    if out_bshd:
        return te.compute((b, sq, h, d), lambda n, i, m, c: cast(o[n, m, i, c]), name="attn_out")
    return te.compute((b, h, sq, d), lambda n, m, i, c: cast(o[n, m, i, c]), name="attn_out")


def _dtype(expr) -> str:
    return str(expr.ty.dtype)


def is_attention(func) -> bool:
    """Whether a PrimFunc is this pass's kernel."""
    return bool(func.attrs and ATTR in func.attrs)
