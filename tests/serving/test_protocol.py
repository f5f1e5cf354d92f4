"""Protocol conformance through tritonclient (the standard v2 client) and
bad requests through raw HTTP: each gets its one-line error."""

import gzip
import json
import threading

import httpx
import numpy as np
import pytest
import tritonclient.http as triton

import deploy
from deploy.serving import app as server_app
from deploy.serving import protocol

from .helpers import GOOD, MODEL, client, infer_input, metric, metrics, request_with, rng_input, wait_until


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



@pytest.mark.parametrize(
    "path, body, headers, status, message",
    [
        ("/v2/models/nope/infer", request_with(), {}, 404, "unknown model | got 'nope' | expected 'tiny_cnn'"),
        (f"/v2/models/{MODEL}/versions/2/infer", request_with(), {}, 404, "unknown version"),
        (f"/v2/models/{MODEL}/infer", b'{"inputs": [', {}, 400, "malformed JSON"),
        (f"/v2/models/{MODEL}/infer", b"\xff\xfe", {}, 400, "malformed JSON"),
        (f"/v2/models/{MODEL}/infer", {"inputs": []}, {}, 400, "missing input(s) 'input'"),
        (f"/v2/models/{MODEL}/infer", {"input": []}, {}, 400, "malformed inference request"),
        (f"/v2/models/{MODEL}/infer", request_with(name="image"), {}, 400, "unknown input name | got 'image'"),
        (f"/v2/models/{MODEL}/infer", request_with(shape=[1, 3, 8, 32]), {}, 400, "wrong shape"),
        (f"/v2/models/{MODEL}/infer", request_with(shape=[0, 3, 16, 16], data=[]), {}, 400, "wrong shape"),
        (f"/v2/models/{MODEL}/infer", request_with(shape="1x3x16x16"), {}, 400, "malformed inference request"),
        (f"/v2/models/{MODEL}/infer", request_with(datatype="FP16"), {}, 400, "wrong datatype | got FP16 | expected FP32"),
        (f"/v2/models/{MODEL}/infer", request_with(data=[0.0] * 767), {}, 400, "does not match its shape"),
        (f"/v2/models/{MODEL}/infer", request_with(data=[[0.0], [0.0, 1.0]]), {}, 400, "not a rectangular array"),
        (f"/v2/models/{MODEL}/infer", request_with(data=["a"] * 768), {}, 400, "wrong kind"),
        (f"/v2/models/{MODEL}/infer", request_with(data=None), {}, 400, "has no data"),
        (f"/v2/models/{MODEL}/infer", request_with(data=None, parameters={"binary_data_size": 3072}), {}, 400, "shorter"),
        (f"/v2/models/{MODEL}/infer", request_with(data=None, parameters={"binary_data_size": 12}), {}, 400,
         "binary_data_size does not match"),
        (f"/v2/models/{MODEL}/infer", request_with(paramters={}), {}, 400, "malformed inference request"),
        (f"/v2/models/{MODEL}/infer", {**request_with(), "model_name": "resnet"}, {}, 400,
         "model_name in the body is not the URL's model | got 'resnet' | expected 'tiny_cnn'"),
        (f"/v2/models/{MODEL}/infer", {**request_with(), "model_version": "2"}, {}, 400, "model_version in the body"),
        (f"/v2/models/{MODEL}/infer", request_with(data=[True] + [0.0] * 767), {}, 400, "wrong kind | got bool"),
        (f"/v2/models/{MODEL}/infer", request_with(data=[1e39] + [0.0] * 767), {}, 400, "out of range"),
        (f"/v2/models/{MODEL}/infer", request_with(), {"Inference-Header-Content-Length": "99999"}, 400, "does not fit"),
        (f"/v2/models/{MODEL}/infer", {"inputs": [GOOD, GOOD]}, {}, 400, "given twice"),
        (f"/v2/models/{MODEL}/infer", {**request_with(), "outputs": [{"name": "logits"}]}, {}, 400, "unknown output name"),
        (f"/v2/models/{MODEL}/infer", {**request_with(), "parameters": {"binary_data_output": "yes"}}, {}, 400, "true or false"),
        (f"/v2/models/{MODEL}/infer", {**request_with(), "parameters": {"timeout": -1}}, {}, 400, "microseconds"),
        (f"/v2/models/{MODEL}/infer", request_with(), {"Content-Encoding": "br"}, 415, "unsupported Content-Encoding"),
        (f"/v2/models/{MODEL}/infer", request_with(), {"Content-Encoding": "gzip"}, 400, "not valid gzip"),
        ("/v2/nowhere", request_with(), {}, 404, "Not Found"),
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
    header = json.dumps(request_with(data=None, parameters={"binary_data_size": 3072})).encode()
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
    assert httpx.post(url, json=request_with()).status_code == 200
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
    assert httpx.post(url, json=request_with()).status_code == 200  # small: on the loop
    assert threads == ["uvicorn", "uvicorn"]
    monkeypatch.setattr(server_app, "OFFLOAD_BYTES", 0)  # everything is "large"
    assert httpx.post(url, json=request_with()).status_code == 200
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
