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
the database is a local run's on that GPU). llvm: the server's CPU must be
of the target's x86-64 level (`targets.cpu_level` of its LLVM CPU name; core
count and triple are not checked: they do not change the generated code's
correctness, only its speed).

This module is the measurer (sessions, retries, lost servers); the pool's
processes are `pool`, its tracker and devices `devices`.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
import signal
import threading
import time

from ..config import RPCPool
from ..errors import RPCPoolError
from ..targets import TargetInfo
from . import devices as rpc_devices

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


# --------------------------------------------------------------- tracker ---


# ---------------------------------------------------------------- devices ---


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
            return "lost", f"connect to {address}: {rpc_devices._reason(e)}"
        try:
            found = rpc_devices.probe(sess, address)
        except Exception as e:
            return "lost", f"session on {address} (before loading the candidate): {rpc_devices._reason(e)}"
        if rpc_devices.mismatch(found, TargetInfo(target_kind, "{}", target_arch, target_device, False)):
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
            return status, f"session on {address} (before loading the candidate): {rpc_devices._reason(e)}"
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
            return status, f"session on {address}: {rpc_devices._reason(e)}"
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

    def _tracker(self) -> rpc_devices.Tracker:
        t = getattr(self.local, "tracker", None)
        if t is None:
            try:
                t = self.local.tracker = rpc_devices.connect(self.pool)
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
            with rpc_devices.connect(self.pool) as t:
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
                raise _PoolLost(RPCPoolError("lost the RPC tracker", f"{self.pool.address} ({rpc_devices._reason(e)})")) from None
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
                status, value = "lost", f"worker for {address}: {rpc_devices._reason(e)}"
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
                self._fail(rpc_devices._mismatch_error(value, self.target, self.pool, rpc_devices.mismatch(value, self.target)))
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
                stop: threading.Event | None = None, on_result=None):
    """A MetaSchedule runner measuring on the pool. `.measurer` holds its
    state: `stop` (set when the pool is lost), `fatal` (why), `stats`;
    `.measurer.add_to_database()` is the measure callback to record with;
    `.measurer.close()` ends it. `on_result(artifact_path, future)` is called
    as each candidate's measurement ends (the tuning journal)."""
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
            futures = []
            for r in runner_inputs:
                future = measurer.submit(r)
                if on_result is not None:
                    future.add_done_callback(functools.partial(on_result, str(r.artifact_path)))
                futures.append(PoolFuture(future))
            return futures

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
