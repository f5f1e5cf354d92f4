"""deploy/passes/attention.py and attention_schedule.py: attention as one
kernel (`--fused-attention`).

On the CPU machine: the rewrite computes what the unfused graph computes
(both modules, optimized for CUDA, compiled for llvm and run on the same
inputs), which attention it leaves alone, and the kernel's CUDA schedule
built for sm_90 (tensor cores, no local memory); the TVM defects its
schedule works around. On the GPU (`-m gpu`): the corpus's transformers
built with it and validated against ONNX Runtime and PyTorch."""

import json
import re
import shutil
import subprocess

import numpy as np
import onnx
import pytest
import torch

from deploy import config, export, frontend, optimize, pipeline, targets
from deploy.passes import attention, attention_schedule, tensor_core_smem
from deploy.tvm_compat import relax, tvm

from .. import emulation
from ..conftest import load_script

TRANSFORMERS = ["vit", "bert", "gpt", "tiny_vit"]


def _optimized(name, target, work, fused: bool, batch: int = 2, size: str = "small", inputs=None, **extra):
    """The module optimized for `target` (CUDA fp16): a registry model at
    `size`, or an ONNX file with its `inputs` (the config's tables)."""
    model = {"source": name, "size": size} if inputs is None else {"source": name, "inputs": inputs}
    cfg = config.from_dict({"model": model,
                            "cuda": {"buckets": [batch], "tune_buckets": [batch], "precision": "fp16",
                                     "fused_attention": fused, **extra}})
    profile = cfg.profile("cuda")
    ex = export.run(cfg, work / "export")
    fe = frontend.run(profile, ex, work / "frontend")
    return optimize.run(profile, target, fe, work / "optimize").load_module(batch)


def _run_on_cpu(mod):
    """The module's outputs on seeded inputs, compiled for llvm (its kernels
    unscheduled: TVM's own lowering)."""
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    rng = np.random.default_rng(0)
    args = []
    for p in mod["main"].params:
        shape, dtype = [int(d) for d in p.ty.shape], str(p.ty.dtype)
        if "int" in dtype:  # token ids, and a mask with its second half padded
            a = rng.integers(0, 50, size=shape).astype(dtype)
            if "mask" in p.name:
                a[:] = 1
                a[..., shape[-1] // 2:] = 0
        else:
            a = rng.standard_normal(shape).astype(dtype)
        args.append(tvm.runtime.tensor(a))
    out = vm["main"](*args)
    outs = [out] if hasattr(out, "numpy") else list(out)
    return [o.numpy().astype("float32") for o in outs]


def _kernels(mod):
    return {gv.name_hint: f for gv, f in mod.functions.items() if isinstance(f, tvm.tirx.PrimFunc)}


@pytest.mark.parametrize("name", TRANSFORMERS)
def test_fused_attention_computes_what_the_graph_computed(name, tmp_path, sm90_info):
    plain = _optimized(name, sm90_info, tmp_path / "plain", fused=False)
    fused = _optimized(name, sm90_info, tmp_path / "fused", fused=True)
    ours = [f for f in _kernels(fused).values() if attention.is_attention(f)]
    assert ours, "no attention was fused"
    assert len(_kernels(fused)) < len(_kernels(plain))
    # the layers' kernels are one function (structurally equal: the builder keeps one)
    assert len(ours) <= 2
    for a, b in zip(_run_on_cpu(plain), _run_on_cpu(fused), strict=True):
        assert np.isfinite(b).all()
        assert np.linalg.norm(a - b) <= 1e-5 * np.linalg.norm(a), np.abs(a - b).max()


class _SDPA(torch.nn.Module):
    """Self-attention by torch's scaled_dot_product_attention under a padding
    mask (an input): its exporter puts where(isnan(P), 0, P) after the
    softmax, as in Hugging Face's decoder LMs."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.qkv, self.out = torch.nn.Linear(64, 192), torch.nn.Linear(64, 64)

    def forward(self, x, mask):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, 4, 16).permute(2, 0, 3, 1, 4)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :].bool())
        return self.out(o.transpose(1, 2).reshape(b, n, 64))


def _sdpa_onnx(tmp_path):
    path = tmp_path / "sdpa.onnx"
    torch.onnx.export(_SDPA(), (torch.randn(2, 16, 64), torch.ones(2, 16, dtype=torch.long)), str(path),
                      opset_version=17, dynamo=False, input_names=["x", "mask"], output_names=["y"])
    return path


SDPA_INPUTS = [{"name": "x", "shape": [16, 64]}, {"name": "mask", "shape": [16], "dtype": "int64"}]


def _sdpa_inputs():
    x = np.random.default_rng(0).standard_normal((2, 16, 64)).astype("float32")
    mask = np.ones((2, 16), "int64")
    mask[0, 9:], mask[1] = 0, 0  # (sample 1: every key masked)
    return x, mask


def test_a_nan_fill_after_the_softmax_is_fused_and_kept(tmp_path, sm90_info):
    """torch's exported SDPA: the where(isnan(P), 0, P) goes into the kernel,
    and a sample whose every key is masked gives what the graph gives (its
    attention 0, where the softmax alone gives NaN)."""
    path = _sdpa_onnx(tmp_path)
    assert "IsNaN" in {n.op_type for n in onnx.load(str(path)).graph.node}
    mods = {fused: _optimized(str(path), sm90_info, tmp_path / str(fused), fused, inputs=SDPA_INPUTS)
            for fused in (False, True)}
    kernel = next(f for f in _kernels(mods[True]).values() if attention.is_attention(f))
    assert not [f for f in _kernels(mods[False]).values() if attention.is_attention(f)]
    assert "T.isnan" in kernel.script() and "mma.sync" in _cuda_source(kernel, sm90_info)  # (TVM prints it x != x)
    x, mask = _sdpa_inputs()
    outs = {}
    for fused, mod in mods.items():
        vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
        outs[fused] = vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(mask)).numpy()
    assert np.isfinite(outs[True]).all()
    np.testing.assert_array_equal(outs[True], outs[False])


def test_fp16_accumulation_rounds_the_scores_as_the_graph_does(tmp_path, sm90_info):
    """With `accumulate = "fp16"` the model's QK^T gives fp16 scores: the
    kernel rounds its (fp32-summed) scores to fp16 before the softmax too,
    so the two differ by the sums' order and precision alone."""
    plain = _run_on_cpu(_optimized("vit", sm90_info, tmp_path / "plain", fused=False, accumulate="fp16"))
    fused_mod = _optimized("vit", sm90_info, tmp_path / "fused", fused=True, accumulate="fp16")
    kernel = next(f for f in _kernels(fused_mod).values() if attention.is_attention(f))
    assert "float16(attn_s" in kernel.script().replace('T.Cast("float16", attn_s', "float16(attn_s")
    for a, b in zip(plain, _run_on_cpu(fused_mod), strict=True):
        assert np.linalg.norm(a - b) <= 1e-2 * np.linalg.norm(a)


def test_the_fused_kernel_reads_qkv_where_the_projection_wrote_it(tmp_path, sm90_info):
    """ViT: no kernel is left that only moves Q, K or V into heads or the
    heads back; the attention kernel's one input is the QKV projection's
    [tokens, 3 x dim] output."""
    mod = _optimized("vit", sm90_info, tmp_path, fused=True)
    kernels = _kernels(mod)
    assert not [n for n in kernels if "transpose" in n and "reshape" in n and n != "fused_transpose_cast"
                and "pad" not in n], sorted(kernels)
    text = mod["main"].script()
    calls = re.findall(r"R\.call_tir\((?:cls\.)?fused_attention\w*, \((\w+),\)", text)
    assert calls, "the attention kernel takes more than one input"
    qkv = re.search(rf"{calls[0]} = R\.call_tir\((?:cls\.)?(\w+),", text).group(1)
    assert "matmul" in qkv  # the projection's own kernel


def test_attention_left_alone_where_its_kernel_would_not_fit(tmp_path, sm90_info, monkeypatch):
    def fused(mod):
        return [f for f in _kernels(mod).values() if attention.is_attention(f)]

    # no sm_80 mma.sync: nothing fused
    assert not fused(_optimized("vit", targets.resolve("cuda:sm_75"), tmp_path / "sm75", fused=True))
    # shared memory the architecture does not have: nothing fused (one bucket: optimized in this process)
    monkeypatch.setattr(attention_schedule, "shared_bytes", lambda keys, head_dim, warps=None: 1 << 30)
    assert not fused(_optimized("vit", sm90_info, tmp_path / "big", fused=True))


def test_fused_attention_is_a_cuda_option(tmp_path):
    with pytest.raises(config.ConfigError, match="fused_attention"):
        config.from_dict({"model": {"source": "vit"}, "llvm": {"fused_attention": True}})
    for precision in ("fp32", "tf32"):  # (an fp16 kernel: refused rather than silently left out)
        with pytest.raises(config.ConfigError, match=f"fused_attention .* precision {precision}"):
            config.from_dict({"model": {"source": "vit"}, "cuda": {"fused_attention": True, "precision": precision}})
    cfg = config.from_dict({"model": {"source": "vit"}, "cuda": {"fused_attention": False}})
    assert "attention" not in [n for n, _ in optimize.phases(cfg.profile("cuda"))]


def test_fused_attention_is_on_by_default_where_it_applies():
    """On for CUDA fp16 (results/h100/2026-12-05/attention-8-16-warps/):
    another precision, in a config or on the command line, leaves the
    default off rather than failing, and fp16 again brings it back; an
    explicit true with another precision is refused wherever it was set."""
    cfg = config.from_dict({"model": {"source": "vit"}})
    assert cfg.cuda.fuses_attention and not cfg.llvm.fuses_attention
    assert "attention" in [n for n, _ in optimize.phases(cfg.cuda)]
    for precision in ("fp32", "tf32"):
        toml = config.from_dict({"model": {"source": "vit"}, "cuda": {"precision": precision}})
        assert not toml.cuda.fuses_attention
        assert "attention" not in [n for n, _ in optimize.phases(toml.cuda)]
        assert config.apply_overrides(toml, "cuda", precision="fp16").cuda.fuses_attention
        assert not config.apply_overrides(cfg, "cuda", precision=precision).cuda.fuses_attention
    explicit = config.from_dict({"model": {"source": "vit"}, "cuda": {"fused_attention": True}})
    with pytest.raises(config.ConfigError, match="fused_attention"):
        config.apply_overrides(explicit, "cuda", precision="fp32")
    with pytest.raises(config.ConfigError, match="fused_attention"):
        config.apply_overrides(cfg, "cuda", precision="fp32", fused_attention=True)
    with pytest.raises(config.ConfigError, match="wrong type"):
        config.from_dict({"model": {"source": "vit"}, "cuda": {"fused_attention": "yes"}})


def _attention_kernel(tmp_path, sm90_info, name="vit"):
    mod = _optimized(name, sm90_info, tmp_path, fused=True)
    return next(f for f in _kernels(mod).values() if attention.is_attention(f))


def _cuda_source(func, sm90_info):
    """The CUDA of the fused kernel `func`, scheduled and built as the package builds it."""
    return _built_source(attention_schedule.schedule(func).mod["main"], sm90_info)


@pytest.mark.parametrize("name", ["vit", "bert"])
def test_the_kernel_builds_on_tensor_cores_without_local_memory(name, tmp_path, sm90_info):
    src = _cuda_source(_attention_kernel(tmp_path, sm90_info, name), sm90_info)
    assert src.count("mma.sync.aligned.m16n8k16") >= 2 and "ldmatrix" in src
    assert "__shfl" in src  # the rows' maximum and sum across a warp
    # every warp buffer lowered to a thread's registers (passes/tensor_core_smem.py: EVERY_WARP_BUFFER)
    sizes = [int(n) for n in re.findall(r"_warp_ptr\[(\d+)\];", src)]
    assert sizes and max(sizes) <= 128, sizes
    if shutil.which("nvcc"):
        usage = _nvcc_usage(src, tmp_path)
        assert "0 bytes stack frame" in usage, usage


def _nvcc_usage(src: str, tmp_path) -> str:
    path = tmp_path / "kernel.cu"
    path.write_text(src)
    r = subprocess.run(["nvcc", "-arch=sm_90", "-cubin", "-o", str(tmp_path / "k.cubin"), "--resource-usage",
                        str(path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stderr


def test_the_build_schedules_it_first(tmp_path, sm90_info):
    cfg = config.from_dict({"model": {"source": "vit", "size": "small"},
                            "cuda": {"buckets": [1], "trials": 0, "fused_attention": True}})
    pipeline.run(cfg, sm90_info, tmp_path / "ws", db_root=tmp_path / "db")
    import json

    m = json.loads((tmp_path / "ws" / "package" / "manifest.json").read_text())
    schedules = m["buckets"]["1"]["schedules"]
    assert schedules.get("fused-attention", 0) >= 1, schedules
    assert not [f for f in m["buckets"]["1"].get("fallbacks", []) if "attention" in f["kernel"]]


def test_the_tuner_leaves_it_out(tmp_path, sm90_info):
    from deploy.tuning import tasks

    mod = _optimized("vit", sm90_info, tmp_path, fused=True)
    names = [t.task_name for t in tasks.extract_tasks(mod, sm90_info.tvm_target())]
    assert names and not [n for n in names if "attention" in n]


def _te_kernel(q_rows: int, keys: int, head_dim: int = 64):
    """A fused attention kernel of separate Q [1, 2, q_rows, d], K^T [1, 2,
    d, keys] (head dimension outermost: read 1 wide) and V tensors."""
    from tvm import te

    q = te.placeholder((1, 2, q_rows, head_dim), "float16", name="q")
    kt = te.placeholder((1, 2, head_dim, keys), "float16", name="kt")
    v = te.placeholder((1, 2, keys, head_dim), "float16", name="v")
    out = attention.attention_te(q, kt, v, out_bshd=True)
    return te.create_prim_func([q, kt, v, out]).with_attr(
        attention.ATTR, {"q_rows": q_rows, "keys": keys, "head_dim": head_dim, "tokens_first": True})


def test_a_k_transposed_in_memory_is_copied_one_element_at_a_time(tmp_path, sm90_info):
    """16-byte copies need 8 consecutive, aligned halves: a K^T tensor of
    the model's own (head dimension outermost) is copied one at a time, and
    the kernel compiles (8 at a time, nvcc rejected it)."""
    func = _te_kernel(197, 197)
    sch = tvm.s_tir.Schedule(tvm.IRModule({"main": func}))
    widths = {name: attention_schedule._copy_vector(sch, sch.get_sblock(name)) for name in ("attn_k", "attn_v")}
    assert widths == {"attn_k": 1, "attn_v": 8}
    src = _cuda_source(func, sm90_info)
    if shutil.which("nvcc"):
        assert "0 bytes stack frame" in _nvcc_usage(src, tmp_path)


def test_the_wider_variants_build_with_fewer_registers(tmp_path):
    """scripts/attention_probe.py's variants (attention_schedule.schedule's
    col_warps): both build for sm_90 without local memory, the 8-warp one's
    accumulators split between two warps."""
    probe = load_script("attention_probe")
    assert probe.main(["--out", str(tmp_path), "--build-only", "--cases", "BERT b32 seq64"]) == 0
    rows = json.loads((tmp_path / "probe.json").read_text())["rows"]
    assert [r["config"] for r in rows] == ["4 warps", "8 warps", "16 warps"] and not any("error" in r for r in rows)
    if shutil.which("nvcc"):
        regs = [int(re.search(r"Used (\d+) registers", r["ptxas"]).group(1)) for r in rows]
        assert regs[2] < regs[1] < regs[0], rows
    with pytest.raises(ValueError, match="column tiles"):
        probe.kernel((1, 2, 64, 48, 64), 2, 16)  # (3 key tiles: no even split)
    assert probe.main(["--out", str(tmp_path), "--build-only", "--cases", "GPT"]) == 2


# the probe kernel's pointer parameters: the emulated global buffers they name, their element type
_EMU_PARAMS = {"attn_out_ptr": ("out", "half"), "k_ptr": ("k", "half"), "q_ptr": ("q", "half"), "v_ptr": ("v", "half")}


@pytest.mark.parametrize("shape", [(1, 2, 64, 64, 64), (1, 1, 197, 197, 64)])
@pytest.mark.parametrize("variant", ["4 warps", "8 warps", "16 warps"])
def test_the_generated_cuda_computes_attention_in_emulation(shape, variant, sm90_info):
    """The kernel's CUDA, as built for sm_90, run by tests/cuda_emu.py (a
    CPU interpreter of it: every thread, shared memory by the byte,
    ldmatrix, mma.sync and the shuffles per the PTX ISA): softmax(Q K^T) V
    to an fp16 rounding, every output written once, no shared-memory race
    between barriers, no read of memory never written."""
    from .. import cuda_emu

    probe = load_script("attention_probe")
    func = probe.kernel(shape, *probe.VARIANTS[variant])
    src = _built_source(func, sm90_info)
    grid, block, dyn = emulation.launch(func, sm90_info.tvm_target())
    b, h, s, k, d = shape
    rng = np.random.default_rng(0)
    q, kk, v = (rng.standard_normal(sh).astype("float16") for sh in ((b, h, s, d), (b, h, k, d), (b, h, k, d)))
    tensors = {"q": q.view(np.uint8).ravel().copy(), "k": kk.view(np.uint8).ravel().copy(),
               "v": v.view(np.uint8).ravel().copy(), "out": np.full(b * s * h * d * 2, 0xFF, np.uint8)}
    problems, written = cuda_emu.run(src, "k_kernel", grid, block, dyn, tensors, _EMU_PARAMS)
    assert not problems, sorted(problems)
    assert (written["out"] == 1).all()
    scores = np.einsum("bhsd,bhkd->bhsk", q.astype("float32"), kk.astype("float32"))
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p = (p / p.sum(-1, keepdims=True)).astype("float16").astype("float32")
    want = np.einsum("bhsk,bhkd->bshd", p, v.astype("float32"))
    got = tensors["out"].view(np.float16).reshape(b, s, h, d).astype("float32")
    np.testing.assert_allclose(got, want, atol=2e-3, rtol=2e-3)


def test_the_emulation_sees_a_missing_barrier(sm90_info):
    """tests/cuda_emu.py fails a kernel whose warps read what others write
    without a barrier between: the 8-warp kernel with its scores' barrier
    (the third) taken out."""
    from .. import cuda_emu

    probe = load_script("attention_probe")
    shape = (1, 1, 64, 64, 64)
    func = probe.kernel(shape, *probe.VARIANTS["8 warps"])
    src = _built_source(func, sm90_info)
    grid, block, dyn = emulation.launch(func, sm90_info.tvm_target())
    parts = src.split("__syncthreads();")
    assert len(parts) > 4
    broken = "__syncthreads();".join(parts[:3]) + ";" + "__syncthreads();".join(parts[3:])
    rng = np.random.default_rng(0)
    tensors = {n: rng.standard_normal(64 * 64).astype("float16").view(np.uint8) for n in ("q", "k", "v")}
    tensors["out"] = np.zeros(64 * 64 * 2, np.uint8)
    problems, _ = cuda_emu.run(broken, "k_kernel", grid, block, dyn, tensors, _EMU_PARAMS)
    assert any("RACE" in p for p in problems), problems


def _built_source(func, sm90_info) -> str:
    from deploy.build import build_kernel

    return build_kernel("k", func, sm90_info).imports[0].inspect_source()


@pytest.mark.parametrize("keys, head_dim, warps", [
    (197, 64, 2),  # ViT-S/16: 224 keys in 8 warps, where 16 would pad to 256
    (128, 64, 4), (64, 64, 4), (100, 64, 4),  # BERT's, and keys that 64 pads no more than 32
    (16, 64, 2),  # 32 keys in 8 warps, not 64 in 16
    (128, 32, 2), (128, 16, 1), (128, 48, 1),  # head dimensions of 2, 1 and 3 column tiles
])
def test_the_block_takes_as_many_warps_as_its_keys_allow(keys, head_dim, warps):
    assert attention.col_warps(keys, head_dim) == warps


def test_fewer_warps_where_more_would_not_fit():
    """An A100's opt-in shared memory holds ViT-S/16's kernel with its 197
    keys padded to 208 (4 warps), not to 224 (8): it stays fused in 4."""
    from deploy.passes.mma_gemm import OPT_IN_SHARED_MEMORY

    a100, h100 = OPT_IN_SHARED_MEMORY["sm_80"], OPT_IN_SHARED_MEMORY["sm_90"]
    assert attention_schedule.shared_bytes(197, 64, 1) <= a100 < attention_schedule.shared_bytes(197, 64, 2)
    assert attention.col_warps(197, 64, a100) == 1 and attention.col_warps(197, 64, h100) == 2


def test_the_package_kernel_is_scheduled_with_its_warps(tmp_path, sm90_info):
    """The rewrite pads the keys for the warps it chooses, and the build's
    schedule launches that many: 32 x 4 x col_warps threads a block."""
    func = _attention_kernel(tmp_path, sm90_info)
    info = func.attrs[attention.ATTR]
    warps = attention.col_warps(int(info["keys"]), int(info["head_dim"]))
    assert int(info["col_warps"]) == warps > 1
    padded = attention.padded_keys(int(info["keys"]), attention.KEY_ALIGN * warps)
    k_shape = re.search(r"attn_k = T\.\w*alloc_buffer\(\(([^)]*)\)", func.script()).group(1)
    assert [int(d) for d in k_shape.split(",")][2] == padded, k_shape
    _, block, _ = emulation.launch(attention_schedule.schedule(func).mod["main"], sm90_info.tvm_target())
    assert block == (32, attention_schedule.WARPS * warps)


@pytest.mark.parametrize("rows", [1, 63, 64, 65, 128, 197, 255, 256])
def test_rows_the_schedule_takes(rows, sm90_info):
    assert attention.schedulable_rows(rows)
    attention_schedule.schedule(_te_kernel(rows, 64))


# ---- the TVM defects the schedule works around (each test fails once TVM no longer has it)


@pytest.mark.parametrize("rows", [66, 196, 198])
def test_tvm_cannot_schedule_even_row_counts(rows):
    """attention.schedulable_rows: even row counts above 64 that 64 does
    not divide."""
    assert not attention.schedulable_rows(rows)
    with pytest.raises(Exception, match="stage pipeline"):
        attention_schedule.schedule(_te_kernel(rows, 64))



def test_tvm_lowers_only_the_first_warp_buffer(tmp_path, sm90_info):
    """TVM 0.27's LowerWarpMemory rewrites the first `warp` buffer of a
    kernel's body and leaves the others (tensor_core_smem.EVERY_WARP_BUFFER)."""
    from deploy.tvm_compat import default_tir_pipeline

    sch = attention_schedule.schedule(_attention_kernel(tmp_path, sm90_info))
    mod = tvm.IRModule({"main": sch.mod["main"].with_attr("global_symbol", "main")
                       .with_attr("target", sm90_info.tvm_target())})
    stock, _, _ = default_tir_pipeline()
    with tensor_core_smem.tensor_core_context(no_cse=True):
        lowered = stock(mod)
    device = tvm.IRModule({gv: f for gv, f in lowered.functions.items()
                           if isinstance(f, tvm.tirx.PrimFunc) and f.attrs and "calling_conv" in f.attrs})
    before = sum(f.script().count('scope="warp"') for f in device.functions.values())
    once = tvm.tirx.transform.LowerWarpMemory()(device)
    after = sum(f.script().count('scope="warp"') for f in once.functions.values())
    assert before >= 6 and after == before - 1, (before, after)


def test_tvm_prints_8_lane_fp32_broadcasts_nvcc_rejects(sm90_info):
    """An fp32 multiply by a constant vectorized 8 wide: TVM 0.27 prints the
    constant as `make_ulonglong4` of 8 floats (attention_schedule._copy_vector)."""
    from tvm import te

    x = te.placeholder((1024,), "float16", name="x")
    y = te.compute(x.shape, lambda i: (x[i].astype("float32") * tvm.tirx.const(0.125, "float32")).astype("float16"),
                   name="y")
    sch = tvm.s_tir.Schedule(te.create_prim_func([x, y]))
    b = sch.get_sblock("y")
    (i,) = sch.get_loops(b)
    bx, tx, v = sch.split(i, [None, 32, 8])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    sch.vectorize(v)
    lib = tvm.compile(sch.mod, target=sm90_info.tvm_target())
    src = lib.mod.imports[0].inspect_source()
    assert re.search(r"make_ulonglong4\((0x[^,]+, ){7}0x", src), src[-1500:]


@pytest.mark.gpu
@pytest.mark.parametrize("name", TRANSFORMERS)
def test_gpu_fused_attention_validated(name, tmp_path):
    target = targets.resolve("cuda")
    cfg = config.from_dict({"model": {"source": name, "size": "small"},
                            "cuda": {"buckets": [1, 4], "trials": 0, "fused_attention": True}})
    summary = pipeline.run(cfg, target, tmp_path / "ws", db_root=tmp_path / "db", compare_untuned=False)
    assert summary["validation"]["passed"], summary["validation"]


class _Eager(torch.nn.Module):
    """Attention written out, its scores divided by a constant after the
    product (Hugging Face's MobileViT): mixed precision leaves the divisor
    as astype(6.0, float16) bound to a var."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.qkv, self.out = torch.nn.Linear(64, 192), torch.nn.Linear(64, 64)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, 4, 16).permute(2, 0, 3, 1, 4)
        p = torch.softmax(q @ k.transpose(-1, -2) / 6.0, dim=-1)
        return self.out((p @ v).transpose(1, 2).reshape(b, n, 64))


def test_a_scale_cast_by_mixed_precision_is_still_a_scale(tmp_path, sm90_info):
    path = tmp_path / "eager.onnx"
    torch.onnx.export(_Eager(), (torch.randn(2, 16, 64),), str(path), opset_version=17, dynamo=False,
                      input_names=["x"], output_names=["y"])
    outs = {}
    for fused in (False, True):
        mod = _optimized(str(path), sm90_info, tmp_path / str(fused), fused, inputs=[{"name": "x", "shape": [16, 64]}])
        assert bool([f for f in _kernels(mod).values() if attention.is_attention(f)]) == fused
        outs[fused] = _run_on_cpu(mod)
    np.testing.assert_array_equal(outs[True][0], outs[False][0])


@pytest.mark.gpu
def test_gpu_nan_fill_kernel_matches_onnx_runtime(tmp_path):
    """torch's exported SDPA fused (its where(isnan(P), 0, P) in the
    kernel), on the GPU: validated, and a sample whose every key is masked
    gives ONNX Runtime's output."""
    import onnxruntime as ort

    import deploy

    path = _sdpa_onnx(tmp_path)
    cfg = config.from_dict({"model": {"source": str(path), "inputs": SDPA_INPUTS},
                            "cuda": {"buckets": [2], "tune_buckets": [2], "trials": 0}})
    summary = pipeline.run(cfg, targets.resolve("cuda"), tmp_path / "ws", db_root=tmp_path / "db", compare_untuned=False)
    assert summary["validation"]["passed"], summary["validation"]
    m = json.loads((tmp_path / "ws" / "package" / "manifest.json").read_text())
    assert m["buckets"]["2"]["schedules"].get("fused-attention", 0) >= 1
    x, mask = _sdpa_inputs()
    ref = ort.InferenceSession(str(path)).run(None, {"x": x, "mask": mask})[0]
    out = deploy.load(tmp_path / "ws" / "package")({"x": x, "mask": mask})["y"]
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, rtol=2e-2, atol=2e-2)
