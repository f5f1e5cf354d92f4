"""The processes of a pool of GPUs: TVM's RPC tracker and servers started, watched
and stopped (one server per GPU), and a loopback pool on this machine's GPU for
tuning lanes; a killed run takes them with it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from ..config import RPCPool
from ..errors import ConfigError, RPCPoolError
from . import devices as rpc_devices

log = logging.getLogger(__name__)


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
                rpc_devices.Tracker(host if host not in ("0.0.0.0", "::") else "127.0.0.1", port, timeout=2.0).close()
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
                log.error("rpc-server: TVM's RPC server stopped serving (%s); exiting for a restart", rpc_devices._reason(e))
                print(f"error: TVM's RPC server stopped serving ({rpc_devices._reason(e)}); restart it", file=sys.stderr, flush=True)
                return 1
    finally:
        server.terminate()


def wait_for_servers(pool: RPCPool, n: int, wait_s: float = 90.0, started: list[Process] = ()) -> list[str]:
    """Wait until `n` servers are registered under the key; their addresses.
    Fails at once when one of the servers `started` here has exited."""
    deadline = time.time() + wait_s
    while True:
        with rpc_devices.Tracker(pool.host, pool.port) as t:
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


class LazyLoopback:
    """A loopback pool (`loopback_pool`) started on first `start()`, so that
    a run whose databases are done starts no tracker, server and lanes (24 s
    of `make tune MODEL=resnet50` on the H200, results/h200/2026-12-04/
    resnet50-time-to-package). `close()` stops what was started."""

    def __init__(self, lanes: int, lane_cpus: int, log_dir: Path):
        self.lanes, self.lane_cpus, self.log_dir = lanes, lane_cpus, log_dir
        self._stack = contextlib.ExitStack()
        self._pool: RPCPool | None = None

    def start(self) -> RPCPool:
        if self._pool is None:
            self._pool = self._stack.enter_context(loopback_pool(self.lanes, self.lane_cpus, self.log_dir))
        return self._pool

    @property
    def started(self) -> RPCPool | None:
        return self._pool

    def close(self) -> None:
        self._stack.close()
        self._pool = None


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
