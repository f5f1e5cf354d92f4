"""The CPU thread-pool workaround (deploy/passes/cpu_threads.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest

from deploy.passes import cpu_threads


def _threads(code: str, **env) -> int:
    clean = {k: v for k, v in os.environ.items() if k not in ("TVM_NUM_THREADS", "OMP_NUM_THREADS")}
    clean.update(env)
    out = subprocess.run([sys.executable, "-c", code + "\nprint(tvm.runtime.num_threads())"], env=clean,
                         capture_output=True, text=True, timeout=300, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def test_usable_cores_counts_physical_cores_of_the_affinity_mask():
    n = cpu_threads.usable_cores()
    assert 1 <= n <= len(os.sched_getaffinity(0))
    if psutil.cpu_count(logical=True) == psutil.cpu_count(logical=False):
        assert n == len(os.sched_getaffinity(0))


def test_the_pool_gets_every_core_and_the_users_choice_stands():
    assert _threads("from deploy.tvm_compat import tvm") == cpu_threads.usable_cores()
    assert _threads("from deploy.tvm_compat import tvm", TVM_NUM_THREADS="1") == 1
    assert _threads("from deploy.tvm_compat import tvm", OMP_NUM_THREADS="1") == 1


def test_tvm_still_halves_the_cores_of_a_machine_without_smt():
    """Fails once plain TVM gives a one-thread-per-core machine all its
    cores: then deploy/passes/cpu_threads.py can go."""
    if psutil.cpu_count(logical=True) != psutil.cpu_count(logical=False):
        pytest.skip("an SMT machine: TVM's halving is right here")
    if len(os.sched_getaffinity(0)) != os.cpu_count() or os.cpu_count() < 2:
        pytest.skip("needs two or more cores, all of them usable by this process")
    assert _threads("import tvm") < os.cpu_count()
