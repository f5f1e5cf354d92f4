"""deploy/passes: each workaround of a TVM defect with a test that fails once
TVM no longer needs it, and the schedule chain's fallbacks. All on the CPU
machine (the CUDA builds cross-compile for sm_90: every TIR pass runs)."""

import json

import numpy as np
import pytest
import tvm_ffi

from deploy import config, pipeline
from deploy.errors import BuildError
from deploy.passes import mixed_precision, schedule, tensor_core_smem
from deploy.tvm_compat import PassContext, dlight, relax, tirx, tvm


def _matmul_softmax_layernorm(sm90_info):
    """fp16 matmul (fp32 out: DLight's Matmul puts it on tensor cores),
    softmax and LayerNorm (DLight schedules both with shared memory)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((128, 256), "float16"))
    w = relax.const(np.random.default_rng(0).standard_normal((256, 256)).astype("float16"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, w, out_dtype="float32"))
            z = bb.emit(relax.op.nn.softmax(y, axis=-1))
            g = bb.emit(relax.op.nn.layer_norm(z, relax.const(np.ones(256, "float32")),
                                               relax.const(np.zeros(256, "float32")), axes=[-1]))
            out = bb.emit_output(g)
        bb.emit_func_output(out)
    t = sm90_info.tvm_target()
    with t, PassContext(opt_level=3):
        mod = relax.transform.LegalizeOps()(bb.get())
        mod = relax.transform.AnnotateTIROpPattern()(mod)
        mod = relax.transform.FuseTIR()(relax.transform.FuseOps()(mod))
        g = dlight.gpu
        mod = dlight.ApplyDefaultSchedule(g.Matmul(), g.GEMV(), g.Reduction(), g.GeneralReduction(), g.Fallback())(mod)
    return mod, t


def test_merge_static_smem_for_a_whole_module_still_breaks_dlight_reductions(sm90_info):
    """Why the tensor-core workaround is scoped: set module-wide, TVM 0.27's
    option breaks DLight's softmax/LayerNorm kernels. Fails once TVM fixes
    MergeSharedMemoryAllocations (then the scoping can go)."""
    mod, t = _matmul_softmax_layernorm(sm90_info)
    with t, PassContext(opt_level=3, config={tensor_core_smem.OPTION: True}):
        with pytest.raises(Exception, match="buffer_byte_offsets"):
            tvm.compile(mod, target=t)


def test_scoped_pipeline_builds_tensor_core_and_reduction_kernels_together(sm90_info):
    mod, t = _matmul_softmax_layernorm(sm90_info)
    tc = {gv.name_hint: tensor_core_smem.uses_tensor_cores(f) for gv, f in mod.functions.items()
          if isinstance(f, tirx.PrimFunc)}
    assert tc == {"matmul": True, "softmax": False, "layer_norm": False}
    with t, PassContext(opt_level=3):
        ex = tvm.compile(mod, target=t, tir_pipeline=tensor_core_smem.register())
    assert ex is not None


def _conv_clip_module():
    """A convolution followed by TVM's own frontend form of Clip with tensor
    bounds (`call_tir` of a TOPI maximum/minimum), as MobileNetV2's ReLU6
    imports."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from deploy.tvm_compat import from_onnx

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((8, 3, 3, 3)).astype("float32"), "w"),
             numpy_helper.from_array(np.array(0.0, "float32"), "lo"),
             numpy_helper.from_array(np.array(6.0, "float32"), "hi")]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Clip", ["c", "lo", "hi"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 8, 8])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    return from_onnx(model, keep_params_in_input=False)


def test_to_mixed_precision_alone_still_fails_on_call_tir_arguments():
    """Fails once TVM's ToMixedPrecision handles non-tensor arguments (then
    deploy.passes.mixed_precision can go)."""
    mod = _conv_clip_module()
    assert "call_tir" in mod.script()
    with pytest.raises(Exception, match="Expected TensorType"):
        relax.transform.ToMixedPrecision(out_dtype="float32")(mod)


def test_guarded_mixed_precision_computes_the_same(llvm_target):
    mod = _conv_clip_module()
    fp16 = mixed_precision.to_mixed_precision("float32")(mod)
    assert "float16" in fp16.script()
    assert tvm_ffi.structural_equal(mixed_precision.unpin()(fp16), fp16)  # no no-op casts left
    x = np.random.default_rng(1).standard_normal((1, 3, 8, 8)).astype("float32")
    outs = []
    for m in (mod, fp16):
        with llvm_target.tvm_target():
            ex = tvm.compile(relax.get_pipeline("zero")(m), target=llvm_target.tvm_target())
        vm = relax.VirtualMachine(ex, tvm.cpu())
        outs.append(vm["main"](tvm.runtime.tensor(x)).numpy())
    assert outs[0].min() >= 0 and outs[0].max() <= 6
    np.testing.assert_allclose(outs[1], outs[0], atol=2e-2 * np.abs(outs[0]).max())


def _tiny_cuda_module(tmp_path, sm90_info):
    from deploy import export, frontend, optimize

    cfg = config.from_dict({"model": {"source": "tiny_cnn"}, "cuda": {"buckets": [1], "trials": 0}})
    ex = export.run(cfg, tmp_path / "export")
    fe = frontend.run(cfg.cuda, ex, tmp_path / "frontend")
    return optimize.run(cfg.cuda, sm90_info, fe, tmp_path / "optimize").load_module(1), cfg


def test_a_tuned_kernel_that_does_not_build_falls_back(tmp_path, sm90_info):
    """A tuning record whose schedule does not build (made to fail here: the
    build of any module holding it raises as TVM does) falls back to the
    default chain (DLight's rules and ours) for that kernel alone; the other
    kernels keep their records, and the fallback is reported with TVM's line."""
    from deploy import build

    mod, cfg = _tiny_cuda_module(tmp_path, sm90_info)
    t = sm90_info.tvm_target()
    with t:  # every kernel 'tuned' (DLight's schedule standing in for a record)
        tuned = dlight.ApplyDefaultSchedule(*[r for _, r in schedule.rules("cuda")])(mod.clone())
    funcs = [gv for gv, f in mod.functions.items() if isinstance(f, tirx.PrimFunc)]
    broken = funcs[0]
    tuned[broken] = tuned[broken].with_attr("test.broken", True)

    def fails_if_broken(m):
        if any(isinstance(f, tirx.PrimFunc) and f.attrs and "test.broken" in f.attrs for f in m.functions.values()):
            raise tvm.error.InternalError("Check failed: (x) is false: tvm_access_ptr element type must match\nIR")

    def compile_fn(m):
        fails_if_broken(m)
        return build.compile_module(m, sm90_info, cfg.cuda)

    def kernel_builds(name, f):
        fails_if_broken(tvm.IRModule({name: f}))
        return build.build_kernel(name, f, sm90_info)

    with t:
        _, kernels = schedule.build(mod, tuned, t, "cuda", compile_fn=compile_fn, kernel_builds=kernel_builds)
    by_name = {k.name: k for k in kernels}
    k = by_name[broken.name_hint]
    assert k.source in schedule.CHAINS["cuda"] and [f["source"] for f in k.fallbacks] == [schedule.TUNED]
    assert k.fallbacks[0]["reason"] == "Check failed: (x) is false: tvm_access_ptr element type must match"
    assert all(o.source == schedule.TUNED and not o.fallbacks for n, o in by_name.items() if n != broken.name_hint)
    assert schedule.summarize(kernels)["fallbacks"][0]["kernel"] == broken.name_hint


def test_a_rule_that_raises_falls_back_to_the_next(tmp_path, sm90_info, monkeypatch):
    from deploy import build

    class Raises:
        def apply(self, func, target, tunable):
            raise AssertionError("There are some consumers of the cache-write stage that are not properly inlined")

    real = schedule.rules
    monkeypatch.setattr(schedule, "rules", lambda kind: [("dlight.Broken", Raises())] + real(kind))
    mod, cfg = _tiny_cuda_module(tmp_path, sm90_info)
    with sm90_info.tvm_target():
        _, kernels = schedule.build(mod, None, sm90_info.tvm_target(), "cuda",
                                    compile_fn=lambda m: build.compile_module(m, sm90_info, cfg.cuda),
                                    kernel_builds=lambda n, f: build.build_kernel(n, f, sm90_info))
    assert all(k.fallbacks[0]["source"] == "dlight.Broken" and "properly inlined" in k.fallbacks[0]["reason"]
               for k in kernels)
    assert all(k.source != "dlight.Broken" for k in kernels)
    # A DLight rule raising declined the kernel: the manifest lists it apart, and no fallback is counted.
    report = schedule.summarize(kernels)
    assert not report["fallbacks"] and len(report["declined"]) == len(kernels)
    assert all(d["from"] == ["dlight.Broken"] and "properly inlined" in d["reasons"][0] for d in report["declined"])


def test_one_of_our_rules_raising_is_a_fallback(tmp_path, sm90_info, monkeypatch):
    from deploy import build

    class Raises:
        def apply(self, func, target, tunable):
            raise AssertionError("our rule's own defect")

    real = schedule.rules
    monkeypatch.setattr(schedule, "rules", lambda kind: [(schedule.MMA_GEMM, Raises())] + real(kind))
    mod, cfg = _tiny_cuda_module(tmp_path, sm90_info)
    with sm90_info.tvm_target():
        _, kernels = schedule.build(mod, None, sm90_info.tvm_target(), "cuda",
                                    compile_fn=lambda m: build.compile_module(m, sm90_info, cfg.cuda),
                                    kernel_builds=lambda n, f: build.build_kernel(n, f, sm90_info))
    report = schedule.summarize(kernels)
    assert len(report["fallbacks"]) == len(kernels) and not report["declined"]
    assert all(f["from"][0] == schedule.MMA_GEMM and "own defect" in f["reasons"][0] for f in report["fallbacks"])


def test_a_kernel_no_source_builds_is_one_line_and_a_log(tmp_path, monkeypatch, capsys):
    """A kernel that no source builds (made so here: its every schedule
    raises as TVM does): the run ends in one `error:` line naming the stage
    and the kernel, exit 2, the whole trace in <workdir>/logs/build.log."""
    from deploy import build, cli

    real_compile, real_kernel = build.compile_module, build.build_kernel

    def fails_on_mean(m):
        if any(gv.name_hint == "mean" for gv in m.functions):
            raise tvm.error.InternalError("Check failed: (ok) is false: cannot lower mean\n  IR dump")

    def compile_module(m, target, profile):
        fails_on_mean(m)
        return real_compile(m, target, profile)

    def build_kernel(name, f, target):
        fails_on_mean(tvm.IRModule({name: f}))
        return real_kernel(name, f, target)

    monkeypatch.setattr(build, "compile_module", compile_module)
    monkeypatch.setattr(build, "build_kernel", build_kernel)
    ws = tmp_path / "ws"
    rc = cli.main(["run", "-m", "tiny_cnn", "--target", "cuda:sm_90", "--buckets", "1", "--trials", "0",
                   "--workdir", str(ws), "--db-root", str(tmp_path / "db")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    errors = [ln for ln in err if ln.startswith("error:")]
    assert len(errors) == 1, err
    assert "build: kernel 'mean': no schedule builds" in errors[0] and "cannot lower mean" in errors[0]
    assert "full trace in" in errors[0] and (ws / "logs" / "build.log").is_file()
    assert "Traceback" in (ws / "logs" / "build.log").read_text()
    assert not any("Traceback" in ln for ln in err)
    assert not (ws / "package").exists()


def test_stage_guard_turns_a_tvm_failure_into_one_line(tmp_path):
    with pytest.raises(BuildError) as e:
        with pipeline.stage_guard(tmp_path, "optimize"):
            raise tvm.error.InternalError("Check failed: (x) is false: bad shape\n# from tvm.script import ir as I\n@I.ir_module")
    assert str(e.value).startswith("optimize failed: Check failed: (x) is false: bad shape | full trace in ")
    assert "\n" not in str(e.value)
    assert json.dumps(str(e.value))  # plain text
    assert (tmp_path / "logs" / "optimize.log").is_file()


def _conv_then_transposed_conv():
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 4, 8, 8), "float32"))
    rng = np.random.default_rng(0)
    w = relax.const(rng.standard_normal((8, 4, 3, 3)).astype("float32"))
    wt = relax.const(rng.standard_normal((8, 4, 2, 2)).astype("float32"))  # IOHW
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.conv2d(x, w, padding=1))
            z = bb.emit(relax.op.nn.conv2d_transpose(y, wt, strides=2))
            out = bb.emit_output(relax.op.nn.relu(z))
        bb.emit_func_output(out)
    return bb.get()


def test_convert_layout_still_moves_conv2d_transpose_where_topi_cannot_lower_it():
    """Fails once TVM lowers an NHWC conv2d_transpose (then deploy.passes.layout can go)."""
    mod = relax.transform.ConvertLayout({"relax.nn.conv2d": ["NHWC", "OHWI"]})(_conv_then_transposed_conv())
    assert "R.nn.conv2d_transpose(" in relax.transform.LegalizeOps()(mod).script().split("def main")[1]


def test_nhwc_layouts_keep_conv2d_transpose_lowerable(llvm_target):
    from deploy.passes import layout

    plain = _conv_then_transposed_conv()
    mod = layout.convert_to_nhwc()(plain)
    main = relax.transform.LegalizeOps()(mod).script().split("def main")[1]
    assert "R.nn.conv2d_transpose(" not in main and "NHWC" in mod.script()
    x = np.random.default_rng(2).standard_normal((1, 4, 8, 8)).astype("float32")
    outs = []
    for m in (plain, mod):
        ex = tvm.compile(relax.get_pipeline("zero")(m), target=llvm_target.tvm_target())
        outs.append(relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy())
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-4, atol=1e-4)


def _modules(m):
    yield m
    for i in m.imports:
        yield from _modules(i)


def _square_module():
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 8), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.power(x, relax.const(2.0, "float32")))
            out = bb.emit_output(relax.op.add(y, relax.op.power(x, relax.const(0.5, "float32"))))
        bb.emit_func_output(out)
    return bb.get()


def test_tvm_still_lowers_a_square_to_fast_math_powf(sm90_info):
    """Fails once TVM's CUDA code for x**2 is no longer powf (compiled with
    --use_fast_math: NaN for x < 0); then deploy.passes.exact_power can go."""
    import inspect

    from tvm.support import nvcc

    t = sm90_info.tvm_target()
    with t, PassContext(opt_level=3):
        ex = tvm.compile(relax.get_pipeline("zero")(_square_module()), target=t)
    src = "".join(m.inspect_source() for m in _modules(ex.mod) if m.kind == "cuda")
    assert "powf(" in src and "0x1p+1f" in src
    assert "--use_fast_math" in inspect.getsource(nvcc._compile_cuda_nvrtc)


def test_small_integer_powers_become_multiplications(llvm_target):
    from deploy.passes import exact_power

    mod = _square_module()
    new = exact_power.power_to_multiply()(mod)
    text = new.script()
    assert text.count("R.power(") == 1 and "R.multiply(x, x)" in text  # 0.5 is left to powf
    x = np.abs(np.random.default_rng(3).standard_normal((4, 8))).astype("float32")
    outs = []
    for m in (mod, new):
        ex = tvm.compile(relax.get_pipeline("zero")(m), target=llvm_target.tvm_target())
        outs.append(relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy())
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-6)
