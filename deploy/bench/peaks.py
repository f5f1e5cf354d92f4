"""The ceilings a kernel is measured against: each GPU's datasheet peak
arithmetic rate (dense, no sparsity) and memory bandwidth, and the roofline
of a kernel from its FLOPs and bytes.

A kernel's roofline time is the longer of its FLOPs at the peak rate and its
bytes at the peak bandwidth (`bound` says which); `of_roofline` is that time
over the measured one: 100% is as fast as the GPU allows, and the time above
the roofline (`loss`) is what tuning or a better kernel could win back.
TVM's FLOP estimate and "each argument read or written once" make the
roofline an optimistic floor, not a target every kernel can reach.

Figures from NVIDIA's datasheets (SXM parts): fp16 is the dense tensor-core
rate with fp32 accumulation, fp32 the CUDA-core rate. Unknown GPUs and CPUs
get no ceiling (the report leaves the columns out).
"""

from __future__ import annotations

# name fragment (lower case) -> (fp16 tensor TFLOP/s, fp32 TFLOP/s, memory TB/s)
GPUS = {
    "h200": (989.4, 66.9, 4.8),
    "h100": (989.4, 66.9, 3.35),
    "a100": (312.0, 19.5, 2.04),
    "l40s": (362.1, 91.6, 0.864),
    "l4": (121.0, 30.3, 0.3),
}


def ceilings(device_name: str, precision: str) -> dict | None:
    """{"flops_per_s", "bytes_per_s", "source"} of this device at this
    precision, or None where the device is not in the table."""
    name = (device_name or "").lower()
    for key in sorted(GPUS, key=len, reverse=True):  # "l40s" before "l4"
        if key in name:
            fp16, fp32, tbs = GPUS[key]
            tflops = fp16 if precision == "fp16" else fp32
            return {"flops_per_s": tflops * 1e12, "bytes_per_s": tbs * 1e12,
                    "source": f"{key.upper()} datasheet: {tflops:g} TFLOP/s {precision}, {tbs:g} TB/s"}
    return None


def roofline(flops: float, nbytes: float, seconds: float, peaks: dict) -> dict:
    """A kernel call's roofline against `peaks` (from `ceilings`)."""
    t_compute = flops / peaks["flops_per_s"]
    t_memory = nbytes / peaks["bytes_per_s"]
    floor = max(t_compute, t_memory)
    return {"bound": "compute" if t_compute >= t_memory else "memory",
            "roofline_s": floor,
            "of_roofline": floor / seconds if seconds > 0 else 0.0}
