"""Workaround: TVM 0.27's ConvertLayout moves transposed convolutions to NHWC,
where its own legalization cannot lower them.

Upstream symptom (TVM 0.27, `relax.transform.ConvertLayout` to NHWC, then
LegalizeOps): `TOPI conv2d_transpose does not support input layout other than
NCHW, and kernel layout other than IOHW, so cannot be legalized by TOPI`
(logged), the operator stays in the module, and the build fails in VM codegen:
`CodeGenVM cannot emit this Relax operator directly`. ConvertLayout carries the
NHWC layout of the neighbouring convolutions into `conv2d_transpose` (U-Net
style decoders), although TOPI only lowers it in NCHW/IOHW.

Scope: the NHWC layout phase names `conv2d_transpose`'s own layout, NCHW/IOHW,
so ConvertLayout keeps it there and transposes around it; every other operator
is converted as before. `tests/passes/test_passes.py` checks that TVM still cannot
lower an NHWC `conv2d_transpose`, and fails once it can.
"""

from __future__ import annotations

NHWC_LAYOUTS = {
    "relax.nn.conv2d": ["NHWC", "OHWI"],
    "relax.nn.conv2d_transpose": ["NCHW", "IOHW"],  # the workaround: TOPI lowers no other layout
}


def convert_to_nhwc():
    from ..tvm_compat import relax

    return relax.transform.ConvertLayout(NHWC_LAYOUTS)
