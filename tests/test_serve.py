"""The serving process on loopback: the tiny llvm package behind the Open
Inference Protocol. Protocol conformance through tritonclient (the standard
v2 client), error cases through raw HTTP, batching, limits, shutdown."""

import asyncio
import gzip
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
import tritonclient.http as triton
from prometheus_client.parser import text_string_to_metric_families

import deploy
from deploy import config, protocol, serve, tvm_compat
from deploy.errors import StaleArtifactError, TargetError

from .test_errors import error_line, run_cli

REPO = Path(__file__).resolve().parent.parent
MODEL = "tiny_cnn"


def rng_input(seed: int, batch: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, 3, 16, 16)).astype("float32")


@pytest.fixture(scope="module")
def predictor(tiny_package):
    return deploy.load(tiny_package[0])


@pytest.fixture(scope="module")
def served(tiny_package):
    cfg = config.serve_config(port=0, max_queue_delay_ms=20.0, max_body_mb=1.0)
    server = serve.start(cfg, tiny_package[0])
    yield server
    server.stop()


class Controlled:
    """The real Predictor, with a delay or a failure the test sets."""

    def __init__(self, predictor):
        self.predictor, self.delay, self.fail = predictor, 0.0, None

    def __getattr__(self, name):
        return getattr(self.predictor, name)

    def __call__(self, *arrays):
        time.sleep(self.delay)
        if self.fail is not None:
            raise self.fail
        return self.predictor(*arrays)


@pytest.fixture(scope="module")
def slow(tiny_package):
    """A server whose model the test slows down or breaks; at most 2 requests in flight."""
    box = {}

    def loader(folder):
        box["model"] = Controlled(deploy.load(folder))
        return box["model"]

    cfg = config.serve_config(port=0, max_concurrency=2, max_queue_delay_ms=0.0)
    server = serve.start(cfg, tiny_package[0], loader=loader)
    yield server, box["model"]
    server.stop()


def client(server) -> triton.InferenceServerClient:
    return triton.InferenceServerClient(server.url.removeprefix("http://"))


def infer_input(x: np.ndarray, binary: bool = True, name: str = "input") -> triton.InferInput:
    t = triton.InferInput(name, list(x.shape), protocol.datatype(str(x.dtype)))
    t.set_data_from_numpy(x, binary_data=binary)
    return t


def metrics(server) -> dict:
    text = httpx.get(server.url + "/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def metric(server, name: str, **labels) -> float:
    labels.setdefault("model", MODEL)
    return metrics(server).get((name, tuple(sorted(labels.items()))), 0.0)


# ---------------------------------------------------------------- protocol ---


def test_health_and_metadata(served):
    c = client(served)
    assert c.is_server_live() and c.is_server_ready() and c.is_model_ready(MODEL)
    assert c.is_model_ready(MODEL, model_version="1") and not c.is_model_ready("other")
    meta = c.get_server_metadata()
    assert meta["name"] == "tvm-deploy" and "binary_tensor_data" in meta["extensions"]
    model = c.get_model_metadata(MODEL)
    assert model == {
        "name": MODEL, "versions": ["1"], "platform": "tvm",
        "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, 3, 16, 16]}],
        "outputs": [{"name": "output", "datatype": "FP32", "shape": [-1, 10]}],
    }
    assert httpx.get(served.url + "/v2/health/live").json() == {"live": True}
    assert httpx.get(served.url + "/v2/health/ready").json() == {"ready": True}
    assert httpx.get(served.url + f"/v2/models/{MODEL}/versions/1").json() == model


@pytest.mark.parametrize("binary_in, binary_out", [(True, True), (False, False), (True, False), (False, True)])
def test_infer_json_and_binary(served, predictor, binary_in, binary_out):
    x = rng_input(1, batch=3)
    out = triton.InferRequestedOutput("output", binary_data=binary_out)
    r = client(served).infer(MODEL, [infer_input(x, binary_in)], outputs=[out], request_id="req-7")
    response = r.get_response()
    assert response["id"] == "req-7" and response["model_name"] == MODEL and response["model_version"] == "1"
    assert ("parameters" in response["outputs"][0]) == binary_out
    np.testing.assert_allclose(r.as_numpy("output"), predictor(x)["output"], rtol=1e-5, atol=1e-6)


def test_versioned_infer_and_default_binary_outputs(served, predictor):
    x = rng_input(2)
    r = client(served).infer(MODEL, [infer_input(x)], model_version="1")  # no outputs named: all, binary
    np.testing.assert_allclose(r.as_numpy("output"), predictor(x)["output"], rtol=1e-5, atol=1e-6)
    # plain JSON, as curl would send it, nested data
    body = {"inputs": [{"name": "input", "shape": [1, 3, 16, 16], "datatype": "FP32", "data": x.tolist()}]}
    resp = httpx.post(served.url + f"/v2/models/{MODEL}/infer", json=body)
    assert resp.status_code == 200 and resp.headers["content-type"] == "application/json"
    out = resp.json()["outputs"][0]
    assert out["name"] == "output" and out["datatype"] == "FP32" and out["shape"] == [1, 10]
    np.testing.assert_allclose(np.array(out["data"]).reshape(1, 10), predictor(x)["output"], rtol=1e-5, atol=1e-6)


def test_gzip_request_body(served, predictor):
    x = rng_input(3)
    body = {"inputs": [{"name": "input", "shape": [1, 3, 16, 16], "datatype": "FP32", "data": x.ravel().tolist()}]}
    resp = httpx.post(served.url + f"/v2/models/{MODEL}/infer", content=gzip.compress(json.dumps(body).encode()),
                      headers={"Content-Encoding": "gzip"})
    assert resp.status_code == 200
    np.testing.assert_allclose(np.array(resp.json()["outputs"][0]["data"]), predictor(x)["output"][0], rtol=1e-5)


def test_fp16_and_int_codec():
    """The tiny package is fp32: fp16 (and int64) go through the codec alone,
    encoded by tritonclient's own request builder and read by its InferResult."""
    from tritonclient.http._utils import _get_inference_request

    specs = [{"name": "x", "shape": [2, 3], "dtype": "float16"}, {"name": "ids", "shape": [4], "dtype": "int64"}]
    outs = [{"name": "y", "shape": [2, 3], "dtype": "float16"}]
    x = np.random.default_rng(0).standard_normal((2, 2, 3)).astype("float16")
    ids = np.arange(8, dtype="int64").reshape(2, 4)
    for binary in (True, False):
        inputs = [infer_input(x, binary, "x"), infer_input(ids, binary, "ids")]
        body, header = _get_inference_request(inputs, "", None, 0, False, False, 0, None, None)
        req = protocol.decode(body, None if header is None else str(header), specs, outs)
        assert req.arrays[0].dtype == np.float16 and req.batch == 2
        np.testing.assert_array_equal(req.arrays[0], x)
        np.testing.assert_array_equal(req.arrays[1], ids)
        response, length = protocol.encode("m", "1", None, [("y", x, binary)])
        result = triton.InferResult.from_response_body(response, header_length=length)
        assert result.get_output("y")["datatype"] == "FP16"
        np.testing.assert_array_equal(result.as_numpy("y"), x)
    with pytest.raises(deploy.DeployError, match="wrong kind"):
        protocol.decode(json.dumps({"inputs": [{"name": "ids", "shape": [1, 4], "datatype": "INT64",
                                                "data": [0.5, 1, 2, 3]}]}).encode(), None, specs[1:], outs)


# ---------------------------------------------------------------- batching ---


def test_concurrent_requests_are_batched_and_answered_each(served, predictor):
    """Distinct inputs of 1 to 3 rows (and one of 6, over the largest bucket)
    at once: every answer is the Predictor's output for its own input."""
    from tritonclient.http.aio import InferenceServerClient

    xs = [rng_input(100 + i, batch=[1, 2, 3][i % 3]) for i in range(24)] + [rng_input(99, batch=6)]
    before = (metric(served, "tvm_serve_batch_requests_sum"), metric(served, "tvm_serve_batch_requests_count"))

    async def send_all():
        c = InferenceServerClient(served.url.removeprefix("http://"), conn_limit=len(xs))
        try:
            return await asyncio.gather(*(c.infer(MODEL, [infer_input(x)]) for x in xs))
        finally:
            await c.close()

    results = asyncio.run(send_all())
    for x, r in zip(xs, results):
        np.testing.assert_allclose(r.as_numpy("output"), predictor(x)["output"], rtol=1e-4, atol=1e-5)
    merged = metric(served, "tvm_serve_batch_requests_sum") - before[0]
    runs = metric(served, "tvm_serve_batch_requests_count") - before[1]
    assert merged == len(xs) and runs < len(xs)  # some requests shared a module run
    assert metric(served, "tvm_serve_bucket_runs_total", bucket="split") >= 1


# ------------------------------------------------------------------ errors ---

GOOD = {"name": "input", "shape": [1, 3, 16, 16], "datatype": "FP32", "data": [0.0] * 768}


def _with(**changes) -> dict:
    return {"inputs": [{**GOOD, **changes}]}


@pytest.mark.parametrize(
    "path, body, headers, status, message",
    [
        ("/v2/models/nope/infer", _with(), {}, 404, "unknown model | got 'nope' | expected 'tiny_cnn'"),
        (f"/v2/models/{MODEL}/versions/2/infer", _with(), {}, 404, "unknown version"),
        (f"/v2/models/{MODEL}/infer", b'{"inputs": [', {}, 400, "malformed JSON"),
        (f"/v2/models/{MODEL}/infer", b"\xff\xfe", {}, 400, "malformed JSON"),
        (f"/v2/models/{MODEL}/infer", {"inputs": []}, {}, 400, "missing input(s) 'input'"),
        (f"/v2/models/{MODEL}/infer", {"input": []}, {}, 400, "malformed inference request"),
        (f"/v2/models/{MODEL}/infer", _with(name="image"), {}, 400, "unknown input name | got 'image'"),
        (f"/v2/models/{MODEL}/infer", _with(shape=[1, 3, 8, 32]), {}, 400, "wrong shape"),
        (f"/v2/models/{MODEL}/infer", _with(shape=[0, 3, 16, 16], data=[]), {}, 400, "wrong shape"),
        (f"/v2/models/{MODEL}/infer", _with(shape="1x3x16x16"), {}, 400, "malformed inference request"),
        (f"/v2/models/{MODEL}/infer", _with(datatype="FP16"), {}, 400, "wrong datatype | got FP16 | expected FP32"),
        (f"/v2/models/{MODEL}/infer", _with(data=[0.0] * 767), {}, 400, "does not match its shape"),
        (f"/v2/models/{MODEL}/infer", _with(data=[[0.0], [0.0, 1.0]]), {}, 400, "not a rectangular array"),
        (f"/v2/models/{MODEL}/infer", _with(data=["a"] * 768), {}, 400, "wrong kind"),
        (f"/v2/models/{MODEL}/infer", _with(data=None), {}, 400, "has no data"),
        (f"/v2/models/{MODEL}/infer", _with(data=None, parameters={"binary_data_size": 3072}), {}, 400, "shorter"),
        (f"/v2/models/{MODEL}/infer", _with(data=None, parameters={"binary_data_size": 12}), {}, 400,
         "binary_data_size does not match"),
        (f"/v2/models/{MODEL}/infer", _with(), {"Inference-Header-Content-Length": "99999"}, 400, "does not fit"),
        (f"/v2/models/{MODEL}/infer", {"inputs": [GOOD, GOOD]}, {}, 400, "given twice"),
        (f"/v2/models/{MODEL}/infer", {**_with(), "outputs": [{"name": "logits"}]}, {}, 400, "unknown output name"),
        (f"/v2/models/{MODEL}/infer", {**_with(), "parameters": {"binary_data_output": "yes"}}, {}, 400, "true or false"),
        (f"/v2/models/{MODEL}/infer", {**_with(), "parameters": {"timeout": -1}}, {}, 400, "microseconds"),
        (f"/v2/models/{MODEL}/infer", _with(), {"Content-Encoding": "br"}, 415, "unsupported Content-Encoding"),
        (f"/v2/models/{MODEL}/infer", _with(), {"Content-Encoding": "gzip"}, 400, "not valid gzip"),
        ("/v2/nowhere", _with(), {}, 404, "Not Found"),
    ],
)
def test_bad_requests_get_one_line(served, path, body, headers, status, message):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = httpx.post(served.url + path, content=content, headers=headers)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert message in error and "\n" not in error and "Traceback" not in error
    assert error.count(" | ") >= 1


def test_wrong_method_and_binary_tail(served):
    assert httpx.get(served.url + f"/v2/models/{MODEL}/infer").status_code == 405
    header = json.dumps(_with(data=None, parameters={"binary_data_size": 3072})).encode()
    resp = httpx.post(served.url + f"/v2/models/{MODEL}/infer", content=header + bytes(3072 + 4),
                      headers={"Inference-Header-Content-Length": str(len(header))})
    assert resp.status_code == 400 and "longer" in resp.json()["error"]
    assert client(served).is_server_live()


def test_oversized_bodies_get_413(served):
    url = served.url + f"/v2/models/{MODEL}/infer"
    big = b"x" * (2 * 1024 * 1024)  # the server takes 1 MB
    resp = httpx.post(url, content=big)
    assert resp.status_code == 413 and "too large" in resp.json()["error"]
    # no Content-Length (chunked): counted while reading
    resp = httpx.post(url, content=(big[i : i + 65536] for i in range(0, len(big), 65536)))
    assert resp.status_code == 413
    # small on the wire, large once decompressed
    bomb = gzip.compress(b'{"inputs": [' + b" " * (4 * 1024 * 1024) + b"]}")
    resp = httpx.post(url, content=bomb, headers={"Content-Encoding": "gzip"})
    assert resp.status_code == 413 and "decompressed" in resp.json()["error"]
    assert client(served).is_server_ready()


def test_client_disconnect_is_not_an_error(served):
    import socket

    with socket.create_connection((served.host, served.port)) as s:
        s.sendall(b"POST /v2/models/tiny_cnn/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n" + b"x" * 1000)
        time.sleep(0.2)
    deadline = time.monotonic() + 5
    while metric(served, "tvm_serve_requests_total", outcome="disconnected") < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(served, "tvm_serve_requests_total", outcome="disconnected") == 1
    assert metric(served, "tvm_serve_requests_total", outcome="error") == 0


def test_metrics(served):
    client(served).infer(MODEL, [infer_input(rng_input(5))])
    httpx.post(served.url + f"/v2/models/{MODEL}/infer", content=b"{")
    m = metrics(served)
    names = {name for name, _ in m}
    for name in ("tvm_serve_request_seconds_bucket", "tvm_serve_queue_seconds_bucket", "tvm_serve_batch_rows_bucket",
                 "tvm_serve_compute_seconds_count", "tvm_serve_in_flight", "process_cpu_seconds_total"):
        assert name in names, name
    assert metric(served, "tvm_serve_requests_total", outcome="success") >= 1
    assert metric(served, "tvm_serve_requests_total", outcome="bad_request") >= 1
    assert metric(served, "tvm_serve_ready") == 1


# ------------------------------------------------------- limits, failures ---


async def _post_many(url: str, n: int, body: bytes) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=30) as c:
        return await asyncio.gather(*(c.post(url, content=body) for _ in range(n)))


def test_concurrency_limit_sheds_load(slow):
    server, model = slow
    model.delay = 0.5
    try:
        body = json.dumps(_with()).encode()
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
    model.delay = 0.8
    try:
        with httpx.Client(timeout=30) as c:
            first = threading.Thread(target=c.post, args=(url,), kwargs={"content": json.dumps(_with()).encode()})
            first.start()
            time.sleep(0.2)  # the first one is running
            t0 = time.monotonic()
            late = c.post(url, json={**_with(), "parameters": {"timeout": 200_000}})  # 0.2 s, in microseconds
            waited = time.monotonic() - t0
            first.join()
    finally:
        model.delay = 0.0
    assert late.status_code == 504 and "no answer in time" in late.json()["error"]
    assert waited < 0.6
    time.sleep(0.1)
    assert metric(server, "tvm_serve_batch_rows_count") == runs + 1  # the late one was dropped, not run
    assert metric(server, "tvm_serve_requests_total", outcome="timeout") == 1


def test_internal_error_is_one_line_500(slow):
    server, model = slow
    model.fail = RuntimeError("kernel exploded\n  long native traceback\n  ...")
    try:
        resp = httpx.post(server.url + f"/v2/models/{MODEL}/infer", json=_with())
    finally:
        model.fail = None
    assert resp.status_code == 500
    assert resp.json()["error"] == "internal error | RuntimeError: kernel exploded"
    assert httpx.post(server.url + f"/v2/models/{MODEL}/infer", json=_with()).status_code == 200


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
        resp = httpx.post(server.url + f"/v2/models/{MODEL}/infer", json=_with())
        assert resp.status_code == 503 and "not ready" in resp.json()["error"]
        gate.set()
        server.wait_ready(60)
        assert httpx.get(server.url + "/v2/health/ready").status_code == 200
    finally:
        gate.set()
        server.stop()


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


def test_cli_needs_a_package_and_valid_knobs(capsys, tmp_path):
    rc, _, err = run_cli(capsys, "serve")
    assert rc == 2 and "no package given" in error_line(err)
    rc, _, err = run_cli(capsys, "serve", "--package", tmp_path, "--max-concurrency", 0)
    assert rc == 2 and "max_concurrency" in error_line(err)
    rc, _, err = run_cli(capsys, "serve", "--package", tmp_path / "missing")
    assert rc == 2 and "no package artifact" in error_line(err)


# ---------------------------------------------------------------- shutdown ---


def test_sigterm_finishes_requests_in_flight(tiny_package):
    """`deploy serve` in its own process: SIGTERM while requests wait in the
    batch queue; every one is answered, then the process exits 0."""
    port = serve._bind("127.0.0.1", 0)
    port_number = port.getsockname()[1]
    port.close()
    proc = subprocess.Popen(
        [sys.executable, "-m", "deploy", "serve", "--package", str(tiny_package[0]), "--port", str(port_number),
         "--max-queue-delay-ms", "1500", "--no-warmup"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port_number}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/v2/health/ready").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        xs = [rng_input(200 + i) for i in range(3)]  # 3 rows < bucket 4: they wait out the queue delay
        results = [None] * len(xs)

        def send(i):
            results[i] = httpx.post(url + f"/v2/models/{MODEL}/infer", timeout=30,
                                    json={"inputs": [{**GOOD, "data": xs[i].ravel().tolist()}]})

        threads = [threading.Thread(target=send, args=(i,)) for i in range(len(xs))]
        for t in threads:
            t.start()
        in_flight = 0
        while in_flight < len(xs) and time.monotonic() < deadline:  # all three read and queued
            text = httpx.get(url + "/metrics").text
            in_flight = next((s.value for f in text_string_to_metric_families(text) for s in f.samples
                              if s.name == "tvm_serve_in_flight"), 0)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(30)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert [r.status_code for r in results] == [200, 200, 200], out
    pred = deploy.load(tiny_package[0])
    for x, r in zip(xs, results):
        np.testing.assert_allclose(np.array(r.json()["outputs"][0]["data"]), pred(x)["output"][0], rtol=1e-4, atol=1e-5)
    assert proc.returncode == 0, out
    assert "Waiting for connections to close" in out and "PASSED" in out


# ---------------------------------------------------------------- loadtest ---


def test_loadtest_writes_a_report(capsys, tmp_path, tiny_package):
    out = tmp_path / "lt"
    rc, _, err = run_cli(capsys, "loadtest", "--package", tiny_package[0], "--concurrency", "1,3",
                              "--duration-s", "1", "--warmup-s", "0.3", "--raw-seconds", "0.1", "--out", out)
    assert rc == 0, err
    report = json.loads((out / "results.json").read_text())
    assert [lv["concurrency"] for lv in report["levels"]] == [1, 3]
    for lv in report["levels"]:
        assert lv["samples_per_s"] > 0 and lv["statuses"] == {"ok": lv["requests"]}
        assert lv["p50_ms"] <= lv["p99_ms"]
    assert set(report["raw"]["buckets"]) == {"1", "4"} and report["raw"]["best_samples_per_s"] > 0
    assert report["server_exit_status"] == 0 and report["target_check"] is None
    assert "| concurrency | samples/s |" in (out / "results.md").read_text()
    foreign = tmp_path / "mine"
    foreign.mkdir()
    rc, _, err = run_cli(capsys, "loadtest", "--package", tiny_package[0], "--out", foreign)
    assert rc == 2 and "not written by loadtest" in error_line(err)
