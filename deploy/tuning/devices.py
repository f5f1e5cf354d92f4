"""The pool's tracker and devices: TVM's tracker spoken to directly, each server's
device probed and checked against the target a database is for, and the CUDA
target resolved from what the servers have.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import select
import socket
import struct
import threading
import time

from ..config import RPCPool
from ..errors import DeviceMismatchError, RPCPoolError, TargetError
from ..targets import TargetInfo

log = logging.getLogger(__name__)


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
    from ..targets import cpu_level

    # the CPU's x86-64 level, as a local CPU target is named (targets.cpu_level)
    return ServerDevice(address, False, "cpu", cpu_level(sess.get_function("target.llvm_get_system_cpu")()))


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
