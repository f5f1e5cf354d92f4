"""Every kernel scheduled by the best source that builds.

The sources, best first: the kernel's tuning record (MetaSchedule), then each
of DLight's rules in order (on the CPU, our tiled schedule of contractions,
`cpu_default`, first; DLight's GEMV is left out, see `rules`; on CUDA our
mma.sync GEMM, `mma_gemm`, before DLight's Matmul, and our schedule of short
reductions, `gpu_default`, before DLight's reductions), then the plain fallback (DLight's
`Fallback` on CUDA; TVM's own default lowering on the CPU). A rule that raises while it
schedules a kernel (DLight's Matmul rule on a grouped convolution:
`auto_inline_consumer_chain: AssertionError: There are some consumers of the
cache-write stage that are not properly inlined`) counts as a failure of that
source, as does a schedule whose kernel does not build. A failing kernel moves
to its next source and the rest of the module keeps theirs: one kernel never
fails the build, and a tuned bucket keeps every other kernel's record.

`build` compiles the whole module first; only when that fails is each kernel
built on its own to find which ones fail (a module of 100 kernels is then
built ~100 times once, which costs seconds, not the build).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

from ..errors import error_line

log = logging.getLogger(__name__)

TUNED = "tuned"
DEFAULT = "default"  # no schedule: TVM's own lowering (CPU targets only)
CONTRACTION = "contraction"  # our CPU schedule of convolutions and matmuls (passes/cpu_default.py)
INJECTIVE = "injective"  # our CPU schedule of kernels without a reduction (passes/cpu_default.py)
STATISTICS = "statistics"  # our CPU schedule of normalizations and their statistics (passes/cpu_reduction.py)
SHORT_REDUCTION = "short-reduction"  # our CUDA schedule of depthwise convolutions and pools (passes/gpu_default.py)
FEW_OUTPUTS = "few-outputs"  # DLight's GeneralReduction for contractions with few outputs (passes/gpu_default.py)
BROADCAST_EPILOGUE = "broadcast-epilogue"  # our CUDA schedule of squeeze-excitation "excite" kernels (passes/gpu_default.py)
COLUMN_SUMS = "column-sums"  # our CUDA schedule of sums and means over pixels, channels kept (passes/gpu_columns.py)
SHORT_ROWS = "short-rows"  # our CUDA schedule of normalizations over short rows, a warp a row (passes/gpu_rows.py)
MMA_GEMM = "mma-gemm"  # our CUDA mma.sync GEMM in a default configuration (passes/mma_gemm.py)
THIN_GEMM = "thin-gemm"  # our CUDA schedule of GEMMs with few columns, a thread a row (passes/thin_gemm.py)
SIMT_GEMM = "simt-gemm"  # our CUDA schedule of fp32 GEMMs and convolutions on CUDA cores (passes/simt_gemm.py)
SHORT_INNER = "short-inner-axis"  # our CUDA schedule of transposes into a short last axis (passes/gpu_movement.py)
TILED_TRANSPOSE = "tiled-transpose"  # our CUDA schedule of other transposes, through shared memory (the same)
VECTOR_ROWS = "vector-rows"  # our CUDA schedule of other movement, 16-byte pieces of rows a thread (the same)
# Our schedule of the fused attention kernels (passes/attention_schedule.py):
# not a rule of the chain but tried first on those kernels alone (they are
# never tuned), the chain behind it. So the chain, which the kernel check
# keys its timings by, is the same with or without them.
FUSED_ATTENTION = "fused-attention"
# The version of each of our own default rules: bumped when a change gives
# kernels another schedule under that rule. The kernel check
# (tuning/check.py) keeps a tuned kernel's timing against its default schedule
# while the chain (`default_chain`) up to and including the source that made
# that default is unchanged, so a new or changed rule re-times only the kernels
# it could have taken, and DLight's rules (fixed for a TVM release) need no
# number. (Before rules had versions the whole chain had one: CUDA 4 is the
# chain with every rule at 1.)
# (SHORT_REDUCTION 2: NHWC depthwise convolutions and pools computed a sliding window a thread;
# 3: grouped convolutions a thread an output, their group's channels in the reduction; 4: a grouped
# convolution's four adjacent outputs a thread.
# MMA_GEMM 2: a GEMM whose K is two tiles of 32 takes the default tiles in a 3-stage pipeline, and
# one whose rows no tile divides has them padded to a multiple of 64 inside the kernel; N = 96 takes 128x96 tiles;
# 3: a GEMM over [1, M, K] rows, a transformer's dense layer at batch 1, as a 2-D one: passes/unit_batch.py;
# 4: a GEMM whose columns or K no tile divides has them padded too (mma_gemm.COL_TILE, K_TILE).
# COLUMN_SUMS 1: new, just before DLight's Reduction (which took those kernels).
# STATISTICS 1: new, just before DLight's CPU Reduction (which took those kernels).
# INJECTIVE 2: each block read by one other block inlined into it, not every block at the root; 3: the loop along
# the output's last axis innermost (cpu_default.CONTIGUOUS_WRITES: layout changes 2-12x faster).
# THIN_GEMM 1: new, just before DLight's Matmul (which took those kernels).
# SIMT_GEMM 1: new, just before DLight's Matmul (which took those kernels); 2: an operand whose rows are contiguous
# (a [K, N] weight) copied along them, 16 bytes at a time.
# VECTOR_ROWS 2: concatenations along the row, each piece's condition made the piece's; pieces of 8 bytes where
# reads are aligned to 8 bytes, not 16.
# CONTRACTION stays 1 with its padded tiles (2026-12-07, cpu_default._pad): they change only kernels with an axis
# the tile does not divide, of which the committed CPU databases have none, and a 2 would drop all 43 of their
# "default faster" verdicts (those files predate per-rule versions), putting records back that lost to the default.)
# It stays 1 with WHOLE_BLOCKS too (2026-12-07): of 66 corpus kernels that change, the two slower ones are ResNet3D's
# (results/cpu/2026-12-07/whole-blocks/), in no committed CPU database; where the default got faster, a verdict that
# it was faster than the tuned record still holds. And with VECTOR_EPILOGUE and POOLS (2026-12-07): kernels that
# only got faster (results/cpu/2026-12-07/vector-epilogue/, pools/); a max pool had no rule before (TVM's plain
# lowering), so a record that beat that is still used, as before.
# CONTRACTION 2 (2026-12-08): depthwise convolutions read their padding in place (WINDOW_PADDING), 0.23-0.94x
# the time, so tuned depthwise records that beat the old default mostly lose to the new one (MobileNetV2's beat
# it by 0.41-0.84x): their verdicts must be made again. The committed CPU databases were re-checked at 2.
RULE_VERSIONS = {CONTRACTION: 2, INJECTIVE: 3, SHORT_REDUCTION: 4, FEW_OUTPUTS: 1, BROADCAST_EPILOGUE: 1, SHORT_ROWS: 1,
                 MMA_GEMM: 4, SHORT_INNER: 1, TILED_TRANSPOSE: 1, VECTOR_ROWS: 2, COLUMN_SUMS: 1, SIMT_GEMM: 2,
                 THIN_GEMM: 1, STATISTICS: 1}


@dataclasses.dataclass
class Kernel:
    name: str
    source: str = ""
    fallbacks: list = dataclasses.field(default_factory=list)  # [{"source", "reason"}], in order


class UnbuildableKernelError(Exception):
    """No source yields a schedule of this kernel that builds."""

    def __init__(self, kernel: str, reasons: list[dict]):
        self.kernel, self.reasons = kernel, reasons
        last = reasons[-1]["reason"] if reasons else "no source applies"
        super().__init__(f"kernel '{kernel}': no schedule builds (last, {reasons[-1]['source'] if reasons else '-'}: {last})")


# Each target kind's default rules, in the order a kernel tries them (`rules`
# makes them). CUDA: our FewOutputs before DLight's Matmul: it gives a
# contraction with few outputs a handful of thread blocks. Our mma.sync GEMM
# just before DLight's Matmul: on the fp16 GEMMs it takes, DLight's
# tensor-core kernels ran 3 to 7 times slower (passes/mma_gemm.py,
# DEFAULT_CONFIGS); our ThinGemm after it: a GEMM with fewer columns than our mma.sync GEMM takes gets a
# thread a row, where DLight's Matmul pads its columns to 64 (thin_gemm.py); our SimtGemm after that: fp32 GEMMs
# and convolutions get 128 x 128 tiles, a thread 8 x 8 outputs, where DLight's Matmul gives 32 x 64 and 4 x 4
# (simt_gemm.py). Our ShortReduction
# before DLight's reduction rules: they give a depthwise convolution one thread
# block per output. Our ShortRows just before DLight's GeneralReduction: it
# gives a normalization over short rows a warp a row, where GeneralReduction
# gives each row a block of 256 threads. Our ColumnSums just before DLight's Reduction: it gives a mean over
# an NHWC feature map's pixels a block of up to 512 threads for 4 channels, where Reduction gives 16 channels
# 16 threads that walk every pixel (gpu_columns.py). Our BroadcastEpilogue just before DLight's GEMV: at batch 1 GEMV
# takes the squeeze-excitation "excite" kernel and computes its broadcast over the whole feature map in a
# block per 16 channels (0.317 ms for 1.6 MB, gpu_default.py); elsewhere DLight leaves that kernel to
# Fallback. Our ShortInnerAxis, TiledTranspose and VectorRows just before Fallback:
# they take only kernels the rest leave to it (gpu_movement.py). CPU: DLight's GEMV rule is
# left out: its schedule of a squeeze-excitation kernel (1x1 convolution to
# 1152 channels, sigmoid, broadcast multiply) does not finish compiling
# (EfficientNet-B0's build took 19 minutes; see passes/cpu_default.py), and a
# compile that never ends is not a failure the chain can fall back from. Ours
# takes the GEMV-shaped kernels. Our SumStatistics just before DLight's CPU Reduction: it takes the kernels of
# that rule whose reductions are sums or maxima of plain elements (norms, softmax, means; not pools) or whose
# statistics it would recompute (cpu_reduction.py).
CHAINS = {
    "cuda": [FEW_OUTPUTS, MMA_GEMM, THIN_GEMM, SIMT_GEMM, "dlight.Matmul", BROADCAST_EPILOGUE, "dlight.GEMV",
             SHORT_REDUCTION, COLUMN_SUMS, "dlight.Reduction", SHORT_ROWS, "dlight.GeneralReduction", SHORT_INNER,
             TILED_TRANSPOSE, VECTOR_ROWS, "dlight.Fallback"],
    "llvm": [CONTRACTION, STATISTICS, "dlight.Reduction", INJECTIVE],
}


def _chain_kind(target_kind: str) -> str:
    return "cuda" if target_kind == "cuda" else "llvm"


def rules(target_kind: str) -> list[tuple[str, object]]:
    from ..tvm_compat import dlight

    if _chain_kind(target_kind) == "cuda":
        from .gpu_columns import ColumnSums
        from .gpu_default import BroadcastEpilogue, FewOutputs, ShortReduction
        from .gpu_movement import ShortInnerAxis, TiledTranspose, VectorRows
        from .gpu_rows import ShortRows
        from .mma_gemm import Default as MmaGemm
        from .simt_gemm import SimtGemm
        from .thin_gemm import ThinGemm

        g = dlight.gpu
        make = {FEW_OUTPUTS: FewOutputs, MMA_GEMM: MmaGemm, THIN_GEMM: ThinGemm, SIMT_GEMM: SimtGemm,
                "dlight.Matmul": g.Matmul, "dlight.GEMV": g.GEMV, SHORT_REDUCTION: ShortReduction,
                COLUMN_SUMS: ColumnSums, "dlight.Reduction": g.Reduction, SHORT_ROWS: ShortRows,
                "dlight.GeneralReduction": g.GeneralReduction, BROADCAST_EPILOGUE: BroadcastEpilogue,
                SHORT_INNER: ShortInnerAxis, TILED_TRANSPOSE: TiledTranspose, VECTOR_ROWS: VectorRows,
                "dlight.Fallback": g.Fallback}
    else:
        from .cpu_default import ContractionTiling, InjectiveParallel
        from .cpu_reduction import SumStatistics

        make = {CONTRACTION: ContractionTiling, STATISTICS: SumStatistics,
                "dlight.Reduction": dlight.cpu.Reduction, INJECTIVE: InjectiveParallel}
    return [(name, make[name]()) for name in CHAINS[_chain_kind(target_kind)]]


def default_chain(target_kind: str) -> list[str]:
    """The sources a kernel's default schedule can come from, in order, each
    of ours with its version (`RULE_VERSIONS`): e.g. ['few-outputs@1',
    'dlight.Matmul', ..., 'dlight.Fallback', 'default']. Nothing is built or
    imported."""
    return [f"{name}@{RULE_VERSIONS[name]}" if name in RULE_VERSIONS else name
            for name in CHAINS[_chain_kind(target_kind)]] + [DEFAULT]


def _sources(gv, plain, tuned, target, target_kind, wgmma=False, wgmma_gather=False):
    """(source name, scheduled PrimFunc or exception), lazily, best first."""
    from ..tvm_compat import register_tensor_intrinsics, s_tir

    if target_kind == "cuda":  # (DLight's Matmul imports them for fp16 GEMMs, slowly: tvm_compat says why)
        register_tensor_intrinsics()
    if wgmma and target_kind == "cuda":
        from . import wgmma_gemm

        try:
            ours = wgmma_gemm.replacement(plain, gather=wgmma_gather) if wgmma_gemm.available(target) else None
        except Exception as e:  # noqa: BLE001 - the kernel not made: the fallbacks say why
            ours = e
        if ours is not None:
            yield wgmma_gemm.RULE, ours

    if tuned is not None:
        yield TUNED, tuned
    first = []  # (FUSED_ATTENTION: tried before the chain, outside it)
    if target_kind == "cuda":
        from .attention_schedule import Default as FusedAttention

        first.append((FUSED_ATTENTION, FusedAttention()))
    for name, rule in [*first, *rules(target_kind)]:
        try:
            space = rule.apply(plain, target, False)
        except Exception as e:  # noqa: BLE001 - a rule's failure is this source's failure
            yield name, e
            continue
        if space is None:
            continue
        sch = space if isinstance(space, s_tir.Schedule) else space[0]
        yield name, sch.mod["main"].with_attr("tirx.is_scheduled", True)
        if name == "dlight.Fallback":
            return
    yield DEFAULT, plain  # on CUDA only where Fallback does not apply


def _is_scheduled(func) -> bool:
    return bool(func.attrs and func.attrs.get("tirx.is_scheduled", False))


OPAQUE = 8  # OpPatternKind::kOpaque: FuseOps fuses nothing into or out of such a kernel


def final(func):
    """A chosen kernel, marked opaque to fusion: compiled as it is.

    Workaround: TVM's default build pipelines (relax/backend/cuda/pipeline.py
    and relax/pipeline.py, which `tvm.compile` runs) apply
    AnnotateTIROpPattern, FuseOps and FuseTIR once more to the module they
    compile. A kernel that FuseTIR made carries no `op_pattern`, gets one from
    its scheduled body, and FuseOps then merges it with a neighbour into a new,
    unscheduled function, which DLight's default rules schedule over our
    schedules and tuning records, or raise on (half of it is scheduled). At
    batch 32 MobileNetV3's 1x1 convolutions were merged with the hardswish
    kernel after each (its transposes cancel, so the analysis calls it
    elementwise) and the whole build failed (`ReIndex: Check failed:
    (outer->body.get() == inner)`). AnnotateTIROpPattern keeps a nonzero
    `op_pattern`. tests/passes/test_final_kernels.py fails once TVM's pipeline
    leaves scheduled kernels alone."""
    return func.with_attr("op_pattern", OPAQUE)


def build(plain_mod, tuned_mod, target, target_kind: str, compile_fn: Callable, kernel_builds: Callable,
          wgmma: bool = False, wgmma_gather: bool = False):
    """Schedule each PrimFunc of `plain_mod` (tuning records applied in
    `tuned_mod`, same functions) and compile; returns (compiled, kernels).
    `wgmma`: a GEMM passes/wgmma_gemm.py takes tries that kernel first
    (`wgmma_gather`: implicit GEMMs too).

    `compile_fn(mod)` compiles a whole module; `kernel_builds(name, func)`
    raises when one PrimFunc alone does not build."""
    from ..tvm_compat import tirx

    funcs = {gv: f for gv, f in plain_mod.functions.items() if isinstance(f, tirx.PrimFunc)}
    kernels, chains, chosen = {}, {}, {}
    for gv, plain in funcs.items():
        tuned = tuned_mod[gv] if tuned_mod is not None and _is_scheduled(tuned_mod[gv]) else None
        if _is_scheduled(plain):  # scheduled before the build (none today): keep it
            tuned = plain
        kernels[gv] = Kernel(gv.name_hint)
        chains[gv] = _sources(gv, plain, tuned, target, target_kind, wgmma, wgmma_gather)
        _advance(gv, kernels, chains, chosen, reason=None)

    verified = set()
    while True:
        mod = plain_mod.clone() if hasattr(plain_mod, "clone") else plain_mod
        for gv, func in chosen.items():
            mod[gv] = final(func)
        try:
            compiled = compile_fn(mod)
            break
        except Exception as whole:  # noqa: BLE001 - find the kernels at fault
            failing = []
            for gv, func in chosen.items():
                if gv in verified:
                    continue
                try:
                    kernel_builds(gv.name_hint, func)
                    verified.add(gv)
                except Exception as e:  # noqa: BLE001
                    failing.append((gv, error_line(e)))
            if not failing:
                raise whole  # not one kernel's fault: the caller reports it
            for gv, why in failing:
                _advance(gv, kernels, chains, chosen, reason=why)
    return compiled, [kernels[gv] for gv in funcs]


def _advance(gv, kernels, chains, chosen, reason):
    """Move kernel `gv` to its next source that yields a schedule (recording
    why the current one is left); raises UnbuildableKernelError at the end."""
    k = kernels[gv]
    if reason is not None:
        k.fallbacks.append({"source": k.source, "reason": reason})
        log.warning("build: kernel %s: %s schedule does not build (%s); falling back", k.name, k.source, reason)
    for name, got in chains[gv]:
        if isinstance(got, Exception):
            why = error_line(got)
            ours = not name.startswith("dlight.")  # (our rules, the wgmma kernel, fused attention)
            # (a DLight rule that raises on a kernel it does not fit is the chain working as meant, e.g.
            # its Matmul on every squeeze-excitation excite kernel: it declined the kernel, at debug level,
            # listed in the manifest's `declined`. One of our own rules raising is a fallback, with a warning.)
            k.fallbacks.append({"source": name, "reason": why, **({} if ours else {"declined": True})})
            log.log(logging.WARNING if ours else logging.DEBUG,
                    "build: kernel %s: %s failed to schedule it (%s); falling back", k.name, name, why)
            continue
        k.source = name
        chosen[gv] = got
        return
    raise UnbuildableKernelError(k.name, k.fallbacks)


def summarize(kernels: list[Kernel]) -> dict:
    """For the manifest: kernels per source; every fallback with its reason
    (a kernel whose tuning record, one of our rules or a schedule failed to
    build); and the kernels DLight's rules declined by raising (`declined`:
    the chain working as meant, not counted as fallbacks)."""
    counts: dict[str, int] = {}
    for k in kernels:
        counts[k.source] = counts.get(k.source, 0) + 1

    out = {"sources": dict(sorted(counts.items())), "fallbacks": [], "declined": []}
    for k in kernels:
        if k.fallbacks:
            kind = "declined" if all(f.get("declined") for f in k.fallbacks) else "fallbacks"
            out[kind].append({"kernel": k.name, "to": k.source, "from": [f["source"] for f in k.fallbacks],
                              "reasons": [f["reason"] for f in k.fallbacks]})
    return out
