"""A kernel made to write out of bounds, run as `profile --debug-kernels` runs
a bucket: a device synchronization after every kernel names it, then one run
under compute-sanitizer says which thread wrote where. Needs a CUDA GPU.

    python scripts/kernel_fault_demo.py --out results/h200/DATE/kernel-fault

Prints the two one-line outcomes and writes them, with the sanitizer's full
report, to --out. Exit 0 when the fault was named (and memcheck either named
the kernel or said why it could not run), 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

KERNEL = "oob_write"
STRIDE = 1 << 22  # thread i writes 16 MiB * i past the output's start: far outside any allocation


def module():
    from tvm.script import ir as I
    from tvm.script import relax as R
    from tvm.script import tirx as T

    @I.ir_module
    class Mod:
        @T.prim_func(private=True, s_tir=True)
        def oob_write(A: T.Buffer((T.int64(256),), "float32"), B: T.Buffer((T.int64(256),), "float32")):
            T.func_attr({"tirx.noalias": True})
            for i in T.thread_binding(T.int64(256), thread="threadIdx.x"):
                with T.sblock("B"):
                    vi = T.axis.spatial(T.int64(256), i)
                    T.reads(A[vi])
                    T.writes(B[vi * T.int64(STRIDE)])
                    B[vi * T.int64(STRIDE)] = A[vi]

        @R.function
        def main(x: R.Tensor((256,), "float32")):
            with R.dataflow():
                y = R.call_tir(Mod.oob_write, (x,), out_ty=R.Tensor((256,), "float32"))
                R.output(y)
            return y

    return Mod


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from deploy.bench import profile, sanitize
    from deploy.errors import KernelFaultError
    from deploy.tvm_compat import VirtualMachine, load_module, tensor, tvm

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = tvm.cuda(0)
    if not dev.exist:
        print("error: no CUDA GPU visible", file=sys.stderr)
        return 2
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_" + dev.compute_version.replace(".", "")},
                               host={"kind": "llvm"})
    mod = module()
    x = np.arange(256, dtype="float32")
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        so = Path(tmp) / "oob.so"
        tvm.compile(mod, target=target).export_library(str(so))
        vm = VirtualMachine(load_module(str(so)), dev)
        try:
            calls = profile.run_synchronized(vm, dev, [tensor(x, dev)], {KERNEL: {}}, mod, out / "kernel-fault")
            result["debug_kernels"] = f"no fault in {calls} kernel call(s)"
        except KernelFaultError as e:
            result["debug_kernels"] = f"error: {e}"
        outcome = sanitize.run(so, [x], out)
        result["sanitizer"] = sanitize.describe(outcome)
        result["sanitizer_status"] = outcome["status"]
    for k in ("debug_kernels", "sanitizer"):
        print(f"{k}: {result[k]}")
    (out / "kernel_fault.json").write_text(json.dumps(result, indent=1) + "\n")
    named = f"kernel '{KERNEL}' faulted" in result["debug_kernels"]
    said = outcome["status"] == "unavailable" or (outcome["status"] == "error" and outcome["error"].get("tir") == KERNEL)
    return 0 if named and said else 1


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    os._exit(rc)  # the faulted CUDA context aborts the interpreter's teardown
