"""Stage 2, frontend: ONNX -> one Relax module per batch bucket, with static
input shapes. Unsupported operators are reported all at once, with counts.

Before import, each bucket's graph is simplified with onnxslim for its static
input shapes: shape computations (Shape -> Gather -> Concat -> Reshape, masks
broadcast from a computed shape) fold into constants, so TVM's importer sees
static shapes, and control flow that the static shapes decide folds away
(DeBERTa's two `If` nodes). Without it, TVM 0.27 refuses such graphs at import
(`emit_te now only supports Tensor that has ShapeExpr shape`, `Reshape expects
the input tensor to have known shape`). Then LSTM, GRU and RNN nodes, which
TVM's importer lacks, are unrolled into the operators they are made of
(passes/onnx_rnn.py). Operators TVM's importer still lacks after both are
reported, for that graph, in one line. The manifest records the node counts
before and after, and the nodes unrolled. The slimmed graph is checked like
any other: validation compares the package with the exported (unslimmed)
graph."""

from __future__ import annotations

import collections
import dataclasses
import logging
from pathlib import Path

from . import artifacts
from .config import Profile
from .errors import BuildError, UnsupportedOperatorError, error_line, run_in_processes
from .export import ExportArtifact, check_buckets, load_onnx
from .passes import onnx_rnn
from .shapes import Bucket, as_bucket, parse

log = logging.getLogger(__name__)
STAGE = "frontend"


@dataclasses.dataclass(frozen=True)
class FrontendArtifact:
    folder: Path
    modules: dict[Bucket, Path]  # bucket -> Relax module (tvm JSON)
    manifest: dict

    def load_module(self, bucket: Bucket | int):
        from .tvm_compat import load_json

        return load_json(self.modules[as_bucket(bucket)].read_text())


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


def _listed(missing: dict[str, int]) -> str:
    return ", ".join(f"{op} x{n}" for op, n in missing.items())


def simplify(model, inputs, batch: int, label: str | None = None):
    """(simplified model, what changed): onnxslim with every input's shape
    fixed for `batch` (`inputs`: the bucket's per-sample shapes). A simplification that fails leaves the graph as it is
    (the reason is recorded); the import then decides."""
    import onnxslim

    shapes = [f"{i.name}:{','.join(str(d) for d in (batch, *i.shape))}" for i in inputs]
    before = len(model.graph.node)
    try:
        slim = onnxslim.slim(model, input_shapes=shapes)
    except Exception as e:  # noqa: BLE001 - the import of the original graph is the fallback
        why = error_line(e, 200)
        log.warning("frontend: bucket %s: onnxslim failed (%s); importing the graph as exported", label or batch, why)
        return model, {"nodes_before": before, "nodes_after": before, "slim": f"failed: {why}"}
    if slim is None:
        return model, {"nodes_before": before, "nodes_after": before, "slim": "failed: no model returned"}
    return slim, {"nodes_before": before, "nodes_after": len(slim.graph.node), "slim": "ok"}


def _import_bucket(job) -> dict:
    """One bucket: the graph simplified for its static shapes, imported, saved
    (a process-pool entry as well; there `model` is None and is read again)."""
    from .tvm_compat import save_json

    model, onnx_path, inputs, bucket, out = job  # inputs: the bucket's per-sample shapes
    if model is None:
        model = load_onnx(Path(onnx_path))
    shapes = {i.name: [bucket.batch, *i.shape] for i in inputs}
    dtypes = {i.name: i.dtype for i in inputs}
    graph, changes = simplify(model, inputs, bucket.batch, bucket.label)
    graph, unrolled = onnx_rnn.decompose(graph, shapes)  # (TVM has no LSTM, GRU or RNN converter)
    if unrolled:
        changes["unrolled"] = unrolled
    missing = unsupported_ops(onnx_op_histogram(graph.graph))
    if missing:
        raise UnsupportedOperatorError(
            f"{len(missing)} ONNX operator type(s) are not supported by TVM's ONNX frontend: {_listed(missing)}"
        )
    Path(out).write_text(save_json(import_graph(graph, shapes, dtypes, bucket)))
    return changes


# A model this large (ResNet-50's 100 MB) takes seconds a bucket to simplify
# and import, so its buckets go to parallel processes where cores are spare;
# a small one is not worth a process's start (optimize uses the same rule).
PARALLEL_BYTES = 16 << 20


def parallel_workers(path: Path, jobs: int, threshold: int | None = None) -> int:
    """Processes for `jobs` per-bucket jobs over a file of that size: half
    this machine's cores at most, one for a small file or a 2-core machine."""
    import os

    size = sum(p.stat().st_size for p in Path(path).parent.glob(Path(path).name + "*"))  # with external data
    if jobs < 2 or size < (PARALLEL_BYTES if threshold is None else threshold):
        return 1
    return max(1, min(jobs, (os.cpu_count() or 1) // 2))


def run(profile: Profile, exported: ExportArtifact, folder: Path) -> FrontendArtifact:
    check_buckets(exported, profile.buckets)
    buckets = exported.buckets(profile)
    model = load_onnx(exported.onnx_path)
    hist = onnx_op_histogram(model.graph)
    onnx_rnn.check(model)
    missing = unsupported_ops(hist - onnx_rnn.decomposed_ops(model.graph))
    if missing:  # (decided per bucket, once onnxslim has folded what static shapes decide: DeBERTa's two If nodes)
        log.info("frontend: the graph as exported has %s; checked again in each bucket's simplified graph",
                 _listed(missing))
    workers = parallel_workers(exported.onnx_path, len(buckets))
    with artifacts.staged_dir(folder) as tmp:
        files = {b: f"b{b.label}.relax.json" for b in buckets}
        jobs = [(None if workers > 1 else model, str(exported.onnx_path), exported.bucket_inputs(b), b,
                 str(tmp / files[b])) for b in buckets]
        if workers > 1:
            log.info("frontend: %d buckets in %d processes", len(jobs), workers)
        simplified = {}
        for b, changes in zip(buckets, run_in_processes(_import_bucket, jobs, workers)):
            simplified[b.label] = changes
            log.info("frontend: bucket %s imported (onnxslim: %d -> %d nodes%s)", b,
                     changes["nodes_before"], changes["nodes_after"],
                     "".join(f"; {n} {op} unrolled" for op, n in changes.get("unrolled", {}).items()))
        artifacts.write_manifest(
            tmp,
            STAGE,
            {
                "onnx_sha256": artifacts.sha256_file(exported.onnx_path),
                "buckets": {b.label: f for b, f in files.items()},
                "onnx_ops": {f"{d}:{op}" if d != "ai.onnx" else op: n for (d, op), n in sorted(hist.items())},
                "simplified": simplified,
                "processes": workers,
            },
        )
    return load(folder, exported)


def import_graph(graph, shapes: dict, dtypes: dict, bucket):
    """TVM's ONNX importer; a failure inside it is one line naming the
    operator being converted (the importer's own trace goes to the log)."""
    import contextlib
    import io
    import re

    from .tvm_compat import from_onnx

    printed = io.StringIO()  # the importer prints the failing operator's inputs (IR) before it raises
    try:
        with contextlib.redirect_stdout(printed):
            return from_onnx(graph, shape_dict=shapes, dtype_dict=dtypes, keep_params_in_input=False)
    except Exception as e:  # noqa: BLE001 - reported as a BuildError with TVM's own line
        op = re.search(r"Error converting operator (\w+)", printed.getvalue())
        where = f" at operator {op.group(1)}" if op else ""
        raise BuildError(f"frontend: TVM's ONNX importer failed on bucket {bucket}{where}: {error_line(e)}") from e
    finally:
        if printed.getvalue().strip():
            log.debug("frontend: TVM's importer printed:\n%s", printed.getvalue())


def load(folder: Path, exported: ExportArtifact | None = None) -> FrontendArtifact:
    m = artifacts.read_manifest(folder, STAGE)
    if exported is not None and m["onnx_sha256"] != artifacts.sha256_file(exported.onnx_path):
        from .errors import StaleArtifactError

        raise StaleArtifactError("frontend artifact was made from another ONNX file (re-run the frontend stage)", str(folder))
    modules = {parse(b): Path(folder) / f for b, f in m["buckets"].items()}
    return FrontendArtifact(Path(folder), modules, m)
