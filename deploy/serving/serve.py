"""Serve a package over HTTP with the Open Inference Protocol (KServe v2).

    serve.run(ServeConfig(...), "artifacts/.../package")     # blocks; SIGTERM drains
    server = serve.start(ServeConfig(port=0), folder)        # in a thread; server.url

Before anything is bound or loaded, the package is checked as `deploy.load`
checks it (manifest, sha256 of every module, TVM version, GPU architecture):
a package that fails is never loaded and the process exits with one line.
The HTTP side then starts at once (live); the batcher thread loads the
modules, runs every bucket once, and only then is the server ready.

Dynamic batching: one thread owns the Predictor (every TVM call is made from
it). Requests queue; the thread takes the first, waits at most
`max_queue_delay_ms` (from that request's arrival) for more, as long as their
rows fit the largest bucket, and copies each request's rows into its place
in a host buffer of the smallest bucket that holds them (page-locked memory
on a GPU; shared-memory inputs are read straight into it). It then collects
the batch running on the device, if any, answers its requests with their own
rows, and launches the new one: the copies to the device, the module and the
copies back are queued without waiting, so the next batch is gathered and
staged while this one runs (waiting for more requests only until the running
batch is expected to be done). When nothing is queued, the running batch is
collected at once. A request larger than the largest bucket runs alone,
split across buckets by the Predictor.

Libraries: Starlette (routing, requests, responses) on uvicorn (HTTP/1.1,
graceful shutdown), prometheus_client (metrics), pydantic and tritonclient's
datatype tables through `deploy.serving.protocol`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import queue
import socket
import sys
import threading
import time
import zlib
from pathlib import Path

import numpy as np

from ..config import ServeConfig
from ..errors import (
    DeployError,
    ModelNotFoundError,
    PayloadTooLargeError,
    RequestError,
    RequestTimeoutError,
    UnavailableError,
    UnsupportedEncodingError,
)
from . import protocol, shm

log = logging.getLogger(__name__)

MODEL_VERSION = "1"  # a package is one version of one model
SERVER_NAME = "tvm-deploy"
# Bodies (and answers) larger than this are decoded (encoded) in a worker
# thread: parsing megabytes of JSON on the event loop would hold up every
# other request, health checks included.
OFFLOAD_BYTES = 256 * 1024
# Seconds; fine enough for GPU batches of a millisecond, wide enough for CPU ones of seconds.
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


# ------------------------------------------------------------------ metrics ---


class Metrics:
    """Prometheus metrics of one server, in a registry of its own (two servers
    in one process, as in the tests, do not share counters)."""

    def __init__(self, model: str):
        from prometheus_client import (
            CollectorRegistry,
            Counter,
            Gauge,
            Histogram,
            ProcessCollector,
            disable_created_metrics,
        )

        disable_created_metrics()  # the *_created series only double every metric's size
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)
        p = "tvm_serve_"
        self.requests = Counter(p + "requests", "Inference requests by outcome (success, bad_request, not_found, "
                                "too_large, overloaded, not_ready, timeout, disconnected, shutdown, error)",
                                ["model", "outcome"], registry=r)
        self.latency = Histogram(p + "request_seconds", "Arrival to response of successful inference requests",
                                 ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Histogram(p + "queue_seconds", "Enqueued to the start of its batch", ["model"],
                               buckets=LATENCY_BUCKETS, registry=r)
        self.compute = Histogram(p + "compute_seconds", "One batch from its launch (rows already in host memory) to its outputs back",
                                 ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.batch_rows = Histogram(p + "batch_rows", "Samples per batch, before padding", ["model"],
                                    buckets=ROW_BUCKETS, registry=r)
        self.batch_requests = Histogram(p + "batch_requests", "Requests merged into one batch", ["model"],
                                        buckets=ROW_BUCKETS, registry=r)
        self.bucket_runs = Counter(p + "bucket_runs", "Module runs per batch bucket (a split request counts "
                                   "each piece)", ["model", "bucket"], registry=r)
        self.padded_rows = Counter(p + "padded_rows", "Padding rows run to fill a bucket", ["model"], registry=r)
        self.in_flight = Gauge(p + "in_flight", "Inference requests being read, queued or run", ["model"], registry=r)
        self.ready = Gauge(p + "ready", "1 once the package is loaded and warmed up", ["model"], registry=r)
        self.model = model
        self._children: dict = {}

    def child(self, metric, *labels: str):
        """`metric.labels(self.model, *labels)`, looked up once: labels()
        validates, locks and builds a key on every call, several times per
        request. Children are still created on first use (a series appears
        when it is first counted, as before)."""
        key = (metric, labels)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(self.model, *labels)
        return c


# ------------------------------------------------------------------ batcher ---


@dataclasses.dataclass(eq=False)
class _Job:
    arrays: list[np.ndarray]
    rows: int
    future: concurrent.futures.Future
    enqueued: float


_STOP = object()
# A collect that took longer than this waited for the device (not only for
# the GIL, at most the 0.5 ms switch interval, and the outputs' copy).
COLLECT_WAITED_S = 1e-3


class Batcher:
    """The one thread that runs the Predictor (see the module docstring)."""

    def __init__(self, load, max_queue_delay_s: float, metrics: Metrics):
        """`load()` returns the Predictor (loaded and warmed up); it runs in
        the batcher's own thread, so every TVM call is made from that thread."""
        self.predictor = None
        self.max_delay = max_queue_delay_s
        self.metrics = metrics
        self.max_rows = 0
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._carry = None  # a job taken from the queue that did not fit the last batch
        self._device_s: dict[int, float] = {}  # bucket -> estimated seconds from launch to outputs back
        self._stage_s = 0.0  # recent seconds to stage a batch
        self._thread = threading.Thread(target=self._main, args=(load,), name="batcher", daemon=True)
        self._thread.start()

    def submit(self, arrays: list[np.ndarray], rows: int) -> concurrent.futures.Future:
        job = _Job(arrays, rows, concurrent.futures.Future(), time.perf_counter())
        self._queue.put(job)
        return job.future

    def close(self, timeout: float | None = None) -> None:
        """Run everything already queued, then stop the thread; wait for it
        at most `timeout` seconds (it is a daemon: one still loading or
        running dies with the process)."""
        self._queue.put(_STOP)
        self._thread.join(timeout)

    def _next(self, timeout: float | None):
        if self._carry is not None:
            job, self._carry = self._carry, None
            return job
        try:
            if timeout is None:
                return self._queue.get()
            return self._queue.get(timeout=timeout) if timeout > 0 else self._queue.get_nowait()
        except queue.Empty:
            return None

    def _main(self, load) -> None:
        predictor = load()
        if predictor is None:
            return
        self.predictor, self.max_rows = predictor, predictor.max_batch
        self._loop()

    def _loop(self) -> None:
        # One batch at a time runs on the device; the next one is gathered
        # and staged (its rows copied into host memory) meanwhile, then the
        # running one is collected and answered and the staged one launched.
        # While a batch runs, the next one waits for company only until it
        # must be staged for the running one's end (see _expected_done):
        # past that, waiting would hold up the finished batch's answers.
        running = None  # (jobs, batch, launched at)
        while True:
            first = self._next(None if running is None else 0)
            if first is None:  # nothing more has arrived while the batch ran: answer it
                self._finish(*running)
                running = None
                continue
            if first is _STOP:
                if running is not None:
                    self._finish(*running)
                return
            # A job whose request timed out while queued was cancelled: skip it.
            if not first.future.set_running_or_notify_cancel():
                continue
            jobs, rows = [first], first.rows
            deadline = first.enqueued + self.max_delay
            if running is not None:
                deadline = min(deadline, self._expected_done(*running) - self._stage_s)
            while rows < self.max_rows:
                job = self._next(deadline - time.perf_counter())
                if job is None:
                    break
                if job is _STOP or rows + job.rows > self.max_rows:
                    self._carry = job
                    break
                if job.future.set_running_or_notify_cancel():
                    jobs.append(job)
                    rows += job.rows
            batch = self._stage(jobs)
            if running is not None:
                self._finish(*running)
                running = None
            if batch is not None:
                running = self._launch(jobs, batch)

    def _expected_done(self, jobs: list[_Job], batch, launched: float) -> float:
        """When the running batch should be done: now, if its launch ran it
        to the end (a CPU device; a batch split over the largest bucket),
        else its launch time plus its bucket's estimated device time."""
        if batch.pieces is not None or getattr(self.predictor, "launch_waits", False):
            return 0.0
        return launched + self._device_s.get(batch.bucket, 0.0)

    def _stage(self, jobs: list[_Job]):
        m = self.metrics
        start = time.perf_counter()
        queued = m.child(m.queue)
        for j in jobs:
            queued.observe(start - j.enqueued)
        try:
            # Each request's rows go to their place in the bucket's host
            # buffer (padded to the bucket, or a request split over the largest).
            batch = self.predictor.stage([j.arrays for j in jobs])
        except BaseException as e:  # noqa: BLE001  every waiting request gets the error, the thread lives on
            _fail(jobs, e)
            return None
        self._stage_s = _smoothed(self._stage_s or None, time.perf_counter() - start)
        for k, e in batch.errors.items():  # a request whose input could not be read; the others run
            jobs[k].future.set_exception(e)
        if len(batch.errors) == len(jobs):
            self.predictor.release(batch)
            return None
        return batch

    def _launch(self, jobs: list[_Job], batch):
        start = time.perf_counter()
        try:
            self.predictor.launch(batch)
        except BaseException as e:  # noqa: BLE001
            _fail(jobs, e)
            return None
        return jobs, batch, start

    def _finish(self, jobs: list[_Job], batch, start: float) -> None:
        m = self.metrics
        t0 = time.perf_counter()
        try:
            out = self.predictor.collect(batch)
        except BaseException as e:  # noqa: BLE001
            _fail(jobs, e)
            return
        done = time.perf_counter()
        took, last = done - start, self._device_s.get(batch.bucket)
        if done - t0 > COLLECT_WAITED_S:  # collect waited for the device: the batch ended about now
            self._device_s[batch.bucket] = _smoothed(last, took)
        elif last is not None:  # it ended before collect: its device time was at most `took`
            self._device_s[batch.bucket] = min(last, took)
        rows = batch.rows
        m.child(m.compute).observe(done - start)
        m.child(m.batch_rows).observe(rows)
        m.child(m.batch_requests).observe(len(jobs))
        for bucket, n in self.predictor.plan(rows):  # one piece, or the pieces of a split request
            m.child(m.bucket_runs, str(bucket)).inc()
            m.child(m.padded_rows).inc(bucket - n)
        begin = 0
        for j in jobs:
            if not j.future.done():
                j.future.set_result({k: v[begin : begin + j.rows] for k, v in out.items()})
            begin += j.rows


def _smoothed(last: float | None, x: float) -> float:
    """A running estimate moved 30% of the way to the new sample `x`."""
    return x if last is None else 0.7 * last + 0.3 * x


def _fail(jobs: list[_Job], e: BaseException) -> None:
    for j in jobs:
        if not j.future.done():
            j.future.set_exception(e)


# ------------------------------------------------------------------- server ---


class InferenceServer:
    """The Starlette application and the state behind it."""

    def __init__(self, cfg: ServeConfig, folder: str | Path, manifest: dict, loader=None):
        from .. import runtime

        self.cfg = cfg
        self.folder = Path(folder)
        self.manifest = manifest
        self.model = cfg.model_name or manifest["model"]
        # The manifest was checked (every module hashed) before the server was built.
        self.loader = loader or (lambda f: runtime.load(f, manifest=manifest))
        self.metrics = Metrics(self.model)
        self.batcher: Batcher | None = None
        self.load_error: BaseException | None = None
        self.ready = False  # set by the batcher thread once the package is loaded and warmed up
        self.loaded = threading.Event()  # set when ready, when loading failed, or when stopped while loading
        self.stopping = threading.Event()  # set when the server begins to shut down
        self.stop_requested = None  # time.monotonic() of that moment
        self.on_load_error = lambda: None
        self.in_flight = 0
        self.in_flight_bytes = 0  # request bodies being read, queued or run, as received (or decompressed)
        self.max_body = int(cfg.max_body_mb * 1024 * 1024)
        self.max_in_flight_bytes = int(cfg.max_inflight_mb * 1024 * 1024)
        self.regions = shm.Regions() if cfg.shared_memory else None  # registered shared memory
        self.model_metadata = {
            "name": self.model,
            "versions": [MODEL_VERSION],
            "platform": "tvm",
            "inputs": protocol.tensor_metadata(manifest["inputs"]),
            "outputs": protocol.tensor_metadata(manifest["outputs"]),
        }
        self.app = self._app()

    # -- loading ---------------------------------------------------------

    def begin_stop(self) -> None:
        """The server stops accepting: loading and warm-up stop at the next
        bucket, and the shutdown grace starts counting."""
        if self.stop_requested is None:
            self.stop_requested = time.monotonic()
        self.stopping.set()

    def _load(self):
        """In the batcher's thread: the Predictor, or None if loading failed
        or the server was stopped first."""
        try:
            predictor = self.loader(self.folder)
            if self.cfg.warmup:
                # First runs compile lazily loaded kernels and capture CUDA graphs.
                for b in predictor.buckets:
                    if self.stopping.is_set():
                        break
                    predictor.run_bucket(b, predictor.random_inputs(b))
            if self.stopping.is_set():
                log.info("stopped while loading %s", self.folder)
                self.loaded.set()
                return None
        except BaseException as e:
            self.load_error = e
            if isinstance(e, DeployError):
                log.error("loading %s failed: %s", self.folder, e)
            else:
                log.exception("loading %s failed", self.folder)
            self.on_load_error()
            self.loaded.set()
            return None
        self.ready = True
        self.metrics.ready.labels(self.model).set(1)
        log.info("model %s ready: buckets %s from %s", self.model, predictor.buckets, self.folder)
        self.loaded.set()
        return predictor

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        self.batcher = Batcher(self._load, self.cfg.max_queue_delay_ms / 1e3, self.metrics)
        yield
        # uvicorn gets here after in-flight requests finished (or the grace
        # ran out). The batcher may still be loading or warming up: wait for
        # it only what is left of the grace.
        self.begin_stop()
        self.ready = False
        self.metrics.ready.labels(self.model).set(0)
        left = self.cfg.shutdown_grace_s - (time.monotonic() - self.stop_requested)
        await asyncio.to_thread(self.batcher.close, max(left, 0.0))
        if self.regions is not None:
            self.regions.close()

    # -- endpoints -------------------------------------------------------

    def _app(self):
        from starlette.applications import Starlette
        from starlette.exceptions import HTTPException
        from starlette.routing import Route

        model = "/v2/models/{name}"
        version = "/v2/models/{name}/versions/{version}"
        routes = [
            Route("/v2/health/live", self.live),
            Route("/v2/health/ready", self.server_ready),
            Route("/v2", self.server_metadata),
            Route(model, self.model_meta),
            Route(version, self.model_meta),
            Route(model + "/ready", self.model_ready),
            Route(version + "/ready", self.model_ready),
            Route(model + "/infer", self.infer, methods=["POST"]),
            Route(version + "/infer", self.infer, methods=["POST"]),
            Route("/metrics", self.prometheus),
        ]
        if self.regions is not None:
            shm_root = "/v2/systemsharedmemory"
            routes += [
                Route(shm_root + "/status", self.shm_status),
                Route(shm_root + "/region/{region}/status", self.shm_status),
                Route(shm_root + "/region/{region}/register", self.shm_register, methods=["POST"]),
                Route(shm_root + "/region/{region}/unregister", self.shm_unregister, methods=["POST"]),
                Route(shm_root + "/unregister", self.shm_unregister, methods=["POST"]),
            ]

        async def http_error(request, exc: HTTPException):
            return _error(exc.status_code, f"{exc.detail} | got {request.method} {request.url.path}")

        async def internal_error(request, exc: Exception):
            log.error("internal error on %s %s", request.method, request.url.path, exc_info=exc)
            return _error(500, _internal(exc))

        starlette = Starlette(routes=routes, lifespan=self.lifespan,
                              exception_handlers={HTTPException: http_error, Exception: internal_error})
        return self._fast_infer(starlette, internal_error)

    def _fast_infer(self, starlette, internal_error):
        """The ASGI app: POST .../infer straight to `infer`, everything else
        (and lifespan) through Starlette. Starlette's middleware, router and
        route wrappers are ~100 Python calls per request, a third of what
        an inference request costs the event loop; `infer` answers every
        exception itself (only cancellation passes), so they add nothing to it
        (one that escaped would get Starlette's `internal_error` answer all the same).
        The path is matched as the router matches the two infer routes
        ({name} and {version} are one path segment each)."""
        import re

        from starlette.requests import Request

        path = re.compile(r"/v2/models/([^/]+)(?:/versions/([^/]+))?/infer")
        infer = self.infer

        async def app(scope, receive, send):
            if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path"):
                m = path.fullmatch(scope["path"])
                if m is not None:
                    name, version = m.groups()
                    scope["path_params"] = {"name": name} if version is None else {"name": name, "version": version}
                    request = Request(scope, receive, send)
                    try:
                        response = await infer(request)
                    except Exception as e:  # noqa: BLE001  as Starlette would (infer answers its own)
                        response = await internal_error(request, e)
                    await response(scope, receive, send)
                    return
            await starlette(scope, receive, send)

        return app

    async def live(self, request):
        return _json({"live": True})

    async def server_ready(self, request):
        # The protocol says a 4xx means "not ready"; 503 is what KServe itself
        # answers and what load balancers expect. Clients only test for 200.
        return _json({"ready": self.ready}, 200 if self.ready else 503)

    async def server_metadata(self, request):
        return _json({"name": SERVER_NAME, "version": _version(), "extensions": [
            e for e in protocol.EXTENSIONS if e != "system_shared_memory" or self.regions is not None]})

    def _check_model(self, request) -> None:
        name = request.path_params["name"]
        if name != self.model:
            raise ModelNotFoundError("unknown model", repr(name), repr(self.model))
        version = request.path_params.get("version")
        if version is not None and version != MODEL_VERSION:
            raise ModelNotFoundError(f"unknown version of model '{name}'", repr(version), repr(MODEL_VERSION))

    async def model_meta(self, request):
        try:
            self._check_model(request)
        except RequestError as e:
            return _error(e.status, str(e))
        return _json(self.model_metadata)

    async def model_ready(self, request):
        try:
            self._check_model(request)
        except RequestError as e:
            return _error(e.status, str(e))
        return _json({"name": self.model, "ready": self.ready}, 200 if self.ready else 503)

    # -- system shared memory (Triton's extension; deploy.serving.shm) -------------

    async def shm_status(self, request):
        try:
            return _json(self.regions.status(request.path_params.get("region")))
        except RequestError as e:
            return _error(e.status, str(e))

    async def shm_register(self, request):
        import json

        try:
            peer = request.client.host if request.client else None
            if peer not in ("127.0.0.1", "::1", "localhost"):
                # Shared memory is this host's: a remote client could only read or overwrite it.
                raise RequestError("shared memory is for clients on the server's host", peer, "a loopback client")
            try:
                body = json.loads(await request.body())
            except ValueError as e:
                raise RequestError("malformed JSON", str(e).split(":")[0], '{"key": ..., "offset": ..., "byte_size": ...}') from None
            self.regions.register(request.path_params["region"], body)
        except RequestError as e:
            return _error(e.status, str(e))
        return _json({})

    async def shm_unregister(self, request):
        self.regions.unregister(request.path_params.get("region"))
        return _json({})

    async def prometheus(self, request):
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        from starlette.responses import Response

        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def infer(self, request):
        from starlette.requests import ClientDisconnect

        m, label = self.metrics, self.model
        start = time.perf_counter()
        outcome = "error"
        try:
            self._check_model(request)
            if not self.ready:
                raise UnavailableError(f"model '{self.model}' is not ready yet", None, "GET /v2/health/ready to be 200",
                                       outcome="not_ready")
            if self.in_flight >= self.cfg.max_concurrency:
                raise UnavailableError("too many requests in flight", self.in_flight,
                                       f"at most {self.cfg.max_concurrency} (--max-concurrency); retry later")
            self.in_flight += 1
            in_flight = m.child(m.in_flight)
            in_flight.inc()
            reserved = [0]  # body bytes this request holds in in_flight_bytes
            try:
                response = await self._infer(request, start, reserved)
            finally:
                self.in_flight -= 1
                self.in_flight_bytes -= reserved[0]
                in_flight.dec()
            if response is None:  # the client left while its request waited
                outcome = "disconnected"
                return _error(499, "the client closed the connection before the answer")
            outcome = "success"
            m.child(m.latency).observe(time.perf_counter() - start)
            return response
        except RequestError as e:
            outcome = e.outcome
            headers = {"Retry-After": "1"} if e.status == 503 else None
            return _error(e.status, str(e), headers)
        except DeployError as e:  # the Predictor's own input checks
            outcome = "bad_request"
            return _error(400, str(e))
        except ClientDisconnect:  # nobody to answer; not the server's fault
            outcome = "disconnected"
            return _error(400, "the client closed the connection before sending the whole body")
        except asyncio.CancelledError:  # uvicorn cancels what is left when the shutdown grace ends
            outcome = "shutdown"
            raise
        except Exception as e:
            log.error("internal error in inference on %s", label, exc_info=e)
            return _error(500, _internal(e))
        finally:
            m.child(m.requests, outcome).inc()

    async def _infer(self, request, start: float, reserved: list[int]):
        """The response, or None if the client disconnected while waiting."""
        from starlette.responses import Response

        timeout = self.cfg.timeout_s
        try:
            async with asyncio.timeout(timeout):
                body = await self._read_body(request, reserved)
        except TimeoutError:
            raise RequestTimeoutError("the request body did not arrive in time", None,
                                      f"within {timeout:g} s (--timeout-s)", status=408) from None
        args = (body, request.headers.get(protocol.HEADER_LENGTH), self.manifest["inputs"], self.manifest["outputs"],
                self.model, request.path_params.get("version", MODEL_VERSION), self.regions)
        req = await asyncio.to_thread(protocol.decode, *args) if len(body) > OFFLOAD_BYTES else protocol.decode(*args)
        if req.timeout_s is not None:
            timeout = min(timeout, req.timeout_s)
        # Wait for the first of: the answer, the client's disconnect, the
        # deadline. One future that each of them completes (what
        # asyncio.wait(FIRST_COMPLETED) builds, without its sets, per-future
        # checks and the asyncio copy of the job's future that wrap_future
        # makes and chains both ways).
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()

        def wake(_=None) -> None:
            if not waiter.done():
                waiter.set_result(None)

        def answered(_) -> None:  # in the batcher's thread (or here, when cancelled below)
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
                loop.call_soon_threadsafe(wake)

        job = self.batcher.submit(req.arrays, req.batch)
        job.add_done_callback(answered)
        gone = loop.create_task(_disconnected(request))
        gone.add_done_callback(wake)
        timer = loop.call_later(max(timeout - (time.perf_counter() - start), 0.0), wake)
        try:
            await waiter
        finally:
            timer.cancel()
            gone.cancel()
            # A request still queued is then dropped by the batcher; one
            # already running finishes unseen.
            job.cancel()
        if not job.done() or job.cancelled():
            if gone.done() and not gone.cancelled():
                return None
            raise RequestTimeoutError("no answer in time", f"more than {timeout:g} s",
                                      f"at most {timeout:g} s (--timeout-s or the request's timeout)")
        result = job.result()
        outputs = [(name, result[name], binary, region) for name, binary, region in req.outputs]
        args = (self.model, MODEL_VERSION, req.id, outputs, self.regions)
        if sum(o[1].nbytes for o in outputs) > OFFLOAD_BYTES:
            body, header_length = await asyncio.to_thread(protocol.encode, *args)
        else:
            body, header_length = protocol.encode(*args)
        if header_length is None:
            return Response(body, media_type="application/json")
        return Response(body, media_type="application/octet-stream",
                        headers={protocol.HEADER_LENGTH: str(header_length)})

    def _reserve(self, reserved: list[int], size: int) -> None:
        """Count `size` body bytes of this request (in total) against --max-inflight-mb."""
        extra = size - reserved[0]
        if extra > 0 and self.in_flight_bytes + extra > self.max_in_flight_bytes:
            raise UnavailableError("too many request bytes in flight", f"{self.in_flight_bytes + extra} bytes",
                                   f"at most {self.max_in_flight_bytes} (--max-inflight-mb "
                                   f"{self.cfg.max_inflight_mb:g}); retry later")
        self.in_flight_bytes += extra
        reserved[0] = size

    async def _read_body(self, request, reserved: list[int]) -> bytes:
        limit = self.max_body
        too_large = f"at most {limit} (--max-body-mb {self.cfg.max_body_mb:g})"
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit():
            if int(declared) > limit:
                raise PayloadTooLargeError("request body is too large", f"{int(declared)} bytes", too_large)
            self._reserve(reserved, int(declared))
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise PayloadTooLargeError("request body is too large", f"more than {limit} bytes", too_large)
            if size > reserved[0]:
                self._reserve(reserved, size)
            chunks.append(chunk)
        body = b"".join(chunks)
        encoding = request.headers.get("content-encoding", "identity").strip().lower()
        if encoding in ("", "identity"):
            return body
        if encoding not in ("gzip", "deflate"):
            raise UnsupportedEncodingError("unsupported Content-Encoding", encoding, "gzip, deflate or none")
        # tritonclient's "deflate" is zlib-wrapped; gzip has its own header.
        d = zlib.decompressobj(zlib.MAX_WBITS | 16 if encoding == "gzip" else zlib.MAX_WBITS)
        try:
            if len(body) > OFFLOAD_BYTES // 8:  # compressed: it may grow 10x or more
                out = await asyncio.to_thread(d.decompress, body, limit + 1)
            else:
                out = d.decompress(body, limit + 1)
        except zlib.error as e:
            raise RequestError(f"request body is not valid {encoding}", str(e)) from None
        if len(out) > limit or d.unconsumed_tail:
            raise PayloadTooLargeError("decompressed request body is too large", f"more than {limit} bytes",
                                       too_large)
        self._reserve(reserved, max(len(out), reserved[0]))
        return out


async def _disconnected(request) -> None:
    """Returns when the client closes the connection (the body is read:
    the server's next message is the disconnect)."""
    try:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    except Exception:  # cannot tell: then never report a disconnect
        log.debug("cannot watch for the client's disconnect", exc_info=True)
        await asyncio.Future()


def _version() -> str:
    import importlib.metadata as md

    try:
        return md.version(SERVER_NAME)
    except md.PackageNotFoundError:
        return "unknown"


def _json(data, status: int = 200):
    from starlette.responses import JSONResponse

    return JSONResponse(data, status)


def _error(status: int, message: str, headers: dict | None = None):
    """The protocol's error body: {"error": "<one line>"}."""
    from starlette.responses import JSONResponse

    return JSONResponse({"error": message}, status, headers=headers)


def _internal(e: BaseException) -> str:
    first = (str(e).strip().splitlines() or [""])[0][:300]
    return f"internal error | {type(e).__name__}: {first}" if first else f"internal error | {type(e).__name__}"


# -------------------------------------------------------------- lifecycle ---


def check(folder: str | Path) -> dict:
    """Everything checked before any native code is loaded: the manifest, the
    sha256 of every file, the TVM version, and the GPU architecture."""
    from .. import runtime

    manifest = runtime.check_package(folder)
    runtime.check_device(manifest)
    return manifest


def url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        from ..errors import ConfigError

        raise ConfigError(f"cannot listen on {host}:{port}", e.strerror, "a free port (--port) and a local address (--host)") from None
    sock.set_inheritable(True)
    return sock


def _uvicorn_server(app: InferenceServer):
    import uvicorn

    class _Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            app.begin_stop()  # before uvicorn waits for connections: a loading batcher stops at once
            await super().shutdown(sockets)

        @contextlib.contextmanager
        def capture_signals(self):
            # uvicorn re-raises SIGTERM/SIGINT once it has drained, so the
            # process dies of the signal; a server that drained cleanly exits 0.
            with super().capture_signals():
                try:
                    yield
                finally:
                    self._captured_signals.clear()

    config = uvicorn.Config(
        app.app,
        log_config=None,  # keep the project's logging
        access_log=False,  # one line per request is the metrics' job
        timeout_graceful_shutdown=app.cfg.shutdown_grace_s,
        lifespan="on",
    )
    return _Server(config)


class RunningServer:
    """A server running in a thread of this process (tests, notebooks)."""

    def __init__(self, app: InferenceServer, sock: socket.socket):
        self.app = app
        self.host, self.port = sock.getsockname()[:2]
        self.url = url(self.host, self.port)
        self._server = _uvicorn_server(app)
        app.on_load_error = lambda: setattr(self._server, "should_exit", True)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, name="uvicorn",
                                        daemon=True)
        self._thread.start()

    def wait_ready(self, timeout: float = 300.0) -> RunningServer:
        if not self.app.loaded.wait(timeout):
            raise TimeoutError(f"the package did not load in {timeout} s")
        if self.app.load_error is not None:
            self.stop()
            raise self.app.load_error
        return self

    def stop(self, timeout: float | None = None) -> None:
        """As on SIGTERM: stop accepting, finish in-flight requests, stop."""
        self._server.should_exit = True
        self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()


def start(cfg: ServeConfig, folder: str | Path, wait: bool = True, loader=None) -> RunningServer:
    """Check the package, listen, and load it, in a thread of this process."""
    manifest = check(folder)
    server = RunningServer(InferenceServer(cfg, folder, manifest, loader), _bind(cfg.host, cfg.port))
    return server.wait_ready() if wait else server


def run(cfg: ServeConfig, folder: str | Path, on_listening=None) -> int:
    """Serve until SIGTERM or SIGINT, then drain; the exit status (0, or 1
    when the package could not be loaded)."""
    manifest = check(folder)
    sys.setswitchinterval(cfg.gil_switch_ms / 1e3)  # this process only serves: see ServeConfig.gil_switch_ms
    app = InferenceServer(cfg, folder, manifest)
    sock = _bind(cfg.host, cfg.port)
    server = _uvicorn_server(app)
    app.on_load_error = lambda: setattr(server, "should_exit", True)
    host, port = sock.getsockname()[:2]
    # The load test (and the tests) read the port from this line when --port is 0.
    log.info("serving %s (model '%s') on %s", folder, app.model, url(host, port))
    if on_listening is not None:
        on_listening(host, port)
    server.run(sockets=[sock])
    if app.load_error is not None:
        if isinstance(app.load_error, DeployError):
            raise app.load_error
        return 1
    return 0
