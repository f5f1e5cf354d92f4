"""Default CUDA schedules of ours for three kinds of kernel DLight's chain
schedules badly: a short reduction (`ShortReduction`: a depthwise
convolution, 3x3 to 7x7 taps; a small pooling window), a contraction
with few outputs and a long contiguous reduction (`FewOutputs`: the
squeeze-excitation convolutions at a large batch), and a small reduction
broadcast into a larger tensor (`BroadcastEpilogue`: the squeeze-excitation
"excite" kernel, see its docstring).

Why our own: DLight's Matmul rule cannot take a grouped convolution
(`auto_inline_consumer_chain: AssertionError`), so a depthwise convolution
fell to `GeneralReduction`, which gives every output element its own thread
block of 256 threads and spreads the 9 taps of a 3x3 window over 9 of them.
EfficientNet-B0 at batch 32 on the H200 then launched 12.8 million blocks for
its first depthwise convolution + SiLU: 11.7 ms for 0.23 GFLOP and 51 MB, 0%
of its roofline; its depthwise kernels took 62 of the 67 ms the untuned
package spent in kernels, against 5.6 ms for all of PyTorch eager
(`results/h200/2026-12-03/efficientnet_b0-fp16-b32/profile.md`).

`ShortReduction` gives each output element one thread instead: the spatial
loops fused and bound to blocks of 256 threads (the channel, innermost in
NHWC, runs across a warp, so loads and stores are coalesced), the taps as an
unrolled loop in registers, the padding computed inline, and the epilogue
(cast, bias, activation, residual) applied as each thread writes its output.

Where the reduction slides a window along NHWC's W axis (a depthwise
convolution or a pool, any stride), a thread computes several neighbouring
outputs of one channel instead, and loads each row of their common window
into registers once (`_schedule_window`): on ConvNeXt-T at batch 32 its
first 7x7 depthwise convolution took 279 us a call with a thread an output
(138 GB/s; results/h200/2026-12-04/convnext-fp16-b32-transposes-2/profile/).

Tuning gets the same schedule as a design space of its own, the block size
(and the window's width) a decision (`tunable=True`, added to MetaSchedule's spaces in
tuning/search.py): at batch 32 MetaSchedule's multi-level tiling drew no
candidate of EfficientNet-B0's depthwise convolutions that VerifyGPUCode
accepts (0 of 60 draws on the CPU machine: blocks of 4 to 224 tiles, each
caching its whole input tile in shared memory), and each such task spent its
search finding none (21 trials per minute on the H200).

A grouped convolution (ResNeXt's 32 groups of 4 to 32 channels) fell to
`GeneralReduction` the same way: on the H200 at batch 64, 24 ms a call for
ResNeXt-50's first 3x3 (78 GFLOP/s), 168 ms for the model against
torch.compile's 3.8 (results/h200/2026-12-06/gathers-row-k/). It gets a
thread GROUPED_OUTPUTS adjacent output channels (`_schedule_grouped`),
its group's channels summed with the taps (up to MAX_GROUPED_TAPS steps),
not the sliding window (whose registers would hold every channel of the
group for each tap). A thread an output, with the weights HWIO, ran it
at 0.28-0.36 ms a call on an H100 at batch 64, 3-12% of its roofline
(results/h100/2026-12-06/depthwise-b32/): two loads for each
multiply-add. Four outputs of a group share each input: 1.25 loads each,
and the four weights of a tap lie side by side (not yet timed).

It applies to a kernel with exactly one reduction block, whose loops are
spatial axes then reduction axes, with at most MAX_TAPS reduction steps per
output (MAX_GROUPED_TAPS for a grouped convolution) and at least
MIN_OUTPUTS outputs, and injective blocks besides whose last writes the
reduction's shape; anything else is left to DLight. It
comes after DLight's Matmul and GEMV in the chain (passes/schedule.py), so
no contraction they schedule changes.
"""

from __future__ import annotations

import math

from .kernel_shape import reduction_loops, rule_kernel, static_int, vars_of

MAX_TAPS = 64  # reduction steps per output: a 7x7 window is 49
MAX_GROUPED_TAPS = 288  # a grouped convolution's: ResNeXt-50 32x4d's last stage, 3x3 x 32 channels a group
MIN_OUTPUTS = 4096  # below this, too few threads: DLight's reduction rules split the reduction instead
THREADS = 256
THREAD_CHOICES = (64, 128, 256, 512, 1024)  # the block sizes tuning chooses among
GROUPED_OUTPUTS = 4  # a grouped convolution's adjacent output channels a thread computes (1: one)
GROUPED_CHOICES = (1, 2, 4)  # ... which tuning chooses among (those that divide the channels)


class ShortReduction:
    """A DLight-style rule (`apply(func, target, tunable)` returns a
    schedule, or None where it does not apply)."""

    def __init__(self, window: int | None = None):
        self.window = window  # outputs a thread computes along W (tests); None: WINDOW_DEFAULT

    def apply(self, func, target, tunable=False):
        got = rule_kernel(func, target, "cuda")
        if got is None:
            return None
        sch, (main, producers, consumers, n_s, extents) = got
        block = sch.get(main.block_rv)
        if len(block.writes) != 1:
            return None
        reduce_vars = {v for v, _ in reduction_loops(main, n_s, extents)}
        grouped_read = _grouped_read(block, main, n_s, reduce_vars)
        grouped = grouped_read is not None
        if math.prod(extents[n_s:]) > (MAX_GROUPED_TAPS if grouped else MAX_TAPS) \
                or math.prod(extents[:n_s]) < MIN_OUTPUTS:
            return None
        # Each thread's reads walk the reduction: not along a buffer's
        # contiguous axis (a sum over the last axis stays with DLight, whose
        # threads split it and read it coalesced), but for a grouped
        # convolution's channels of a group.
        for r in block.reads:
            if r.region and vars_of(r.region[-1].min) & reduce_vars and not grouped:
                return None
        if not elementwise_epilogue(sch, block, consumers):
            return None  # a broadcast epilogue: not one output per thread
        if grouped:
            try:
                return _schedule_grouped(sch, main, producers, consumers, n_s, extents, grouped_read, tunable)
            except Exception:  # noqa: BLE001 - a ScheduleError: not this rule's kernel
                return None
        window = _window_read(block, main, n_s, reduce_vars)
        if window is not None:
            try:
                return _schedule_window(sch, main, producers, consumers, n_s, extents, window, tunable, self.window)
            except Exception:  # noqa: BLE001 - e.g. the windowed input read by an epilogue too: a thread an output
                sch, (main, producers, consumers, n_s, extents) = rule_kernel(func, target, "cuda")
        try:
            return self._schedule(sch, main, producers, consumers, n_s, tunable)
        except Exception:  # noqa: BLE001 - a ScheduleError (a producer read twice, an output read again): not this rule's kernel
            return None

    @staticmethod
    def _schedule(sch, main, producers, consumers, n_s, tunable):
        inline_around(sch, producers, consumers)  # (the padding: computed where it is read)
        # Tunable (a design space for MetaSchedule, tuning/search.py): the
        # block size is a decision its MutateThreadBinding mutates.
        threads = _decision(sch, THREAD_CHOICES) if tunable else THREADS
        loops = _thread_per_output(sch, main, n_s, threads)
        if consumers:
            sch.reverse_compute_inline(consumers[-1].block_rv)
        for r in loops[n_s:]:
            sch.unroll(r)
        sch.decompose_reduction(main.block_rv, loops[n_s])
        return sch


# Outputs along the window's axis (NHWC's W) one thread computes: each row of
# the window is read once for all of them. Tuning chooses among those that
# divide the axis (1: a thread per output, the window still in registers).
WINDOW_CHOICES = (1, 2, 4, 7, 8)
WINDOW_DEFAULT = (4, 7, 2)  # the default: the first of these that divides the axis, else 1


def _grouped_read(block, main, n_s: int, reduce_vars: set) -> int | None:
    """The index of the main block's read of a 4-D buffer (NHWC) with
    reduction variables along a spatial axis and along its channels, these
    together with an output variable that another read holds too (the
    output channel, which the weight carries: the group's first channel):
    a grouped convolution's input; else None. (A depthwise one sums no channel; a dense one's
    channel is the reduction's alone; in NCHW the last axis is W, whose
    output variable no weight holds, and a pool has no weight. At batch 1
    the image loop is gone: three spatial loops, the read still 4-D.)"""
    outputs = {it.var for it in main.iters[:n_s]}
    reads = list(block.reads)  # (by position: TVM gives a new wrapper object at each access)

    def held_elsewhere(i) -> set:
        return set().union(*(vars_of(d.min) for j, w in enumerate(reads) if j != i for d in w.region))

    return next((i for i, r in enumerate(reads) if len(r.region) == 4 and vars_of(r.region[-1].min) & reduce_vars
                 and vars_of(r.region[-1].min) & outputs & held_elsewhere(i)
                 and any(vars_of(d.min) & reduce_vars for d in r.region[1:3])), None)


def _window_read(block, main, n_s: int, reduce_vars: set) -> int | None:
    """The index of the main block's read that slides a window along the
    second-to-last spatial axis (NHWC's W: `x * stride + rx`) of a 4-D
    output, else None."""
    if n_s != 4:
        return None
    w = main.iters[n_s - 2].var
    for i, r in enumerate(block.reads):
        if len(r.region) == n_s:
            found = vars_of(r.region[n_s - 2].min)
            if w in found and found & reduce_vars:
                return i
    return None


def _schedule_window(sch, main, producers, consumers, n_s, extents, read_index, tunable, fixed=None):
    """ShortReduction with a sliding window (depthwise convolutions and
    pools in NHWC): each thread computes `vw` neighbouring outputs along W
    for one channel. For each row of the window it loads the `(vw - 1) *
    stride + taps` inputs that row needs into registers once (the padding
    computed as they are loaded), then accumulates every tap of every output
    from them: ConvNeXt's 7x7 convolution loads 17.5 inputs an output at
    vw=4 instead of 49. Channels stay across a warp (coalesced)."""
    padding = inline_around(sch, producers, consumers, keep=sch.get(main.block_rv).reads[read_index].source)
    width = extents[n_s - 2]
    divisors = [v for v in WINDOW_CHOICES if width % v == 0]
    vw, threads = _sizes(sch, tunable, divisors, fixed if fixed is not None and width % fixed == 0
                         else next((v for v in WINDOW_DEFAULT if width % v == 0), 1))
    loops = sch.get_loops(main.block_rv)
    spatial, reduce = loops[:n_s], loops[n_s:]
    wo, wi = sch.split(spatial[n_s - 2], factors=[None, vw])
    sch.reorder(*spatial[:n_s - 2], wo, spatial[n_s - 1], *reduce, wi)
    _bind_threads(sch, main, sch.fuse(*spatial[:n_s - 2], wo, spatial[n_s - 1]), threads)
    if consumers:
        sch.reverse_compute_inline(consumers[-1].block_rv)
    if padding is not None:  # the padding, computed into registers a window row at a time
        window = padding.block_rv
        sch.set_scope(window, 0, "local")
    else:
        window = sch.cache_read(main.block_rv, read_index, "local")
    sch.compute_at(window, reduce[0], preserve_unit_loops=True)
    for loop in sch.get_loops(window)[3:]:  # (below blockIdx, threadIdx and the window's row)
        sch.unroll(loop)
    for loop in [*reduce[1:], wi]:
        sch.unroll(loop)
    sch.decompose_reduction(main.block_rv, reduce[0])
    return sch


def _schedule_grouped(sch, main, producers, consumers, n_s, extents, x_read, tunable):
    """ShortReduction on a grouped convolution: each thread computes `vo`
    adjacent output channels of one pixel (GROUPED_OUTPUTS, or fewer where
    it does not divide the channels; tuning: a decision among
    GROUPED_CHOICES), the taps and the group's channels outside its outputs'
    loop. At each tap and channel the input (the padding computed as it is
    loaded), the same for the `vo` outputs of a group, is loaded once into a
    register, and their `vo` weights, side by side in HWIO, in one vector;
    the sums in registers, the epilogue applied as it writes them. `x_read`:
    the index of the input's read (`_grouped_read`)."""
    reads = list(sch.get(main.block_rv).reads)
    outputs = {it.var for it in main.iters[:n_s]}
    w_read = next(i for i, r in enumerate(reads) if i != x_read and any(vars_of(d.min) & outputs for d in r.region))
    side_by_side = bool(vars_of(reads[w_read].region[-1].min) & outputs)  # (HWIO: a tap's outputs adjacent)
    padding = inline_around(sch, producers, consumers, keep=reads[x_read].source)
    channels = extents[n_s - 1]
    divisors = [v for v in GROUPED_CHOICES if channels % v == 0]
    vo, threads = _sizes(sch, tunable, divisors, next(v for v in (GROUPED_OUTPUTS, 2, 1) if channels % v == 0))
    loops = sch.get_loops(main.block_rv)
    spatial, reduce = loops[:n_s], loops[n_s:]
    oo, oi = sch.split(spatial[n_s - 1], factors=[None, vo])
    sch.reorder(*spatial[:n_s - 1], oo, *reduce, oi)
    _bind_threads(sch, main, sch.fuse(*spatial[:n_s - 1], oo), threads)
    if consumers:
        sch.reverse_compute_inline(consumers[-1].block_rv)
    weights = sch.cache_read(main.block_rv, w_read, "local")
    if padding is not None:  # (the padded input, a register at a time)
        sch.set_scope(padding.block_rv, 0, "local")
        inputs = padding.block_rv
    else:
        inputs = sch.cache_read(main.block_rv, x_read, "local")
    for cache in (inputs, weights):
        sch.compute_at(cache, reduce[-1], preserve_unit_loops=True)
    if side_by_side and (tunable or vo > 1):
        sch.vectorize(sch.get_loops(weights)[-1])
    for loop in [*reduce, oi]:
        sch.unroll(loop)
    sch.decompose_reduction(main.block_rv, reduce[0])
    return sch


FLOAT_DTYPES = ("float16", "bfloat16", "float32")


def float_buffers(sch, blocks) -> bool:
    """Whether every buffer the blocks (DLight block infos) read or write
    is of a float type CUDA's codegen prints as a vector (no bool, int64 or
    float64 lanes)."""
    return {str(r.source.dtype) for b in blocks
            for r in [*sch.get(b.block_rv).reads, *sch.get(b.block_rv).writes]} <= set(FLOAT_DTYPES)


def elementwise_epilogue(sch, block, consumers) -> bool:
    """Whether the last epilogue block writes the reduction `block`'s
    shape (an element for each output, not a broadcast), or there is none."""
    shape = [static_int(d) for d in block.writes[0].source.shape]
    return not consumers or [static_int(d) for d in sch.get(consumers[-1].block_rv).writes[0].source.shape] == shape


def inline_around(sch, producers, consumers, keep=None):
    """The reduction's producers (padding) and every consumer but the last
    inlined: computed where they are read; but the producer that writes
    `keep` (a buffer: the padding of the input a schedule loads into
    registers itself), which is returned (None where there is none)."""
    kept = next((p for p in producers if keep is not None and sch.get(p.block_rv).writes[0].source.same_as(keep)),
                None)
    for p in reversed(producers):
        if p is not kept:
            sch.compute_inline(p.block_rv)
    for c in consumers[:-1]:
        sch.compute_inline(c.block_rv)
    return kept


def _thread_per_output(sch, main, n_s: int, threads) -> list:
    """The reduction's spatial loops fused and bound to blocks of `threads`
    (an int, or a sampled decision), one thread per output, its sum kept in
    a register and written back by that thread; returns the block's loops
    (its reduction loops from `n_s` on)."""
    loops = sch.get_loops(main.block_rv)
    _bind_threads(sch, main, sch.fuse(*loops[:n_s]), threads)
    return loops


def _bind_threads(sch, main, fused, threads) -> None:
    """`fused` (the outputs' loop) bound to blocks of `threads` threads, each
    thread's sums kept in registers and written back by that thread."""
    bx, tx = sch.split(fused, factors=[None, threads])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    writeback = sch.cache_write(main.block_rv, 0, "local")
    sch.reverse_compute_at(writeback, tx, preserve_unit_loops=True)


def _sizes(sch, tunable, divisors, default):
    """(what a thread computes, the block size): tuning's decisions among
    `divisors` and THREAD_CHOICES, else `default` and THREADS."""
    if tunable:
        return _decision(sch, divisors), _decision(sch, THREAD_CHOICES)
    return default, THREADS


def _decision(sch, candidates):
    """A tuning decision among `candidates`, each equally likely."""
    return sch.sample_categorical(candidates=list(candidates), probs=[1 / len(candidates)] * len(candidates))


MAX_FEW_OUTPUTS = 16384  # DLight's Matmul tiles 32 x 64 outputs a block: at most 8 blocks
MIN_LONG_TAPS = 32


class FewOutputs:
    """A contraction with few outputs (at most MAX_FEW_OUTPUTS) whose
    innermost reduction loop runs at least MIN_LONG_TAPS steps along both
    operands' contiguous axis, not GEMV-shaped: DLight's GeneralReduction (a thread block per
    output, its threads splitting the reduction, reads coalesced) instead of
    DLight's Matmul, which tiles it into a handful of thread blocks on a
    132-SM GPU. EfficientNet-B0's squeeze-excitation convolutions at batch 32
    (e.g. 32 x 672 -> 28: 896 outputs, 672 steps) got one block each under
    Matmul, 17-45 us a call, 0.57 of the 4.18 ms its kernels took on the H200
    (results/h200/2026-12-03/efficientnet_b0-fp16-b32-short-reduction/
    profile.md). It comes first in the chain, before Matmul; a GEMV-shaped
    kernel (batch 1) is left to DLight's GEMV rule, a reduction read strided
    (a classifier's [K, N] weight) to Matmul."""

    def apply(self, func, target, tunable=False):
        from ..tvm_compat import dlight

        got = rule_kernel(func, target, "cuda")
        if got is None:
            return None
        sch, (main, _producers, _consumers, n_s, extents) = got
        reduce = reduction_loops(main, n_s, extents)
        if math.prod(extents[:n_s]) > MAX_FEW_OUTPUTS or not reduce or reduce[-1][1] < MIN_LONG_TAPS:
            return None
        block = sch.get(main.block_rv)
        reduce_vars, inner = {v for v, _ in reduce}, reduce[-1][0]
        walked = [r for r in block.reads if r.region and any(vars_of(d.min) & reduce_vars for d in r.region)]
        # A contraction (two operands walked: a sum or a mean stays with
        # DLight's Reduction), its innermost reduction loop along every
        # walked operand's contiguous axis (else most of it is read strided).
        if len(walked) < 2 or any(inner not in vars_of(r.region[-1].min) for r in walked):
            return None
        try:
            if dlight.gpu.GEMV().apply(func, target, False) is not None:
                return None
            return dlight.gpu.GeneralReduction().apply(func, target, tunable)
        except Exception:  # noqa: BLE001 - a rule that cannot take it: left to the chain
            return None


MAX_EXCITE_TAPS = 512  # reduction steps per output, each a thread's serial loop
MIN_BROADCAST = 4  # the epilogue writes at least this many times the reduction's outputs
VECTOR = (8, 4, 2)  # elements per thread in the epilogue: 16 bytes of the output at most


def _broadcast_along_rows(blocks) -> bool:
    """Whether the epilogue's blocks broadcast the reduction over other
    axes than the last: in each, a read of a buffer smaller than the one it
    writes is indexed along its last axis by the block's last iterator (the
    excite kernel's channels, NHWC). A reduction broadcast along the row
    (an RMS norm's, `x - mean(x)`'s) is DLight's Reduction's, a block a row."""
    for block in blocks:
        written = math.prod(static_int(d) or 0 for d in block.writes[0].source.shape)
        last_iv = block.iter_vars[-1].var
        for r in block.reads:
            if math.prod(static_int(d) or 0 for d in r.source.shape) >= written:
                continue  # (read element for element)
            if last_iv not in vars_of(r.region[-1].min):
                return False
    return True


class BroadcastEpilogue:
    """A small reduction whose epilogue broadcasts it over a larger tensor:
    the squeeze-excitation "excite" kernel, a 1x1 convolution of the squeezed
    channels, bias and sigmoid, multiplied into the whole feature map
    (out[n, h, w, c] = x[n, h, w, c] * sigmoid(conv(s)[n, c] + b[c])).

    DLight's Matmul rule raises on it (the broadcast consumer cannot be
    inlined into its cache-write stage) and its reductions decline it, so it
    fell to `Fallback`: one thread per element and scalar fp16 loads. On the
    H200 at batch 32 EfficientNet-B0's ten such kernels ran at 4-18% of their
    memory roofline, 0.59 ms of 4.18 in kernels
    (results/h200/2026-12-03/efficientnet_b0-fp16-b32-short-reduction/profile.md).

    Ours: two kernels in one function, as Fallback's, the reduction a thread
    per output (its few steps a serial loop, the sum in a register) and the
    epilogue, with the activation computed inline, fused over every axis with
    up to VECTOR elements per thread, so that the feature map is read and
    written 16 bytes at a time. It declines kernels with other than
    floating-point buffers. `tunable` is ignored: tuning has no design space
    of it (MetaSchedule's own spaces apply).

    In the chain (passes/schedule.py) it comes just before DLight's GEMV: at
    batch 1 GEMV takes the excite kernel and computes the broadcast multiply
    in the blocks of its reduction, one per 16 channels: EfficientNet-B0's
    first (112x112x32 features, 2 blocks) took 0.317 ms a call on an H100,
    its ten such kernels 0.76 of the 1.98 ms in kernels
    (results/h100/2026-12-06/verify-conv-transpose-vector-rows/profile-efficientnet_b0-b1/).
    At larger batches GEMV declines it, and every DLight rule before Fallback
    does.
    """

    def apply(self, func, target, tunable=False):
        got = rule_kernel(func, target, "cuda")
        if got is None:
            return None
        sch, (main, producers, consumers, n_s, extents) = got
        if not consumers or math.prod(extents[n_s:]) > MAX_EXCITE_TAPS:
            return None
        block = sch.get(main.block_rv)
        if len(block.writes) != 1:
            return None
        written = sch.get(consumers[-1].block_rv).writes[0].source
        out = [static_int(d) for d in written.shape]
        if None in out or math.prod(out) < MIN_BROADCAST * math.prod(extents[:n_s]):
            return None
        if out[-1] < 2 or not _broadcast_along_rows([sch.get(c.block_rv) for c in consumers]):
            return None
        # Floating-point buffers only (CUDA's codegen prints no 8-lane bool,
        # int64 or float64 vector), and at most 16 bytes of the output a thread.
        if not float_buffers(sch, [main, *producers, *consumers]):
            return None
        widest = 16 // (2 if str(written.dtype) in ("float16", "bfloat16") else 4)
        vector = next((v for v in VECTOR if v <= widest and out[-1] % v == 0), 1)
        try:
            return self._schedule(sch, main, producers, consumers, n_s, vector)
        except Exception:  # noqa: BLE001 - a ScheduleError: not this rule's kernel
            return None

    @staticmethod
    def _schedule(sch, main, producers, consumers, n_s, vector):
        inline_around(sch, producers, consumers)  # (the activation: recomputed per element, from the reduction's output)
        loops = _thread_per_output(sch, main, n_s, THREADS)
        sch.decompose_reduction(main.block_rv, loops[n_s])
        epilogue = consumers[-1].block_rv
        # (split the vector off first: the bounds check of the last block then
        # does not involve the vectorized loop)
        rest, lanes = sch.split(sch.fuse(*sch.get_loops(epilogue)), factors=[None, vector])
        bx, tx = sch.split(rest, factors=[None, THREADS])
        sch.bind(bx, "blockIdx.x")
        sch.bind(tx, "threadIdx.x")
        sch.vectorize(lanes)
        return sch
