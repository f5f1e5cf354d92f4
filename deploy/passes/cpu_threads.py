"""Workaround: TVM's CPU thread pool uses half the cores of a machine without SMT.

Symptom: TVM sizes its CPU thread pool (`threading::MaxConcurrency()` in
`src/runtime/threading_backend.cc`) as `std::thread::hardware_concurrency()`
halved on x86-64, on the assumption that every core runs two hardware threads.
On a machine with one thread per core (most cloud VMs: this project's CPU
machine has 2 cores, 1 thread each) every CPU kernel runs on half the cores.
There, `tvm.runtime.num_threads()` is 1, and ResNet-50's tuned batch 1 took
126.3 ms on 1 thread against 79.8 ms on 2, the same package
(`results/cpu/2026-12-02/threads-resnet50-llvm/`).

Scope: the CPU thread pool of this process and of the processes it starts
(MetaSchedule's runners measure candidates in children, which inherit the
environment, so kernels are timed on the threads they will run on). Nothing
is set when the user set `TVM_NUM_THREADS` or `OMP_NUM_THREADS` (TVM reads
both); CUDA kernels do not use the pool.

Fix: when `tvm_compat` is first imported (it calls `configure()`), which
must come before TVM's first parallel call (TVM reads the variable when it
creates its pool; importing `tvm` first does not create it),
`TVM_NUM_THREADS` is set to the physical cores this process may run on: the
CPUs of its affinity mask divided by the threads per core. On an SMT machine
using all its cores this is what TVM picks itself.

Test: `tests/passes/test_cpu_threads.py` fails once plain TVM gives a
one-thread-per-core machine all its cores (then this module can go).
"""

from __future__ import annotations

import os

ENV = "TVM_NUM_THREADS"


def usable_cores() -> int:
    """Physical cores this process may run on."""
    try:
        allowed = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        allowed = os.cpu_count() or 1
    try:
        import psutil

        logical, physical = psutil.cpu_count(logical=True), psutil.cpu_count(logical=False)
    except Exception:  # noqa: BLE001 - psutil missing or unable to tell: count logical CPUs
        logical = physical = None
    per_core = max(1, round(logical / physical)) if logical and physical else 1
    return max(1, allowed // per_core)


def configure() -> int | None:
    """Set TVM_NUM_THREADS unless the user chose a thread count; returns the
    count set, or None when the user's (or an earlier call's) stands."""
    if os.environ.get(ENV) or os.environ.get("OMP_NUM_THREADS"):
        return None
    n = usable_cores()
    os.environ[ENV] = str(n)
    return n
