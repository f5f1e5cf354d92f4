"""compute-sanitizer's report read into one line (deploy/bench/sanitize.py).
The tool itself needs a GPU: here fake executables print what memcheck
prints, and the H200 run of scripts/kernel_fault_demo.py is committed in
results/."""

import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from deploy.bench import sanitize

# memcheck's report for one out-of-bounds store (the format of CUDA 12/13's compute-sanitizer)
REPORT = """========= COMPUTE-SANITIZER
========= Invalid __global__ write of size 4 bytes
=========     at oob_write_kernel+0x90
=========     by thread (1,0,0) in block (0,0,0)
=========     Access to 0x7f2c16000004 is out of bounds
=========     and is 16,776,196 bytes after the nearest allocation at 0x7f2c15000000 of size 1,024 bytes
=========     Saved host backtrace up to driver entry point at kernel launch time
=========         Host Frame: cuLaunchKernel [0x2f2f25] in libcuda.so.1
=========
========= Program hit cudaErrorLaunchFailure (error 719) due to "unspecified launch failure" on CUDA API call to cuStreamSynchronize.
========= ERROR SUMMARY: 2 errors
"""


def _fake(tmp_path: Path, stdout: str, code: int) -> str:
    exe = tmp_path / "compute-sanitizer"
    (tmp_path / "said.txt").write_text(stdout)
    exe.write_text(f"#!/bin/sh\ncat '{tmp_path / 'said.txt'}'\nexit {code}\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return str(exe)


def test_the_first_error_names_the_tir_function_thread_and_address():
    err = sanitize.parse(REPORT)
    assert err == {"what": "Invalid __global__ write of size 4 bytes", "kernel": "oob_write_kernel",
                   "tir": "oob_write", "thread": "1,0,0", "block": "0,0,0",
                   "address": "Access to 0x7f2c16000004 is out of bounds"}
    assert sanitize.parse("========= ERROR SUMMARY: 0 errors\n") is None
    assert sanitize.tir_name("fused_conv2d_add_relu_kernel0") == "fused_conv2d_add_relu"
    assert sanitize.tir_name("main_kernel") == "main"


def test_an_error_is_one_line_and_the_report_is_kept(tmp_path):
    out = sanitize.run(tmp_path / "m.so", [np.zeros(4, "float32")], tmp_path / "f", exe=_fake(tmp_path, REPORT, 86))
    line = sanitize.describe(out)
    assert line == ("compute-sanitizer: Invalid __global__ write of size 4 bytes in kernel 'oob_write' "
                    "(thread (1,0,0) of block (0,0,0)): Access to 0x7f2c16000004 is out of bounds")
    assert "\n" not in line
    assert "oob_write_kernel+0x90" in (tmp_path / "f" / "sanitizer.txt").read_text()
    assert not list((tmp_path / "f").glob("*.npz")), "the inputs are not left behind"


def test_a_device_the_tool_cannot_instrument_is_said_not_hidden(tmp_path):
    said = ("========= COMPUTE-SANITIZER\n========= Error: Device not supported. Please refer to the "
            "\"Supported Devices\" section of the sanitizer documentation\n")
    out = sanitize.run(tmp_path / "m.so", [], tmp_path / "f", exe=_fake(tmp_path, said, 1))
    assert out["status"] == "unavailable"
    assert sanitize.describe(out).startswith("compute-sanitizer: not run: Error: Device not supported.")


def test_a_clean_run_and_a_missing_tool(tmp_path, monkeypatch):
    out = sanitize.run(tmp_path / "m.so", [], tmp_path / "f", exe=_fake(tmp_path, "========= ERROR SUMMARY: 0 errors\n", 0))
    assert sanitize.describe(out) == "compute-sanitizer: one run, no memory error"
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    for var in ("CUDA_PATH", "CUDA_HOME"):
        monkeypatch.delenv(var, raising=False)
    if not Path("/usr/local/cuda/bin/compute-sanitizer").is_file():
        assert sanitize.run(tmp_path / "m.so", [], tmp_path / "g")["status"] == "unavailable"
    toolkit = tmp_path / "cuda"
    (toolkit / "bin").mkdir(parents=True)
    tool = toolkit / "bin" / "compute-sanitizer"
    tool.write_text("")
    monkeypatch.setenv("CUDA_PATH", str(toolkit))
    assert sanitize.find() is None  # not executable
    tool.chmod(0o755)
    assert sanitize.find() == str(tool)


def test_other_report_forms():
    old = ("========= Invalid __global__ read of size 2\n=========     at 0x00000150 in /tmp/k.cu:12:fused_add_kernel0\n"
           "=========     by thread (3,0,0) in block (7,0,0)\n")
    assert sanitize.parse(old)["tir"] == "fused_add"
    warp = ("========= Warp Illegal Address\n=========     at fused_matmul_kernel+0x1a0\n"
            "=========     by thread (0,0,0) in block (2,0,0)\n")
    assert sanitize.parse(warp) == {"what": "Warp Illegal Address", "kernel": "fused_matmul_kernel",
                                    "tir": "fused_matmul", "thread": "0,0,0", "block": "2,0,0"}
    # memcheck said it found an error, in a form not read here: an error all the same, not "not run"
    assert sanitize.parse("========= Something new\n========= ERROR SUMMARY: 1 error\n") is None


def test_an_error_in_a_form_not_read_is_still_an_error(tmp_path):
    out = sanitize.run(tmp_path / "m.so", [], tmp_path / "f",
                       exe=_fake(tmp_path, "========= Something new\n========= ERROR SUMMARY: 1 error\n", 86))
    assert out["status"] == "error" and "memcheck found an error" in sanitize.describe(out)


def test_the_demo_kernel_builds_for_sm_90_and_writes_out_of_bounds(tmp_path):
    """The H200 demo's module compiles here; its kernel's store index is the
    thread index times a stride far past the 256-element output."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    import kernel_fault_demo as demo

    from deploy.tvm_compat import tvm

    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"}, host={"kind": "llvm"})
    ex = tvm.compile(demo.module(), target=target)
    (cuda,) = [m for m in ex.mod.imports[0].imports if m.kind == "cuda"]
    src = cuda.inspect_source()
    assert f"{demo.KERNEL}_kernel" in src and str(demo.STRIDE) in src


@pytest.mark.gpu
def test_the_demo_names_the_kernel_on_a_gpu(tmp_path):
    """In a process of its own: the fault leaves its CUDA context unusable."""
    script = Path(__file__).resolve().parents[2] / "scripts" / "kernel_fault_demo.py"
    p = subprocess.run([sys.executable, str(script), "--out", str(tmp_path)], capture_output=True, text=True,
                       env=dict(os.environ), timeout=900)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "kernel 'oob_write' faulted" in p.stdout
