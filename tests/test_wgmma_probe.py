"""scripts/wgmma_gemm_probe.py: a Hopper GEMM (wgmma fed by TMA) written in
TVM 0.27's TIRx. On the CPU machine it is built for sm_90a (every pass and
CUDA codegen run); on the GPU (`-m gpu`) it computes what PyTorch computes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import load_script

ROOT = Path(__file__).resolve().parents[1]


def _script():
    return load_script("wgmma_gemm_probe")


@pytest.mark.parametrize("epilogue", ["bias", "gelu"])
def test_it_builds_for_sm90a_with_wgmma_and_tma(epilogue):
    probe = _script()
    lib = probe.build(probe.make_gemm(256, 128, 128, bn=64, stages=2, epilogue=epilogue))
    src = lib.mod.imports[0].inspect_source()
    assert "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16" in src
    assert "cp.async.bulk.tensor.2d" in src and "CUtensorMap" in src
    assert ("erff(" in src[src.index("main_kernel"):]) == (epilogue == "gelu")


def test_a_tf32_gemm_of_fp32_operands():
    probe = _script()
    lib = probe.build(probe.make_gemm(256, 128, 64, bn=64, stages=2, dtype="tf32"))
    src = lib.mod.imports[0].inspect_source()
    assert "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32" in src
    assert "float* __restrict__ C_ptr" in src or "float* C_ptr" in src
    with pytest.raises(ValueError, match="does not tile"):  # (wgmma's K for tf32: 8)
        probe.make_gemm(256, 128, 44, dtype="tf32")


def test_shapes_that_do_not_tile_and_unknown_epilogues_are_refused():
    probe = _script()
    with pytest.raises(ValueError, match="does not tile"):
        probe.make_gemm(128, 100, 128)
    with pytest.raises(ValueError, match="does not tile"):
        probe.make_gemm(128, 128, 40)
    with pytest.raises(ValueError, match="does not tile"):
        probe.make_gemm(128, 128, 128, bn=12)
    with pytest.raises(ValueError, match="unknown epilogue"):
        probe.make_gemm(128, 128, 128, epilogue="relu6")
    with pytest.raises(ValueError, match="unknown dtype"):
        probe.make_gemm(128, 128, 128, dtype="bf16")


_STOCK = """
import sys
sys.path.insert(0, sys.argv[1])
import importlib.util
spec = importlib.util.spec_from_file_location("p", sys.argv[2])
p = importlib.util.module_from_spec(spec); spec.loader.exec_module(p)
from deploy.tvm_compat import tvm
tvm.compile(tvm.IRModule({"main": p.make_gemm(128, 64, 64, bn=64, stages=1)}), target=p.target(), tir_pipeline="tirx")
"""


def test_tvm_still_needs_the_noop_barrier_codegen_fix():
    """Without the probe's fix, TVM 0.27's codegen of wgmma.noop_barrier
    fails; this fails once TVM no longer needs the fix."""
    r = subprocess.run([sys.executable, "-c", _STOCK, str(ROOT), str(ROOT / "scripts" / "wgmma_gemm_probe.py")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "'TensorLoad' object has no attribute 'dtype'" in r.stderr


def test_rows_past_a_multiple_of_128_are_guarded_and_96_columns_tile():
    probe = _script()

    def branches(m):
        src = probe.build(probe.make_gemm(m, 192, 64, bn=96, stages=2)).mod.imports[0].inspect_source()
        assert "m64n96k16" in src
        return src[src.index("main_kernel"):].count("if (")

    assert branches(200) > branches(256)  # (the stores of rows 200 to 255 guarded; none at 256)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,epilogue", [("fp16", "bias"), ("fp16", "gelu"), ("tf32", "bias")])
def test_it_computes_what_pytorch_computes(tmp_path, dtype, epilogue):
    """A ragged M (ViT's 6,304 rows are not a multiple of 128), 96 columns,
    K = 96 (ConvNeXt's stage 1: half of the second K tile past the end), and
    K = 592 (more K tiles than stages: the ring refills, its barriers' phase
    flips, and a tail)."""
    probe = _script()
    assert probe.main(["--shapes", "400x192x96,400x192x592", "--bn", "64,96", "--stages", "2,4", "--epilogue", epilogue,
                       "--dtype", dtype, "--out", str(tmp_path)]) == 0
    rows = [r for r in json.loads((tmp_path / "probe.json").read_text())["rows"] if r["config"].startswith("wgmma")]
    # (fp16: the single and the persistent kernel, 8 configurations each; tf32: the single one)
    assert len(rows) == (16 if dtype == "fp16" else 8), rows
    assert all("error" not in r and float(r["rel_l2"]) < 1e-2 for r in rows), rows


@pytest.mark.gpu
def test_the_residual_epilogue_staged_and_not_computes_what_pytorch_computes(tmp_path):
    """ResNet's epilogue (bias, an fp16 residual, ReLU) in the persistent
    kernel, its result staged through shared memory and stored as the
    registers hold it; the residual's loads issued before the products
    (tiles of 64 and 96 columns) or at each chunk (pingpong: twice the rows);
    ragged rows and columns (N = 192 in tiles of 128: 64 past N)."""
    probe = _script()
    assert probe.main(["--shapes", "400x192x96,400x192x592", "--bn", "64,96,128", "--kernels", "persistent",
                       "--epilogue", "residual", "--store", "staged,registers", "--pingpong", "0,1",
                       "--out", str(tmp_path)]) == 0
    rows = [r for r in json.loads((tmp_path / "probe.json").read_text())["rows"] if r["config"].startswith("wgmma")]
    assert len(rows) == 2 * 3 * 2 * 2, rows
    assert all("error" not in r and float(r["rel_l2"]) < 1e-2 for r in rows), rows


@pytest.mark.parametrize("epilogue", ["bias", "gelu"])
def test_the_persistent_kernel_specializes_warpgroups_and_stores_pairs(epilogue):
    """make_gemm_ws: a producer warpgroup's TMA and two consumers' wgmma on
    a persistent grid, each thread's 8 adjacent outputs one 16-byte store
    (staged through shared memory), or with `store="registers"` its two
    adjacent ones one half2 store (the scalar stores cost the short-K shapes
    half their time); at 256 columns setmaxnreg moves registers to the
    consumers."""
    probe = _script()
    for store, vector in (("staged", "uint4"), ("registers", "half2")):
        src = probe.build(probe.make_gemm_ws(400, 256, 592, bn=128, stages=2, epilogue=epilogue,
                                             sms=2, store=store)).mod.imports[0].inspect_source()
        kernel = src[src.index("main_kernel("):]
        assert "__launch_bounds__(384)" in src and "m64n128k16" in kernel
        assert "mbarrier_arrive_expect_tx" in kernel and "cp_async_bulk_tensor" in kernel  # (helpers' names)
        assert f"*({vector}*)(D_ptr" in kernel and " D_ptr[" not in kernel  # (D: the output)
    assert "setmaxnreg" not in kernel
    wide = probe.build(probe.make_gemm_ws(256, 256, 64, bn=256, stages=2)).mod.imports[0].inspect_source()
    assert "setmaxnreg.inc.sync.aligned.u32" in wide and "setmaxnreg.dec.sync.aligned.u32" in wide
    with pytest.raises(ValueError, match="not a GEMM the pass takes"):  # (N = 100: not a multiple of 8)
        probe.make_gemm_ws(128, 100, 128)
    with pytest.raises(ValueError, match="shared memory"):
        probe.make_gemm_ws(128, 256, 128, bn=256, stages=6)


def test_the_persistent_kernel_is_fp16_only_on_the_command_line(tmp_path, capsys):
    probe = _script()
    assert probe.main(["--shapes", "128x64x64", "--dtype", "tf32", "--kernels", "persistent",
                       "--out", str(tmp_path)]) == 2
    assert "fp16 only" in capsys.readouterr().err
    assert probe.main(["--shapes", "128x64x64", "--kernels", "pingpong", "--out", str(tmp_path)]) == 2
    assert "unknown kernel" in capsys.readouterr().err


def test_b_stored_k_by_n_takes_boxes_of_64_columns_and_a_transposed_wgmma():
    """--b-layout kn: B as ONNX MatMul keeps a weight ([K, N]), read by TMA
    in boxes of 64 columns (two a 128-column tile) into an MN-major layout
    that wgmma takes transposed (its trans-b immediate 1)."""
    probe = _script()
    src = probe.build(probe.make_gemm_ws(400, 256, 592, bn=128, stages=2, b_kn=True)).mod.imports[0].inspect_source()
    kernel = src[src.index("main_kernel("):]
    assert "m64n128k16_f32_f16_f16_1_1_0_1(" in kernel  # (scale-a, scale-b, trans-a 0, trans-b 1)
    assert kernel.count("cp_async_bulk_tensor") == 3  # (A's box, B's two)
    assert "512, 64, 3)" in kernel  # (B's descriptor: boxes 8,192 bytes apart, 8-row groups 1,024)
    with pytest.raises(ValueError, match="multiple of 64"):
        probe.make_gemm_ws(128, 192, 128, bn=96, b_kn=True)


def test_b_stored_k_by_n_is_the_persistent_kernels_only(tmp_path, capsys):
    probe = _script()
    assert probe.main(["--shapes", "128x64x64", "--b-layout", "kn", "--out", str(tmp_path)]) == 2
    assert "persistent kernel's only" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.parametrize("epilogue", ["bias", "gelu"])
def test_b_stored_k_by_n_computes_what_pytorch_computes(tmp_path, epilogue):
    """The same ragged shapes as above with B [K, N], 64 and 192 columns
    (one and three boxes a tile), with one wgmma group left in flight or
    none; and N = 96 in tiles of 128 columns (the last 32 past N); and
    pingpong's kernel (a tile a CTA here: the warpgroups' turns are the
    pass's GPU tests')."""
    probe = _script()
    assert probe.main(["--shapes", "400x192x96,400x192x592", "--bn", "64,192", "--stages", "2,4", "--kernels",
                       "persistent", "--b-layout", "kn", "--in-flight", "0,1", "--epilogue", epilogue,
                       "--out", str(tmp_path)]) == 0
    rows = [r for r in json.loads((tmp_path / "probe.json").read_text())["rows"] if r["config"].startswith("wgmma")]
    assert len(rows) == 16 and all("error" not in r and float(r["rel_l2"]) < 1e-2 for r in rows), rows
    assert probe.main(["--shapes", "400x192x96,1008x192x592", "--bn", "64", "--stages", "2,4", "--kernels",
                       "persistent", "--b-layout", "kn", "--in-flight", "0,1", "--pingpong", "1",
                       "--epilogue", epilogue, "--out", str(tmp_path / "pp")]) == 0
    rows = [r for r in json.loads((tmp_path / "pp" / "probe.json").read_text())["rows"]
            if r["config"].startswith("wgmma")]
    assert len(rows) == 8 and all("error" not in r and float(r["rel_l2"]) < 1e-2 for r in rows), rows
    assert probe.main(["--shapes", "400x96x384", "--bn", "128", "--kernels", "persistent", "--b-layout", "kn",
                       "--epilogue", epilogue, "--out", str(tmp_path / "n96")]) == 0
    rows = json.loads((tmp_path / "n96" / "probe.json").read_text())["rows"]
    assert [r["config"] for r in rows if "error" not in r and float(r.get("rel_l2", 1)) < 1e-2] \
        == ["wgmma-ws fp16 128x128x64-s4-kn"], rows
