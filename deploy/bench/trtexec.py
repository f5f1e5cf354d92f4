"""TensorRT baselines measured elsewhere (the TensorRT builder cannot be
installed on these machines): trtexec's `--exportTimes` JSON and its printed
performance summary, read through a `baseline.json` that names what was
measured, so the latency diff can set them beside its own runners.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import ConfigError, InputFileError
from .runners import percentiles


def parse_trtexec_times(data: list[dict]) -> list[float]:
    """`trtexec --exportTimes=FILE`: one record per inference. With
    --noDataTransfers the latency is the compute time."""
    if not isinstance(data, list) or not data or not all(isinstance(r, dict) for r in data):
        raise InputFileError("trtexec times file holds no records (a JSON list of objects)")
    key = "computeMs" if "computeMs" in data[0] else "latencyMs"
    try:
        return [float(r[key]) for r in data]
    except (KeyError, TypeError, ValueError):
        raise InputFileError("trtexec times records lack computeMs/latencyMs") from None


_SUMMARY_KEYS = {"min": "min_ms", "max": "max_ms", "mean": "mean_ms", "median": "p50_ms",
                 "percentile(90%)": "p90_ms", "percentile(95%)": "p95_ms", "percentile(99%)": "p99_ms"}


def parse_trtexec_summary(text: str) -> dict:
    """The performance summary trtexec prints: the 'GPU Compute Time' line
    (preferred, as with --noDataTransfers) or 'Latency', and 'Throughput'."""
    import re

    found: dict[str, dict] = {}
    throughput = None
    for line in text.splitlines():
        m = re.search(r"\] (Latency|GPU Compute Time): (.*)$", line) or re.search(r"^(Latency|GPU Compute Time): (.*)$", line.strip())
        if m:
            stats = {}
            for part in m.group(2).split(","):
                if "=" not in part:
                    continue
                k, v = (s.strip() for s in part.split("=", 1))
                if k in _SUMMARY_KEYS:
                    try:
                        stats[_SUMMARY_KEYS[k]] = float(v.split()[0])
                    except (ValueError, IndexError):
                        raise InputFileError("unreadable trtexec summary value", f"{k} = {v}") from None
            found[m.group(1)] = stats
        m = re.search(r"Throughput: ([0-9.]+) qps", line)
        if m:
            throughput = float(m.group(1))
    stats = found.get("GPU Compute Time") or found.get("Latency")
    if not stats or "p50_ms" not in stats:
        raise InputFileError("no trtexec performance summary (Latency / GPU Compute Time lines) found")
    stats["qps"] = throughput
    return stats


def read_baseline_meta(path: Path) -> dict:
    """The `baseline.json` of a baseline measured elsewhere."""
    path = Path(path)
    if not path.is_file():
        raise InputFileError("baseline file not found", str(path))
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise InputFileError(f"baseline {path} is not valid JSON", str(e)) from None
    if not isinstance(meta, dict):
        raise InputFileError(f"baseline {path} must be a JSON object", type(meta).__name__)
    return meta


def baseline_batch(path: Path) -> int | None:
    """The batch a baseline was measured at."""
    return read_baseline_meta(path).get("batch")


def load_baseline(path: Path, model: str, batch: int, input_shape: list[int], precision: str) -> dict:
    """A baseline measured elsewhere: `baseline.json` naming what it measured,
    beside trtexec's --exportTimes JSON and/or its text output."""
    path = Path(path)
    meta = read_baseline_meta(path)
    want = {"model": model, "batch": batch, "input_shape": list(input_shape), "precision": precision}
    for k, v in want.items():
        if meta.get(k) != v:
            raise ConfigError(f"baseline {path} was measured for another {k}", meta.get(k), v)
    def read(name: str) -> str:
        try:
            return (path.parent / name).read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise InputFileError(f"baseline {path} names an unreadable file", f"{name}: {e}") from None

    timing = None
    if meta.get("times"):
        try:
            data = json.loads(read(meta["times"]))
        except json.JSONDecodeError as e:
            raise InputFileError(f"trtexec times file {meta['times']} is not valid JSON", str(e)) from None
        timing = percentiles(parse_trtexec_times(data), batch)
    if meta.get("summary"):
        summary = parse_trtexec_summary(read(meta["summary"]))
        if timing is None:
            timing = {**{k: v for k, v in summary.items() if k.endswith("_ms")}, "iterations": None,
                      "throughput_per_s": batch / (summary["p50_ms"] / 1e3)}
        timing["trtexec_qps"] = summary.get("qps")
    if timing is None:
        raise InputFileError(f"baseline {path} names neither a 'times' nor a 'summary' file")
    return {"name": meta.get("name", "tensorrt-baseline"), "kind": "tensorrt", "status": "ok", "source": str(path),
            "gpu": meta.get("gpu"), "timing": timing, "setup_s": None, "check": None}
