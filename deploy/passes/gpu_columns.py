"""A default CUDA schedule of ours for sums and means over the pixels of an
NHWC feature map (`ColumnSums`): a reduction over outer axes of a buffer
whose last, contiguous axis (the channels) it keeps. Squeeze-excitation's
"squeeze" (a mean over H and W for each channel) and a CNN's global
average pool are such kernels.

Why our own: DLight's `Reduction` takes them (its `_sch_inner_spatial`)
with 16 channels of a thread block across threadIdx.x and only 16 threads
splitting the reduction (threadIdx.y): at batch 1 EfficientNet-B0's mean
over 56 x 56 pixels of 144 channels ran in 9 thread blocks whose threads
each walked 196 pixels one fp16 element at a time, 13 us a call (about
10 us for each of its 11 squeeze kernels) on an H100, where the 0.9 MB it
reads take under a microsecond at the memory's bandwidth
(results/h100/2026-12-06/verify-conv-transpose-vector-rows/profile-efficientnet_b0-b1/).

`ColumnSums` gives a thread block `LANES` adjacent channels of one image
and a power of two of threads, up to `MAX_THREADS`, enough that each
walks about `STEPS` pixels: each thread loads its pixels' `LANES` channels
in one vector load, sums them in registers (fp32 where the model's mean
casts), and the block's threads are then summed by TVM's cross-thread
reduction (warp shuffles, then shared memory); the epilogue (the mean's
division, a cast) is applied as the sums are written. The 56 x 56 x 144
mean then runs in 36 blocks of 512 threads, 7 pixels a thread.

It takes a kernel with one reduction block reading one input along the
reduction (a sum, a mean, a max: any reducer TVM's `rfactor` takes, one
with a non-zero initial value declined by it; a contraction, two inputs
walked, stays with the rules that take those), whose reduction runs at
least `MIN_STEPS` steps over axes other than the input's last, which is
the output's last (a reduction along the row is DLight's, whose threads
read it coalesced), and injective blocks besides, the last writing the
reduction's shape. A pool with a window of 32 steps or more over fewer
outputs than `ShortReduction` takes is such a kernel too. It comes after
our `ShortReduction` (short reductions over many outputs, a thread an
output) and just before DLight's `Reduction` in the CUDA chain
(passes/schedule.py).

Its fp32 sums add the pixels in another order than TVM's plain lowering
for the CPU, as DLight's Reduction's do: outputs may differ from that
lowering's in the last bits (ResNet-50's global pool: 1,570 of 2,048 fp32
outputs, at most 4.5e-8 apart, DLight's 1,571).
"""

from __future__ import annotations

import math

from .gpu_default import elementwise_epilogue, float_buffers, inline_around
from .kernel_shape import reduction_loops, rule_kernel, static_int, vars_of

# The rule in the chain (an A/B switch: scripts/with_settings.py). Off, the chain keeps its name
# (`default_chain`): a kernel check run with it off files its timings under the chain with it on.
COLUMN_SUMS = True
MIN_STEPS = 32  # reduction steps an output: fewer go to ShortReduction (a thread an output) or DLight
STEPS = 8  # pixels a thread walks, about: the threads a block are the pixels over this
MIN_THREADS, MAX_THREADS = 32, 512
# Channels a thread sums: its loads 8 bytes of fp16 or 16 of fp32 at once, its sums one float4 (of 8,
# TVM 0.27's CUDA codegen prints what nvcc rejects: passes/gpu_movement.py's `_unprintable_8`).
LANES = 4


def threads_for(steps: int) -> int:
    """A block's threads for a reduction of `steps` steps an output: a
    power of two, about steps / STEPS, within MIN_THREADS and MAX_THREADS."""
    want = max(1, math.ceil(steps / STEPS))
    return min(MAX_THREADS, max(MIN_THREADS, 1 << (want - 1).bit_length()))


class ColumnSums:
    """A DLight-style rule (`apply(func, target, tunable)` returns a
    schedule, or None where it does not apply). `tunable` is ignored:
    tuning has no design space of it (MetaSchedule's own spaces apply)."""

    def apply(self, func, target, _tunable=False):
        if not COLUMN_SUMS:
            return None
        got = rule_kernel(func, target, "cuda")
        if got is None:
            return None
        sch, (main, producers, consumers, n_s, extents) = got
        reduce = reduction_loops(main, n_s, extents)
        steps = math.prod(extents[n_s:])
        if not reduce or steps < MIN_STEPS or n_s < 1:
            return None
        block = sch.get(main.block_rv)
        if len(block.writes) != 1:
            return None
        channel = main.iters[n_s - 1].var
        reduce_vars = {it.var for it in main.iters[n_s:]}
        walked = [r for r in block.reads if any(vars_of(d.min) & reduce_vars for d in r.region)]
        if len(walked) != 1 or not walked[0].region:
            return None
        read = walked[0]
        if vars_of(read.region[-1].min) != {channel} or vars_of(block.writes[0].region[-1].min) != {channel}:
            return None
        if not elementwise_epilogue(sch, block, consumers):
            return None  # (a broadcast epilogue: not this kernel)
        if not float_buffers(sch, [main, *producers, *consumers]):
            return None
        lanes = next(v for v in (LANES, 2, 1) if extents[n_s - 1] % v == 0)
        try:
            return _schedule(sch, main, producers, consumers, n_s, lanes, threads_for(steps))
        except Exception:  # noqa: BLE001 - a ScheduleError: not this rule's kernel
            return None


def _schedule(sch, main, producers, consumers, n_s: int, lanes: int, threads: int):
    inline_around(sch, producers, consumers)  # (the input's cast: computed as it is loaded)
    loops = sch.get_loops(main.block_rv)
    spatial, reduce = loops[:n_s], loops[n_s:]
    r = sch.fuse(*reduce) if len(reduce) > 1 else reduce[0]
    serial, lane = sch.split(r, factors=[None, threads])
    group, vec = sch.split(spatial[-1], factors=[None, lanes])
    sch.reorder(*spatial[:-1], group, lane, serial, vec)
    # Each thread's partial sums of its `lanes` channels, in registers.
    rf = sch.rfactor(lane, 0)
    *outer, rf_lane, rf_serial, rf_vec = sch.get_loops(rf)
    bx = sch.fuse(*outer)
    sch.bind(bx, "blockIdx.x")
    sch.bind(rf_lane, "threadIdx.x")
    sch.set_scope(rf, 0, "local")
    sch.vectorize(rf_vec)
    sch.decompose_reduction(rf, rf_serial)
    # The block's threads summed for each channel (a cross-thread reduction).
    sch.reverse_compute_at(main.block_rv, bx, preserve_unit_loops=True)
    rest = sch.get_loops(main.block_rv)[1:]  # (below blockIdx.x)
    lane_loop = next(lp for lp in rest if static_int(sch.get(lp).extent) == threads)  # (the others: <= lanes)
    sch.reorder(*[lp for lp in rest if not lp.same_as(lane_loop)], lane_loop)  # (TVM: the cross-thread loop innermost)
    sch.bind(lane_loop, "threadIdx.x")
    if consumers:
        # (without an epilogue the sums are the output, written by TVM's reduction)
        sch.set_scope(main.block_rv, 0, "local")
        epilogue = consumers[-1].block_rv
        sch.reverse_compute_at(epilogue, bx, preserve_unit_loops=True)
        _, tx = sch.split(sch.fuse(*sch.get_loops(epilogue)[1:]), factors=[None, threads])
        sch.bind(tx, "threadIdx.x")  # (the block's size: TVM guards the threads beyond the outputs)
    return sch
