"""What a tuning database holds, one line per workload: its buffers' shapes,
how many records, the best record's mean time, which tensor-core
instructions that record uses (wmma, mma.sync through ldmatrix, or none), and
the kernel's default-schedule time where the kernel check timed it
(database_checks.json). Reads the committed, compressed database; needs no
device.

    python3 scripts/db_kernels.py tuning_logs/resnet50/cuda-sm_90-nvidia-h200/fp16-nhwc-b64 [--json out.json]

Used to see whether the mma.sync candidates of `--flat-gemm` ever won against
WMMA (results/h200/2026-12-03/resnet50-fp16-b64-flat-gemm/).
"""

from __future__ import annotations

import argparse
import json
import lzma
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def tensor_core_kind(trace_json: str) -> str:
    """'wmma', 'mma' (mma.sync fed by ldmatrix) or '-' from a record's trace."""
    names = set(re.findall(r'"((?:wmma|mma|ldmatrix)[a-z0-9_]*)"', trace_json))
    if any(n.startswith("wmma") for n in names):
        return "wmma"
    if any(n.startswith(("mma", "ldmatrix")) for n in names):
        return "mma"
    return "-"


def shapes(script: str) -> list[str]:
    """The buffers' shapes of a PrimFunc's TVMScript, e.g. ['64,56,56,64', ...]."""
    found = re.findall(r'T\.Buffer\(\((.*?)\), "', script)
    return [re.sub(r"T\.int64\((\d+)\)", r"\1", s).replace(" ", "").rstrip(",") for s in found]


def rows(folder: Path) -> list[dict]:
    from deploy.tvm_compat import ms, register_tensor_intrinsics

    register_tensor_intrinsics()  # (traces name TVM's tensor intrinsics)
    from deploy.tuning import check

    state = check.read(folder)  # (timings dropped when made under another default chain)
    default_us = {e["workload"]: e["default_us"] for e in state["default_faster"]}  # (the check's, where it lost)
    default_us.update(state.get("default_us", {}))  # (the tune stage's timing of every default)
    with tempfile.TemporaryDirectory() as tmp:
        paths = {}
        for name in ("database_workload.json", "database_tuning_record.json"):
            src = folder / (name + ".xz")
            paths[name] = Path(tmp) / name
            paths[name].write_text(lzma.open(src, "rt").read() if src.is_file() else (folder / name).read_text())
        records = [json.loads(ln) for ln in paths["database_tuning_record.json"].read_text().splitlines() if ln.strip()]
        by_workload: dict[int, list] = {}
        for wi, rec in records:
            by_workload.setdefault(wi, []).append(rec)
        out = []
        for wi, line in enumerate(ln for ln in paths["database_workload.json"].read_text().splitlines() if ln.strip()):
            shash = json.loads(line)[0]
            workload = ms.database.Workload.from_json(json.loads(line))
            recs = by_workload.get(wi, [])
            ran = [(sum(r[1]) / len(r[1]), r) for r in recs if r[1] and max(r[1]) < 1e9]  # (1e10: a failed run)
            best_us = kind = None
            if ran:
                secs, rec = min(ran, key=lambda t: t[0])
                best_us, kind = round(secs * 1e6, 2), tensor_core_kind(json.dumps(rec[0]))
            out.append({"workload": shash, "shapes": shapes(workload.mod.script()), "records": len(recs),
                        "best_us": best_us, "tensor_cores": kind, "default_us": default_us.get(shash)})
        return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path, help="a database folder (…/<target>/<profile>-b<batch>)")
    ap.add_argument("--json", type=Path, help="also write the rows to this file")
    a = ap.parse_args(argv)
    if not (a.folder / "database_workload.json.xz").is_file() and not (a.folder / "database_workload.json").is_file():
        print(f"error: no tuning database in {a.folder} | expected database_workload.json(.xz) there", file=sys.stderr)
        return 2
    got = rows(a.folder)
    print("| workload | buffers | records | best us | tensor cores | default us |")
    print("|---|---|---|---|---|---|")
    for r in got:
        print(f"| {r['workload']} | {' '.join(r['shapes'])} | {r['records']} | {r['best_us']} | {r['tensor_cores']} "
              f"| {r['default_us'] if r['default_us'] is not None else ''} |")
    if a.json:
        a.json.write_text(json.dumps(got, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
