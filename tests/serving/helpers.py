"""What the serving tests share: inputs, clients, metrics, waiting, and a
Predictor the test slows down or breaks."""

import threading
import time
from pathlib import Path

import httpx
import numpy as np
import tritonclient.http as triton
from prometheus_client.parser import text_string_to_metric_families

from deploy.serving import protocol

REPO = Path(__file__).resolve().parents[2]
MODEL = "tiny_cnn"


def rng_input(seed: int, batch: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, 3, 16, 16)).astype("float32")


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


GOOD = {"name": "input", "shape": [1, 3, 16, 16], "datatype": "FP32", "data": [0.0] * 768}


def request_with(**changes) -> dict:
    """A good JSON request for tiny_cnn, with `changes` to its input."""
    return {"inputs": [{**GOOD, **changes}]}
