"""deploy/passes/schedule.py `final`: the kernels the build chose are compiled
as they are; TVM's own build pipeline re-fuses them otherwise."""

from __future__ import annotations

import numpy as np

from deploy import targets
from deploy.passes import schedule
from deploy.tvm_compat import PassContext, relax, tirx, tvm


def _two_scheduled_kernels(target):
    """What MobileNetV3's hardswish left at batch 32, in small: a 1x1
    convolution + bias kernel, then a kernel that transposes, scales and
    transposes back (injective to FuseOps before FuseTIR, elementwise to the
    analysis after it), each scheduled."""
    from deploy.tvm_compat import dlight

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 8, 8, 16), "float16"))
    w = relax.const(np.ones((16, 1, 1, 16), "float16"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.conv2d(x, w, data_layout="NHWC", kernel_layout="OHWI"))
            y = bb.emit(relax.op.add(y, relax.const(np.ones((1, 1, 1, 16), "float16"))))
            t = bb.emit(relax.op.permute_dims(y, [0, 3, 1, 2]))
            t = bb.emit(relax.op.clip(t, 0.0, 6.0))
            out = bb.emit_output(relax.op.permute_dims(t, [0, 2, 3, 1]))
        bb.emit_func_output(out)
    with target, PassContext(opt_level=3):
        mod = relax.transform.LegalizeOps()(bb.get())
        mod = relax.transform.AnnotateTIROpPattern()(mod)
        mod = relax.transform.FuseTIR()(relax.transform.FuseOps()(mod))
        mod = dlight.ApplyDefaultSchedule(dlight.gpu.Fallback())(mod)  # (a thread per output, as some kernels get)
    for gv, f in list(mod.functions.items()):
        if isinstance(f, tirx.PrimFunc):
            mod[gv] = f.with_attr("tirx.is_scheduled", True)
    return mod


def _kernels_after_tvms_fusion(mod, target):
    from tvm.relax.backend.cuda.pipeline import legalize_passes

    with target, PassContext(opt_level=3):
        out = tvm.transform.Sequential(legalize_passes(target)[:5])(mod)  # (LegalizeOps .. FuseTIR)
    return sorted(gv.name_hint for gv, f in out.functions.items() if isinstance(f, tirx.PrimFunc))


def test_tvms_build_pipeline_fuses_scheduled_kernels_again():
    # The workaround's reason: once this fails, TVM leaves scheduled kernels alone.
    sm90 = targets.resolve("cuda:sm_90").tvm_target()
    mod = _two_scheduled_kernels(sm90)
    assert _kernels_after_tvms_fusion(mod, sm90) == ["fused_fused_conv2d_add_fused_transpose_tir_clip_transpose1"]


def test_final_kernels_are_compiled_as_they_are():
    sm90 = targets.resolve("cuda:sm_90").tvm_target()
    mod = _two_scheduled_kernels(sm90)
    for gv, f in list(mod.functions.items()):
        if isinstance(f, tirx.PrimFunc):
            mod[gv] = schedule.final(f)
    assert _kernels_after_tvms_fusion(mod, sm90) == ["fused_conv2d_add", "fused_transpose_tir_clip_transpose1"]
