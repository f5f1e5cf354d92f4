"""The ceilings a kernel is measured against: each GPU's datasheet peak
arithmetic rate (dense, no sparsity) and memory bandwidth, and the roofline
of a kernel from its FLOPs and bytes.

A kernel's roofline time is the longer of its FLOPs at the peak rate and its
bytes at the peak bandwidth (`bound` says which); `of_roofline` is that time
over the measured one: 100% is as fast as the GPU allows, and the time above
the roofline (`loss`) is what tuning or a better kernel could win back.
TVM's FLOP estimate and "each argument read or written once" make the
roofline an optimistic floor, not a target every kernel can reach.

Figures from NVIDIA's datasheets (SXM parts unless the name says PCIe): fp16 is the dense tensor-core
rate with fp32 accumulation, tf32 the dense TF32 tensor-core rate, fp32 the CUDA-core rate. Unknown GPUs and CPUs
get no ceiling (the report leaves the columns out).
"""

from __future__ import annotations

import re

# A pattern on the GPU's name (lower case; the first that matches) ->
# (fp16 tensor TFLOP/s, tf32 tensor TFLOP/s, fp32 TFLOP/s, memory TB/s).
GPUS = [
    (r"\bh200\b", (989.4, 494.7, 66.9, 4.8)),
    (r"\bh100\b.*\bpcie\b", (756.0, 378.0, 51.2, 2.0)),
    (r"\bh100\b", (989.4, 494.7, 66.9, 3.35)),
    (r"\ba100\b.*\b80gb\b", (312.0, 156.0, 19.5, 2.04)),
    (r"\ba100\b", (312.0, 156.0, 19.5, 1.555)),
    (r"\bl40s\b", (362.1, 183.0, 91.6, 0.864)),
    (r"\bl40\b", (181.0, 90.5, 90.5, 0.864)),
    (r"\bl4\b", (121.0, 60.0, 30.3, 0.3)),
]


def ceilings(device_name: str, precision: str) -> dict | None:
    """{"flops_per_s", "bytes_per_s", "source"} of this device at this
    precision, or None where the device is not in the table."""
    name = (device_name or "").lower()
    for pattern, (fp16, tf32, fp32, tbs) in GPUS:
        if re.search(pattern, name):
            tflops = {"fp16": fp16, "tf32": tf32}.get(precision, fp32)
            return {"flops_per_s": tflops * 1e12, "bytes_per_s": tbs * 1e12,
                    "source": f"{device_name} datasheet: {tflops:g} TFLOP/s {precision}, {tbs:g} TB/s"}
    return None


def roofline(flops: float, nbytes: float, seconds: float, peaks: dict) -> dict:
    """A kernel call's roofline against `peaks` (from `ceilings`)."""
    t_compute = flops / peaks["flops_per_s"]
    t_memory = nbytes / peaks["bytes_per_s"]
    floor = max(t_compute, t_memory)
    return {"bound": "compute" if t_compute >= t_memory else "memory",
            "roofline_s": floor,
            "of_roofline": floor / seconds if seconds > 0 else 0.0}
