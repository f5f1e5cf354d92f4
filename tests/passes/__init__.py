"""Helpers shared by the passes' tests."""

from __future__ import annotations


def fp16_gemm(m: int, n: int, k: int, epilogue: str = "none", name: str = "c"):
    """An IRModule of one fp16 GEMM with an fp32 sum, C[m, n] = A[m, k] B[k, n],
    then `epilogue`: "none" (the fp32 sum is the output), "bias" (cast to fp16,
    plus a bias: a fused dense layer) or "bias-relu" (and ReLU: a fused convolution's)."""
    from tvm import te, topi

    from deploy.tvm_compat import tvm

    a = te.placeholder((m, k), "float16", name="a")
    b = te.placeholder((k, n), "float16", name="b")
    r = te.reduce_axis((0, k), "r")
    out = te.compute((m, n), lambda i, j: te.sum(a[i, r].astype("float32") * b[r, j].astype("float32"), axis=r),
                     name=name)
    args = [a, b]
    if epilogue != "none":
        bias = te.placeholder((n,), "float16", name="bias")
        args.append(bias)
        out = topi.add(topi.cast(out, "float16"), bias)
        if epilogue == "bias-relu":
            out = topi.nn.relu(out)
    return tvm.IRModule({"main": te.create_prim_func([*args, out]).with_attr("global_symbol", "main")})
