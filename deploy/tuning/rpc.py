"""Tuning candidates measured on a pool of devices through TVM's RPC tracker.

TVM's own distributed engine does the distribution: a tracker
(`python -m tvm.exec.rpc_tracker`) and one RPC server per GPU
(`python -m tvm.exec.rpc_server --tracker H:P --key K`, with
CUDA_VISIBLE_DEVICES naming its GPU). The tracker hands each session to a
free server under the key. This module starts those processes, checks the
servers' devices against the tuning database's target, and measures
candidates on them; building stays local (tune.py's parallel builder).

Why not MetaSchedule's RPCRunner: it records a lost session (a server that
died or hung) as a failed candidate, run time 1e10 s, which goes into the
database as if the schedule were bad, and the candidate is never measured.
Here each candidate runs in a session of its own, in a worker process that is
killed if the session outlasts its time-out; then:
  - the server raised (kernel or load error) or it ended the session at its
    own time-out (too slow): a genuine failure, recorded as MetaSchedule does;
  - the session was lost (connection refused or closed, no answer in time):
    the candidate is retried once on another server (never on the one it
    was lost on while another can be had); lost twice, it counts as failed
    ("session lost twice": it likely crashes servers). A server that did not
    answer is never used again in this run. The tracker itself drops a server
    that died;
  - no server left under the key (or the tracker gone, or a server with
    another device): tuning stops at the end of the current batch, the
    candidates that could not be measured are not recorded, and the run ends
    with one line (`RPCPoolError`). What was measured is in the database.

Device check. CUDA: the server's `cuda(0)` must exist and have the target's
architecture and GPU name (for `auto`/`cuda` its target string is read from
the device the way a local run reads it; for `cuda:sm_XY` it is the generic
spec `targets.resolve` builds, with the GPU name from the server: either way
the database is a local run's on that GPU). llvm: the server's LLVM
CPU name must be the target's `mcpu` (core count and triple are not checked:
they do not change the generated code's correctness, only its speed).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

from ..config import RPCPool
from ..errors import ConfigError, DeviceMismatchError, RPCPoolError, TargetError
from ..targets import TargetInfo

log = logging.getLogger(__name__)

# Prefix of the error of a candidate that could not be measured because the
# pool was lost: such results are not written to the database.
LOST = "rpc-lost: "
# Session time-out is the runner time-out; a session with no answer this much
# later (connect, upload, and the server's own time-out reply) is a hung server.
HANG_GRACE_S = 10.0
# The longest wait for a free server while servers are registered.
WAIT_FREE_S = 1800.0


# ------------------------------------------------------------- processes ---


def tracker_command(host: str, port: int) -> list[str]:
    # --port-end port+1: TVM would otherwise bind the next free port silently.
    return [sys.executable, "-m", "tvm.exec.rpc_tracker", "--host", host, "--port", str(port), "--port-end", str(port + 1)]


def server_command(tracker: str, key: str, host: str, port: int, port_end: int, custom_addr: str | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "tvm.exec.rpc_server", "--tracker", tracker, "--key", key,
           "--host", host, "--port", str(port), "--port-end", str(port_end)]
    return cmd + (["--custom-addr", custom_addr] if custom_addr else [])


def server_env(gpu: str | None) -> dict:
    env = dict(os.environ)
    # TVM's server forks a process per session. tvm_ffi loads PyTorch's C
    # DLPack extension at import, which initialises CUDA in the server, and
    # a forked child of a process that has initialised CUDA cannot use it
    # (cudaErrorInitializationError in every session; seen on the H200s).
    env["TVM_FFI_DISABLE_TORCH_C_DLPACK"] = "1"
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    return env


def check_port_free(host: str, port: int, what: str) -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise ConfigError(f"cannot listen for the {what} at {host}:{port}", e.strerror, "a free port on an address of this host") from None


def check_server_address(host: str, tracker_host: str) -> None:
    """A server bound to loopback registers the address the tracker sees it
    from, where nothing listens, unless the tracker is on loopback too."""
    loop = host in ("127.0.0.1", "localhost", "::1")
    if loop and tracker_host not in ("127.0.0.1", "localhost", "::1"):
        raise ConfigError(
            "an RPC server on loopback cannot be reached through a tracker on another address", f"--host {host}",
            "--host 0.0.0.0 (or this host's address) with a remote tracker",
        )


@dataclasses.dataclass
class Process:
    """A tracker or server started in a process group of its own."""

    popen: subprocess.Popen
    log_path: Path | None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM to the group (the server's session and pool workers too),
        SIGKILL after `timeout`."""
        if self.alive():
            self.signal(signal.SIGTERM)
            self.signal(signal.SIGCONT)  # a stopped (hung) process acts on SIGTERM only once continued
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self.signal(signal.SIGKILL)  # children that outlived their parent
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def log_tail(self, n: int = 5) -> str:
        if not self.log_path or not self.log_path.is_file():
            return ""
        return " / ".join(ln.strip() for ln in self.log_path.read_text(errors="replace").splitlines()[-n:])


# Runs a command tied to its parent, as the leader of the command's process
# group: on Linux, PR_SET_PDEATHSIG sends it SIGTERM when the process that
# started it dies, even by SIGKILL, and it then ends the whole group (TVM's
# tracker and server do their work in child processes); elsewhere it just
# runs the command. Process.stop's SIGTERM to the group lands here too.
_TIED = """import ctypes, os, signal, subprocess, sys
child = None
def end(*_):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.killpg(0, signal.SIGTERM)
    try:
        child and child.wait(5)
    except subprocess.TimeoutExpired:
        pass
    os.killpg(0, signal.SIGKILL)
signal.signal(signal.SIGTERM, end)
try:
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)
except (OSError, AttributeError):
    pass
child = subprocess.Popen(sys.argv[1:])
sys.exit(child.wait())
"""


def _spawn(cmd: list[str], log_path: Path | None, env: dict | None = None, tied: bool = False) -> Process:
    """`tied`: the child dies with this process (for helpers of one run)."""
    if tied:
        cmd = [sys.executable, "-c", _TIED, *cmd]
    with open(log_path or os.devnull, "ab") as out:  # the child keeps its own copy of the descriptor
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                             start_new_session=True)
    return Process(p, log_path)


def start_tracker(host: str, port: int, log_path: Path | None = None, wait_s: float = 60.0, tied: bool = False) -> Process:
    """Start a tracker and wait until it answers (it, not another process
    that took the port meanwhile: the tracker must still be running)."""
    check_port_free(host, port, "RPC tracker")
    proc = _spawn(tracker_command(host, port), log_path, tied=tied)
    deadline = time.time() + wait_s
    try:
        while True:
            try:
                Tracker(host if host not in ("0.0.0.0", "::") else "127.0.0.1", port, timeout=2.0).close()
                if proc.alive():
                    return proc
            except RPCPoolError:
                pass
            if not proc.alive() or time.time() > deadline:
                raise RPCPoolError("the RPC tracker did not start", proc.log_tail() or f"{host}:{port}")
            time.sleep(0.3)
    except BaseException:  # an interrupt while it starts too: never leave it running
        proc.stop()
        raise


def start_server(pool: RPCPool, host: str = "127.0.0.1", port: int = 9090, port_end: int | None = None,
                 gpu: str | None = None, log_path: Path | None = None, custom_addr: str | None = None,
                 tied: bool = False) -> Process:
    """Start an RPC server registering with the pool's tracker (it is listed
    a few seconds later: see `wait_for_servers`)."""
    check_server_address(host, pool.host)
    return _spawn(server_command(pool.address, pool.key, host, port, port_end or port + 100, custom_addr), log_path,
                  server_env(gpu), tied)


def _listening() -> bool:
    """In TVM's server worker process: whether its listen thread still runs."""
    from tvm.rpc.server import PopenRPCServerState

    st = PopenRPCServerState.current
    return st is not None and st.thread.is_alive()


def serve_watched(pool: RPCPool, host: str, port: int, port_end: int, custom_addr: str | None = None,
                  check_s: float = 5.0) -> int:
    """Run TVM's RPC server (as `python -m tvm.exec.rpc_server` does) until
    it stops listening; then exit status 1, so a supervisor restarts it."""
    from tvm import rpc as tvm_rpc

    server = tvm_rpc.Server(host, port, port_end, key=pool.key, tracker_addr=(pool.host, pool.port), custom_addr=custom_addr)
    try:
        while True:
            time.sleep(check_s)
            try:
                if not server.proc.is_alive():
                    raise RuntimeError("its process ended")
                server.proc.send(_listening)
                if not server.proc.recv():
                    raise RuntimeError("its listen thread ended")
            except Exception as e:
                log.error("rpc-server: TVM's RPC server stopped serving (%s); exiting for a restart", _reason(e))
                print(f"error: TVM's RPC server stopped serving ({_reason(e)}); restart it", file=sys.stderr, flush=True)
                return 1
    finally:
        server.terminate()


def wait_for_servers(pool: RPCPool, n: int, wait_s: float = 90.0, started: list[Process] = ()) -> list[str]:
    """Wait until `n` servers are registered under the key; their addresses.
    Fails at once when one of the servers `started` here has exited."""
    deadline = time.time() + wait_s
    while True:
        with Tracker(pool.host, pool.port) as t:
            found = t.servers(pool.key)
        dead = [p for p in started if not p.alive()]
        if dead and len(found) < n:
            raise RPCPoolError("an RPC server exited before it registered", dead[0].log_tail() or f"pid {dead[0].pid}",
                               f"{n} server(s) under key '{pool.key}' (see its log)")
        if len(found) >= n or time.time() > deadline:
            if len(found) < n:
                raise RPCPoolError(f"only {len(found)} RPC server(s) registered under key '{pool.key}'", found, f"{n}")
            return found
        time.sleep(0.3)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the OS's pick)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _signals_exit():
    """While the block runs (in the main thread): SIGTERM and SIGHUP raise
    SystemExit, so `finally` blocks run and stop what was started (Python's
    default for them ends the process without running any)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(sig, _frame):
        raise SystemExit(128 + sig)

    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h if h is not None else signal.SIG_DFL)


@contextlib.contextmanager
def loopback_pool(lanes: int, lane_cpus: int, log_dir: Path, tries: int = 3):
    """A tracker and one RPC server on 127.0.0.1 for this machine's device
    (the GPU this process would use, or the CPU), so that one device is
    tuned in `lanes` processes: each measures through the tracker, which
    hands the one server to one lane at a time, so no two candidates are
    timed at once. Tuning is bound by the host's search and builds, not the
    device (two lanes on one H200: 1.85x one lane's trials/min,
    results/h200/2026-11-30/rpc-check-x2-lanes). Yields the pool; the
    tracker and server are stopped however the block ends (an exception,
    Ctrl-C, SIGTERM or SIGHUP; and they get SIGTERM if this process is
    killed). The key is this process's own, and a port taken between
    choosing it and the tracker binding it is tried again with another."""
    log_dir.mkdir(parents=True, exist_ok=True)
    key = f"loopback-{os.getpid()}"
    procs: list[Process] = []
    with _signals_exit():
        try:
            for attempt in range(tries):
                port = free_port()
                try:
                    procs.append(start_tracker("127.0.0.1", port, log_dir / "tracker.log", tied=True))
                    break
                except (RPCPoolError, ConfigError):
                    if attempt == tries - 1:
                        raise
            pool = RPCPool("127.0.0.1", port, key, lanes=lanes, lane_cpus=lane_cpus)
            procs.append(start_server(pool, port=free_port(), log_path=log_dir / "server.log", tied=True))
            wait_for_servers(pool, 1, wait_s=pool.wait_s, started=procs[1:])
            log.info("rpc: %d tuning lanes on this machine's device through a loopback tracker at %s", lanes,
                     pool.address)
            yield pool
        finally:
            for p in reversed(procs):
                p.stop()


# --------------------------------------------------------------- tracker ---


class Tracker:
    """A connection to TVM's tracker (its JSON protocol, as tvm.rpc's
    TrackerSession speaks it), with time-outs: TVM's client retries an
    unreachable tracker for 60 s and waits for a free server forever."""

    def __init__(self, host: str, port: int, timeout: float = 10.0):
        from tvm.rpc import base

        self.host, self.port, self._base = host, port, base
        try:
            self.sock = socket.create_connection((host, port), timeout=timeout)
            self.sock.sendall(struct.pack("<i", base.RPC_TRACKER_MAGIC))
            magic = struct.unpack("<i", base.recvall(self.sock, 4))[0]
        except (OSError, RuntimeError) as e:
            raise RPCPoolError("cannot reach the RPC tracker", f"{host}:{port} ({_reason(e)})",
                               "a running tracker (make rpc-tracker HOST=... PORT=...)") from None
        if magic != base.RPC_TRACKER_MAGIC:
            self.close()
            raise RPCPoolError("not a TVM RPC tracker", f"{host}:{port}")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def summary(self) -> dict:
        b = self._base
        b.sendjson(self.sock, [b.TrackerCode.SUMMARY])
        code, value = b.recvjson(self.sock)
        if code != b.TrackerCode.SUCCESS:
            raise RPCPoolError("the RPC tracker refused a summary", value)
        return value

    def servers(self, key: str) -> list[str]:
        """Addresses (host:port) of the servers registered under `key`, free or busy."""
        return sorted(f"{h}:{p}" for h, p in (s["addr"] for s in self.summary()["server_info"] if s["key"] == "server:" + key))

    def request(self, key: str, wait_s: float, alive=None, poll_s: float = 1.0) -> tuple[str, int, str]:
        """A free server under `key`: (host, port, match key) to connect to.
        While waiting, `alive()` is called every `poll_s`; it raises to give up."""
        b = self._base
        b.sendjson(self.sock, [b.TrackerCode.REQUEST, key, "", 1])
        deadline = time.time() + wait_s
        while True:
            ready, _, _ = select.select([self.sock], [], [], poll_s)
            if ready:
                code, value = b.recvjson(self.sock)
                if code != b.TrackerCode.SUCCESS:
                    raise RPCPoolError("the RPC tracker refused a request", value)
                host, port, matchkey = value
                return host, int(port), matchkey
            if alive is not None:
                alive()
            if time.time() > deadline:
                raise RPCPoolError(f"no RPC server under key '{key}' became free within {wait_s:.0f} s",
                                   f"{self.host}:{self.port}")


def _reason(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[-1] if text else type(e).__name__)[:200]


def connect(pool: RPCPool) -> Tracker:
    return Tracker(pool.host, pool.port)


def servers_or_fail(pool: RPCPool) -> list[str]:
    with connect(pool) as t:
        found = t.servers(pool.key)
    if not found:
        raise RPCPoolError(f"no RPC server registered under key '{pool.key}'", f"tracker {pool.address}",
                           f"servers started with --key {pool.key} (make rpc-server TRACKER={pool.address} RPC_KEY={pool.key})")
    return found


# ---------------------------------------------------------------- devices ---


@dataclasses.dataclass(frozen=True)
class ServerDevice:
    address: str
    cuda: bool  # whether its cuda(0) exists
    name: str  # GPU name, or "cpu"
    arch: str  # sm_XY of its GPU, or its LLVM CPU name

    def describe(self) -> str:
        return f"{self.name} {self.arch}" if self.cuda else f"cpu {self.arch} (no CUDA GPU)"


def probe(sess, address: str) -> ServerDevice:
    """What device a session's server has."""
    dev = sess.cuda(0)
    if dev.exist:
        # A fresh session process has not initialised the CUDA driver, which
        # the device's name is read from (CUDA_ERROR_NOT_INITIALIZED, seen on
        # the H200 machines): one allocation does it.
        import numpy as np

        from ..tvm_compat import tensor

        tensor(np.zeros(1, "float32"), dev)
        return ServerDevice(address, True, dev.device_name, "sm_" + dev.compute_version.replace(".", ""))
    return ServerDevice(address, False, "cpu", sess.get_function("target.llvm_get_system_cpu")())


def mismatch(found: ServerDevice, target: TargetInfo) -> str | None:
    """Why a server cannot measure for `target`, or None."""
    if target.kind == "cuda":
        if not found.cuda:
            return "no CUDA GPU"
        if found.arch != target.arch.rstrip("a") or (target.device_name and found.name != target.device_name):
            return "another GPU"
        return None
    if found.arch != target.arch:
        return "another CPU"
    return None


def _mismatch_error(found: ServerDevice, target: TargetInfo, pool: RPCPool, why: str) -> DeviceMismatchError:
    want = f"{target.device_name or 'a GPU'} {target.arch}" if target.kind == "cuda" else f"cpu {target.arch}"
    return DeviceMismatchError(f"RPC server {found.address} under key '{pool.key}' has {why}, refused",
                               found.describe(), f"{want} (the tuning database's target)")


def _open(pool: RPCPool, tracker: Tracker, timeout_s: float):
    """A session on a free server, and that server's address."""
    from tvm import rpc

    host, port, matchkey = tracker.request(pool.key, pool.wait_s)
    try:
        return rpc.connect(host, port, matchkey, session_timeout=timeout_s), f"{host}:{port}"
    except Exception as e:  # TVM raises InternalError for a refused connection
        raise RPCPoolError(f"cannot connect to the RPC server {host}:{port}", _reason(e)) from None


def _within(work, seconds: float) -> bool:
    """Run `work()` in a daemon thread for at most `seconds`: True if it
    finished; its exception is raised here. A hung server would block a
    connect forever; TVM's RPC calls release the GIL, so the thread can be
    given up on."""
    box: dict = {}

    def run():
        try:
            work()
        except Exception as e:  # handed to the caller's thread
            box["error"] = e

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(seconds)
    if "error" in box:
        raise box["error"]
    return not th.is_alive()


def probe_pool(pool: RPCPool) -> list[ServerDevice]:
    """Every server under the key, each in a session held until all are
    probed (a server serves one session at a time, so the tracker hands out
    each once). A server that does not answer within `pool.wait_s` fails."""
    addresses = servers_or_fail(pool)
    sessions, found = [], []

    def work():
        with connect(pool) as t:
            for _ in addresses:
                sess, addr = _open(pool, t, pool.wait_s + 30)
                sessions.append(sess)
                found.append(probe(sess, addr))

    finished = _within(work, pool.wait_s + 15)
    sessions.clear()
    if not finished:
        raise RPCPoolError(f"RPC servers under key '{pool.key}' did not all answer within {pool.wait_s + 15:.0f} s",
                           f"{len(found)} of {len(addresses)} answered", "servers that are up and not busy with another run")
    return found


def check_pool(pool: RPCPool, target: TargetInfo) -> list[ServerDevice]:
    """Every server's device matches `target`, or DeviceMismatchError."""
    found = probe_pool(pool)
    for f in found:
        why = mismatch(f, target)
        if why:
            raise _mismatch_error(f, target, pool, why)
    log.info("rpc: %d server(s) under key '%s' at %s: %s", len(found), pool.key, pool.address,
             ", ".join(f"{f.address} ({f.describe()})" for f in found))
    return found


def resolve_target(text: str, pool: RPCPool) -> TargetInfo:
    """The target to tune for when measuring on the pool: `auto` is the
    pool's GPU if its servers have one (its target read from the remote
    device, as a local run reads it), else the llvm CPU target of this
    machine; `cuda` must find a GPU there; `cuda:sm_XY` must match it."""
    from .. import targets

    text = (text or "auto").strip().lower()
    if text in ("llvm", "cpu"):
        return targets.resolve(text)
    if text not in ("auto", "cuda") and not text.startswith("cuda:"):
        return targets.resolve(text)  # raises the unknown-target error
    servers_or_fail(pool)
    box: dict = {}

    def work():
        with connect(pool) as t:
            sess, addr = _open(pool, t, pool.wait_s + 30)
            found = probe(sess, addr)
            box["found"] = found
            if found.cuda:
                box["info"] = _pool_cuda_target(text, found, sess.cuda(0))

    if not _within(work, pool.wait_s + 15):
        raise RPCPoolError(f"no RPC server under key '{pool.key}' answered within {pool.wait_s + 15:.0f} s", pool.address)
    found = box["found"]
    if text == "auto" and not found.cuda:
        return targets.resolve("llvm")
    if not found.cuda:
        raise TargetError(f"TARGET={text} but the RPC server {found.address} under key '{pool.key}' has no CUDA GPU",
                          found.describe(), "servers on GPUs (CUDA_VISIBLE_DEVICES), or TARGET=llvm")
    info = box["info"]
    if text.startswith("cuda:") and mismatch(found, info):
        raise DeviceMismatchError(f"RPC server {found.address} under key '{pool.key}' has another GPU, refused",
                                  found.describe(), text)
    return info


def _pool_cuda_target(text: str, found: ServerDevice, dev) -> TargetInfo:
    """The target for a pool whose server has GPU `found` (`dev`, its remote
    `cuda(0)`): `auto`/`cuda` read from the device as a local run does;
    `cuda:sm_XY` is what `targets.resolve` builds (generic spec, the arch as
    written), with only the GPU name taken from the server, so the database
    key is a local run's on that GPU."""
    from .. import targets

    local = targets.local_cuda_matches(found.arch, found.name)
    if text.startswith("cuda:"):
        m = re.fullmatch(r"cuda:(sm_\d+a?)", text)
        if not m:
            return targets.resolve(text)  # raises the unknown-target error
        return targets.cuda_for_arch(m.group(1), found.name, local and m.group(1).rstrip("a") == found.arch)
    return targets.cuda_from_device(dev, has_device=local)


# ----------------------------------------------------------------- runner ---


# In a pool worker process: the session kept open between candidates
# (address, session), so that a batch pays for one connection, one forked
# session process and one CUDA context per server, not one per candidate.
_KEPT: dict = {}


def _before_loading(why: str) -> bool:
    """Whether `_measure` lost its session before the candidate was loaded
    (so the candidate cannot have caused it)."""
    return "(before loading the candidate)" in why or "no session kept" in why


def _close_session() -> None:
    """In a pool worker process: end the kept session (the server is then
    free for the tracker to hand out again)."""
    _KEPT.clear()


def _measure(host, port, matchkey, session_timeout, artifact_path, device_type, args_info, evaluator_config,
             target_kind, target_arch, target_device, keep=False):
    """One candidate (in a pool worker process), in a new session on
    host:port, or with `host` None in the session kept from the last call.
    With `keep`, the session stays open after a candidate that ran; any
    other outcome ends it (a failed kernel can leave the CUDA context
    unusable). Returns ("ok", run_secs), ("error", why): the server raised
    while loading or running the candidate, or timed the session out then,
    ("lost", why): the session was lost, or failed before the candidate was
    loaded (probe, device, upload, arguments: the server's problem), or
    ("mismatch", ServerDevice)."""
    from tvm import rpc
    from tvm.error import RPCError, RPCSessionTimeoutError
    from tvm.s_tir.meta_schedule.runner.utils import (
        alloc_argument_common,
        run_evaluator_common,
    )

    if host is None:
        if not _KEPT:
            return "lost", "no session kept in this worker"
        address, sess = _KEPT.pop("address"), _KEPT.pop("sess")
    else:
        _KEPT.clear()
        address = f"{host}:{port}"
        try:
            sess = rpc.connect(host, port, matchkey, session_timeout=session_timeout)
        except Exception as e:
            return "lost", f"connect to {address}: {_reason(e)}"
        try:
            found = probe(sess, address)
        except Exception as e:
            return "lost", f"session on {address} (before loading the candidate): {_reason(e)}"
        if mismatch(found, TargetInfo(target_kind, "{}", target_arch, target_device, False)):
            return "mismatch", found
    # A unique name on the server: every candidate is exported as
    # `candidate.so` (in a folder of its own), and loading a second library
    # under a path the session already loaded can hand back the first one
    # (dlopen matches loaded libraries by path): in a kept session every
    # candidate after the first would then run the first one's kernel.
    remote = f"{os.path.basename(os.path.dirname(artifact_path))}-{os.path.basename(artifact_path)}"
    status = None
    try:
        try:  # the server's part: any error here is the server's, not the candidate's
            dev = sess.device(device_type, 0)
            sess.upload(artifact_path, remote)
            fill = sess.get_function("tvm.contrib.random.random_fill_for_measure")
            args = alloc_argument_common(fill, dev, args_info, 1)
        except Exception as e:
            status = "lost"
            return status, f"session on {address} (before loading the candidate): {_reason(e)}"
        try:  # the candidate's part: loading and running it
            mod = sess.load_module(remote)
            secs = run_evaluator_common(mod, dev, evaluator_config, args)
            del mod, args
            status = "ok"
            return status, secs
        except RPCSessionTimeoutError:
            status = "error"
            return status, f"RPC session on {address} timed out after {session_timeout:g} s"
        except RPCError as e:  # raised on the server while loading or running: the candidate's fault
            status = "error"
            return status, f"on {address}: {e}"
        except Exception as e:  # connection closed or reset: the server's fault
            status = "lost"
            return status, f"session on {address}: {_reason(e)}"
    finally:
        try:
            sess.remove(remote)
            removed = True
        except Exception:  # a lost session has nothing left to clean up
            removed = False
        if keep and status == "ok" and removed:
            _KEPT.update(address=address, sess=sess)


def ignore_sigint() -> None:
    """In a worker process (building, measuring): leave SIGINT to the parent.
    Ctrl-C, and `timeout --signal=INT`, reach the whole process group; the
    tuning process winds down on the first one (finishing and saving what
    its workers build and measure), which a worker killed by it would turn
    into failed candidates. A worker starting (importing TVM, a few seconds)
    has not set this yet: an interrupt then still ends it."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _warm() -> None:
    """What `_measure` imports, loaded before a server is requested: the
    server gives up on a match key not used within ~5 s, and a fresh worker
    process takes about that long to import TVM."""
    import tvm.rpc
    import tvm.s_tir.meta_schedule.runner.utils  # noqa: F401


class _PoolLost(Exception):
    """Nothing left to measure on (every server gone, the tracker gone, or a
    server with another device)."""


class Measurer:
    """Dispatches candidates to the pool's servers: one dispatcher thread
    per server, each with a worker process of its own (killed and replaced
    when a session outlasts its time-out), each session through the tracker."""

    # Servers handed out by the tracker and skipped for one session: any
    # hung one, and the one where the candidate's session was lost up to
    # AVOID_SKIPS times (then it is taken: it may be the only one left).
    MAX_SKIPS = 8
    AVOID_SKIPS = 3

    def __init__(self, pool: RPCPool, target: TargetInfo, n_servers: int, evaluator_config, timeout_s: float,
                 stop: threading.Event | None = None):
        self.pool, self.target, self.cfg, self.timeout_s = pool, target, evaluator_config, timeout_s
        self.n = max(1, n_servers)
        self.workers: list = []
        self.dispatch = concurrent.futures.ThreadPoolExecutor(max_workers=self.n, thread_name_prefix="rpc-dispatch")
        self.local = threading.local()
        self.lock = threading.Lock()
        self.stop = stop if stop is not None else threading.Event()
        self.fatal: Exception | None = None
        self.hung: set[str] = set()
        self.stats = {"tracker": pool.address, "key": pool.key, "servers": {}, "retried": 0, "lost_sessions": 0,
                      "hung": [], "sessions": 0}
        self.queued = 0  # candidates submitted and not yet started

    # --- bookkeeping
    def _count(self, address: str, what: str) -> None:
        with self.lock:
            s = self.stats["servers"].setdefault(address, {"measured": 0, "failed": 0, "lost": 0})
            s[what] += 1

    def _fail(self, error: Exception) -> None:
        with self.lock:
            if self.fatal is None:
                self.fatal = error
        self.stop.set()

    def _tracker(self) -> Tracker:
        t = getattr(self.local, "tracker", None)
        if t is None:
            try:
                t = self.local.tracker = connect(self.pool)
            except RPCPoolError as e:
                raise _PoolLost(e) from None
        return t

    def _alive(self) -> None:
        """Raise _PoolLost when no usable server is left under the key."""
        if self.stop.is_set():
            raise _PoolLost(self.fatal)
        try:
            with self.lock:
                hung = set(self.hung)
            with connect(self.pool) as t:
                left = set(t.servers(self.pool.key)) - hung
        except RPCPoolError as e:
            raise _PoolLost(e) from None
        if not left:
            raise _PoolLost(RPCPoolError(
                f"every RPC server under key '{self.pool.key}' was lost; tuning stopped (measured records are kept)",
                f"tracker {self.pool.address}", "servers up again, then the same command resumes"))

    def _worker(self):
        from ..tvm_compat import PopenWorker

        w = getattr(self.local, "worker", None)
        if w is None:
            w = self.local.worker = PopenWorker(initializer=ignore_sigint)
            with self.lock:
                self.workers.append(w)
        if not w.is_alive():
            self.local.held = None  # a restarted worker keeps no session
            w.send(_warm)
            w.recv()
        return w

    def _request(self) -> tuple[str, int, str]:
        self._alive()
        try:
            # Wait while any usable server is registered (`_alive` raises once
            # none is): with more lanes than servers, sessions queue up.
            return self._tracker().request(self.pool.key, max(self.pool.wait_s, self.timeout_s * 4, WAIT_FREE_S),
                                           alive=self._alive)
        except BaseException as e:
            # The connection may hold an unanswered request: never reuse it.
            t = getattr(self.local, "tracker", None)
            if t is not None:
                t.close()
            self.local.tracker = None
            if isinstance(e, _PoolLost):
                raise
            if isinstance(e, RPCPoolError):  # nothing became free for too long
                raise _PoolLost(e) from None
            if isinstance(e, (OSError, ValueError)):  # the tracker went away
                raise _PoolLost(RPCPoolError("lost the RPC tracker", f"{self.pool.address} ({_reason(e)})")) from None
            raise

    def _acquire(self, avoid: set[str] = frozenset()) -> tuple[str, int, str]:
        """A free server, never a hung one, and not one in `avoid` (where
        this candidate's session was lost) while another can be had. A server
        handed out and skipped is released by not connecting: it takes a new
        match key and is listed again a few seconds later."""
        for i in range(self.MAX_SKIPS + 1):
            host, port, matchkey = self._request()
            address = f"{host}:{port}"
            with self.lock:
                hung = address in self.hung
            if hung or (address in avoid and i < self.AVOID_SKIPS):
                log.info("rpc: skipping server %s (%s)", address, "hung" if hung else "lost this candidate's session")
                continue
            return host, port, matchkey
        raise _PoolLost(RPCPoolError(f"the RPC tracker handed out only hung servers under key '{self.pool.key}'",
                                     f"tracker {self.pool.address}", "servers up again, then the same command resumes"))

    # --- sessions kept between candidates
    def _held(self) -> str | None:
        """The server whose session this thread's worker keeps, while it is
        young enough for one more candidate."""
        held = getattr(self.local, "held", None)
        if held is None:
            return None
        # The server ends a session `timeout_s` after it began, as when each
        # candidate had a session of its own: a candidate that runs too long
        # is still timed out by the server (and counted as failed), and a
        # receive time-out past that still means a hung server. So a session
        # takes new candidates only in the first half of that time (a batch's
        # share of a server takes a few seconds).
        if time.monotonic() - self.local.held_since < self.timeout_s / 2:
            return held
        self._release()
        return None

    def _release(self) -> None:
        """End this thread's kept session, if any."""
        if getattr(self.local, "held", None) is None:
            return
        self.local.held = None
        w = getattr(self.local, "worker", None)
        if w is not None:
            try:
                w.send(_close_session, timeout=HANG_GRACE_S)
                w.recv()
            except Exception:  # a dead or stuck worker: its session goes with it
                w.kill()

    # --- one candidate
    def _run_one(self, runner_input):
        from ..tvm_compat import ms

        args_info = tuple(a.as_json() for a in runner_input.args_info)
        losses, lost_on = [], set()
        attempts = max(1, min(self.pool.attempts, 2))  # retried at most once
        fresh_check = True  # a failure in a reused session is checked once in a new one
        attempt = 0
        while attempt < attempts:
            try:
                worker = self._worker()
                held = self._held()
                if held is None:
                    host, port, matchkey = self._acquire(lost_on)
            except _PoolLost as e:
                if e.args and isinstance(e.args[0], Exception):
                    self._fail(e.args[0])
                return ms.runner.RunnerResult(None, LOST + "no RPC server left")
            if held is None:
                address = f"{host}:{port}"
                self.local.held, self.local.held_since = address, time.monotonic()
                with self.lock:
                    self.stats["sessions"] += 1
                call = (host, port, matchkey)
            else:
                address, call = held, (None, None, None)
            worker.send(_measure, (
                *call, self.timeout_s, str(runner_input.artifact_path), str(runner_input.device_type),
                args_info, self.cfg, self.target.kind, self.target.arch, self.target.device_name, True,
            ), timeout=self.timeout_s + HANG_GRACE_S)
            try:
                status, value = worker.recv()
            except TimeoutError:
                status, value = "lost", f"no answer from {address} within {self.timeout_s + HANG_GRACE_S:g} s (hung)"
                with self.lock:
                    self.hung.add(address)
                    self.stats["hung"] = sorted(self.hung)
            except Exception as e:  # the worker process died (it is restarted)
                status, value = "lost", f"worker for {address}: {_reason(e)}"
            if status != "ok":
                self.local.held = None  # the worker ended the session (or died with it)
            if status == "ok":
                self._count(address, "measured")
                return ms.runner.RunnerResult([float(x) for x in value], None)
            stale = status == "error" or (status == "lost" and _before_loading(value))
            if stale and held is not None and fresh_check:
                # What an earlier kernel left in that session (or the session
                # having ended meanwhile) may be the cause: once more in a new one.
                fresh_check = False
                log.info("rpc: a candidate %s in a reused session on %s; measuring it again in a new one",
                         "failed" if status == "error" else "lost its session", address)
                continue
            if status == "error":
                self._count(address, "failed")
                return ms.runner.RunnerResult(None, value)
            if status == "mismatch":
                self._fail(_mismatch_error(value, self.target, self.pool, mismatch(value, self.target)))
                return ms.runner.RunnerResult(None, LOST + "server with another device")
            attempt += 1
            self._count(address, "lost")
            with self.lock:
                self.stats["lost_sessions"] += 1
                self.stats["retried"] += 1
            losses.append(value)
            lost_on.add(address)
            log.warning("rpc: lost a session (%s); measuring the candidate on another server", value)
        with self.lock:
            self.stats["retried"] -= 1  # the last loss was not retried
        why = "session lost twice: the candidate likely crashes the server" if len(losses) > 1 else "session lost"
        log.warning("rpc: %s; recorded as failed", why)
        return ms.runner.RunnerResult(None, f"RPC {why} ({' | '.join(losses)})")

    def _run_guarded(self, runner_input):
        from ..tvm_compat import ms

        with self.lock:
            self.queued -= 1
        try:
            return self._run_one(runner_input)
        except Exception as e:  # a bug here: stop and show it, never record it as the candidate's failure
            log.exception("rpc: runner failed")
            self._fail(e)
            return ms.runner.RunnerResult(None, LOST + "runner failed")
        finally:
            # Nothing waiting: free the server for other runs (and lanes).
            with self.lock:
                idle = self.queued == 0
            if idle or self.stop.is_set():
                self._release()

    def submit(self, runner_input) -> concurrent.futures.Future:
        with self.lock:
            self.queued += 1
        return self.dispatch.submit(self._run_guarded, runner_input)

    def add_to_database(self):
        return make_add_to_database()

    def close(self) -> None:
        self.stop.set()
        self.dispatch.shutdown(wait=True)
        for w in self.workers:
            w.kill()


def make_runner(pool: RPCPool, target: TargetInfo, n_servers: int, evaluator_config, timeout_s: float,
                stop: threading.Event | None = None):
    """A MetaSchedule runner measuring on the pool. `.measurer` holds its
    state: `stop` (set when the pool is lost), `fatal` (why), `stats`;
    `.measurer.add_to_database()` is the measure callback to record with;
    `.measurer.close()` ends it."""
    from ..tvm_compat import derived_object, ms

    measurer = Measurer(pool, target, n_servers, evaluator_config, timeout_s, stop)

    @derived_object
    class PoolFuture(ms.runner.PyRunnerFuture):
        def __init__(self, future):
            super().__init__()
            self.future = future

        def done(self):
            return self.future.done()

        def result(self):
            return self.future.result()

    @derived_object
    class PoolRunner(ms.runner.PyRunner):
        def __init__(self):
            super().__init__()
            self.measurer = measurer

        def run(self, runner_inputs):
            return [PoolFuture(measurer.submit(r)) for r in runner_inputs]

    return PoolRunner()


def make_add_to_database():
    """MetaSchedule's AddToDatabase, minus the candidates the pool could not
    measure: they were never run, and a record would mark them failed."""
    from ..tvm_compat import derived_object, ms

    @derived_object
    class AddMeasuredToDatabase(ms.measure_callback.PyMeasureCallback):
        def __init__(self):
            self.inner = ms.measure_callback.AddToDatabase()

        def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results):
            keep = [i for i, r in enumerate(runner_results) if not (r.error_msg and str(r.error_msg).startswith(LOST))]
            if len(keep) == len(runner_results):
                self.inner.apply(task_scheduler, task_id, measure_candidates, builder_results, runner_results)
            elif keep:
                self.inner.apply(task_scheduler, task_id, [measure_candidates[i] for i in keep],
                                 [builder_results[i] for i in keep], [runner_results[i] for i in keep])

    return AddMeasuredToDatabase()
