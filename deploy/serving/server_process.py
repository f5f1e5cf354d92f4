"""`python -m deploy serve` in a subprocess, as the load test (and
scripts/serve_overhead.py) run it: started, waited for, its metrics read, stopped.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from .. import artifacts
from ..config import ServeConfig
from ..errors import StaleArtifactError


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


class ServerProcess:
    """`python -m deploy serve` in a subprocess, its log in a file. With port
    0 the server binds a free port itself and logs it (no race with another
    process taking a port found free here)."""

    def __init__(self, argv: list[str], log_path: Path, cwd: Path = artifacts.REPO_ROOT, env: dict | None = None,
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
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(artifacts.REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
        return cls(argv, log_path, artifacts.REPO_ROOT, env, url(cfg.host, cfg.port) if cfg.port else None)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise StaleArtifactError("the server exited before it was ready", self._tail())
            if self.url is None:
                self._log.flush()
                self.url = listening_url(self.log_path.read_text(errors="replace"))
            try:
                if self.url is not None and http_get(self.url + "/v2/health/ready", 2.0)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"the server was not ready after {timeout:g} s: {self._tail()}")

    def metrics(self) -> dict[str, float]:
        from prometheus_client.parser import text_string_to_metric_families

        _, body = http_get(self.url + "/metrics")
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
