"""Load test of the serving process against the raw module, in one run.

1. Raw: the package's Predictor in this process, each bucket timed through
   `Predictor.run_bucket` (numpy in, numpy out: the host-device copies the
   server also pays) for `raw_seconds`; the best bucket's samples/s is the
   reference. TVM's time evaluator (module only, no copies) is reported too.
2. Served: `python -m deploy serve` in a subprocess on a free loopback port
   (port 0: the server picks it and logs it);
   closed-loop clients (each sends its next request when the last one is
   answered) at each concurrency level, spread over client processes so that
   the clients are not the bottleneck. The clients are tritonclient's asyncio
   HTTP client, the standard v2 client, sending binary tensors. Every answer
   is compared with the raw Predictor's output for the same input.
   Each level's clock starts once every client process has built its
   requests (a barrier), so start-up is not measured.
3. Per level: samples/s and requests/s over the measured window, latency
   p50/p90/p99 (send to answer, as the client sees it) over every answer,
   errors included, and over the correct ones alone, the errors, and the
   server's mean batch (from its /metrics) -- written as results.json and
   results.md.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import logging
import math
import os
import platform
import queue
import tempfile
import time
from pathlib import Path

import numpy as np

from .. import artifacts
from ..config import LoadtestConfig
from ..shapes import parse
from . import clients as load_clients
from . import server_process

log = logging.getLogger(__name__)

STAGE = "loadtest"
TARGET_CONCURRENCY, TARGET_RATIO = 32, 0.70  # the serving issue's goal on the H200
DISTINCT_REQUESTS = 8  # distinct inputs the clients cycle through (each answer is checked)


# ---------------------------------------------------------------------- raw ---


def measure_raw(predictor, seconds: float) -> dict:
    """Samples/s of every bucket through run_bucket, and the best."""
    out = {}
    for b in predictor.buckets:
        arrays = predictor.random_inputs(b, seed=1)
        for _ in range(2):
            predictor.run_bucket(b, arrays)
        times = []
        t_end = time.perf_counter() + seconds
        while time.perf_counter() < t_end or len(times) < 5:
            t0 = time.perf_counter()
            predictor.run_bucket(b, arrays)  # returns numpy: synchronized
            times.append(time.perf_counter() - t0)
        median = float(np.median(times))
        # The host part alone: the rows into the bucket's host buffer, what
        # the server's batcher does for the next batch while one runs.
        staging = []
        for _ in range(min(max(len(times), 5), 50)):
            t0 = time.perf_counter()
            batch = predictor.stage([arrays])
            staging.append(time.perf_counter() - t0)
            predictor.release(batch)
        stage = float(np.median(staging))
        nbytes = sum(a.nbytes for a in arrays)
        module = predictor.latency(b)["median_ms"] / 1e3
        out[b.label] = {
            "run_bucket_median_ms": median * 1e3,
            "run_bucket_samples_per_s": b.batch / median,
            "iterations": len(times),
            "staging_median_ms": stage * 1e3,
            "staging_gb_per_s": nbytes / stage / 1e9 if stage > 0 else None,
            "module_median_ms": module * 1e3,
            "module_samples_per_s": b.batch / module,
        }
    best = max(out, key=lambda k: out[k]["run_bucket_samples_per_s"])
    return {"buckets": out, "best_bucket": best if predictor.dims else int(best), "best_samples_per_s": out[best]["run_bucket_samples_per_s"]}


# --------------------------------------------------------------------- run ---


def _level(concurrency: int, records: list, cfg: LoadtestConfig, t_measure: float, t_end: float,
           before: dict, after: dict, raw_best: float) -> dict:
    window = t_end - t_measure
    done = [r for r in records if t_measure <= r[1] <= t_end]
    ok = [r for r in done if r[2] == "ok"]
    statuses: dict[str, int] = {}
    for r in done:
        statuses[r[2]] = statuses.get(r[2], 0) + 1
    # Latency of the requests sent in the window: of every answer, errors
    # included (a server that sheds load fast must not look fast), and of
    # the correct ones alone.
    every = [(r[1] - r[0]) * 1e3 for r in records if r[0] >= t_measure]
    correct = [(r[1] - r[0]) * 1e3 for r in records if r[0] >= t_measure and r[2] == "ok"]

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    def pct(values: list[float], q: float) -> float | None:
        return float(np.percentile(values, q)) if values else None

    def mean(name: str, scale: float = 1.0) -> float | None:
        n = delta(name + "_count")
        return delta(name + "_sum") / n * scale if n else None

    samples = len(ok) * cfg.request_batch / window
    # Server side, over the level's warm-up and measured window (the metrics
    # were read just before and after it; the clients sent nothing outside it).
    span = t_end - (t_measure - cfg.warmup_s)
    answered = delta("tvm_serve_requests_total")
    loop_cpu = delta("_loop_cpu_s") if "_loop_cpu_s" in after and "_loop_cpu_s" in before else None
    return {
        "concurrency": concurrency,
        "requests": len(done),
        "statuses": statuses,
        "samples_per_s": samples,
        "requests_per_s": len(ok) / window,
        "p50_ms": pct(every, 50),
        "p90_ms": pct(every, 90),
        "p99_ms": pct(every, 99),
        "mean_ms": float(np.mean(every)) if every else None,
        "ok_p50_ms": pct(correct, 50),
        "ok_p90_ms": pct(correct, 90),
        "ok_p99_ms": pct(correct, 99),
        "ok_mean_ms": float(np.mean(correct)) if correct else None,
        "mean_batch_rows": mean("tvm_serve_batch_rows"),
        "mean_batch_requests": mean("tvm_serve_batch_requests"),
        "server_ms": mean("tvm_serve_request_seconds", 1e3),
        "queue_ms": mean("tvm_serve_queue_seconds", 1e3),
        "batch_ms": mean("tvm_serve_compute_seconds", 1e3),
        "batcher_busy": delta("tvm_serve_compute_seconds_sum") / span if span > 0 else None,
        "loop_cpu_us": loop_cpu / answered * 1e6 if loop_cpu is not None and answered else None,
        "loop_busy": loop_cpu / span if loop_cpu is not None and span > 0 else None,
        "vs_raw_best": samples / raw_best if raw_best else None,
    }


def run(cfg: LoadtestConfig, folder: str | Path, out: str | Path, command: str = "") -> dict:
    from .. import runtime

    folder, out = Path(folder), Path(out)
    artifacts.check_replaceable(out, STAGE)
    manifest = runtime.check_package(folder)
    runtime.check_device(manifest)
    precision = manifest.get("precision", "fp32")
    predictor = runtime.load(folder, warn_unvalidated=False, manifest=manifest)  # checked just above
    log.info("raw: timing every bucket through run_bucket for %g s", cfg.raw_seconds)
    raw = measure_raw(predictor, cfg.raw_seconds)
    requests = [predictor.random_inputs(cfg.request_batch, seed=100 + k) for k in range(DISTINCT_REQUESTS)]
    expected = [predictor(*r) for r in requests]
    del predictor

    serve_cfg = cfg.serve
    procs = load_clients.client_procs(cfg)
    levels = []
    with tempfile.TemporaryDirectory(prefix="loadtest-") as tmp:
        server = server_process.ServerProcess.for_package(serve_cfg, folder, Path(tmp) / "server.log")
        pool = manager = None
        try:
            server.wait_ready(600)
            model = json.loads(server_process.http_get(server.url + "/v2/models/" + (serve_cfg.model_name or manifest["model"]))[1])
            if procs > 1:
                import multiprocessing

                ctx = multiprocessing.get_context("spawn")
                pool = ctx.Pool(procs, initializer=_import_clients)
                manager = ctx.Manager()
                ready, go = manager.Queue(), manager.Queue()
            for c in cfg.concurrency:
                parts = load_clients.split_clients(c, procs)
                before = server.metrics()
                args = [(server.url, model["name"], manifest["inputs"], requests, expected, precision, n,
                         cfg.warmup_s, cfg.duration_s, serve_cfg.shared_memory) for n in parts]
                log.info("concurrency %d: %d client(s) in %d process(es) for %g + %g s", c, c, len(parts),
                         cfg.warmup_s, cfg.duration_s)
                if pool is None:
                    t_start, records = load_clients.client_part(*args[0])
                else:
                    t_start, records = _run_parts(pool, args, ready, go)
                t_measure, t_end = t_start + cfg.warmup_s, t_start + cfg.warmup_s + cfg.duration_s
                after = server.metrics()
                levels.append(_level(c, records, cfg, t_measure, t_end, before, after, raw["best_samples_per_s"]))
                log.info("concurrency %d: %.1f samples/s, p50 %s ms, p99 %s ms", c, levels[-1]["samples_per_s"],
                         _fmt(levels[-1]["p50_ms"]), _fmt(levels[-1]["p99_ms"]))
        finally:
            if pool is not None:
                pool.terminate()
            if manager is not None:
                manager.shutdown()
            rc = server.stop()
            server_log = server.log_path.read_text(errors="replace")
        if rc != 0:
            log.warning("the server exited with status %s", rc)
    report = {
        "model": manifest["model"],
        "package": str(folder),
        "target": manifest["target"],
        "gpu": manifest.get("gpu"),
        "precision": precision,
        "buckets": [b.label if b.dims else b.batch for b in sorted(parse(b) for b in manifest["buckets"])],
        "date": _dt.date.today().isoformat(),
        "command": command,
        "environment": environment(),
        "config": dataclasses.asdict(cfg),
        "client_processes": procs,
        "server_exit_status": rc,
        "raw": raw,
        "levels": levels,
        "target_check": _target(levels, raw),
    }
    write(report, out, server_log)
    return report


def _run_parts(pool, args: list[tuple], ready, go) -> tuple[float, list]:
    """Every client process at once: the clock starts when all of them have
    their requests ready (unpickled and built), not when they were sent."""
    pending = pool.starmap_async(load_clients.client_part, [(*a, (ready, go)) for a in args])
    deadline, waiting = time.monotonic() + 300, len(args)
    while waiting:
        try:
            ready.get(timeout=0.5)
            waiting -= 1
        except queue.Empty:
            if pending.ready():
                pending.get()  # a client process failed: raises its exception
                raise RuntimeError("a client process ended before it was ready") from None
            if time.monotonic() > deadline:
                raise TimeoutError("the load test's client processes were not ready in 300 s") from None
    t_start = time.monotonic() + 0.1
    for _ in args:
        go.put(t_start)
    parts = pending.get()
    return t_start, [r for _, part in parts for r in part]


def _import_clients() -> None:
    import tritonclient.http.aio  # noqa: F401  before the first level's clock starts


def _target(levels: list[dict], raw: dict) -> dict | None:
    level = next((lv for lv in levels if lv["concurrency"] == TARGET_CONCURRENCY), None)
    if level is None:
        return None
    ratio = level["vs_raw_best"]
    return {"concurrency": TARGET_CONCURRENCY, "required_ratio": TARGET_RATIO, "ratio": ratio,
            "met": ratio is not None and ratio >= TARGET_RATIO}


def environment() -> dict:
    import importlib.metadata as md

    from ..tvm_compat import versions

    env = {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
           **versions()}
    for dist in ("uvicorn", "starlette", "tritonclient", "prometheus_client", "pydantic", "uvloop", "httptools"):
        try:
            env[dist] = md.version(dist)
        except md.PackageNotFoundError:
            env[dist] = None
    return env


def default_out(manifest: dict) -> Path:
    """results/<cpu | the GPU's name, e.g. h200>/<date>/<model>-loadtest, as the committed results are laid out."""
    if manifest["target"]["kind"] == "cuda":
        gpu = (manifest.get("gpu") or {}).get("name") or manifest["target"].get("arch", "gpu")
        machine = gpu.lower().replace("nvidia", "").strip().replace(" ", "-")
    else:
        machine = "cpu"
    return artifacts.REPO_ROOT / "results" / machine / _dt.date.today().isoformat() / f"{manifest['model']}-loadtest"


def write(report: dict, folder: Path, server_log: str = "") -> None:
    """results.json, results.md and the server's log; an existing folder is
    replaced only if an earlier load test wrote it."""
    artifacts.check_replaceable(folder, STAGE)
    with artifacts.staged_dir(folder) as tmp:
        artifacts.write_json_atomic(tmp / "results.json", report)
        (tmp / "results.md").write_text(markdown(report))
        (tmp / "server.log").write_text(server_log)
        artifacts.write_manifest(tmp, STAGE, {"model": report["model"]})


def _fmt(v, spec: str = ".2f") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def markdown(report: dict) -> str:
    raw, cfg = report["raw"], report["config"]
    target = report["target"]
    where = (report["gpu"] or {}).get("name") if target["kind"] == "cuda" else f"CPU ({report['environment']['cpus']} cores)"
    lines = [
        f"# Load test: {report['model']}, {target['kind']} {report['precision']}, {report['date']}",
        "",
        f"Package `{report['package']}` (buckets {report['buckets']}) on {where}. Command:",
        "",
        f"    {report['command']}",
        "",
        (f"Each request carries {cfg['request_batch']} sample(s) "
         + ("through system shared memory (a region per client for inputs and one for outputs); "
            if cfg["serve"].get("shared_memory") else "as binary tensors; ")
         + "clients are closed-loop "
         f"(tritonclient's asyncio HTTP client, {report['client_processes']} process(es)); each level runs "
         f"{cfg['warmup_s']:g} s unmeasured, then {cfg['duration_s']:g} s measured. Server: max queue delay "
         f"{cfg['serve']['max_queue_delay_ms']:g} ms, max concurrency {cfg['serve']['max_concurrency']}."),
        "",
        "## Raw module (this process, no HTTP)",
        "",
        "| bucket | run_bucket p50 (ms) | samples/s | module only p50 (ms) | samples/s | staging p50 (ms) | GB/s |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for b, r in raw["buckets"].items():
        staged = r.get("staging_median_ms")  # absent in reports written before it was measured
        lines.append(f"| {b} | {r['run_bucket_median_ms']:.3f} | {r['run_bucket_samples_per_s']:.1f} | "
                     f"{r['module_median_ms']:.3f} | {r['module_samples_per_s']:.1f} | "
                     f"{_fmt(staged, '.3f')} | {_fmt(r.get('staging_gb_per_s'), '.1f')} |")
    lines += [
        "",
        (f"Reference: bucket {raw['best_bucket']}, {raw['best_samples_per_s']:.1f} samples/s through run_bucket "
         "(numpy in and out, the copies the server pays too). Staging: the rows copied into the bucket's host "
         "buffer alone (page-locked on a GPU), what the server's batcher does for the next batch while one runs; "
         "the host's copy speed, which differs between machines, bounds the server when staging takes longer "
         "than the module."),
        "",
        "## Served (HTTP, KServe v2)",
        "",
        ("| concurrency | samples/s | vs raw | p50 (ms) | p90 (ms) | p99 (ms) | ok p50 (ms) | ok p99 (ms) "
         "| mean batch (rows) | requests | not ok |"),
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for lv in report["levels"]:
        bad = {k: v for k, v in lv["statuses"].items() if k != "ok"}
        lines.append(
            f"| {lv['concurrency']} | {lv['samples_per_s']:.1f} | {_fmt(lv['vs_raw_best'], '.0%')} | "
            f"{_fmt(lv['p50_ms'])} | {_fmt(lv['p90_ms'])} | {_fmt(lv['p99_ms'])} | "
            f"{_fmt(lv.get('ok_p50_ms'))} | {_fmt(lv.get('ok_p99_ms'))} | {_fmt(lv['mean_batch_rows'], '.1f')} | "
            f"{lv['requests']} | {', '.join(f'{k}: {v}' for k, v in bad.items()) or 'none'} |")
    lines += [
        "",
        "Server side, over each level's warm-up and measured window (from /metrics and the server's event-loop thread):",
        "",
        ("| concurrency | in server (ms) | queued (ms) | batch run (ms) | batcher busy | loop CPU per request (us) "
         "| loop busy |"),
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for lv in report["levels"]:
        lines.append(
            f"| {lv['concurrency']} | {_fmt(lv.get('server_ms'))} | {_fmt(lv.get('queue_ms'))} | "
            f"{_fmt(lv.get('batch_ms'))} | {_fmt(lv.get('batcher_busy'), '.0%')} | {_fmt(lv.get('loop_cpu_us'), '.0f')} | "
            f"{_fmt(lv.get('loop_busy'), '.0%')} |")
    t = report["target_check"]
    if t is not None:
        lines += ["", (f"Target (concurrency {t['concurrency']}, at least {t['required_ratio']:.0%} of the raw best): "
                       f"{_fmt(t['ratio'], '.0%')}, {'met' if t['met'] else 'NOT met'}.")]
    lines += [
        "",
        ("samples/s: answered and correct samples per second of the measured window. Latency: send to answer, "
         "as the client sees it, of the requests sent in the window: p50/p90/p99 over every answer, errors "
         "included (an overloaded server answering 503 at once lowers them: read them next to `not ok`); "
         "ok p50/p99 over the correct answers alone. mean batch: rows per batch (warm-up included), from the "
         "server's /metrics. not ok: errors by status, and answers that differ from the raw Predictor's output "
         "for the same input (`mismatch`). Server side: in server, arrival to response of a successful request "
         "(its client-side latency minus this is the client and the network); queued, waiting for its batch; "
         "batch run, one batch from its launch (its rows already copied into host memory while the previous "
         "batch ran) to its outputs back, the copies to and from the device included; batcher busy, the share of "
         "the time a batch was launched and not yet collected (near 100%: the device side is the limit); loop CPU per request (any outcome) and "
         "loop busy, the event loop's thread (HTTP, and decoding and answers of bodies under 256 KiB, larger ones "
         "go to worker threads; near 100%: the loop is the limit)."),
        "",
    ]
    return "\n".join(lines)
