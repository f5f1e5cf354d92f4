"""The Open Inference Protocol (KServe v2) application: routes, request decoding, the
binary tensor extension, system shared memory, limits and errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
import zlib
from pathlib import Path

from .. import shapes
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
from . import batcher as batching
from . import metrics as server_metrics
from . import protocol, shm

log = logging.getLogger(__name__)


MODEL_VERSION = "1"  # a package is one version of one model


SERVER_NAME = "tvm-deploy"


# Bodies (and answers) larger than this are decoded (encoded) in a worker
# thread: parsing megabytes of JSON on the event loop would hold up every
# other request, health checks included.
OFFLOAD_BYTES = 256 * 1024


def free_axes(manifest: dict, which: str) -> list[dict]:
    """The manifest's inputs or outputs, -1 at the axes of its dimensions."""
    dims = shapes.dims_from_manifest(manifest.get("dims"))
    out = []
    for spec in manifest[which]:
        shape = list(spec["shape"])
        for d in dims:
            if spec["name"] in (d.inputs if which == "inputs" else d.outputs) and d.axis - 1 < len(shape):
                shape[d.axis - 1] = -1
        out.append({**spec, "shape": shape})
    return out


class InferenceServer:
    """The Starlette application and the state behind it."""

    def __init__(self, cfg: ServeConfig, folder: str | Path, manifest: dict, loader=None):
        from .. import runtime

        self.cfg = cfg
        self.folder = Path(folder)
        # The inputs and outputs with -1 at each axis of a dimension besides
        # the batch (a sequence length): requests may have any length there.
        manifest = {**manifest, "inputs": free_axes(manifest, "inputs"), "outputs": free_axes(manifest, "outputs")}
        self.manifest = manifest
        self.dims = shapes.dims_from_manifest(manifest.get("dims"))
        self.input_names = [s["name"] for s in manifest["inputs"]]
        self.model = cfg.model_name or manifest["model"]
        # The manifest was checked (every module hashed) before the server was built.
        self.loader = loader or (lambda f: runtime.load(f, manifest=manifest))
        self.metrics = server_metrics.Metrics(self.model)
        self.batcher: batching.Batcher | None = None
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
        log.info("model %s ready: buckets %s from %s", self.model, ", ".join(b.label for b in predictor.buckets),
                 self.folder)
        self.loaded.set()
        return predictor

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        self.batcher = batching.Batcher(self._load, self.cfg.max_queue_delay_ms / 1e3, self.metrics)
        self.batcher.settle = functools.partial(settle, asyncio.get_running_loop())
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
            arriving = [True]  # admitted, not yet handed to the batcher: company the batcher may wait for
            self.batcher.arriving += 1
            try:
                response = await self._infer(request, start, reserved, arriving)
            finally:
                if arriving[0]:
                    self.batcher.arriving -= 1
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

    async def _infer(self, request, start: float, reserved: list[int], arriving: list[bool]):
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
        if self.dims:  # checked here: in the batcher one request's bad length would fail its whole batch
            try:
                shapes.fit(shapes.lengths(req.arrays, self.input_names, self.dims), self.dims)
            except DeployError as e:
                raise RequestError(e.args[0] if e.args else str(e), *e.args[1:]) from None
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

        self.batcher.arriving -= 1  # this event-loop thread alone changes it
        arriving[0] = False
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


# Event-loop iterations after which a request whose bytes had reached the
# socket has been admitted (selected, parsed, its handler started).
SETTLE_HOPS = 3


def settle(loop) -> threading.Event:
    """An event set once `loop` has run SETTLE_HOPS more iterations (at once
    if it is gone): called from the batcher's thread, it tells whether a
    request that had arrived by now is on its way in (`Batcher.arriving`)."""
    done = threading.Event()

    def hop(n: int) -> None:
        if n <= 0:
            done.set()
        else:
            loop.call_soon(hop, n - 1)

    try:
        loop.call_soon_threadsafe(hop, SETTLE_HOPS)
    except RuntimeError:  # the loop closed
        done.set()
    return done
