"""`python -m deploy doctor`: its rows, exit status and JSON on this machine
(CPU only: the GPU rows WARN), and what it says of faked pins, drivers,
LD_LIBRARY_PATH entries and packages. Seconds: nothing is tuned; the one
package is a single add kernel."""

import json
import re
import subprocess
import sys

import pytest

from deploy import artifacts, cli, doctor

from .conftest import HAS_GPU

ROWS = ["GPU", "CPU target", "driver", "nvcc", "CUDA_PATH", "NVRTC", "apache-tvm", "apache-tvm-ffi", "torch",
        "onnxruntime", "LD_LIBRARY_PATH", "tuning db (CPU)", "tuning db (GPU)"]


def _table_rows(out: str) -> dict[str, tuple[str, str]]:
    """check -> (status, detail) from the printed table."""
    rows = {}
    for line in out.splitlines():
        m = re.match(r"^(OK|WARN|FAIL)\s{2,}(.+?)\s{2,}(.*)$", line)
        if m:
            rows[m.group(2)] = (m.group(1), m.group(3))
    return rows


def test_this_machine_gets_every_row_and_no_failure(capsys):
    rc = cli.main(["doctor"])
    out = capsys.readouterr().out
    rows = _table_rows(out)
    assert list(rows) == ROWS, out
    assert [c for c, (s, _) in rows.items() if s == "FAIL"] == [] and rc == 0, out
    assert out.splitlines()[0].split() == ["STATUS", "CHECK", "DETAIL"]
    for check, (status, _) in rows.items():
        if status != "OK":  # each WARN has its fix, in one line
            assert re.search(rf"^  {status}\s+{re.escape(check)}: \S", out, re.M), check
    assert rows["apache-tvm-ffi"][0] == "OK" and "pin 0.1.14.post0" in rows["apache-tvm-ffi"][1]
    if not HAS_GPU:  # a CPU-only machine is a valid deployment: WARN, not FAIL
        assert rows["GPU"][0] == "WARN" and re.match(r"no GPU visible: CPU target llvm-\S+$", rows["GPU"][1])
        assert rows["tuning db (GPU)"][0] == "WARN"


def test_json_is_all_that_goes_to_stdout():
    p = subprocess.run([sys.executable, "-m", "deploy", "doctor", "--json"], cwd=artifacts.REPO_ROOT,
                       capture_output=True, text=True, timeout=120)
    data = json.loads(p.stdout)
    assert [r["check"] for r in data["rows"]] == ROWS
    assert {tuple(r) for r in data["rows"]} == {("check", "status", "detail", "fix")}
    assert p.returncode == data["exit"] == (1 if data["fail"] else 0)


def test_a_bogus_package_fails_in_one_line_and_exits_1(tmp_path, capsys):
    rc = cli.main(["doctor", "--package", str(tmp_path / "nope")])
    captured = capsys.readouterr()
    assert rc == 1 and "Traceback" not in captured.out + captured.err
    status, detail = _table_rows(captured.out)["package"]
    assert status == "FAIL" and detail.startswith("no package artifact | got ") and str(tmp_path / "nope") in detail
    assert re.search(r"^  FAIL package: give --package a package folder", captured.out, re.M)


def _tiny_package(folder, target_key: dict | None = None):
    """A real package of one bucket: x + x on llvm (compiles in well under a second)."""
    from deploy import targets
    from deploy.tvm_compat import relax, tvm

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 4), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(relax.op.add(x, x)))
        bb.emit_func_output(out)
    target = targets.resolve("llvm")
    folder.mkdir()
    tvm.compile(bb.get(), target=target.tvm_target()).export_library(str(folder / "b1.so"))
    spec = {"name": "x", "shape": [4], "dtype": "float32"}
    artifacts.write_manifest(folder, "package", {
        "model": "tiny_add", "inputs": [spec], "outputs": [{**spec, "name": "y"}], "precision": "fp32",
        "target": target_key or target.key(), "gpu": None,
        "buckets": {"1": {"file": "b1.so", "sha256": artifacts.sha256_file(folder / "b1.so")}},
        "validation": {"passed": True},
    }, files=["b1.so"])
    return folder


def test_a_package_that_loads_here_and_ones_that_do_not(tmp_path):
    pkg = _tiny_package(tmp_path / "pkg")
    [row] = doctor.check_package(pkg)
    assert row.status == "OK" and row.detail.startswith("tiny_add, llvm ") and "loads here; validated" in row.detail
    if not HAS_GPU:
        cuda = _tiny_package(tmp_path / "cuda", {"kind": "cuda", "arch": "sm_90", "device": "NVIDIA H200", "target": "{}"})
        [row] = doctor.check_package(cuda)
        assert row.status == "FAIL" and row.detail.startswith("package is built for CUDA but no CUDA GPU is visible")
        assert row.fix.startswith("run it where there is sm_90") and "MODEL=tiny_add" in row.fix
    (pkg / "b1.so").write_bytes((pkg / "b1.so").read_bytes() + b"x")
    [row] = doctor.check_package(pkg)
    assert row.status == "FAIL" and "sha256 differs" in row.detail and "\n" not in row.detail


def test_a_pin_mismatch_fails_and_its_fix_names_the_pin(monkeypatch):
    real = doctor.installed_version
    fake = {"apache-tvm-ffi": "0.1.15.post2", "apache-tvm": "0.26.0"}
    monkeypatch.setattr(doctor, "installed_version", lambda d: fake.get(d) or real(d))
    tvm_row, ffi = doctor.check_tvm(doctor.Env())
    assert ffi.status == "FAIL" and "segfaults in MetaSchedule" in ffi.detail
    assert ffi.fix == "pip install apache-tvm-ffi==0.1.14.post0"
    assert tvm_row.status == "FAIL" and tvm_row.fix.startswith("pip install apache-tvm==0.27.0.post1")
    assert doctor.exit_code([tvm_row, ffi]) == 1
    fake["apache-tvm-ffi"] = "0.1.13"  # another version: untested, not known to crash
    assert doctor.check_tvm(doctor.Env())[1].status == "WARN"


def test_the_built_in_pins_agree_with_requirements_txt(tmp_path):
    assert doctor.pins(tmp_path / "absent.txt") == (doctor.PINS, "built-in pins")  # an installed package
    if not (artifacts.REPO_ROOT / "requirements.txt").is_file():
        pytest.skip("no requirements.txt beside the code")
    found, source = doctor.pins()
    assert source == "requirements.txt" and {k: found[k] for k in doctor.PINS} == doctor.PINS


def test_a_cuda_library_on_ld_library_path_is_flagged(tmp_path, monkeypatch):
    (tmp_path / "libnvrtc.so.13").touch()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "libfoo.so").touch()
    monkeypatch.setenv("LD_LIBRARY_PATH", f"{tmp_path / 'other'}:{tmp_path}:/nonexistent")
    [row] = doctor.check_ld_library_path(doctor.Env())
    assert row.status == "WARN" and f"{tmp_path} (libnvrtc.so.13)" in row.detail and "other" not in row.detail
    assert "LD_LIBRARY_PATH" in row.fix
    (tmp_path / "stubs").mkdir()
    (tmp_path / "stubs" / "libcuda.so.1").touch()
    monkeypatch.setenv("LD_LIBRARY_PATH", str(tmp_path / "stubs"))
    [row] = doctor.check_ld_library_path(doctor.Env())
    assert row.status == "FAIL" and "a stub libcuda" in row.detail and "hides the driver's" in row.detail
    monkeypatch.setenv("LD_LIBRARY_PATH", str(tmp_path / "other"))
    assert doctor.check_ld_library_path(doctor.Env())[0].status == "OK"
    # the driver's own libcuda, where a container runtime puts it (/usr/local/nvidia/lib64): fine; another driver's: not
    driver = tmp_path / "nvidia"
    driver.mkdir()
    for name in ("libcuda.so", "libcuda.so.1", "libcuda.so.580.159.04"):
        (driver / name).touch()
    monkeypatch.setenv("LD_LIBRARY_PATH", str(driver))
    env = doctor.Env()
    env.smi = [{"name": "NVIDIA H200", "driver": "580.159.04", "compute_cap": "9.0"}]
    assert doctor.check_ld_library_path(env)[0].status == "OK"
    env.smi[0]["driver"] = "590.1"
    [row] = doctor.check_ld_library_path(env)
    assert row.status == "FAIL" and "libcuda.so.580.159.04" in row.detail


def test_cuda_path_needs_the_toolkit_headers(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_PATH", str(tmp_path))
    env = doctor.Env()
    env.gpu_visible = False
    [row] = doctor.check_cuda_path(env)
    assert row.status == "WARN" and "no include/cuda_runtime.h" in row.detail and row.fix.startswith("export CUDA_PATH=")
    env.gpu_visible = True  # where kernels are built for a GPU here, every NVRTC build would fail
    assert doctor.check_cuda_path(env)[0].status == "FAIL"
    (tmp_path / "include").mkdir()
    (tmp_path / "include" / "cuda_runtime.h").touch()
    assert doctor.check_cuda_path(doctor.Env())[0].status == "OK"


def test_gpu_driver_and_nvrtc_rows_from_faked_probes(monkeypatch):
    monkeypatch.delenv("TVM_CUDA_COMPILE_MODE", raising=False)
    env = doctor.Env()  # what a GPU host would report, without one
    env.smi = [{"name": "NVIDIA H200", "driver": "535.54", "compute_cap": "9.0"}]
    env.gpu_target, env.driver_cuda, env.nvrtc = None, (12, 2), (13, 0)
    [gpu] = doctor.check_gpu(env)
    assert gpu.status == "FAIL" and "nvidia-smi sees NVIDIA H200 (compute capability 9.0, cuda sm_90)" in gpu.detail
    [driver] = doctor.check_driver(env)
    assert driver.status == "FAIL" and "supports CUDA up to 12.2; toolkit 13.0" in driver.detail
    env.driver_cuda = (13, 0)
    assert doctor.check_driver(env)[0].status == "OK"
    from deploy.tuning.builder import NVRTC_PCH_MIN

    env.nvrtc, env.nvcc = (NVRTC_PCH_MIN[0], NVRTC_PCH_MIN[1] - 1), None
    [nvrtc] = doctor.check_nvrtc(env)
    assert nvrtc.status == "WARN" and "no precompiled headers (-pch)" in nvrtc.detail
    env.nvrtc = "cuda-bindings is not installed"
    assert doctor.check_nvrtc(env)[0].status == "FAIL"  # a GPU here, and TVM compiles with NVRTC


def test_a_check_that_raises_is_a_fail_row_not_a_traceback(monkeypatch):
    def broken(env):
        raise RuntimeError("Traceback (most recent call last):\n  File ...\nInternalError: Check failed: x")

    monkeypatch.setattr(doctor, "CHECKS", [("broken", broken)])
    [row] = doctor.run()
    assert (row.check, row.status, row.detail) == ("broken", "FAIL", "InternalError: Check failed: x")
    assert doctor.exit_code([row]) == 1
