"""Every kernel of the corpus that one of our CUDA default rules takes, checked
on the CPU machine: run in emulation (tests/cuda_emu.py) against TVM's plain
lowering of it for the CPU, and its CUDA compiled by nvcc for sm_90 (a build
here generates CUDA source without compiling it). Reads the optimized modules
a corpus run left in its workdirs (`scripts/corpus.py --work WORK`).

    python scripts/rule_kernels.py WORK RULE [--nvcc-only] [--models a,b] [--rtol R]
    python scripts/rule_kernels.py /tmp/w1 vector-rows          # every kernel vector-rows takes at batch 1

RULE is a source name of `deploy.passes.schedule` (`vector-rows`,
`short-inner-axis`, ...): the kernels whose first working source in the CUDA
chain it is. `--nvcc-only` skips the emulation (large kernels: it runs each
thread block in Python). Kernels with buffers the emulator does not hold
(int64, bool) are compiled only. Exit 1 where a kernel differs, the emulation
finds a problem (but TVM's benign allreduce read, `tests/emulation.BENIGN`) or
nvcc fails; 2 on a bad argument. `--rtol`: outputs within R of the largest
pass (a rule that sums in another order than the plain lowering).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

EMULATED_DTYPES = ("float16", "float32")


def nvcc_error(src: str) -> str | None:
    """nvcc's first error line for `src` compiled for sm_90; None where it compiles."""
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "k.cu").write_text(src)
        done = subprocess.run(["nvcc", "-arch=sm_90", "-c", f"{d}/k.cu", "-o", f"{d}/k.o"],
                              capture_output=True, text=True)
    if done.returncode == 0:
        return None
    lines = [ln for ln in done.stderr.splitlines() if "error" in ln] or done.stderr.splitlines() or ["nvcc failed"]
    return lines[0].strip()[:200]


def check(func, sch, target, emulate: bool, rtol: float = 0.0) -> tuple[str, bool]:
    """(what was found, whether the kernel passed): equal bit for bit to
    TVM's plain lowering, or with `rtol` within it of the largest output
    (a rule that sums in another order), and no problem but the benign
    ones (`emulation.BENIGN`)."""
    import numpy as np

    from tests import emulation

    scheduled = sch.mod["main"] if hasattr(sch, "mod") else sch
    found = []
    ok = True
    if emulate and all(str(b.dtype) in EMULATED_DTYPES for b in func.params):
        args = emulation.reference(func)  # (its output, the last, as TVM's plain lowering writes it)
        try:
            got, problems = emulation.run(func, scheduled, target, args)
            equal = np.array_equal(got, args[-1])
            diff = float(np.abs(got.astype(np.float64) - args[-1]).max(initial=0.0))
            close = diff <= rtol * float(np.abs(args[-1].astype(np.float64)).max(initial=0.0))
            found.append("equal" if equal else f"{'close' if close else 'DIFFERENT'} (at most {diff:.2g} apart)")
            real = emulation.real_problems(problems)
            ok = (equal or close) and not real
            found += sorted(real) + [f"benign: {p}" for p in sorted(problems - real)]
        except Exception as e:  # noqa: BLE001 - the emulator's limits, not the kernel's
            found.append(f"not emulated ({type(e).__name__}: {str(e)[:80]})")
    elif emulate:
        found.append("not emulated (a buffer of " + ", ".join(sorted({str(b.dtype) for b in func.params})) + ")")
    error = nvcc_error(emulation.source(scheduled, target))
    found.append("nvcc ok" if error is None else f"NVCC: {error}")
    return "; ".join(found), ok and error is None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("work", type=Path, help="a corpus run's --work folder")
    ap.add_argument("rule", help="a source name of deploy.passes.schedule, e.g. vector-rows")
    ap.add_argument("--nvcc-only", action="store_true", help="compile only, no emulation")
    ap.add_argument("--models", default="", help="comma list (default: every model in WORK)")
    ap.add_argument("--rtol", type=float, default=0.0,
                    help="pass outputs within this of the largest output (default 0: bit for bit; a rule summing "
                         "in another order differs in the last bits, e.g. 1e-6 in fp32)")
    args = ap.parse_args(argv)

    from deploy import targets
    from deploy.passes import schedule
    from deploy.tvm_compat import load_json, tirx

    sources = {name for name, _ in schedule.rules("cuda")}
    if args.rule not in sources:
        print(f"error: unknown rule '{args.rule}' | one of {', '.join(sorted(sources))}", file=sys.stderr)
        return 2
    paths = sorted(args.work.glob("*/optimize/b*.relax.json"))
    wanted = {m for m in args.models.split(",") if m}
    paths = [p for p in paths if not wanted or p.parents[1].name.rsplit("-", 1)[0] in wanted]
    if not paths:
        print(f"error: no optimized module under {args.work} | give a corpus run's --work folder", file=sys.stderr)
        return 2
    target = targets.resolve("cuda:sm_90").tvm_target()
    checked = passed = 0
    for path in paths:
        mod = load_json(path.read_text())
        for gv, func in mod.functions.items():
            if not isinstance(func, tirx.PrimFunc):
                continue
            with target:
                got = next((s for s in schedule._sources(gv, func, None, target, "cuda")
                            if not isinstance(s[1], Exception)), None)
            if got is None or got[0] != args.rule:
                continue
            t0 = time.time()
            found, ok = check(func, got[1], target, not args.nvcc_only, args.rtol)
            checked += 1
            passed += ok
            print(f"{path.parents[1].name} {gv.name_hint}: {found} ({time.time() - t0:.1f} s)", flush=True)
    print(f"{passed} of {checked} kernels {args.rule} takes passed")
    return 0 if passed == checked else 1


if __name__ == "__main__":
    raise SystemExit(main())
