"""Stage 3, optimize: graph-level passes in named phases, per bucket.

The phases, in order (each a short list of passes, as in TVM's own
relax/backend/cuda/pipeline.py):
  fold_batchnorm    batch-norm folded into the preceding convolution
  inference         remaining inference-only decompositions (batch_norm, ...)
  constant_folding  constants folded, dead code and common subexpressions removed
  layout            2-D convolutions to NHWC (when the profile asks for it)
  mixed_precision   fp16 compute (when the profile asks for it)
  fusion            legalize to TIR and fuse into kernels: the module that
                    tuning extracts tasks from and the build compiles
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
from .errors import StaleArtifactError
from .frontend import FrontendArtifact

log = logging.getLogger(__name__)
STAGE = "optimize"


@dataclasses.dataclass(frozen=True)
class OptimizeArtifact:
    folder: Path
    modules: dict[int, Path]
    manifest: dict

    def module_path(self, bucket: int) -> Path:
        if bucket not in self.modules:
            raise StaleArtifactError(
                f"optimize artifact has no bucket {bucket} (re-run the pipeline with these buckets)",
                sorted(self.modules),
            )
        return self.modules[bucket]

    def load_module(self, bucket: int):
        from .tvm_compat import load_json

        return load_json(self.module_path(bucket).read_text())


def phases(profile: Profile) -> list[tuple[str, list]]:
    from .tvm_compat import relax

    T = relax.transform
    out = [
        ("fold_batchnorm", [T.FoldBatchnormToConv2D()]),
        ("inference", [T.DecomposeOpsForInference(), T.CanonicalizeBindings()]),
        ("constant_folding", [T.FoldConstant(), T.EliminateCommonSubexpr(), T.DeadCodeElimination()]),
    ]
    if profile.layout == "NHWC":
        out.append(("layout", [T.ConvertLayout({"relax.nn.conv2d": ["NHWC", "OHWI"]}), T.FoldConstant()]))
    if profile.precision == "fp16":
        acc = "float16" if profile.accumulate == "fp16" else "float32"
        out.append(("mixed_precision", [T.ToMixedPrecision(out_dtype=acc), T.FoldConstant()]))
    if profile.split_k > 1 and profile.layout == "NHWC":
        out.append(("split_k", [split_k_conv2d(profile.split_k), T.FoldConstant()]))
    out.append(
        (
            "fusion",
            [
                T.LegalizeOps(),
                T.AnnotateTIROpPattern(),
                T.FoldConstant(),
                T.FuseOps(),
                T.FuseTIR(),
                T.DeadCodeElimination(),
            ],
        )
    )
    return out


# Which convolutions split_k_conv2d rewrites: at most this many output rows
# (batch x height x width) and at least this long a reduction.
SPLIT_K_MAX_ROWS = 256
SPLIT_K_MIN_K = 2048


def split_k_conv2d(parts: int, max_rows: int = SPLIT_K_MAX_ROWS, min_k: int = SPLIT_K_MIN_K):
    """A pass: each NHWC/OHWI convolution (groups 1, no dilation, static
    shapes) with at most `max_rows` output rows and a reduction of at least
    `min_k` (kh*kw*C, divisible by `parts` into multiples of 16) becomes
    im2col (pad, shifted windows, concat), a batched matmul over `parts`
    slices of the reduction, and a sum over them (three kernels after
    fusion: im2col; the matmul; the sum with the convolution's epilogue).

    Why: at batch 1, ResNet-50's last-stage 3x3 convolution is a GEMM of 49
    rows by 512 columns with K = 4608. A tensor-core schedule then has only a
    handful of thread blocks on 132 SMs, each walking 288 WMMA steps in a row
    (84 us on the H200, 2.7 TFLOP/s), and MetaSchedule's space has no split-K.
    Split in parts, the same work runs in `parts` times as many blocks with a
    reduction that many times shorter; the batched matmul still tensorizes
    (a grouped convolution, the other way to write it, does not)."""
    from .tvm_compat import relax, tvm

    op = relax.op

    def ints(xs):
        return [int(x) for x in xs]

    @relax.expr_functor.mutator
    class SplitK(relax.PyExprMutator):
        def visit_call_(self, call):
            call = self.builder_.normalize(super().visit_call_(call))
            if not isinstance(call, relax.Call) or call.op != tvm.ir.Op.get("relax.nn.conv2d"):
                return call
            a = call.attrs
            if (a.data_layout, a.kernel_layout, str(a.out_layout or "NHWC")) != ("NHWC", "OHWI", "NHWC") or int(a.groups) != 1 \
                    or ints(a.dilation) != [1, 1]:
                return call
            x, w = call.args
            try:  # static shapes only
                xs, ws, ys = ([int(d) for d in e.ty.shape] for e in (x, w, call))  # TVM 0.27: struct info is `.ty`
            except (TypeError, ValueError, AttributeError):
                return call
            n, _, _, c = xs
            o, kh, kw, _ = ws
            _, ho, wo, _ = ys
            rows, k = n * ho * wo, kh * kw * c
            if rows > max_rows or k < min_k or k % parts or (k // parts) % 16:
                return call
            sh, sw = ints(a.strides)
            pt, pl, pb, pr = ints(a.padding)
            xp = x
            if pt or pl or pb or pr:
                xp = self.builder_.emit(op.nn.pad(x, [0, 0, pt, pb, pl, pr, 0, 0]))
            if kh == kw == 1 and sh == sw == 1:
                col = xp
            else:
                wins = [
                    self.builder_.emit(op.strided_slice(xp, axes=[1, 2], begin=[ry, rx],
                                                        end=[ry + (ho - 1) * sh + 1, rx + (wo - 1) * sw + 1],
                                                        strides=[sh, sw]))
                    for ry in range(kh) for rx in range(kw)
                ]
                col = self.builder_.emit(op.concat(wins, axis=3))  # K ordered (ry, rx, c), as OHWI's (kh, kw, i)
            lhs = op.permute_dims(op.reshape(col, [rows, parts, k // parts]), [1, 0, 2])
            rhs = op.reshape(op.permute_dims(op.reshape(w, [o, k]), [1, 0]), [parts, k // parts, o])
            y = self.builder_.emit(op.matmul(self.builder_.emit(lhs), self.builder_.emit(rhs), out_dtype=a.out_dtype))
            # The parts summed by adds, not by a sum: FuseOps never fuses a
            # reduction with what follows it, so sum and the convolution's
            # epilogue (cast, bias, ReLU) would be two kernels; slices and adds
            # are injective and elementwise, one kernel with the epilogue.
            acc = None
            for i in range(parts):
                part = op.reshape(op.strided_slice(y, axes=[0], begin=[i], end=[i + 1]), [n, ho, wo, o])
                acc = part if acc is None else op.add(acc, part)
            return acc

    @tvm.transform.module_pass(opt_level=0, name="SplitKConv2d")
    def split_k(mod, _ctx):
        out = mod.clone()  # a pass must not change its input
        for gv, func in list(mod.functions.items()):
            if isinstance(func, relax.Function):
                out[gv] = SplitK().visit_expr(func)
        return out

    return split_k


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


def optimize_module(mod, profile: Profile, target, dump_dir: Path | None = None):
    """Run the phases on one module; returns (module, per-phase report)."""
    from .tvm_compat import PassContext, Sequential, tirx

    report = [{"phase": "input", "ops": op_counts(mod)}]
    with target, PassContext(opt_level=3):
        for name, passes in phases(profile):
            mod = Sequential(passes, name=name)(mod)
            entry = {"phase": name, "ops": op_counts(mod)}
            if name == "fusion":
                entry["kernels"] = sum(isinstance(f, tirx.PrimFunc) for f in mod.functions.values())
            report.append(entry)
            if dump_dir is not None:
                (dump_dir / f"{len(report) - 1:02d}_{name}.py").write_text(mod.script(show_meta=False))
    return mod, report


def run(profile: Profile, target_info, front: FrontendArtifact, folder: Path, dump_ir: bool = False) -> OptimizeArtifact:
    from .tvm_compat import save_json

    target = target_info.tvm_target()
    with artifacts.staged_dir(folder) as tmp:
        files, reports = {}, {}
        for bucket in profile.buckets:
            if bucket not in front.modules:
                raise StaleArtifactError(
                    f"frontend artifact has no bucket {bucket} (re-run the frontend stage)", sorted(front.modules)
                )
            dump_dir = None
            if dump_ir:
                dump_dir = tmp / "ir" / f"b{bucket}"
                dump_dir.mkdir(parents=True)
            mod, report = optimize_module(front.load_module(bucket), profile, target, dump_dir)
            name = f"b{bucket}.relax.json"
            (tmp / name).write_text(save_json(mod))
            files[bucket], reports[str(bucket)] = name, report
            log.info("optimize: bucket %d: %s", bucket, summarize(report))
        artifacts.write_manifest(
            tmp,
            STAGE,
            {
                "frontend_manifest_sha256": artifacts.sha256_file(front.folder / artifacts.MANIFEST),
                "profile": dataclasses.asdict(profile),
                "target": target_info.key(),
                "buckets": {str(b): f for b, f in files.items()},
                "report": reports,
            },
        )
    return load(folder)


def summarize(report: list[dict]) -> str:
    parts = []
    for entry in report:
        n = sum(v for k, v in entry["ops"].items() if k != "call_tir")
        if entry["phase"] == "fusion":
            parts.append(f"fusion: {entry['kernels']} kernels, {entry['ops'].get('call_tir', 0)} calls")
        else:
            parts.append(f"{entry['phase']}: {n} ops")
    return ", ".join(parts)


def load(folder: Path) -> OptimizeArtifact:
    m = artifacts.read_manifest(folder, STAGE)
    return OptimizeArtifact(Path(folder), {int(b): Path(folder) / f for b, f in m["buckets"].items()}, m)
