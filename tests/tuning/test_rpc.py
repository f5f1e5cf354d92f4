"""Tuning on a pool of RPC servers through TVM's tracker, on loopback and
llvm: a tracker and RPC servers as subprocesses (always stopped in teardown),
short tuning runs of one tiny task measured through them, a server that dies
mid-run, one that hangs, a device that does not match, and bad addresses.

The RPC servers are TVM's own (`deploy rpc-server` runs the same command);
the faulty ones are TVM's server with a fault injected while it loads a
candidate (tests/tuning/rpc_fault_server.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deploy import config
from deploy.config import RPCPool
from deploy.errors import DeviceMismatchError, RPCPoolError, TargetError
from deploy.tuning import builder as tune_builder
from deploy.tuning import database as dbs
from deploy.tuning import devices as rpc_devices
from deploy.tuning import lanes as tune_lanes
from deploy.tuning import pool as rpc_pool
from deploy.tuning import rpc, tune

from ..conftest import make_config

FAULT_SERVER = Path(__file__).with_name("rpc_fault_server.py")


@pytest.fixture(scope="module")
def tiny_opt(tmp_path_factory):
    """tiny_cnn through export, frontend and optimize (no build needed)."""
    from deploy import export, frontend, optimize, targets

    ws = tmp_path_factory.mktemp("rpc_ws")
    cfg = make_config()
    target = targets.resolve("llvm")
    ex = export.run(cfg, ws / "export")
    front = frontend.run(cfg.llvm, ex, ws / "frontend")
    return ex, optimize.run(cfg.llvm, target, front, ws / "optimize")


class Procs:
    """The tracker and servers of one test module; all stopped at the end."""

    def __init__(self, folder: Path):
        self.folder, self.procs = folder, []
        self.port = rpc_pool.free_port()
        self.procs.append(rpc_pool.start_tracker("127.0.0.1", self.port, folder / "tracker.log"))

    def pool(self, key: str, **kw) -> config.RPCPool:
        return config.RPCPool("127.0.0.1", self.port, key, **kw)

    def server(self, key: str) -> rpc_pool.Process:
        p = rpc_pool.start_server(self.pool(key), port=rpc_pool.free_port(), log_path=self.folder / f"{key}-{len(self.procs)}.log")
        self.procs.append(p)
        return p

    def fault_server(self, key: str, fault: str, at: int) -> tuple[rpc_pool.Process, Path]:
        count = self.folder / f"{key}-{len(self.procs)}.count"
        cmd = [sys.executable, str(FAULT_SERVER), "--tracker", f"127.0.0.1:{self.port}", "--key", key,
               "--port", str(rpc_pool.free_port()), "--fault", fault, "--at", str(at), "--count-file", str(count)]
        with open(self.folder / f"{key}-{len(self.procs)}.log", "ab") as log:
            p = rpc_pool.Process(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True), None)
        self.procs.append(p)
        return p, count

    def stop(self):
        for p in self.procs:
            p.stop()


@pytest.fixture(scope="module")
def procs(tmp_path_factory):
    p = Procs(tmp_path_factory.mktemp("rpc"))
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture(scope="module")
def pair(procs):
    """Two servers under one key: TVM's plain server, and one that dies while
    loading its first candidate."""
    procs.server("pair")
    dying, count = procs.fault_server("pair", "die", at=1)
    pool = procs.pool("pair")
    rpc_pool.wait_for_servers(pool, 2)
    return pool, dying, count


def _records(db_dir: Path) -> list[float]:
    """Mean run time of every record in a packed database."""
    out = []
    for line in dbs._packed_lines(db_dir / (dbs.RECORDS + dbs.PACKED)):
        _, rec = json.loads(line)
        secs = [float(x) for x in rec[1]]
        out.append(sum(secs) / len(secs))
    return out


def _tune(cfg, target, tiny_opt, db_root, folder, pool):
    exported, opt = tiny_opt
    a = tune.run(cfg.llvm, target, opt, cfg.model.name, exported.inputs, db_root, folder, None, pool=pool)
    return json.loads((a.folder / "summary.json").read_text())["1"], a


# ------------------------------------------------------------- devices ---


def test_pool_devices_checked(pair, llvm_target):
    pool = pair[0]
    found = rpc_devices.check_pool(pool, llvm_target)
    assert len(found) == 2 and len({f.address for f in found}) == 2
    assert all(not f.cuda and f.arch == llvm_target.arch for f in found)
    # A database for a GPU: these CPU-only servers are refused, with the server named.
    from deploy import targets

    gpu = targets.resolve("cuda:sm_90")
    with pytest.raises(DeviceMismatchError, match=r"RPC server 127\.0\.0\.1:\d+ under key 'pair' has no CUDA GPU, refused"):
        rpc_devices.check_pool(pool, gpu)
    # Another CPU than the database's.
    other = dataclasses.replace(llvm_target, arch="cascadelake")
    with pytest.raises(DeviceMismatchError, match="has another CPU.*got cpu .*expected cpu cascadelake"):
        rpc_devices.check_pool(pool, other)
    # What the pool resolves TARGET to: auto -> this CPU (no GPU there); cuda -> refused.
    assert rpc_devices.resolve_target("auto", pool) == llvm_target
    with pytest.raises(TargetError, match="has no CUDA GPU"):
        rpc_devices.resolve_target("cuda", pool)
    with pytest.raises(TargetError, match="has no CUDA GPU"):
        rpc_devices.resolve_target("cuda:sm_90", pool)


def test_cli_refuses_mismatch_and_lists_servers(pair, capsys):
    from deploy import cli

    pool = pair[0]
    rc = cli.main(["tune", "-m", "tiny_cnn", "--target", "cuda:sm_90", "--tracker", pool.address, "--rpc-key", pool.key])
    err = capsys.readouterr().err
    assert rc == 2 and "has no CUDA GPU" in err and len(err.strip().splitlines()) == 2  # the error, then FAILED
    assert cli.main(["rpc-status", "--tracker", pool.address, "--rpc-key", pool.key]) == 0
    out = capsys.readouterr().out
    assert out.count("(no CUDA GPU)") == 2 and "2 server(s)" in out


def test_remote_cuda_target_is_a_local_runs_target():
    """A GPU read through RPC gives the target string (and so the database)
    of a run on that GPU's own host: the same fields as TVM's detector."""
    from tvm.backend.cuda import _detect_target_from_device

    from deploy import targets

    class H200:  # the attributes a (remote) tvm Device answers
        max_shared_memory_per_block, max_threads_per_block, warp_size = 49152, 1024, 32
        compute_version, device_name = "9.0", "NVIDIA H200"

    info = targets.cuda_from_device(H200(), has_device=False)
    spec = {k: v for k, v in dict(_detect_target_from_device(H200()).export()).items() if k not in ("host", "tag")}
    spec["keys"] = list(spec["keys"])
    assert json.loads(info.spec) == json.loads(json.dumps(spec, default=str))
    assert (info.arch, info.device_name) == ("sm_90", "NVIDIA H200")
    gpu = rpc_devices.ServerDevice("h:1", True, "NVIDIA H200", "sm_90")
    assert rpc_devices.mismatch(gpu, info) is None
    assert rpc_devices.mismatch(dataclasses.replace(gpu, name="NVIDIA H100"), info) == "another GPU"
    assert rpc_devices.mismatch(dataclasses.replace(gpu, arch="sm_80"), info) == "another GPU"


def test_pool_cuda_sm_target_is_a_local_runs_key(monkeypatch):
    """TARGET=cuda:sm_XY with a pool: the database key of a local run with
    the same TARGET on that GPU (generic spec, the arch as written), only the
    GPU name taken from the server; auto/cuda still read the device."""
    from deploy import targets

    class H200:
        max_shared_memory_per_block, max_threads_per_block, warp_size = 49152, 1024, 32
        compute_version, device_name, exist = "9.0", "NVIDIA H200", True

    monkeypatch.setattr(targets, "_cuda_device", lambda: H200())
    found = rpc_devices.ServerDevice("h:1", True, "NVIDIA H200", "sm_90")
    for text in ("cuda:sm_90", "cuda:sm_90a"):
        pooled = rpc_devices._pool_cuda_target(text, found, H200())
        assert pooled.key() == targets.resolve(text).key() and pooled.arch == text[5:]
        assert rpc_devices.mismatch(found, pooled) is None
    assert rpc_devices._pool_cuda_target("cuda", found, H200()).key() == targets.resolve("cuda").key()
    # A server of another architecture is still refused for cuda:sm_80.
    assert rpc_devices.mismatch(found, rpc_devices._pool_cuda_target("cuda:sm_80", found, H200())) == "another GPU"


def test_server_errors_before_loading_are_not_the_candidates(monkeypatch):
    """An RPCError raised by the server before the candidate is loaded
    (upload here) is a lost session, retried elsewhere; one raised while
    loading it is the candidate's failure."""
    import tvm.rpc
    from tvm.error import RPCError

    class Sess:
        def __init__(self, fail):
            self.fail = fail

        def cuda(self, _):
            return type("D", (), {"exist": False})()

        def get_function(self, name):
            return (lambda: "znver4") if name == "target.llvm_get_system_cpu" else (lambda *a: None)

        def device(self, *_):
            return object()

        def upload(self, *_):
            if self.fail == "upload":
                raise RPCError("disk full")

        def load_module(self, _):
            raise RPCError("bad kernel")

        def remove(self, _):
            pass

    def measure(fail):
        monkeypatch.setattr(tvm.rpc, "connect", lambda *a, **k: Sess(fail))
        return rpc._measure("h", 1, "k", 5.0, "/x/a.so", "cpu", (), None, "llvm", "x86-64-v4", "znver4")

    status, why = measure("upload")
    assert status == "lost" and "before loading the candidate" in why and "disk full" in why
    status, why = measure("load")
    assert status == "error" and "bad kernel" in why


def test_retries_avoid_hung_and_lost_servers(llvm_target):
    """A hung server handed out by the tracker is skipped, always; the server
    where the candidate's session was lost is skipped while another comes."""
    m = rpc.Measurer(config.RPCPool("127.0.0.1", 1, "k"), llvm_target, 2, None, 5.0)
    try:
        handed = iter([("h", 1, "a"), ("h", 2, "b"), ("h", 3, "c"), ("h", 2, "d"), ("h", 2, "e"), ("h", 2, "f"), ("h", 2, "g")])
        m._request = lambda: next(handed)
        m.hung.add("h:1")
        assert m._acquire({"h:2"}) == ("h", 3, "c")  # h:1 hung, h:2 lost this candidate's session
        assert m._acquire({"h:2"}) == ("h", 2, "g")  # only h:2 comes: taken after AVOID_SKIPS skips
    finally:
        m.close()


# ---------------------------------------------------------------- tuning ---


def test_tune_on_two_servers_one_dies_mid_run(pair, llvm_target, tiny_opt, tmp_path):
    """Eight candidates over two servers; one server dies while loading its
    first (both get one in the first batch: two dispatchers, both servers
    free): that candidate is measured on the other, nothing is recorded as
    failed, every candidate is in the database."""
    pool, dying, count = pair
    cfg = make_config(trials=8, trials_per_task=8, trials_per_iter=4, max_tasks=1)
    s, a = _tune(cfg, llvm_target, tiny_opt, tmp_path / "db", tmp_path / "t", pool)
    assert not dying.alive()
    assert len(count.read_text().splitlines()) == 1  # it died at its 1st candidate
    r = s["rpc"]
    measured = {addr: v["measured"] for addr, v in r["servers"].items()}
    lost = {addr: v["lost"] for addr, v in r["servers"].items()}
    assert len(measured) == 2 and sorted(measured.values()) == [0, 8] and sorted(lost.values()) == [0, 1], r
    assert r["lost_sessions"] == 1 and r["retried"] == 1, r
    assert r["sessions"] <= 5, r  # a session serves a server's share of a batch, not one candidate
    assert s["new_trials"] == 8 and s["valid_fraction"] == 1.0 and s["trials_after"] == 8
    (task,) = s["tasks"].values()
    assert task["run_errors"] == 0 and task["best_us"] is not None
    recs = _records(a.databases[1])
    assert len(recs) == 8 and max(recs) < dbs.FAILED_SECS  # no record of the lost session
    assert a.manifest["rpc"]["servers"] == 2
    from deploy import pipeline

    text = pipeline.format_summary({"package": "p", "buckets": {}, "tuning": {"1": s}, "validation": None})
    assert "measured on 2 RPC server(s) under key 'pair'" in text and "1 lost session(s), re-measured elsewhere" in text


def test_every_server_lost_stops_cleanly(procs, llvm_target, tiny_opt, tmp_path, monkeypatch):
    """One server, which hangs while loading its third candidate: after the
    session time-out it is given up on, nothing is left, tuning stops with
    one error, and the two records measured before are kept."""
    monkeypatch.setattr(rpc, "HANG_GRACE_S", 5.0)
    hanging, count = procs.fault_server("solo", "hang", at=3)
    pool = procs.pool("solo")
    rpc_pool.wait_for_servers(pool, 1)
    cfg = make_config(trials=6, trials_per_task=6, trials_per_iter=2, max_tasks=1, runner_timeout_s=10.0)  # only the hung session waits
    with pytest.raises(RPCPoolError, match="every RPC server under key 'solo' was lost; tuning stopped"):
        _tune(cfg, llvm_target, tiny_opt, tmp_path / "db", tmp_path / "t", pool)
    assert hanging.alive() and len(count.read_text().splitlines()) == 3  # hung, not dead
    assert not (tmp_path / "t").exists()  # no tune artifact from a run that failed
    (db_dir,) = [p.parent for p in (tmp_path / "db").rglob("key.json")]
    recs = _records(db_dir)
    assert len(recs) == 2 and max(recs) < dbs.FAILED_SECS  # measured ones kept, lost ones not recorded
    assert not (db_dir / dbs.RECORDS).exists()  # packed


# ----------------------------------------------------------- bad inputs ---


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tracker", "localhost", "--rpc-key", "k"], "invalid --tracker | got 'localhost' | expected HOST:PORT"),
        (["--tracker", "127.0.0.1:70000", "--rpc-key", "k"], "invalid --tracker"),
        (["--tracker", "127.0.0.1:9190"], "--tracker needs --rpc-key"),
        (["--rpc-key", "k"], "--rpc-key needs --tracker"),
        (["--tracker", "127.0.0.1:{free}", "--rpc-key", "k"], "cannot reach the RPC tracker | got 127.0.0.1:"),
    ],
)
def test_bad_pool_arguments(argv, message, capsys):
    from deploy import cli

    argv = [a.replace("{free}", str(rpc_pool.free_port())) for a in argv]
    assert cli.main(["tune", "-m", "tiny_cnn", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: " + message) and len(err.strip().splitlines()) == 2


def test_no_server_under_key(procs, capsys):
    from deploy import cli

    assert cli.main(["run", "-m", "tiny_cnn", "--tracker", f"127.0.0.1:{procs.port}", "--rpc-key", "nobody"]) == 2
    assert "error: no RPC server registered under key 'nobody'" in capsys.readouterr().err


def test_server_command_checks(procs, capsys):
    from deploy import cli

    # A server on loopback cannot serve through a tracker on another address.
    assert cli.main(["rpc-server", "--tracker", "10.0.0.1:9190", "--key", "k"]) == 2
    assert "an RPC server on loopback cannot be reached" in capsys.readouterr().err
    # The tracker's port is taken (by the test's tracker).
    assert cli.main(["rpc-tracker", "--port", str(procs.port)]) == 2
    assert f"cannot listen for the RPC tracker at 127.0.0.1:{procs.port}" in capsys.readouterr().err


# ----------------------------------------------------------------- lanes ---


def test_split_tasks_balances_trials_left():
    todo = [{"name": n, "left": left, "flops": 1.0, "weight": 1.0}
            for n, left in [("a", 64), ("b", 64), ("c", 30), ("d", 20), ("e", 10), ("f", 4)]]
    lanes = tune_lanes.split_tasks(todo, 2)
    assert sorted(p["name"] for lane in lanes for p in lane) == list("abcdef")  # each task in one lane
    loads = [sum(p["left"] for p in lane) for lane in lanes]
    assert sum(loads) == 192 and max(loads) - min(loads) <= 4  # within the smallest task
    assert tune_lanes.split_tasks(todo[:1], 3) == [[todo[0]]]  # no empty lane
    assert tune_lanes.lanes(None, 4) == 1  # a local GPU measures one candidate at a time
    assert tune_lanes.lanes(RPCPool("h", 1, "k"), 3) == 3 and tune_lanes.lanes(RPCPool("h", 1, "k", lanes=2), 3) == 2


def test_lane_cpus_share_or_as_asked(monkeypatch):
    monkeypatch.setattr(tune_builder, "usable_cpus", lambda: 32)
    assert tune_lanes.lane_cpus(None, 1) == 32
    assert tune_lanes.lane_cpus(RPCPool("h", 1, "k"), 2) == 16 and tune_lanes.lane_cpus(RPCPool("h", 1, "k"), 64) == 1
    assert tune_lanes.lane_cpus(RPCPool("h", 1, "k", lane_cpus=32), 2) == 32  # overlapping lanes
    assert tune_lanes.lane_cpus(RPCPool("h", 1, "k", lane_cpus=99), 2) == 32  # never more than the machine has


def test_tune_in_two_lanes_one_server_dies(procs, llvm_target, tiny_opt, tmp_path):
    """Two tasks in two lanes (processes), measuring on two servers, one of
    which dies at its first candidate: that candidate is measured on the
    other; both lanes' records end up in the one database, each task's
    trials as asked, none recorded as failed."""
    procs.server("lanes")
    dying, count = procs.fault_server("lanes", "die", at=1)
    # Each lane given every CPU (--rpc-lane-cpus), as on a GPU host where lanes overlap.
    pool = dataclasses.replace(procs.pool("lanes"), lane_cpus=tune_builder.usable_cpus())
    rpc_pool.wait_for_servers(pool, 2)
    cfg = make_config(trials=12, trials_per_task=6, trials_per_iter=3, max_tasks=2)
    s, a = _tune(cfg, llvm_target, tiny_opt, tmp_path / "db", tmp_path / "t", pool)
    assert len(s["lanes"]) == 2 and all(lane["cpus"] == tune_builder.usable_cpus() for lane in s["lanes"])
    assert sorted(t for lane in s["lanes"] for t in lane["tasks"]) == sorted(s["tasks"])  # disjoint, all covered
    assert [lane["new_trials"] for lane in s["lanes"]] == [6, 6]
    assert s["build"]["batches"] == sum(lane["build"]["batches"] for lane in s["lanes"]) >= 2  # combined
    assert s["build"]["candidates"] == sum(lane["build"]["candidates"] for lane in s["lanes"]) and "build_times" not in s
    assert s["new_trials"] == 12 and s["valid_fraction"] == 1.0 and s["trials_after"] == 12
    assert all(t["trials"] == 6 and t["best_us"] is not None for t in s["tasks"].values())
    r = s["rpc"]
    assert sum(v["measured"] for v in r["servers"].values()) == 12
    if count.is_file():  # the dying server got a candidate: it died and the candidate went elsewhere
        assert not dying.alive() and r["lost_sessions"] == 1
    recs = _records(a.databases[1])
    assert len(recs) == 12 and max(recs) < dbs.FAILED_SECS
    assert not (a.databases[1] / dbs.RECORDS).exists()  # packed
    assert not dbs.lane_dirs(a.databases[1])  # the lanes' databases folded in and removed
    # A second run finds every task's budget done: nothing tuned, nothing lost.
    s2, _ = _tune(cfg, llvm_target, tiny_opt, tmp_path / "db", tmp_path / "t2", pool)
    assert s2["new_trials"] == 0 and s2["trials_after"] == 12 and "lanes" not in s2
    from deploy import pipeline

    text = pipeline.format_summary({"package": "p", "buckets": {}, "tuning": {"1": s}, "validation": None})
    assert "summed over 2 lanes" in text and "measured on 2 RPC server(s) under key 'lanes'" in text


@pytest.mark.parametrize("argv, message", [
    (["--rpc-lanes", "-1", "--tracker", "127.0.0.1:9190", "--rpc-key", "k"], "invalid --rpc-lanes | got -1"),
    (["--rpc-lanes", "1", "--rpc-lane-cpus", "4"], "--rpc-lane-cpus needs --tracker and --rpc-key | got 4"),
    (["--rpc-lane-cpus", "-2", "--tracker", "127.0.0.1:9190", "--rpc-key", "k"], "invalid --rpc-lane-cpus | got -2"),
    (["--rpc-lane-cpus", "8"], "--rpc-lane-cpus needs --tracker and --rpc-key"),
    (["--rpc-lanes", "2", "--rpc-lane-cpus", "-3"], "invalid --rpc-lane-cpus | got -3"),  # lanes on this machine too
])
def test_bad_lanes(argv, message, capsys):
    from deploy import cli

    assert cli.main(["tune", "-m", "tiny_cnn", *argv]) == 2
    assert capsys.readouterr().err.startswith("error: " + message)


def test_lane_budgets_are_whole_batches():
    assert tune_lanes.lane_budgets([128, 128], 192, 64) == [128, 64]  # not 96 + 96, which MetaSchedule runs as 128 + 128
    assert tune_lanes.lane_budgets([128, 128], 256, 64) == [128, 128]
    assert tune_lanes.lane_budgets([10, 5], 100, 64) == [10, 5]  # everything left fits
    assert tune_lanes.lane_budgets([128, 128], 64, 64) == [64, 0]  # one batch: one lane (the other is dropped)
    assert tune_lanes.lane_budgets([30, 30, 30, 30], 100, 64) == [30, 30, 30, 30]  # short lanes: the budget still spent
    assert tune_lanes.lane_budgets([1, 1, 1], 2, 64) == [1, 1, 0]
    assert 1000 <= sum(tune_lanes.lane_budgets([640, 640, 600], 1000, 64)) < 1000 + 64


def _candidate(folder: Path, n: int):
    """A built elementwise kernel over n floats, exported as MetaSchedule's
    builder names every candidate (`candidate.so`, in a folder of its own)."""
    from tvm import te

    from deploy.tvm_compat import ms, tvm

    a = te.placeholder((n,), "float32", name="a")
    b = te.compute((n,), lambda i: a[i] * 2.0 + 1.0, name="b")
    func = te.create_prim_func([a, b])
    folder.mkdir(parents=True)
    path = folder / "candidate.so"
    tvm.tirx.build(func, target="llvm").export_library(str(path))
    return ms.runner.RunnerInput(str(path), "cpu", ms.arg_info.ArgInfo.from_prim_func(func))


def test_kept_session_runs_each_candidates_own_kernel(procs, llvm_target, tmp_path):
    """Two candidates measured in one kept session: each runs its own code.
    (Uploaded under one name, the second would have run the first's kernel.)"""
    from deploy.tvm_compat import ms

    procs.server("kept")
    pool = procs.pool("kept")
    rpc_pool.wait_for_servers(pool, 1)
    small, big = _candidate(tmp_path / "a", 64), _candidate(tmp_path / "b", 1 << 22)
    cfg = ms.runner.EvaluatorConfig(number=3, repeat=1, min_repeat_ms=0, enable_cpu_cache_flush=False)
    m = rpc.Measurer(pool, llvm_target, 1, cfg, 30.0)
    try:
        futures = [m.submit(x) for x in (small, big)]  # both queued: one session serves both
        res = [f.result() for f in futures]
    finally:
        m.close()
    assert all(r.error_msg is None for r in res), [r.error_msg for r in res]
    t_small, t_big = (min(float(x) for x in r.run_secs) for r in res)
    assert t_big > 20 * t_small, (t_small, t_big)  # 65536x the work
    assert m.stats["sessions"] == 1, m.stats


def test_slow_candidate_fails_without_taking_its_server(procs, llvm_target, tmp_path):
    """A candidate that runs past the time-out, in a kept session or not, is
    timed out by the server (its session ends), recorded as failed, and the
    server stays in use: not lost, not marked hung."""
    from deploy.tvm_compat import ms

    procs.server("slow")
    pool = procs.pool("slow")
    rpc_pool.wait_for_servers(pool, 1)
    small = _candidate(tmp_path / "a", 64)
    cfg = ms.runner.EvaluatorConfig(number=1, repeat=1, min_repeat_ms=4000, enable_cpu_cache_flush=False)
    m = rpc.Measurer(pool, llvm_target, 1, cfg, 2.0)
    try:
        (res,) = [f.result() for f in [m.submit(small)]]
    finally:
        m.close()
    assert res.error_msg and "timed out after 2 s" in res.error_msg and not res.error_msg.startswith(rpc.LOST), res.error_msg
    assert not m.hung and m.stats["lost_sessions"] == 0, m.stats


def test_lanes_without_tracker_tune_through_a_loopback_pool(tmp_path, monkeypatch, capsys):
    """`run --rpc-lanes 2` with no tracker: the pipeline gets a loopback
    pool that starts (a tracker and one server on loopback for this
    machine's device, a pool of 2 lanes) only when the tune stage has work,
    and is stopped when the run ends (here by an error in the pipeline)."""
    from deploy import cli, pipeline

    seen = {}

    def fake_run(cfg, target, workdir, db_root, pool=None, **kw):
        seen["lazy"] = pool
        seen["before"] = pool and pool.started
        seen["pool"] = pool and pool.start()  # what the tune stage does once a database has trials left
        seen["servers"] = pool and rpc_pool.wait_for_servers(seen["pool"], 1)
        raise RPCPoolError("stop here", None, "the test's end")

    monkeypatch.setattr(pipeline, "run", fake_run)
    argv = ["run", "-m", "tiny_cnn", "--target", "llvm", "--workdir", str(tmp_path / "ws"), "--db-root",
            str(tmp_path / "db"), "--rpc-lanes", "2"]
    assert cli.main(argv) == 2
    assert isinstance(seen["lazy"], rpc_pool.LazyLoopback) and seen["before"] is None
    pool = seen["pool"]
    assert pool.host == "127.0.0.1" and pool.key == f"loopback-{os.getpid()}" and pool.lanes == 2
    assert len(seen["servers"]) == 1
    out = capsys.readouterr()
    assert "from 2 tuning lanes (a loopback pool, started when a database has trials left)" in out.out
    assert out.err.startswith("error: stop here")
    with pytest.raises(RPCPoolError):  # the tracker (and its server) are gone
        rpc_devices.Tracker(pool.host, pool.port, timeout=2.0).close()
    assert (tmp_path / "ws" / "rpc-loopback" / "server.log").is_file()
    # Nothing to tune (TRIALS=0): no pool is started at all.
    seen.clear()
    assert cli.main([*argv, "--trials", "0"]) == 2 and seen["pool"] is None


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_loopback_pool_ends_with_a_terminated_or_killed_run(tmp_path, sig):
    """A process holding a loopback pool gets SIGTERM (what `timeout` and job
    schedulers send: handlers stop the pool) or SIGKILL (no handler runs:
    the parent-death signal its tracker and server were started with ends
    them): either way they go, though they run in sessions of their own."""
    import signal
    import time

    script = ("import sys, time; from pathlib import Path; from deploy.tuning import pool as rpc_pool\n"
              "with rpc_pool.loopback_pool(2, 0, Path(sys.argv[1])) as pool:\n"
              "    print(pool.port, flush=True); time.sleep(600)\n")
    p = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                         cwd=Path(__file__).resolve().parents[2])
    try:
        port = int(p.stdout.readline())
        rpc_devices.Tracker("127.0.0.1", port, timeout=2.0).close()  # up
        p.send_signal(getattr(signal, sig))
        rc = p.wait(60)
        assert rc == (128 + signal.SIGTERM if sig == "SIGTERM" else -signal.SIGKILL)
    finally:
        p.kill()
    deadline = time.time() + 15
    while True:
        try:
            rpc_devices.Tracker("127.0.0.1", port, timeout=1.0).close()
        except RPCPoolError:
            break  # the tracker is gone
        assert time.time() < deadline, f"the loopback tracker outlived the run ({sig})"
        time.sleep(0.3)
    assert (tmp_path / "server.log").is_file()


def test_a_local_gpu_tunes_in_two_lanes_unless_told_otherwise(monkeypatch):
    """On a machine with a GPU and 8+ CPUs, `run` tunes in two lanes through
    a loopback pool by default (tuning is CPU-bound: a second lane searches
    and builds while the first measures); `--rpc-lanes 1` keeps one process,
    and a machine with few CPUs, the CPU target or a tracker get none."""
    from deploy import cli, config, targets
    from deploy.tuning import builder

    gpu = targets.TargetInfo("cuda", '{"arch": "sm_90", "kind": "cuda"}', "sm_90", "NVIDIA H200", True)
    monkeypatch.setattr(targets, "resolve", lambda text: gpu)

    def loopback(*extra, cpus=16):
        monkeypatch.setattr(builder, "usable_cpus", lambda: cpus)
        args = cli.parser().parse_args(["run", "-m", "tiny_cnn", *extra])
        cli.prepare(args)
        return args.loopback

    assert loopback() == (config.LOCAL_LANES, 0) and config.LOCAL_LANES == 2
    assert loopback("--rpc-lanes", "1") is None
    assert loopback("--rpc-lanes", "3") == (3, 0)
    assert loopback(cpus=4) is None
    monkeypatch.setattr(targets, "resolve", lambda text: dataclasses.replace(gpu, has_device=False))
    assert loopback() is None
