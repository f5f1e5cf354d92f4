"""deploy/passes/nchwc.py: the CPU's blocked convolution layout computes
what NCHW computes, blocks each convolution by its own channel counts, keeps
what it cannot block in NCHW, and the TVM defects it works around are still
there (each test named `..._still_...` fails once TVM no longer needs us)."""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest

from deploy import config, optimize
from deploy.passes import nchwc
from deploy.tvm_compat import relax, tvm


@pytest.mark.parametrize("cin,cout,groups,want", [
    (64, 256, 1, ("NCHW16c", "OIHW16i16o", "NCHW16c")),
    (3, 64, 1, ("NCHW3c", "OIHW3i16o", "NCHW16c")),  # a first layer: its 3 channels taken whole
    (24, 40, 1, ("NCHW8c", "OIHW8i8o", "NCHW8c")),
    (96, 96, 96, ("NCHW16c", "OIHW1i16o", "NCHW16c")),  # depthwise
    (20, 20, 20, ("NCHW4c", "OIHW1i4o", "NCHW4c")),
    (64, 64, 32, None),  # grouped, 2 channels a group: NCHW
    (512, 512, 32, ("NCHW16c", "OIHW16i16o", "NCHW16c")),  # grouped, 16 channels a group (ResNeXt's third stage)
    (1024, 1024, 32, ("NCHW16c", "OIHW32i16o", "NCHW16c")),  # 32 a group: each block within one
    (128, 128, 32, None),  # 4 a group: its tensor's block of 16 would span four (and 4c cannot meet 16c)
    (64, 96, 2, ("NCHW16c", "OIHW32i16o", "NCHW16c")),  # 32 in, 48 out a group
    (48, 48, 4, None),  # 12 a group
    (17, 64, 1, None),  # no block divides 17 and it is too wide to take whole
    (64, 30, 1, None),
])
def test_blocks(cin, cout, groups, want):
    assert nchwc.blocks(cin, cout, groups) == want


def _net():
    """conv 3->16 + relu, depthwise 3x3, conv 16->24 + residual-free add of a
    bias, grouped conv, max pool, conv_transpose, global mean: every branch of
    the layout choice in one graph."""
    bb = relax.BlockBuilder()
    rng = np.random.default_rng(0)

    def const(*shape):
        return relax.const(rng.standard_normal(shape).astype("float32") * 0.2)

    x = relax.Var("x", relax.TensorType((1, 3, 12, 12), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.relu(relax.op.nn.conv2d(x, const(16, 3, 3, 3), padding=1)))
            y = bb.emit(relax.op.nn.conv2d(y, const(16, 1, 3, 3), padding=1, groups=16))
            y = bb.emit(relax.op.add(relax.op.nn.conv2d(y, const(24, 16, 1, 1)), const(1, 24, 1, 1)))
            y = bb.emit(relax.op.nn.conv2d(y, const(24, 12, 3, 3), padding=1, groups=2))
            y = bb.emit(relax.op.nn.max_pool2d(y, pool_size=2, strides=2))
            y = bb.emit(relax.op.nn.conv2d_transpose(y, const(24, 8, 2, 2), strides=2))
            out = bb.emit_output(relax.op.mean(y, axis=[2, 3]))
        bb.emit_func_output(out)
    return bb.get()


def _profile(layout):
    return config.from_dict({"model": {"source": "tiny_cnn"}, "llvm": {"layout": layout}}).llvm


def _vm(mod, llvm_target, folder):
    """Built as the build stage builds a bucket (our schedules, our TIR pipeline)."""
    from deploy.build import build_bucket
    from deploy.tvm_compat import load_module, save_json

    folder.mkdir()
    (folder / "m.json").write_text(save_json(mod))
    build_bucket(str(folder / "m.json"), llvm_target, _profile("NCHWc"), None, str(folder / "m.so"))
    return relax.VirtualMachine(load_module(str(folder / "m.so")), tvm.cpu())


def test_nchwc_module_computes_what_nchw_computes(llvm_target, tmp_path):
    x = np.random.default_rng(1).standard_normal((1, 3, 12, 12)).astype("float32")
    outs, scripts = {}, {}
    for layout in ("NCHW", "NCHWc"):
        mod, _ = optimize.optimize_module(_net(), _profile(layout), llvm_target.tvm_target())
        scripts[layout] = mod.script()
        vm = _vm(mod, llvm_target, tmp_path / layout)
        outs[layout] = vm["main"](tvm.runtime.tensor(x)).numpy()
    np.testing.assert_allclose(outs["NCHWc"], outs["NCHW"], rtol=1e-4, atol=1e-5)
    s = scripts["NCHWc"]
    assert re.search(r"(?<!depthwise_)conv2d_NCHWc", s) and "depthwise_conv2d_NCHWc" in s
    assert "conv2d_NCHWc" not in scripts["NCHW"]
    # the first layer's 3 channels whole, the depthwise blocked by 16, the 16->24 in 16 out 8; the grouped stays NCHW
    layouts = {}
    for line in nchwc.convert()(_net()).script().splitlines():
        m = re.search(r"R\.nn\.conv2d\(.*groups=(\d+), data_layout=\"(\w+)\", kernel_layout=\"(\w+)\"", line)
        if m:
            layouts.setdefault(int(m.group(1)), []).append((m.group(2), m.group(3)))
    assert layouts == {1: [("NCHW3c", "OIHW3i16o"), ("NCHW16c", "OIHW16i8o")], 16: [("NCHW16c", "OIHW1i16o")],
                       2: [("NCHW", "OIHW")]}


def _grouped_net():
    """A 1x1 convolution, then grouped 3x3 ones of 16, 4, 8 and 32 channels a
    group (two of stride 2, one with a multiplier: 16 in, 32 out a group),
    with biases and ReLU."""
    bb = relax.BlockBuilder()
    rng = np.random.default_rng(0)

    def const(*shape):
        return relax.const(rng.standard_normal(shape).astype("float32") * 0.2)

    op = relax.op
    x = relax.Var("x", relax.TensorType((1, 32, 10, 10), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(op.nn.relu(op.nn.conv2d(x, const(64, 32, 1, 1))))
            y = bb.emit(op.nn.relu(op.add(op.nn.conv2d(y, const(64, 16, 3, 3), padding=1, groups=4),
                                          const(1, 64, 1, 1))))
            y = bb.emit(op.nn.relu(op.nn.conv2d(y, const(64, 4, 3, 3), padding=1, groups=16)))
            y = bb.emit(op.nn.conv2d(y, const(64, 8, 3, 3), strides=2, padding=1, groups=8))
            y = bb.emit(op.nn.conv2d(y, const(64, 32, 3, 3), strides=2, padding=1, groups=2))
            y = bb.emit(op.nn.conv2d(y, const(128, 16, 3, 3), padding=1, groups=4))
            out = bb.emit_output(op.nn.relu(y))
        bb.emit_func_output(out)
    return bb.get()


def test_grouped_convolutions_blocked_compute_what_nchw_computes(llvm_target, tmp_path, monkeypatch):
    """Grouped convolutions whose groups are whole blocks of 16 run in NCHW16c
    (our `group_conv2d_NCHWc`), and those of 4 or 8 channels a group too,
    widened to 16 with zero weights (`widen_groups`): the result as in NCHW.
    With GROUPED off they stay NCHW; with WIDEN_GROUPS off the 4 and 8 do."""
    x = np.random.default_rng(1).standard_normal((1, 32, 10, 10)).astype("float32")
    outs = {}
    for layout in ("NCHW", "NCHWc"):
        mod, _ = optimize.optimize_module(_grouped_net(), _profile(layout), llvm_target.tvm_target())
        if layout == "NCHWc":
            assert sum("group_conv2d_NCHWc" in gv.name_hint for gv in mod.functions) == 5
        outs[layout] = _vm(mod, llvm_target, tmp_path / layout)["main"](tvm.runtime.tensor(x)).numpy()
    np.testing.assert_allclose(outs["NCHWc"], outs["NCHW"], rtol=1e-4, atol=1e-5)
    widened = nchwc.widen_groups()(_grouped_net()).script()
    assert "groups=16" not in widened and "groups=8" not in widened and widened.count("groups=4") == 4  # (two widened, two as they were)
    monkeypatch.setattr(nchwc, "WIDEN_GROUPS", False)
    assert "groups=16" in nchwc.widen_groups()(_grouped_net()).script()
    monkeypatch.setattr(nchwc, "GROUPED", False)
    assert "groups=4, data_layout=\"NCHW\"" in nchwc.convert()(_grouped_net()).script()


def test_convert_layout_still_cannot_move_a_tensor_between_channel_blocks():
    """Fails once TVM's ConvertLayout moves a tensor from NCHW4c to NCHW16c
    (then a grouped convolution of 4 or 8 channels a group can take its own
    block next to 16-channel ones: `blocks`)."""
    bb = relax.BlockBuilder()
    rng = np.random.default_rng(0)
    x = relax.Var("x", relax.TensorType((1, 128, 8, 8), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.conv2d(x, relax.const(rng.standard_normal((128, 4, 3, 3)).astype("float32")),
                                           padding=1, groups=32))
            out = bb.emit_output(relax.op.nn.conv2d(y, relax.const(rng.standard_normal((64, 128, 1, 1))
                                                                   .astype("float32"))))
        bb.emit_func_output(out)

    def layouts(call):
        if call.op.name == "relax.nn.conv2d" and int(call.attrs.groups) > 1:
            return {"relax.nn.conv2d": ["NCHW4c", "OIHW4i4o", "NCHW4c"]}
        return nchwc._layouts(call)

    with pytest.raises(Exception, match="Invalid layout axis"):
        relax.transform.ConvertLayout({}, layouts)(bb.get())


def test_a_blocked_conv2d_still_is_not_legalized_by_tvm(llvm_target):
    """Fails once TVM 0.27's LegalizeOps lowers a conv2d with a channel block
    (then nchwc.legalize_conv2d can go)."""
    mod = nchwc.convert()(_net())
    with llvm_target.tvm_target():
        main = relax.transform.LegalizeOps()(mod).script().split("def main")[1]
    assert "R.nn.conv2d(" in main


def _mean_then_layer_norm(widths=(32,)):
    """ConvNeXt's head: a spatial mean of a convolution's output, then
    LayerNorm over the channels (the convolutions: 16 channels in, `widths`
    out, 3x3 then 1x1s, a ReLU between two)."""
    bb = relax.BlockBuilder()
    rng = np.random.default_rng(0)
    x = relax.Var("x", relax.TensorType((1, 16, 7, 7), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y, k = x, 3
            for i, (c_in, c_out) in enumerate(zip((16, *widths), widths)):
                weight = relax.const(rng.standard_normal((c_out, c_in, k, k)).astype("float32"))
                y = bb.emit(relax.op.nn.conv2d(relax.op.nn.relu(y) if i else y, weight, padding=k // 2))
                k = 1
            y = bb.emit(relax.op.mean(y, axis=[2, 3], keepdims=False))
            g = relax.const(np.ones(widths[-1], "float32"))
            out = bb.emit_output(relax.op.nn.layer_norm(y, g, g, axes=[-1]))
        bb.emit_func_output(out)
    return bb.get()


def test_convert_layout_still_fails_on_a_layer_norm_behind_a_mean():
    """Fails once TVM's ConvertLayout carries a blocked layout through a
    reduction into LayerNorm (then convnext gets NCHWc too, not the fallback)."""
    with pytest.raises(Exception, match="layer_norm"):
        relax.transform.ConvertLayout({}, nchwc._layouts)(_mean_then_layer_norm())


def test_a_model_convert_layout_fails_on_keeps_nchw(caplog):
    plain = _mean_then_layer_norm()
    with caplog.at_level(logging.WARNING, logger="deploy.passes.nchwc"):
        mod = nchwc.convert()(plain)
    assert mod.script() == plain.script()
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith("layout: convolutions stay in NCHW") and "\n" not in line
    assert "(relax.nn.layer_norm requires the input gamma" in line


def test_a_module_without_convolutions_skips_convert_layout(monkeypatch):
    """(TVM's pass took 13 s over a GRU's 8,000 unrolled ops, converting nothing.)"""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 8), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.tanh(relax.op.matmul(x, relax.const(np.ones((8, 8), "float32")))))
        bb.emit_func_output(out)
    plain = bb.get()

    ran = []
    monkeypatch.setattr(relax.transform, "ConvertLayout", lambda *args: ran.append(args) or (lambda mod: mod))
    assert nchwc.convert()(plain).script() == plain.script()
    assert not ran
    nchwc.convert()(_mean_then_layer_norm())
    assert ran


def test_nchwc_is_the_cpu_default_and_not_a_cuda_layout():
    assert config.LLVM_DEFAULTS.layout == "NCHWc"
    with pytest.raises(config.ConfigError, match="NCHWc is the CPU's layout"):
        config.from_dict({"model": {"source": "tiny_cnn"}, "cuda": {"layout": "NCHWc"}})


def test_tvm_refusing_blocked_convolutions_is_not_logged(llvm_target, caplog):
    """TVM's conv2d legalization logs a refusal for every blocked convolution
    a pass tries it on (106 lines for ResNet-50's two buckets); ours lowers them."""
    with caplog.at_level(logging.INFO):
        optimize.optimize_module(_net(), _profile("NCHWc"), llvm_target.tvm_target())
    assert not [r for r in caplog.records if "legalized" in r.getMessage()]


def _onnx_clip_net():
    """Conv then ReLU6 as torch exports it (Clip with tensor bounds), through TVM's ONNX frontend."""
    from onnx import TensorProto, helper, numpy_helper

    from deploy.tvm_compat import from_onnx

    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
         helper.make_node("Clip", ["c", "lo", "hi"], ["y"])],
        "clip", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 32, 8, 8])],
        [numpy_helper.from_array(rng.standard_normal((32, 16, 3, 3)).astype("float32"), "w"),
         numpy_helper.from_array(np.array(0, "float32"), "lo"), numpy_helper.from_array(np.array(6, "float32"), "hi")])
    return from_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), keep_params_in_input=False)


def test_the_onnx_frontend_still_writes_clip_as_opaque_kernels():
    """Fails once TVM's ONNX frontend writes Clip as Relax operators (then passes/clip.py can go)."""
    main = _onnx_clip_net().script().split("def main")[1]
    assert "R.call_tir(" in main and "R.maximum(" not in main and "R.clip(" not in main


def test_clip_kernels_become_relax_ops_and_compute_the_same(llvm_target):
    from deploy.passes.clip import clip_kernels_to_ops

    plain = relax.transform.FoldConstant()(_onnx_clip_net())
    mod = clip_kernels_to_ops()(plain)
    main = mod.script().split("def main")[1]
    assert "R.maximum(" in main and "R.minimum(" in main and "R.call_tir(" not in main
    # then the blocked layout goes through the ReLU6 without a transform around it
    blocked = nchwc.convert()(mod)
    assert blocked.script().count("R.layout_transform(") == 3  # input, weights, output
    x = np.random.default_rng(3).standard_normal((1, 16, 8, 8)).astype("float32") * 3
    outs = []
    for m in (plain, mod):
        ex = tvm.compile(relax.get_pipeline("zero")(m), target=llvm_target.tvm_target())
        outs.append(relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy())
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    assert outs[0].min() == 0 and outs[0].max() == 6


def test_a_kernel_named_maximum_that_is_not_topi_maximum_is_left_alone():
    from deploy.passes.clip import clip_kernels_to_ops
    from deploy.tvm_compat import topi

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 4), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(bb.emit_te(topi.add, x, relax.const(np.array(1, "float32")),
                                            primfunc_name_hint="maximum"))
        bb.emit_func_output(out)
    mod = bb.get()
    assert "R.call_tir(" in clip_kernels_to_ops()(mod).script()


def test_a_relax_clip_becomes_max_min_and_the_blocked_layout_goes_through(llvm_target):
    """ONNX HardSwish (MobileNetV3) comes out of TVM's frontend with an R.clip
    that ConvertLayout transforms around in 0.27; as maximum/minimum it does not."""
    from onnx import TensorProto, helper, numpy_helper

    from deploy.passes.clip import clip_kernels_to_ops
    from deploy.tvm_compat import from_onnx

    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c"]), helper.make_node("HardSwish", ["c"], ["y"])],
        "hardswish", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 6, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 32, 6, 6])],
        [numpy_helper.from_array(rng.standard_normal((32, 16, 1, 1)).astype("float32"), "w")])
    plain = relax.transform.FoldConstant()(from_onnx(helper.make_model(graph, opset_imports=[
        helper.make_opsetid("", 17)]), keep_params_in_input=False))
    assert "R.clip(" in plain.script()
    assert nchwc.convert()(plain).script().count("R.layout_transform(") > 3
    mod = clip_kernels_to_ops()(plain)
    assert "R.clip(" not in mod.script()
    assert nchwc.convert()(mod).script().count("R.layout_transform(") == 3  # input, weights, output
    xs = rng.standard_normal((1, 16, 6, 6)).astype("float32") * 3
    outs = []
    for m in (plain, mod):
        ex = tvm.compile(relax.get_pipeline("zero")(m), target=llvm_target.tvm_target())
        outs.append(relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(xs)).numpy())
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-6, atol=1e-6)
