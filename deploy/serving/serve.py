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

This module is the server's lifecycle (check, bind, start, run, drain); the
application is `app`, the dynamic batcher `batcher`, the metrics `metrics`.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import sys
import threading
from pathlib import Path

from ..config import ServeConfig
from ..errors import (
    DeployError,
)
from . import app as server_app

log = logging.getLogger(__name__)


# ------------------------------------------------------------------ metrics ---


# ------------------------------------------------------------------ batcher ---


# ------------------------------------------------------------------- server ---


# -------------------------------------------------------------- lifecycle ---


def check(folder: str | Path) -> dict:
    """Everything checked before any native code is loaded: the manifest, the
    sha256 of every file, the TVM version, the GPU architecture, and that
    the buckets fit the GPU's free memory."""
    from .. import runtime

    manifest = runtime.check_package(folder)
    runtime.check_fits(manifest, runtime.check_device(manifest))
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


def _uvicorn_server(app: server_app.InferenceServer):
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

    def __init__(self, app: server_app.InferenceServer, sock: socket.socket):
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
    server = RunningServer(server_app.InferenceServer(cfg, folder, manifest, loader), _bind(cfg.host, cfg.port))
    return server.wait_ready() if wait else server


def run(cfg: ServeConfig, folder: str | Path, on_listening=None) -> int:
    """Serve until SIGTERM or SIGINT, then drain; the exit status (0, or 1
    when the package could not be loaded)."""
    manifest = check(folder)
    sys.setswitchinterval(cfg.gil_switch_ms / 1e3)  # this process only serves: see ServeConfig.gil_switch_ms
    app = server_app.InferenceServer(cfg, folder, manifest)
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
