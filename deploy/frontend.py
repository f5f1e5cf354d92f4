"""Stage 2, frontend: ONNX -> one Relax module per batch bucket, with static
input shapes. Unsupported operators are reported all at once, with counts."""

from __future__ import annotations

import collections
import dataclasses
import logging
from pathlib import Path

from . import artifacts
from .config import Profile
from .errors import UnsupportedOperatorError
from .export import ExportArtifact, load_onnx

log = logging.getLogger(__name__)
STAGE = "frontend"


@dataclasses.dataclass(frozen=True)
class FrontendArtifact:
    folder: Path
    modules: dict[int, Path]  # bucket -> Relax module (tvm JSON)
    manifest: dict

    def load_module(self, bucket: int):
        from .tvm_compat import load_json

        return load_json(self.modules[bucket].read_text())


def onnx_op_histogram(graph) -> collections.Counter:
    """(domain, op_type) counts, subgraphs (If/Loop bodies) included."""
    counts: collections.Counter = collections.Counter()
    for node in graph.node:
        counts[(node.domain or "ai.onnx", node.op_type)] += 1
        for attr in node.attribute:
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                counts.update(onnx_op_histogram(sub))
    return counts


def unsupported_ops(histogram: collections.Counter) -> dict[str, int]:
    from .tvm_compat import onnx_frontend

    supported = set(onnx_frontend._get_convert_map())
    out = {}
    for (domain, op), n in sorted(histogram.items()):
        if domain not in ("ai.onnx", "") or op not in supported:
            out[op if domain in ("ai.onnx", "") else f"{domain}.{op}"] = n
    return out


def run(profile: Profile, exported: ExportArtifact, folder: Path) -> FrontendArtifact:
    from .tvm_compat import from_onnx, save_json

    model = load_onnx(exported.onnx_path)
    hist = onnx_op_histogram(model.graph)
    missing = unsupported_ops(hist)
    if missing:
        listed = ", ".join(f"{op} x{n}" for op, n in missing.items())
        raise UnsupportedOperatorError(
            f"{len(missing)} ONNX operator type(s) are not supported by TVM's ONNX frontend: {listed}"
        )
    with artifacts.staged_dir(folder) as tmp:
        files = {}
        for bucket in profile.buckets:
            shapes = {i.name: [bucket, *i.shape] for i in exported.inputs}
            dtypes = {i.name: i.dtype for i in exported.inputs}
            mod = from_onnx(model, shape_dict=shapes, dtype_dict=dtypes, keep_params_in_input=False)
            name = f"b{bucket}.relax.json"
            (tmp / name).write_text(save_json(mod))
            files[bucket] = name
            log.info("frontend: bucket %d imported", bucket)
        artifacts.write_manifest(
            tmp,
            STAGE,
            {
                "onnx_sha256": artifacts.sha256_file(exported.onnx_path),
                "buckets": {str(b): f for b, f in files.items()},
                "onnx_ops": {f"{d}:{op}" if d != "ai.onnx" else op: n for (d, op), n in sorted(hist.items())},
            },
        )
    return load(folder, exported)


def load(folder: Path, exported: ExportArtifact | None = None) -> FrontendArtifact:
    m = artifacts.read_manifest(folder, STAGE)
    if exported is not None and m["onnx_sha256"] != artifacts.sha256_file(exported.onnx_path):
        from .errors import StaleArtifactError

        raise StaleArtifactError("frontend artifact was made from another ONNX file (re-run the frontend stage)", str(folder))
    modules = {int(b): Path(folder) / f for b, f in m["buckets"].items()}
    return FrontendArtifact(Path(folder), modules, m)
