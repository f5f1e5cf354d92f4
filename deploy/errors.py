"""User-facing errors.

Anything derived from `DeployError` is a problem with the user's input or
environment: the CLI prints it as one line ("what | got | expected") and exits
non-zero. Every other exception is a bug and keeps its traceback.
"""

from __future__ import annotations


class DeployError(Exception):
    """Base class of every error the user can fix."""

    exit_code = 2

    def __init__(self, what: str, got: object | None = None, expected: object | None = None):
        self.what, self.got, self.expected = what, got, expected
        parts = [what]
        if got is not None:
            parts.append(f"got {got}")
        if expected is not None:
            parts.append(f"expected {expected}")
        super().__init__(" | ".join(parts))


class ConfigError(DeployError):
    """A config file, key, value or command-line override is invalid."""


class InputFileError(DeployError):
    """A file the user pointed at is missing, unreadable or corrupt."""


class UnsupportedOperatorError(DeployError):
    """The ONNX graph uses operators the TVM frontend cannot import."""


class ShapeError(DeployError):
    """Input names, shapes or dtypes do not match what the model expects."""


class StaleArtifactError(DeployError):
    """An artifact on disk is incomplete, tampered with, or made for something else."""


class DatabaseMismatchError(StaleArtifactError):
    """A tuning database was made for another model, shape, precision, target or GPU."""


class BuildError(DeployError):
    """A model TVM cannot build: a kernel no schedule source builds, or a stage
    that failed inside TVM. The message names the stage, the operator or
    kernel and TVM's own last line; the whole trace is in a log file."""


class ToleranceError(DeployError):
    """Compiled outputs differ from the reference beyond the configured tolerance."""


class KernelFaultError(DeployError):
    """A kernel faulted on the device (an illegal memory access, a launch
    failure): the message names the kernel and its arguments' shapes; its
    TIR is in the file the message names."""


class TargetError(DeployError):
    """The requested target or device is not available here."""


class RPCPoolError(DeployError):
    """The RPC tracker or the servers under the key cannot be used: unreachable,
    no server registered, or every server lost during a run."""


class DeviceMismatchError(RPCPoolError):
    """An RPC server's device is not the one the tuning database is for."""


class RequestError(DeployError):
    """An inference request the server refuses; `status` is its HTTP status.
    Raised per request by the server: it never stops the process."""

    status = 400
    outcome = "bad_request"  # the `outcome` label of the requests metric


class ModelNotFoundError(RequestError):
    status = 404
    outcome = "not_found"


class RequestTimeoutError(RequestError):
    """The request's body did not arrive in time (408) or no answer was ready
    in time (504)."""

    status = 504
    outcome = "timeout"

    def __init__(self, what: str, got: object | None = None, expected: object | None = None, status: int = 504):
        super().__init__(what, got, expected)
        self.status = status


class PayloadTooLargeError(RequestError):
    status = 413
    outcome = "too_large"


class UnsupportedEncodingError(RequestError):
    status = 415
    outcome = "bad_request"


class UnavailableError(RequestError):
    """The server cannot take the request now (model not loaded yet, or the
    concurrency limit is reached): retry later."""

    status = 503

    def __init__(self, what: str, got: object | None = None, expected: object | None = None,
                 outcome: str = "overloaded"):
        super().__init__(what, got, expected)
        self.outcome = outcome


def error_line(exc: BaseException, limit: int = 300) -> str:
    """What went wrong, in one line: a TVM error's message is its first line
    (the frames are in the traceback, IR dumps follow the message); a heading
    that ends in ':' takes the next line with it. Python exceptions other than
    TVM's are prefixed with their type."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    name = type(exc).__name__
    if not lines:
        return name
    pick = lines[0]
    if pick.endswith(":") and len(lines) > 1:
        pick = f"{pick} {lines[1]}"
    if not type(exc).__module__.startswith("tvm") and not pick.startswith(name):
        pick = f"{name}: {pick}"
    return pick[:limit]


class WorkerTrace(Exception):
    """The traceback of a failure in a worker process, as text: the cause
    attached to what the parent re-raises, so the stage's log holds it."""


def _call_catching(job):
    import traceback

    fn, args = job
    try:
        return True, fn(args)
    except Exception as e:  # noqa: BLE001 - carried to the parent, re-raised there
        cause = e.__cause__ if isinstance(e, DeployError) and e.__cause__ is not None else e
        return False, (e, "".join(traceback.format_exception(cause)))


def run_in_processes(fn, jobs: list, workers: int) -> list:
    """fn(job) for every job, in `workers` spawned processes (in this one
    when workers is 1), results in order. A failure is re-raised here as it
    was raised there, its traceback attached as the cause (a user error keeps
    its one line; pipeline.stage_guard writes the trace to the stage's log)."""
    if workers <= 1:
        return [fn(j) for j in jobs]
    import concurrent.futures
    import multiprocessing

    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        outcomes = list(pool.map(_call_catching, [(fn, j) for j in jobs]))
    for ok, value in outcomes:
        if not ok:
            exc, trace = value
            raise exc from WorkerTrace(trace)
    return [value for _, value in outcomes]
