"""deploy/passes/mma_gemm.py: our mma.sync GEMM as design spaces. On the CPU
machine every configuration is scheduled and built for sm_90 (no GPU
needed: every TIR pass runs); on the GPU (`-m gpu`) each computes what
TVM's plain CPU lowering computes."""

import numpy as np
import pytest
import tvm_ffi

from deploy import targets
from deploy.passes import mma_gemm, schedule
from deploy.tuning import builder as tune_builder
from deploy.tuning import search as tune_search
from deploy.tvm_compat import ms, s_tir, tvm

from ..conftest import load_script


def _i64(x):
    return tvm.tirx.IntImm("int64", x)


def _gemm(m=200, n=256, k=128, padded=256, b_transposed=False, epilogue=True, batch=None):
    """pad_gemm's shape of a GEMM: A's `m` rows padded with zeros to
    `padded`, an fp32 GEMM of fp16 operands, then (`epilogue`) the cast to
    fp16, a bias, and the square of that, written for the `m` rows only
    (the CPU reference lowers no fp16 erf)."""
    from tvm import te

    lead = [] if batch is None else [_i64(batch)]
    a = te.placeholder((*lead, _i64(m), _i64(k)), "float16", name="A")
    b = te.placeholder((_i64(n), _i64(k)) if b_transposed else (_i64(k), _i64(n)), "float16", name="B")
    bias = te.placeholder((_i64(n),), "float16", name="bias")
    src = a
    if padded != m:
        src = te.compute((*lead, _i64(padded), _i64(k)), lambda *ix: tvm.tirx.if_then_else(
            ix[-2] < _i64(m), a[ix], tvm.tirx.const(0, "float16")), name="A_pad")
    r = te.reduce_axis((_i64(0), _i64(k)), name="k")

    def load_b(j):
        return b[j, r] if b_transposed else b[r, j]

    c = te.compute((*lead, src.shape[-2], _i64(n)), lambda *ix: te.sum(
        src[(*ix[:-1], r)].astype("float32") * load_b(ix[-1]).astype("float32"), axis=r), name="C")
    if not epilogue:
        return te.create_prim_func([a, b, c])
    h = te.compute((*lead, _i64(m), _i64(n)), lambda *ix: c[ix].astype("float16") + bias[ix[-1]], name="H")
    g = te.compute(h.shape, lambda *ix: h[ix] * h[ix], name="G")
    return te.create_prim_func([a, b, bias, g])


def test_it_matches_a_padded_gemm_with_its_epilogue_and_a_transposed_weight():
    got = mma_gemm.match(_gemm())
    assert (got.m, got.n, got.k, got.b_transposed) == (256, 256, 128, False)
    assert got.producers == ["A_pad"] and got.epilogue == ["H", "G"]
    assert mma_gemm.match(_gemm(b_transposed=True)).b_transposed
    assert mma_gemm.configs_for(got) == ["128x128x32-w2x2-s3", "128x128x32-w2x2-s4", "128x128x64-w2x2-s3",
                                         "64x128x32-w2x2-s4", "128x64x32-w2x2-s4", "128x256x32-w2x4-s3",
                                         "256x128x32-w4x2-s3", "64x64x32-w2x2-s4"]


def test_it_declines_batched_matmuls_and_shapes_16_does_not_divide():
    assert mma_gemm.match(_gemm(batch=4)) is None  # attention's batched matmuls
    assert mma_gemm.match(_gemm(k=200)) is None
    assert mma_gemm.match(_gemm(m=100, padded=100)) is None
    assert mma_gemm.match(_gemm(n=1000)) is None


def _gemm_then(epilogue):
    """A 256^3 GEMM whose epilogue computes `epilogue(c, i, j)` from its result c."""
    from tvm import te

    a = te.placeholder((_i64(256), _i64(256)), "float16", name="A")
    b = te.placeholder((_i64(256), _i64(256)), "float16", name="B")
    r = te.reduce_axis((_i64(0), _i64(256)), name="k")
    c = te.compute((_i64(256), _i64(256)), lambda i, j: te.sum(a[i, r].astype("float32") * b[r, j].astype("float32"),
                                                              axis=r), name="C")
    e = te.compute((_i64(256), _i64(256)), lambda i, j: epilogue(c, i, j).astype("float16"), name="E")
    return te.create_prim_func([a, b, e])


def test_it_declines_an_epilogue_that_reads_the_result_outside_its_own_element():
    """A thread block's epilogue reads its own tile of the accumulators only:
    a shifted or transposed read of the result is not this schedule's."""
    assert mma_gemm.match(_gemm_then(lambda c, i, j: c[i, j] * 2)) is not None
    assert mma_gemm.match(_gemm_then(lambda c, i, j: c[i, (j + 1) % 256])) is None
    assert mma_gemm.match(_gemm_then(lambda c, i, j: c[j, i])) is None
    assert mma_gemm.match(_gemm_then(lambda c, i, j: c[i, j] + c[i, 0])) is None


def test_a_pipeline_gets_at_least_stages_minus_one_k_tiles():
    k64 = mma_gemm.configs_for(mma_gemm.match(_gemm(k=64)))
    assert k64 and all(mma_gemm.CONFIGS[c][4] == 32 and mma_gemm.CONFIGS[c][5] <= 3 for c in k64)
    assert mma_gemm.configs_for(mma_gemm.match(_gemm(k=32))) == []


@pytest.mark.parametrize("b_transposed,epilogue,n", [(False, True, 256), (True, True, 256), (False, False, 256),
                                                     (True, True, 384)],
                         ids=["epilogue", "weight-NK", "no-epilogue", "N384-weight-NK"])
def test_every_configuration_builds_for_sm90_with_cp_async_ldmatrix_and_mma(sm90, b_transposed, epilogue, n):
    """Built as the tuner builds a candidate (`lean_build`, our TIR
    pipeline, which turns on TVM's cp.async for these kernels); N = 384
    also takes the 128x96 tile."""
    func = _gemm(b_transposed=b_transposed, epilogue=epilogue, n=n)
    if n % 96 == 0:
        assert "128x96x32-w4x1-s4" in mma_gemm.configs_for(mma_gemm.match(func))
    spaces = mma_gemm.spaces(func, sm90)
    assert len(spaces) == len(mma_gemm.configs_for(mma_gemm.match(func)))
    for sch in spaces:
        src = tune_builder.lean_build(sch.mod, sm90, None).imports[0].inspect_source()
        assert "cp.async.cg" in src and "ldmatrix" in src and "mma.sync" in src, mma_gemm.config_of(sch.mod)
        assert "extern __shared__" in src  # (dynamic shared memory only)
        if epilogue:  # the fp16 output written four elements at a time
            assert "*(uint2*)(G_ptr + " in src or "*(half4*)(G_ptr + " in src


def test_a_configuration_name_carries_its_launch_bounds_and_fragment_buffering(sm90):
    """The probe's knobs (scripts/mma_gemm_probe.py): `-b3` compiles the
    kernel for 3 blocks per SM (`__launch_bounds__(128, 3)`, set by our TIR
    pipeline on the lowered kernel), `-f0` leaves the ldmatrix fragments
    single-buffered; the tuner's configurations set neither."""
    import re

    assert mma_gemm.config_from_name("128x128x32-w2x2-s3-b3-f0") == (128, 128, 2, 2, 32, 3, 3, 0)
    for name in [*mma_gemm.CONFIGS, "64x128x32-w2x2-s4-b4", "128x128x32-w2x2-s4-f0"]:
        assert mma_gemm.name_of(mma_gemm.config_from_name(name)) == name
    for bad in ["128x128x32", "128x128x32-w2x2-s3-z1", "axbxc-w2x2-s3", "128x128x32-w2x2-s4-", "128x128x32-w2x2-s4--b3",
                "128x128x32-w2x2-s4-f2", "128x128x32-w2x2-s4-b0", "128x128x32-w2x2-s4-f1", "128x128x32-w2x2-s4-b3-b4",
                "128x128x32-w2x2-s1", "100x128x32-w2x2-s4", "128x128x24-w2x2-s4"]:
        with pytest.raises(ValueError, match="not a configuration name"):
            mma_gemm.config_from_name(bad)
    func = _gemm()
    gemm = mma_gemm.match(func)

    def source(config):
        sch = mma_gemm.schedule(func, gemm, config)
        return tune_builder.lean_build(sch.mod, sm90, None).imports[0].inspect_source()

    stock, knobs = source("128x128x32-w2x2-s3"), source(mma_gemm.config_from_name("128x128x32-w2x2-s3-b3-f0"))
    assert re.findall(r"__launch_bounds__\([^)]*\)", stock) == ["__launch_bounds__(128)"] * 2
    assert "__launch_bounds__(128, 3)" in knobs and "mma.sync" in knobs
    # double-buffered fragments: one warp buffer of both K steps' fragments
    assert "B_shared_dyn_warp_ptr[2048]" in stock and "B_shared_dyn_warp_ptr[2048]" not in knobs


_FRESH_BUILD = """
import sys, tvm
from deploy import targets
from deploy.tuning import builder
mod = tvm.ir.load_json(open(sys.argv[1]).read())
if sys.argv[2] == "stock":
    builder.MMA_FRAGMENT_MARKERS = ()
builder.lean_build(mod, targets.resolve("cuda:sm_90").tvm_target(), None)
"""


def test_a_fresh_build_worker_registers_the_fragment_layout(sm90, tmp_path):
    """A build worker does not import TVM's tensor intrinsics (slow), but
    CUDA codegen of an mma.sync kernel needs the fragment layout their module
    registers: lean_build registers them for such kernels. The second half
    fails once TVM's codegen no longer needs the registration."""
    import subprocess
    import sys

    (sch, *_) = mma_gemm.spaces(_gemm(), sm90)
    path = tmp_path / "mod.json"
    path.write_text(tvm.ir.save_json(tvm.IRModule({"main": sch.mod["main"].with_attr("global_symbol", "main")})))
    ours = subprocess.run([sys.executable, "-c", _FRESH_BUILD, str(path), "ours"], capture_output=True, text=True)
    assert ours.returncode == 0, ours.stderr[-2000:]
    stock = subprocess.run([sys.executable, "-c", _FRESH_BUILD, str(path), "stock"], capture_output=True, text=True)
    assert stock.returncode != 0 and "index_map_func" in stock.stderr


def test_cp_async_needs_our_pipeline(sm90):
    """TVM leaves `tirx.use_async_copy` off: built without our pipeline the
    copies are synchronous. Fails once TVM turns it on by default; then
    passes/tensor_core_smem.py need not set it."""
    (sch, *_) = mma_gemm.spaces(_gemm(), sm90)
    with tvm.transform.PassContext(opt_level=3):
        lib = tvm.compile(tvm.IRModule({"main": sch.mod["main"].with_attr("global_symbol", "main")}), target=sm90)
    assert "cp.async.cg" not in lib.mod.imports[0].inspect_source()


def _replayed(sch):
    """A fresh schedule with `sch`'s trace (Schedule.copy raises on these)."""
    out = s_tir.Schedule(tvm.IRModule({"main": _gemm()}))
    sch.trace.apply_to_schedule(out, remove_postproc=True)
    return out


def test_the_traces_replay_from_json_onto_the_workload(sm90):
    """As a database record is applied by a build. (The search replays a
    space's trace rather than copying it: `Schedule.copy` raises on these;
    once it does not, tuning/search.py's `_seeds` may copy.)"""
    func = _gemm()
    with pytest.raises(Exception, match="unordered_map"):
        mma_gemm.spaces(func, sm90)[0].copy()
    for sch in mma_gemm.spaces(func, sm90)[:3]:
        replayed = s_tir.Schedule(tvm.IRModule({"main": func}))
        s_tir.Trace.apply_json_to_schedule(sch.trace.as_json(), replayed)
        assert tvm_ffi.structural_equal(replayed.mod, sch.mod)


@pytest.mark.parametrize("m, padded_to, config", [(197, 256, "64x64x32-w2x2-s4"), (49, 64, "64x64x32-w2x2-s4")],
                         ids=["ViT-b1-tokens", "ConvNeXt-b1-stage-4"])
def test_rows_no_tile_divides_are_padded_inside_the_schedule(sm90, m, padded_to, config):
    """A GEMM of 197 (or 49) rows, which no configuration tiles: its rows
    padded to a multiple of 64 as the schedule's first step (pad_einsum, in
    its trace), the padded GEMM scheduled as any other, the padded rows
    never written out; the build's default and the tuner's spaces alike,
    and each trace replays onto the unpadded kernel."""
    func = _gemm(m=m, padded=m, n=384, k=384)
    assert mma_gemm.match(func) is None
    gemm, padding = mma_gemm.plan(func)
    assert (gemm.m, padding, gemm.producers) == (padded_to, [64, 1, 1], ["A_pad"])
    sch = mma_gemm.Default().apply(func, sm90)
    assert mma_gemm.config_of(sch.mod) == config and "pad_einsum" in str(sch.trace)
    src = tune_builder.lean_build(sch.mod, sm90, None).imports[0].inspect_source()
    assert "cp.async.cg" in src and "mma.sync" in src
    spaces = mma_gemm.spaces(func, sm90)
    assert [mma_gemm.config_of(s.mod) for s in spaces] == mma_gemm.configs_for(gemm) and spaces
    for s in spaces[:2]:
        replayed = s_tir.Schedule(tvm.IRModule({"main": func}))
        s_tir.Trace.apply_json_to_schedule(s.trace.as_json(), replayed)
        assert tvm_ffi.structural_equal(replayed.mod, s.mod)
    assert mma_gemm.plan(_gemm(m=20, padded=20)) is None  # (fewer than SMALL_ROWS: a GEMV's, left to DLight)


def test_it_is_cuda_sm80_and_later_only(sm90):
    assert mma_gemm.spaces(_gemm(), targets.resolve("llvm").tvm_target()) == []
    sm75 = tvm.target.Target({"kind": "cuda", "arch": "sm_75"})
    assert mma_gemm.spaces(_gemm(), sm75) == []


@pytest.mark.parametrize("m, n, k, want", [
    (256, 384, 1536, "64x64x32-w2x2-s4"),  # ConvNeXt-T b1's fc2, 196 rows padded: 24 blocks, the most
    (256, 1536, 384, "64x64x32-w2x2-s4"),  # its fc1: 96 blocks
    (6400, 1536, 384, "128x128x32-w2x2-s4"),  # ViT-S/16 b32's fc1: 600 blocks
    (200704, 64, 576, "128x64x32-w2x2-s4"),  # ResNet-50 b64's first implicit GEMM: 64 columns
    (3200, 512, 4608, "128x64x32-w2x2-s4"),  # its 7x7 stage's: 128x128 gives 100 blocks, 128x64 200
    (256, 48, 256, None),  # no default tile divides 48 columns: left to DLight
    (4096, 4096, 32, None),  # one K tile: no pipeline
    (200704, 256, 64, "128x128x32-w2x2-s3"),  # K = 64, two K tiles: a 3-stage pipeline (ResNet-50's 1x1 convs)
    (200704, 64, 64, "128x64x32-w2x2-s3"),  # (a tile not among CONFIGS: the default's alone)
    (100352, 96, 384, "128x96x32-w4x1-s4"),  # ConvNeXt-T b32's stage-1 fc2: N = 96, no other tile
    (100352, 384, 96, "128x128x32-w2x2-s4"),  # its fc1: 128x96 comes last
])
def test_the_default_configuration_is_the_largest_tile_that_fills_the_gpu(m, n, k, want):
    assert mma_gemm.default_config(mma_gemm.Gemm("C", m, n, k, False, [], [])) == want


def test_a_k_of_two_tiles_builds_in_a_three_stage_pipeline(sm90):
    """The default of a K = 64 GEMM, a configuration the tuner's spaces do
    not list (128x64 tiles in 3 stages), schedules and builds."""
    func = _gemm(m=16384, padded=16384, n=64, k=64, epilogue=False)  # (128 blocks of 128x64)
    gemm = mma_gemm.match(func)
    assert "128x64x32-w2x2-s3" not in mma_gemm.configs_for(gemm)
    sch = mma_gemm.Default().apply(func, sm90)
    assert mma_gemm.config_of(sch.mod) == "128x64x32-w2x2-s3"
    assert "cp.async.cg" in tune_builder.lean_build(sch.mod, sm90, None).imports[0].inspect_source()


def test_the_build_chain_gives_a_gemm_our_schedule_before_dlights_matmul(sm90):
    """passes/schedule.py: the CUDA chain's first source for a GEMM this
    schedule takes is ours, in its default configuration, built with
    cp.async, ldmatrix and mma.sync; before sm_80 it stays DLight's."""
    from deploy.build import build_kernel

    chain = schedule.CHAINS["cuda"]
    # (between them only thin-gemm, which declines GEMMs of mma_gemm.SMALL_COLS columns or more, and
    # simt-gemm, which declines fp16 ones)
    assert chain[chain.index(schedule.MMA_GEMM) + 1:chain.index("dlight.Matmul")] == [schedule.THIN_GEMM,
                                                                                     schedule.SIMT_GEMM]
    func = _gemm()  # 256 x 256: 64x64 tiles give the most blocks (16)
    gv = tvm.ir.GlobalVar("main")
    source, scheduled = next(s for s in schedule._sources(gv, func, None, sm90, "cuda") if not isinstance(s[1], Exception))
    assert source == schedule.MMA_GEMM
    assert mma_gemm.config_of(tvm.IRModule({"main": scheduled})) == "64x64x32-w2x2-s4"
    src = build_kernel("k", scheduled, targets.resolve("cuda:sm_90")).imports[0].inspect_source()
    assert "cp.async.cg" in src and "ldmatrix" in src and "mma.sync" in src
    sm75 = tvm.target.Target({"kind": "cuda", "arch": "sm_75"})
    assert mma_gemm.Default().apply(func, sm75) is None
    assert mma_gemm.Default().apply(_gemm(n=48), sm90) is not None  # (48 columns padded to 64: COL_TILE)
    assert mma_gemm.Default().apply(_gemm(m=20, padded=20), sm90) is None  # (fewer than SMALL_ROWS rows)


def test_the_kernel_check_compares_a_gemm_with_dlight_not_with_our_own_default(sm90):
    """tuning/check.py: where our mma.sync GEMM is a kernel's default, the
    outputs of its tuned records (often this schedule too) are compared with
    the next source of the chain, DLight's Matmul, built here for sm_90; the
    default is still what they are timed against."""
    import json

    from deploy.tuning import check as kernel_check
    from deploy.tuning import journal

    mod = tvm.IRModule({"main": _gemm()})
    (sch, *_) = mma_gemm.spaces(mod["main"], sm90)
    workload = ms.database.Workload(mod)
    args = ms.arg_info.ArgInfo.from_prim_func(mod["main"])  # (a record as the journal writes one)
    rec = [journal.canonical(journal.plain(sch.trace.as_json(remove_postproc=False))), [1e-5],
           journal.plain(sm90.export()), journal.plain([a.as_json() for a in args])]
    libs = kernel_check.build_libs(json.dumps(journal.plain(workload.as_json())), rec, targets.resolve("cuda:sm_90"))
    assert libs["default_rule"] == schedule.MMA_GEMM and libs["reference"] is not libs["default"]
    assert "mma.sync" in libs["default"].imports[0].inspect_source()
    assert "mma.sync" not in libs["reference"].imports[0].inspect_source()  # (DLight's: WMMA)


def test_verify_gpu_code_takes_the_opt_in_shared_memory_limit_for_these_kernels_only(sm90):
    """A 128x128 tile in a 3-stage pipeline uses more than 48 KB: the stock
    VerifyGPUCode rejects it, ours accepts it (sm_90 allows 227 KB)."""
    (sch,) = [s for s in mma_gemm.spaces(_gemm(), sm90) if mma_gemm.config_of(s.mod) == "128x128x64-w2x2-s3"]
    ctx = ms.TuneContext(mod=tvm.IRModule({"main": _gemm()}), target=sm90)
    stock = ms.postproc.VerifyGPUCode()
    stock._initialize_with_tune_context(ctx)
    ours = mma_gemm.verify_postproc(sm90)
    ours._initialize_with_tune_context(ctx)
    assert not stock.apply(_replayed(sch))
    assert ours.apply(_replayed(sch))
    # another kernel over the target's limit is still rejected: a 64 KB static shared buffer
    from tvm.script import tirx as T

    @T.prim_func(s_tir=True)
    def big(a: T.Buffer((16384,), "float32"), b: T.Buffer((16384,), "float32")):
        s = T.sblock_alloc_buffer((16384,), "float32", scope="shared")
        for _bx in T.thread_binding(1, thread="blockIdx.x"):
            for tx in T.thread_binding(128, thread="threadIdx.x"):
                for i in range(128):
                    with T.sblock("load"):
                        v = T.axis.spatial(16384, tx * 128 + i)
                        s[v] = a[v]
                for i in range(128):
                    with T.sblock("store"):
                        v = T.axis.spatial(16384, tx * 128 + i)
                        b[v] = s[v]

    other = s_tir.Schedule(tvm.IRModule({"main": big}))
    assert not ours.apply(other)


def _searching(mod, target, space, db, deadline=None, **search):
    """A tuning context over `space` with our DeadlineSearch, ready to hand out batches."""
    ctx = ms.TuneContext(mod=mod, target=target, space_generator=space,
                         search_strategy=tune_search._make_deadline_search(deadline, 64, 32, 2, **search),
                         task_name="gemm", rand_state=1)
    ctx.pre_tuning(max_trials=64, num_trials_per_iter=32, design_spaces=ctx.generate_design_space(), database=db,
                   cost_model=ms.cost_model.RandomModel())
    return ctx


def test_the_search_measures_our_spaces_first_unless_the_database_has_them(sm90, tmp_path):
    """tuning/search.py: the design spaces of a GEMM task include ours, and
    the first batch the search hands out holds each of them, postprocessed;
    a configuration the database has a valid record of is not measured
    again."""
    func = _gemm()
    mod = tvm.IRModule({"main": func})
    space, cache = tune_search._design_space(mod, sm90, seed=1)
    db = ms.database.MemoryDatabase()
    ctx = _searching(mod, sm90, space, db)
    tiling = mma_gemm.configs_for(mma_gemm.match(func))
    assert len(tiling) >= 8 and cache.get("own") == len(tiling) and cache["own_rule"] == schedule.MMA_GEMM
    first = ctx.generate_measure_candidates()
    assert sorted(mma_gemm.config_of(c.sch.mod) for c in first if mma_gemm.is_ours(c.sch.mod)) == sorted(tiling)
    # with the evolutionary search's first batch (32 here, fewer where its sampling draws fewer valid
    # candidates: 31 once under a loaded machine), not alone: a chunk may end in the first round
    assert len(tiling) + 16 <= len(first) <= len(tiling) + 32
    # one of them recorded: the next search leaves it out
    done = first[0]
    db.commit_tuning_record(ms.database.TuningRecord(done.sch.trace, db.commit_workload(mod), [1e-5], sm90,
                                                     done.args_info))
    ctx2 = _searching(mod, sm90, space, db)
    again = {mma_gemm.config_of(c.sch.mod) for c in ctx2.generate_measure_candidates()} - {None}
    assert mma_gemm.config_of(done.sch.mod) not in again and len(again) == len(tiling) - 1
    # after the seeds, the evolutionary search draws from MetaSchedule's spaces only (ours are fixed kernels)
    for _ in range(2):
        later = ctx2.generate_measure_candidates()
        assert later and not any(mma_gemm.is_ours(c.sch.mod) for c in later)
    # the plan's list, where given, is what is measured: none here
    ctx3 = _searching(mod, sm90, space, db, seed_configs=[])
    assert not any(mma_gemm.is_ours(c.sch.mod) for c in ctx3.generate_measure_candidates())


def test_the_search_holds_back_a_batch_while_measuring_would_outlast_the_deadline(sm90, monkeypatch):
    """tuning/search.py: before the deadline, a batch is handed out once the
    candidates built and not yet measured (the journal's backlog) would be
    measured before it; until then it waits (the task is not ended while
    time is left); past the deadline, or stopped, none. An unknown backlog
    (too few results yet) does not hold it back."""
    import threading
    import time
    from types import SimpleNamespace

    mod = tvm.IRModule({"main": _gemm()})
    space, _ = tune_search._design_space(mod, sm90, seed=1)
    monkeypatch.setattr(tune_search, "BACKLOG_POLL_S", 0.01)

    def first_batch(backlogs, deadline_in=100.0, stop=()):
        it = iter(backlogs)
        last = [None]

        def backlog():
            last[0] = next(it, last[0])
            return last[0]

        j = SimpleNamespace(task=lambda ctx: None, offer=lambda task, cands: None, backlog_seconds=backlog)
        return _searching(mod, sm90, space, ms.database.MemoryDatabase(), deadline=time.time() + deadline_in,
                          journal=j, stop=stop).generate_measure_candidates()

    assert first_batch([None]) and first_batch([0.0]) and first_batch([50.0])
    assert first_batch([150.0, 120.0, 30.0])  # waits while it drains, then hands the batch out
    assert not first_batch([150.0], deadline_in=0.05)  # it never drains before the deadline: none
    assert not first_batch([0.0], deadline_in=-1.0)  # the deadline passed
    stopped = threading.Event()
    stopped.set()
    assert not first_batch([150.0], stop=(stopped,))  # interrupted while waiting


def test_a_configuration_this_gpu_cannot_run_is_recorded_as_failed(tmp_path):
    """On sm_86 (99 KB of shared memory a block) the postprocessors reject the
    largest tiles: each is recorded as a failure, so the plan does not offer
    it again."""
    sm86 = tvm.target.Target({"kind": "cuda", "arch": "sm_86", "max_shared_memory_per_block": 49152,
                              "max_threads_per_block": 1024, "thread_warp_size": 32, "registers_per_block": 65536})
    mod = tvm.IRModule({"main": _gemm()})
    space, _ = tune_search._design_space(mod, sm86, seed=1)
    db = ms.database.MemoryDatabase()
    ctx = _searching(mod, sm86, space, db)
    measured = {mma_gemm.config_of(c.sch.mod) for c in ctx.generate_measure_candidates()} - {None}
    failed = set()
    for rec in db.get_all_tuning_records():
        failed |= {c for c in mma_gemm.CONFIGS if f'"{c}"' in str(rec.trace)}
        assert [float(x) for x in rec.run_secs] == [1e10]
    tiling = set(mma_gemm.configs_for(mma_gemm.match(_gemm())))
    assert failed and not failed & measured and failed | measured == tiling


@pytest.mark.gpu
@pytest.mark.parametrize("b_transposed,m,padded", [(False, 800, 896), (True, 800, 896), (False, 197, 197)],
                         ids=["KN", "NK", "KN-197-rows-padded-in-the-schedule"])
def test_every_configuration_computes_what_tvms_plain_lowering_does(sm90, b_transposed, m, padded):
    """On the GPU: each configuration against the same kernel unscheduled,
    lowered for the CPU (a ViT-like padded GEMM with its epilogue; ViT b1's
    197 rows, which `plan` pads inside the schedule)."""
    func = _gemm(m=m, padded=padded, n=384, k=384, b_transposed=b_transposed)  # (N = 384: the 128x96 tile too)
    from deploy.tvm_compat import ms as _ms

    info = _ms.arg_info.ArgInfo.from_prim_func(func)
    rng = np.random.default_rng(2)
    args = [(rng.standard_normal([int(d) for d in a.shape]) / 4).astype(str(a.dtype)) for a in info]
    cpu = tvm.tirx.build(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target="llvm")
    want = [tvm.runtime.tensor(a) for a in args]
    cpu["main"](*want)
    dev = tvm.cuda(0)
    spaces = mma_gemm.spaces(func, sm90)
    assert spaces
    for sch in spaces:
        lib = tune_builder.lean_build(sch.mod, sm90, None)
        got = [tvm.runtime.tensor(a, dev) for a in args]
        lib["main"](*got)
        np.testing.assert_allclose(got[-1].numpy().astype("float32"), want[-1].numpy().astype("float32"),
                                   rtol=2e-2, atol=2e-2, err_msg=mma_gemm.config_of(sch.mod))


def test_the_plan_gives_a_done_database_the_configurations_it_lacks(sm90, tmp_path, monkeypatch):
    """tuning/tune.py: a GEMM task whose database holds its trials already
    is still given the configurations of ours it has no record of (once);
    with TRIALS=0 nothing is tuned; not on the CPU."""
    from types import SimpleNamespace

    from deploy.tuning import database as dbs
    from deploy.tuning import tasks as tune_tasks
    from deploy.tuning import tune

    gemm = SimpleNamespace(task_name="gemm", dispatched=[tvm.IRModule({"main": _gemm()})], weight=1)
    batched = SimpleNamespace(task_name="bmm", dispatched=[tvm.IRModule({"main": _gemm(batch=4)})], weight=1)
    done = SimpleNamespace(trials=64, trials_per_task=64, max_tasks=0, trials_per_iter=64)
    counts = {"gemm": (64, 1e-5), "bmm": (0, None)}  # TRIALS reached by the GEMM's records alone
    monkeypatch.setattr(dbs, "trials_done", lambda folder, mods: [
        counts["bmm" if mma_gemm.match(m["main"]) is None else "gemm"] for m in mods])
    monkeypatch.setattr(dbs, "has_records", lambda folder: True)
    monkeypatch.setattr(dbs, "marked", lambda folder, mods, markers: [{"128x128x32-w2x2-s3"}] * len(mods))
    (p,), left = tune._plan([gemm], tmp_path, done, None, sm90)
    tiling = mma_gemm.configs_for(mma_gemm.match(_gemm()))
    assert p["mma_missing"] == [c for c in tiling if c != "128x128x32-w2x2-s3"]
    assert p["left"] == left == len(tiling) - 1
    # TRIALS reached: the other task, without a record, gets its share (half of TRIALS), and ours come first
    plan, left = tune._plan([batched, gemm], tmp_path, done, None, sm90)
    by = {q["name"]: q for q in plan}
    assert (by["bmm"]["left"], by["gemm"]["left"], left) == (64, 7, 32 + 7)
    assert sorted(plan, key=tune_tasks.order)[0]["name"] == "gemm"
    counts["bmm"] = (1, 1e-5)  # with one record it gets nothing
    plan, left = tune._plan([batched, gemm], tmp_path, done, None, sm90)
    assert ({q["name"]: q["left"] for q in plan}, left) == ({"bmm": 0, "gemm": 7}, 7)
    counts["bmm"] = (0, None)
    # less than a batch of TRIALS left (8 of 72), less than the new task's share (36): its share, plus ours
    plan, left = tune._plan([batched, gemm], tmp_path,
                            SimpleNamespace(trials=72, trials_per_task=64, max_tasks=0, trials_per_iter=16), None, sm90)
    assert left == 36 + 7 and {q["name"]: q["left"] for q in plan} == {"bmm": 64, "gemm": 7}
    # a batch or more left (32 of 96): what is left, shared as before, plus ours
    plan, left = tune._plan([batched, gemm], tmp_path,
                            SimpleNamespace(trials=96, trials_per_task=64, max_tasks=0, trials_per_iter=32), None, sm90)
    assert left == 32 + 7 and {q["name"]: q["left"] for q in plan} == {"bmm": 64, "gemm": 7}
    (p,), left = tune._plan([gemm], tmp_path, SimpleNamespace(trials=0, trials_per_task=64, max_tasks=0,
                                                              trials_per_iter=64), None, sm90)
    assert (p["mma_missing"], p["left"], left) == ([], 0, 0)
    (p,), left = tune._plan([gemm], tmp_path, done, None, targets.resolve("llvm").tvm_target())
    assert (p["mma_missing"], left) == ([], 0)


def test_the_database_says_which_configurations_a_task_has_records_of(sm90, tmp_path):
    from deploy.tuning import database as dbs

    mod = tvm.IRModule({"main": _gemm()})
    other = tvm.IRModule({"main": _gemm(b_transposed=True)})
    (sch, *_) = mma_gemm.spaces(_gemm(), sm90)
    db = ms.database.JSONDatabase(path_workload=str(tmp_path / dbs.WORKLOADS), path_tuning_record=str(tmp_path / dbs.RECORDS))
    db.commit_tuning_record(ms.database.TuningRecord(sch.trace, db.commit_workload(mod), [1e10], sm90,
                                                     ms.arg_info.ArgInfo.from_prim_func(_gemm())))
    assert dbs.marked(tmp_path, [mod, other], list(mma_gemm.CONFIGS)) == [{mma_gemm.config_of(sch.mod)}, set()]


def test_the_default_probe_refuses_bad_arguments_in_one_line_and_writes_nothing(tmp_path, capsys):
    probe = load_script("mma_default_probe")
    out = tmp_path / "out"
    for args, why in (
        (["--models", "tiny_mlp"], "NAME:BATCH"),
        (["--models", "tiny_mlp:0"], "NAME:BATCH"),
        (["--models", "tiny_mlp:8:flat"], "NAME:BATCH"),
        (["--models", "nosuch:8"], "unknown model(s) nosuch"),
        (["--models", "tiny_mlp:8", "--no-run", "--target", "llvm"], "must be a CUDA target"),
        (["--models", "tiny_mlp:8", "--no-run", "--target", "bogus"], "error:"),
        (["--models", "tiny_mlp:8", "--no-run", "--target", "cuda:sm_75"], "needs sm_80 or later"),
    ):
        assert probe.main([*args, "--out", str(out)]) == 2, args
        err = capsys.readouterr().err
        assert why in err and len(err.strip().splitlines()) == 1, err
        assert not out.exists()
    (tmp_path / "file").write_text("")
    assert probe.main(["--models", "tiny_mlp:8", "--no-run", "--out", str(tmp_path / "file")]) == 2
    assert "is a file" in capsys.readouterr().err
    assert probe.main(["--models", "tiny_mlp:8", "--no-run", "--out", str(tmp_path / "file" / "under")]) == 2
    assert "cannot be written" in capsys.readouterr().err


def test_the_default_probe_builds_both_schedules_of_a_models_gemms_here(tmp_path):
    """Without a GPU (`--no-run`): each kernel our default takes, built both
    ways for sm_90 (raises where either does not build), listed with its
    GEMM and our tile."""
    import json

    probe = load_script("mma_default_probe")
    assert probe.main(["--models", "tiny_mlp:64", "--no-run", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "probe.json").read_text())["rows"]
    assert sorted((r["model"], r["bucket"], r["gemm"], r["config"]) for r in rows) == [
        ("tiny_mlp", "64", "64x128x128", "64x64x32-w2x2-s4"), ("tiny_mlp", "64", "64x128x64", "64x64x32-w2x2-s3")]
    assert all("error" not in r and "ours_us" not in r for r in rows)
    assert "| tiny_mlp | 64 | fused_matmul" in (tmp_path / "probe.md").read_text()
