"""TF32 tensor cores for fp32 GEMMs, where the user asks for them (`PRECISION=tf32`).

What PyTorch does by default for an fp32 convolution on Ampere and newer:
the inputs of each multiply are rounded to TF32 (fp32's range, a 10-bit
mantissa) and the products summed in fp32 by `mma.sync ... .tf32`. The
model stays fp32 throughout: weights, activations, every other kernel.

How it reaches a kernel:
- `mark()`, the optimize stage's last pass in tf32, gives each fp32 GEMM
  kernel that our `mma.sync` schedule takes (passes/mma_gemm.py) the
  PrimFunc attribute `ATTR`. The attribute is part of the kernel's
  workload, so a strict-fp32 kernel and its TF32 twin never share a
  tuning record, and `mma_gemm.match` takes an fp32 GEMM only where it is
  set: a strict-fp32 package never gets a TF32 kernel.
- `mma_gemm.schedule` then builds the same pipeline as in fp16 (cp.async
  stages in dynamic shared memory, fragments a step ahead), with the
  intrinsics registered here: 16x16x16 tiles, each four
  `mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32`.

The fragments (PTX ISA, "Matrix Fragments for mma.m16n8k8" with .tf32;
g = lane / 4, t = lane % 4), for one k8 step and one n8 half:
  A (16x8, 4 registers): (g, t), (g+8, t), (g, t+4), (g+8, t+4)
  B (8x8, 2 registers): (k=t, n=g), (k=t+4, n=g)
  C (16x8, 4 floats): (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1), the
  layout of the fp16 m16n8k16 accumulators: TVM's f32 fill and store
  intrinsics serve both.
A thread holds a 16x16 tile of A, B and C in 8 registers each (`a_layout`,
`b_layout`, C's `shared_16x16_to_ldmatrix_32x8_layout`). `ldmatrix`
(.b16, four 8x8 matrices) loads A and a B stored [N, K]: an 8x8 matrix of
16-bit halves is an 8x4 matrix of 32-bit values, and thread `lane`
receives row lane / 4, column lane % 4 of each, the A and B registers
above. A B stored [K, N] has its k along the rows: `ldmatrix`'s transpose
would split each value in two halves, so each thread loads its 8 values
from shared memory one by one (`B_KN_LOAD`), conflict-free with rows
padded to a stride of 8 (mod 32) words (`SHARED_ROW_OFFSET`). Each finite
value is rounded to TF32 as it reaches its register (`rounded`); infinities
and NaNs are left as they are.
tests/passes/test_tf32.py checks these layouts against the ISA's tables,
element by element, and the built kernels against NumPy on a GPU.
"""

from __future__ import annotations

ATTR = "deploy.tf32"  # PrimFunc attribute: this fp32 GEMM may use TF32 tensor cores

A_LDMATRIX = "deploy_tf32_ldmatrix_a"
B_NK_LDMATRIX = "deploy_tf32_ldmatrix_b_nk"  # B stored [N, K]
B_KN_LOAD = "deploy_tf32_load_b_kn"  # B stored [K, N]
MMA = "deploy_tf32_mma"

# The row padding (words mod 32) of a shared tile read by `ldmatrix` (4
# words a row: eight rows 4 banks apart) and of a [K, N] B tile read one
# word a thread (rows t = 0..3 of 8 consecutive words: 8 banks apart).
SHARED_ROW_OFFSET = {"ldmatrix": 4, "load": 8}
# Half a TF32 unit in the last place, added to each finite fp32 value's bits
# as it is loaded into a fragment (`rounded`): `mma.sync` ignores the 13 low
# mantissa bits of a .tf32 operand, so this rounds to nearest (ties away
# from zero) where the bits alone would be truncated toward zero: half the
# error, and none of truncation's bias, which a long sum accumulates
# (CUTLASS's `round_half_ulp_truncate`; cuBLAS rounds to nearest too). A
# value within half a unit of fp32's largest rounds to infinity, as it
# should. Not added to an infinity or a NaN: the GPU's NaN, 0x7FFFFFFF,
# would become 0x80000FFF, which the tensor core reads as -0.
ROUND = 0x1000
EXPONENT = 0x7F800000  # an fp32's exponent bits: all set in an infinity or a NaN


def rounded(value):
    """The TIR expression of fp32 `value` rounded for a .tf32 operand (see ROUND)."""
    from ..tvm_compat import tirx

    bits = tirx.reinterpret("uint32", value)
    finite = tirx.NE(bits & tirx.const(EXPONENT, "uint32"), tirx.const(EXPONENT, "uint32"))
    return tirx.reinterpret("float32", tirx.if_then_else(finite, bits + tirx.const(ROUND, "uint32"), bits))
VECTOR = 4  # words of one 16-byte cp.async


def allowed(func) -> bool:
    """Whether a PrimFunc carries `ATTR` (`mark` gave it)."""
    return bool(func.attrs is not None and ATTR in func.attrs and func.attrs[ATTR])


def a_layout(i, k):
    """Where A's [i, k] of a 16x16 tile lives: (thread, register)."""
    return 4 * (i % 8) + k % 4, 4 * (k // 8) + 2 * (k % 8 // 4) + i // 8


def b_layout(k, n):
    """Where B's [k, n] of a 16x16 tile (K x N) lives: (thread, register)."""
    return 4 * (n % 8) + k % 4, 4 * (n // 8) + 2 * (k // 8) + k % 8 // 4


def b_kn_element(thread, register):
    """The [k, n] of B that a thread's register holds (`b_layout` inverted)."""
    h, s, j = register // 4, register % 4 // 2, register % 2
    return 8 * s + 4 * j + thread % 4, 8 * h + thread // 4


def a_ldmatrix_row_col(tx, step):
    """The shared tile's [row, col] whose address thread `tx` gives the
    `ldmatrix` of A's k8 step `step` (matrices: rows 0-7 then 8-15 of
    columns 0-3, then of columns 4-7)."""
    return tx % 8 + 8 * (tx // 8 % 2), 8 * step + 4 * (tx // 16)


def b_nk_ldmatrix_row_col(tx, half):
    """The [n, k] of a B tile stored [N, K] whose address thread `tx` gives
    the `ldmatrix` of n8 half `half` (matrices: k columns 0-3, 4-7, 8-11,
    12-15 of its eight rows)."""
    return 8 * half + tx % 8, 4 * (tx // 8)


def mma_offsets(half, step):
    """Register offsets (A, B, C) of the m16n8k8 of one n8 half and k8 step."""
    return 4 * step, 4 * half + 2 * step, 4 * half


def register_intrinsics() -> None:
    """Register the intrinsics: called by `tvm_compat.register_tensor_intrinsics`
    with TVM's own (once per process, wherever a schedule is made or a
    tuning record's trace is replayed)."""
    from ..tvm_compat import s_tir

    for name, (desc, impl) in _intrinsics().items():
        s_tir.TensorIntrin.register(name, desc, impl)


def _intrinsics() -> dict:
    from tvm.script import tirx as T

    from ..tvm_compat import tirx

    def lift(x):
        return tirx.const(x, "int32") if isinstance(x, int) else x

    scope = "shared.dyn"

    def load_desc(layout):
        # a 16x16 shared tile to the warp's registers; `layout`: a tile
        # element's [row, col] -> (thread, register)
        @T.prim_func(s_tir=True)
        def desc(warp_handle: T.handle, shared_handle: T.handle) -> None:
            shared = T.match_buffer(shared_handle, (16, 16), "float32", align=64, offset_factor=16, scope=scope)
            warp = T.match_buffer(warp_handle, (32, 8), "float32", align=64, offset_factor=16, scope="warp")
            with T.sblock("root"):
                T.reads(shared[0:16, 0:16])
                T.writes(warp[0:32, 0:8])
                for ax0, ax1 in T.grid(16, 16):
                    with T.sblock("shared_warp"):
                        v0, v1 = T.axis.remap("SS", [ax0, ax1])
                        T.reads(shared[v0, v1])
                        thread, local = T.meta_var(layout(v0, v1))
                        T.writes(warp[thread, local])
                        warp[thread, local] = shared[v0, v1]

        return desc

    def ldmatrix_impl(row_col):
        # two ldmatrix.x4, one per k8 step (A) or n8 half (B [N, K])
        @T.prim_func(s_tir=True)
        def impl(warp_handle: T.handle, shared_handle: T.handle) -> None:
            s0 = T.int32()
            s1 = T.int32()
            shared = T.match_buffer(shared_handle, (16, 16), "float32", align=64, offset_factor=16, scope=scope,
                                    strides=[s0, s1])
            warp = T.match_buffer(warp_handle, (32, 8), "float32", align=64, offset_factor=16, scope="warp")
            with T.sblock("root"):
                T.reads(shared[0:16, 0:16])
                T.writes(warp[0:32, 0:8])
                for tx in T.thread_binding(0, 32, "threadIdx.x"):
                    for part in T.unroll(2):
                        row, col = T.meta_var(row_col(tx, part))
                        T.evaluate(T.ptx_legacy.ldmatrix(False, 4, ".b16", warp.data,
                                                         warp.elem_offset + lift(8) * tx + 4 * part,
                                                         shared.access_ptr("r"), s0 * row + col, dtype="float32"))
                    for local in T.unroll(8):
                        value = T.meta_var(rounded(warp[tx, local]))
                        warp[tx, local] = value

        return impl

    @T.prim_func(s_tir=True)
    def b_kn_load_impl(warp_handle: T.handle, shared_handle: T.handle) -> None:
        s0 = T.int32()
        s1 = T.int32()
        shared = T.match_buffer(shared_handle, (16, 16), "float32", align=64, offset_factor=16, scope=scope,
                                strides=[s0, s1])
        warp = T.match_buffer(warp_handle, (32, 8), "float32", align=64, offset_factor=16, scope="warp")
        with T.sblock("root"):
            T.reads(shared[0:16, 0:16])
            T.writes(warp[0:32, 0:8])
            for tx in T.thread_binding(0, 32, "threadIdx.x"):
                for local in T.unroll(8):
                    k, n = T.meta_var(b_kn_element(tx, local))
                    value = T.meta_var(rounded(shared[k, n]))
                    warp[tx, local] = value

    @T.prim_func(s_tir=True)
    def mma_desc(a: T.handle, b: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (32, 8), "float32", align=64, offset_factor=16, scope="warp")
        B = T.match_buffer(b, (32, 8), "float32", align=64, offset_factor=16, scope="warp")
        C = T.match_buffer(c, (32, 8), "float32", align=64, offset_factor=16, scope="warp")
        with T.sblock("root"):
            T.reads(C[0:32, 0:8], A[0:32, 0:8], B[0:32, 0:8])
            T.writes(C[0:32, 0:8])
            for i, j, k in T.grid(16, 16, 16):
                with T.sblock("C"):
                    vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                    tc, lc = T.meta_var(_c_layout(vi, vj))
                    ta, la = T.meta_var(a_layout(vi, vk))
                    tb, lb = T.meta_var(b_layout(vk, vj))
                    T.reads(C[tc, lc], A[ta, la], B[tb, lb])
                    T.writes(C[tc, lc])
                    C[tc, lc] = C[tc, lc] + A[ta, la] * B[tb, lb]

    @T.prim_func(s_tir=True)
    def mma_impl(a: T.handle, b: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (32, 8), "float32", align=64, offset_factor=16, scope="warp")
        B = T.match_buffer(b, (32, 8), "float32", align=64, offset_factor=16, scope="warp")
        C = T.match_buffer(c, (32, 8), "float32", align=64, offset_factor=16, scope="warp")
        with T.sblock("root"):
            T.reads(C[0:32, 0:8], A[0:32, 0:8], B[0:32, 0:8])
            T.writes(C[0:32, 0:8])
            for tx in T.thread_binding(0, 32, "threadIdx.x"):
                for half, step in T.grid(2, 2):
                    oa, ob, oc = T.meta_var(mma_offsets(half, step))
                    T.evaluate(T.ptx_legacy.mma("m16n8k8", "row", "col", "tf32", "tf32", "fp32",
                                                A.data, A.elem_offset + tx * lift(8) + oa,
                                                B.data, B.elem_offset + tx * lift(8) + ob,
                                                C.data, C.elem_offset + tx * lift(8) + oc,
                                                False, dtype="float32"))

    return {
        A_LDMATRIX: (load_desc(a_layout), ldmatrix_impl(a_ldmatrix_row_col)),
        B_NK_LDMATRIX: (load_desc(lambda n, k: b_layout(k, n)), ldmatrix_impl(b_nk_ldmatrix_row_col)),
        B_KN_LOAD: (load_desc(b_layout), b_kn_load_impl),
        MMA: (mma_desc, mma_impl),
    }


def _c_layout(i, j):
    from tvm.s_tir.tensor_intrin.cuda import shared_16x16_to_ldmatrix_32x8_layout

    return shared_16x16_to_ldmatrix_32x8_layout(i, j)


def mark():
    """The IRModule pass that gives every fp32 GEMM kernel our `mma.sync`
    schedule would take in TF32 the attribute `ATTR` (see the module's
    docstring)."""
    from . import mma_gemm, prim_function_pass

    return prim_function_pass("deploy.Tf32Gemms", lambda func: func.with_attr(ATTR, True)
                              if mma_gemm.plan_any(func, tf32=True) is not None else None)
