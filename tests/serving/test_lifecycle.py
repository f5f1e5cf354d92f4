"""Limits, failures, loading and shutdown: load shedding, time-outs, one-line
500s, readiness, the grace period, tampered packages, SIGTERM."""

import asyncio
import json
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

import deploy
from deploy import config, tvm_compat
from deploy.errors import StaleArtifactError, TargetError
from deploy.serving import serve

from ..test_errors import error_line, run_cli
from .helpers import GOOD, MODEL, REPO, Controlled, metric, request_with, rng_input, stopped_metric, wait_until


async def _post_many(url: str, n: int, body: bytes) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=30) as c:
        return await asyncio.gather(*(c.post(url, content=body) for _ in range(n)))


def test_concurrency_limit_sheds_load(slow):
    server, model = slow
    model.delay = 0.5
    try:
        body = json.dumps(request_with()).encode()
        responses = asyncio.run(_post_many(server.url + f"/v2/models/{MODEL}/infer", 5, body))
    finally:
        model.delay = 0.0
    codes = sorted(r.status_code for r in responses)
    assert codes == [200, 200, 503, 503, 503]
    busy = next(r for r in responses if r.status_code == 503)
    assert busy.headers["Retry-After"] == "1" and "too many requests in flight" in busy.json()["error"]
    assert metric(server, "tvm_serve_requests_total", outcome="overloaded") == 3


def test_request_timeout(slow):
    """A request still queued at its deadline gets 504 and is never run."""
    server, model = slow
    url = server.url + f"/v2/models/{MODEL}/infer"
    runs = metric(server, "tvm_serve_batch_rows_count")
    model.delay = 1.5
    model.started.clear()
    try:
        with httpx.Client(timeout=30) as c:
            first = threading.Thread(target=c.post, args=(url,), kwargs={"content": json.dumps(request_with()).encode()})
            first.start()
            assert model.started.wait(10)  # the first one is running
            t0 = time.monotonic()
            late = c.post(url, json={**request_with(), "parameters": {"timeout": 200_000}})  # 0.2 s, in microseconds
            waited = time.monotonic() - t0
            first.join()
    finally:
        model.delay = 0.0
    assert late.status_code == 504 and "no answer in time" in late.json()["error"]
    assert waited < 1.2  # answered at its own deadline, not when the first one finished
    # One more request: once it is answered, the batcher has passed the late one.
    assert httpx.post(url, json=request_with()).status_code == 200
    assert metric(server, "tvm_serve_batch_rows_count") == runs + 2  # the late one was dropped, not run
    assert metric(server, "tvm_serve_requests_total", outcome="timeout") == 1


def test_client_leaving_while_queued_is_disconnected(slow):
    import socket

    server, model = slow
    before = {o: metric(server, "tvm_serve_requests_total", outcome=o) for o in ("success", "disconnected")}
    body = json.dumps(request_with()).encode()
    model.delay = 0.5
    model.started.clear()
    try:
        with socket.create_connection((server.host, server.port)) as s:
            s.sendall(f"POST /v2/models/{MODEL}/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            assert model.started.wait(10)
        assert wait_until(lambda: metric(server, "tvm_serve_requests_total", outcome="disconnected")
                          == before["disconnected"] + 1)
    finally:
        model.delay = 0.0
    assert metric(server, "tvm_serve_requests_total", outcome="success") == before["success"]


def test_internal_error_is_one_line_500(slow):
    server, model = slow
    model.fail = RuntimeError("kernel exploded\n  long native traceback\n  ...")
    try:
        resp = httpx.post(server.url + f"/v2/models/{MODEL}/infer", json=request_with())
    finally:
        model.fail = None
    assert resp.status_code == 500
    assert resp.json()["error"] == "internal error | RuntimeError: kernel exploded"
    assert httpx.post(server.url + f"/v2/models/{MODEL}/infer", json=request_with()).status_code == 200


def test_not_ready_until_loaded(tiny_package):
    gate = threading.Event()

    def loader(folder):
        gate.wait(30)
        return deploy.load(folder)

    server = serve.start(config.serve_config(port=0), tiny_package[0], wait=False, loader=loader)
    try:
        assert httpx.get(server.url + "/v2/health/live").status_code == 200
        ready = httpx.get(server.url + "/v2/health/ready")
        assert ready.status_code == 503 and ready.json() == {"ready": False}
        assert httpx.get(server.url + f"/v2/models/{MODEL}/ready").status_code == 503
        resp = httpx.post(server.url + f"/v2/models/{MODEL}/infer", json=request_with())
        assert resp.status_code == 503 and "not ready" in resp.json()["error"]
        gate.set()
        server.wait_ready(60)
        assert httpx.get(server.url + "/v2/health/ready").status_code == 200
    finally:
        gate.set()
        server.stop()


def test_stop_while_loading_keeps_to_the_grace(tiny_package):
    """A loader that takes long: stopping waits for it at most the grace."""
    gate = threading.Event()

    def loader(folder):
        gate.wait(60)
        return deploy.load(folder)

    server = serve.start(config.serve_config(port=0, shutdown_grace_s=0.5), tiny_package[0], wait=False,
                         loader=loader)
    try:
        assert httpx.get(server.url + "/v2/health/live").status_code == 200
        t0 = time.monotonic()
        server.stop(timeout=20)
        took = time.monotonic() - t0
    finally:
        gate.set()
    assert not server.running and took < 5


def test_stop_during_warmup_skips_the_other_buckets(tiny_package):
    runs, started = [], threading.Event()

    class SlowWarmup(Controlled):
        def run_bucket(self, bucket, arrays):
            runs.append(bucket)
            started.set()
            time.sleep(0.5)
            return self.predictor.run_bucket(bucket, arrays)

    server = serve.start(config.serve_config(port=0), tiny_package[0], wait=False,
                         loader=lambda folder: SlowWarmup(deploy.load(folder)))
    assert started.wait(30)
    server.stop(timeout=20)
    assert not server.running and runs == [1]  # bucket 4 was never warmed up
    assert server.app.loaded.is_set() and server.app.load_error is None and not server.app.ready


def test_requests_cut_by_the_grace_count_as_shutdown(tiny_package):
    box = {}

    def loader(folder):
        box["model"] = Controlled(deploy.load(folder))
        return box["model"]

    server = serve.start(config.serve_config(port=0, shutdown_grace_s=0.3), tiny_package[0], loader=loader)
    model = box["model"]
    model.delay = 2.0
    answers = []

    def send():
        try:
            answers.append(httpx.post(server.url + f"/v2/models/{MODEL}/infer", json=request_with(), timeout=30))
        except httpx.TransportError as e:
            answers.append(e)

    threads = [threading.Thread(target=send) for _ in range(2)]  # one running, one queued
    for t in threads:
        t.start()
    assert model.started.wait(10) and wait_until(lambda: server.app.in_flight == 2)
    server.stop(timeout=20)
    for t in threads:
        t.join(10)
    assert not server.running and len(answers) == 2
    assert stopped_metric(server, "tvm_serve_requests_total", outcome="shutdown") == 2
    assert stopped_metric(server, "tvm_serve_requests_total", outcome="error") == 0


def test_load_failure_stops_the_server(tiny_package):
    def loader(folder):
        raise RuntimeError("out of device memory")

    server = serve.start(config.serve_config(port=0), tiny_package[0], wait=False, loader=loader)
    with pytest.raises(RuntimeError, match="out of device memory"):
        server.wait_ready(30)
    assert not server.running


def test_tampered_or_foreign_package_is_never_loaded(capsys, tmp_path, tiny_package, monkeypatch):
    def never(*_):
        raise AssertionError("native code was loaded")

    monkeypatch.setattr(tvm_compat, "load_module", never)
    pkg = tmp_path / "pkg"
    shutil.copytree(tiny_package[0], pkg)
    with open(pkg / "b4.so", "ab") as f:
        f.write(b"\0")
    with pytest.raises(StaleArtifactError, match=r"b4.so \(sha256 differs\)"):
        serve.start(config.serve_config(port=0), pkg)
    rc, _, err = run_cli(capsys, "serve", "--package", pkg, "--port", 0)
    assert rc == 2 and "does not match its manifest" in error_line(err)

    other = tmp_path / "gpu-pkg"
    shutil.copytree(tiny_package[0], other)
    m = json.loads((other / "manifest.json").read_text())
    m["target"] = {**m["target"], "kind": "cuda", "arch": "sm_90"}
    m["gpu"] = {"name": "NVIDIA H200", "compute_capability": "9.0"}
    (other / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(TargetError, match="CUDA"):
        serve.start(config.serve_config(port=0), other)


def test_cli_serve_failing_to_load_is_not_passed(capsys, tiny_package, monkeypatch):
    from deploy import runtime

    def broken(*_, **__):
        raise RuntimeError("out of device memory")

    monkeypatch.setattr(runtime, "load", broken)
    rc, out, err = run_cli(capsys, "serve", "--package", tiny_package[0], "--port", 0, "--no-warmup")
    assert rc == 1 and "PASSED" not in out
    assert "serve failed | got exit status 1" in error_line(err) and "FAILED |" in err


def test_modules_are_hashed_once(tiny_package, monkeypatch):
    from deploy import artifacts

    hashed = []
    real = artifacts.sha256_file
    monkeypatch.setattr(artifacts, "sha256_file", lambda p: hashed.append(Path(p).name) or real(p))
    server = serve.start(config.serve_config(port=0, warmup=False), tiny_package[0])
    server.stop()
    assert sorted(hashed) == sorted(Path(f).name for f in json.loads(
        (tiny_package[0] / "manifest.json").read_text())["files"])


def test_cli_needs_a_package_and_valid_knobs(capsys, tmp_path):
    rc, _, err = run_cli(capsys, "serve")
    assert rc == 2 and "no package given" in error_line(err)
    rc, _, err = run_cli(capsys, "serve", "--package", tmp_path, "--max-concurrency", 0)
    assert rc == 2 and "max_concurrency" in error_line(err)
    rc, _, err = run_cli(capsys, "serve", "--package", tmp_path / "missing")
    assert rc == 2 and "no package artifact" in error_line(err)
    rc, _, err = run_cli(capsys, "serve", "--package", tmp_path, "--max-body-mb", 64, "--max-inflight-mb", 32)
    assert rc == 2 and "max_inflight_mb" in error_line(err)
    rc, _, err = run_cli(capsys, "serve", "--package", tmp_path, "--gil-switch-ms", 0)
    assert rc == 2 and "gil_switch_ms" in error_line(err)
    assert serve.url("::1", 8000) == "http://[::1]:8000" and serve.url("127.0.0.1", 80) == "http://127.0.0.1:80"




def test_sigterm_finishes_requests_in_flight(tiny_package, tmp_path):
    """`deploy serve` in its own process: SIGTERM while requests wait in the
    batch queue (for a fourth whose body is still arriving: company the
    batcher waits for); every one is answered, then the process exits 0."""
    from deploy.serving.server_process import listening_url

    log = tmp_path / "serve.log"
    with open(log, "w") as f:  # --port 0: the server binds a free port and logs it
        proc = subprocess.Popen(
            [sys.executable, "-m", "deploy", "serve", "--package", str(tiny_package[0]), "--port", "0",
             "--max-queue-delay-ms", "1500", "--no-warmup"],
            cwd=REPO, stdout=f, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        url = None
        while time.monotonic() < deadline and proc.poll() is None:
            url = url or listening_url(log.read_text())
            try:
                if url and httpx.get(url + "/v2/health/ready").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.02)
        xs = [rng_input(200 + i) for i in range(4)]  # 4 rows: bucket 4, once the slow one is in
        results = [None] * len(xs)

        def send(i):
            body = json.dumps({"inputs": [{**GOOD, "data": xs[i].ravel().tolist()}]}).encode()
            if i == len(xs) - 1:  # the slow one: its body arrives over ~2 s, the others wait for it
                whole, step = body, len(body) // 10 + 1

                def slowly():
                    for k in range(0, len(whole), step):
                        time.sleep(0.2)
                        yield whole[k:k + step]
                body = slowly()
            try:
                results[i] = httpx.post(url + f"/v2/models/{MODEL}/infer", timeout=30, content=body,
                                        headers={"Content-Type": "application/json"})
            except httpx.HTTPError as e:
                results[i] = e

        def in_flight() -> float:
            text = httpx.get(url + "/metrics").text
            return next((s.value for f in text_string_to_metric_families(text) for s in f.samples
                         if s.name == "tvm_serve_in_flight"), 0)

        threads = [threading.Thread(target=send, args=(i,)) for i in range(len(xs))]
        threads[-1].start()  # the slow one first: admitted, it is the company the others wait for
        while in_flight() < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        for t in threads[:-1]:
            t.start()
        while in_flight() < len(xs) and time.monotonic() < deadline:  # all four in
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(30)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = log.read_text()
    assert [getattr(r, "status_code", r) for r in results] == [200] * len(xs), out
    pred = deploy.load(tiny_package[0])
    for x, r in zip(xs, results):
        np.testing.assert_allclose(np.array(r.json()["outputs"][0]["data"]), pred(x)["output"][0], rtol=1e-4, atol=1e-5)
    assert proc.returncode == 0, out
    assert "Waiting for connections to close" in out and "PASSED" in out
