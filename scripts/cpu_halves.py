"""Split the CPUs this process may use into two halves of whole physical
cores, for scripts/gpu_halves.sh: SMT siblings (two logical CPUs of one core)
stay in the same half, so one half's busy threads do not share a core with
the other's. Linux often numbers siblings N and N + cores/2, so halving the
list of logical CPUs by index can put every core in both halves.

    python3 scripts/cpu_halves.py [--sysfs /sys/devices/system/cpu]

prints two lines, the CPU lists of half a and half b (comma-separated), then
one line per core ("core P:C cpus 3,19") on stderr. Without readable topology
it falls back to halving by index, and says so on stderr.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def cores(cpus: list[int], sysfs: Path) -> list[tuple[tuple[int, int], list[int]]] | None:
    """(package, core) -> its CPUs among `cpus`, in CPU order; None when the topology is not readable."""
    by: dict[tuple[int, int], list[int]] = {}
    try:
        for c in cpus:
            topo = sysfs / f"cpu{c}" / "topology"
            key = (int((topo / "physical_package_id").read_text()), int((topo / "core_id").read_text()))
            by.setdefault(key, []).append(c)
    except (OSError, ValueError):
        return None
    return sorted(by.items(), key=lambda kv: min(kv[1]))


def halves(cpus: list[int], sysfs: Path) -> tuple[list[int], list[int], list[str]]:
    groups = cores(cpus, sysfs)
    if groups is None or len(groups) < 2:
        h = len(cpus) // 2
        return cpus[:h], cpus[h:], [f"no core topology (or one core): halved {len(cpus)} CPUs by index"]
    h = len(groups) // 2
    a = sorted(c for _, cs in groups[:h] for c in cs)
    b = sorted(c for _, cs in groups[h:] for c in cs)
    return a, b, [f"core {p}:{k} cpus {','.join(map(str, cs))}" for (p, k), cs in groups]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sysfs", default="/sys/devices/system/cpu")
    ap.add_argument("--cpus", help="comma-separated CPUs (default: this process's affinity)")
    args = ap.parse_args()
    cpus = sorted(int(c) for c in args.cpus.split(",")) if args.cpus else sorted(os.sched_getaffinity(0))
    a, b, info = halves(cpus, Path(args.sysfs))
    if not a or not b:
        print(f"error: cannot split {len(cpus)} CPU(s) into two halves", file=sys.stderr)
        return 2
    print(",".join(map(str, a)))
    print(",".join(map(str, b)))
    print("\n".join(info), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
