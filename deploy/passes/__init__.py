"""Our own Relax and TIR passes, and every workaround of a TVM defect.

Each module's docstring names what it does and, for a workaround, the
upstream symptom it works around, the kernels it is scoped to, and the test
that fails once TVM no longer needs it.
"""

from __future__ import annotations


def tensor_dtype(expr) -> str | None:
    """A Relax expression's tensor dtype ("float16", ...), None where it has none."""
    try:  # TVM 0.27: struct info is `.ty`
        return str(expr.ty.dtype)
    except AttributeError:
        return None


def static_shape(expr) -> list[int] | None:
    """A Relax expression's tensor shape, None where it has none or a dimension is symbolic."""
    try:  # TVM 0.27: struct info is `.ty`
        return [int(d) for d in expr.ty.shape]
    except (TypeError, ValueError, AttributeError):
        return None


def nchw_oihw(conv_attrs) -> bool:
    """Whether a conv2d's attributes are NCHW data, OIHW weights and NCHW
    output (an unset output layout is the data's), as the ONNX frontend
    writes them."""
    a = conv_attrs
    return (a.data_layout, a.kernel_layout, str(a.out_layout or "NCHW")) == ("NCHW", "OIHW", "NCHW")


def nhwc_ohwi(conv_attrs) -> bool:
    """Whether a conv2d's attributes are NHWC data, OHWI weights and NHWC
    output (an unset output layout is the data's), as ConvertLayout leaves
    the CUDA path's convolutions."""
    a = conv_attrs
    return (a.data_layout, a.kernel_layout, str(a.out_layout or "NHWC")) == ("NHWC", "OHWI", "NHWC")


def relax_function_pass(name: str, make_mutator, emits_functions: bool = False):
    """A module pass that runs a fresh `make_mutator()` (a Relax
    PyExprMutator) over every Relax function of a copy of the module; with
    `emits_functions`, one `make_mutator(mod)` whose builder's module is the
    result, so that the PrimFuncs it emits (`builder_.call_te`) join it."""
    from ..tvm_compat import relax, tvm

    @tvm.transform.module_pass(opt_level=0, name=name)
    def run(mod, _ctx):
        if emits_functions:
            return _rebuilt(mod, make_mutator(mod))
        out = mod.clone()  # a pass must not change its input
        for gv, func in list(mod.functions.items()):
            if isinstance(func, relax.Function):
                out[gv] = make_mutator().visit_expr(func)
        return out

    return run


def prim_function_pass(name: str, rewrite):
    """A module pass that puts `rewrite(func)` in place of every PrimFunc
    of a copy of the module, where it returns one (None: left as it is)."""
    from ..tvm_compat import tirx, tvm

    @tvm.transform.module_pass(opt_level=0, name=name)
    def run(mod, _ctx):
        out = mod.clone()  # a pass must not change its input
        for gv, func in mod.functions_items():
            if isinstance(func, tirx.PrimFunc):
                new = rewrite(func)
                if new is not None:
                    out[gv] = new
        return out

    return run


def call_rewrite_pass(name: str, rewrite):
    """A module pass that offers every call of every Relax function, its
    arguments already rewritten, to `rewrite(builder, mod, call)`, which
    returns the replacement or None; PrimFuncs it emits (`builder.call_te`)
    join the module."""
    from ..tvm_compat import relax, tvm

    @tvm.transform.module_pass(opt_level=0, name=name)
    def run(mod, _ctx):
        @relax.expr_functor.mutator
        class Rewrite(relax.PyExprMutator):
            def visit_call_(self, call):
                call = super().visit_call_(call)
                out = rewrite(self.builder_, mod, call)
                return call if out is None else out

        return _rebuilt(mod, Rewrite(mod))

    return run


def _rebuilt(mod, mutator):
    """The module of `mutator`'s builder (a PyExprMutator made on `mod`)
    after it has visited each Relax function of `mod`: with the functions it
    emitted beside them."""
    from ..tvm_compat import relax

    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function):
            mutator.builder_.update_func(gv, mutator.visit_expr(func))
    return mutator.builder_.get()


def pruned(name: str, rewrite):
    """A module pass: `rewrite` (a module pass), then from every Relax
    function the bindings nothing reads any more (what a rewrite replaced)."""
    from ..tvm_compat import relax, tvm

    @tvm.transform.module_pass(opt_level=0, name=name)
    def run(mod, _ctx):
        out = rewrite(mod)
        for gv, func in list(out.functions.items()):
            if isinstance(func, relax.Function):
                out[gv] = relax.analysis.remove_all_unused(func)
        return out

    return run
