"""KxK convolutions as implicit GEMMs: the tensor-core GEMM schedule for them.

Our own rewrite (the profile's `implicit_gemm`; by default on sm_90 in fp16,
where our wgmma kernel takes them, but in a bucket whose database was tuned
on direct convolutions: config.Profile.implicit_gemms, tuning/graph.py; not
a workaround). On ResNet-50 at batch 64 on the H200 the 3x3 convolutions are
where TVM loses to cuDNN: 1.4x to 2.5x its time each, 1.35 ms of the model's
~3.85 ms against cuDNN's 0.73 (results/h200/2026-12-04/conv-vs-cudnn/). Six
of the seven run DLight's default; MetaSchedule's tensor-core rules give a
4-D NHWC convolution WMMA candidates only (no `cp.async`, no pipeline), and
decline it for `mma.sync` ("The MMA tensor core only supports SSR loops").

A convolution `y[n, h, w, o] = sum x[n, h*s+r-p, w*s+q-p, c] * W[o, r, q, c]`
(NHWC data, OHWI weights) is a GEMM over rows `i = (n, h, w)` and a
reduction `k = (r, q, c)`:
    A[i, k] = x[...] or 0 in the padding     (an injective block: im2col)
    C[i, o] = sum_k f32(A[i, k]) * f32(W2[o, k])   with W2 = reshape(W, [O, R*S*C])
The im2col matrix is never stored: in a fused kernel it is a producer block
that a schedule computes straight into its shared-memory tile (passes.mma_gemm
stages such a producer as it does pad_gemm's padded rows: the copies are
predicated `cp.async` where TVM can vectorize them, 16 bytes of channels at a
time), and MetaSchedule's rules inline it into the GEMM's loads. The pass in
flat_gemm.py emits this function for each convolution `applies` accepts and
carries the epilogue (bias, residual, ReLU) in 2-D after it, so that the
fused kernel is the 2-D GEMM that passes.mma_gemm and the `mma.sync` rule take.

It changes those kernels' workloads, so a database tuned without it does not
cover them: a bucket whose database was tuned on direct convolutions keeps
them (tuning/graph.py; at batch 1 the plain graph's tuned kernels are
faster: results/h200/2026-12-06/gathers-row-k/).
"""

from __future__ import annotations

from . import nhwc_ohwi, static_shape, tensor_dtype

VECTOR = 8  # channels per 16-byte fp16 copy: C must be a multiple
# Fewer channels than VECTOR (an RGB stem's 3) padded with zeros up to it where the wgmma kernel takes
# the GEMM (`applies`' `pad`); 0: left alone
FEW_CHANNELS = VECTOR
IM2COL = "im2col"  # the producer block's name (passes/pad_gemm.py finds it by it)
# A stride-2 convolution of fewer channels than VECTOR (an RGB stem) as a stride-1 one over 2 x 2 blocks of pixels
# (`space_to_depth`); False: its channels padded to VECTOR alone
SPACE_TO_DEPTH = True


def dense_nhwc(attrs) -> bool:
    """A conv2d in NHWC/OHWI with one group and no dilation (what this pass
    and flat_gemm's 1x1 rewrite both take)."""
    return nhwc_ohwi(attrs) and int(attrs.groups) == 1 and [int(d) for d in attrs.dilation] == [1, 1]


def stride_1_unpadded(attrs) -> bool:
    """A conv2d of stride 1 without padding: a 1x1 one is flat_gemm's plain GEMM."""
    return [int(s) for s in attrs.strides] == [1, 1] and not any(int(p) for p in attrs.padding)


def applies(call, tf32: bool = False, strided_1x1: bool = False, pad: bool = False) -> bool:
    """Whether this Relax conv2d call becomes an implicit GEMM: NHWC/OHWI,
    one group, no dilation, static shapes, a kernel larger than 1x1 (a 1x1
    convolution is a plain GEMM: flat_gemm's) or, with `strided_1x1`, a
    strided 1x1 one (ResNet's downsampling: an implicit GEMM over every
    other pixel; only where flat_gemm makes the other 1x1 convolutions 2-D:
    otherwise the residual add between a 4-D and a 2-D branch fuses with
    neither, which made ResNet-50 b64 five kernels more), fp16 data and weights with an
    fp32 sum (an fp16 sum is no GEMM our mma.sync schedule takes) or, with
    `tf32`, fp32 throughout (passes/tf32.py), and
    channels a multiple of 8 with 16 dividing the output channels. With
    `pad` (where the wgmma kernel takes it), fewer channels than
    FEW_CHANNELS too (an RGB stem's 3: `padded_channels`)."""
    if not dense_nhwc(call.attrs):
        return False
    x, w = call.args
    xs, ws = static_shape(x), static_shape(w)
    if xs is None or ws is None or static_shape(call) is None:
        return False
    dtypes = (tensor_dtype(x), tensor_dtype(w), tensor_dtype(call))
    if dtypes != ("float16", "float16", "float32") and not (tf32 and dtypes == ("float32",) * 3):
        return False
    o, r, s, c = ws
    if r * s == 1 and not (strided_1x1 and not stride_1_unpadded(call.attrs)):
        return False
    return (c % VECTOR == 0 or (pad and c < FEW_CHANNELS)) and o % 16 == 0


def padded_channels(c: int) -> int:
    """The channels a convolution of `c` input channels gathers: `c` padded
    with zeros to a multiple of VECTOR (its data and weights both: the
    gather copies 8 neighbouring channels at a time). The 7x7 stem of
    ResNet-50 (3 channels) at batch 64 was DLight's, 0.75 ms on an H100
    untuned, a fifth of the model's kernel time
    (results/h100/2026-12-06/epilogue-staged/); as an implicit GEMM of
    K = 7 x 7 x 8 on the wgmma kernel its padded products are 40 GFLOP."""
    return -(-c // VECTOR) * VECTOR


def space_to_depth(xs, ws, strides, padding, ys) -> dict | None:
    """How a stride-2 convolution of few channels is computed as a stride-1
    one over 2 x 2 blocks of pixels, or None where it is not one.

    The RGB stem (7 x 7, stride 2, 3 channels padded to 8) gathers 392
    values a row, 49 copies of 16 bytes, each pixel read by 3.5
    neighbouring rows: on an H100, untuned, 0.306 ms of ResNet-50 b64's
    2.84 ms of kernels, 15% of its roofline
    (results/h100/2026-12-06/movement/). With `kh = 2a + b`, `y[h, w] =
    sum x[2h + kh, 2w + kw] W[kh, kw]` (x padded) is `sum X[h + a, w + a']
    V[a, a']` with `X[p, q] = x[2p + b, 2q + b']` over the channels
    `(b, b', c)` and `V[a, a'] = W[2a + b, 2a' + b']` (zeros past the
    kernel): a ceil(k/2)-square kernel of stride 1 and 4c channels, K = 4
    x 4 x 16 for the stem (256 values a row, 16 copies of 32 bytes). `xs`,
    `ws`, `ys`: the NHWC data's, the OHWI weights' and the output's shapes;
    `padding`: [top, left, bottom, right]. Returns `channels` (c padded to
    an even count: 4c a multiple of 8), `x_pad` (the data's pad widths,
    before and after each axis), `w_pad` (the weights'), `kernel`, the
    blocked shapes `x_blocks` and `w_blocks`, and the GEMM's `k`. None where the blocked K
    exceeds the padded one (5 to 7 channels), or where the blocked data
    would have to be cropped (an even kernel over an odd size, unpadded)."""
    if not SPACE_TO_DEPTH or [int(v) for v in strides] != [2, 2]:
        return None
    n, h, wd, c = xs
    o, r, s, _ = ws
    _, ho, wo, _ = ys
    if c >= VECTOR or r < 2 or s < 2:
        return None
    top, left = int(padding[0]), int(padding[1])
    r2, s2 = -(-r // 2), -(-s // 2)
    hp, wp = 2 * (ho + r2 - 1), 2 * (wo + s2 - 1)  # (the padded data the blocked kernel reads, even sizes)
    bottom, right = hp - h - top, wp - wd - left
    if bottom < 0 or right < 0:
        return None
    cb = c + c % 2
    k = r2 * s2 * 4 * cb
    if k > r * s * padded_channels(c):  # (5 to 7 channels: more products than padding them to 8)
        return None
    return {"channels": cb, "kernel": (r2, s2), "k": k,
            "x_pad": [0, 0, top, bottom, left, right, 0, cb - c],
            "w_pad": [0, 0, 0, 2 * r2 - r, 0, 2 * s2 - s, 0, cb - c],
            "x_blocks": ([n, hp // 2, 2, wp // 2, 2, cb], [n, hp // 2, wp // 2, 4 * cb]),
            "w_blocks": ([o, r2, 2, s2, 2, cb], [o, r2, s2, 4 * cb])}


def conv_as_gemm(x, w2, kernel: tuple[int, int], strides, padding, out_shape, out_dtype: str):
    """The TE of one convolution as an implicit GEMM: `x` [N, H, W, C],
    `w2` [O, R*S*C] (the OHWI weights, reshaped); returns C [N*Ho*Wo, O]
    in `out_dtype`. `padding` is conv2d's [top, left, bottom, right]."""
    from tvm import te, tirx

    n, h, wd, c = (int(d) for d in x.shape)
    o, kk = (int(d) for d in w2.shape)
    r, s = kernel
    sh, sw = (int(v) for v in strides)
    top, left = int(padding[0]), int(padding[1])
    _, ho, wo, _ = out_shape
    rows = n * ho * wo
    padded = any(int(p) for p in padding)
    zero = tirx.const(0, x.dtype)

    def im2col(i, k):
        b, pix = i // (ho * wo), i % (ho * wo)
        y, xq = pix // wo, pix % wo
        dr, ds, cc = k // (s * c), k // c % s, k % c
        hi, wi = y * sh + dr - top, xq * sw + ds - left
        if not padded:
            return x[b, hi, wi, cc]
        inside = tirx.all(hi >= 0, hi < h, wi >= 0, wi < wd)
        return tirx.if_then_else(inside, x[b, hi, wi, cc], zero)

    a = te.compute((rows, kk), im2col, name=IM2COL)
    red = te.reduce_axis((0, kk), name="k")
    return te.compute((rows, o), lambda i, j: te.sum(a[i, red].astype(out_dtype) * w2[j, red].astype(out_dtype),
                                                    axis=red), name="conv_gemm")
