"""System shared memory: round trips, off by default, the load test through
it, and regions that could crash the server or escape are refused."""

import json
import os
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
import tritonclient.utils as triton_utils

from deploy import config
from deploy.serving import serve

from ..test_errors import run_cli
from .helpers import MODEL, client, rng_input


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
