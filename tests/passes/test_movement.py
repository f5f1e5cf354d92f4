"""deploy/passes/movement.py: casts moved below data movement, exact cast
round trips removed, a constant-index take made a slice. Every value stays
bit for bit as it was, and ViT's QKV split no longer casts the whole tensor
once per use."""

from __future__ import annotations

import numpy as np

from deploy.passes.movement import tidy_movement
from deploy.tvm_compat import VirtualMachine, relax, tensor, tvm

from .test_flat_gemm import _args, _fused, _kernels, _parse


def _run(mod, args):
    ex = tvm.compile(relax.transform.LegalizeOps()(mod), target="llvm")
    out = VirtualMachine(ex, tvm.cpu())["main"](*[tensor(a) for a in args])
    return [o.numpy() for o in ([out] if hasattr(out, "numpy") else list(out))]


def _assert_bit_exact(mod, new):
    """Both modules on the same seeded inputs: every output of the same
    dtype, shape and bits."""
    args = _args(mod)
    for ref, got in zip(_run(mod, args), _run(new, args)):
        assert got.dtype == ref.dtype and got.shape == ref.shape
        np.testing.assert_array_equal(got, ref)


def _qkv():
    """ViT's attention inputs as ToMixedPrecision leaves them: the fp16 QKV
    tensor cast to fp32 once for each `take`, q scaled in fp32, k transposed
    in fp32, each cast back to fp16."""
    return _parse("""
@I.ir_module
class Mod:
    @R.function
    def main(x: R.Tensor((3, 2, 4, 5, 8), "float16")):
        with R.dataflow():
            a = R.astype(x, "float32")
            q = R.take(a, R.const(0, "int64"), axis=0, mode="fast")
            b = R.astype(x, "float32")
            k = R.take(b, R.const(1, "int64"), axis=0, mode="fast")
            c = R.astype(x, "float32")
            v = R.take(c, R.const(2, "int64"), axis=0, mode="fast")
            q1 = R.astype(R.multiply(q, R.const(0.125, "float32")), "float16")
            k1 = R.astype(R.permute_dims(k, axes=[0, 1, 3, 2]), "float16")
            v1 = R.astype(v, "float16")
            R.output(q1, k1, v1)
        return (q1, k1, v1)
""")


def test_the_qkv_split_casts_only_what_it_scales_and_is_bit_exact():
    mod = _qkv()
    new = tidy_movement()(mod)
    text = new.script()
    assert "R.take" not in text and text.count("R.strided_slice") == 3
    # no cast of the whole 5-D tensor any more; only q's scaling is in fp32
    assert 'R.Tensor((3, 2, 4, 5, 8), dtype="float32")' not in text
    assert text.count("R.astype") == 2, text
    assert "R.astype(x" in mod.script()  # the input module is left as it was
    _assert_bit_exact(mod, new)
    # each slice is fused into the kernel that consumes it: three kernels, no take
    kernels = _kernels(_fused(relax.transform.DeadCodeElimination()(new)))
    assert len(kernels) == 3 and not [n for n in kernels if "take" in n], kernels.keys()


def test_only_exact_round_trips_are_removed():
    """fp16 -> fp32 -> fp16 is the value itself; fp32 -> fp16 -> fp32 rounds, and stays."""
    mod = _parse("""
@I.ir_module
class Mod:
    @R.function
    def main(x: R.Tensor((4, 8), "float16"), y: R.Tensor((4, 8), "float32")):
        with R.dataflow():
            a = R.astype(R.astype(x, "float32"), "float16")
            b = R.astype(R.astype(y, "float16"), "float32")
            R.output(a, b)
        return (a, b)
""")
    new = tidy_movement()(mod)
    assert new.script().count("R.astype") == 2  # b's two casts; a is x
    _assert_bit_exact(mod, new)


def test_a_take_of_an_index_tensor_or_without_an_axis_is_left_alone():
    mod = _parse("""
@I.ir_module
class Mod:
    @R.function
    def main(x: R.Tensor((3, 8), "float32"), i: R.Tensor((2,), "int64"), f: R.Tensor((24,), "float32")):
        with R.dataflow():
            a = R.take(x, i, axis=0)
            b = R.take(f, R.const(5, "int64"))
            R.output(a, b)
        return (a, b)
""")
    new = tidy_movement()(mod)
    assert new.script().count("R.take") == 2 and "strided_slice" not in new.script()


def test_mixed_precision_still_casts_a_shared_input_once_per_take():
    """Why the pass exists: ToMixedPrecision (through our wrapper) keeps
    `take` in fp32 and casts its fp16 input at each use, one whole-tensor
    cast per take. Fails once TVM casts such an input once, or takes in fp16
    (then the cast sinking is no longer needed for it; the slices still are)."""
    from deploy.passes.mixed_precision import to_mixed_precision

    mod = _parse("""
@I.ir_module
class Mod:
    @R.function
    def main(x: R.Tensor((6, 16), "float32"), w: R.Tensor((16, 24), "float32")):
        with R.dataflow():
            y = R.reshape(R.matmul(x, w), R.shape([6, 3, 8]))
            t = R.permute_dims(y, axes=[1, 0, 2])
            q = R.take(t, R.const(0, "int64"), axis=0)
            k = R.take(t, R.const(1, "int64"), axis=0)
            v = R.take(t, R.const(2, "int64"), axis=0)
            s = R.matmul(q, R.permute_dims(k, axes=[1, 0]))
            o = R.matmul(s, v)
            R.output(o)
        return o
""")
    mixed = to_mixed_precision("float32")(mod)
    whole = 'R.Tensor((3, 6, 8), dtype="float32") = R.astype('
    assert mixed.script().count(whole) >= 2, mixed.script()
    assert tidy_movement()(mixed).script().count(whole) == 0


def test_a_negative_index_is_a_slice_only_where_take_wraps():
    """mode='wrap' takes row -1 as the last row: a slice, bit-exact; under
    'clip' (row 0) or 'fast' (out of bounds) the take is left as it was."""
    mod = _parse("""
@I.ir_module
class Mod:
    @R.function
    def main(x: R.Tensor((4, 3), "float32")):
        with R.dataflow():
            a = R.take(x, R.const(-1, "int64"), axis=0, mode="wrap")
            b = R.take(x, R.const(-1, "int64"), axis=0, mode="clip")
            R.output(a, b)
        return (a, b)
""")
    new = tidy_movement()(mod)
    assert new.script().count("R.take") == 1 and 'mode="clip"' in new.script()
    _assert_bit_exact(mod, new)
