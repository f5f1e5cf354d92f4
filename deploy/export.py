"""Stage 1, export: a PyTorch model (registry name + seed or checkpoint) or a
user's ONNX file -> a checked ONNX file with a dynamic batch dimension.

The ONNX file is saved with its weights inline when it fits protobuf's 2 GB
(external data, what torch's dynamo exporter writes, is read back in), else
with one external data file beside it (`model.onnx.data`); both are hashed in
the manifest. A user's graph whose batch is fixed (no `dynamic_axes`) gets a
symbolic batch when ONNX Runtime shows that the graph allows it (a batch of 3
gives each row what it gives alone); otherwise the manifest records the fixed
batch and the pipeline refuses other buckets in one line."""

from __future__ import annotations

import dataclasses
import functools
import logging
import tempfile
from pathlib import Path

from . import artifacts
from .config import Config, DimSpec, InputSpec, Profile, check_dims
from .errors import ConfigError, InputFileError, ShapeError
from .passes import onnx_indices

log = logging.getLogger(__name__)
STAGE = "export"
ONNX_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"
PROTOBUF_LIMIT = 2**31 - 1

_ONNX_DTYPES = {1: "float32", 10: "float16", 7: "int64", 6: "int32", 9: "bool", 11: "float64"}


@dataclasses.dataclass(frozen=True)
class ExportArtifact:
    folder: Path
    onnx_path: Path
    inputs: tuple[InputSpec, ...]  # per-sample shapes (batch excluded)
    outputs: tuple[str, ...]
    manifest: dict

    @property
    def dims(self) -> tuple[DimSpec, ...]:
        """Dimensions besides the batch with buckets of their own."""
        from .shapes import dims_from_manifest

        return dims_from_manifest(self.manifest.get("dims"))

    def buckets(self, profile: Profile) -> list:
        """The profile's buckets of this model (shapes.Bucket, in order)."""
        from .shapes import all_buckets

        return all_buckets(profile, self.dims)

    def bucket_inputs(self, bucket) -> tuple[InputSpec, ...]:
        """The inputs' per-sample shapes in one bucket."""
        from .shapes import input_specs

        return input_specs(self.inputs, self.dims, bucket)

    @functools.cached_property
    def index_ranges(self) -> dict[str, tuple[int, int]]:
        """{integer input that indexes a table: (lowest, one past the highest)
        value} (passes/onnx_indices.py), read from the graph where the export
        predates their record."""
        ranges = self.manifest.get("index_ranges")
        if ranges is None:
            return onnx_indices.input_ranges(load_onnx(self.onnx_path))
        return {k: (int(v[0]), int(v[1])) for k, v in ranges.items()}

    def random_specs(self, bucket) -> list[tuple]:
        """(per-sample shape, dtype, the range of the table it indexes or None)
        of each input in one bucket: what runtime.random_inputs takes."""
        return [(i.shape, i.dtype, self.index_ranges.get(i.name)) for i in self.bucket_inputs(bucket)]

    @property
    def fixed_batch(self) -> int | None:
        """The batch size the graph is fixed to (None: any batch)."""
        return self.manifest.get("fixed_batch")


def is_onnx_source(source: str) -> bool:
    return source.endswith(".onnx") or "/" in source or "\\" in source


def run(cfg: Config, folder: Path) -> ExportArtifact:
    with artifacts.staged_dir(folder) as tmp:
        fixed_batch = None
        if is_onnx_source(cfg.model.source):
            inputs, origin, fixed_batch = _copy_onnx(cfg, tmp / ONNX_FILE)
        else:
            inputs, origin = _export_registry(cfg, tmp / ONNX_FILE)
        model = load_onnx(tmp / ONNX_FILE)
        outputs = tuple(o.name for o in model.graph.output)
        ranges = onnx_indices.input_ranges(model)
        _check_pads(cfg.model.dims, ranges)
        artifacts.write_manifest(
            tmp,
            STAGE,
            {
                "model": cfg.model.name,
                "origin": origin,
                "opset": max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=0),
                "inputs": [dataclasses.asdict(i) for i in inputs],
                "outputs": list(outputs),
                "fixed_batch": fixed_batch,
                "dims": [dataclasses.asdict(d) for d in cfg.model.dims],
                "external_data": (tmp / DATA_FILE).is_file(),
                # integer inputs that index a table, and the values they may take (passes/onnx_indices.py)
                "index_ranges": {k: list(v) for k, v in ranges.items()},
            },
        )
    log.info("export: wrote %s", folder / ONNX_FILE)
    return load(folder)


def _check_pads(dims, ranges: dict) -> None:
    """A dimension's padding value, written into the inputs that carry it
    (all but its mask), must be a row of each table those inputs index."""
    for d in dims:
        for name in d.inputs:
            if name in ranges and name != d.mask and not (ranges[name][0] <= d.pad < ranges[name][1]):
                lo, hi = ranges[name]
                raise ConfigError(f"model.dims '{d.name}': pad {d.pad:g} is outside the table input '{name}' indexes",
                                  d.pad, f"{lo} <= pad < {hi} (a token id, e.g. the tokenizer's padding id)")


def load(folder: Path) -> ExportArtifact:
    m = artifacts.read_manifest(folder, STAGE)
    inputs = tuple(InputSpec(i["name"], tuple(i["shape"]), i["dtype"]) for i in m["inputs"])
    return ExportArtifact(Path(folder), Path(folder) / ONNX_FILE, inputs, tuple(m["outputs"]), m)


def load_onnx(path: Path):
    """Load and check an ONNX file, with its external data (read from beside
    it); any problem is one InputFileError line."""
    import onnx

    path = Path(path)
    if not path.is_file():
        raise InputFileError("ONNX file not found", str(path))
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # protobuf DecodeError, ...
        raise InputFileError(f"corrupt or invalid ONNX file {path}", _first_line(e)) from None
    missing = sorted(_missing_external_data(model, path.parent))
    if missing:
        raise InputFileError(f"the external data of ONNX file {path} is missing (keep it beside the .onnx file)",
                             ", ".join(missing[:3]))
    try:
        onnx.load_external_data_for_model(model, str(path.parent))
        # The checker takes a path for models over 2 GB (and reads their data from disk).
        onnx.checker.check_model(str(path) if model.ByteSize() > PROTOBUF_LIMIT else model)
    except Exception as e:  # ValidationError, ...
        raise InputFileError(f"corrupt or invalid ONNX file {path}", _first_line(e)) from None
    return model


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


def _missing_external_data(model, folder: Path) -> set[str]:
    from onnx.external_data_helper import uses_external_data

    out = set()
    for t in model.graph.initializer:
        if uses_external_data(t):
            loc = next((e.value for e in t.external_data if e.key == "location"), "")
            if not (folder / loc).is_file():
                out.add(loc)
    return out


def save_onnx(model, dest: Path) -> None:
    """Save inline when it fits protobuf's limit, else with one external data file."""
    import onnx

    dest = Path(dest)
    if model.ByteSize() <= PROTOBUF_LIMIT:
        onnx.save(model, str(dest))
    else:
        onnx.save(model, str(dest), save_as_external_data=True, all_tensors_to_one_file=True, location=DATA_FILE)


def _export_registry(cfg: Config, dest: Path) -> tuple[tuple[InputSpec, ...], dict]:
    import torch

    import models

    try:
        spec = models.get(cfg.model.source).sized(cfg.model.size)
    except KeyError as e:
        raise ConfigError(str(e.args[0])) from None
    inputs = tuple(InputSpec(t.name, tuple(t.shape), t.dtype) for t in spec.inputs)
    if cfg.model.inputs and cfg.model.inputs != inputs:
        raise ShapeError(
            f"config inputs do not match registry model '{spec.name}'",
            [dataclasses.asdict(i) for i in cfg.model.inputs],
            [dataclasses.asdict(i) for i in inputs],
        )
    dims = cfg.model.dims
    check_dims(dims, inputs)
    for d in dims:
        unknown = [o for o in d.outputs if o not in spec.outputs]
        if unknown:
            raise ConfigError(f"dimension '{d.name}' names outputs the model does not have", unknown,
                              ", ".join(spec.outputs))
    model = build_torch_model(cfg)
    example = tuple(example_inputs(inputs, batch=2))
    names = [i.name for i in inputs]
    outputs = list(spec.outputs)
    axes = {n: {0: "batch"} for n in names + outputs}
    for d in dims:
        for n in (*d.inputs, *d.outputs):
            axes[n][d.axis] = d.name
    if cfg.model.exporter == "dynamo":
        batch = torch.export.Dim("batch", min=1, max=4096)
        named = {d.name: torch.export.Dim(d.name, min=1, max=max(d.buckets)) for d in dims}
        sig = _forward_params(model, len(names))
        with tempfile.TemporaryDirectory() as d:  # the dynamo exporter may write external data beside its file
            raw = Path(d) / ONNX_FILE
            torch.onnx.export(
                model, example, str(raw), dynamo=True, opset_version=max(cfg.model.opset, 18),
                input_names=names, output_names=outputs,
                dynamic_shapes={p: {a: batch if v == "batch" else named[v] for a, v in axes[n].items()}
                                for p, n in zip(sig, names)},
                external_data=True,
            )
            save_onnx(load_onnx(raw), dest)
    else:
        torch.onnx.export(
            model,
            example,
            str(dest),
            opset_version=cfg.model.opset,
            dynamo=False,
            input_names=names,
            output_names=outputs,
            dynamic_axes=axes,
            do_constant_folding=True,
        )
    origin = {"kind": "registry", "name": spec.name, "seed": cfg.model.seed, "checkpoint": cfg.model.checkpoint,
              "size": cfg.model.size, "exporter": cfg.model.exporter}
    if cfg.model.checkpoint:
        origin["checkpoint_sha256"] = artifacts.sha256_file(cfg.model.checkpoint)
    return inputs, origin


def _forward_params(model, n: int) -> list[str]:
    import inspect

    params = [p for p in inspect.signature(model.forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return [p.name for p in params[:n]]


def example_inputs(inputs, batch: int, seed: int = 0):
    """Seeded torch tensors for `inputs`: the package's own random inputs
    (runtime.random_inputs: floats standard normal, integers in [0, 10))."""
    import torch

    from .runtime import random_inputs

    return [torch.from_numpy(a) for a in random_inputs([(i.shape, i.dtype) for i in inputs], batch, seed)]


def build_torch_model(cfg: Config):
    """The registry model with the config's seed or checkpoint (also used by
    validation to compare against PyTorch on the same weights)."""
    import models

    try:
        return models.build(cfg.model.source, seed=cfg.model.seed, checkpoint=cfg.model.checkpoint or None,
                            size=cfg.model.size)
    except FileNotFoundError as e:
        raise InputFileError("checkpoint not found", cfg.model.checkpoint or str(e)) from None
    except ValueError as e:
        raise InputFileError(str(e).splitlines()[0]) from None
    except KeyError as e:
        raise ConfigError(str(e.args[0])) from None


def _graph_inputs(graph_inputs, cfg: Config) -> tuple[InputSpec, ...]:
    """Inputs the config leaves out, read from the graph where each input's
    shape past the batch is fixed there (what torch.onnx.export writes
    without dynamic_axes, or with only the batch dynamic). One line naming
    the input where the graph cannot say."""
    from onnx import TensorProto

    names = ", ".join(i.name for i in graph_inputs)
    hint = "[[model.inputs]] or --input NAME:SHAPE for each of its inputs: " + names
    if not graph_inputs:
        raise ConfigError("the ONNX graph has no inputs (every graph input is an initializer)")
    if cfg.model.dims:
        raise ConfigError("an ONNX model with [[model.dims]] needs its inputs in the config too", None, hint)
    out = []
    for gi in graph_inputs:
        tt = gi.type.tensor_type
        if tt.elem_type not in _ONNX_DTYPES:
            raise ShapeError(f"ONNX input '{gi.name}' has an element type the pipeline does not take",
                             TensorProto.DataType.Name(tt.elem_type), ", ".join(sorted(set(_ONNX_DTYPES.values()))))
        dims = [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None for d in tt.shape.dim]
        if not dims:
            raise ShapeError(f"ONNX input '{gi.name}' is a scalar: it has no batch axis", "rank 0", "rank 1 or more")
        if None in dims[1:]:
            shown = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in tt.shape.dim]
            raise ConfigError(f"ONNX input '{gi.name}' leaves a shape past the batch open: give the model's inputs in "
                              f"the config", shown, hint)
        out.append(InputSpec(gi.name, tuple(dims[1:]), _ONNX_DTYPES[tt.elem_type]))
    log.info("export: inputs read from the graph (per sample): %s",
             ", ".join(f"{i.name} [{', '.join(map(str, i.shape))}] {i.dtype}" for i in out))
    return tuple(out)


def _copy_onnx(cfg: Config, dest: Path) -> tuple[tuple[InputSpec, ...], dict, int | None]:
    src = Path(cfg.model.source)
    model = load_onnx(src)
    init_names = {i.name for i in model.graph.initializer}
    graph_inputs = [i for i in model.graph.input if i.name not in init_names]
    declared = {i.name: i for i in (cfg.model.inputs or _graph_inputs(graph_inputs, cfg))}
    names = [i.name for i in graph_inputs]
    if set(declared) != set(names):
        raise ShapeError("config input names do not match the ONNX graph", sorted(declared), sorted(names))
    outs = [o.name for o in model.graph.output]
    for d in cfg.model.dims:
        unknown = [o for o in d.outputs if o not in outs]
        if unknown:
            raise ConfigError(f"dimension '{d.name}' names outputs the ONNX graph does not have", unknown, ", ".join(outs))
    inputs, batch_dims = [], set()
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
        free = {d.axis: d for d in cfg.model.dims if gi.name in d.inputs}
        for axis, (d, w) in enumerate(zip(dims[1:], want.shape), start=1):
            if axis in free:
                if d is not None and any(v != d for v in free[axis].buckets):
                    raise ShapeError(f"dim {axis} of input '{gi.name}' is fixed at {d} in the ONNX graph; dimension "
                                     f"'{free[axis].name}' needs it symbolic", list(free[axis].buckets), d)
                continue
            if d is not None and d != w:
                raise ShapeError(f"dim {axis} of input '{gi.name}' does not match the ONNX graph", w, d)
        batch_dims.add(dims[0])
        inputs.append(want)
    inputs = tuple(inputs)
    origin = {"kind": "onnx", "path": str(src.resolve()), "sha256": artifacts.sha256_file(src)}
    fixed = next(iter(batch_dims)) if batch_dims and None not in batch_dims else None
    if fixed is not None:
        if len(batch_dims) > 1:
            raise ShapeError("the ONNX graph's inputs have different fixed batch sizes", sorted(batch_dims))
        poly = symbolic_batch(model, inputs, fixed)
        if poly is not None:
            log.info("export: the graph's batch was fixed at %d; made symbolic (checked with ONNX Runtime)", fixed)
            model, origin["batch"], fixed = poly, f"made symbolic (was fixed at {fixed})", None
        else:
            log.warning("export: the graph's batch is fixed at %d and the graph does not allow another", fixed)
            origin["batch"] = f"fixed at {fixed}"
    save_onnx(model, dest)
    return inputs, origin, fixed


def symbolic_batch(model, inputs, fixed: int, trial: int = 3):
    """A copy of `model` whose inputs' and outputs' first dim is symbolic, if
    ONNX Runtime shows the graph allows it: a batch of `trial` rows gives, row
    by row, what each row gives alone. None when it does not (a reshape or a
    constant hard-codes the batch) or ONNX Runtime cannot run it."""
    import numpy as np
    import onnx
    import onnxruntime as ort

    from .runtime import random_inputs

    poly = onnx.ModelProto()
    poly.CopyFrom(model)
    for vi in list(poly.graph.input) + list(poly.graph.output):
        dims = vi.type.tensor_type.shape.dim
        if dims:
            dims[0].Clear()
            dims[0].dim_param = "batch"
    del poly.graph.value_info[:]  # inferred shapes that carry the old batch
    ranges = onnx_indices.input_ranges(model)  # (ids inside their tables)
    rows = [random_inputs([(i.shape, i.dtype, ranges.get(i.name)) for i in inputs], fixed, seed=s) for s in range(trial)]
    try:
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / ONNX_FILE
            save_onnx(poly, path)
            sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
            names = [i.name for i in inputs]
            alone = [sess.run(None, dict(zip(names, r))) for r in rows]
            together = sess.run(None, {n: np.concatenate([r[k] for r in rows]) for k, n in enumerate(names)})
    except Exception:  # noqa: BLE001 - ONNX Runtime refuses the batch: the graph fixes it
        return None
    for k, out in enumerate(together):
        want = np.concatenate([a[k] for a in alone])
        if out.shape != want.shape or not np.allclose(out, want, rtol=1e-4, atol=1e-5 * max(1.0, float(np.abs(want).max()))):
            return None
    return poly


def check_buckets(exported: ExportArtifact, buckets) -> None:
    """A graph with a fixed batch builds only that bucket: one line otherwise."""
    fixed = exported.fixed_batch
    if fixed is not None and any(b != fixed for b in buckets):
        raise ShapeError(
            f"the ONNX graph's batch is fixed at {fixed} (a reshape or constant in it hard-codes it)",
            f"buckets {','.join(map(str, buckets))}",
            f"BUCKETS={fixed} (--buckets {fixed}), or a model exported with a dynamic batch "
            "(torch.onnx.export dynamic_axes / dynamic_shapes)",
        )
