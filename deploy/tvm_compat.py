"""Every import path of Apache TVM used by the project, in one place.

TVM 0.27 moved MetaSchedule and DLight under `tvm.s_tir`, TIR to `tvm.tirx`,
and `tvm.nd.array` to `tvm.runtime.tensor`. When the next release moves them
again, this file is the one edit.
"""

from __future__ import annotations

import tvm  # noqa: F401  (re-exported)
from tvm import relax  # noqa: F401
from tvm.relax.frontend.onnx import from_onnx  # noqa: F401
from tvm.s_tir import dlight  # noqa: F401
from tvm.s_tir import meta_schedule as ms  # noqa: F401
from tvm import tirx  # noqa: F401
from tvm.target import Target  # noqa: F401

tensor = tvm.runtime.tensor
from_dlpack = tvm.runtime.from_dlpack
VirtualMachine = relax.VirtualMachine
load_module = tvm.runtime.load_module
save_json = tvm.ir.save_json
load_json = tvm.ir.load_json
import tvm_ffi  # noqa: E402

structural_hash = tvm_ffi.structural_hash
PassContext = tvm.transform.PassContext
Sequential = tvm.transform.Sequential


def versions() -> dict[str, str]:
    """Versions of TVM and its FFI, recorded in every manifest."""
    import importlib.metadata as md

    out = {"tvm": tvm.__version__}
    try:
        out["tvm_ffi"] = md.version("apache-tvm-ffi")
    except md.PackageNotFoundError:
        out["tvm_ffi"] = "unknown"
    return out


def dlight_gpu_rules() -> list:
    g = dlight.gpu
    return [g.Matmul(), g.GEMV(), g.Reduction(), g.GeneralReduction(), g.Fallback()]


def dlight_cpu_rules() -> list:
    c = dlight.cpu
    return [c.GEMV(), c.Reduction()]

from tvm.ir.utils import derived_object  # noqa: E402,F401  (Python subclasses of MetaSchedule objects)
