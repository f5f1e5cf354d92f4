"""The tuning journal: every candidate on disk the moment it is measured.

MetaSchedule saves a batch's records when its task scheduler comes back to
that task, which in its first round is after every other task has had a
batch (minutes, for a model of 70 tasks). A run killed outright (SIGKILL,
the out-of-memory killer, a GPU machine taken back mid-command) lost every
batch measured and not yet saved: ~1,400 measured trials once on the H200.

The journal follows each candidate through the task scheduler's one thread:
the search (`search._make_deadline_search`) notes each batch as it hands it
out (trace, argument info, its task's workload); the builder (`builder`)
says which artifact is which candidate and journals at once the candidates
that did not build (MetaSchedule records them as failed, 1e10 s); the
runner journals each result as it comes back, one candidate at a time.
Each line holds a whole tuning record, so `database.pack` folds the journal
into the database the next time a run, a build or `pack-databases` opens
it, keeping once a record that MetaSchedule saved too. A line cut short by
the kill is dropped.

The file, `database_measured.jsonl` beside a database's working copy, is
git-ignored; lines are
  {"workload": [shash, mod]}                 once per task, before its records
  {"w": shash, "record": [trace, run_secs, target, args_info]}
in the form of MetaSchedule's own JSON database.
"""

from __future__ import annotations

import collections
import json
import logging
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)
MEASURED = "database_measured.jsonl"
FAILED_RUN_SECS = [1e10]  # what MetaSchedule's AddToDatabase stores for a candidate that failed
RATE_WINDOW = 64  # the measuring rate is taken over the last this many results
RATE_MIN = 8  # and only once there are this many


class Journal:
    """Appends each measured candidate's record to `folder/MEASURED`. Used
    from the tuning thread (`offer`, `built`) and from the measuring side
    (`measured`, which an RPC pool calls from its threads)."""

    def __init__(self, folder: Path):
        self.path = Path(folder) / MEASURED
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._file = open(self.path, "a", buffering=1)  # noqa: SIM115  (closed by close())
        self._written: set[str] = set()  # workloads whose line this journal has written
        self._pending: list[dict] = []  # the batch last handed out, in the builder's order
        self._by_artifact: dict[str, dict] = {}
        self.records = 0
        self.failed = False
        self._gaps = collections.deque(maxlen=RATE_WINDOW)  # seconds between results while others waited
        self._last_at = None  # when the last result came back, if candidates were waiting then
        self.on_record = None  # called after each record is written (the progress bar counts them)

    # -- the search: a batch handed out ---------------------------------
    def task(self, context) -> dict | None:
        """What the journal needs of a task, once per task: its workload
        (structural hash and module, as MetaSchedule stores them) and target;
        None when it cannot be read (the task is then not journaled)."""
        from ..tvm_compat import ms

        try:
            shash, mod = plain(ms.database.Workload(context.mod).as_json())
            return {"shash": shash, "workload": [shash, mod], "target": plain(context.target.export())}
        except Exception as e:  # a safety net must not stop the tuning it guards
            log.warning("tune: journal: a task's workload could not be read (%s); it is not journaled", e)
            return None

    def offer(self, task: dict | None, candidates) -> None:
        """Called by the search with each batch it hands out, in order."""
        self._pending = [{"task": None}] * len(candidates)  # (not journaled, still counted: `on_record`)
        if task is None:
            return
        try:
            self._pending = [
                {"task": task, "trace": canonical(plain(c.sch.trace.as_json(remove_postproc=False))),
                 "args": plain([a.as_json() for a in c.args_info])}
                for c in candidates
            ]
        except Exception as e:  # as above: this batch goes unjournaled, tuning goes on
            log.warning("tune: journal: a batch's traces could not be read (%s); it is not journaled", e)

    # -- the builder: which artifact is which candidate ------------------
    def built(self, results) -> None:
        """`results`: the builder's results for the batch last offered, in order."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        if len(pending) != len(results):  # not the batch offered: nothing to pair it with
            log.warning("tune: journal: a batch of %d built against %d offered; not journaled",
                        len(results), len(pending))
            pending = [{"task": None}] * len(results)
        for entry, r in zip(pending, results):
            if r.error_msg:
                self._write(entry, FAILED_RUN_SECS)
            else:
                self._by_artifact[str(r.artifact_path)] = entry

    # -- the runner: a result as it comes back ---------------------------
    def measured(self, artifact_path: str, result) -> None:
        """Journal `result` (a RunnerResult) of the candidate built into
        `artifact_path`. Results of candidates never run (the RPC pool was
        lost) are not journaled: a record would mark them failed."""
        from .rpc import LOST

        with self._lock:
            entry = self._by_artifact.pop(str(artifact_path), None)
            if entry is not None:
                now = time.monotonic()
                if self._last_at is not None:  # (only while results queue: idle gaps are not the rate)
                    self._gaps.append(now - self._last_at)
                self._last_at = now if self._by_artifact else None
        if entry is None:
            return
        error = result.error_msg
        if error and str(error).startswith(LOST):
            return
        secs = FAILED_RUN_SECS if error or not result.run_secs else [float(x) for x in result.run_secs]
        self._write(entry, secs)

    def measured_future(self, artifact_path: str, future) -> None:
        """`measured` for a concurrent future of a RunnerResult (the RPC
        pool's), as its done-callback: never raises into the pool."""
        if future.cancelled() or future.exception() is not None:
            with self._lock:  # (never measured: no longer waiting)
                self._by_artifact.pop(str(artifact_path), None)
            return
        try:
            self.measured(artifact_path, future.result())
        except Exception:  # a safety net must not stop the measuring it guards
            log.exception("tune: journaling a measured candidate failed")

    def backlog_seconds(self) -> float | None:
        """How long the candidates built and not yet measured would take, at
        the rate the last results came back while others waited (0 where
        none wait); None while fewer than RATE_MIN such results have come
        back. With an RPC pool the task scheduler hands out a batch of every
        task in its first round without waiting for any to be measured:
        search.py holds back new batches while this outlasts the deadline."""
        with self._lock:
            waiting, gaps = len(self._by_artifact), list(self._gaps)
        if not waiting:
            return 0.0
        if len(gaps) < RATE_MIN:
            return None
        return waiting * sum(gaps) / len(gaps)

    def _write(self, entry: dict, run_secs: list[float]) -> None:
        """The candidate's record written (where its task is journaled), and
        counted (`on_record`) either way."""
        task = entry["task"]
        with self._lock:
            try:
                if task is not None:
                    record = [entry["trace"], run_secs, task["target"], entry["args"]]
                    if task["shash"] not in self._written:
                        self._file.write(json.dumps({"workload": task["workload"]}, separators=(",", ":")) + "\n")
                        self._written.add(task["shash"])
                    self._file.write(json.dumps({"w": task["shash"], "record": record}, separators=(",", ":")) + "\n")
                    self._file.flush()
                    self.records += 1
            except (OSError, TypeError, ValueError) as e:  # a safety net must not stop the tuning it guards
                if not self.failed:
                    log.warning("tune: journal %s: %s; records are saved as MetaSchedule saves them", self.path, e)
                self.failed = True
        if self.on_record is not None:
            try:
                self.on_record()
            except Exception:  # noqa: BLE001 - as above
                log.debug("tune: journal: on_record failed", exc_info=True)

    def close(self) -> None:
        with self._lock:
            self._file.close()


def plain(x):
    """MetaSchedule's JSON form of an object (a trace's, a target's) as plain
    Python, as its JSON database writes it: integers and floats arrive as
    IntImm and FloatImm (a boolean IntImm is written as 1 or 0), booleans
    as booleans."""
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, dict) or hasattr(x, "items"):
        return {str(k): plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)) or hasattr(x, "__len__") and hasattr(x, "__getitem__"):
        return [plain(v) for v in x]
    if hasattr(x, "value"):  # IntImm, FloatImm
        v = x.value
        return int(v) if isinstance(v, bool) else v
    return str(x)


def make_runner(inner, journal: Journal):
    """A runner around `inner` (MetaSchedule's LocalRunner) that measures one
    candidate at a time and journals each result as it returns. LocalRunner
    measures a whole batch before it returns; asked one at a time, it costs
    nothing more (its worker measures them one after another anyway)."""
    from ..tvm_compat import derived_object, ms

    @derived_object
    class JournalRunner(ms.runner.PyRunner):
        def __init__(self):
            super().__init__()

        def run(self, runner_inputs):
            futures = []
            for ri in runner_inputs:
                (f,) = inner.run([ri])
                journal.measured(str(ri.artifact_path), f.result())
                futures.append(f)
            return futures

    return JournalRunner()


# ------------------------------------------------------------- folding in ---


def read(path: Path) -> tuple[dict[str, str], list[tuple[str, list]]]:
    """A journal's workloads (shash -> workload line) and records (shash,
    record), skipping a line cut short by a kill."""
    workloads: dict[str, str] = {}
    records: list[tuple[str, list]] = []
    if not Path(path).is_file():
        return workloads, records
    for ln in Path(path).read_text().splitlines():
        try:
            item = json.loads(ln)
        except json.JSONDecodeError:
            continue
        if "workload" in item:
            workloads[item["workload"][0]] = json.dumps(item["workload"], separators=(",", ":"))
        elif "record" in item:
            records.append((item["w"], item["record"]))
    return workloads, records


def canonical(x):
    """`x` with every string that holds a JSON object (a tensorized trace's
    layout maps) rewritten compactly: TVM's Python API writes them indented,
    its JSON database compactly, for the same candidate."""
    if isinstance(x, list):
        return [canonical(v) for v in x]
    if isinstance(x, dict):
        return {k: canonical(v) for k, v in x.items()}
    if isinstance(x, str) and x.startswith("{") and "\n" in x:
        try:
            return json.dumps(json.loads(x), separators=(",", ":"))
        except json.JSONDecodeError:
            return x
    return x


def _booleans_as_ints(x):
    if isinstance(x, bool):
        return int(x)
    if isinstance(x, list):
        return [_booleans_as_ints(v) for v in x]
    if isinstance(x, dict):
        return {k: _booleans_as_ints(v) for k, v in x.items()}
    return x


def identity(shash: str, record: list) -> tuple[str, str, str]:
    """A candidate's identity: its workload, trace and argument info (not its
    times, which MetaSchedule writes with other digits, nor the target's key
    order, nor how its layout maps are indented or its booleans written)."""
    trace = json.dumps(_booleans_as_ints(canonical(record[0])), sort_keys=True)
    return shash, trace, json.dumps(record[3], sort_keys=True)


def fold(workloads: list[str], records: list[str], path: Path) -> tuple[list[str], list[str], int]:
    """`workloads` and `records` (a database's lines) with the journal at
    `path` folded in: each journaled candidate the database lacks is
    appended. Returns the new lines and the number added."""
    j_workloads, j_records = read(path)
    if not j_records:
        return workloads, records, 0
    workloads, records = list(workloads), list(records)
    index: dict = {}
    for i, wl in enumerate(workloads):  # the first line of a hash, as MetaSchedule's database matches
        index.setdefault(json.loads(wl)[0], i)
    seen = set()
    for ln in records:
        wi, rec = json.loads(ln)
        seen.add(identity(json.loads(workloads[wi])[0], rec))
    added = 0
    for shash, rec in j_records:
        ident = identity(shash, rec)
        if ident in seen:
            continue
        if shash not in index:
            if shash not in j_workloads:  # its workload line was cut short: cannot be placed
                continue
            index[shash] = len(workloads)
            workloads.append(j_workloads[shash])
        seen.add(ident)
        records.append(json.dumps([index[shash], rec], separators=(",", ":")))
        added += 1
    return workloads, records, added
