"""Dynamic batching: requests share a batch and each gets its own rows back;
staging overlaps the running batch; two-input models."""

import asyncio
import concurrent.futures
import json
import os
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as triton

import deploy
from deploy import config
from deploy.serving import protocol, serve

from .helpers import MODEL, Controlled, client, infer_input, metric, rng_input


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
    from deploy.shapes import as_bucket

    four = as_bucket(4)

    clock = [0.0]
    monkeypatch.setattr(batching.time, "perf_counter", lambda: clock[0])

    class Fake:
        launch_waits = False
        wait = 0.0

        def collect(self, batch):
            clock[0] += self.wait
            return {"y": np.zeros((batch.rows, 1))}

        def plan(self, rows, dims=()):
            return [(four, rows)]

        def split(self, batch, out):
            return [out]

    batcher = batching.Batcher(lambda: None, 0.010, server_metrics.Metrics("t"))
    batcher.predictor = fake = Fake()

    def run(collect_at, wait):  # a batch launched at 0, collected at `collect_at`, waiting `wait` there
        job = batching._Job([np.zeros((1, 1))], 1, concurrent.futures.Future(), 0.0)
        job.future.set_running_or_notify_cancel()
        batch = Batch(four, 1, None, [1], {})
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
    # Whether the second request reaches the server before the batcher gives
    # up on company is up to the scheduler (CI once ran them apart): once the
    # batcher holds the first, its next look waits until the second is queued.
    # How long it waits on its own is test_the_batcher_waits_for_company_....
    batcher = server.app.batcher
    real_next = batcher._next

    def next_once_the_second_is_queued(timeout):
        if timeout is None:  # the batcher's wait for a first request
            return real_next(timeout)
        del batcher._next  # back to the class's method for every later look
        give_up = time.monotonic() + 30
        while batcher._queue.empty() and time.monotonic() < give_up:
            time.sleep(1e-3)
        return real_next(timeout)

    batcher._next = next_once_the_second_is_queued

    async def send_all():
        c = InferenceServerClient(server.url.removeprefix("http://"), conn_limit=2)
        try:
            return await asyncio.gather(*(c.infer(TWO, [infer_input(x, True, "x"), infer_input(ids, True, "ids")])
                                          for x, ids in pairs))
        finally:
            await c.close()

    try:
        results = asyncio.run(send_all())
    finally:
        batcher.__dict__.pop("_next", None)
    for (x, ids), r in zip(pairs, results):
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


def test_the_batcher_waits_for_company_only_while_some_can_come(tiny_package):
    """A lone request (nothing queued, nothing admitted on its way in) runs at
    once instead of waiting out --max-queue-delay-ms; one admitted by the
    server and still being read (`arriving`) is waited for, and shares the batch."""
    from deploy.serving.batcher import Batcher
    from deploy.serving.metrics import Metrics

    pred = Controlled(deploy.load(tiny_package[0]))
    launched = []
    real_launch = pred.launch
    pred.launch = lambda batch: (launched.append(batch.rows), real_launch(batch))[1]
    batcher = Batcher(lambda: pred, 0.5, Metrics("t"))
    x = pred.random_inputs(1)
    try:
        t0 = time.perf_counter()
        batcher.submit(x, 1).result(timeout=30)
        assert time.perf_counter() - t0 < 0.25  # not the 0.5 s window
        launched.clear()
        batcher.arriving = 1  # the server has admitted one more, its body not yet read
        first = batcher.submit(x, 1)
        time.sleep(0.05)
        batcher.arriving = 0
        second = batcher.submit(x, 1)
        first.result(timeout=30), second.result(timeout=30)
        assert launched == [2]  # one batch of both
    finally:
        batcher.close(30)
