"""Stage 3, optimize: graph-level passes in named phases, per bucket.

The phases, in order (each a short list of passes, as in TVM's own
relax/backend/cuda/pipeline.py):
  fold_batchnorm    batch-norm folded into the preceding convolution
  inference         remaining inference-only decompositions (batch_norm, ...)
  constant_folding  constants folded, dead code and common subexpressions removed,
                    small integer powers as multiplications (passes.exact_power)
  layout            2-D convolutions to NHWC, or to NCHW[x]c on the CPU (passes.nchwc,
                    after passes.clip, and passes.pad_channels: channel counts no
                    block of 16 divides padded), when the profile asks for it
  fast_math         exp, sigmoid, tanh, erf, softmax as vectorizable approximations
                    (passes.fast_math; the CPU's default)
  mixed_precision   fp16 compute (when the profile asks for it); the casts it puts
                    before data movement moved after it (passes.movement)
  attention         attention as one kernel of ours (passes.attention; asked for, fp16 on CUDA)
  split_k           small-row convolutions' reductions split (passes.split_k; asked for)
  flat_gemm         1x1 convolutions and batched-row matmuls as 2-D GEMMs
                    (passes.flat_gemm; asked for), and with implicit_gemm KxK
                    convolutions as implicit GEMMs (passes.implicit_gemm; asked for);
                    both always in tf32
  epilogues         otherwise: a 2-D matmul's elementwise epilogue carried in 2-D
                    where its output is reshaped to more dimensions, and on sm_90 with
                    the wgmma kernel in use the N-D matmuls it would take as 2-D GEMMs
                    (passes.flat_gemm); named implicit_gemm where convolutions become
                    GEMMs without flat_gemm: where asked for, or by default on sm_90
                    with the wgmma kernel (but in a bucket whose database was tuned
                    on direct convolutions: tuning/graph.py), then the 1x1 ones as
                    2-D GEMMs too (config.Profile.implicit_gemms)
  fusion            legalize to TIR and fuse into kernels (an fp32 cast before a
                    mean inside the mean's kernel: passes.mean_cast), GEMM rows that
                    tile badly padded inside their kernels (passes.pad_gemm; CUDA): the
                    module that tuning extracts tasks from and the build compiles;
                    in tf32, the GEMM kernels marked for TF32 tensor cores (passes.tf32)
A report records the operator counts after each phase; `dump_ir` writes the
IR after each phase.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from pathlib import Path

from . import artifacts
from .config import Profile
from .errors import ConfigError, StaleArtifactError, run_in_processes
from .frontend import FrontendArtifact, parallel_workers
from .passes import nchwc
from .passes.attention import fuse_attention
from .passes.clip import clip_kernels_to_ops
from .passes.conv1d import conv1d_as_conv2d
from .passes.conv_transpose import conv_transpose_gemm
from .passes.depthwise_layout import depthwise_channels_last
from .passes.exact_power import power_to_multiply
from .passes.fast_math import fast_math
from .passes.flat_gemm import flat_epilogues, flat_gemm
from .passes.fold_weights import fold_weights
from .passes.layout import convert_to_nhwc
from .passes.mean_cast import fuse_mean_casts
from .passes.mixed_precision import to_mixed_precision
from .passes.movement import tidy_movement
from .passes.pack_weights import ATTR as PACKED
from .passes.pack_weights import pack_gemm_weights
from .passes.pad_channels import pad_channels
from .passes.pad_gemm import pad_gemm_rows
from .passes.split_k import split_k_conv2d
from .passes.tf32 import mark as tf32_gemms
from .passes.transposes import cancel_transposes
from .shapes import Bucket, as_bucket, parse

log = logging.getLogger(__name__)
STAGE = "optimize"


@dataclasses.dataclass(frozen=True)
class OptimizeArtifact:
    folder: Path
    modules: dict[Bucket, Path]
    manifest: dict

    def module_path(self, bucket: Bucket | int) -> Path:
        bucket = as_bucket(bucket)
        if bucket not in self.modules:
            raise StaleArtifactError(
                f"optimize artifact has no bucket {bucket} (re-run the pipeline with these buckets)",
                [b.label for b in sorted(self.modules)],
            )
        return self.modules[bucket]

    def load_module(self, bucket: Bucket | int):
        from .tvm_compat import load_json

        return load_json(self.module_path(bucket).read_text())


def phases(profile: Profile, target=None, tuned_direct: bool = False) -> list[tuple[str, list]]:
    """The phases for `profile` on `target` (a TVM target; what the
    optimize stage runs under) for a bucket, `tuned_direct` where its
    database was tuned on direct convolutions (tuning/graph.py)."""
    from .passes import wgmma_gemm
    from .tvm_compat import relax

    T = relax.transform

    def fold():  # (weights moved and cast in NumPy first: passes/fold_weights.py)
        return [fold_weights(), T.FoldConstant()]

    out = [
        ("fold_batchnorm", [T.FoldBatchnormToConv2D()]),
        ("inference", [T.DecomposeOpsForInference(), T.CanonicalizeBindings()]),
        ("constant_folding", [*fold(), T.EliminateCommonSubexpr(), T.DeadCodeElimination(),
                              power_to_multiply()]),
    ]
    if profile.layout == "NHWC":
        # (cancel_transposes: a model's own NCHW <-> NHWC permutes meet ConvertLayout's; passes/transposes.py.
        # In fp16 after mixed precision, whose casts it would otherwise change: see there.)
        cancel = [] if profile.precision == "fp16" else [cancel_transposes()]
        out.append(("layout", [convert_to_nhwc(), depthwise_channels_last(), conv_transpose_gemm(), *cancel, *fold()]))
    elif profile.layout == "NCHWc":
        # (1-D convolutions as 2-D ones of height 1, first, so that the blocked layout takes them: passes/conv1d.py)
        # (channel counts padded to whole blocks of 16 before the layout chooses its blocks: passes/pad_channels.py)
        # (where ConvertLayout fails, convert() returns the module as it was before pad_channels and widen_groups)
        prepare = [pad_channels(), nchwc.widen_groups(), T.CanonicalizeBindings(), T.DeadCodeElimination()]
        out.append(("layout", [clip_kernels_to_ops(), conv1d_as_conv2d(), T.CanonicalizeBindings(),
                               T.DeadCodeElimination(), nchwc.convert(prepare), *fold()]))
    if profile.fast_math:
        out.append(("fast_math", [fast_math()]))
    if profile.precision == "fp16":
        acc = "float16" if profile.accumulate == "fp16" else "float32"
        # (tidy_movement: the casts mixed precision put before data movement go after it; passes/movement.py)
        out.append(("mixed_precision", [to_mixed_precision(acc), tidy_movement(),
                                        *([cancel_transposes()] if profile.layout == "NHWC" else []),
                                        T.CanonicalizeBindings(),
                                        T.DeadCodeElimination(), *fold()]))
    if profile.fuses_attention:
        out.append(("attention", [fuse_attention(), T.DeadCodeElimination()]))
    if profile.split_k > 1 and profile.layout == "NHWC":
        out.append(("split_k", [split_k_conv2d(profile.split_k), *fold()]))
    tf32 = profile.precision == "tf32"  # (flat and implicit GEMMs on: config.py)
    hopper = target is not None and wgmma_gemm.available(target)
    convs = profile.implicit_gemms(hopper, tuned_direct)
    if profile.flat_gemm:
        out.append(("flat_gemm", [flat_gemm(convs=convs, tf32=tf32), *fold()]))
    else:  # (by default, with the KxK convolutions as implicit GEMMs the 1x1 ones as 2-D GEMMs)
        out.append(("implicit_gemm" if convs else "epilogues",
                    [flat_epilogues(pad_rows=profile.pad_gemm, convs=convs, wgmma=profile.uses_wgmma_gemm and hopper,
                                    conv1x1=convs and profile.implicit_gemm is None),
                     T.CanonicalizeBindings(), *fold()]))
    out.append(
        (
            "fusion",
            [
                fuse_mean_casts(),
                T.LegalizeOps(customize_legalize_map={"relax.nn.conv2d": nchwc.legalize_conv2d}),
                T.AnnotateTIROpPattern(),
                T.FoldConstant(),  # (every op is a call_tir by now: nothing left for fold_weights)
                T.FuseOps(),
                T.FuseTIR(),
                T.DeadCodeElimination(),
                # Reshapes left alone by FuseOps (flat_gemm's and the
                # epilogues' among them): views of their input rather than
                # kernels (as the build would make them), so that neither
                # tuning nor the build's schedules see them.
                T.RewriteDataflowReshape(),
                T.DeadCodeElimination(),
                *([pad_gemm_rows()] if profile.pad_gemm else []),
                *([tf32_gemms()] if tf32 else []),
            ],
        )
    )
    if target is not None and target.kind.name == "llvm":
        # (a CPU GEMM's constant weight in column panels for the default schedule: passes/pack_weights.py)
        out.append(("pack_weights", [pack_gemm_weights(target), *fold(), T.DeadCodeElimination()]))
    return out


def op_counts(mod) -> dict[str, int]:
    """Relax operator calls in the module's Relax functions; fused kernels are
    counted by their PrimFunc name prefix as `call_tir:<name>`."""
    from .tvm_compat import relax, tvm

    counts: collections.Counter = collections.Counter()

    def visit(expr):
        if isinstance(expr, relax.Call):
            if isinstance(expr.op, tvm.ir.Op):
                if expr.op.name == "relax.call_tir":
                    counts["call_tir"] += 1
                else:
                    counts[expr.op.name.removeprefix("relax.")] += 1

    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func.body, visit)
    return dict(sorted(counts.items()))


def optimize_module(mod, profile: Profile, target, dump_dir: Path | None = None, tuned_direct: bool = False):
    """Run the phases on one module (a bucket; `tuned_direct`: see
    `phases`); returns (module, per-phase report)."""
    from .tvm_compat import PassContext, Sequential, tirx

    report = [{"phase": "input", "ops": op_counts(mod)}]
    with target, PassContext(opt_level=3):
        for name, passes in phases(profile, target, tuned_direct):
            mod = Sequential(passes, name=name)(mod)
            entry = {"phase": name, "ops": op_counts(mod)}
            if name == "fusion":
                entry["kernels"] = sum(isinstance(f, tirx.PrimFunc) for f in mod.functions.values())
            if name == "pack_weights":
                entry["kernels"] = sum(isinstance(f, tirx.PrimFunc) and PACKED in (f.attrs or {})
                                       for f in mod.functions.values())
            report.append(entry)
            if dump_dir is not None:
                (dump_dir / f"{len(report) - 1:02d}_{name}.py").write_text(mod.script(show_meta=False))
    return mod, report


def _optimize_bucket(job) -> list[dict]:
    """One bucket, from the frontend's module file to the optimized one (a
    process-pool entry as well)."""
    from .tvm_compat import load_json, save_json

    module_path, profile, target_info, dump_dir, out, tuned_direct = job
    if dump_dir is not None:
        Path(dump_dir).mkdir(parents=True)
    mod = load_json(Path(module_path).read_text())
    mod, report = optimize_module(mod, profile, target_info.tvm_target(), None if dump_dir is None else Path(dump_dir),
                                  tuned_direct)
    Path(out).write_text(save_json(mod))
    return report


# A frontend module this large (its weights inline) takes tens of seconds a
# bucket (ResNet-50: ~25 s on the H200 machine, mostly folding the weights'
# layout and fp16 casts): its buckets go to parallel processes where cores
# are spare (frontend.parallel_workers).
PARALLEL_MODULE_BYTES = 16 << 20


def run(profile: Profile, target_info, front: FrontendArtifact, folder: Path, dump_ir: bool = False,
        tuned_direct: frozenset = frozenset()) -> OptimizeArtifact:
    """Every bucket the frontend imported of the profile's batch sizes
    (`tuned_direct`: the buckets whose databases were tuned on direct
    convolutions, pipeline.tuned_direct)."""
    if profile.precision == "tf32":
        from .passes import mma_gemm

        if not mma_gemm.available(target_info.tvm_target()):  # (else every GEMM would silently stay strict fp32)
            raise ConfigError("precision tf32 needs a CUDA GPU of sm_80 or later (TF32 tensor cores, cp.async)",
                              target_info.arch or target_info.kind, "fp32 or fp16 on this target")
    buckets = sorted(b for b in front.modules if b.batch in profile.buckets)
    missing = sorted(set(profile.buckets) - {b.batch for b in buckets})
    if missing:
        raise StaleArtifactError(
            f"frontend artifact has no bucket of batch {missing[0]} (re-run the frontend stage)",
            [b.label for b in sorted(front.modules)],
        )
    with artifacts.staged_dir(folder) as tmp:
        files = {b: f"b{b.label}.relax.json" for b in buckets}
        jobs = [(str(front.modules[b]), profile, target_info, str(tmp / "ir" / f"b{b.label}") if dump_ir else None,
                 str(tmp / files[b]), b in tuned_direct) for b in buckets]
        from .passes import wgmma_gemm

        hopper = wgmma_gemm.available(target_info.tvm_target())
        workers = parallel_workers(front.modules[buckets[0]], len(jobs), PARALLEL_MODULE_BYTES)
        if workers > 1:
            log.info("optimize: %d buckets in %d processes", len(jobs), workers)
        results = run_in_processes(_optimize_bucket, jobs, workers)
        reports = {}
        for bucket, report in zip(buckets, results):
            reports[bucket.label] = report
            log.info("optimize: bucket %s: %s", bucket, summarize(report))
            if bucket in tuned_direct and report[0]["ops"].get("nn.conv2d") and profile.implicit_gemms(hopper):
                log.info("optimize: bucket %s keeps direct convolutions: its tuning database was tuned on them "
                         "(--implicit-gemm makes them implicit GEMMs)", bucket)
        artifacts.write_manifest(
            tmp,
            STAGE,
            {
                "frontend_manifest_sha256": artifacts.sha256_file(front.folder / artifacts.MANIFEST),
                "profile": dataclasses.asdict(profile),
                "target": target_info.key(),
                "buckets": {b.label: f for b, f in files.items()},
                # (each bucket's convolutions: what a database first tuned on it records, tuning/graph.py)
                "implicit_gemms": {b.label: profile.implicit_gemms(hopper, b in tuned_direct) for b in buckets},
                "report": reports,
                "processes": workers,
            },
        )
    return load(folder)


def summarize(report: list[dict]) -> str:
    parts = []
    for entry in report:
        n = sum(v for k, v in entry["ops"].items() if k != "call_tir")
        if entry["phase"] == "fusion":
            parts.append(f"fusion: {entry['kernels']} kernels, {entry['ops'].get('call_tir', 0)} calls")
        elif entry["phase"] == "pack_weights":
            parts.append(f"pack_weights: {entry['kernels']} kernels")
        else:
            parts.append(f"{entry['phase']}: {n} ops")
    return ", ".join(parts)


def load(folder: Path) -> OptimizeArtifact:
    m = artifacts.read_manifest(folder, STAGE)
    return OptimizeArtifact(Path(folder), {parse(b): Path(folder) / f for b, f in m["buckets"].items()}, m)
