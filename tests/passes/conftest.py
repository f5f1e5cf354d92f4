"""Fixtures shared by the tests of deploy/passes."""

from __future__ import annotations

import pytest

from deploy import targets


@pytest.fixture(scope="session")
def sm90():
    """sm_90 as a TVM target: its CUDA is generated, and compiled where nvcc
    is, on the CPU machine too."""
    return targets.resolve("cuda:sm_90").tvm_target()


@pytest.fixture(scope="session")
def sm90_info():
    """sm_90 as deploy's target (`targets.TargetInfo`)."""
    return targets.resolve("cuda:sm_90")
