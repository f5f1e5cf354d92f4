"""Shared fixtures. Tiny models are defined in code (models/tiny.py), never
committed as binaries. Tests run on the `llvm` target; `gpu`-marked tests need
a CUDA GPU and are skipped without one."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

os.environ.setdefault("TQDM_DISABLE", "1")


def _has_gpu() -> bool:
    try:
        import tvm

        return bool(tvm.cuda(0).exist)
    except Exception:
        return False


HAS_GPU = _has_gpu()


def load_script(name: str):
    """scripts/<name>.py as a module (scripts/ is not a package; each
    script puts what it imports on the path itself)."""
    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


SERIAL_DIRS = ("tuning", "serving")  # time-outs, load tests, hung servers: never beside another test


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine)")
    here = Path(__file__).parent
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip)
        rel = Path(str(item.fspath)).relative_to(here) if Path(str(item.fspath)).is_relative_to(here) else None
        if rel is not None and rel.parts[0] in SERIAL_DIRS:
            item.add_marker(pytest.mark.serial)


@pytest.fixture(scope="session")
def llvm_target():
    from deploy import targets

    return targets.resolve("llvm")


def make_config(source: str = "tiny_cnn", **profile):
    from deploy import config

    table = {"buckets": [1, 4], "tune_buckets": [1], "trials": 0, "budget": ""}
    table.update(profile)
    if "buckets" in profile and "tune_buckets" not in profile:
        table["tune_buckets"] = [min(profile["buckets"])]
    return config.from_dict({"model": {"source": source, "seed": 0}, "llvm": table})


@pytest.fixture(scope="session")
def tiny_package(tmp_path_factory, llvm_target):
    """tiny_cnn through every stage on llvm (no tuning): the shared package."""
    from deploy import pipeline

    work = tmp_path_factory.mktemp("tiny_cnn")
    cfg = make_config()
    summary = pipeline.run(cfg, llvm_target, work / "ws", db_root=work / "db")
    return Path(summary["package"]), summary, cfg, work
