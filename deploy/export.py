"""Stage 1, export: a PyTorch model (registry name + seed or checkpoint) or a
user's ONNX file -> a checked ONNX file with a dynamic batch dimension."""

from __future__ import annotations

import dataclasses
import logging
import shutil
from pathlib import Path

from . import artifacts
from .config import Config, InputSpec
from .errors import ConfigError, InputFileError, ShapeError

log = logging.getLogger(__name__)
STAGE = "export"
ONNX_FILE = "model.onnx"

_ONNX_DTYPES = {1: "float32", 10: "float16", 7: "int64", 6: "int32", 9: "bool", 11: "float64"}


@dataclasses.dataclass(frozen=True)
class ExportArtifact:
    folder: Path
    onnx_path: Path
    inputs: tuple[InputSpec, ...]  # per-sample shapes (batch excluded)
    outputs: tuple[str, ...]
    manifest: dict


def is_onnx_source(source: str) -> bool:
    return source.endswith(".onnx") or "/" in source or "\\" in source


def run(cfg: Config, folder: Path) -> ExportArtifact:
    with artifacts.staged_dir(folder) as tmp:
        if is_onnx_source(cfg.model.source):
            inputs, origin = _copy_onnx(cfg, tmp / ONNX_FILE)
        else:
            inputs, origin = _export_registry(cfg, tmp / ONNX_FILE)
        model = load_onnx(tmp / ONNX_FILE)
        outputs = tuple(o.name for o in model.graph.output)
        artifacts.write_manifest(
            tmp,
            STAGE,
            {
                "model": cfg.model.name,
                "origin": origin,
                "opset": max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=0),
                "inputs": [dataclasses.asdict(i) for i in inputs],
                "outputs": list(outputs),
            },
        )
    log.info("export: wrote %s", folder / ONNX_FILE)
    return load(folder)


def load(folder: Path) -> ExportArtifact:
    m = artifacts.read_manifest(folder, STAGE)
    inputs = tuple(InputSpec(i["name"], tuple(i["shape"]), i["dtype"]) for i in m["inputs"])
    return ExportArtifact(Path(folder), Path(folder) / ONNX_FILE, inputs, tuple(m["outputs"]), m)


def load_onnx(path: Path):
    """Load and check an ONNX file; any problem is one InputFileError line."""
    import onnx

    path = Path(path)
    if not path.is_file():
        raise InputFileError("ONNX file not found", str(path))
    try:
        model = onnx.load(str(path))
        onnx.checker.check_model(model)
    except Exception as e:  # protobuf DecodeError, ValidationError, ...
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise InputFileError(f"corrupt or invalid ONNX file {path}", first[:200]) from None
    return model


def _export_registry(cfg: Config, dest: Path) -> tuple[tuple[InputSpec, ...], dict]:
    import models
    import torch

    try:
        spec = models.get(cfg.model.source)
    except KeyError as e:
        raise ConfigError(str(e.args[0])) from None
    inputs = (InputSpec("input", tuple(spec.input_shape), spec.input_dtype),)
    if cfg.model.inputs and cfg.model.inputs != inputs:
        raise ShapeError(
            f"config inputs do not match registry model '{spec.name}'",
            [dataclasses.asdict(i) for i in cfg.model.inputs],
            [dataclasses.asdict(i) for i in inputs],
        )
    model = build_torch_model(cfg)
    example = torch.randn(2, *spec.input_shape)
    torch.onnx.export(
        model,
        (example,),
        str(dest),
        opset_version=cfg.model.opset,
        dynamo=False,  # the dynamo exporter needs onnxscript and is not what TVM's importer is tested with
        input_names=["input"],
        output_names=["output"],
        dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}},
        do_constant_folding=True,
    )
    origin = {"kind": "registry", "name": spec.name, "seed": cfg.model.seed, "checkpoint": cfg.model.checkpoint}
    if cfg.model.checkpoint:
        origin["checkpoint_sha256"] = artifacts.sha256_file(cfg.model.checkpoint)
    return inputs, origin


def build_torch_model(cfg: Config):
    """The registry model with the config's seed or checkpoint (also used by
    validation to compare against PyTorch on the same weights)."""
    import models

    try:
        return models.build(cfg.model.source, seed=cfg.model.seed, checkpoint=cfg.model.checkpoint or None)
    except FileNotFoundError as e:
        raise InputFileError("checkpoint not found", cfg.model.checkpoint or str(e)) from None
    except ValueError as e:
        raise InputFileError(str(e).splitlines()[0]) from None
    except KeyError as e:
        raise ConfigError(str(e.args[0])) from None


def _copy_onnx(cfg: Config, dest: Path) -> tuple[tuple[InputSpec, ...], dict]:
    src = Path(cfg.model.source)
    model = load_onnx(src)
    init_names = {i.name for i in model.graph.initializer}
    graph_inputs = [i for i in model.graph.input if i.name not in init_names]
    declared = {i.name: i for i in cfg.model.inputs}
    names = [i.name for i in graph_inputs]
    if not cfg.model.inputs:
        raise ConfigError(
            "an ONNX model needs its inputs in the config ([[model.inputs]] or --input NAME:SHAPE)",
            None,
            "inputs " + ", ".join(names),
        )
    if set(declared) != set(names):
        raise ShapeError("config input names do not match the ONNX graph", sorted(declared), sorted(names))
    inputs = []
    for gi in graph_inputs:
        want = declared[gi.name]
        tt = gi.type.tensor_type
        dtype = _ONNX_DTYPES.get(tt.elem_type, f"onnx-type-{tt.elem_type}")
        if dtype != want.dtype:
            raise ShapeError(f"dtype of input '{gi.name}' does not match the ONNX graph", want.dtype, dtype)
        dims = [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim]
        if len(dims) != len(want.shape) + 1:
            raise ShapeError(
                f"rank of input '{gi.name}' does not match the ONNX graph (config shapes exclude the batch dim)",
                [None, *want.shape],
                dims,
            )
        for axis, (d, w) in enumerate(zip(dims[1:], want.shape), start=1):
            if d is not None and d != w:
                raise ShapeError(f"dim {axis} of input '{gi.name}' does not match the ONNX graph", w, d)
        inputs.append(want)
    shutil.copyfile(src, dest)
    return tuple(inputs), {"kind": "onnx", "path": str(src.resolve()), "sha256": artifacts.sha256_file(src)}
