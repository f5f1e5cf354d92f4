"""The serving process's CPU cost per inference request, on its event-loop
thread, and where it goes.

`python -m deploy serve` runs in a subprocess (uvicorn's loop in its main
thread); closed-loop tritonclient clients (deploy.serving.clients', in client
processes) send requests of `--request-batch` samples as binary tensors
(`binary`) or through system shared memory (`shm`). Over the measured
window the script reads the server's threads' CPU time from
/proc/<pid>/task/<tid>/schedstat (nanoseconds on the CPU): the event-loop
thread's, divided by the requests answered in the window, is the
per-request cost; requests/s is the same window's.

With `--profile`, one more run per mode and variant has cProfile on the
event-loop thread for the measured window only (started and stopped by
SIGUSR1/SIGUSR2) and splits its time by where it goes (uvicorn/httptools,
Starlette, protocol, shm, asyncio, prometheus, logging...); the profiler
inflates Python-heavy parts, so those shares are a guide, the unprofiled
runs the numbers.

`--compute null` (the default) replaces the batch's staging, module run and
collection by zeros of the outputs' shapes in the server (the batcher, its metrics and the HTTP path
are unchanged), so that the server path is what is measured even on a
2-core machine (the clients check the answers against those zeros).
`--compute real` runs the package.

`--baseline REV` runs the same measurements with the `deploy` package of
git revision REV (git archive into a temporary folder) as well, each
repetition of the two variants one after the other.

    .venv/bin/python scripts/serve_overhead.py --package artifacts/tiny_cnn/llvm-znver3-fp32/package \\
        --baseline HEAD --repeat 2 --profile --out results/cpu/2026-11-30/serve-overhead

Builds nothing: --package is an existing package (make tune MODEL=tiny_cnn
TARGET=llvm TRIALS=0 BUCKETS=1,8,32 builds one). Writes results.json and
results.md under --out.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import multiprocessing
import os
import platform
import pstats
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import results_files

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# Runs `deploy serve` (argv[3:]) in the server process. argv[1]: where to
# dump the profile ("" for none), argv[2]: "null" or "real" compute.
LAUNCHER = r"""
import cProfile, signal, sys, time
import numpy as np
from deploy import cli, runtime

prof_path, compute = sys.argv[1], sys.argv[2]
if compute == "null":
    real_load = runtime.load

    class NullCompute:
        def __init__(self, predictor, outputs):
            self.predictor, self.outputs = predictor, outputs

        def __getattr__(self, name):
            return getattr(self.predictor, name)

        # The batcher's three steps (Predictor.stage, launch, collect), no copies, no module.
        def stage(self, parts):
            rows = [int(p[0].shape[0]) for p in parts]
            return runtime.Batch(0, sum(rows), None, rows, {})

        def launch(self, batch):
            return batch

        def collect(self, batch):
            return {o["name"]: np.zeros((batch.rows, *o["shape"]), o["dtype"]) for o in self.outputs}

    def load(folder, *args, **kwargs):
        p = real_load(folder, *args, **kwargs)
        return NullCompute(p, runtime.check_package(folder)["outputs"])

    runtime.load = load
if prof_path:
    box = {}

    def begin(*_):
        box["p"] = cProfile.Profile(time.thread_time)
        box["p"].enable()

    def end(*_):
        box["p"].disable()
        box["p"].dump_stats(prof_path)

    signal.signal(signal.SIGUSR1, begin)
    signal.signal(signal.SIGUSR2, end)
sys.exit(cli.main(sys.argv[3:]))
"""

# Self time (cProfile's tottime) by where it is spent, from the function's
# file (first match wins); C functions ("~") count for their callers.
CATEGORIES = [
    ("disconnect watcher (_disconnected)", lambda f, n: f.endswith(("deploy/serve.py", "deploy/serving/serve.py", "deploy/serving/app.py", "deploy/serving/batcher.py")) and n == "_disconnected"),
    ("batcher submit (serve.Batcher.submit)", lambda f, n: f.endswith(("deploy/serve.py", "deploy/serving/serve.py", "deploy/serving/app.py", "deploy/serving/batcher.py")) and n == "submit"),
    ("body read (serve._read_body, _reserve)", lambda f, n: f.endswith(("deploy/serve.py", "deploy/serving/serve.py", "deploy/serving/app.py", "deploy/serving/batcher.py")) and n in ("_read_body", "_reserve")),
    ("serve handler (infer, _infer, _error...)", lambda f, n: f.endswith(("deploy/serve.py", "deploy/serving/serve.py", "deploy/serving/app.py", "deploy/serving/batcher.py"))),
    ("shm region read/write (deploy.serving.shm)", lambda f, n: f.endswith(("deploy/shm.py", "deploy/serving/shm.py"))),
    ("protocol.decode (+pydantic)", lambda f, n: f.endswith(("deploy/protocol.py", "deploy/serving/protocol.py")) and n != "encode"),
    ("protocol.encode (+json)", lambda f, n: f.endswith(("deploy/protocol.py", "deploy/serving/protocol.py"))),
    ("prometheus metrics", lambda f, n: "prometheus_client" in f),
    ("logging", lambda f, n: "/logging/" in f),
    ("Starlette Response", lambda f, n: "starlette/responses.py" in f),
    ("Starlette Request / body stream", lambda f, n: "starlette/requests.py" in f),
    ("Starlette routing, middleware, datastructures", lambda f, n: "starlette" in f),
    ("uvicorn HTTP protocol (httptools)", lambda f, n: "uvicorn" in f or "httptools" in f),
    ("asyncio futures, tasks, wait, timeout", lambda f, n: "/asyncio/" in f or "uvloop" in f),
    ("concurrent.futures", lambda f, n: "concurrent/futures" in f),
    ("threading", lambda f, n: f.endswith("threading.py")),
    ("numpy", lambda f, n: "numpy" in f),
    ("pydantic", lambda f, n: "pydantic" in f),
    ("json", lambda f, n: "/json/" in f),
    ("other Python", lambda f, n: True),
]


def category(func: tuple) -> str | None:
    f, _, n = func
    if f == "~":
        return None
    return next(name for name, test in CATEGORIES if test(f, n))


def split_profile(path: Path) -> dict[str, float]:
    """Seconds of self time per category; a C function's time goes to its
    callers' categories in proportion to the time each caller spent in it."""
    stats = pstats.Stats(str(path)).stats
    out: dict[str, float] = {}

    def owner(func, depth=0) -> dict[str, float]:
        cat = category(func)
        if cat is not None or depth > 5:
            return {cat or "other Python": 1.0}
        callers = stats.get(func, (0, 0, 0, 0, {}))[4]
        total = sum(c[2] for c in callers.values()) or 1.0
        shares: dict[str, float] = {}
        for caller, c in callers.items():
            for k, v in owner(caller, depth + 1).items():
                shares[k] = shares.get(k, 0.0) + v * (c[2] / total if total else 0)
        return shares or {"C, no caller (event loop)": 1.0}

    for func, (_, _, tt, _, _) in stats.items():
        for k, share in owner(func).items():
            out[k] = out.get(k, 0.0) + tt * share
    return out


def profile_top(path: Path, n: int = 25) -> list[dict]:
    stats = pstats.Stats(str(path)).stats
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:n]
    return [{"function": f"{Path(f).name}:{line}({name})", "calls": nc, "tottime_s": tt, "cumtime_s": ct}
            for (f, line, name), (_, nc, tt, ct, _) in rows]


# ------------------------------------------------------------- raw client ---


def raw_client_part(url: str, model: str, specs: list[dict], requests: list, expected: list, precision: str,
                    concurrency: int, warmup_s: float, duration_s: float, shared_memory: bool, sync) -> tuple:
    """As deploy.serving.clients.client_part, with keep-alive connections on raw
    sockets and request bodies built once by tritonclient
    (generate_request_body: the bytes its clients send): a client that costs
    little CPU, so that on 2 cores the server is what is loaded. Answers are
    checked for status 200 only. Through shared memory, each connection
    has its input region (written once) and output region."""
    import asyncio

    try:
        import uvloop
    except ImportError:
        uvloop = None
    return (uvloop.run if uvloop else asyncio.run)(_raw_clients(url, model, specs, requests, expected, concurrency,
                                                                 warmup_s, duration_s, shared_memory, sync))


async def _raw_clients(url, model, specs, requests, expected, concurrency, warmup_s, duration_s, shared_memory,
                       sync):
    import asyncio
    import contextlib

    import tritonclient.http as th
    from tritonclient.utils import np_to_triton_dtype

    host, port = url.removeprefix("http://").rsplit(":", 1)
    host = host.strip("[]")
    regions, handles = [], []
    sync_client = th.InferenceServerClient(url.removeprefix("http://")) if shared_memory else None
    bodies = []  # per connection: the request bytes, headers included
    for k in range(concurrency):
        arrays = requests[k % len(requests)]
        if shared_memory:
            import tritonclient.utils.shared_memory as shm

            tag = f"so{os.getpid()}-{k}"
            out_bytes = sum(a.nbytes for a in expected[0].values())
            h_in = shm.create_shared_memory_region(tag + "i", "/" + tag + "i", sum(a.nbytes for a in arrays))
            h_out = shm.create_shared_memory_region(tag + "o", "/" + tag + "o", out_bytes)
            handles += [h_in, h_out]
            shm.set_shared_memory_region(h_in, arrays)
            sync_client.register_system_shared_memory(tag + "i", "/" + tag + "i", sum(a.nbytes for a in arrays))
            sync_client.register_system_shared_memory(tag + "o", "/" + tag + "o", out_bytes)
            regions += [tag + "i", tag + "o"]
            inputs, offset = [], 0
            for spec, a in zip(specs, arrays):
                t = th.InferInput(spec["name"], list(a.shape), np_to_triton_dtype(a.dtype))
                inputs.append(t.set_shared_memory(tag + "i", a.nbytes, offset))
                offset += a.nbytes
            outputs, offset = [], 0
            for name, a in expected[0].items():
                o = th.InferRequestedOutput(name, binary_data=True)
                o.set_shared_memory(tag + "o", a.nbytes, offset)
                outputs.append(o)
                offset += a.nbytes
            body, header_length = th.InferenceServerClient.generate_request_body(inputs, outputs)
        else:
            inputs = []
            for spec, a in zip(specs, arrays):
                t = th.InferInput(spec["name"], list(a.shape), np_to_triton_dtype(a.dtype))
                t.set_data_from_numpy(a, binary_data=True)
                inputs.append(t)
            body, header_length = th.InferenceServerClient.generate_request_body(inputs)
        head = f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Length: {len(body)}\r\n"
        if header_length is not None:
            head += f"Inference-Header-Content-Length: {header_length}\r\n"
        bodies.append(head.encode() + b"\r\n" + body)
    ready, go = sync
    ready.put(os.getpid())
    t_start = await asyncio.to_thread(go.get, True, 300)
    t_end = t_start + warmup_s + duration_s
    records = []

    async def one(k: int) -> None:
        reader, writer = await asyncio.open_connection(host, int(port))
        await asyncio.sleep(max(0.0, t_start - time.monotonic()))
        data = bodies[k]
        try:
            while time.monotonic() < t_end:
                sent = time.monotonic()
                writer.write(data)
                head = await reader.readuntil(b"\r\n\r\n")
                status = int(head[9:12])
                length = 0
                for line in head.split(b"\r\n"):
                    if line[:15].lower() == b"content-length:":
                        length = int(line[15:])
                await reader.readexactly(length)
                records.append((sent, time.monotonic(), "ok" if status == 200 else f"http {status}"))
        finally:
            writer.close()

    try:
        await asyncio.gather(*(one(k) for k in range(concurrency)))
    finally:
        for name in regions:
            with contextlib.suppress(Exception):
                sync_client.unregister_system_shared_memory(name)
        for h in handles:
            with contextlib.suppress(Exception):
                shm.destroy_shared_memory_region(h)
    return t_start, records


# ----------------------------------------------------------------- process ---


def cpu_ns(pid: int) -> dict[int, int]:
    """Nanoseconds on the CPU of each thread of `pid`."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out[int(tid)] = int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return out


def start_server(package: Path, mode: str, compute: str, root: Path, log: Path, profile: Path | None, extra: list[str]):
    """`deploy serve` through LAUNCHER (null or real compute, cProfile on the
    loop), from the source tree `root` (the baseline's or this one); waiting
    and stopping are deploy.serving.server_process.ServerProcess's."""
    from deploy.serving.server_process import ServerProcess

    argv = [sys.executable, "-c", LAUNCHER, str(profile or ""), compute, "serve", "--package", str(package),
            "--port", "0", *extra]
    if mode == "shm":
        argv.append("--shared-memory")
    return ServerProcess(argv, log, root, dict(os.environ, PYTHONPATH=str(root)))


def one_run(args, pool, sync, package: Path, root: Path, mode: str, specs, requests, expected, precision,
            concurrency: int, work: Path, profile: Path | None) -> dict:
    from deploy.serving import clients as load_clients

    ready, go = sync
    server = start_server(package, mode, args.compute, root, work / f"server-{mode}-{time.time_ns()}.log", profile,
                    args.serve_args.split() if args.serve_args else [])
    try:
        server.wait_ready(300)
        parts = load_clients.split_clients(concurrency, args.client_procs)
        call = [(server.url, args.model_name or args.model, specs, requests, expected,
                 precision, n, args.warmup_s, args.duration_s, mode == "shm", (ready, go)) for n in parts]
        client = raw_client_part if args.client == "raw" else load_clients.client_part
        pending = pool.starmap_async(client, call)
        for _ in parts:
            ready.get(timeout=300)
        t_start = time.monotonic() + 0.1
        for _ in parts:
            go.put(t_start)
        t_measure, t_end = t_start + args.warmup_s, t_start + args.warmup_s + args.duration_s
        time.sleep(max(0.0, t_measure - time.monotonic()))
        if profile:
            server.proc.send_signal(signal.SIGUSR1)
        c0, w0 = cpu_ns(server.proc.pid), time.monotonic()
        time.sleep(max(0.0, t_end - time.monotonic()))
        c1, w1 = cpu_ns(server.proc.pid), time.monotonic()
        if profile:
            server.proc.send_signal(signal.SIGUSR2)
        records = [r for _, part in pending.get(timeout=args.warmup_s + args.duration_s + 120) for r in part]
    finally:
        rc = server.stop()
    done = [r for r in records if t_measure <= r[1] <= t_end]
    statuses: dict[str, int] = {}
    for r in done:
        statuses[r[2]] = statuses.get(r[2], 0) + 1
    answered = statuses.get("ok", 0) + statuses.get("mismatch", 0)  # HTTP 200 (mismatch: --compute null)
    pid = server.proc.pid
    loop = (c1.get(pid, 0) - c0.get(pid, 0)) / 1e9
    others = sum(c1[t] - c0.get(t, 0) for t in c1 if t != pid) / 1e9
    window = w1 - w0
    lat = sorted((r[1] - r[0]) * 1e3 for r in records if r[0] >= t_measure and r[1] <= t_end)
    return {
        "concurrency": concurrency,
        "window_s": window,
        "answered": answered,
        "statuses": statuses,
        "requests_per_s": answered / (t_end - t_measure),
        "samples_per_s": answered * args.request_batch / (t_end - t_measure),
        "p50_ms": lat[len(lat) // 2] if lat else None,
        "loop_cpu_s": loop,
        "loop_busy": loop / window,
        "loop_cpu_us_per_request": loop / answered * 1e6 if answered else None,
        "other_threads_cpu_us_per_request": others / answered * 1e6 if answered else None,
        "server_exit_status": rc,
    }


def variant_root(rev: str | None, work: Path) -> Path:
    """REPO for the working tree, or a folder with REV's deploy package."""
    if rev is None:
        return REPO
    dest = work / f"rev-{rev.replace('/', '_')}"
    dest.mkdir()
    archive = subprocess.run(["git", "archive", rev, "deploy"], cwd=REPO, check=True, capture_output=True).stdout
    with tarfile.open(fileobj=__import__("io").BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")
    return dest


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--package", required=True, help="an existing package (tiny_cnn on llvm)")
    ap.add_argument("--modes", default="binary,shm", help="binary, shm or both")
    ap.add_argument("--concurrency", default="32")
    ap.add_argument("--request-batch", type=int, default=8)
    ap.add_argument("--compute", choices=("null", "real"), default="null")
    ap.add_argument("--warmup-s", type=float, default=2.0)
    ap.add_argument("--duration-s", type=float, default=8.0)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--client-procs", type=int, default=1)
    ap.add_argument("--client", choices=("raw", "triton"), default="raw",
                    help="raw: keep-alive sockets, tritonclient's request bytes (cheap); triton: deploy.serving.clients'")
    ap.add_argument("--baseline", metavar="REV", help="also measure REV's deploy package (e.g. HEAD)")
    ap.add_argument("--profile", action="store_true", help="one more run per mode and variant under cProfile")
    ap.add_argument("--serve-args", default="", help="more `deploy serve` flags, one string")
    ap.add_argument("--model-name", default="")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import numpy as np

    from deploy import runtime

    package = Path(args.package).resolve()
    manifest = runtime.check_package(package)
    requests = [[np.random.default_rng(100 + k).standard_normal((args.request_batch, *s["shape"])).astype(s["dtype"])
                 for s in manifest["inputs"]] for k in range(8)]
    if args.compute == "null":  # what the server's null compute answers
        expected = [{o["name"]: np.zeros((args.request_batch, *o["shape"]), o["dtype"]) for o in manifest["outputs"]}
                    for _ in requests]
    else:
        import deploy

        predictor = deploy.load(package)
        expected = [predictor(*r) for r in requests]
        del predictor
    args.model = manifest["model"]
    modes = args.modes.split(",")
    levels = [int(c) for c in args.concurrency.split(",")]
    variants = ([("baseline", args.baseline)] if args.baseline else []) + [("current", None)]

    ctx = multiprocessing.get_context("spawn")
    manager = ctx.Manager()
    sync = (manager.Queue(), manager.Queue())
    runs = []
    profiles = {}
    with tempfile.TemporaryDirectory(prefix="serve-overhead-") as tmp, \
            ctx.Pool(args.client_procs, initializer=_import_clients) as pool:
        work = Path(tmp)
        roots = {name: variant_root(rev, work) for name, rev in variants}
        for mode in modes:
            for c in levels:
                for rep in range(args.repeat):
                    for name, _ in variants:
                        r = one_run(args, pool, sync, package, roots[name], mode, manifest["inputs"], requests,
                                    expected, manifest.get("precision", "fp32"), c, work, None)
                        runs.append({"mode": mode, "variant": name, "repeat": rep, **r})
                        print(f"{mode:6} {name:8} c={c} #{rep}: {r['loop_cpu_us_per_request'] or float('nan'):.0f} us/request on the "
                              f"loop, {r['requests_per_s']:.0f} requests/s, loop busy {r['loop_busy']:.0%}, "
                              f"{r['statuses']}", flush=True)
            if args.profile:
                for name, _ in variants:
                    path = work / f"{mode}-{name}.prof"
                    r = one_run(args, pool, sync, package, roots[name], mode, manifest["inputs"], requests, expected,
                                manifest.get("precision", "fp32"), levels[-1], work, path)
                    for _ in range(50):
                        if path.exists():
                            break
                        time.sleep(0.1)
                    split = split_profile(path)
                    n = r["answered"] or 1
                    profiles[f"{mode}/{name}"] = {
                        "run": r,
                        "us_per_request": {k: v / n * 1e6 for k, v in sorted(split.items(), key=lambda kv: -kv[1])},
                        "top": profile_top(path),
                    }
    manager.shutdown()

    import tritonclient
    import uvicorn

    from deploy.bench import report as bench_report

    report = {
        "date": _dt.date.today().isoformat(),
        "command": " ".join([sys.executable.replace(str(REPO) + "/", ""), *sys.argv]),
        "machine": {"cpus": os.cpu_count(), "processor": bench_report.cpu_name(), "python": platform.python_version(),
                    "uvicorn": uvicorn.__version__, "tritonclient": getattr(tritonclient, "__version__", None)},
        "package": str(package),
        "config": vars(args),
        "runs": runs,
        "summary": summarize(runs),
        "profiles": profiles,
    }
    return results_files.write(args.out, report, markdown(report))


def _import_clients() -> None:
    import tritonclient.http.aio  # noqa: F401


def summarize(runs: list[dict]) -> list[dict]:
    keys = sorted({(r["mode"], r["concurrency"], r["variant"]) for r in runs},
                  key=lambda k: (k[0], k[1], k[2] != "baseline"))
    out = []
    for mode, c, variant in keys:
        rs = [r for r in runs if (r["mode"], r["concurrency"], r["variant"]) == (mode, c, variant)]
        out.append({"mode": mode, "concurrency": c, "variant": variant,
                    "loop_cpu_us_per_request": [round(r["loop_cpu_us_per_request"] or 0, 1) for r in rs],
                    "requests_per_s": [round(r["requests_per_s"], 1) for r in rs],
                    "p50_ms": [round(r["p50_ms"] or 0, 2) for r in rs],
                    "loop_busy": [round(r["loop_busy"], 3) for r in rs]})
    return out


def markdown(report: dict) -> list[str]:
    cfg = report["config"]
    lines = [f"# Serving overhead per request, {report['date']}", "",
             (f"{report['machine']['cpus']} CPUs ({report['machine']['processor']}); package `{report['package']}`; "
              f"{cfg['request_batch']}-sample requests, compute `{cfg['compute']}`, {cfg['client_procs']} client "
              f"process(es), {cfg['warmup_s']:g} s + {cfg['duration_s']:g} s measured per run."), "",
             "    " + report["command"], "",
             "| mode | concurrency | variant | loop CPU us/request | requests/s | p50 ms | loop busy |",
             "|---|---:|---|---|---|---|---|"]
    for s in report["summary"]:
        lines.append(f"| {s['mode']} | {s['concurrency']} | {s['variant']} | "
                     f"{', '.join(f'{v:.0f}' for v in s['loop_cpu_us_per_request'])} | "
                     f"{', '.join(f'{v:.0f}' for v in s['requests_per_s'])} | "
                     f"{', '.join(f'{v:.1f}' for v in s['p50_ms'])} | "
                     f"{', '.join(f'{v:.0%}' for v in s['loop_busy'])} |")
    for key, p in report["profiles"].items():
        r = dict(p["run"], loop_cpu_us_per_request=p["run"]["loop_cpu_us_per_request"] or float("nan"))
        lines += ["", (f"## cProfile, {key} (concurrency {r['concurrency']}): loop CPU "
                       f"{r['loop_cpu_us_per_request']:.0f} us/request under the profiler"), "",
                  "| where (self time) | us/request |", "|---|---:|"]
        lines += [f"| {k} | {v:.1f} |" for k, v in p["us_per_request"].items() if v >= 0.5]
        lines += [(f"| (outside Python frames: uvloop, syscalls; CPU minus profiled) | "
                   f"{r['loop_cpu_us_per_request'] - sum(p['us_per_request'].values()):.1f} |")]
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
