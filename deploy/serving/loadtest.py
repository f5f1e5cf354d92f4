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

import asyncio
import contextlib
import dataclasses
import datetime as _dt
import functools
import json
import logging
import math
import os
import platform
import queue
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

from .. import artifacts
from ..config import LoadtestConfig, ServeConfig
from ..errors import StaleArtifactError

log = logging.getLogger(__name__)

STAGE = "loadtest"
TARGET_CONCURRENCY, TARGET_RATIO = 32, 0.70  # the serving issue's goal on the H200
DISTINCT_REQUESTS = 8  # distinct inputs the clients cycle through (each answer is checked)
REPO_ROOT = Path(__file__).resolve().parents[2]  # deploy/serving/loadtest.py -> the checkout


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
        out[str(b)] = {
            "run_bucket_median_ms": median * 1e3,
            "run_bucket_samples_per_s": b / median,
            "iterations": len(times),
            "staging_median_ms": stage * 1e3,
            "staging_gb_per_s": nbytes / stage / 1e9 if stage > 0 else None,
            "module_median_ms": module * 1e3,
            "module_samples_per_s": b / module,
        }
    best = max(out, key=lambda k: out[k]["run_bucket_samples_per_s"])
    return {"buckets": out, "best_bucket": int(best), "best_samples_per_s": out[best]["run_bucket_samples_per_s"]}


def _close(out: np.ndarray, ref: np.ndarray, precision: str) -> bool:
    # Merged requests may run in another bucket (another compiled module)
    # than the reference did: equal up to rounding, not bit for bit.
    limit = 2e-2 if precision == "fp16" else 1e-4
    out, ref = out.astype(np.float64), ref.astype(np.float64)
    if out.shape != ref.shape:
        return False
    return bool(np.linalg.norm(out - ref) <= limit * max(np.linalg.norm(ref), 1e-30))


# ------------------------------------------------------------------ clients ---


def _client_part(url: str, model: str, specs: list[dict], requests: list[list[np.ndarray]],
                 expected: list[dict], precision: str, concurrency: int, warmup_s: float, duration_s: float,
                 shared_memory: bool = False, sync=None) -> tuple[float, list]:
    """One client process: `concurrency` closed-loop clients for `warmup_s`
    + `duration_s` seconds. `sync`, with several processes: (ready, go)
    queues; the process says it is ready once its requests are built, and
    gets the common start time (time.monotonic, shared by the processes of
    one machine). With `shared_memory`, each client passes its inputs and
    outputs through system shared memory regions of its own (written before
    each request, read after it), as a client on the server's host would.
    Returns (start, [(sent, answered, status) per request])."""
    return asyncio.run(_clients(url, model, specs, requests, expected, precision, concurrency, warmup_s,
                                duration_s, sync, shared_memory))


async def _clients(url, model, specs, requests, expected, precision, concurrency, warmup_s, duration_s,
                   sync, shared_memory: bool = False) -> tuple[float, list]:
    from tritonclient.http.aio import InferenceServerClient, InferInput
    from tritonclient.utils import InferenceServerException, np_to_triton_dtype

    client = InferenceServerClient(url.removeprefix("http://"), conn_limit=concurrency)
    regions = None
    prepared = []  # binary tensors, built once (through shared memory, each request writes its region)
    for arrays in ([] if shared_memory else requests):
        tensors = []
        for spec, a in zip(specs, arrays):
            t = InferInput(spec["name"], list(a.shape), np_to_triton_dtype(a.dtype))
            t.set_data_from_numpy(a, binary_data=True)
            tensors.append(t)
        prepared.append(tensors)
    if sync is None:
        t_start = time.monotonic() + 0.1
    else:
        ready, go = sync
        ready.put(os.getpid())
        t_start = await asyncio.to_thread(go.get, True, 300)
    t_end = t_start + warmup_s + duration_s
    records = []

    async def one_client(k: int) -> None:
        i = k
        await asyncio.sleep(max(0.0, t_start - time.monotonic()))
        while time.monotonic() < t_end:
            j = i % len(requests)
            sent = time.monotonic()
            try:
                if regions is None:
                    r = await client.infer(model, prepared[j])
                else:
                    inputs, outputs = regions.request(k, specs, requests[j])
                    r = await client.infer(model, inputs, outputs=outputs)
            except InferenceServerException as e:
                answered, status = time.monotonic(), f"http {e.status()}"
            except Exception as e:  # noqa: BLE001  counted, reported
                answered, status = time.monotonic(), type(e).__name__
            else:
                answered = time.monotonic()  # before the check: it is the client's work, not the server's
                got = r.as_numpy if regions is None else functools.partial(regions.output, k)
                ok = all(_close(got(n), ref, precision) for n, ref in expected[j].items())
                status = "ok" if ok else "mismatch"
            records.append((sent, answered, status))
            i += concurrency

    try:
        if shared_memory:
            regions = _ShmClients(client, concurrency, requests[0], expected[0])
            await regions.register()
        await asyncio.gather(*(one_client(k) for k in range(concurrency)))
    finally:
        if regions is not None:
            await regions.close()
        await client.close()
    return t_start, records


class _ShmClients:
    """Each client's input and output regions in system shared memory
    (tritonclient.utils.shared_memory), registered with the server."""

    def __init__(self, client, n: int, inputs: list[np.ndarray], outputs: dict):
        import tritonclient.utils.shared_memory as shm

        self.shm, self.client = shm, client
        # Each output's place in a client's output region: (dtype, shape, offset, bytes), by name.
        self.out_layout, offset = {}, 0
        for name, a in outputs.items():
            self.out_layout[name] = (a.dtype, a.shape, offset, a.nbytes)
            offset += a.nbytes
        in_bytes, out_bytes = sum(a.nbytes for a in inputs), offset
        tag = f"lt{os.getpid()}"
        self.names = [(f"{tag}-in{k}", f"{tag}-out{k}") for k in range(n)]
        self.handles, self.registered = [], []
        self.sizes = (in_bytes, out_bytes)
        try:
            for name_in, name_out in self.names:
                h_in = shm.create_shared_memory_region(name_in, "/" + name_in, in_bytes)
                self.handles.append(h_in)
                self.handles.append(shm.create_shared_memory_region(name_out, "/" + name_out, out_bytes))
        except BaseException:
            self._destroy()
            raise

    async def register(self) -> None:
        for (name_in, name_out) in self.names:
            for name, size in ((name_in, self.sizes[0]), (name_out, self.sizes[1])):
                await self.client.register_system_shared_memory(name, "/" + name, size)
                self.registered.append(name)

    def request(self, k: int, specs: list[dict], arrays: list[np.ndarray]) -> tuple[list, list]:
        from tritonclient.http.aio import InferInput, InferRequestedOutput
        from tritonclient.utils import np_to_triton_dtype

        name_in, name_out = self.names[k]
        self.shm.set_shared_memory_region(self.handles[2 * k], arrays)
        inputs, offset = [], 0
        for spec, a in zip(specs, arrays):
            t = InferInput(spec["name"], list(a.shape), np_to_triton_dtype(a.dtype))
            inputs.append(t.set_shared_memory(name_in, a.nbytes, offset))
            offset += a.nbytes
        outputs = []
        for name, (_, _, offset, nbytes) in self.out_layout.items():
            o = InferRequestedOutput(name, binary_data=True)
            o.set_shared_memory(name_out, nbytes, offset)  # returns None, unlike InferInput's
            outputs.append(o)
        return inputs, outputs

    def output(self, k: int, name: str) -> np.ndarray:
        dtype, shape, offset, _ = self.out_layout[name]
        return self.shm.get_contents_as_numpy(self.handles[2 * k + 1], dtype, shape, offset).copy()

    async def close(self) -> None:
        try:
            for name in self.registered:
                with contextlib.suppress(Exception):  # the server may be gone; the objects still go
                    await self.client.unregister_system_shared_memory(name)
        finally:
            self._destroy()

    def _destroy(self) -> None:
        for h in self.handles:
            with contextlib.suppress(Exception):
                self.shm.destroy_shared_memory_region(h)
        self.handles = []


def _client_procs(cfg: LoadtestConfig) -> int:
    if cfg.client_procs:
        return cfg.client_procs
    return max(1, min(8, (os.cpu_count() or 1) // 4))


def _split(concurrency: int, procs: int) -> list[int]:
    return [n for n in (concurrency // procs + (i < concurrency % procs) for i in range(procs)) if n]


# ------------------------------------------------------------------- server ---


def _get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


class ServerProcess:
    """`python -m deploy serve` in a subprocess, its log in a file. With port
    0 the server binds a free port itself and logs it (no race with another
    process taking a port found free here)."""

    def __init__(self, argv: list[str], log_path: Path, cwd: Path = REPO_ROOT, env: dict | None = None,
                 url: str | None = None):
        self.log_path = log_path
        self.url = url  # with port 0, known once the server logs it
        self._log = open(log_path, "w")  # noqa: SIM115  open while the server runs; closed by stop()
        self.proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    @classmethod
    def for_package(cls, cfg: ServeConfig, folder: Path, log_path: Path) -> ServerProcess:
        from .serve import url

        argv = [sys.executable, "-m", "deploy", "serve", "--package", str(folder), "--host", cfg.host,
                "--port", str(cfg.port), "--max-queue-delay-ms", str(cfg.max_queue_delay_ms),
                "--timeout-s", str(cfg.timeout_s), "--max-concurrency", str(cfg.max_concurrency),
                "--max-body-mb", str(cfg.max_body_mb), "--max-inflight-mb", str(cfg.max_inflight_mb),
                "--shutdown-grace-s", str(cfg.shutdown_grace_s), "--gil-switch-ms", str(cfg.gil_switch_ms)]
        if cfg.model_name:
            argv += ["--model-name", cfg.model_name]
        if not cfg.warmup:
            argv.append("--no-warmup")
        if cfg.shared_memory:
            argv.append("--shared-memory")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
        return cls(argv, log_path, REPO_ROOT, env, url(cfg.host, cfg.port) if cfg.port else None)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise StaleArtifactError("the server exited before it was ready", self._tail())
            if self.url is None:
                self._log.flush()
                self.url = listening_url(self.log_path.read_text(errors="replace"))
            try:
                if self.url is not None and _get(self.url + "/v2/health/ready", 2.0)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"the server was not ready after {timeout:g} s: {self._tail()}")

    def metrics(self) -> dict[str, float]:
        from prometheus_client.parser import text_string_to_metric_families

        _, body = _get(self.url + "/metrics")
        out = {}
        for family in text_string_to_metric_families(body.decode()):
            for s in family.samples:
                if s.name.startswith("tvm_serve_") and s.name.endswith(("_sum", "_count")):
                    out[s.name] = s.value
                elif s.name == "tvm_serve_requests_total":  # every outcome
                    out[s.name] = out.get(s.name, 0.0) + s.value
        try:  # the event loop's thread (the server's main thread): seconds on the CPU, Linux only
            out["_loop_cpu_s"] = int(Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/schedstat").read_text().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):
            pass
        return out

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def _tail(self) -> str:
        self._log.flush()
        lines = self.log_path.read_text(errors="replace").strip().splitlines()
        return " / ".join(lines[-3:]) or "(no output)"


def listening_url(log: str) -> str | None:
    """The URL in serve's "serving ... on http://HOST:PORT" log line."""
    m = re.search(r"serving .* on (http://\S+)$", log, re.MULTILINE)
    return m.group(1) if m else None


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
    procs = _client_procs(cfg)
    levels = []
    with tempfile.TemporaryDirectory(prefix="loadtest-") as tmp:
        server = ServerProcess.for_package(serve_cfg, folder, Path(tmp) / "server.log")
        pool = manager = None
        try:
            server.wait_ready(600)
            model = json.loads(_get(server.url + "/v2/models/" + (serve_cfg.model_name or manifest["model"]))[1])
            if procs > 1:
                import multiprocessing

                ctx = multiprocessing.get_context("spawn")
                pool = ctx.Pool(procs, initializer=_import_clients)
                manager = ctx.Manager()
                ready, go = manager.Queue(), manager.Queue()
            for c in cfg.concurrency:
                parts = _split(c, procs)
                before = server.metrics()
                args = [(server.url, model["name"], manifest["inputs"], requests, expected, precision, n,
                         cfg.warmup_s, cfg.duration_s, serve_cfg.shared_memory) for n in parts]
                log.info("concurrency %d: %d client(s) in %d process(es) for %g + %g s", c, c, len(parts),
                         cfg.warmup_s, cfg.duration_s)
                if pool is None:
                    t_start, records = _client_part(*args[0])
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
        "buckets": sorted(int(b) for b in manifest["buckets"]),
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
    pending = pool.starmap_async(_client_part, [(*a, (ready, go)) for a in args])
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
    return REPO_ROOT / "results" / machine / _dt.date.today().isoformat() / f"{manifest['model']}-loadtest"


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
