"""Servers of the tiny llvm package, one per test module."""


import pytest

import deploy
from deploy import config
from deploy.serving import serve

from .helpers import Controlled


@pytest.fixture(scope="module")
def predictor(tiny_package):
    return deploy.load(tiny_package[0])


@pytest.fixture(scope="module")
def served(tiny_package):
    cfg = config.serve_config(port=0, max_queue_delay_ms=20.0, max_body_mb=1.0, max_inflight_mb=1.0)
    server = serve.start(cfg, tiny_package[0])
    yield server
    server.stop()


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
