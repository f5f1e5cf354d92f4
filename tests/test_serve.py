"""The serving process on loopback: the tiny llvm package behind the Open
Inference Protocol. Protocol conformance through tritonclient (the standard
v2 client), error cases through raw HTTP, batching, limits, shutdown."""

import asyncio
import concurrent.futures
import gzip
import json
import os
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
import tritonclient.utils as triton_utils
from prometheus_client.parser import text_string_to_metric_families

import deploy
from deploy import config, tvm_compat
from deploy.errors import StaleArtifactError, TargetError
from deploy.serving import app as server_app
from deploy.serving import protocol, serve

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
    cfg = config.serve_config(port=0, max_queue_delay_ms=20.0, max_body_mb=1.0, max_inflight_mb=1.0)
    server = serve.start(cfg, tiny_package[0])
    yield server
    server.stop()


class Controlled:
    """The real Predictor, with a delay or a failure the test sets; `started`
    is set when a batch starts running."""

    def __init__(self, predictor):
        self.predictor, self.delay, self.fail = predictor, 0.0, None
        self.started = threading.Event()

    def __getattr__(self, name):
        return getattr(self.predictor, name)

    def launch(self, batch):  # what the batcher calls for every batch, after staging it
        self.started.set()
        time.sleep(self.delay)
        if self.fail is not None:
            self.predictor.release(batch)
            raise self.fail
        return self.predictor.launch(batch)


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


def stopped_metric(server, name: str, **labels) -> float:
    """A metric of a server that no longer answers HTTP."""
    labels.setdefault("model", MODEL)
    return server.app.metrics.registry.get_sample_value(name, labels) or 0.0


def wait_until(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


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


def test_kserve_shaped_request(served, predictor):
    """What KServe's own client sends: top-level model_name and id, and
    parameters that are null; other top-level keys are ignored."""
    x = rng_input(4)
    body = {"id": "5b1c", "model_name": MODEL, "model_version": "1", "parameters": None, "some_extension": {"a": 1},
            "inputs": [{**GOOD, "data": x.ravel().tolist(), "parameters": None}],
            "outputs": [{"name": "output", "parameters": None}]}
    resp = httpx.post(served.url + f"/v2/models/{MODEL}/infer", json=body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["id"] == "5b1c"
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


@pytest.mark.parametrize("dtype, data, message", [
    ("int8", [1, 128], "out of range | got 128 | expected values in [-128, 127] for INT8"),
    ("uint8", [-1, 0], "out of range | got -1 | expected values in [0, 255] for UINT8"),
    ("int64", [2**63, 0], "out of range | got 9223372036854775808"),
    ("int32", [True, 1], "wrong kind | got bool"),
    ("float32", [1, 1e39], "out of range | got 1e+39 | expected values in [-3.40282e+38, 3.40282e+38] for FP32"),
    ("float16", [70000.0, 1], "out of range | got 70000.0 | expected values in [-65504, 65504] for FP16"),
    ("float32", [True, 0.5], "wrong kind | got bool"),
    ("float32", [float("nan"), 0.5], "not a finite number | got nan"),
    ("bool", [1, True], "wrong kind | got int | expected true or false"),
])
def test_json_numbers_must_fit_the_datatype(dtype, data, message):
    """numpy would wrap 128 to -128 in INT8, turn 70000 into inf in FP16 and
    read true as 1: each is a 400 instead."""
    spec = [{"name": "x", "shape": [2], "dtype": dtype}]
    body = json.dumps({"inputs": [{"name": "x", "shape": [1, 2], "datatype": protocol.datatype(dtype),
                                   "data": data}]}).encode()
    with pytest.raises(deploy.DeployError) as e:
        protocol.decode(body, None, spec, spec)
    assert message in str(e.value)
    ok = {"int8": [-128, 127], "uint8": [0, 255], "float16": [65504.0, -1], "bool": [True, False]}.get(dtype)
    if ok:
        body = json.dumps({"inputs": [{"name": "x", "shape": [1, 2], "datatype": protocol.datatype(dtype),
                                       "data": ok}]}).encode()
        np.testing.assert_array_equal(protocol.decode(body, None, spec, spec).arrays[0], np.array([ok], dtype))


def test_binary_data_size_must_be_an_integer():
    """8.0 equals 8, but as an offset into the binary part it failed later, as a 500."""
    specs = [{"name": "a", "shape": [2], "dtype": "float32"}, {"name": "b", "shape": [2], "dtype": "float32"}]
    blob = np.arange(4, dtype="<f4").tobytes()
    for size in (8.0, True, "8"):
        header = json.dumps({"inputs": [
            {"name": "a", "shape": [1, 2], "datatype": "FP32", "parameters": {"binary_data_size": size}},
            {"name": "b", "shape": [1, 2], "datatype": "FP32", "parameters": {"binary_data_size": 8}}]}).encode()
        with pytest.raises(deploy.DeployError, match=r"'a' binary_data_size .* expected the integer 8"):
            protocol.decode(header + blob, str(len(header)), specs, specs)


def test_non_finite_outputs_are_json_null():
    """JSON has no NaN or Infinity: null in JSON (tritonclient reads it back
    as NaN), exact in binary."""
    y = np.array([[np.nan, np.inf, -np.inf, 1.5]], dtype="float32")
    body, length = protocol.encode("m", "1", None, [("y", y, False)])
    assert length is None and b"NaN" not in body and b"Infinity" not in body
    assert json.loads(body)["outputs"][0]["data"] == [None, None, None, 1.5]
    assert np.isnan(triton.InferResult.from_response_body(body).as_numpy("y")).sum() == 3
    body, length = protocol.encode("m", "1", None, [("y", y, True)])
    np.testing.assert_array_equal(triton.InferResult.from_response_body(body, header_length=length).as_numpy("y"), y)


# ---------------------------------------------------------------- batching ---


def test_run_parts_puts_each_request_in_its_own_rows(tiny_package):
    """The batcher's path: requests copied side by side into a bucket's device
    inputs (one straddling two pieces of the largest bucket, 4), answered in
    order, each row as if run alone; padding rows are zeroed, not left over."""
    pred = deploy.load(tiny_package[0])
    assert pred.buckets == [1, 4]
    parts = [pred.random_inputs(n, seed=n) for n in (1, 2, 3, 4, 6)]  # 16 rows: 4 runs of bucket 4
    out = pred.run_parts(parts)
    alone = np.concatenate([pred.run_bucket(1, [x[r : r + 1] for x in p])[0] for p in parts for r in range(len(p[0]))])
    name = pred.outputs[0]["name"]
    assert out[name].shape == alone.shape
    np.testing.assert_allclose(out[name], alone, rtol=1e-5, atol=1e-6)
    three = pred.run_parts([parts[2]])  # 3 rows in bucket 4, after runs that filled all 4
    np.testing.assert_allclose(three[name], alone[3:6], rtol=1e-5, atol=1e-6)
    assert not pred._staged_inputs[4][0].numpy()[3].any()  # the padding row
    np.testing.assert_allclose(pred(*parts[4])[name], alone[10:], rtol=1e-5, atol=1e-6)  # __call__: the same path
    from deploy.errors import ShapeError

    with pytest.raises(ShapeError, match="wrong dtype"):  # copyfrom would have cast it silently
        pred.run_parts([[parts[0][0].astype("float64")]])




def test_a_batch_staged_while_another_runs(tiny_package, tmp_path):
    """The batcher's overlap: batch B is staged into another host buffer while
    A is launched, and each is answered with its own rows; B (2 rows) runs
    after A (4) with zeros, not A's rows, in its padding; a part that cannot
    be read fails alone (its rows zeroed), the others run."""
    from deploy.errors import RequestError
    from deploy.serving import shm

    pred = deploy.load(tiny_package[0])
    name = pred.outputs[0]["name"]
    xa, xb, xc = pred.random_inputs(4, seed=1), pred.random_inputs(2, seed=2), pred.random_inputs(1, seed=3)
    want = {"a": pred.run_bucket(4, xa)[0],
            "b": pred.run_bucket(4, [np.concatenate([xb[0], np.zeros_like(xb[0])])])[0][:2]}
    a = pred.launch(pred.stage([xa]))
    b = pred.stage([xb])
    assert b.slot is not a.slot  # A's buffer is still being read by the device
    got_a = pred.collect(a)
    got_b = pred.collect(pred.launch(b))
    np.testing.assert_allclose(got_a[name], want["a"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_b[name], want["b"], rtol=1e-5, atol=1e-6)
    assert not pred._staged_inputs[4][0].numpy()[2:].any()  # A's last rows were zeroed for B

    # A shared-memory part whose object shrank: that part fails, the batch runs.
    path = Path(shm.SHM_DIR) / f"tvm-deploy-test-stage-{os.getpid()}"
    path.write_bytes(xc[0].tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        gone = shm.ShmInput("input", os.dup(fd), 0, xc[0].shape, xc[0].dtype)
        os.truncate(path, 8)
        batch = pred.stage([xb, [gone], xc])
        assert list(batch.errors) == [1] and isinstance(batch.errors[1], RequestError)
        out = pred.collect(pred.launch(batch))[name]
        np.testing.assert_allclose(out[:2], want["b"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(out[3:], pred.run_bucket(1, xc)[0], rtol=1e-5, atol=1e-6)
        assert gone._fd < 0  # closed once read (here: once it failed), not left to the garbage collector
        again = shm.ShmInput("input", os.dup(fd), 0, xc[0].shape, xc[0].dtype)
        with pytest.raises(RequestError, match="shorter than registered"):
            pred.run_parts([xb, [again]])
        assert not pred._lock.locked() and not any(s.busy for ss in pred._slots.values() for s in ss)
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)


def test_large_batches_are_staged_by_several_threads(tiny_package, monkeypatch):
    """Staging copies spread over threads, large arrays in slices of rows
    (forced here on the tiny model): the same outputs as one thread."""
    from deploy import runtime

    pred = deploy.load(tiny_package[0])
    parts = [pred.random_inputs(n, seed=10 + n) for n in (1, 3)]
    name = pred.outputs[0]["name"]
    alone = pred.run_parts(parts)[name]
    monkeypatch.setattr(runtime, "PARALLEL_STAGE_BYTES", 0)
    monkeypatch.setattr(runtime, "STAGE_SLICE_BYTES", parts[1][0][0].nbytes)  # one row a slice
    pred._stage_threads = 2
    sliced = []
    real = runtime._copy_one
    monkeypatch.setattr(runtime, "_copy_one", lambda c: sliced.append(c[1].shape[0]) or real(c))
    np.testing.assert_array_equal(pred.run_parts(parts)[name], alone)
    assert sorted(sliced) == [1, 1, 1, 1] and pred._stage_pool is not None

    class Broken:  # an input whose read fails with something other than a request error (a bug, the OS)
        shape, dtype, ndim = parts[0][0].shape, parts[0][0].dtype, parts[0][0].ndim

        def read_into(self, dst):
            raise OSError("the disk is on fire")

    with pytest.raises(OSError, match="on fire"):  # raised once every other copy has ended
        pred.stage([[Broken()], parts[1]])
    assert not any(slot.busy for slots in pred._slots.values() for slot in slots)


def test_a_running_batch_is_answered_without_waiting_for_the_next_ones_company(tiny_package):
    """The batcher gathers the next batch while one runs, but waits for more
    requests only until the running batch is expected to be done: its answer
    is not held up by the next batch's --max-queue-delay-ms window."""
    from deploy.serving.batcher import Batcher
    from deploy.serving.metrics import Metrics

    pred = Controlled(deploy.load(tiny_package[0]))
    pred.delay = 0.05  # the running batch takes 50 ms
    batcher = Batcher(lambda: pred, 0.5, Metrics("t"))
    x = pred.random_inputs(1)
    try:
        first = batcher.submit(x, 1)
        assert pred.started.wait(30)
        t0 = time.perf_counter()
        second = batcher.submit(x, 1)  # queued while the first runs; its window would be 0.5 s
        first.result(timeout=30)
        assert time.perf_counter() - t0 < 0.3
        np.testing.assert_allclose(second.result(timeout=30)["output"], first.result()["output"])
    finally:
        batcher.close(30)


def test_the_batchers_device_time_estimate_follows_the_device_not_its_own_waits(monkeypatch):
    """The estimate that bounds gathering while a batch runs learns only from
    collects that waited for the device; a batch found already done (collected
    late, after the next batch's gathering and staging) can only lower it, so
    it cannot ratchet up to --max-queue-delay-ms. On a CPU device (launch runs
    the module), the running batch counts as done at once."""
    from deploy.runtime import Batch
    from deploy.serving import batcher as batching
    from deploy.serving import metrics as server_metrics

    clock = [0.0]
    monkeypatch.setattr(batching.time, "perf_counter", lambda: clock[0])

    class Fake:
        launch_waits = False
        wait = 0.0

        def collect(self, batch):
            clock[0] += self.wait
            return {"y": np.zeros((batch.rows, 1))}

        def plan(self, rows):
            return [(4, rows)]

    batcher = batching.Batcher(lambda: None, 0.010, server_metrics.Metrics("t"))
    batcher.predictor = fake = Fake()

    def run(collect_at, wait):  # a batch launched at 0, collected at `collect_at`, waiting `wait` there
        job = batching._Job([np.zeros((1, 1))], 1, concurrent.futures.Future(), 0.0)
        job.future.set_running_or_notify_cancel()
        batch = Batch(4, 1, None, [1], {})
        clock[0], fake.wait = collect_at, wait
        batcher._finish([job], batch, 0.0)
        return batcher._device_s[4], batch

    assert run(0.001, 0.002)[0] == pytest.approx(0.003)  # waited: done at 3 ms
    assert run(0.008, 0.0)[0] == pytest.approx(0.003)  # already done at 8 ms: no higher
    est, batch = run(0.001, 0.0015)
    assert est == pytest.approx(0.7 * 0.003 + 0.3 * 0.0025)
    assert run(0.0015, 0.0)[0] == pytest.approx(0.0015)  # done by 1.5 ms: lowered
    assert batcher._expected_done([], batch, 0.0) == pytest.approx(0.0015)
    fake.launch_waits = True
    assert batcher._expected_done([], batch, 5.0) == 0.0
    batcher.close(5)


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


def test_split_request_metrics(slow):
    """6 rows over buckets 1 and 4: two runs of bucket 4, the second with 2 padding rows."""
    server, _ = slow
    runs = {b: metric(server, "tvm_serve_bucket_runs_total", bucket=b) for b in ("1", "4")}
    padded = metric(server, "tvm_serve_padded_rows_total")
    client(server).infer(MODEL, [infer_input(rng_input(7, batch=6))])
    assert metric(server, "tvm_serve_bucket_runs_total", bucket="4") == runs["4"] + 2
    assert metric(server, "tvm_serve_bucket_runs_total", bucket="1") == runs["1"]
    assert metric(server, "tvm_serve_padded_rows_total") == padded + 2


# -------------------------------------------------------------- two inputs ---

TWO = "two_input"


@pytest.fixture(scope="module")
def two_input(tmp_path_factory, llvm_target):
    """A model with two inputs of two dtypes and two outputs, x [N, 4] float32
    and ids [N, 3] int64 -> y = x @ W + ids @ V, r = relu(y) (both [N, 5]),
    built on llvm with buckets 1 and 4 and served with a long queue delay so
    that concurrent requests merge."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from deploy import build, pipeline

    work = tmp_path_factory.mktemp(TWO)
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["xw"]),
        helper.make_node("Cast", ["ids"], ["idsf"], to=TensorProto.FLOAT),
        helper.make_node("MatMul", ["idsf", "v"], ["iv"]),
        helper.make_node("Add", ["xw", "iv"], ["y"]),
        helper.make_node("Relu", ["y"], ["r"]),
    ]
    graph = helper.make_graph(
        nodes, TWO,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4]),
         helper.make_tensor_value_info("ids", TensorProto.INT64, ["n", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 5]),
         helper.make_tensor_value_info("r", TensorProto.FLOAT, ["n", 5])],
        [numpy_helper.from_array(rng.standard_normal((4, 5)).astype("float32"), "w"),
         numpy_helper.from_array(rng.standard_normal((3, 5)).astype("float32"), "v")])
    path = work / f"{TWO}.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    cfg = config.from_dict({"model": {"source": str(path), "inputs": [{"name": "x", "shape": [4]},
                                                                      {"name": "ids", "shape": [3], "dtype": "int64"}]},
                            "llvm": {"buckets": [1, 4], "tune_buckets": [1], "trials": 0}})
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(build.os, "cpu_count", lambda: 1)  # compile in this process: spawning workers takes ~15 s here
        summary = pipeline.run(cfg, llvm_target, work / "ws", db_root=work / "db")
    server = serve.start(config.serve_config(port=0, max_queue_delay_ms=300.0), summary["package"])
    yield server, deploy.load(summary["package"])
    server.stop()


def two_inputs(seed: int, batch: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((batch, 4)).astype("float32"), rng.integers(-5, 5, (batch, 3)).astype("int64")


def test_two_inputs_out_of_order_mixed_json_and_binary(two_input):
    server, pred = two_input
    x, ids = two_inputs(1, 2)
    want = pred(x, ids)
    # ids first (the manifest has x first), ids binary and x JSON; y as binary, r as JSON
    outputs = [triton.InferRequestedOutput("r", binary_data=False), triton.InferRequestedOutput("y", binary_data=True)]
    r = client(server).infer(TWO, [infer_input(ids, True, "ids"), infer_input(x, False, "x")], outputs=outputs)
    assert [o["name"] for o in r.get_response()["outputs"]] == ["r", "y"]
    np.testing.assert_allclose(r.as_numpy("y"), want["y"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(r.as_numpy("r"), want["r"], rtol=1e-5, atol=1e-6)
    # and all JSON, in manifest order, with one output asked for
    body = {"inputs": [{"name": "x", "shape": [2, 4], "datatype": "FP32", "data": x.tolist()},
                       {"name": "ids", "shape": [2, 3], "datatype": "INT64", "data": ids.ravel().tolist()}],
            "outputs": [{"name": "y"}]}
    resp = httpx.post(server.url + f"/v2/models/{TWO}/infer", json=body)
    assert resp.status_code == 200 and [o["name"] for o in resp.json()["outputs"]] == ["y"]
    np.testing.assert_allclose(np.array(resp.json()["outputs"][0]["data"]).reshape(2, 5), want["y"], rtol=1e-5)


def test_two_inputs_concurrent_requests_share_a_batch(two_input):
    from tritonclient.http.aio import InferenceServerClient

    server, pred = two_input
    pairs = [two_inputs(10, 1), two_inputs(11, 2)]  # 3 rows: one run of bucket 4
    before = [metric(server, "tvm_serve_batch_requests_" + k, model=TWO) for k in ("sum", "count")]

    async def send_all():
        c = InferenceServerClient(server.url.removeprefix("http://"), conn_limit=2)
        try:
            return await asyncio.gather(*(c.infer(TWO, [infer_input(x, True, "x"), infer_input(ids, True, "ids")])
                                          for x, ids in pairs))
        finally:
            await c.close()

    for (x, ids), r in zip(pairs, asyncio.run(send_all())):
        want = pred(x, ids)
        np.testing.assert_allclose(r.as_numpy("y"), want["y"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(r.as_numpy("r"), want["r"], rtol=1e-5, atol=1e-6)
    after = [metric(server, "tvm_serve_batch_requests_" + k, model=TWO) for k in ("sum", "count")]
    assert (after[0] - before[0], after[1] - before[1]) == (2, 1)  # two requests, one module run


@pytest.mark.parametrize("size, status", [(16, 200), (16.0, 400)])
def test_two_binary_inputs_and_a_float_binary_data_size(two_input, size, status):
    """binary_data_size 16.0 for the first input was a 500 (a float offset for the second)."""
    server, pred = two_input
    x, ids = two_inputs(3, 1)
    header = json.dumps({"inputs": [
        {"name": "x", "shape": [1, 4], "datatype": "FP32", "parameters": {"binary_data_size": size}},
        {"name": "ids", "shape": [1, 3], "datatype": "INT64", "parameters": {"binary_data_size": 24}}]}).encode()
    resp = httpx.post(server.url + f"/v2/models/{TWO}/infer", content=header + x.tobytes() + ids.tobytes(),
                      headers={protocol.HEADER_LENGTH: str(len(header))})
    assert resp.status_code == status, resp.text
    if status == 200:
        np.testing.assert_allclose(np.array(resp.json()["outputs"][0]["data"]), pred(x, ids)["y"][0], rtol=1e-5)
    else:
        assert "binary_data_size" in resp.json()["error"]


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
        (f"/v2/models/{MODEL}/infer", _with(paramters={}), {}, 400, "malformed inference request"),
        (f"/v2/models/{MODEL}/infer", {**_with(), "model_name": "resnet"}, {}, 400,
         "model_name in the body is not the URL's model | got 'resnet' | expected 'tiny_cnn'"),
        (f"/v2/models/{MODEL}/infer", {**_with(), "model_version": "2"}, {}, 400, "model_version in the body"),
        (f"/v2/models/{MODEL}/infer", _with(data=[True] + [0.0] * 767), {}, 400, "wrong kind | got bool"),
        (f"/v2/models/{MODEL}/infer", _with(data=[1e39] + [0.0] * 767), {}, 400, "out of range"),
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


def test_request_bytes_in_flight_are_capped(served):
    """--max-inflight-mb 1: a body still arriving holds its declared 1,000,000
    bytes; another request that would pass the cap gets 503 at once."""
    import socket

    url = served.url + f"/v2/models/{MODEL}/infer"
    overloaded = metric(served, "tvm_serve_requests_total", outcome="overloaded")
    with socket.create_connection((served.host, served.port)) as s:
        s.sendall(f"POST /v2/models/{MODEL}/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n".encode()
                  + b"x" * 1000)
        assert wait_until(lambda: served.app.in_flight_bytes == 1_000_000)
        resp = httpx.post(url, content=b" " * 60_000)
        assert resp.status_code == 503 and resp.headers["Retry-After"] == "1"
        assert "too many request bytes in flight | got 1060000 bytes | expected at most 1048576" in resp.json()["error"]
    assert wait_until(lambda: served.app.in_flight_bytes == 0)
    assert httpx.post(url, json=_with()).status_code == 200
    assert metric(served, "tvm_serve_requests_total", outcome="overloaded") == overloaded + 1


def test_large_bodies_are_decoded_off_the_event_loop(served, monkeypatch):
    threads = []

    def spy(fn):
        def wrapped(*args):
            threads.append(threading.current_thread().name)
            return fn(*args)
        return wrapped

    monkeypatch.setattr(protocol, "decode", spy(protocol.decode))
    monkeypatch.setattr(protocol, "encode", spy(protocol.encode))
    url = served.url + f"/v2/models/{MODEL}/infer"
    assert httpx.post(url, json=_with()).status_code == 200  # small: on the loop
    assert threads == ["uvicorn", "uvicorn"]
    monkeypatch.setattr(server_app, "OFFLOAD_BYTES", 0)  # everything is "large"
    assert httpx.post(url, json=_with()).status_code == 200
    assert len(threads) == 4 and "uvicorn" not in threads[2:]


def test_client_disconnect_is_not_an_error(served):
    import socket

    before = metric(served, "tvm_serve_requests_total", outcome="disconnected")
    with socket.create_connection((served.host, served.port)) as s:
        s.sendall(b"POST /v2/models/tiny_cnn/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n" + b"x" * 1000)
        assert wait_until(lambda: served.app.in_flight == 1)
    assert wait_until(lambda: metric(served, "tvm_serve_requests_total", outcome="disconnected") == before + 1)
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
    model.delay = 1.5
    model.started.clear()
    try:
        with httpx.Client(timeout=30) as c:
            first = threading.Thread(target=c.post, args=(url,), kwargs={"content": json.dumps(_with()).encode()})
            first.start()
            assert model.started.wait(10)  # the first one is running
            t0 = time.monotonic()
            late = c.post(url, json={**_with(), "parameters": {"timeout": 200_000}})  # 0.2 s, in microseconds
            waited = time.monotonic() - t0
            first.join()
    finally:
        model.delay = 0.0
    assert late.status_code == 504 and "no answer in time" in late.json()["error"]
    assert waited < 1.2  # answered at its own deadline, not when the first one finished
    # One more request: once it is answered, the batcher has passed the late one.
    assert httpx.post(url, json=_with()).status_code == 200
    assert metric(server, "tvm_serve_batch_rows_count") == runs + 2  # the late one was dropped, not run
    assert metric(server, "tvm_serve_requests_total", outcome="timeout") == 1


def test_client_leaving_while_queued_is_disconnected(slow):
    import socket

    server, model = slow
    before = {o: metric(server, "tvm_serve_requests_total", outcome=o) for o in ("success", "disconnected")}
    body = json.dumps(_with()).encode()
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
            answers.append(httpx.post(server.url + f"/v2/models/{MODEL}/infer", json=_with(), timeout=30))
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


# ---------------------------------------------------------------- shutdown ---


def test_sigterm_finishes_requests_in_flight(tiny_package, tmp_path):
    """`deploy serve` in its own process: SIGTERM while requests wait in the
    batch queue; every one is answered, then the process exits 0."""
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
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(30)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = log.read_text()
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
                         "--duration-s", "1", "--warmup-s", "0.3", "--raw-seconds", "0.1", "--out", out,
                         "--client-procs", 2, "--no-warmup")
    assert rc == 0, err
    report = json.loads((out / "results.json").read_text())
    assert [lv["concurrency"] for lv in report["levels"]] == [1, 3]
    for lv in report["levels"]:
        assert lv["samples_per_s"] > 0 and lv["statuses"] == {"ok": lv["requests"]}
        assert lv["p50_ms"] <= lv["p99_ms"] and lv["ok_p50_ms"] == lv["p50_ms"]  # no errors: the same answers
        # Server side: a request spends part of its client-side latency in the server, part of that queued.
        assert 0 < lv["queue_ms"] < lv["server_ms"] <= lv["ok_mean_ms"] * 1.5 and lv["batch_ms"] > 0
        assert 0 < lv["batcher_busy"] <= 1.05 and 0 < lv["loop_busy"] <= 1.05 and lv["loop_cpu_us"] > 0
    assert report["client_processes"] == 2
    assert '"warmup": false' in (out / "server.log").read_text()  # --no-warmup reached the server
    assert set(report["raw"]["buckets"]) == {"1", "4"} and report["raw"]["best_samples_per_s"] > 0
    four = report["raw"]["buckets"]["4"]  # the host copy alone, timed apart from the run
    assert 0 < four["staging_median_ms"] < four["run_bucket_median_ms"] and four["staging_gb_per_s"] > 0
    assert report["server_exit_status"] == 0 and report["target_check"] is None
    assert "| concurrency | samples/s |" in (out / "results.md").read_text()
    assert "| concurrency | in server (ms) | queued (ms) | batch run (ms) |" in (out / "results.md").read_text()
    foreign = tmp_path / "mine"
    foreign.mkdir()
    rc, _, err = run_cli(capsys, "loadtest", "--package", tiny_package[0], "--out", foreign)
    assert rc == 2 and "not written by loadtest" in error_line(err)


# ---------------------------------------------------------- shared memory ---


@pytest.fixture(scope="module")
def shm_served(tiny_package):
    server = serve.start(config.serve_config(port=0, shared_memory=True), tiny_package[0])
    yield server
    server.stop()


def test_system_shared_memory_round_trip(shm_served, predictor):
    """tritonclient's own shared-memory helpers: inputs read from a region,
    outputs written into another, the JSON body carrying neither."""
    import tritonclient.utils.shared_memory as shm

    c = client(shm_served)
    assert "system_shared_memory" in c.get_server_metadata()["extensions"]
    x = rng_input(7, batch=2)
    want = predictor(x)["output"]
    key_in, key_out = f"/tvm-deploy-test-in-{os.getpid()}", f"/tvm-deploy-test-out-{os.getpid()}"
    h_in = shm.create_shared_memory_region("t-in", key_in, x.nbytes)
    h_out = shm.create_shared_memory_region("t-out", key_out, want.nbytes + 64)
    try:
        shm.set_shared_memory_region(h_in, [x])
        c.register_system_shared_memory("t-in", key_in, x.nbytes)
        c.register_system_shared_memory("t-out", key_out, want.nbytes + 64)
        status = {r["name"]: r for r in c.get_system_shared_memory_status()}
        assert status["t-in"]["byte_size"] == x.nbytes and status["t-out"]["key"] == key_out
        inp = triton.InferInput("input", list(x.shape), "FP32").set_shared_memory("t-in", x.nbytes)
        out = triton.InferRequestedOutput("output", binary_data=True)
        out.set_shared_memory("t-out", want.nbytes + 64)
        r = c.infer(MODEL, [inp], outputs=[out])
        meta = r.get_output("output")  # the answer is in the region, not the body
        assert "data" not in meta and meta["parameters"]["shared_memory_region"] == "t-out"
        got = shm.get_contents_as_numpy(h_out, np.float32, want.shape)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        # Errors, one line each: a region too small, an unknown region, a name taken, a missing key.
        small = triton.InferRequestedOutput("output", binary_data=True)
        small.set_shared_memory("t-out", 8)
        with pytest.raises(triton_utils.InferenceServerException, match="does not fit its shape"):
            c.infer(MODEL, [inp], outputs=[small])
        ghost = triton.InferInput("input", list(x.shape), "FP32").set_shared_memory("nope", x.nbytes)
        with pytest.raises(triton_utils.InferenceServerException, match="unregistered shared-memory region"):
            c.infer(MODEL, [ghost])
        with pytest.raises(triton_utils.InferenceServerException, match="already registered"):
            c.register_system_shared_memory("t-in", key_in, x.nbytes)
        with pytest.raises(triton_utils.InferenceServerException, match="cannot open shared-memory key"):
            c.register_system_shared_memory("t-x", "/tvm-deploy-no-such-key", 16)
        with pytest.raises(triton_utils.InferenceServerException, match="larger than its object"):
            c.register_system_shared_memory("t-y", key_in, x.nbytes + 1)
    finally:
        c.unregister_system_shared_memory()
        shm.destroy_shared_memory_region(h_in)
        shm.destroy_shared_memory_region(h_out)
    assert c.get_system_shared_memory_status() == []


def test_shared_memory_is_off_by_default(served):
    c = client(served)
    assert "system_shared_memory" not in c.get_server_metadata()["extensions"]
    assert httpx.get(served.url + "/v2/systemsharedmemory/status").status_code == 404
    body = {"inputs": [{"name": "input", "shape": [1, 3, 16, 16], "datatype": "FP32",
                        "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 3072}}]}
    resp = httpx.post(served.url + f"/v2/models/{MODEL}/infer", json=body)
    assert resp.status_code == 400 and "shared-memory tensors are not supported here" in resp.json()["error"]


def test_loadtest_through_shared_memory(capsys, tmp_path, tiny_package):
    out = tmp_path / "lt-shm"
    rc, _, err = run_cli(capsys, "loadtest", "--package", tiny_package[0], "--concurrency", "2",
                         "--duration-s", "1", "--warmup-s", "0.3", "--raw-seconds", "0.1", "--out", out,
                         "--client-procs", 1, "--no-warmup", "--shared-memory")
    assert rc == 0, err
    report = json.loads((out / "results.json").read_text())
    (level,) = report["levels"]
    assert level["requests"] > 0 and level["statuses"] == {"ok": level["requests"]}  # every answer checked
    assert report["config"]["serve"]["shared_memory"] is True
    assert "through system shared memory" in (out / "results.md").read_text()


def test_shared_memory_regions_refuse_what_could_crash_or_escape(tmp_path):
    """deploy.serving.shm.Regions alone: a shrunk object is a 400, not SIGBUS; a
    symbolic link, a NUL in a key or a non-string region name are refused."""
    from deploy.errors import RequestError
    from deploy.serving import shm

    regions = shm.Regions()
    name = f"tvm-deploy-test-shrink-{os.getpid()}"
    path = Path(shm.SHM_DIR) / name
    link = Path(shm.SHM_DIR) / f"{name}-link"
    path.write_bytes(b"\0" * 64)
    try:
        regions.register("r", {"key": "/" + name, "byte_size": 64})
        params = {"shared_memory_region": "r", "shared_memory_byte_size": 64}
        f2 = np.dtype("<f2")
        early, late = regions.input(params, "x", [32], f2), regions.input(params, "x", [32], f2)
        first = np.asarray(early)
        assert not first.any() and first.shape == (32,)
        with pytest.raises(RequestError, match="already read"):  # one read: its descriptor is closed after
            np.asarray(early)
        regions.unregister("r")  # the pending input keeps its own descriptor
        os.truncate(path, 16)  # the client shrinks its object under the pending input ...
        with pytest.raises(RequestError, match="shorter than registered"):
            late.read_into(np.empty(32, f2))  # ... which is then a 400 when staged, not SIGBUS
        regions.register("r", {"key": "/" + name, "byte_size": 16})
        os.truncate(path, 64)
        regions.register("r2", {"key": "/" + name, "byte_size": 64})
        params = {"shared_memory_region": "r2", "shared_memory_byte_size": 64}
        os.truncate(path, 16)
        with pytest.raises(RequestError, match="shorter than registered"):
            regions.input(params, "x", [32], f2)  # shrunk before the request: refused when decoded
        with pytest.raises(RequestError, match="shorter than registered"):
            regions.write(params, "y", b"1" * 64)
        assert path.stat().st_size == 16  # not grown by the write
        with pytest.raises(RequestError, match="invalid shared_memory_region"):
            regions.input({"shared_memory_region": ["r"], "shared_memory_byte_size": 64}, "x", [32], f2)
        with pytest.raises(RequestError, match="invalid shared-memory key"):
            regions.register("n", {"key": "/a\x00b", "byte_size": 1})
        link.symlink_to(tmp_path / "file")
        (tmp_path / "file").write_bytes(b"\0" * 64)
        with pytest.raises(RequestError, match="cannot open shared-memory key"):
            regions.register("l", {"key": "/" + link.name, "byte_size": 8})
    finally:
        regions.close()
        path.unlink(missing_ok=True)
        link.unlink(missing_ok=True)


def test_loadtest_paths_are_the_checkouts():
    """The default results folder and the server's working directory are the
    checkout's (the module sits two folders down in it)."""
    from deploy.serving import loadtest

    repo = Path(__file__).resolve().parent.parent
    out = loadtest.default_out({"model": "m", "target": {"kind": "llvm"}})
    assert out.parent.parent.parent == repo / "results" and out.name == "m-loadtest"
    from deploy.serving import server_process

    assert server_process.REPO_ROOT == repo and (server_process.REPO_ROOT / "deploy" / "__main__.py").is_file()
