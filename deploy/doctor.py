"""`python -m deploy doctor`: can this machine build and run packages? One row
per fact, OK, WARN or FAIL, with a one-line fix (docs/diagnostics.md). A machine
without a GPU is a valid deployment (the CPU target): GPU rows WARN there. Exit 1
when a row FAILs; a check that raises is a FAIL row (`-v` logs its traceback)."""

from __future__ import annotations

import dataclasses
import importlib.metadata as md
import json
import logging
import os
import re
import shutil
import subprocess
from functools import cached_property
from pathlib import Path

from . import targets
from .artifacts import REPO_ROOT
from .errors import DeployError, TargetError

log = logging.getLogger(__name__)
OK, WARN, FAIL = "OK", "WARN", "FAIL"
# The pins when requirements.txt is not beside the code (an installed package);
# tests/test_doctor.py checks that they agree with requirements.txt.
PINS = {"apache-tvm": "0.27.0.post1", "apache-tvm-ffi": "0.1.14.post0", "torch": "2.13.0", "onnxruntime": "1.32.0"}
BAD_FFI = ("0.1.15", "segfaults in MetaSchedule (a trace's JSON) and in DLight's fp16 tensorize")
# A CUDA toolkit's libraries that a folder on LD_LIBRARY_PATH can shadow; libcuda (the driver's) only
# as a toolkit's stub or another driver's copy (the container runtime puts the right one there).
CUDA_LIBS = re.compile(r"^lib(cudart|nvrtc|nvrtc-builtins|nvJitLink|cuda)\.so(\.\d+)*$")


@dataclasses.dataclass(frozen=True)
class Row:
    check: str
    status: str  # OK | WARN | FAIL
    detail: str
    fix: str = ""


def installed_version(dist: str) -> str | None:
    """The installed version of a distribution; None when it is not installed."""
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def pins(path: Path | None = None) -> tuple[dict[str, str], str]:
    """(name -> pinned version, where from): the checkout's requirements.txt, else PINS."""
    path = REPO_ROOT / "requirements.txt" if path is None else path
    if not path.is_file():
        return dict(PINS), "built-in pins"
    found = {}
    for line in path.read_text().splitlines():
        if m := re.match(r"^\s*([A-Za-z0-9_.\-]+)(\[[^\]]*\])?\s*==\s*([^\s;#]+)", line):
            found[m.group(1).lower().replace("_", "-")] = m.group(3)
    return {**PINS, **found}, path.name


def _one_line(e: BaseException) -> str:
    """An exception in one line (TVM's errors end with their message)."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    text = (lines[-1] if len(lines) > 1 else lines[0]) if lines else ""
    name = type(e).__name__
    text = text if re.match(r"^\w*(Error|Exception)\b", text) else f"{name}: {text}" if text else name
    return text if len(text) <= 240 else text[:237] + "..."


def _ver(text: str | None) -> tuple[int, int] | None:
    m = re.search(r"(\d+)\.(\d+)", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def _v(t: tuple[int, int] | None) -> str:
    return "?" if t is None else f"{t[0]}.{t[1]}"


def _has_headers(root: Path) -> bool:
    """Whether NVRTC finds CUDA's headers under `root` where TVM looks (tvm.support.nvcc)."""
    return (root / "include" / "cuda_runtime.h").is_file() or any(root.glob("targets/*/include/cuda_runtime.h"))


def _wrapped_root(exe: str) -> Path | None:
    """The toolkit a wrapper script of nvcc runs (`exec /usr/local/cuda-13.0/bin/nvcc "$@"`)."""
    try:
        m = re.search(r"(/\S+)/bin/nvcc\b", Path(exe).read_text(errors="replace")[:4096])
    except (OSError, UnicodeError):
        return None
    return Path(m.group(1)) if m and _has_headers(Path(m.group(1))) else None


class Env:
    """What several checks read, probed once."""

    @cached_property
    def smi(self) -> list[dict] | None:
        """GPUs as nvidia-smi lists them: None without nvidia-smi, [] when it finds none."""
        if not (exe := shutil.which("nvidia-smi")):
            return None
        p = subprocess.run([exe, "--query-gpu=name,driver_version,compute_cap", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)
        if p.returncode != 0:
            if "no devices" in (p.stdout + p.stderr).lower():
                return []
            raise RuntimeError("nvidia-smi failed: " + ((p.stdout + p.stderr).strip().splitlines() or ["?"])[0])
        rows = [[c.strip() for c in ln.split(",")] for ln in p.stdout.strip().splitlines() if ln.strip()]
        return [{"name": r[0], "driver": r[1], "compute_cap": r[2] if len(r) > 2 else ""} for r in rows]

    @cached_property
    def gpu_target(self) -> targets.TargetInfo | None:
        """GPU 0 as TVM sees it, as the target it maps to; None without one."""
        dev = targets._cuda_device()
        return targets.cuda_from_device(dev) if dev is not None else None

    @cached_property
    def gpu_visible(self) -> bool:
        try:
            return bool(self.smi) or self.gpu_target is not None
        except Exception:  # noqa: BLE001  (the GPU row says why)
            return False

    @property
    def need(self) -> str:
        """The status of a missing CUDA prerequisite: a failure only where a GPU is visible."""
        return FAIL if self.gpu_visible else WARN

    cpu = cached_property(lambda self: targets._llvm())
    mode = property(lambda self: os.environ.get("TVM_CUDA_COMPILE_MODE", "nvrtc").lower())

    @cached_property
    def nvcc(self) -> tuple[str, tuple[int, int] | None] | None:
        if not (exe := shutil.which("nvcc")):
            return None
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30).stdout
        return exe, _ver(m.group(1)) if (m := re.search(r"release (\d+\.\d+)", out)) else None

    @cached_property
    def toolkit(self) -> tuple[Path | None, str]:
        """(root, how) of the toolkit whose headers TVM gives NVRTC: CUDA_PATH, else
        two folders above nvcc's real path (tvm.support.nvcc.find_cuda_path)."""
        if os.environ.get("CUDA_PATH"):
            return Path(os.environ["CUDA_PATH"]), "CUDA_PATH"
        if self.nvcc:
            return Path(os.path.realpath(self.nvcc[0])).parent.parent, f"from nvcc ({self.nvcc[0]})"
        if Path("/usr/local/cuda/bin/nvcc").exists():
            return Path("/usr/local/cuda"), "/usr/local/cuda"
        return None, "no CUDA_PATH, no nvcc"

    @property
    def toolkit_real(self) -> Path | None:
        """The toolkit itself: the root TVM takes, or the one a wrapper script of nvcc runs."""
        root = self.toolkit[0]
        return root if root is not None and _has_headers(root) else _wrapped_root(self.nvcc[0]) if self.nvcc else None

    @cached_property
    def nvrtc(self) -> tuple[int, int] | str:
        """NVRTC's (major, minor), or why there is none."""
        try:
            from cuda.bindings import nvrtc
        except ImportError:
            return "cuda-bindings is not installed"
        try:
            err, major, minor = nvrtc.nvrtcVersion()
        except Exception as e:  # noqa: BLE001  (no libnvrtc to load)
            return f"cuda-bindings cannot load NVRTC: {_one_line(e)}"
        return (int(major), int(minor)) if err == nvrtc.nvrtcResult.NVRTC_SUCCESS else f"nvrtcVersion: {err}"

    @cached_property
    def driver_cuda(self) -> tuple[int, int] | None:
        """The highest CUDA the driver supports: cuDriverGetVersion, else nvidia-smi's header."""
        try:
            from cuda.bindings import driver

            err, ver = driver.cuDriverGetVersion()
            if err == driver.CUresult.CUDA_SUCCESS and ver:
                return ver // 1000, ver % 1000 // 10
        except Exception:  # noqa: BLE001  (no cuda-bindings, or no libcuda to load)
            pass
        if exe := shutil.which("nvidia-smi"):
            out = subprocess.run([exe], capture_output=True, text=True, timeout=30).stdout
            return _ver(m.group(1)) if (m := re.search(r"CUDA Version:\s*(\d+\.\d+)", out)) else None
        return None


def check_gpu(env: Env) -> list[Row]:
    try:
        smi = env.smi
    except Exception as e:  # noqa: BLE001
        return [Row("GPU", FAIL, _one_line(e), "load the NVIDIA driver, or give the container the GPU (--gpus all)")]
    try:
        target, why, fix = env.gpu_target, "", "check CUDA_VISIBLE_DEVICES and that libcuda.so.1 loads (ldconfig -p)"
    except Exception as e:  # noqa: BLE001  (TVM itself: its row says more)
        target, why, fix = None, ": " + _one_line(e), "fix the apache-tvm row first, then this one"
    if target is not None:
        count, cc = f"{len(smi)} x " if smi and len(smi) > 1 else "", target.arch.removeprefix("sm_").rstrip("a")
        return [Row("GPU", OK, f"{count}{target.device_name}, compute capability {cc[:-1]}.{cc[-1]} -> cuda "
                               f"{target.arch} (key {target.slug})")]
    if smi:
        g = smi[0]
        return [Row("GPU", FAIL, f"nvidia-smi sees {g['name']} (compute capability {g['compute_cap']}, cuda sm_"
                                 f"{g['compute_cap'].replace('.', '')}) but TVM cannot open it{why}", fix)]
    return [Row("GPU", WARN, f"no GPU visible: CPU target llvm-{env.cpu.arch}",
                "none for CPU deployment; for CUDA run on a GPU host, or cross-compile with TARGET=cuda:sm_90")]


def check_cpu(env: Env) -> list[Row]:
    t, cores = env.cpu, json.loads(env.cpu.spec).get("num-cores")
    if targets.level_rank(t.arch) is None:
        return [Row("CPU target", WARN, f"{t.device_name} has no x86-64 level: target llvm -mcpu={t.arch}",
                    "x86-64 databases and packages do not apply here: tune here (make tune TARGET=llvm)")]
    return [Row("CPU target", OK, f"{t.device_name} -> llvm {t.arch} (key {t.slug}), {cores} cores")]


def check_driver(env: Env) -> list[Row]:
    smi, cuda = env.smi, env.driver_cuda
    kit = env.nvrtc if isinstance(env.nvrtc, tuple) else (env.nvcc[1] if env.nvcc else None)
    if not smi and cuda is None:
        return [Row("driver", env.need, "no NVIDIA driver (no nvidia-smi, no loadable libcuda)",
                    "none for the CPU target; on a GPU host install the NVIDIA driver (580+ for CUDA 13)")]
    detail = f"{smi[0]['driver'] if smi else 'libcuda'}, supports CUDA up to {_v(cuda)}"
    detail += f"; toolkit {_v(kit)}" if kit else ""
    if cuda is None:
        return [Row("driver", WARN, detail, "pip install cuda-bindings to read the driver's CUDA version")]
    if kit and kit[0] > cuda[0]:
        return [Row("driver", FAIL, detail + ": kernels compiled here will not load",
                    f"a driver that supports CUDA {_v(kit)}, or a CUDA {cuda[0]} toolkit")]
    if kit and kit > cuda:
        return [Row("driver", WARN, detail + ": minor-version compatibility only (no PTX JIT)",
                    f"a driver that supports CUDA {_v(kit)}")]
    return [Row("driver", OK, detail)]


def check_nvcc(env: Env) -> list[Row]:
    if env.nvcc is None:
        return [Row("nvcc", FAIL if env.mode == "nvcc" else WARN, f"not on PATH (TVM_CUDA_COMPILE_MODE={env.mode})",
                    "add the CUDA toolkit's bin/ to PATH (needed with TVM_CUDA_COMPILE_MODE=nvcc)")]
    exe, ver = env.nvcc
    with open(os.path.realpath(exe), "rb") as f:
        wrapper = " (a wrapper script)" if f.read(2) == b"#!" else ""
    return [Row("nvcc", OK, f"{_v(ver)} at {exe}{wrapper}, TVM_CUDA_COMPILE_MODE={env.mode}")]


def check_cuda_path(env: Env) -> list[Row]:
    root, how = env.toolkit
    if root is not None and _has_headers(root):
        return [Row("CUDA_PATH", OK, f"toolkit {root} ({how}): headers found")]
    hint = _wrapped_root(env.nvcc[0]) if env.nvcc else None
    fix = f"export CUDA_PATH={hint or '<the CUDA toolkit root, holding include/cuda_runtime.h>'}"
    if root is None:
        return [Row("CUDA_PATH", env.need, f"no CUDA toolkit found ({how}): NVRTC would have no headers", fix)]
    took = "CUDA_PATH=" if how == "CUDA_PATH" else "not set: TVM takes "
    return [Row("CUDA_PATH", env.need, f"{took}{root}{' (nvcc is a wrapper script)' if hint else ''}, which has no "
                                       "include/cuda_runtime.h: NVRTC would find no headers", fix)]


def check_nvrtc(env: Env) -> list[Row]:
    from .tuning.builder import NVRTC_PCH_MIN

    have, pch, kit = env.nvrtc, _v(NVRTC_PCH_MIN), env.nvcc[1] if env.nvcc else None
    if isinstance(have, str):
        major = (kit or env.driver_cuda or (13, 0))[0]
        return [Row("NVRTC", env.need if env.mode == "nvrtc" else OK, f"{have} (TVM compiles CUDA kernels with NVRTC "
                    f"through it; TVM_CUDA_COMPILE_MODE={env.mode})",
                    f"pip install 'cuda-bindings=={major}.*', or TVM_CUDA_COMPILE_MODE=nvcc")]
    detail = f"{_v(have)} (cuda-bindings {installed_version('cuda-bindings') or '?'})"
    if "TVM_CUDA_NVRTC_EXTRA_OPTS" in os.environ:
        detail += f"; TVM_CUDA_NVRTC_EXTRA_OPTS={os.environ['TVM_CUDA_NVRTC_EXTRA_OPTS']!r} is yours (kept)"
    if kit and kit[0] != have[0]:
        return [Row("NVRTC", WARN, detail + f", but nvcc and its headers are {_v(kit)}",
                    f"pip install 'cuda-bindings=={kit[0]}.*', or CUDA_PATH at a CUDA {have[0]} toolkit")]
    if have < NVRTC_PCH_MIN:
        return [Row("NVRTC", WARN, detail + f" < {pch}: no precompiled headers (-pch), slower candidate builds",
                    f"NVRTC {pch} or newer (cuda-bindings and a CUDA toolkit {pch}+)")]
    return [Row("NVRTC", OK, detail + f" >= {pch}: precompiled headers (-pch) on")]


def _pin_row(dist: str, fail_on_mismatch: bool, note: str = "") -> Row:
    want, source = pins()
    pin, have = want.get(dist), installed_version(dist)
    if have is None:
        return Row(dist, FAIL, "not installed", f"pip install {dist}=={pin}")
    detail = f"{have} (pin {pin}, {source}){note}"
    if pin is None or have.split("+")[0] == pin:
        return Row(dist, OK, detail)
    return Row(dist, FAIL if fail_on_mismatch else WARN, detail, f"pip install {dist}=={pin}")


def check_tvm(env: Env) -> list[Row]:
    """apache-tvm and apache-tvm-ffi against the pins; that TVM imports, built with LLVM (and CUDA)."""
    row, ffi = _pin_row("apache-tvm", True), _pin_row("apache-tvm-ffi", False)
    if (installed_version("apache-tvm-ffi") or "").startswith(BAD_FFI[0] + "."):
        ffi = dataclasses.replace(ffi, status=FAIL, detail=f"{ffi.detail}: {BAD_FFI[0]}.x {BAD_FFI[1]}")
    elif ffi.status == WARN:
        ffi = dataclasses.replace(ffi, detail=ffi.detail + ": untested with this project")
    if row.status != OK:
        refused = "" if row.detail == "not installed" else " (a package built with another TVM is refused)"
        return [dataclasses.replace(row, fix=row.fix + refused), ffi]
    both = "pip install " + " ".join(f"{d}=={pins()[0][d]}" for d in ("apache-tvm", "apache-tvm-ffi"))
    try:
        from .tvm_compat import tvm

        info = tvm.support.libinfo()
    except Exception as e:  # noqa: BLE001  (a TVM that does not import: the tvm-ffi row may say why)
        return [Row(row.check, FAIL, f"{row.detail}, does not import: {_one_line(e)}", both), ffi]
    detail = row.detail + f", USE_CUDA={info.get('USE_CUDA')} USE_LLVM={info.get('USE_LLVM')}"
    def on(flag: str) -> bool:  # CMake's value: ON, or a path / llvm-config command in source builds
        return str(info.get(flag, "")).strip().upper() not in ("", "OFF", "0", "FALSE", "NOTFOUND")

    if not on("USE_LLVM") or (env.gpu_visible and not on("USE_CUDA")):
        return [Row(row.check, FAIL, detail, "a TVM built with LLVM and CUDA: " + both), ffi]
    return [dataclasses.replace(row, detail=detail), ffi]


def check_torch(env: Env) -> list[Row]:
    if installed_version("torch") is None:
        return [_pin_row("torch", True)]
    import torch

    cuda = torch.version.cuda
    row = _pin_row("torch", False, f", {'CUDA ' + cuda + ' build' if cuda else 'CPU build'}")
    if not env.gpu_visible:
        return [row]
    if not cuda:
        return [Row("torch", WARN, row.detail + ": the PyTorch comparisons and references run on the CPU",
                    "a CUDA build of torch (pip install torch --index-url https://download.pytorch.org/whl/cu130)")]
    if not torch.cuda.is_available():
        return [Row("torch", WARN, row.detail + f": cannot use the GPU (driver supports CUDA {_v(env.driver_cuda)})",
                    f"a torch built for CUDA {_v(env.driver_cuda)} or older, or a newer driver")]
    return [row]


def check_onnxruntime(env: Env) -> list[Row]:
    if installed_version("onnxruntime") is None:
        return [_pin_row("onnxruntime", True)]
    import onnxruntime

    providers = onnxruntime.get_available_providers()
    note = ", providers " + ", ".join(p.removesuffix("ExecutionProvider") for p in providers)
    if env.gpu_visible and "CUDAExecutionProvider" not in providers:
        note += " (the reference runs on the CPU: only slower)"
    return [_pin_row("onnxruntime", False, note)]


def check_ld_library_path(env: Env) -> list[Row]:
    text = os.environ.get("LD_LIBRARY_PATH", "")
    if not text.strip():
        return [Row("LD_LIBRARY_PATH", OK, "not set")]
    root = env.toolkit_real.resolve() if env.toolkit_real is not None else None
    try:
        driver = env.smi[0]["driver"] if env.smi else None
    except Exception:  # noqa: BLE001  (the GPU row says why)
        driver = None
    found, stub = [], False
    for entry in (e for e in text.split(":") if e):
        path = Path(entry)
        try:
            libs = sorted(p.name for p in path.iterdir() if CUDA_LIBS.match(p.name)) if path.is_dir() else []
        except OSError:  # an entry this user cannot read: it shadows nothing for this process either
            libs = []
        stubbed = "stubs" in path.parts and any(n.startswith("libcuda.") for n in libs)  # the toolkit's own, too
        other = [n for n in libs if re.match(r"libcuda\.so\.\d+\.", n) and driver and n != f"libcuda.so.{driver}"]
        libs = [n for n in libs if not n.startswith("libcuda.")] + other
        if stubbed or other or (libs and (root is None or not path.resolve().is_relative_to(root))):
            found.append(f"{entry} ({', '.join(libs) or 'a stub libcuda'})")
            stub = stub or stubbed or bool(other)
    if not found:
        return [Row("LD_LIBRARY_PATH", OK, f"{len(text.split(':'))} entries, none shadows the CUDA libraries")]
    detail = f"shadows the toolkit's ({root or 'none found'}) libraries: " + "; ".join(found)
    return [Row("LD_LIBRARY_PATH", FAIL if stub else WARN, detail + ("; a stub or another driver's libcuda hides "
                "the driver's" if stub else ""),
                "remove those folders from LD_LIBRARY_PATH (or put the toolkit's lib64 first)")]


def _db_row(name: str, target, by_slug: dict, kind: str, root: Path, fix: str, why_none: str = "") -> Row:
    others = sorted(s for s in by_slug if s.startswith(kind + "-") and s != getattr(target, "slug", None))
    listing = "; ".join(f"{s} ({', '.join(sorted(by_slug[s]))})" for s in others)
    if target is None:
        return Row(name, WARN, why_none + (f": the committed ones are for {listing}" if listing else ""), fix)
    if not (mine := by_slug.get(target.slug, {})):
        where = f"committed for {listing}" if listing else f"none committed under {root.name}/"
        return Row(name, WARN, f"none for {target.slug} (this machine): {where}; its kernels build untuned", fix)
    stale = [str(f.relative_to(root)) for dbs in mine.values() for f, key in dbs if key.get("target") != target.key()]
    found = f"{target.slug}: {', '.join(sorted(mine))} ({sum(len(v) for v in mine.values())} databases)"
    if stale:
        return Row(name, WARN, f"{found}, {len(stale)} keyed for another target string: {', '.join(stale[:3])}",
                   "tune them again here (make tune MODEL=<model>): a build refuses a database whose key differs")
    return Row(name, OK, found + " match this machine")


def check_databases(env: Env) -> list[Row]:
    """The committed databases (tuning_logs/<model>/<target key>/...) against this machine's keys."""
    from .pipeline import DEFAULT_DB_ROOT as root
    from .tuning import database as dbs
    from .tuning import store

    by_slug: dict[str, dict[str, list]] = {}  # target slug -> model -> [(folder, key)]
    for folder, key in store.databases(root) if root.is_dir() else []:
        if dbs.has_records(folder):
            by_slug.setdefault(folder.parent.name, {}).setdefault(folder.parent.parent.name, []).append((folder, key))
    gpu = env.gpu_target if env.gpu_visible else None
    return [
        _db_row("tuning db (CPU)", env.cpu, by_slug, "llvm", root,
                "tune for this CPU's level: make tune TARGET=llvm MODEL=<model> (docs/tuning.md)"),
        _db_row("tuning db (GPU)", gpu, by_slug, "cuda", root,
                "none for CPU deployment; a GPU's databases apply to that GPU model only" if gpu is None
                else "tune on this GPU: make tune MODEL=<model> (docs/tuning.md)",
                "TVM cannot open the GPU" if env.gpu_visible else "no GPU visible"),
    ]


def check_package(folder: str | Path) -> list[Row]:
    """Whether the package loads here: manifest, sha256, TVM version, device,
    then every module (runtime.Predictor), or why not."""
    from . import runtime

    model = "<model>"
    try:
        manifest = runtime.check_package(folder)
        model = manifest.get("model", model)
        predictor = runtime.Predictor(folder, warn_unvalidated=False, manifest=manifest)
    except Exception as e:  # noqa: BLE001  (a DeployError's one line, or a module TVM cannot load)
        fix = f"rebuild it on this machine: make tune MODEL={model}"
        if model == "<model>":  # no manifest read
            fix = "give --package a package folder (artifacts/<model>/<target>-<precision>/package), or " + fix
        elif isinstance(e, TargetError):
            fix = f"run it where there is {e.expected}, or {fix}"
        return [Row("package", FAIL, str(e) if isinstance(e, DeployError) else _one_line(e), fix)]
    t, v = manifest["target"], manifest.get("validation")
    detail = (f"{model}, {t['kind']} {t.get('arch', '')}, {manifest.get('precision')}, buckets "
              f"{', '.join(b.label for b in predictor.buckets)}: loads here")
    if not v:
        return [Row("package", WARN, detail + "; never validated", f"python -m deploy validate -m {model}")]
    if not v.get("passed"):
        return [Row("package", FAIL, detail + "; its validation FAILED", f"see {Path(folder) / 'validation.json'}")]
    return [Row("package", OK, detail + "; validated")]


CHECKS = [
    ("GPU", check_gpu), ("CPU target", check_cpu), ("driver", check_driver), ("nvcc", check_nvcc),
    ("CUDA_PATH", check_cuda_path), ("NVRTC", check_nvrtc), ("apache-tvm", check_tvm), ("torch", check_torch),
    ("onnxruntime", check_onnxruntime), ("LD_LIBRARY_PATH", check_ld_library_path),
    ("tuning databases", check_databases),
]


def run(package: str | Path | None = None) -> list[Row]:
    env, rows = Env(), []
    checks = list(CHECKS) + ([("package", lambda _env: check_package(package))] if package is not None else [])
    for name, check in checks:
        try:
            rows.extend(check(env))
        except Exception as e:  # noqa: BLE001  a row, never a traceback
            log.debug("doctor: check %s raised", name, exc_info=True)
            tvm = isinstance(e, ImportError) and "tvm" in str(e)
            rows.append(Row(name, FAIL, _one_line(e), "fix the apache-tvm row first (TVM does not import)" if tvm
                            else "the check itself failed: python -m deploy -v doctor logs why"))
    return rows


def exit_code(rows: list[Row]) -> int:
    return 1 if any(r.status == FAIL for r in rows) else 0


def table(rows: list[Row]) -> str:
    width = max(len(r.check) for r in rows)
    lines = [f"{'STATUS':<6}  {'CHECK':<{width}}  DETAIL", *(f"{r.status:<6}  {r.check:<{width}}  {r.detail}" for r in rows)]
    if fixes := [f"  {r.status:<4} {r.check}: {r.fix}" for r in rows if r.status != OK and r.fix]:
        lines += ["", "fixes:", *fixes]
    n_fail, n_warn = (sum(r.status == s for r in rows) for s in (FAIL, WARN))
    return "\n".join([*lines, "", f"doctor: {n_fail} FAIL, {n_warn} WARN, {len(rows) - n_fail - n_warn} OK"])


def as_json(rows: list[Row]) -> dict:
    return {"rows": [dataclasses.asdict(r) for r in rows], "exit": exit_code(rows),
            "fail": sum(r.status == FAIL for r in rows), "warn": sum(r.status == WARN for r in rows)}
