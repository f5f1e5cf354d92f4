"""How long NVRTC takes to compile real MetaSchedule candidates' CUDA code for
sm_90, where that time goes, and which compile options shorten it without
changing the kernel. Runs on a CPU machine: NVRTC needs no GPU.

On a machine without a CUDA driver `tvm.tirx.build` returns a CUDA fallback
module without compiling, so the tuner's real compile is never timed there.
This script takes measured records of committed tuning databases, replays and
builds each with the tuner's own build (deploy.tuning.builder.lean_build: same pass
context), reads the generated CUDA source back from the module
(inspect_source("cuda")), and then, in one fresh process per database and
option set (a build worker's life: one process compiling candidate after
candidate), compiles every source through TVM's own callback
(tvm.support.nvcc.tvm_callback_cuda_compile under the database's target),
the way a build worker does on the GPU machine.

    PYTHONPATH=/tmp/nvrtc-site LD_LIBRARY_PATH=/tmp/nvrtc-site/nvidia/cu13/lib \\
    .venv/bin/python scripts/nvrtc_profile.py --candidates 16 \\
        --database tuning_logs/resnet50/cuda-sm_90-nvidia-h200/fp16-nhwc-b1 \\
        --database tuning_logs/resnet50/cuda-sm_90-nvidia-h200/fp16-nhwc-b64 \\
        --database tuning_logs/resnet50/cuda-sm_90-nvidia-h200/fp32-nhwc-b1 \\
        --out results/cpu/2026-11-30/nvrtc-compile

(cuda-bindings and nvidia-cuda-nvrtc installed with `pip install --target
/tmp/nvrtc-site`; see the results' README.) Per option set it reports the
seconds per candidate, and whether each cubin's SASS is that of TVM's
default options (cuobjdump -sass). The `split` pass compiles the exact
program and options TVM passes to NVRTC three times: front end only
(--fdevice-syntax-only), to PTX, and to cubin, each with NVRTC's --time
table, so the front end, NVVM (optimizer + PTX translation) and ptxas
shares come out.

Writes results.json (every number) and results.md under --out; sources and
cubins go to --work (default under /tmp).
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

# The headers TVM's CUDA sources include (its NVRTC preamble and the codegen's
# own; cuda_fp16.h in fp16 sources): pre-included, NVRTC's automatic PCH can
# cover them.
PRE_INCLUDES = ["cuda/std/cstdint", "cuda/std/limits", "cuda/std/type_traits", "cuda_fp16.h"]
PRE = " ".join(f"-include {h}" for h in PRE_INCLUDES)

# name -> (environment for the compiling process, expected to keep the code?)
VARIANTS = {
    "tvm": ({}, True),  # TVM 0.27's defaults: the reference
    "pch": ({"TVM_CUDA_NVRTC_EXTRA_OPTS": "-pch"}, True),
    "preinclude": ({"TVM_CUDA_NVRTC_EXTRA_OPTS": PRE}, True),
    "pch-preinclude": ({"TVM_CUDA_NVRTC_EXTRA_OPTS": f"-pch {PRE}"}, True),
    "minimal": ({"TVM_CUDA_NVRTC_EXTRA_OPTS": "--minimal"}, True),
    "dopt-on": ({"TVM_CUDA_NVRTC_EXTRA_OPTS": "-dopt=on"}, True),
    "no-ptxas-v": ({"NVRTC_PROFILE_DROP_PTXAS_V": "1"}, True),
    "ptxas-O1": ({"TVM_CUDA_PTXAS_EXTRA_OPTS": "-O1"}, False),
    "ofc-max": ({"TVM_CUDA_NVRTC_EXTRA_OPTS": "-Ofc=max"}, False),
    "nvcc": ({"TVM_CUDA_COMPILE_MODE": "nvcc"}, True),
}
DEFAULT_VARIANTS = "tvm,pch,preinclude,pch-preinclude,minimal,dopt-on,no-ptxas-v,ptxas-O1,ofc-max,nvcc"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--database", action="append", help="a tuning database folder (repeatable)")
    ap.add_argument("--candidates", type=int, default=16, help="records per database, spread over its workloads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"comma-separated, of: {', '.join(VARIANTS)}")
    ap.add_argument("--no-split", action="store_true", help="skip the front end / NVVM / ptxas split")
    ap.add_argument("--work", default="/tmp/nvrtc-profile", help="sources and cubins (reused when present)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--compile-worker", help=argparse.SUPPRESS)  # internal: one process's compiles
    args = ap.parse_args()
    if args.compile_worker:
        return _compile_worker(json.loads(Path(args.compile_worker).read_text()))
    if not args.database:
        ap.error("--database is required")
    _cuda_env()
    nvrtc_version = _check_nvrtc()
    work = Path(args.work)
    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        if v not in VARIANTS:
            ap.error(f"unknown variant {v}")
    if "tvm" not in variants:
        variants.insert(0, "tvm")
    cuobjdump = _tool("cuobjdump")

    report: dict = {"nvrtc": nvrtc_version, "cuda_path": os.environ.get("CUDA_PATH"), "cpus": os.cpu_count(),
                    "pre_includes": PRE_INCLUDES, "variants": {v: VARIANTS[v][0] for v in variants},
                    "cuobjdump": cuobjdump, "databases": {}}
    for folder in args.database:
        name = Path(folder).name
        src_dir = work / "sources" / name
        index = _capture(Path(folder), src_dir, args.candidates, args.seed)
        db: dict = {"folder": folder, "candidates": index, "variants": {}}
        for v in variants:
            print(f"{name}: {v} ...", flush=True)
            db["variants"][v] = _run_worker(work, name, index, src_dir, v, "compile")
        if not args.no_split:
            print(f"{name}: split ...", flush=True)
            db["split"] = _run_worker(work, name, index, src_dir, "tvm", "split")
        for v in variants:
            db["variants"][v]["sass"] = _compare(db["variants"]["tvm"], db["variants"][v], cuobjdump)
        report["databases"][name] = db
    return _write(args, report)


# ------------------------------------------------------------ sources ---


def _capture(folder: Path, dest: Path, n: int, seed: int) -> list[dict]:
    """n measured records of the database, round-robin over its workloads
    (most records first, a random record of each), built with the tuner's
    lean_build; their CUDA source saved under dest. Reused when dest holds
    the same selection."""
    idx_path = dest / "index.json"
    if idx_path.is_file():
        index = json.loads(idx_path.read_text())
        if index.get("n") == n and index.get("seed") == seed:
            return index["candidates"]
    from deploy.tuning import builder as tune_builder
    from deploy.tuning import database as dbs
    from deploy.tuning import tasks as tune_tasks
    from deploy.tvm_compat import Target, tvm

    key = json.loads((folder / "key.json").read_text())
    target_json = key["target"]["target"]
    tgt = Target(json.loads(target_json))
    workloads = dbs._packed_lines(folder / (dbs.WORKLOADS + dbs.PACKED))
    records = dbs._packed_lines(folder / (dbs.RECORDS + dbs.PACKED))
    by: dict[int, list[str]] = {}
    for line in records:
        by.setdefault(json.loads(line)[0], []).append(line)
    rng = np.random.default_rng(seed)
    order = sorted(by, key=lambda w: -len(by[w]))
    for w in order:
        rng.shuffle(by[w])
    picked: list[tuple[int, str]] = []
    rank = 0
    while len(picked) < min(n, len(records)):
        for w in order:
            if rank < len(by[w]) and len(picked) < n:
                picked.append((w, by[w][rank]))
        rank += 1
    tmp = Path(tempfile.mkdtemp(prefix="nvrtc-profile-db-"))
    (tmp / dbs.WORKLOADS).write_text("".join(ln + "\n" for ln in workloads))
    (tmp / dbs.RECORDS).write_text("".join(line + "\n" for _, line in picked))
    t0 = time.perf_counter()
    recs = list(dbs._json_database(tmp).get_all_tuning_records())  # in file order
    print(f"{folder.name}: {len(recs)} records parsed in {time.perf_counter() - t0:.0f} s", flush=True)
    shutil.rmtree(tmp, ignore_errors=True)
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    out = []
    for i, ((w, _), r) in enumerate(zip(picked, recs)):
        sch = tvm.s_tir.Schedule(r.workload.mod)
        r.trace.apply_to_schedule(sch, remove_postproc=False)
        t0 = time.perf_counter()
        try:
            mod = tune_builder.lean_build(sch.mod, tgt, None)
        except Exception as e:  # noqa: BLE001  a candidate that does not build is skipped, and said
            out.append({"i": i, "workload": w, "error": tune_tasks._failure_reason(str(e))})
            continue
        lower_s = time.perf_counter() - t0
        code = "".join(m.inspect_source("cuda") for m in mod.imports if m.kind == "cuda")
        path = dest / f"{i:03d}.cu"
        path.write_text(code)
        out.append({"i": i, "workload": w, "file": path.name, "chars": len(code), "lower_s": round(lower_s, 3),
                    "includes": sorted({ln.strip() for ln in code.splitlines() if ln.strip().startswith("#include")})})
    idx_path.write_text(json.dumps({"n": n, "seed": seed, "target": target_json, "candidates": out}, indent=1))
    return out


# ------------------------------------------------------------ compiling ---


def _run_worker(work: Path, name: str, index: list[dict], src_dir: Path, variant: str, mode: str) -> dict:
    """One fresh process (a build worker's life) compiling every source of a
    database in turn under `variant`'s environment."""
    target_json = json.loads((src_dir / "index.json").read_text())["target"] if (src_dir / "index.json").is_file() else None
    cubins = work / "cubins" / name / (variant if mode == "compile" else "split")
    if cubins.exists():
        shutil.rmtree(cubins)
    cubins.mkdir(parents=True)
    spec = {"mode": mode, "target": target_json, "out": str(cubins),
            "sources": [str(src_dir / c["file"]) for c in index if "file" in c]}
    spec_path = cubins / "spec.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ)
    for k in ("TVM_CUDA_NVRTC_EXTRA_OPTS", "TVM_CUDA_PTXAS_EXTRA_OPTS", "TVM_CUDA_PTXAS_REG_LEVEL",
              "TVM_CUDA_COMPILE_MODE", "TVM_KERNEL_DUMP", "NVRTC_PROFILE_DROP_PTXAS_V"):
        env.pop(k, None)
    env.update(VARIANTS[variant][0])
    # NVRTC's automatic PCH files go to $TMPDIR/__nvrtc_auto_pch_<pid>_*: kept apart here.
    env["TMPDIR"] = str(cubins / "tmp")
    (cubins / "tmp").mkdir()
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--out", str(cubins), "--compile-worker", str(spec_path)],
                          env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout)[-3000:], "process_s": round(wall, 2)}
    res = json.loads((cubins / "result.json").read_text())
    res["process_s"] = round(wall, 2)
    res["dir"] = str(cubins)
    res["pch_dir_bytes"] = sum(p.stat().st_size for p in (cubins / "tmp").rglob("*") if p.is_file())
    shutil.rmtree(cubins / "tmp", ignore_errors=True)
    return res


def _compile_worker(spec: dict) -> int:
    """In the fresh process: compile each source as TVM's callback does (or
    split it into phases), timing each."""
    import tvm
    from tvm.support import nvcc

    if os.environ.get("NVRTC_PROFILE_DROP_PTXAS_V"):
        base = nvcc._ptxas_option_flags
        nvcc._ptxas_option_flags = lambda: [f for f in base() if f != "-v"]
    out = Path(spec["out"])
    target = tvm.target.Target(json.loads(spec["target"]))
    rows = []
    t_import = time.perf_counter()
    for src in spec["sources"]:
        code = Path(src).read_text()
        row: dict = {"file": Path(src).name}
        with target:
            if spec["mode"] == "compile":
                t0 = time.perf_counter()
                try:
                    binary = nvcc.tvm_callback_cuda_compile(code)
                except Exception as e:  # noqa: BLE001
                    row["error"] = str(e)[-1500:]
                    rows.append(row)
                    continue
                row["s"] = time.perf_counter() - t0
                path = out / (Path(src).stem + ".bin")
                path.write_bytes(bytes(binary))
                row["bin"] = path.name
                row["sha1"] = hashlib.sha1(bytes(binary)).hexdigest()
            else:
                row.update(_split(nvcc, code, out))
        rows.append(row)
    (out / "result.json").write_text(json.dumps({"rows": rows, "loop_s": time.perf_counter() - t_import}))
    return 0


def _split(nvcc, code: str, out: Path) -> dict:
    """The exact program and options TVM hands NVRTC (caught at
    nvrtcCompileProgram), compiled front-end-only, to PTX and to cubin, each
    with NVRTC's --time table (milliseconds per phase)."""
    from cuda.bindings import nvrtc

    caught: dict = {}
    create, compile_ = nvrtc.nvrtcCreateProgram, nvrtc.nvrtcCompileProgram

    def _create(src, name, *a):
        caught["src"], caught["name"] = src, name
        return create(src, name, *a)

    def _compile(prog, n, opts):
        caught["opts"] = list(opts)
        return compile_(prog, n, opts)

    nvrtc.nvrtcCreateProgram, nvrtc.nvrtcCompileProgram = _create, _compile
    try:
        nvcc.compile_cuda(code, target_format="cubin", compiler="nvrtc")  # warms the process too
    finally:
        nvrtc.nvrtcCreateProgram, nvrtc.nvrtcCompileProgram = create, compile_
    opts = caught["opts"]
    ptx_opts = [o.replace(b"=sm_", b"=compute_") if o.startswith(b"--gpu-architecture=") else o for o in opts]
    res = {}
    for what, extra in (("frontend", [b"--fdevice-syntax-only"]), ("ptx", []), ("cubin", [])):
        table = out / f"time-{what}.csv"
        o = (ptx_opts if what == "ptx" else opts) + extra + [f"--time={table}".encode()]
        _, prog = create(caught["src"], caught["name"], 0, None, None)
        t0 = time.perf_counter()
        (r,) = compile_(prog, len(o), o)
        res[f"{what}_s"] = time.perf_counter() - t0
        nvrtc.nvrtcDestroyProgram(prog)
        if r != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            res[f"{what}_error"] = str(r)
            continue
        with open(table) as f:
            res[f"{what}_ms"] = {row[1].strip(): float(row[2]) for row in list(csv.reader(f))[1:] if len(row) >= 3}
    return res


# ------------------------------------------------------------ SASS ---


def _compare(ref: dict, got: dict, cuobjdump: str | None) -> dict:
    """Per candidate: same bytes as the reference, else same SASS
    (cuobjdump -sass, file-name lines dropped), else different."""
    if "rows" not in ref or "rows" not in got:
        return {}
    refs = {r["file"]: r for r in ref["rows"] if "bin" in r}
    counts = {"same_bytes": 0, "same_sass": 0, "different": 0, "unchecked": 0}
    for r in got["rows"]:
        a = refs.get(r["file"])
        if a is None or "bin" not in r:
            counts["unchecked"] += 1
        elif a["sha1"] == r["sha1"]:
            counts["same_bytes"] += 1
        elif cuobjdump is None:
            counts["unchecked"] += 1
        else:
            sa, sb = (_sass(cuobjdump, Path(d) / x["bin"]) for d, x in ((ref["dir"], a), (got["dir"], r)))
            counts["same_sass" if sa == sb and sa else "different"] += 1
    return counts


def _sass(cuobjdump: str, path: Path) -> str:
    p = subprocess.run([cuobjdump, "-sass", str(path)], capture_output=True, text=True)
    keep = [ln for ln in p.stdout.splitlines() if "code for sm_" in ln or ln.strip().startswith(("/*", "Function"))]
    return "\n".join(keep)


def _tool(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for base in sys.path + ["/usr/local/cuda/bin"]:
        for cand in (Path(base) / "nvidia" / "cu13" / "bin" / name, Path(base) / name):
            if cand.is_file():
                return str(cand)
    return None


def _cuda_env() -> None:
    """CUDA_PATH as on the GPU machine (scripts/gpu_env.sh): TVM's
    find_cuda_path otherwise derives it from `which nvcc`, wrong for a
    wrapper script such as /usr/local/bin/nvcc."""
    for c in ("/usr/local/cuda", "/usr/local/cuda-13.0", "/usr/local/cuda-13"):
        if not os.environ.get("CUDA_PATH") and os.path.isdir(f"{c}/include"):
            os.environ["CUDA_PATH"] = c
    # TVM's nvcc mode runs `nvcc` from PATH: the toolkit's.
    if os.environ.get("CUDA_PATH"):
        os.environ["PATH"] = f"{os.environ['CUDA_PATH']}/bin:{os.environ.get('PATH', '')}"


def _check_nvrtc() -> str:
    try:
        from cuda.bindings import nvrtc

        r, major, minor = nvrtc.nvrtcVersion()
    except Exception as e:  # noqa: BLE001
        raise SystemExit(f"NVRTC cannot be loaded ({type(e).__name__}: {e}); put cuda-bindings on PYTHONPATH "
                         "and libnvrtc.so.13 on LD_LIBRARY_PATH") from None
    return f"{major}.{minor}"


# ------------------------------------------------------------ report ---


def _stats(xs: list[float]) -> dict:
    a = np.asarray(xs, dtype=float)
    if a.size == 0:
        return {}
    return {"n": int(a.size), "p50": round(float(np.median(a)), 3), "p90": round(float(np.percentile(a, 90)), 3),
            "max": round(float(a.max()), 3), "mean": round(float(a.mean()), 3)}


def _write(args, report: dict) -> int:
    import results_files

    lines = ["# NVRTC compile time of real tuning candidates, sm_90, one process per database and option set", "",
             f"NVRTC {report['nvrtc']}, {report['cpus']} CPUs, one compile at a time. `first`: the process's first "
             "compile (library load, PCH creation); `p50`/`p90`/`mean`: all candidates; `rest p50`: the 2nd onwards. "
             "SASS: candidates whose cubin has the same bytes / the same SASS as TVM's defaults / different.", "",
             "| database | option set | n | first s | p50 s | p90 s | mean s | rest p50 s | same bytes / same SASS / different |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, db in report["databases"].items():
        for v, res in db["variants"].items():
            if "rows" not in res:
                lines.append(f"| {name} | {v} | failed: {res.get('error', '')[-120:]!r} | | | | | | |")
                continue
            ok = [r for r in res["rows"] if "s" in r]
            s_all = _stats([r["s"] for r in ok])
            s_rest = _stats([r["s"] for r in ok[1:]])
            res["stats"], res["stats_rest"] = s_all, s_rest
            res["first_s"] = round(ok[0]["s"], 3) if ok else None
            failed = len(res["rows"]) - len(ok)
            sass = res.get("sass", {})
            sass_txt = f"{sass.get('same_bytes', 0)} / {sass.get('same_sass', 0)} / {sass.get('different', 0)}"
            if sass.get("unchecked"):
                sass_txt += f" ({sass['unchecked']} unchecked)"
            lines.append(f"| {name} | {v}{' (%d failed)' % failed if failed else ''} | {s_all.get('n', 0)} | "
                         f"{res['first_s']} | {s_all.get('p50')} | {s_all.get('p90')} | {s_all.get('mean')} | "
                         f"{s_rest.get('p50')} | {sass_txt} |")
    lines += ["", "## Where TVM's default NVRTC compile goes (p50 over candidates)", "",
              "Front end: `--fdevice-syntax-only` wall (preprocessing, parsing, templates). NVVM: the `NVVM Optimizer` "
              "+ `PTX Translation` rows of NVRTC's `--time` table for the cubin compile. ptxas: cubin wall minus "
              "PTX-only wall.", "",
              "| database | n | cubin s | front end s | --time front end s | NVVM s | ptxas s | front end share |",
              "|---|---|---|---|---|---|---|---|"]
    for name, db in report["databases"].items():
        rows = [r for r in db.get("split", {}).get("rows", []) if "cubin_ms" in r and "ptx_s" in r]
        if not rows:
            continue
        cub = [r["cubin_s"] for r in rows]
        fe = [r["frontend_s"] for r in rows]
        fe_t = [r["cubin_ms"].get("CUDA C++ Frontend", 0) / 1e3 for r in rows]
        nvvm = [(r["cubin_ms"].get("NVVM Optimizer", 0) + r["cubin_ms"].get("PTX Translation", 0)) / 1e3 for r in rows]
        ptxas = [max(0.0, r["cubin_s"] - r["ptx_s"]) for r in rows]
        share = [f / c for f, c in zip(fe, cub)]
        split = {"cubin_s": _stats(cub), "frontend_s": _stats(fe), "frontend_time_table_s": _stats(fe_t),
                 "nvvm_s": _stats(nvvm), "ptxas_s": _stats(ptxas), "frontend_share": _stats(share)}
        db["split"]["stats"] = split
        lines.append(f"| {name} | {len(rows)} | {split['cubin_s']['p50']} | {split['frontend_s']['p50']} | "
                     f"{split['frontend_time_table_s']['p50']} | {split['nvvm_s']['p50']} | {split['ptxas_s']['p50']} | "
                     f"{split['frontend_share']['p50']:.0%} |")
    return results_files.write(args.out, report, lines)


if __name__ == "__main__":
    raise SystemExit(main())
