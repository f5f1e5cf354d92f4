"""The registry's record of one model: its factory, inputs and variants."""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from torch import nn

SIZES = ("full", "small")


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One model input: the shape of ONE sample (the batch dim comes first, at run time)."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"  # integer inputs (token ids, masks) get values in [0, 10)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    factory: Callable[[], nn.Module]
    inputs: tuple[TensorSpec, ...]
    description: str  # one line
    # The architecture family the corpus table groups by (cnn, transformer, rnn, ...).
    kind: str = "cnn"
    # A smaller variant (narrower, smaller spatial size) that the test suite
    # runs through every stage on the 2-core CI machine; None = same as full.
    small: Optional["ModelSpec"] = None
    # What the pipeline is expected to do with it: "build", or "unsupported"
    # where TVM's ONNX frontend lacks an operator (the one-line error is the outcome).
    expect: str = "build"
    outputs: tuple[str, ...] = ("output",)

    @property
    def input_shape(self) -> tuple[int, ...]:
        return self.inputs[0].shape

    @property
    def input_dtype(self) -> str:
        return self.inputs[0].dtype

    def sized(self, size: str = "full") -> "ModelSpec":
        if size not in SIZES:
            raise ValueError(f"unknown model size {size!r} | expected one of {', '.join(SIZES)}")
        return self.small if size == "small" and self.small is not None else self
