"""Dynamic batching: one thread owns the Predictor, gathers queued requests into the
smallest bucket that holds them, and stages the next batch while the last one runs
(see deploy/serving/serve.py's docstring).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time

import numpy as np

from . import metrics as server_metrics

log = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class _Job:
    arrays: list[np.ndarray]
    rows: int
    future: concurrent.futures.Future
    enqueued: float


_STOP = object()


# A collect that took longer than this waited for the device (not only for
# the GIL, at most the 0.5 ms switch interval, and the outputs' copy).
COLLECT_WAITED_S = 1e-3

# While gathering, how often the batcher looks again whether company can
# still come (a request admitted by the server and not yet queued).
ARRIVING_POLL_S = 2e-4


class Batcher:
    """The one thread that runs the Predictor (see the module docstring)."""

    def __init__(self, load, max_queue_delay_s: float, metrics: server_metrics.Metrics):
        """`load()` returns the Predictor (loaded and warmed up); it runs in
        the batcher's own thread, so every TVM call is made from that thread."""
        self.predictor = None
        self.max_delay = max_queue_delay_s
        self.metrics = metrics
        self.max_rows = 0
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._carry = None  # a job taken from the queue that did not fit the last batch
        self._device_s: dict[int, float] = {}  # bucket -> estimated seconds from launch to outputs back
        self._stage_s = 0.0  # recent seconds to stage a batch
        # Requests the server has admitted and not yet submitted (their bodies
        # being read or decoded): the only company a batch can wait for. The
        # server's event-loop thread alone changes it; this thread reads it.
        self.arriving = 0
        # settle() -> threading.Event, set once the server's event loop has
        # admitted whatever had reached it (app.settle); None: no server.
        self.settle = None
        self._thread = threading.Thread(target=self._main, args=(load,), name="batcher", daemon=True)
        self._thread.start()

    def submit(self, arrays: list[np.ndarray], rows: int) -> concurrent.futures.Future:
        job = _Job(arrays, rows, concurrent.futures.Future(), time.perf_counter())
        self._queue.put(job)
        return job.future

    def close(self, timeout: float | None = None) -> None:
        """Run everything already queued, then stop the thread; wait for it
        at most `timeout` seconds (it is a daemon: one still loading or
        running dies with the process)."""
        self._queue.put(_STOP)
        self._thread.join(timeout)

    def _next(self, timeout: float | None):
        if self._carry is not None:
            job, self._carry = self._carry, None
            return job
        try:
            if timeout is None:
                return self._queue.get()
            return self._queue.get(timeout=timeout) if timeout > 0 else self._queue.get_nowait()
        except queue.Empty:
            return None

    def _main(self, load) -> None:
        predictor = load()
        if predictor is None:
            return
        self.predictor, self.max_rows = predictor, predictor.max_batch
        self._loop()

    def _loop(self) -> None:
        # One batch at a time runs on the device; the next one is gathered
        # and staged (its rows copied into host memory) meanwhile, then the
        # running one is collected and answered and the staged one launched.
        # While a batch runs, the next one waits for company only until it
        # must be staged for the running one's end (see _expected_done):
        # past that, waiting would hold up the finished batch's answers. And
        # it waits at all only while company can come (`arriving`): a lone
        # request at low load runs at once instead of waiting out the delay.
        running = None  # (jobs, batch, launched at)
        while True:
            first = self._next(None if running is None else 0)
            if first is None:  # nothing more has arrived while the batch ran: answer it
                self._finish(*running)
                running = None
                continue
            if first is _STOP:
                if running is not None:
                    self._finish(*running)
                return
            # A job whose request timed out while queued was cancelled: skip it.
            if not first.future.set_running_or_notify_cancel():
                continue
            jobs, rows = [first], first.rows
            deadline = first.enqueued + self.max_delay
            if running is not None:
                deadline = min(deadline, self._expected_done(*running) - self._stage_s)
            settled = False
            while rows < self.max_rows:
                # Wait for company only while some can come: with nothing
                # queued, no request on its way in, and none left for the
                # server's event loop to admit, the batch goes now.
                left = deadline - time.perf_counter()
                job = self._next(0)
                if job is None:
                    if left <= 0:
                        break
                    if self.arriving > 0:  # on its way: look again shortly
                        job = self._next(min(left, ARRIVING_POLL_S))
                        if job is None:
                            continue
                    elif settled or self.settle is None:
                        break
                    else:
                        settled = True
                        self.settle().wait(left)
                        continue
                if job is _STOP or rows + job.rows > self.max_rows:
                    self._carry = job
                    break
                if job.future.set_running_or_notify_cancel():
                    jobs.append(job)
                    rows += job.rows
            batch = self._stage(jobs)
            if running is not None:
                self._finish(*running)
                running = None
            if batch is not None:
                running = self._launch(jobs, batch)

    def _expected_done(self, jobs: list[_Job], batch, launched: float) -> float:
        """When the running batch should be done: now, if its launch ran it
        to the end (a CPU device; a batch split over the largest bucket),
        else its launch time plus its bucket's estimated device time."""
        if batch.pieces is not None or getattr(self.predictor, "launch_waits", False):
            return 0.0
        return launched + self._device_s.get(batch.bucket, 0.0)

    def _stage(self, jobs: list[_Job]):
        m = self.metrics
        start = time.perf_counter()
        queued = m.child(m.queue)
        for j in jobs:
            queued.observe(start - j.enqueued)
        try:
            # Each request's rows go to their place in the bucket's host
            # buffer (padded to the bucket, or a request split over the largest).
            batch = self.predictor.stage([j.arrays for j in jobs])
        except BaseException as e:  # noqa: BLE001  every waiting request gets the error, the thread lives on
            _fail(jobs, e)
            return None
        self._stage_s = _smoothed(self._stage_s or None, time.perf_counter() - start)
        for k, e in batch.errors.items():  # a request whose input could not be read; the others run
            jobs[k].future.set_exception(e)
        if len(batch.errors) == len(jobs):
            self.predictor.release(batch)
            return None
        return batch

    def _launch(self, jobs: list[_Job], batch):
        start = time.perf_counter()
        try:
            self.predictor.launch(batch)
        except BaseException as e:  # noqa: BLE001
            _fail(jobs, e)
            return None
        return jobs, batch, start

    def _finish(self, jobs: list[_Job], batch, start: float) -> None:
        m = self.metrics
        t0 = time.perf_counter()
        try:
            out = self.predictor.collect(batch)
        except BaseException as e:  # noqa: BLE001
            _fail(jobs, e)
            return
        done = time.perf_counter()
        took, last = done - start, self._device_s.get(batch.bucket)
        if done - t0 > COLLECT_WAITED_S:  # collect waited for the device: the batch ended about now
            self._device_s[batch.bucket] = _smoothed(last, took)
        elif last is not None:  # it ended before collect: its device time was at most `took`
            self._device_s[batch.bucket] = min(last, took)
        rows = batch.rows
        m.child(m.compute).observe(done - start)
        m.child(m.batch_rows).observe(rows)
        m.child(m.batch_requests).observe(len(jobs))
        for bucket, n in self.predictor.plan(rows, batch.bucket.dims):  # one piece, or the pieces of a split request
            m.child(m.bucket_runs, str(bucket)).inc()
            m.child(m.padded_rows).inc(bucket.batch - n)
        # each request's rows, cut back to its lengths along the package's dimensions
        for j, result in zip(jobs, self.predictor.split(batch, out)):
            if not j.future.done():
                j.future.set_result(result)


def _smoothed(last: float | None, x: float) -> float:
    """A running estimate moved 30% of the way to the new sample `x`."""
    return x if last is None else 0.7 * last + 0.3 * x


def _fail(jobs: list[_Job], e: BaseException) -> None:
    for j in jobs:
        if not j.future.done():
            j.future.set_exception(e)
