"""deploy/passes/gpu_default.py: the CUDA default schedule of short
reductions (depthwise convolutions, small pools) on the CPU machine (the
builds cross-compile for sm_90)."""

from __future__ import annotations

import numpy as np
import pytest

from deploy import targets
from deploy.build import build_kernel
from deploy.passes import gpu_default, schedule
from deploy.passes.gpu_default import ShortReduction
from deploy.tvm_compat import PassContext, relax, tirx, tvm


def _kernels(build, target, shape=(8, 28, 28, 64), dtype="float16"):
    """The fused PrimFuncs of a one-function Relax module built by `build(bb, x)`."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, dtype))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(build(bb, x))
        bb.emit_func_output(out)
    with target, PassContext(opt_level=3):
        mod = relax.transform.LegalizeOps()(bb.get())
        mod = relax.transform.AnnotateTIROpPattern()(mod)
        mod = relax.transform.FuseTIR()(relax.transform.FuseOps()(mod))
    return {gv.name_hint: f for gv, f in mod.functions.items() if isinstance(f, tirx.PrimFunc)}


def _depthwise_silu(bb, x, k=3):
    rng = np.random.default_rng(0)
    w = relax.const(rng.standard_normal((64, k, k, 1)).astype("float16"))
    b = relax.const(rng.standard_normal((1, 1, 1, 64)).astype("float16"))
    y = bb.emit(relax.op.nn.conv2d(x, w, padding=[k // 2] * 4, groups=64, data_layout="NHWC", kernel_layout="OHWI",
                                   out_dtype="float32"))
    y = bb.emit(relax.op.add(relax.op.astype(y, "float16"), b))
    return relax.op.multiply(y, relax.op.sigmoid(y))


def _first_source(func, target):
    gv = tvm.ir.GlobalVar("main")
    return next(s for s in schedule._sources(gv, func, None, target, "cuda") if not isinstance(s[1], Exception))


@pytest.mark.parametrize("k", [3, 7])
def test_a_depthwise_convolution_gets_a_thread_per_window_and_builds(sm90, k):
    """NHWC depthwise: each thread 4 neighbouring outputs along W (28 = 7 x 4),
    each row of its window loaded into registers once (the padded input's
    `(4 - 1) + k` values a row)."""
    (func,) = [f for n, f in _kernels(lambda bb, x: _depthwise_silu(bb, x, k), sm90).items() if "conv2d" in n]
    source, scheduled = _first_source(func, sm90)
    assert source == schedule.SHORT_REDUCTION
    text = scheduled.script()
    outputs = 8 * 28 * 28 * 64
    assert f'T.thread_binding(T.int64({outputs // 4 // 256}), thread="blockIdx.x")' in text  # a thread per 4 outputs
    assert 'thread="threadIdx.x"' in text and "T.unroll" in text and 'scope="local"' in text
    assert "T.sigmoid" in text  # the epilogue is applied as each thread writes
    lib = build_kernel("dw", scheduled, targets.resolve("cuda:sm_90"))  # compiled for sm_90 (raises if not)
    source = lib.imports[0].inspect_source()
    assert "dw_kernel" in source and f"half pad_temp_local_ptr[{3 + k}];" in source  # one row of the window


def test_dlight_alone_still_gives_a_depthwise_convolution_a_block_per_output(sm90):
    """Why the rule exists: DLight's chain without it (Matmul cannot take a
    grouped convolution) schedules one thread block per output element.
    Fails once DLight schedules it otherwise; then look again at whether the
    rule is still needed."""
    from deploy.tvm_compat import dlight

    (func,) = [f for n, f in _kernels(_depthwise_silu, sm90).items() if "conv2d" in n]
    g = dlight.gpu
    with sm90:
        mod = dlight.ApplyDefaultSchedule(g.Matmul(), g.GEMV(), g.Reduction(), g.GeneralReduction(), g.Fallback())(
            tvm.IRModule({"main": func}))
    assert f'T.thread_binding(T.int64({8 * 28 * 28 * 64}), thread="blockIdx.x")' in mod["main"].script()


@pytest.mark.parametrize("what, build", [
    ("a long reduction (global average pool over 28x28)",
     lambda bb, x: relax.op.mean(x, axis=[1, 2], keepdims=True)),
    ("a contraction DLight's Matmul takes (a 1x1 convolution)",
     lambda bb, x: relax.op.nn.conv2d(x, relax.const(np.ones((64, 1, 1, 64), "float16")), data_layout="NHWC",
                                      kernel_layout="OHWI", out_dtype="float32")),
    ("an elementwise kernel", lambda bb, x: relax.op.nn.relu(x)),
])
def test_other_kernels_are_left_to_dlight(sm90, what, build):
    for name, func in _kernels(build, sm90).items():
        source, _ = _first_source(func, sm90)
        assert source != schedule.SHORT_REDUCTION, (what, name)


def test_a_small_pool_window_is_a_short_reduction(sm90):
    (func,) = _kernels(lambda bb, x: relax.op.nn.max_pool2d(x, pool_size=[3, 3], padding=[1, 1, 1, 1], layout="NHWC"),
                       sm90).values()
    assert ShortReduction().apply(func, sm90) is not None
    assert ShortReduction().apply(func, targets.resolve("llvm").tvm_target()) is None  # CUDA only


def test_a_short_reduction_along_the_contiguous_axis_stays_with_dlight(sm90):
    """A sum over a last axis of 32: one thread per row would read it
    strided; DLight's reduction rules read it coalesced."""
    kernels = _kernels(lambda bb, x: relax.op.sum(relax.op.reshape(x, [8 * 28 * 28 * 2, 32]), axis=[1]), sm90)
    (func,) = [f for n, f in kernels.items() if "sum" in n]
    assert ShortReduction().apply(func, sm90) is None
    # (the same sum over the other axis is one thread per output)
    (func,) = [f for n, f in _kernels(lambda bb, x: relax.op.sum(x, axis=[1]), sm90).items() if "sum" in n]
    assert ShortReduction().apply(func, sm90) is not None


def test_a_kernel_the_rule_cannot_schedule_is_declined_not_raised(sm90):
    """A reduction whose result is also read after its consumer (an output
    block the epilogue cannot be inlined into): the rule returns None."""
    from tvm.script import tirx as T

    @T.prim_func(private=True, s_tir=True)
    def two_outputs(x: T.Buffer((64, 64, 4), "float32"), t: T.Buffer((64, 64), "float32"),
                    y: T.Buffer((64, 64), "float32")):
        for i, j, k in T.grid(64, 64, 4):
            with T.sblock("t"):
                vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                with T.init():
                    t[vi, vj] = T.float32(0)
                t[vi, vj] = t[vi, vj] + x[vi, vj, vk]
        for i, j in T.grid(64, 64):
            with T.sblock("y"):
                vi, vj = T.axis.remap("SS", [i, j])
                y[vi, vj] = t[vi, vj] + t[vj, vi]

    assert ShortReduction().apply(two_outputs, sm90) is None


def _se_reduce(batch, c=672, o=28):
    """A squeeze-excitation 'reduce' convolution: [batch, 1, 1, c] -> o, SiLU."""
    def build(bb, x):
        rng = np.random.default_rng(0)
        pooled = bb.emit(relax.op.mean(x, axis=[1, 2], keepdims=True))
        w = relax.const(rng.standard_normal((o, 1, 1, c)).astype("float16"))
        y = bb.emit(relax.op.nn.conv2d(pooled, w, data_layout="NHWC", kernel_layout="OHWI", out_dtype="float32"))
        y = bb.emit(relax.op.astype(y, "float16"))
        return relax.op.multiply(y, relax.op.sigmoid(y))
    return build


def _few_kernels(batch, build):
    return _kernels(build, targets.resolve("cuda:sm_90").tvm_target(), (batch, 7, 7, 672))


def test_a_contraction_with_few_outputs_gets_a_block_per_output_and_builds(sm90):
    """FewOutputs: the squeeze-excitation convolution at batch 32 (896
    outputs, 672 steps) is split over many thread blocks, where DLight's
    Matmul gave it one; at batch 1 it stays GEMV's."""
    (func,) = [f for n, f in _few_kernels(32, _se_reduce(32)).items() if "conv2d" in n]
    source, scheduled = _first_source(func, sm90)
    assert source == schedule.FEW_OUTPUTS
    assert 'T.thread_binding(T.int64(896), thread="blockIdx.x")' in scheduled.script()
    lib = build_kernel("se", scheduled, targets.resolve("cuda:sm_90"))  # compiled for sm_90 (raises if not)
    assert "se_kernel" in lib.imports[0].inspect_source()
    (func,) = [f for n, f in _few_kernels(1, _se_reduce(1)).items() if "conv2d" in n]
    assert _first_source(func, sm90)[0] == "dlight.GEMV"


def test_dlight_alone_gives_a_contraction_with_few_outputs_one_block(sm90):
    """Why the rule exists: DLight's Matmul tiles the squeeze-excitation
    convolution at batch 32 into a single thread block. Fails once it uses
    more; then look again at whether FewOutputs is still needed."""
    from deploy.tvm_compat import dlight

    (func,) = [f for n, f in _few_kernels(32, _se_reduce(32)).items() if "conv2d" in n]
    with sm90:
        mod = dlight.ApplyDefaultSchedule(dlight.gpu.Matmul())(tvm.IRModule({"main": func}))
    text = mod["main"].script()
    assert 'T.thread_binding(T.int64(1), thread="blockIdx.x")' in text
    assert 'T.thread_binding(T.int64(1), thread="blockIdx.y")' in text


def test_a_contraction_read_strided_or_with_many_outputs_stays_with_matmul(sm90):
    from deploy.passes.gpu_default import FewOutputs

    def classifier(bb, x):  # [32, 672] @ [672, 1000]: the reduction walks the weight's rows
        pooled = bb.emit(relax.op.reshape(relax.op.mean(x, axis=[1, 2]), [32, 672]))
        return relax.op.matmul(pooled, relax.const(np.ones((672, 1000), "float16")))

    (func,) = [f for n, f in _few_kernels(32, classifier).items() if "matmul" in n]
    assert FewOutputs().apply(func, sm90) is None
    (func,) = [f for n, f in _few_kernels(32, _se_reduce(32, o=1024)).items() if "conv2d" in n]  # 32768 outputs
    assert FewOutputs().apply(func, sm90) is None
    # not a contraction: a row sum (49 rows of 672, contiguous) stays DLight's Reduction
    row_sum = _few_kernels(1, lambda bb, x: relax.op.sum(relax.op.reshape(x, [49, 672]), axis=[1]))
    (func,) = [f for n, f in row_sum.items() if "sum" in n]
    assert FewOutputs().apply(func, sm90) is None and _first_source(func, sm90)[0] != schedule.FEW_OUTPUTS


def _se_excite(c=144, squeezed=6):
    """The squeeze-excitation "excite" kernel: a 1x1 convolution of the
    squeezed channels, bias, sigmoid, multiplied into the feature map."""
    def build(bb, x):
        rng = np.random.default_rng(2)
        s = bb.emit(relax.op.astype(relax.op.mean(relax.op.strided_slice(x, [3], [0], [squeezed]), axis=[1, 2],
                                                  keepdims=True), "float16"))
        w = relax.const(rng.standard_normal((c, 1, 1, squeezed)).astype("float16"))
        b = relax.const(rng.standard_normal((1, 1, 1, c)).astype("float16"))
        y = bb.emit(relax.op.nn.conv2d(s, w, data_layout="NHWC", kernel_layout="OHWI", out_dtype="float32"))
        y = bb.emit(relax.op.add(relax.op.astype(y, "float16"), b))
        return relax.op.multiply(x, relax.op.sigmoid(y))
    return build


def _excite_kernel(batch, c, target):
    kernels = _kernels(_se_excite(c), target, (batch, 14, 14, c))
    (func,) = [f for n, f in kernels.items() if "conv2d" in n and "multiply" in n]
    return func


@pytest.mark.parametrize("batch,c,lanes,vector_type", [(32, 144, 8, "uint4"), (5, 36, 4, "half4"), (1, 144, 8, "uint4")],
                         ids=["b32-8-lanes", "b5-4-lanes-bounds-checked", "b1-before-gemv"])
def test_the_excite_kernel_reads_and_writes_its_feature_map_in_vectors(sm90, batch, c, lanes, vector_type):
    """BroadcastEpilogue: where DLight leaves the excite kernel to Fallback
    (scalar loads, a thread per element), the broadcast multiply gets up to 8
    fp16 elements per thread (4 where the channels are not a multiple of 8;
    a last block checked against the bounds where the threads do not divide
    the elements); compiled for sm_90."""
    source, scheduled = _first_source(_excite_kernel(batch, c, sm90), sm90)
    assert source == schedule.BROADCAST_EPILOGUE
    threads = batch * 14 * 14 * c // lanes
    text = scheduled.script()
    assert f'T.thread_binding(T.int64({-(-threads // 256)}), thread="blockIdx.x")' in text
    assert ("T.where" in text) == (threads % 256 != 0)
    src = build_kernel("excite", scheduled, targets.resolve("cuda:sm_90")).imports[0].inspect_source()
    lines = src.splitlines()
    assert any(f"*({vector_type}*)(x_ptr +" in ln for ln in lines), "the feature map is not read in vectors"
    assert any(f"*({vector_type}*)(T_multiply_intermediate_ptr +" in ln and " = " in ln for ln in lines), \
        "the output is not written in vectors"


def test_dlights_gemv_gives_the_excite_kernel_at_batch_1_a_block_a_few_channels(sm90):
    """Why BroadcastEpilogue comes before DLight's GEMV in the chain: at
    batch 1 GEMV takes the excite kernel and computes the broadcast multiply
    over the whole feature map in the blocks of the reduction, one block per
    16 channels: EfficientNet-B0's first (112x112x32 features, 2 blocks) took
    0.317 ms a call on an H100 for 1.6 MB
    (results/h100/2026-12-06/verify-conv-transpose-vector-rows/profile-efficientnet_b0-b1/).
    Fails once GEMV spreads the epilogue over more blocks; then time GEMV
    against ours again."""
    from deploy.tvm_compat import dlight

    func = _excite_kernel(1, 144, sm90)
    with sm90:
        mod = dlight.ApplyDefaultSchedule(dlight.gpu.GEMV())(tvm.IRModule({"main": func}))
    text = mod["main"].script()
    assert 'T.thread_binding(T.int64(9), thread="blockIdx.x")' in text  # 144 channels, 16 a block
    assert text.count('thread="blockIdx') == 1


def test_dlight_leaves_the_excite_kernel_to_fallback(sm90):
    """Why the rule exists: every DLight rule before Fallback declines or
    fails on the excite kernel. Fails once one of them takes it; then look
    again at whether BroadcastEpilogue is still needed."""
    func = _excite_kernel(32, 144, sm90)
    gv = tvm.ir.GlobalVar("main")
    chain = [name for name, got in schedule._sources(gv, func, None, sm90, "cuda") if not isinstance(got, Exception)]
    assert [n for n in chain if n != schedule.BROADCAST_EPILOGUE] == ["dlight.Fallback"]


def test_an_epilogue_of_the_reductions_own_shape_is_not_a_broadcast(sm90):
    from deploy.passes.gpu_default import BroadcastEpilogue

    (func,) = [f for n, f in _kernels(lambda bb, x: _depthwise_silu(bb, x, 3), sm90).items() if "conv2d" in n]
    assert BroadcastEpilogue().apply(func, sm90) is None


def _depthwise_strided(bb, x, k=3, stride=2):
    rng = np.random.default_rng(1)
    w = relax.const(rng.standard_normal((64, k, k, 1)).astype("float16"))
    y = bb.emit(relax.op.nn.conv2d(x, w, strides=[stride] * 2, padding=[k // 2] * 4, groups=64, data_layout="NHWC",
                                   kernel_layout="OHWI", out_dtype="float32"))
    return relax.op.astype(y, "float16")


def _max_pool(bb, x):
    return relax.op.nn.max_pool2d(x, pool_size=[3, 3], strides=[2, 2], padding=[1, 1, 1, 1], layout="NHWC")


@pytest.mark.gpu
@pytest.mark.parametrize("what, make, shape", [
    ("3x3", lambda bb, x: _depthwise_silu(bb, x, 3), (8, 28, 28, 64)),
    ("7x7", lambda bb, x: _depthwise_silu(bb, x, 7), (4, 56, 56, 64)),
    ("7x7 at 7x7", lambda bb, x: _depthwise_silu(bb, x, 7), (32, 7, 7, 64)),
    ("3x3 stride 2", _depthwise_strided, (8, 28, 28, 64)),
    ("5x5 stride 2", lambda bb, x: _depthwise_strided(bb, x, 5), (8, 30, 30, 64)),
    ("max pool", _max_pool, (8, 28, 28, 64)),
])
def test_the_window_schedule_computes_what_tvms_plain_lowering_does(sm90, what, make, shape):
    """On the GPU: every window width tuning can choose against the same
    kernel unscheduled, lowered for the CPU."""
    (func,) = [f for n, f in _kernels(make, sm90, shape).items() if "conv2d" in n or "pool" in n]
    args, want = _reference(func)
    dev = tvm.cuda(0)
    width = int(args[-1].shape[2])  # the output's W: the widths that divide it (others fall to the default)
    for vw in [v for v in gpu_default.WINDOW_CHOICES if width % v == 0]:
        with sm90:
            sch = ShortReduction(window=vw).apply(func, sm90)
        assert sch is not None
        lib = build_kernel("k", sch.mod["main"], targets.resolve("cuda:sm_90"))
        got = [tvm.runtime.tensor(a, dev) for a in args]
        lib["k"](*got)
        np.testing.assert_allclose(got[-1].numpy().astype("float32"), want[-1].numpy().astype("float32"),
                                   rtol=2e-2, atol=2e-2, err_msg=f"{what}, window {vw}")


def _reference(func):
    """Seeded arguments of a PrimFunc, and the arguments after TVM's plain
    lowering of it for the CPU has run (its outputs written)."""
    from deploy.tvm_compat import ms

    info = ms.arg_info.ArgInfo.from_prim_func(func)
    args = [np.random.default_rng(2).standard_normal([int(d) for d in a.shape]).astype(str(a.dtype)) for a in info]
    cpu = tvm.tirx.build(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target="llvm")
    want = [tvm.runtime.tensor(a) for a in args]
    cpu["main"](*want)
    return args, want


@pytest.mark.parametrize("what, make, shape", [
    ("3x3", lambda bb, x: _depthwise_silu(bb, x, 3), (2, 14, 14, 64)),
    ("7x7", lambda bb, x: _depthwise_silu(bb, x, 7), (2, 14, 14, 64)),
    ("5x5 stride 2", lambda bb, x: _depthwise_strided(bb, x, 5), (2, 16, 16, 64)),
    ("max pool", _max_pool, (2, 28, 28, 64)),
])
def test_the_window_schedule_computes_it_in_emulation(sm90, what, make, shape):
    """Every window width, its CUDA run in tests/cuda_emu.py against the
    kernel unscheduled, lowered for the CPU: on the CPU machine, what the
    `-m gpu` test above checks on a GPU (smaller shapes: the emulation runs
    each thread block in Python; two images: at one the image loop is gone
    and the rule gives a thread an output, no window, which these shapes
    had tested instead)."""
    from .. import emulation

    (func,) = [f for n, f in _kernels(make, sm90, shape).items() if "conv2d" in n or "pool" in n]
    args, want = _reference(func)
    width = int(args[-1].shape[2])
    for vw in [v for v in gpu_default.WINDOW_CHOICES if width % v == 0]:
        with sm90:
            sch = ShortReduction(window=vw).apply(func, sm90)
        assert sch is not None and "pad_temp" in sch.mod["main"].script(), vw  # (the window, in registers)
        got, problems = emulation.run(func, sch.mod["main"], sm90, args)
        assert not problems, (vw, sorted(problems)[:5])
        np.testing.assert_allclose(got.astype("float32"), want[-1].numpy().astype("float32"), rtol=1e-3, atol=1e-3,
                                   err_msg=f"{what}, window {vw}")


def test_the_reference_of_the_window_test_runs_on_the_cpu(sm90):
    (func,) = [f for n, f in _kernels(_max_pool, sm90, (2, 8, 8, 64)).items() if "pool" in n]
    args, want = _reference(func)
    assert want[-1].numpy().shape == (2, 4, 4, 64) and not np.array_equal(want[-1].numpy(), args[-1])


def test_tuning_gets_the_window_width_and_block_size_as_decisions(sm90):
    (func,) = [f for n, f in _kernels(lambda bb, x: _depthwise_silu(bb, x, 7), sm90, (4, 56, 56, 64)).items()
               if "conv2d" in n]
    with sm90:
        sch = ShortReduction().apply(func, sm90, tunable=True)
    samples = [i for i in sch.trace.insts if i.kind.name == "SampleCategorical"]
    assert [[int(c) for c in i.attrs[0]] for i in samples] == [[1, 2, 4, 7, 8], list(gpu_default.THREAD_CHOICES)]
    build_kernel("dw", sch.mod["main"], targets.resolve("cuda:sm_90"))


def _te_depthwise():
    """A TE depthwise 3x3 NHWC kernel whose weight is cast in the kernel: a
    second producer beside the padding."""
    from tvm import te, topi

    x = te.placeholder((8, 28, 28, 64), "float16", name="x")
    w = te.placeholder((3, 3, 64, 1), "float32", name="w")
    y = topi.nn.depthwise_conv2d_nhwc(x, topi.cast(w, "float16"), 1, 1, 1, out_dtype="float16")
    return te.create_prim_func([x, w, y])


def test_the_window_is_the_padded_input_when_the_weight_has_a_producer_too(sm90):
    """Two producers (the padding and a cast of the weight): the window in
    registers is the padded input's, wherever it comes among them."""
    func = _te_depthwise()
    with sm90:
        scheduled = ShortReduction().apply(func, sm90)
    text = build_kernel("dw", scheduled.mod["main"], targets.resolve("cuda:sm_90")).imports[0].inspect_source()
    assert "PaddedInput_local_ptr[6];" in text  # (4 - 1) + 3 inputs a window row


def _grouped_conv(bb, x, channels=4, k=3, stride=1, layout="HWIO"):
    """A grouped NHWC convolution (ResNeXt's 3x3: `channels` a group), its
    bias and ReLU; its weight HWIO, as passes/depthwise_layout.py gives it,
    or OHWI."""
    rng = np.random.default_rng(3)
    c = int(x.ty.shape[-1])
    w = (rng.standard_normal((c, k, k, channels)) / (k * (channels ** 0.5))).astype("float16")
    w = relax.const(w.transpose(1, 2, 3, 0).copy() if layout == "HWIO" else w)
    b = relax.const(rng.standard_normal((1, 1, 1, c)).astype("float16"))
    y = bb.emit(relax.op.nn.conv2d(x, w, strides=[stride] * 2, padding=[k // 2] * 4, groups=c // channels,
                                   data_layout="NHWC", kernel_layout=layout, out_dtype="float32"))
    return relax.op.nn.relu(relax.op.add(relax.op.astype(y, "float16"), b))


@pytest.mark.parametrize("channels, stride, n", [(4, 1, 8), (8, 2, 8), (32, 1, 8), (4, 1, 1)])
def test_a_grouped_convolution_gets_four_outputs_a_thread_and_builds(sm90, channels, stride, n):
    """ResNeXt's grouped 3x3 (4 to 32 channels a group; 36 to 288 steps
    of reduction; at batch 1 too, where the image loop is gone): a thread
    four adjacent outputs, the group's channels summed with the taps,
    unrolled, the epilogue applied as it writes; DLight gave each output a
    block of its own. At each tap and channel the thread loads the input
    once (not once an output) and the four weights in one 8-byte load (the
    PTX nvcc makes of it: 9 x channels of each, and the bias). 64 channels
    a group (576 steps) stay with DLight, as does a dense convolution of as
    many steps."""
    import re

    from tvm.support import nvcc

    (func,) = [f for name, f in _kernels(lambda bb, x: _grouped_conv(bb, x, channels, stride=stride), sm90,
                                         (n, 28, 28, 128)).items() if "conv2d" in name]
    source, scheduled = _first_source(func, sm90)
    assert source == schedule.SHORT_REDUCTION
    text = scheduled.script()
    outputs = n * (28 // stride) ** 2 * 128
    assert f'T.thread_binding(T.int64({outputs // 4 // 256}), thread="blockIdx.x")' in text
    assert "T.unroll" in text and "T.max" in text  # (the ReLU, as each thread writes)
    src = build_kernel("grouped", scheduled, targets.resolve("cuda:sm_90")).imports[0].inspect_source()
    with tvm.target.Target({"kind": "cuda", "arch": "sm_90"}):
        ptx = nvcc.compile_cuda(src, target_format="ptx", compiler="nvcc").decode()
    loads = re.findall(r"ld\.global\.nc\.(v4\.)?u16", ptx)
    assert loads.count("v4.") == 9 * channels and len(loads) - loads.count("v4.") == 9 * channels + 4
    (wide,) = [f for n, f in _kernels(lambda bb, x: _grouped_conv(bb, x, 64), sm90, (8, 28, 28, 128)).items()
               if "conv2d" in n]
    assert ShortReduction().apply(wide, sm90) is None
    # a dense 3x3 over 16 channels (144 steps, as a grouped one of 16 channels): no group, not this rule's
    (dense,) = [f for n, f in _kernels(lambda bb, x: _grouped_conv(bb, x, 16, layout="OHWI"), sm90,
                                       (8, 28, 28, 16)).items() if "conv2d" in n]
    assert "T.max" in dense.script() and ShortReduction().apply(dense, sm90) is None


@pytest.mark.parametrize("what", ["dense", "depthwise", "max pool", "transposed"])
def test_nchw_kernels_are_not_grouped_convolutions(sm90, what):
    """In NCHW the last axis is W, whose index holds an output variable and
    a reduction one as a grouped convolution's channel does; no weight
    holds that output variable (a pool has no weight), so neither a dense
    3x3 over 16 channels (144 steps), a depthwise one, a max pool nor a
    transposed convolution (U-Net's, left in NCHW) is taken as grouped."""
    rng = np.random.default_rng(4)

    def make(bb, x):
        if what == "max pool":
            return relax.op.nn.max_pool2d(x, pool_size=[3, 3], padding=[1, 1, 1, 1], layout="NCHW")
        if what == "transposed":
            w = relax.const(rng.standard_normal((16, 16, 2, 2)).astype("float16"))
            return relax.op.nn.conv2d_transpose(x, w, strides=[2, 2], out_dtype="float32")
        groups = 16 if what == "depthwise" else 1
        w = relax.const(rng.standard_normal((16, 16 // groups, 3, 3)).astype("float16"))
        return relax.op.nn.conv2d(x, w, padding=[1] * 4, groups=groups, out_dtype="float32")

    (func,) = [f for n, f in _kernels(make, sm90, (8, 16, 28, 28)).items() if "conv" in n or "pool" in n]
    with sm90:
        sch = ShortReduction().apply(func, sm90, tunable=True)
    assert sch is None or gpu_default._grouped_read(*_main_block(func, sm90)) is None, what


def test_tuning_chooses_a_grouped_convolutions_outputs_a_thread(sm90):
    """The grouped schedule's design space: the outputs a thread (1, 2 or
    4: those dividing the channels) and the block size, decisions."""
    (func,) = [f for n, f in _kernels(lambda bb, x: _grouped_conv(bb, x, 4), sm90, (8, 14, 14, 128)).items()
               if "conv2d" in n]
    with sm90:
        sch = ShortReduction().apply(func, sm90, tunable=True)
    decisions = [inst for inst in sch.trace.insts if inst.kind.name == "SampleCategorical"]
    assert [sorted(int(c) for c in d.attrs[0]) for d in decisions] == [[1, 2, 4], [64, 128, 256, 512, 1024]]


def _main_block(func, target):
    """`gpu_default._grouped_read`'s arguments for `func`'s reduction block."""
    from deploy.passes.kernel_shape import reduction_loops, rule_kernel

    sch, (main, _, _, n_s, extents) = rule_kernel(func, target, "cuda")
    return sch.get(main.block_rv), main, n_s, {v for v, _ in reduction_loops(main, n_s, extents)}


@pytest.mark.parametrize("channels, stride, layout, n, per_thread", [
    (4, 1, "HWIO", 2, 4), (32, 2, "HWIO", 2, 4), (4, 1, "OHWI", 2, 4), (8, 1, "HWIO", 1, 4), (8, 1, "HWIO", 2, 2),
    (4, 1, "HWIO", 2, 1)])
def test_the_grouped_schedule_computes_it_in_emulation(sm90, channels, stride, layout, n, per_thread, monkeypatch):
    """Its CUDA run in tests/cuda_emu.py against the kernel unscheduled,
    lowered for the CPU (the weight as the optimize stage leaves it, and
    OHWI, whose four weights of a tap are not side by side: no vector); four
    outputs a thread, two, one."""
    from .. import emulation

    monkeypatch.setattr(gpu_default, "GROUPED_OUTPUTS", per_thread)
    (func,) = [f for name, f in _kernels(lambda bb, x: _grouped_conv(bb, x, channels, stride=stride, layout=layout),
                                         sm90, (n, 8, 8, 128)).items() if "conv2d" in name]
    args, want = _reference(func)
    with sm90:
        sch = ShortReduction().apply(func, sm90)
    got, problems = emulation.run(func, sch.mod["main"], sm90, args)
    assert not problems, sorted(problems)[:5]
    np.testing.assert_allclose(got.astype("float32"), want[-1].numpy().astype("float32"), rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("channels, stride", [(4, 1), (8, 2), (32, 1)])
def test_gpu_the_grouped_schedule_computes_what_tvms_plain_lowering_does(sm90, channels, stride):
    (func,) = [f for n, f in _kernels(lambda bb, x: _grouped_conv(bb, x, channels, stride=stride), sm90,
                                      (8, 28, 28, 128)).items() if "conv2d" in n]
    args, want = _reference(func)
    with sm90:
        sch = ShortReduction().apply(func, sm90)
    lib = build_kernel("k", sch.mod["main"], targets.resolve("cuda:sm_90"))
    got = [tvm.runtime.tensor(a, tvm.cuda(0)) for a in args]
    lib["k"](*got)
    np.testing.assert_allclose(got[-1].numpy().astype("float32"), want[-1].numpy().astype("float32"),
                               rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("what, build, shape", [
    ("an RMS norm, rows as many as its channels", lambda bb, x: relax.op.nn.rms_norm(
        x, relax.const(np.ones((256,), "float16")), axes=[-1]), (256, 256)),
    ("an RMS norm over 128 channels", lambda bb, x: relax.op.nn.rms_norm(
        x, relax.const(np.ones((128,), "float16")), axes=[-1]), (2, 128, 128)),
])
def test_a_reduction_broadcast_along_the_row_is_not_an_excite_kernel(sm90, what, build, shape):
    """BroadcastEpilogue comes before DLight's reductions in the chain: it
    takes only a broadcast over other axes than the last (the excite
    kernel's), not a row's reduction broadcast along the row. (`x -
    mean(x)` over NHWC's pixels is the excite kernel's shape: taken, its
    threads reading neighbouring channels.)"""
    from deploy.passes.gpu_default import BroadcastEpilogue

    for name, func in _kernels(build, sm90, shape).items():
        assert BroadcastEpilogue().apply(func, sm90) is None, name
        assert _first_source(func, sm90)[0] != schedule.BROADCAST_EPILOGUE, name
