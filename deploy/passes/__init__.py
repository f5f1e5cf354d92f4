"""Our own Relax and TIR passes, and every workaround of a TVM defect.

Each module's docstring names what it does and, for a workaround, the
upstream symptom it works around, the kernels it is scoped to, and the test
that fails once TVM no longer needs it.
"""

from __future__ import annotations


def relax_function_pass(name: str, make_mutator):
    """A module pass that runs a fresh `make_mutator()` (a Relax
    PyExprMutator) over every Relax function of a copy of the module."""
    from ..tvm_compat import relax, tvm

    @tvm.transform.module_pass(opt_level=0, name=name)
    def run(mod, _ctx):
        out = mod.clone()  # a pass must not change its input
        for gv, func in list(mod.functions.items()):
            if isinstance(func, relax.Function):
                out[gv] = make_mutator().visit_expr(func)
        return out

    return run
