"""What our default schedule rules (cpu_default.py, gpu_default.py) read off
a kernel before they schedule it: its one reduction block, the injective
blocks around it, and its loops' static extents."""

from __future__ import annotations


def static_int(expr) -> int | None:
    value = getattr(expr, "value", expr)
    return value if isinstance(value, int) else None


def dtype_bytes(dtype) -> int:
    """The bytes of one element of `dtype` (a name or a DataType), from TVM's DataType."""
    from ..tvm_compat import tvm

    return tvm.DataType(str(dtype)).bits // 8


def point_indices(region) -> list:
    """A buffer region's indices, each where it covers one element, else None."""
    return [r.min if static_int(r.extent) == 1 else None for r in region.region]


def vars_of(expr) -> set:
    from ..tvm_compat import tirx

    return set(tirx.analysis.undefined_vars(expr))


def linear_stride(expr, var) -> int | None:
    """The constant coefficient of `var` in an affine `expr`; else None
    (not affine in it: `var % 7`, `var // 2`)."""
    from ..tvm_compat import sym

    found = sym.detect_linear_equation(expr, [var])
    return static_int(found[0]) if len(found) == 2 else None


def single_reduction(sch):
    """(main, producers, consumers, n_s, extents) for a kernel with exactly
    one reduction block, only injective blocks besides, whose loops are its
    n_s spatial axes then its reduction axes, all of static extent; else
    None. `main`, `producers`, `consumers` are DLight block infos."""
    from ..tvm_compat import dlight

    infos = dlight.analysis.normalize_prim_func(sch)
    if not infos:
        return None
    reductions = [i for i, b in enumerate(infos) if b.is_reduction()]
    if len(reductions) != 1:
        return None
    at = reductions[0]
    main, producers, consumers = infos[at], infos[:at], infos[at + 1:]
    if not all(b.is_injective() for b in producers + consumers):
        return None
    kinds = main.dom_kind()
    n_s = len(kinds) - len(kinds.lstrip("S"))
    if n_s == 0 or n_s == len(kinds) or kinds[n_s:].strip("R") or len(main.iters) != len(sch.get_loops(main.block_rv)):
        return None
    extents = [static_int(it.dom) for it in main.iters]
    if any(e is None for e in extents):
        return None
    return main, producers, consumers, n_s, extents


def reduction_loops(main, n_s: int, extents: list[int]) -> list[tuple]:
    """(var, extent) of the main block's reduction loops that run more than
    one step, outermost first."""
    return [(it.var, e) for it, e in zip(main.iters[n_s:], extents[n_s:]) if e > 1]


def rule_kernel(func, target, kind: str):
    """(schedule, single_reduction(schedule)) of a PrimFunc for a rule of
    target kind `kind` ("cuda", "llvm"); None where the function is not a
    PrimFunc, the target another kind, or the kernel not one reduction."""
    from ..tvm_compat import s_tir, tirx

    if not isinstance(func, tirx.PrimFunc) or target.kind.name != kind:
        return None
    sch = s_tir.Schedule(func)
    found = single_reduction(sch)
    return None if found is None else (sch, found)
