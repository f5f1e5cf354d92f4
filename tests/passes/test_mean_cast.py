"""deploy/passes/mean_cast.py: the fp32 cast mixed precision puts before a
mean runs inside the mean's kernel, with the same arithmetic."""

from __future__ import annotations

from deploy.passes.mean_cast import fuse_mean_casts

from .test_flat_gemm import _fused, _kernels, _parse
from .test_movement import _assert_bit_exact

SE = """
@I.ir_module
class Mod:
    @R.function
    def main(x: R.Tensor((2, 6, 5, 16), "float16"), w: R.Tensor((4, 1, 1, 16), "float16")):
        with R.dataflow():
            a = R.astype(x, "float32")
            m = R.mean(a, axis=[1, 2], keepdims=True)
            s = R.astype(m, "float16")
            y = R.nn.conv2d(s, w, data_layout="NHWC", kernel_layout="OHWI")
            z = R.multiply(x, R.const(2.0, "float16"))
            R.output(y, z)
        return (y, z)
"""


def _cast_kernels(mod):
    return sorted(n for n in _kernels(mod) if n.startswith("cast"))


def test_fuse_ops_alone_leaves_the_cast_before_a_mean_as_a_kernel_of_its_own():
    # The workaround's reason: once this fails, TVM fuses the cast itself.
    assert _cast_kernels(_fused(_parse(SE))) == ["cast"]


def test_the_squeeze_excitation_mean_reads_fp16_in_one_kernel_with_the_same_result():
    mod = _parse(SE)
    plain, grouped = _fused(mod), _fused(fuse_mean_casts()(mod))
    assert _cast_kernels(grouped) == []
    means = [n for n in _kernels(grouped) if "mean" in n]
    assert len(means) == 1
    kernel = _kernels(grouped)[means[0]]
    assert [str(p.dtype) for p in kernel.params] == ["float16", "float16"]  # (reads fp16, writes fp16)
    _assert_bit_exact(plain, grouped)


def test_a_global_pool_without_a_cast_after_it_is_grouped_too():
    # (the classifier's pool: the cast to fp16 sits after the reshape, moved there by passes/movement.py)
    mod = _parse(SE.replace('s = R.astype(m, "float16")\n            y = R.nn.conv2d(s, w, data_layout="NHWC", '
                            'kernel_layout="OHWI")', "y = R.reshape(m, R.shape([2, 16]))"))
    assert "R.nn.conv2d" not in mod.script()
    grouped = _fused(fuse_mean_casts()(mod))
    assert _cast_kernels(grouped) == []
    _assert_bit_exact(_fused(mod), grouped)


def test_a_mean_read_by_an_elementwise_op_keeps_it_in_its_kernel():
    # A norm's x - mean(x): FuseOps puts the subtraction into the mean's kernel;
    # a group would leave it out, one kernel more.
    norm = _parse(SE.replace('s = R.astype(m, "float16")\n            y = R.nn.conv2d(s, w, data_layout="NHWC", '
                             'kernel_layout="OHWI")', "y = R.subtract(R.astype(x, \"float32\"), m)"))
    assert fuse_mean_casts()(norm).script() == norm.script()


def test_a_cast_fused_into_the_producer_already_is_left_alone():
    # The map's only reader is the cast: FuseOps puts the cast into the kernel
    # that makes the map (tuned, maybe); grouping would change that kernel.
    sole = _parse(SE.replace('a = R.astype(x, "float32")', 'a = R.astype(R.nn.relu(x), "float32")')
                  .replace("R.multiply(x, R.const", "R.multiply(R.nn.relu(x), R.const"))
    assert "R.nn.relu" in sole.script()
    assert fuse_mean_casts()(sole).script() == sole.script()


def test_a_widened_copy_read_elsewhere_and_a_narrowing_cast_are_left_alone():
    shared = _parse(SE.replace("R.multiply(x, R.const(2.0, \"float16\"))", "R.multiply(a, R.const(2.0, \"float32\"))"))
    assert fuse_mean_casts()(shared).script() == shared.script()
    narrowing = _parse(SE.replace('"float16"), w', '"float32"), w').replace('R.const(2.0, "float16")', 'R.const(2.0, "float32")').replace('R.astype(x, "float32")',
                                                                          'R.astype(x, "float16")')
                       .replace('R.astype(m, "float16")', 'R.astype(m, "float32")')
                       .replace('w: R.Tensor((4, 1, 1, 16), "float16")', 'w: R.Tensor((4, 1, 1, 16), "float32")'))
    assert fuse_mean_casts()(narrowing).script() == narrowing.script()
