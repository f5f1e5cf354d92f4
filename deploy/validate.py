"""Stage 6, validate: every bucket of the package against ONNX Runtime (and
PyTorch, for registry models) on seeded random inputs, with the tolerance of
the package's precision. The report goes into the package (validation.json,
recorded in its manifest); a mismatch fails the run with a per-output report."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import numpy as np

from . import artifacts
from .config import Config, Tolerance
from .errors import ToleranceError
from .export import ExportArtifact, build_torch_model, is_onnx_source

log = logging.getLogger(__name__)
REPORT = "validation.json"


def compare(out: np.ndarray, ref: np.ndarray, tol: Tolerance) -> dict:
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if out.shape != ref.shape:
        return {"passed": False, "error": f"shape {list(out.shape)} != reference {list(ref.shape)}"}
    if not np.all(np.isfinite(out)):
        return {"passed": False, "error": f"{int(np.sum(~np.isfinite(out)))} non-finite values"}
    diff = np.abs(out - ref)
    scale = float(np.max(np.abs(ref))) if ref.size else 0.0
    allowed = tol.atol * max(scale, 1e-12) + tol.rtol * np.abs(ref)
    bad = diff > allowed
    rel_l2 = float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))
    return {
        "passed": bool(not bad.any() and rel_l2 <= tol.max_rel_l2),
        "max_abs_err": float(diff.max()) if diff.size else 0.0,
        "ref_max_abs": scale,
        "rel_l2": rel_l2,
        "mismatched": int(bad.sum()),
        "elements": int(bad.size),
    }


class References:
    """fp32 reference outputs: ONNX Runtime (CPU) on the exported ONNX, and
    the PyTorch model on the same weights for registry models. The session
    and the model are made once and reused for every batch."""

    def __init__(self, cfg: Config, exported: ExportArtifact, include_torch: bool = True):
        import onnxruntime as ort

        self.exported = exported
        self.sess = ort.InferenceSession(str(exported.onnx_path), providers=["CPUExecutionProvider"])
        self.model = None
        if include_torch and not is_onnx_source(cfg.model.source):
            self.model = build_torch_model(cfg)

    def __call__(self, inputs: list[np.ndarray]) -> dict[str, list[np.ndarray]]:
        refs = {"onnxruntime": self.sess.run(None, {i.name: a for i, a in zip(self.exported.inputs, inputs)})}
        if self.model is not None:
            import torch

            with torch.no_grad():
                out = self.model(*[torch.from_numpy(a) for a in inputs])
            outs = out if isinstance(out, (tuple, list)) else [out]
            refs["pytorch"] = [o.numpy() for o in outs]
        return refs


def references(cfg: Config, exported: ExportArtifact, inputs: list[np.ndarray], include_torch: bool = True) -> dict[str, list[np.ndarray]]:
    """One-off reference outputs (see `References`)."""
    return References(cfg, exported, include_torch)(inputs)


def shorter(bucket, dims):
    """A request shorter than `bucket` along each dimension that still runs
    in it (three quarters of its length, past the next smaller bucket): the
    bucket with those lengths, or None (no dimensions, or none shorter)."""
    from .shapes import Bucket

    out = []
    for name, v in bucket.dims:
        d = next(d for d in dims if d.name == name)
        below = max((x for x in d.buckets if x < v), default=0)
        out.append((name, max(below + 1, -(-3 * v // 4))))
    return None if not out or all(h == v for (_, h), (_, v) in zip(out, bucket.dims)) else Bucket(tuple(out), bucket.batch)


def run(cfg: Config, tolerance: Tolerance, package_dir: Path, exported: ExportArtifact, seed: int = 0) -> dict:
    from . import runtime

    predictor = runtime.load(package_dir, warn_unvalidated=False)
    report = {"tolerance": dataclasses.asdict(tolerance), "precision": predictor.manifest["precision"], "buckets": {}}
    failures = []
    refs_for = References(cfg, exported)
    checks = []  # (name, inputs, outputs)
    for bucket in predictor.buckets:
        inputs = predictor.random_inputs(bucket, seed=seed + bucket.batch)
        checks.append((bucket.label, inputs, predictor.run_bucket(bucket, inputs)))
        short = shorter(bucket, predictor.dims)
        if short is not None:  # a request shorter than the bucket: padded, run, cut back; against the unpadded one
            inputs = predictor.random_inputs(short, seed=seed + 7 + bucket.batch)
            got = predictor(*inputs)
            checks.append((f"{bucket.label} padded from {short.label}", inputs, [got[o["name"]] for o in predictor.outputs]))
    for bucket, inputs, outs in checks:
        entry = {}
        for ref_name, refs in refs_for(inputs).items():
            if len(refs) != len(outs):
                failures.append(f"bucket {bucket}: {len(outs)} output(s) vs {len(refs)} from {ref_name}")
            per_out = {}
            for spec, o, r in zip(predictor.outputs, outs, refs):
                res = compare(o, r, tolerance)
                per_out[spec["name"]] = res
                if not res["passed"]:
                    why = res.get("error") or (
                        f"rel_l2 {res['rel_l2']:.2e} (max {tolerance.max_rel_l2:.0e}), "
                        f"{res['mismatched']}/{res['elements']} elements outside rtol {tolerance.rtol:g} atol {tolerance.atol:g}"
                    )
                    failures.append(f"bucket {bucket} output '{spec['name']}' vs {ref_name}: {why}")
            entry[ref_name] = per_out
        report["buckets"][bucket] = entry
    report["passed"] = not failures
    report["failures"] = failures
    _record(package_dir, report)
    worst = max(
        (r["rel_l2"] for b in report["buckets"].values() for refs in b.values() for r in refs.values() if "rel_l2" in r),
        default=0.0,
    )
    report["worst_rel_l2"] = worst
    if failures:
        raise ToleranceError(
            f"validation failed ({len(failures)} mismatch(es), report in {package_dir / REPORT}): {failures[0]}"
        )
    log.info("validate: %d bucket(s) match %s (worst rel_l2 %.1e)%s", len(predictor.buckets),
             " and ".join(next(iter(report["buckets"].values()))), worst,
             f"; {len(checks) - len(predictor.buckets)} shorter request(s) padded to their buckets match too"
             if len(checks) > len(predictor.buckets) else "")
    return report


def _record(package_dir: Path, report: dict) -> None:
    """Write the report and record it in the package manifest (atomically)."""
    package_dir = Path(package_dir)
    (package_dir / REPORT).write_text(json.dumps(report, indent=2) + "\n")
    manifest = json.loads((package_dir / artifacts.MANIFEST).read_text())
    manifest["validation"] = {"passed": report["passed"], "report": REPORT, "failures": report["failures"][:10]}
    manifest["files"][REPORT] = artifacts.sha256_file(package_dir / REPORT)
    artifacts.write_json_atomic(package_dir / artifacts.MANIFEST, manifest)
