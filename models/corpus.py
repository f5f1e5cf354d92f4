"""The model corpus: one ``ModelSpec`` per architecture family, each with a small CI variant.

Every entry exports with the TorchScript ONNX exporter (opset 17) with a
dynamic batch dimension on every input and output.  Full variants are the
realistic size (ImageNet-style 224x224 for most CNNs, < 30M params); the
``small`` variant is the same architecture, narrower and on a smaller input
(< 1M params, < 20 MFLOP per sample) for the fast test suite.  Integer inputs
(token ids, attention masks) are int64 and are fed values in [0, 10); masks
treat 0 as padding.  An entry TVM cannot import would be ``expect="unsupported"``
(the LSTM and GRU nets were, until passes/onnx_rnn.py unrolled them).
"""

from __future__ import annotations

from functools import partial
from typing import Callable

from torch import nn

from .classic_cnn import convnext, densenet, groupnorm_net, multi_io, resnext
from .conv_nd import resnet3d, wav_conv1d
from .dense_pred import deeplab_aspp, espcn, unet
from .mobile_cnn import efficientnet_b0, mobilenet_v3, shufflenet_v2, squeezenet
from .seq import bert, gpt, gru_tagger, lstm_classifier
from .spec import ModelSpec, TensorSpec
from .vit_family import mlp_mixer, mobilevit_like, swin_tiny_window, vit

__all__ = ["CORPUS"]

Factory = Callable[[], nn.Module]


def _img(*shape: int) -> tuple[TensorSpec, ...]:
    return (TensorSpec("input", tuple(shape)),)


def _tokens(seq: int, mask: bool = False) -> tuple[TensorSpec, ...]:
    ids = (TensorSpec("input_ids", (seq,), "int64"),)
    return ids + ((TensorSpec("attention_mask", (seq,), "int64"),) if mask else ())


def _entry(
    name: str,
    kind: str,
    full: tuple[Factory, tuple[TensorSpec, ...], str],
    small: tuple[Factory, tuple[TensorSpec, ...], str],
    outputs: tuple[str, ...] = ("output",),
    expect: str = "build",
) -> ModelSpec:
    """A full-size spec whose ``small`` is the same architecture at CI size."""
    sf, si, sd = small
    small_spec = ModelSpec(name=name, factory=sf, inputs=si, description=sd, kind=kind, expect=expect, outputs=outputs)
    ff, fi, fd = full
    return ModelSpec(
        name=name, factory=ff, inputs=fi, description=fd, kind=kind, small=small_spec, expect=expect, outputs=outputs
    )


CORPUS: tuple[ModelSpec, ...] = (
    # ------------------------------------------------------------------ CNNs
    _entry(
        "mobilenet_v3", "cnn",
        (mobilenet_v3, _img(3, 224, 224),
         "MobileNetV3-Small: inverted residuals, depthwise conv, SE, hard-swish/hard-sigmoid (1000 classes)"),
        (partial(mobilenet_v3, width_mult=0.5, last_channel=256, num_classes=10), _img(3, 64, 64),
         "MobileNetV3-Small x0.5 on 64x64 (10 classes)"),
    ),
    _entry(
        "efficientnet_b0", "cnn",
        (efficientnet_b0, _img(3, 224, 224), "EfficientNet-B0: MBConv with SiLU and squeeze-excitation (1000 classes)"),
        (partial(efficientnet_b0, width_mult=0.25, depth_mult=0.25, num_classes=10), _img(3, 64, 64),
         "EfficientNet-B0 layout, width 0.25, one MBConv per stage, 64x64 (10 classes)"),
    ),
    _entry(
        "resnext", "cnn",
        (resnext, _img(3, 224, 224), "ResNeXt-50 32x4d: bottlenecks with grouped 3x3 convolutions (1000 classes)"),
        (partial(resnext, layers=(1, 1, 1, 1), planes=(16, 32, 64, 128), groups=4, base_width=16, stem=16,
                 num_classes=10), _img(3, 64, 64),
         "ResNeXt 4x4d-style bottlenecks (grouped 3x3), one per stage, 64x64 (10 classes)"),
    ),
    _entry(
        "shufflenet_v2", "cnn",
        (shufflenet_v2, _img(3, 224, 224), "ShuffleNetV2 x1.0: channel split, channel shuffle, concat (1000 classes)"),
        (partial(shufflenet_v2, stages_repeats=(2, 2, 2), stages_out_channels=(24, 48, 96, 192, 256),
                 num_classes=10), _img(3, 64, 64),
         "ShuffleNetV2 x0.5, two units per stage, 64x64 (10 classes)"),
    ),
    _entry(
        "convnext", "cnn",
        (convnext, _img(3, 224, 224),
         "ConvNeXt-T: 7x7 depthwise conv, channel LayerNorm, Linear-GELU-Linear, layer scale (1000 classes)"),
        (partial(convnext, depths=(1, 1, 1, 1), dims=(16, 32, 64, 128), num_classes=10), _img(3, 64, 64),
         "ConvNeXt, one block per stage, dims 16-128, 64x64 (10 classes)"),
    ),
    _entry(
        "deeplab_aspp", "cnn",
        (deeplab_aspp, _img(3, 256, 256),
         "DeepLabV3-style segmentation: dilated ResNet-18 (OS16), ASPP 6/12/18, bilinear upsampling (21 classes)"),
        (partial(deeplab_aspp, image_size=64, widths=(8, 16, 24, 32), blocks=(1, 1, 1, 1), output_stride=8,
                 aspp_channels=32), _img(3, 64, 64),
         "DeepLabV3-style, narrow dilated backbone (OS8), ASPP 6/12/18, 64x64 (21 classes)"),
    ),
    _entry(
        "unet", "cnn",
        (unet, _img(3, 256, 256),
         "U-Net (widths 32-512): skip concats, ConvTranspose2d and nearest-Upsample decoder levels (3 classes)"),
        (partial(unet, widths=(8, 16, 32, 64)), _img(3, 32, 32), "U-Net, widths 8-64, three levels, 32x32 (3 classes)"),
    ),
    _entry(
        "squeezenet", "cnn",
        (squeezenet, _img(3, 224, 224),
         "SqueezeNet 1.1: fire modules, ceil-mode max-pool, conv classifier (1000 classes)"),
        (partial(squeezenet, width=0.25, num_classes=10), _img(3, 64, 64),
         "SqueezeNet 1.1 at quarter width, 64x64 (10 classes)"),
    ),
    _entry(
        "densenet", "cnn",
        (densenet, _img(3, 224, 224),
         "DenseNet-121: dense blocks (concat growth 32), BN-ReLU-Conv, avg-pool transitions (1000 classes)"),
        (partial(densenet, growth=8, blocks=(2, 2, 2, 2), init_features=16, num_classes=10), _img(3, 64, 64),
         "DenseNet, growth 8, two layers per block, 64x64 (10 classes)"),
    ),
    _entry(
        "groupnorm_net", "cnn",
        (groupnorm_net, _img(3, 128, 128),
         "Diffusion-UNet-style GroupNorm/SiLU residual stack, InstanceNorm2d(affine) stem, 128x128 (1000 classes)"),
        (partial(groupnorm_net, channels=(8, 16, 32), blocks_per_stage=1, groups=4, num_classes=10), _img(3, 32, 32),
         "GroupNorm residual stack, widths 8-32, 32x32 (10 classes)"),
    ),
    _entry(
        "multi_io", "cnn",
        (multi_io, (TensorSpec("image", (3, 224, 224)), TensorSpec("meta", (16,))),
         "Two inputs (image, 16-d metadata), two outputs: class logits (1000) and a sigmoid box [4]"),
        (partial(multi_io, channels=(8, 16, 32), meta_hidden=16, fused=32, num_classes=10),
         (TensorSpec("image", (3, 32, 32)), TensorSpec("meta", (16,))),
         "Two-input/two-output net, narrow backbone, 32x32 (10 classes + box)"),
        outputs=("logits", "boxes"),
    ),
    _entry(
        "resnet3d", "cnn",
        (resnet3d, _img(3, 16, 112, 112),
         "R3D-18-style video ResNet at half width: Conv3d/BatchNorm3d, 16x112x112 clips (400 classes)"),
        (partial(resnet3d, widths=(8, 16, 32, 64), blocks=(1, 1, 1, 1), num_classes=10), _img(3, 4, 32, 32),
         "3D ResNet, one block per stage, 4x32x32 clips (10 classes)"),
    ),
    _entry(
        "wav_conv1d", "cnn",
        (wav_conv1d, _img(1, 16000),
         "Raw-waveform audio classifier: wav2vec-style strided Conv1d-BN-GELU stack, time mean (35 classes)"),
        (partial(wav_conv1d, channels=32, num_classes=10), _img(1, 4000),
         "Conv1d waveform classifier, 32 channels, 4000 samples (10 classes)"),
    ),
    _entry(
        "espcn", "cnn",
        (espcn, _img(3, 224, 224), "ESPCN super-resolution x3: Conv-tanh stack, PixelShuffle (3x224x224 -> 3x672x672)"),
        (partial(espcn, f1=16, f2=8), _img(3, 32, 32), "ESPCN x3, 16/8 filters, 3x32x32 -> 3x96x96"),
    ),
    # ------------------------------------------------------------------ transformers
    _entry(
        "vit", "transformer",
        (vit, _img(3, 224, 224),
         "ViT/16: patch conv, class token, learned positions, 6 pre-norm blocks, dim 384, 6 heads (1000 classes)"),
        (partial(vit, image_size=32, patch_size=8, dim=64, depth=2, num_heads=2, num_classes=10), _img(3, 32, 32),
         "ViT, 8x8 patches on 32x32, dim 64, 2 blocks, 2 heads (10 classes)"),
    ),
    _entry(
        "swin_tiny_window", "transformer",
        (swin_tiny_window, _img(3, 224, 224),
         "Swin-T-style window attention (7x7 windows, shifted every 2nd block), relative position bias (1000 classes)"),
        (partial(swin_tiny_window, image_size=32, patch_size=2, dim=16, depths=(2, 2), heads=(2, 4), window=4,
                 num_classes=10), _img(3, 32, 32),
         "Swin-style window attention, 4x4 windows, two stages, dim 16, 32x32 (10 classes)"),
    ),
    _entry(
        "mobilevit_like", "transformer",
        (mobilevit_like, _img(3, 256, 256),
         "MobileViT-XXS-style hybrid: MV2 conv blocks + transformers over 2x2-unfolded patches (1000 classes)"),
        (partial(mobilevit_like, image_size=64, stem=8, mv2=((8, 1), (16, 2), (16, 1)),
                 stages=((24, 32, 1), (32, 48, 1), (40, 48, 1)), last=160, num_classes=10), _img(3, 64, 64),
         "MobileViT-style hybrid, narrow, one transformer layer per stage, 64x64 (10 classes)"),
    ),
    _entry(
        "bert", "transformer",
        (bert, _tokens(128, mask=True),
         "BERT-style post-LN encoder: seq 128, dim 256, 4 layers, 4 heads, padding mask, tanh pooler (vocab 1000)"),
        (partial(bert, vocab=100, seq_len=16, dim=64, depth=2, num_heads=2, ffn=256), _tokens(16, mask=True),
         "BERT-style encoder: seq 16, dim 64, 2 layers, 2 heads (vocab 100)"),
        outputs=("last_hidden_state", "pooled"),
    ),
    _entry(
        "gpt", "transformer",
        (gpt, _tokens(128),
         "GPT-style decoder: seq 128, dim 256, 4 layers, RoPE, RMSNorm, SwiGLU, causal mask, tied head (vocab 1000)"),
        (partial(gpt, vocab=100, seq_len=16, dim=64, depth=2, num_heads=2, hidden=176), _tokens(16),
         "GPT-style decoder: seq 16, dim 64, 2 layers (vocab 100)"),
        outputs=("logits",),
    ),
    # ------------------------------------------------------------------ RNNs (unrolled: passes/onnx_rnn.py)
    _entry(
        "lstm_classifier", "rnn",
        (lstm_classifier, _tokens(64), "Embedding + 2-layer LSTM (hidden 256) + Linear on the last step (5 classes)"),
        (partial(lstm_classifier, vocab=100, embed=16, hidden=32), _tokens(16),
         "Embedding + 2-layer LSTM (hidden 32), seq 16 (5 classes)"),
    ),
    _entry(
        "gru_tagger", "rnn",
        (gru_tagger, _img(100, 40),
         "2-layer bidirectional GRU (hidden 128) tagger on [100, 40] features (12 tags per step)"),
        (partial(gru_tagger, features=8, hidden=16), _img(16, 8), "2-layer bidirectional GRU (hidden 16) on [16, 8]"),
    ),
    # ------------------------------------------------------------------ other
    _entry(
        "mlp_mixer", "other",
        (mlp_mixer, _img(3, 224, 224), "MLP-Mixer-S/16: token mixing (transpose + MLP), channel mixing, LayerNorm"),
        (partial(mlp_mixer, image_size=32, patch_size=4, dim=64, depth=2, token_hidden=32, channel_hidden=128,
                 num_classes=10), _img(3, 32, 32),
         "MLP-Mixer, 4x4 patches on 32x32, dim 64, 2 blocks (10 classes)"),
    ),
)
