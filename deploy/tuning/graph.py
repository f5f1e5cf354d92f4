"""Which graph a bucket's tuning database was tuned on, so that later
builds make the same one.

Records are keyed by kernel (workload): a database tuned on one form of a
model's graph holds no record of another's kernels. On sm_90 in fp16 the
optimize stage makes convolutions implicit GEMMs by default
(`config.Profile.implicit_gemms`): our wgmma kernel and mma.sync GEMM take
them untuned, and they were faster so at every batch measured (on an H100,
untuned: ResNet-50 b1 1.259 -> 0.819 ms, ConvNeXt-T b1 0.726 -> 0.631,
EfficientNet-B0 b1 even, results/h100/2026-12-06/implicit-b1/; b32 and b64
in config.py). But a database made before that for a bucket of fewer than
`config.CONV_GEMM_BATCH` images was tuned on direct convolutions, and there
the tuned direct kernels stay a little faster (ResNet-50 b1 on the H200:
0.470 ms against 0.489, results/h200/2026-12-06/gathers-row-k/): a bucket
such a database covers keeps direct convolutions.

A database made now says in `graph.json` which graph it was first tuned
on; one without the file (and with records) is as old as that rule, and
was tuned on direct convolutions below `CONV_GEMM_BATCH` images. Either
way, `--implicit-gemm` / `--no-implicit-gemm` decide instead where given.
"""

from __future__ import annotations

import json
from pathlib import Path

from .. import artifacts, config
from . import database as dbs

GRAPH_FILE = "graph.json"


def tuned_direct(folder: Path, batch: int) -> bool:
    """Whether the database in `folder` (of a bucket of `batch` images) was
    tuned with the convolutions direct: it has records, and its graph.json
    says so, or it has none and is for fewer than CONV_GEMM_BATCH images."""
    path = Path(folder) / GRAPH_FILE
    if not dbs.has_records(folder):
        return False  # (nothing tuned yet: the default graph)
    if path.is_file():
        try:
            return json.loads(path.read_text()).get("convolutions") == "direct"
        except (json.JSONDecodeError, AttributeError):
            return False  # (unreadable: the default graph, as for a new database)
    return batch < config.CONV_GEMM_BATCH


def record(folder: Path, implicit: bool) -> None:
    """Writes graph.json into a database about to be tuned that has no
    records yet (a first run stopped before its first record is replaced);
    a database with records keeps the graph it was first tuned on, and an
    older one without the file keeps what `tuned_direct` reads it as."""
    folder = Path(folder)
    if dbs.has_records(folder):
        return
    folder.mkdir(parents=True, exist_ok=True)
    artifacts.write_json_atomic(folder / GRAPH_FILE, {"convolutions": "implicit-gemm" if implicit else "direct"})
