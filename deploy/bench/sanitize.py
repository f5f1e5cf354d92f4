"""One inference of a built CUDA module under NVIDIA's `compute-sanitizer`
(memcheck): the first bad access with its kernel, thread and address.

`profile --debug-kernels` synchronizes after every kernel, which names the
kernel whose fault surfaces; memcheck also sees an out-of-bounds access that
does not fault (it lands in another allocation) and says which thread made
it. It runs the module in a child process (`python -m deploy.bench.sanitize
MODULE INPUTS`), since a faulted CUDA context cannot be used again and the
tool instruments a process from its start. Where the tool is missing or
cannot instrument the device (in a gVisor sandbox it answers "Device not
supported"), the outcome says so in one line.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np

EXIT_ON_ERROR = 86  # --error-exitcode: the child found an error
TIMEOUT_S = 600


def find() -> str | None:
    """compute-sanitizer on the PATH, or in the CUDA toolkit ($CUDA_PATH/bin)."""
    exe = shutil.which("compute-sanitizer")
    if exe:
        return exe
    for root in (os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        path = Path(root or "/nonexistent") / "bin" / "compute-sanitizer"
        if root and path.is_file() and os.access(path, os.X_OK):
            return str(path)
    return None


# memcheck's kernel errors (its API errors, "Program hit ...", follow them and are not one)
_ERROR = re.compile(r"^(Invalid|Misaligned|Out-of-range|Uninitialized|Race|Barrier|Malloc|Warp|Lane|Illegal|"
                    r"Hardware|Device-side|Cuda Memory|Leaked)")
_KERNEL = re.compile(r"^(?P<name>.+?)_kernel\d*$")


def tir_name(kernel: str) -> str:
    """The TIR function a CUDA kernel was generated from: TVM names a
    PrimFunc's device kernel `<name>_kernel` (or `_kernel0`, ...)."""
    m = _KERNEL.match(kernel.split("(")[0])
    return m.group("name") if m else kernel


def parse(text: str) -> dict | None:
    """The first error of a memcheck report: {'what', 'kernel', 'tir',
    'thread', 'block', 'address'} (as far as given), or None without one."""
    lines = [ln.strip().lstrip("=").strip() for ln in text.splitlines() if ln.startswith("=========")]
    for i, ln in enumerate(lines):
        if not _ERROR.match(ln):
            continue  # headers, host backtraces, and the API errors that follow a kernel's
        err = {"what": ln}
        for nxt in lines[i + 1:i + 8]:
            # "at kern+0x90 [in file.cu:12]", or older "at 0x90 in [file.cu:12:]kern"
            if m := re.match(r"^at (?:0x[0-9a-f]+ in (?:\S*:\d+:)?)?(?P<k>[A-Za-z_][\w$.]*)", nxt):
                err["kernel"] = m.group("k")
                err["tir"] = tir_name(m.group("k"))
            elif m := re.match(r"^by thread \((?P<t>[^)]*)\) in block \((?P<b>[^)]*)\)", nxt):
                err["thread"], err["block"] = m.group("t"), m.group("b")
            elif nxt.startswith(("Address", "Access to")):
                err["address"] = nxt
        return err
    return None


def describe(outcome: dict) -> str:
    """One line for the user."""
    if outcome["status"] == "error":
        e = outcome["error"]
        where = f" in kernel '{e['tir']}'" if e.get("tir") else ""
        who = f" (thread ({e['thread']}) of block ({e['block']}))" if e.get("thread") else ""
        return f"compute-sanitizer: {e['what']}{where}{who}" + (f": {e['address']}" if e.get("address") else "")
    if outcome["status"] == "clean":
        return "compute-sanitizer: one run, no memory error"
    return f"compute-sanitizer: not run: {outcome['reason']}"


def run(module: Path, inputs: list[np.ndarray], folder: Path, exe: str | None = None) -> dict:
    """One run of `module` (an exported .so) on inputs `inputs` under memcheck;
    the full report is kept in `folder`/sanitizer.txt. Returns {'status':
    'error' | 'clean' | 'unavailable', ...}."""
    exe = exe or find()
    if exe is None:
        return {"status": "unavailable", "reason": "compute-sanitizer not found (it ships with the CUDA toolkit)"}
    folder.mkdir(parents=True, exist_ok=True)
    npz = folder / "sanitizer-inputs.npz"
    np.savez(npz, *inputs)
    cmd = [exe, "--tool", "memcheck", "--print-limit", "10", "--error-exitcode", str(EXIT_ON_ERROR),
           sys.executable, "-m", "deploy.bench.sanitize", str(module), str(npz)]
    try:
        # its own process group: a time-out ends the tool and the Python process it instruments alike
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return {"status": "unavailable", "reason": f"one run took over {TIMEOUT_S} s under memcheck"}
    except OSError as e:
        return {"status": "unavailable", "reason": f"{exe} could not be started ({e})"}
    finally:
        npz.unlink(missing_ok=True)
    rc, said = proc.returncode, stdout + "\n" + stderr
    report = folder / "sanitizer.txt"
    report.write_text(f"$ {' '.join(cmd)}\n# exit {rc}\n{stdout}{stderr}")
    err = parse(said)
    if err is None and rc == EXIT_ON_ERROR:  # an error in a form not read here
        err = {"what": f"memcheck found an error (its report: {report})"}
    if err is not None:
        return {"status": "error", "error": err, "report": str(report)}
    if rc == 0:
        return {"status": "clean", "report": str(report)}
    lines = [ln.strip("= ").strip() for ln in said.splitlines() if ln.strip("= ").strip()]
    why = next((ln for ln in lines if "rror" in ln or "not supported" in ln), lines[-1] if lines else f"exit {rc}")
    return {"status": "unavailable", "reason": f"{why[:200]} (exit {rc}; {report})", "report": str(report)}

def _child(module: str, npz: str) -> int:
    from ..tvm_compat import VirtualMachine, load_module, tensor, tvm

    dev = tvm.cuda(0)
    vm = VirtualMachine(load_module(module), dev)
    with np.load(npz) as f:
        args = [tensor(f[k], dev) for k in sorted(f.files, key=lambda k: int(k.split("_")[1]))]
    vm["main"](*args)
    dev.sync()
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1], sys.argv[2]))
