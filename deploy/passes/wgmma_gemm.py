"""Hopper's `wgmma` for a model's fp16 GEMMs (CUDA sm_90; on by default in fp16, `--no-wgmma-gemm`).

Our `mma.sync` schedule (passes/mma_gemm.py) is L2-bound at 26-63% of
cuBLAS's speed on a transformer's GEMMs; Hopper's own instructions (`wgmma`,
TMA, mbarriers) come only through TVM 0.27's TIRx language, which no schedule
reaches. This pass replaces a GEMM kernel that `mma_gemm.match` takes with a
kernel of ours written in TIRx (scripts/wgmma_gemm_probe.py measured it:
results/h100/2026-12-05/wgmma-ws-probe/), carrying the kernel's epilogue:

- warp-specialized on a persistent grid: `SMS` CTAs take the 128 x BN
  tiles in turn; a producer warpgroup (one thread) fills a ring of `STAGES`
  shared-memory stages by TMA (128-byte swizzle), two consumer warpgroups
  multiply out of it (`wgmma.mma_async m64nBNk16`, fp32 accumulators), a
  `full` and an `empty` mbarrier a stage;
- B as the model stores it: [K, N] (ONNX MatMul's weight: 64-column TMA
  boxes, an MN-major descriptor, wgmma's B transposed) or [N, K];
- A's rows past the GEMM's (pad_gemm's padding) read as zeros by TMA and
  never written, so the kernel reads A where it lies; so are B's columns
  past N where the tiles do not divide it (ConvNeXt's and Swin's first
  stage, N = 96: `tile_columns`);
- or A gathered, an implicit GEMM's im2col (by default on sm_90 from batch
  32, or --implicit-gemm; a strided 1x1 convolution with it): the whole
  producer warpgroup copies the rows' 16-byte chunks by `cp.async`, eight
  threads a row (a warp reads four rows' contiguous 128 bytes), into TMA's
  swizzled layout, zero-filled in the padding; the gather's index as a
  part of the row plus a part of K, each thread computing its rows' parts
  once a tile and K's once a stage (`wgmma_operands.Gather`, which checks,
  by evaluating the gather's own texts, that this holds and that each
  chunk is 8 neighbouring channels). Taken where `gather` is asked for
  (the build does wherever the kernel is in use); as first written, the
  index computed in full for each copy, it ran 3x slower than our
  `mma.sync` gather (results/h100/2026-12-06/ragged-n-and-gathers/), so
  split 1.5-1.9x faster than it (results/h200/2026-12-06/gathers-row-k/);
- the epilogue: the kernel's element-wise blocks after the GEMM (cast, bias,
  GELU, a residual), inlined into one expression by TVM's own
  `compute_inline`, applied to the accumulators after each warp has put
  them through shared memory, 8 adjacent columns of a row a thread, its
  loads and stores 16 bytes each (passes/wgmma_epilogue.py; 1.34-1.44x on
  ResNet-50's 1x1 GEMMs over storing them as the registers hold them).

The kernel is made from TVMScript text (`_TEMPLATE`): TVM 0.27 has no
Python IR mutator to rewrite the epilogue's expression onto the kernel's
indices, so its printed form is rewritten (the GEMM's result becomes the
accumulator, the block's indices the thread's row and column) and parsed
with the model's parameters as the kernel's. What does not fit (other
producers, shapes `fits` declines, a parse failure) keeps its schedule
chain.

The kernel carries its own target (`sm_90a`, which `wgmma` needs) and
MARK, by which our TIR pipeline (passes/tensor_core_smem.py) lowers it
with TVM's TIRx pipeline; it is built before the chain (rule
`wgmma-gemm`), where a failure to compile moves to the next source, and a
module holding one is compiled for sm_90a (`compile_target`).

Workaround (TVM 0.27.0.post1): CUDA codegen of `T.cuda.wgmma.noop_barrier`
reads `reg.dtype`, which a buffer load (a `TensorLoad`) does not have
(`AttributeError: 'TensorLoad' object has no attribute 'dtype'`,
tvm/backend/cuda/cpp/asm.py); `fix_noop_barrier_codegen` registers that
codegen again, reading the dtype as the PTX engine does.
`tests/test_wgmma_probe.py::test_tvm_still_needs_the_noop_barrier_codegen_fix`
fails once TVM no longer needs it.
"""

from __future__ import annotations

import re
import string
import textwrap

from . import wgmma_epilogue, wgmma_operands
from .mma_gemm import OPT_IN_SHARED_MEMORY

MARK = "deploy.tirx"  # PrimFunc attribute: lowered by TVM's TIRx pipeline (passes/tensor_core_smem.py)
RULE = "wgmma-gemm"  # the schedule source's name (passes/schedule.py)
ARCHS = ("sm_90", "sm_90a")  # wgmma and TMA: Hopper only
BM, BK = 128, 64  # a tile's rows (two consumer warpgroups of 64), a stage's K (128 bytes of fp16)
STAGES = 4
IN_FLIGHT = 0  # wgmma groups a consumer leaves running while it waits for the next stage (`kernel`)
PINGPONG = False  # each consumer warpgroup a whole tile, the two in turn (`kernel`)
SHARED_MEMORY = OPT_IN_SHARED_MEMORY["sm_90"] - 1024  # a block's dynamic shared memory, less the barriers' and alignment's
TMA_LOAD = "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
EPILOGUE = "staged"  # how the consumers store a tile (`kernel`; passes/wgmma_epilogue.py)
MULTIPLE = 8  # N and K a multiple of it (`fits`; mma_gemm.match's 16 before)
SMS = 132  # persistent CTAs: the H100's and H200's SMs (more CTAs than SMs is correct, and slower)

_TEMPLATE = string.Template('''
@T.prim_func
def main($params):
    T.func_attr({"tirx.noalias": True})
$a_map
    wg_b_map: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
    T.call_packed("runtime.cuTensorMapEncodeTiled", wg_b_map, "float16", 2, $b.data, *wg_b_args)

    T.device_entry()
    wg_cta = T.cta_id([wg_ctas])
    wg_tx = T.thread_id([384])
    wg_arena = T.alloc_buffer((wg_stages * (wg_a_tile + wg_b_tile),), "float16", scope="shared.dyn", align=1024)
    wg_as = T.decl_buffer((wg_stages, wg_bm, wg_bk), "float16", data=wg_arena.data, scope="shared.dyn")
    wg_bs = T.decl_buffer(wg_b_stage, "float16", data=wg_arena.data, elem_offset=wg_stages * wg_a_tile,
                          scope="shared.dyn")
    wg_full = T.alloc_shared((wg_stages,), "uint64")
    wg_empty = T.alloc_shared((wg_stages,), "uint64")
    wg_turn = T.alloc_shared((2,), "uint64")
    wg_acc = T.alloc_local((wg_nacc * (1 + wg_pp),), "float32")
$decls
    wg_desc_a: T.uint64
    wg_desc_b: T.uint64
    wg_d_a: T.uint64
    wg_d_b: T.uint64
    wg_my_tiles = T.meta_var((wg_tiles - wg_cta + wg_ctas - 1) // wg_ctas)
    wg_g = T.meta_var(wg_tx // 128 - 1)

    if wg_tx == 0:
        for wg_s in T.unroll(wg_stages):
            T.ptx.mbarrier.init.shared.b64(wg_full.ptr_to([wg_s]), T.uint32(wg_full_count))
            T.ptx.mbarrier.init.shared.b64(wg_empty.ptr_to([wg_s]), T.uint32(256 // (1 + wg_pp)))
        for wg_s in T.unroll(2):
            T.ptx.mbarrier.init.shared.b64(wg_turn.ptr_to([wg_s]), T.uint32(128))
    T.ptx.fence.proxy.async_.shared__cta()
    T.cuda.cta_sync()
    if wg_tx < 128:
        if wg_regs:
            T.ptx["setmaxnreg.dec.sync.aligned.u32"](40)
$producer
    else:
        if wg_regs:
            T.ptx["setmaxnreg.inc.sync.aligned.u32"](232)
        T.cuda.wgmma.encode_matrix_descriptor(T.address_of(wg_desc_a), wg_as.ptr_to([0, wg_g * (1 - wg_pp) * 64, 0]),
                                              1, 64, 3)
        T.cuda.wgmma.encode_matrix_descriptor(T.address_of(wg_desc_b), wg_bs.ptr_to(wg_b_origin), wg_b_lbo,
                                              wg_b_sbo, 3)
        for wg_tt in T.serial((wg_my_tiles - wg_g * wg_pp + wg_pp) // (1 + wg_pp)):
            wg_t = T.meta_var(wg_tt * (1 + wg_pp) + wg_g * wg_pp)
            wg_tile = T.meta_var(wg_cta + wg_t * wg_ctas)
$prefetch
            if wg_pp:  # (the tile's products begin when the other warpgroup's last tile's have been issued)
                if wg_t > 0:
                    T.cuda.mbarrier_wait(wg_turn.ptr_to([wg_g]), (wg_tt - 1 + wg_g) % 2)
            for wg_kt in T.serial(wg_k_tiles):
                wg_it = T.meta_var(wg_t * wg_k_tiles + wg_kt)
                T.cuda.mbarrier_wait(wg_full.ptr_to([wg_it % wg_stages]), (wg_it // wg_stages) % 2)
$fence                for wg_i in T.unroll(wg_nacc * (1 + wg_pp)):
                    T.cuda.wgmma.noop_barrier(wg_acc[wg_i])
                T.ptx.wgmma.fence.sync.aligned()
                for wg_kk in T.unroll(wg_bk // 16):
                    wg_d_a = wg_desc_a + T.Cast("uint64", ((wg_it % wg_stages) * wg_a_tile * 2 + wg_kk * 32) // 16)
                    wg_d_b = wg_desc_b + T.Cast("uint64",
                                                ((wg_it % wg_stages) * wg_b_tile * 2 + wg_kk * wg_b_step) // 16)
                    T.ptx[wg_mma](*[wg_acc[wg_i] for wg_i in range(wg_nacc)], wg_d_a, wg_d_b,
                                  wg_kt * (wg_bk // 16) + wg_kk > 0, 1, 1, 0, wg_b_trans)
                    if wg_pp:  # (the tile's second 64 rows: 64 rows of 128 bytes further)
                        T.ptx[wg_mma](*[wg_acc[wg_nacc + wg_i] for wg_i in range(wg_nacc)], wg_d_a + T.uint64(512),
                                      wg_d_b, wg_kt * (wg_bk // 16) + wg_kk > 0, 1, 1, 0, wg_b_trans)
                T.ptx.wgmma.commit_group.sync.aligned()
                T.ptx.wgmma.wait_group.sync.aligned(wg_in_flight)
                for wg_i in T.unroll(wg_nacc * (1 + wg_pp)):
                    T.cuda.wgmma.noop_barrier(wg_acc[wg_i])
                if wg_kt >= wg_in_flight:  # (the stage whose group has finished goes back to the producer)
                    T.ptx.mbarrier.arrive.shared.b64(wg_empty.ptr_to([(wg_it - wg_in_flight) % wg_stages]),
                                                     T.uint32(1))
            if wg_pp:  # (every stage of the tile waited for: the other warpgroup's next tile may begin)
                T.ptx.mbarrier.arrive.shared.b64(wg_turn.ptr_to([1 - wg_g]), T.uint32(1))
            if wg_in_flight > 0:  # (the tile's last group, before its accumulators are read)
                T.ptx.wgmma.wait_group.sync.aligned(0)
                for wg_i in T.unroll(wg_nacc * (1 + wg_pp)):
                    T.cuda.wgmma.noop_barrier(wg_acc[wg_i])
                T.ptx.mbarrier.arrive.shared.b64(wg_empty.ptr_to([(wg_t * wg_k_tiles + wg_k_tiles - 1) % wg_stages]),
                                                 T.uint32(1))
$epilogue''')

# A by TMA: one tensor map over the 2-D parameter (or its rows padded: TMA fills past the end with zeros)
_A_MAP = '''    wg_a_map: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
    T.call_packed("runtime.cuTensorMapEncodeTiled", wg_a_map, "float16", 2, $a.data, *wg_a_args)'''

# B by TMA: [K, N] in 64-column boxes (an MN-major layout), or [N, K] in one box
_B_LOAD = '''if wg_b_kn:
    for wg_j in T.unroll(wg_bn // 64):
        T.ptx[wg_tma](wg_bs.ptr_to([wg_it % wg_stages, wg_j, 0, 0]), T.address_of(wg_b_map),
                      (wg_tile % wg_grid_n) * wg_bn + wg_j * 64, wg_kt * wg_bk, wg_full.ptr_to([wg_it % wg_stages]))
else:
    T.ptx[wg_tma](wg_bs.ptr_to([wg_it % wg_stages, 0, 0]), T.address_of(wg_b_map), wg_kt * wg_bk,
                  (wg_tile % wg_grid_n) * wg_bn, wg_full.ptr_to([wg_it % wg_stages]))'''

# The producer warpgroup's first thread loads A and B by TMA
_PRODUCER_TMA = '''if wg_tx == 0:
    for wg_t in T.serial(wg_my_tiles):
        for wg_kt in T.serial(wg_k_tiles):
            wg_it = T.meta_var(wg_t * wg_k_tiles + wg_kt)
            wg_tile = T.meta_var(wg_cta + wg_t * wg_ctas)
            T.cuda.mbarrier_wait(wg_empty.ptr_to([wg_it % wg_stages]), (wg_it // wg_stages) % 2 ^ 1)
            T.ptx.mbarrier.arrive.expect_tx.shared.b64(wg_full.ptr_to([wg_it % wg_stages]), T.uint32(wg_stage_bytes))
            T.ptx[wg_tma](wg_as.ptr_to([wg_it % wg_stages, 0, 0]), T.address_of(wg_a_map), wg_kt * wg_bk,
                          (wg_tile // wg_grid_n) * wg_bm, wg_full.ptr_to([wg_it % wg_stages]))
''' + textwrap.indent(_B_LOAD, " " * 12)

# (cp.async writes A through the generic proxy, wgmma reads it through the async proxy)
_FENCE = "                T.ptx.fence.proxy.async_.shared__cta()\n"


class Plan:
    """What the kernel needs from a GEMM function: its parameters (name,
    shape, dtype), which are A, B and the output, the rows, N and K, whether
    B is [K, N], and the epilogue as TVMScript text over `wg_x` (the
    accumulator), `wg_row` and `wg_colc`. Where A is gathered (an implicit
    GEMM: `a` is then the gathered parameter), `gather` is the
    `wgmma_operands.Gather` of A's element [`wg_arow`, `wg_ak`], the first
    of 8 that lie side by side in `a`'s last dimension."""

    def __init__(self, params, a, b, out, m, n, k, b_kn, expr, gather=None):
        self.params, self.a, self.b, self.out = params, a, b, out
        self.m, self.n, self.k, self.b_kn, self.expr = m, n, k, b_kn, expr
        self.gather = gather


def available(target) -> bool:
    """Whether `target` (a TVM target) is a Hopper GPU."""
    return target.kind.name == "cuda" and str(target.attrs.get("arch", "")) in ARCHS


def fits(m: int, n: int, k: int) -> bool:
    """Whether the kernel can take an fp16 GEMM of this shape, summed in
    fp32: necessary, not sufficient (plan's other terms: A, B and the
    output parameters, sizes within int32, an element-wise epilogue).
    (N need not fill the tiles, nor K a stage: TMA reads B's columns or rows
    past N and both operands' K past its end as zeros, wgmma then summing
    zeros, and the columns past N are not written. N and K a multiple of
    `MULTIPLE`: 8 keeps TMA's rows and the epilogue's 16-byte loads and
    stores aligned, and an 8-column group wholly inside N or past it: an
    ImageNet classifier's N = 1,000, EfficientNet's and MobileNet's 24, 40
    and 112 channels, a 3x3 convolution's K = 9 x 24. The rows, 16.)"""
    return m % 16 == 0 and n % MULTIPLE == 0 and k % MULTIPLE == 0


def takes(m: int, n: int, k: int) -> bool:
    """`fits`, and the sizes within the int32 the kernel indexes in: a GEMM
    of this shape the kernel takes where its operands and epilogue are
    ones `plan` takes. (`plan` asks 16 of the GEMM's rows, which pad_gemm
    may have padded: M here is the rows before, so this may say no to a
    GEMM of rows padded later.)"""
    return fits(m, n, k) and _int32(m, n, k)


def _int32(m: int, n: int, k: int) -> bool:
    """Whether A, B and the output of an M x N x K GEMM index in int32 (as the kernel does)."""
    return max(m * k, m * n, k * n) < 2**31


def tile_columns(n: int, b_kn: bool, most: int = 256) -> int:
    """A tile's columns for N: 128 or 64 where they divide it (128 first);
    else the one that computes the fewest columns past N, the larger on a
    tie (A read once a row of tiles), or with B [N, K] N itself up to
    `most` (wgmma's N is any multiple of 8 when B is K-major; with B [K, N]
    its TMA boxes and swizzle are 64 columns wide)."""
    if n % 128 == 0 or n % 64 == 0:
        return 128 if n % 128 == 0 else 64
    if not b_kn and n <= most and n % 8 == 0:
        return n
    return min((128, 64), key=lambda bn: -(-n // bn) * bn)


def plan(func, gather: bool = False) -> Plan | None:
    """The Plan of `func` (a fused PrimFunc), else None: an fp16 GEMM that
    mma_gemm.match takes, whose A is a parameter (or a parameter's row
    padding, or with `gather` an implicit GEMM's gather of one), whose B is
    a parameter, whose shape `fits`, and whose epilogue
    ends in a parameter of [rows, N]."""
    from ..tvm_compat import s_tir, tvm
    from .kernel_shape import static_int
    from .mma_gemm import match

    gemm = match(func, multiple=MULTIPLE)
    if gemm is None or gemm.dtype != "float16" or not fits(gemm.m, gemm.n, gemm.k):
        return None
    params = [(str(p), [static_int(d) for d in p.shape], str(p.dtype)) for p in func.params]
    if any(None in shape for _, shape, _ in params):
        return None
    names = {name: (shape, dtype) for name, shape, dtype in params}
    sch = s_tir.Schedule(tvm.IRModule({"main": func}), debug_mask=0)
    main = sch.get(sch.get_sblock(gemm.name))
    a_src, b_src = (str(r.source) for r in main.reads)
    c_src = str(main.writes[0].source)
    padded = gathered = None
    for producer in gemm.producers:  # row padding of a parameter (TMA reads the rows past the end as zeros),
        blk = sch.get(sch.get_sblock(producer))  # or an implicit GEMM's gather of one (each row copied by cp.async)
        if str(blk.writes[0].source) != a_src or len(blk.reads) != 1 or len(gemm.producers) != 1:
            return None
        padded = wgmma_operands.padded_rows(blk)
        if padded is None:
            gathered = wgmma_operands.gather(blk, names, gemm.m, gemm.k) if gather else None
            if gathered is None:
                return None
        a_src = str(blk.reads[0].source)
    if (gathered is None and (a_src not in names or len(names[a_src][0]) != 2)) or b_src not in names \
            or len(names[b_src][0]) != 2:
        return None
    if gemm.epilogue:
        for name in gemm.epilogue[:-1]:
            sch.compute_inline(sch.get_sblock(name))
        last = sch.get(sch.get_sblock(gemm.epilogue[-1]))
        v0, v1 = (str(v.var) for v in last.iter_vars)
        out = str(last.writes[0].source)
        text = last.body.value.script(show_meta=False).strip().splitlines()[-1]
    else:  # the GEMM writes the output itself
        v0, v1 = (str(v.var) for v in main.iter_vars[:2])
        out = c_src
        text = f"{c_src}[{v0}, {v1}]"
    if out not in names or len(names[out][0]) != 2:
        return None
    if gathered is not None:  # (A's rows are the output's: the gather's rows past them, pad_gemm's, read as zeros)
        m, k, a_dtype = names[out][0][0], gemm.k, names[a_src][1]
    else:
        (m, k), a_dtype = names[a_src]
    b_shape, b_dtype = names[b_src]
    if not _int32(m, gemm.n, gemm.k):  # (m: the output's rows)
        return None
    b_kn = not gemm.b_transposed
    if (a_dtype, b_dtype) != ("float16", "float16") or k != gemm.k or m > gemm.m or padded not in (None, m):
        return None
    if b_shape != ([gemm.k, gemm.n] if b_kn else [gemm.n, gemm.k]):
        return None
    if names[out][0] != [m, gemm.n] or names[out][1] not in ("float16", "float32"):
        return None
    expr = re.sub(rf"\b{re.escape(c_src)}\[{re.escape(v0)}, {re.escape(v1)}\]", "wg_x", text)
    expr = re.sub(rf"\b{re.escape(v0)}\b", "wg_row", re.sub(rf"\b{re.escape(v1)}\b", "wg_colc", expr))
    loads = set(re.findall(r"\b([A-Za-z_]\w*)\[", expr))
    if c_src in loads or not loads <= set(names) - {out}:
        return None  # (the result read elsewhere than at its own [i, j], or an intermediate left)
    return Plan(params, a_src, b_src, out, m, gemm.n, k, b_kn, expr, gathered)


def kernel(p: Plan, stages: int | None = None, sms: int | None = None, bn: int | None = None,
           in_flight: int | None = None, pingpong: bool | None = None, epilogue: str | None = None):
    """The TIRx PrimFunc of a Plan: the model function's parameters, the
    kernel of the module docstring, a ring of `stages` stages on `sms`
    CTAs (by default STAGES, SMS), with tiles of `bn` columns (by default
    `tile_columns`; the last tile's columns past N read as zeros and not
    written), each consumer leaving `in_flight` (0 or 1; by default
    IN_FLIGHT) groups of `wgmma` running while it waits for the next stage
    (with 1, a stage goes back to the producer when the group after it is
    issued, as CUTLASS's Hopper mainloop does).

    `pingpong` (by default PINGPONG): rather than the two consumer
    warpgroups computing a tile's two 64-row halves together (and storing
    them together, while no product runs), each computes whole tiles, the
    two taking the CTA's tiles in turn, as CUTLASS's "pingpong" kernel
    does: one's products run while the other applies its epilogue and
    stores. Their products run one warpgroup at a time: a tile's products
    begin when the tile before it has waited for all its stages, which
    also keeps each consumer's waits on the ring's barriers in the order
    the producer fills them. As in CUTLASS's OrderedSequenceBarrier, each
    warpgroup waits on a `turn` mbarrier of its own, which the other's 128
    threads arrive on (one barrier for both would let a warp that ran a
    whole epilogue ahead of its warpgroup's last one pass on the phase
    before, of the same parity). Twice the accumulators a thread: up to
    128 columns.

    `epilogue` (by default EPILOGUE): "staged", the accumulators through
    shared memory and stored 16 bytes a thread, or "registers", stored as
    they lie, two columns a thread (wgmma_epilogue's docstring).

    Raises ValueError where `bn` is not a tile (a multiple of 8 up to 256;
    of 64 with B [K, N]; up to 128 with `pingpong`), the ring does not fit
    in shared memory, or `in_flight` is neither 0 nor 1 (a stage must be
    left for the producer to fill)."""
    from ..tvm_compat import tvm

    stages, sms = stages or STAGES, sms or SMS  # (read when called: scripts/with_settings.py sets them)
    pingpong = PINGPONG if pingpong is None else pingpong
    bn = bn or tile_columns(p.n, p.b_kn, most=128 if pingpong else 256)
    if bn % (64 if p.b_kn else 8) or bn > 256 or p.n % 8:
        raise ValueError(f"{bn} columns are not a tile (a multiple of {64 if p.b_kn else 8} up to 256) of "
                         f"N = {p.n} (a multiple of 8)")
    in_flight = IN_FLIGHT if in_flight is None else in_flight
    if pingpong and bn > 128:
        raise ValueError(f"{bn} columns with pingpong: a thread would hold {bn} accumulators (up to 128)")
    if in_flight not in (0, 1) or in_flight >= stages:
        raise ValueError(f"{in_flight} wgmma groups in flight: 0 or 1, fewer than the {stages} stages")
    epilogue = EPILOGUE if epilogue is None else epilogue
    if epilogue not in ("staged", "registers"):
        raise ValueError(f"unknown epilogue {epilogue!r}: staged or registers")
    out_dtype = next(dtype for name, _, dtype in p.params if name == p.out)
    in_bounds = "wg_row < wg_m" if p.n % bn == 0 else "T.And(wg_row < wg_m, wg_col < wg_n)"  # (N even: col + 1 too)
    if epilogue == "staged":
        epi, prefetch, decls, epi_consts, staging = wgmma_epilogue.staged(p, bn, bool(pingpong), out_dtype, in_bounds)
    else:
        epi, prefetch, decls, epi_consts, staging = wgmma_epilogue.REGISTERS, "", wgmma_epilogue.REGISTERS_DECLS, {}, 0
    if stages * (BM + bn) * BK * 2 + staging > SHARED_MEMORY:
        raise ValueError(f"{stages} stages of 128x{bn} tiles (and the epilogue's {staging // 1024} KB) need "
                         f"{(stages * (BM + bn) * BK * 2 + staging) // 1024} KB of shared memory; a block has "
                         f"{SHARED_MEMORY // 1024} KB on sm_90")
    k_tiles, grid_m, grid_n = (p.k + BK - 1) // BK, (p.m + BM - 1) // BM, (p.n + bn - 1) // bn
    tiles = grid_m * grid_n
    if p.b_kn:
        b_stage, b_args = (stages, bn // 64, BK, 64), [p.n, p.k, p.n * 2, 64, BK, 1, 1, 0, 3, 2, 0]
        b_lbo, b_step, b_trans, b_origin = BK * 128 // 16, 16 * 128, 1, [0, 0, 0, 0]
    else:
        b_stage, b_args = (stages, bn, BK), [p.k, p.n, p.k * 2, BK, bn, 1, 1, 0, 3, 2, 0]
        b_lbo, b_step, b_trans, b_origin = 1, 32, 0, [0, 0, 0]
    consts = {
        "wg_a_args": [p.k, p.m, p.k * 2, BK, BM, 1, 1, 0, 3, 2, 0], "wg_b_args": b_args,
        "wg_ctas": min(tiles, sms), "wg_tiles": tiles, "wg_stages": stages, "wg_bm": BM, "wg_bk": BK, "wg_bn": bn,
        "wg_a_tile": BM * BK, "wg_b_tile": bn * BK, "wg_b_stage": b_stage, "wg_nacc": bn // 2,
        "wg_k_tiles": k_tiles, "wg_grid_n": grid_n, "wg_stage_bytes": (BM + bn) * BK * 2, "wg_b_kn": p.b_kn,
        "wg_b_lbo": b_lbo, "wg_b_sbo": 64, "wg_b_step": b_step, "wg_b_trans": b_trans, "wg_b_origin": b_origin,
        "wg_in_flight": in_flight, "wg_pp": bool(pingpong), "wg_regs": bn * (1 + pingpong) > 128,
        "wg_m": p.m, "wg_n": p.n, "wg_k": p.k, "wg_b_bytes": bn * BK * 2,
        "wg_full_count": 1 if p.gather is None else 129,  # (the TMA thread's arrival, and each gathering thread's)
        "wg_mma": f"wgmma.mma_async.sync.aligned.m64n{bn}k16.f32.f16.f16",
        "wg_tma": TMA_LOAD,
    }
    consts.update(epi_consts)
    params = ", ".join(f'{name}: T.Buffer({tuple(shape)}, "{dtype}")' for name, shape, dtype in p.params)
    pieces = {"epilogue": textwrap.indent(epi, " " * 12), "prefetch": textwrap.indent(prefetch, " " * 12),
              "decls": textwrap.indent(decls, " " * 4)}
    if p.gather is None:
        pieces, gather = {**pieces, "a_map": _A_MAP, "producer": textwrap.indent(_PRODUCER_TMA, " " * 8),
                          "fence": ""}, {}
    else:
        a_map, producer, gather = wgmma_operands.producer(p.gather, p.a, next(d for n, d, _ in p.params if n == p.a),
                                                          _B_LOAD)
        pieces = {**pieces, "a_map": a_map, "producer": textwrap.indent(producer, " " * 8), "fence": _FENCE}
        consts["wg_nchk"] = len(p.gather.checks)
    text = string.Template(_TEMPLATE.safe_substitute(pieces)).substitute(
        params=params, a=p.a, b=p.b, out=p.out, out_dtype=out_dtype, expr=p.expr, in_bounds=in_bounds, **gather)
    from tvm.script import tirx as T

    func = tvm.script.from_source(text, extra_vars={"T": T, **consts})
    func = func.without_attr("global_symbol")  # (private, as the function it replaces)
    return func.with_attr("target", target()).with_attr(MARK, True).with_attr("tirx.is_scheduled", True)


def replacement(func, sms: int | None = None, gather: bool = False):
    """`kernel(plan(func, gather))` (`sms`: by default SMS), or None where the plan
    declines, or raises on a function of a shape it did not foresee (the
    chain keeps the function). Where the kernel is not made from a plan
    (the template does not parse), that error is raised, for the build's
    fallbacks to name."""
    try:
        p = plan(func, gather)
    except Exception:  # noqa: BLE001 - see the docstring
        return None
    return None if p is None else kernel(p, sms=sms or SMS)


def target():
    """The kernels' own target: sm_90a, which `wgmma` needs."""
    from ..tvm_compat import tvm

    return tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}, host="llvm")


def is_ours(func) -> bool:
    return bool(func.attrs and MARK in func.attrs)


def compile_target(target, mod):
    """`target` for compiling `mod`: sm_90a where the module holds our
    kernels (`a` targets one GPU, the one the package is built for; every
    other kernel compiles for it as for sm_90).

    Workaround (TVM 0.27.0.post1): TVM compiles every CUDA module of a build
    for the arch of `Target.current()` (tvm/support/nvcc.py,
    `tvm_callback_cuda_compile(code)` takes no target), not for the module's
    own: a kernel of ours, which carries `sm_90a`, was compiled for sm_90,
    whose ptxas refuses `wgmma` (on the GPU machine, `NVRTC compilation
    failed`; on the CPU machine TVM embeds the source and nothing is
    compiled). `tests/passes/test_wgmma_gemm.py` fails once the callback
    takes the module's target."""
    from ..tvm_compat import tirx, tvm

    if target.kind.name != "cuda" or str(target.attrs.get("arch", "")) != "sm_90":
        return target
    if not any(isinstance(f, tirx.PrimFunc) and is_ours(f) for f in mod.functions.values()):
        return target
    config = dict(target.export())
    config["arch"] = "sm_90a"
    return tvm.target.Target(config)


def fix_noop_barrier_codegen() -> None:
    """The workaround described in the module docstring (idempotent)."""
    from tvm.backend.cuda.codegen.registry import CODEGEN_REGISTRY, register_codegen
    from tvm.backend.cuda.ptx.engine import arg_dtype

    @register_codegen("cuda_wgmma_noop_barrier")
    def _noop_barrier(reg):
        op = {"uint32": "tirx.cuda_wgmma_noop_barrier_uint32",
              "float32": "tirx.cuda_wgmma_noop_barrier_float32"}[str(arg_dtype(reg))]
        res = CODEGEN_REGISTRY[op]([reg])
        return res[0] if isinstance(res, tuple) else res
