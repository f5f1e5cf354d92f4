"""deploy/bench/peaks.py and the per-kernel report's roofline columns (no GPU needed)."""

from __future__ import annotations

import pytest

from deploy.bench import peaks
from deploy.bench.profile import format_report


def test_ceilings_by_gpu_name_and_precision():
    h200 = peaks.ceilings("NVIDIA H200", "fp16")
    assert h200["flops_per_s"] == pytest.approx(989.4e12) and h200["bytes_per_s"] == pytest.approx(4.8e12)
    assert peaks.ceilings("NVIDIA H200", "fp32")["flops_per_s"] == pytest.approx(66.9e12)
    assert peaks.ceilings("NVIDIA L40S", "fp16")["bytes_per_s"] == pytest.approx(0.864e12)  # not the L4's
    assert peaks.ceilings("NVIDIA L40", "fp16")["bytes_per_s"] == pytest.approx(0.864e12)
    assert peaks.ceilings("NVIDIA L4", "fp16")["bytes_per_s"] == pytest.approx(0.3e12)
    assert peaks.ceilings("NVIDIA H100 PCIe", "fp16")["bytes_per_s"] == pytest.approx(2.0e12)
    assert peaks.ceilings("NVIDIA A100-SXM4-80GB", "fp16")["bytes_per_s"] == pytest.approx(2.04e12)
    assert peaks.ceilings("rocketlake", "fp32") is None and peaks.ceilings("", "fp16") is None


def test_roofline_names_the_bound_and_the_share():
    h200 = peaks.ceilings("NVIDIA H200", "fp16")
    # a 1x1 convolution of ResNet-50's last stage at batch 1: ~0.2 GFLOP, ~4.6 MB
    r = peaks.roofline(2.06e8, 4.6e6, 20e-6, h200)
    assert r["bound"] == "memory" and r["roofline_s"] == pytest.approx(4.6e6 / 4.8e12)
    assert r["of_roofline"] == pytest.approx(r["roofline_s"] / 20e-6)
    big = peaks.roofline(1e12, 1e9, 2e-3, h200)  # a large-batch GEMM
    assert big["bound"] == "compute" and 0.5 < big["of_roofline"] < 0.51


def _report(ceil):
    k = {"kernel": "conv", "calls_per_run": 2, "ms_per_call": 0.02, "ms_per_run": 0.04, "share": 1.0,
         "gflops_per_s": 1.0, "gbytes_per_s": 1.0, "flops": 2.06e8, "bytes": 4.6e6}
    if ceil:
        r = peaks.roofline(k["flops"], k["bytes"], 20e-6, ceil)
        k.update(bound=r["bound"], of_roofline=r["of_roofline"], loss_ms_per_run=(20e-6 - r["roofline_s"]) * 2e3)
    return {"bucket": 1, "kernel_ms_per_run": 0.04, "tuned_kernels": 1, "kernels_total": 1, "kernels": [k],
            "ceilings": ceil}


def test_report_columns_against_the_gpu_and_without_one():
    text = format_report(_report(peaks.ceilings("NVIDIA H200", "fp16")))
    assert "above the kernels' rooflines (NVIDIA H200 datasheet: 989.4 TFLOP/s fp16, 4.8 TB/s)" in text
    assert "conv 0.038 ms (memory-bound, 5% of its roofline)" in text
    header, rule, row = text.splitlines()[3:6]
    assert header.count("|") == rule.count("|") == row.count("|") == 11
    plain = format_report(_report(None))
    assert "roofline" not in plain and plain.splitlines()[2].count("|") == 8
