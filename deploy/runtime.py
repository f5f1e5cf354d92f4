"""Load a package and run it: `deploy.load(folder)` returns a Predictor that
checks input names, shapes and dtypes, picks the smallest bucket that fits
(padding the batch, and the lengths of the dimensions the config names:
deploy.shapes), splits larger batches across buckets, and cuts outputs back
to each request's lengths.

A run goes in three steps (`stage`, `launch`, `collect`; `run_parts` and
`run_bucket` take all three): the requests' rows are copied side by side into
a host buffer of the bucket (page-locked memory on a GPU), then one copy per
input takes them to device tensors allocated once per bucket, the module
runs, and its outputs come back to host buffers, all queued on the device
without waiting; `collect` waits. The serving batcher stages the next batch
while the last one runs.

The package's manifest and the sha256 of every module are checked before any
native code is loaded.

Over ~500 lines (~740): the Predictor's stage, launch and collect steps
share its per-bucket slots, buffers and lock, and are read together; the
padding of a dimension (deploy.shapes) lives in those same steps. Its
timers (`Predictor.timer`, `latency_in_turns`) time a bucket's module as it
holds it."""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import artifacts
from .config import InputSpec
from .errors import DeployError, ShapeError, StaleArtifactError, TargetError
from .shapes import (
    Bucket,
    as_bucket,
    cut,
    dims_from_manifest,
    every_bucket,
    fit,
    input_specs,
    lengths,
    longest,
    pad_to,
    pad_value,
    parse,
)

log = logging.getLogger(__name__)
PACKAGE_STAGE = "package"


def check_package(folder: str | Path) -> dict:
    """Everything that can be checked without loading native code."""
    from .tvm_compat import versions

    folder = Path(folder)
    manifest = artifacts.read_manifest(folder, PACKAGE_STAGE, verify=True)
    have = versions()
    built = manifest.get("versions", {})
    if built.get("tvm") != have["tvm"]:
        raise StaleArtifactError("package was built with another TVM version", built.get("tvm"), have["tvm"])
    verified = manifest.get("files", {})  # read_manifest just hashed these: no second pass over the modules
    for b in manifest["buckets"].values():
        digest = verified.get(b["file"]) or artifacts.sha256_file(folder / b["file"])
        if digest != b["sha256"]:
            raise StaleArtifactError(f"module {b['file']} does not match its manifest sha256", str(folder))
    return manifest


def check_device(manifest: dict):
    """The device a package runs on, after checking the GPU architecture
    (no native code of the package is loaded)."""
    from .tvm_compat import tvm

    target = manifest["target"]
    if target["kind"] != "cuda":
        check_cpu_level(target.get("arch", ""))
        return tvm.cpu(0)
    dev = None
    try:
        dev = tvm.cuda(0)
        ok = dev.exist
    except Exception:
        ok = False
    if not ok:
        raise TargetError("package is built for CUDA but no CUDA GPU is visible", "no GPU", target["arch"])
    want = manifest["gpu"]["compute_capability"]
    if dev.compute_version != want:
        raise TargetError(
            "package was built for another GPU architecture", f"compute capability {dev.compute_version}", want
        )
    return dev


def device_memory(manifest: dict) -> int | None:
    """Bytes of device memory the package's buckets hold once loaded (each
    bucket's module its own weights, plus its planned workspace); None for
    a package built before the manifest recorded it."""
    plans = [b.get("memory") for b in manifest["buckets"].values()]
    if not plans or any(p is None for p in plans):
        return None
    return sum(p["weights_bytes"] + p["workspace_bytes"] for p in plans)


def check_fits(manifest: dict, dev) -> None:
    """A CUDA package whose buckets cannot fit the GPU's free memory is
    refused in one line, before any of it is loaded."""
    need = device_memory(manifest)
    free = dev.available_global_memory if manifest["target"]["kind"] == "cuda" else None
    if need is None or free is None or need <= free:
        return
    n = len(manifest["buckets"])
    raise TargetError("the package's buckets do not fit the GPU's free memory", f"{free / 2**20:,.0f} MiB free",
                      f"{need / 2**20:,.0f} MiB for the weights and workspace of {n} bucket(s) (fewer buckets: "
                      "BUCKETS=..., or free the GPU)")


def check_cpu_level(want: str) -> None:
    """A CPU package runs on a machine of its x86-64 level or a higher one;
    on a lower one its code would stop at the first instruction the CPU
    lacks (SIGILL), so that is refused first, in one line."""
    from .targets import cpu_level, level_rank
    from .tvm_compat import target_codegen

    if level_rank(want) is None:
        return  # an older package (keyed by the CPU model) or another architecture: nothing to compare
    cpu = target_codegen.llvm_get_system_cpu()
    have = cpu_level(cpu)
    if (level_rank(have) or 0) < level_rank(want):
        raise TargetError("package was built for a CPU level this machine lacks", f"{have} ({cpu})",
                          f"{want} or higher (rebuild here: make tune TARGET=llvm)")


@dataclass(eq=False)
class _Slot:
    """Host buffers for one batch of a bucket: its inputs (page-locked on a
    GPU, with numpy views) and, after its first run, its outputs."""

    key: tuple
    host: list
    views: list[np.ndarray]
    busy: bool = False
    out_host: list | None = None
    out_views: list[np.ndarray] | None = None


@dataclass(eq=False)
class Batch:
    """A batch from `Predictor.stage` to `Predictor.collect`."""

    bucket: Bucket
    rows: int
    slot: _Slot | None
    part_rows: list[int]  # rows of each part, in order
    errors: dict[int, BaseException]  # part index -> why it could not be read
    part_lens: list[tuple] | None = None  # each part's lengths along the package's dimensions
    pieces: list | None = None  # the parts of a batch over the largest bucket (run piece by piece)
    outs: list | None = None  # the module's output tensors, until collected
    result: dict | None = None
    locked: bool = False


def _rows(a) -> int:
    return int(a.shape[0])


# Staging copies of batches from this size on are spread over threads, in
# slices of about STAGE_SLICE_BYTES.
PARALLEL_STAGE_BYTES = 4 << 20
STAGE_SLICE_BYTES = 2 << 20


def _copy_one(copy: tuple):
    """One staging copy; (part index, error) if it failed (never raises, so
    that every copy of the batch has ended before its buffer is given back).
    A destination that is a padded region's part (not contiguous) takes an
    input read at staging through a buffer of its own."""
    k, dst, src = copy
    try:
        if isinstance(src, np.ndarray):
            np.copyto(dst, src)
        elif not dst.flags.c_contiguous:
            tmp = np.empty(dst.shape, dst.dtype)
            src.read_into(tmp)
            np.copyto(dst, tmp)
        else:
            src.read_into(dst)
    except Exception as e:  # noqa: BLE001
        return k, e.with_traceback(None)  # no frame (and its batch) kept alive
    return None


class Predictor:
    def __init__(self, folder: str | Path, warn_unvalidated: bool = True, manifest: dict | None = None):
        """`manifest`: what `check_package(folder)` returned, when the caller
        checked the package already (each module is then hashed once)."""
        from .tvm_compat import VirtualMachine, host_device, load_module

        self.folder = Path(folder)
        self.manifest = manifest if manifest is not None else check_package(self.folder)
        self.device = check_device(self.manifest)
        self.inputs = self.manifest["inputs"]
        self.outputs = self.manifest["outputs"]
        self.dims = dims_from_manifest(self.manifest.get("dims"))
        self._names = [i["name"] for i in self.inputs]
        self.buckets = sorted(parse(b) for b in self.manifest["buckets"])  # shapes.Bucket, in order
        self._batches: dict[tuple, list[int]] = {}  # the dimensions' lengths -> batch sizes built at them
        for b in self.buckets:
            self._batches.setdefault(b.dims, []).append(b.batch)
        want = {b for b in every_bucket(self.buckets, self.dims)}
        if want != set(self.buckets):
            missing = sorted(want - set(self.buckets))
            raise StaleArtifactError("package does not hold every batch at every length of its dimensions",
                                     ", ".join(b.label for b in missing[:4]) + " missing", "a package built whole")
        self._vms = {}
        for b in self.buckets:
            lib = load_module(str(self.folder / self.manifest["buckets"][b.label]["file"]))
            self._vms[b] = VirtualMachine(lib, self.device)
        self._staged_inputs: dict[Bucket, list] = {}  # bucket -> its device input tensors
        self._clean_from: dict[Bucket, int] = {}  # bucket -> first row from which its device inputs are zeros
        self._host_dev = host_device(self.device)
        self._slots: dict[Bucket, list[_Slot]] = {}  # bucket -> its host staging buffers
        self._slots_lock = threading.Lock()
        self._zeros: dict[tuple, list] = {}  # per lengths, per input: host zeros for padding rows
        self._lock = threading.Lock()  # the device inputs are shared: one launched batch at a time
        self._stage_threads = min(4, os.cpu_count() or 1)
        self._stage_pool = None  # made on the first large batch
        self._views: dict[tuple, object] = {}  # row views of staged and host tensors
        self._row_specs: dict[tuple, list] = {}  # per lengths: row_specs()
        if warn_unvalidated and self.manifest.get("validation") is None:
            log.warning("package %s was not validated", self.folder)
        if "input_ranges" not in self.manifest and not any("range" in i for i in self.inputs) \
                and any(i["dtype"].startswith(("int", "uint")) for i in self.inputs):
            log.warning("package %s predates the check of integer inputs against the tables they index: an id "
                        "past its table is read, not refused; build it again to have ids checked", self.folder)

    @property
    def launch_waits(self) -> bool:
        """Whether `launch` returns only once the module has run (a CPU
        device), so that `collect` never waits."""
        return self.manifest["target"]["kind"] != "cuda"  # as check_device chose the device

    @property
    def max_batch(self) -> int:
        return max(b.batch for b in self.buckets)

    def row_specs(self, dims: tuple = ()) -> list[tuple[list[int], int]]:
        """Per input: the shape of one row at the dimensions' lengths `dims`
        and its size in bytes (row views of the staged tensors)."""
        rows = self._row_specs.get(dims)
        if rows is None:
            specs = tuple(InputSpec(s["name"], tuple(s["shape"]), s["dtype"]) for s in self.inputs)
            rows = [(list(i.shape), int(np.prod(i.shape, dtype=np.int64)) * np.dtype(i.dtype).itemsize)
                    for i in input_specs(specs, self.dims, Bucket(dims, 1))]
            self._row_specs[dims] = rows
        return rows

    def bucket_for(self, batch: int, dims: tuple | None = None) -> Bucket:
        """The smallest bucket of batch `batch` at the lengths `dims` (a
        bucket's own lengths, see shapes.fit; None: the largest)."""
        dims = self.buckets[-1].dims if dims is None else dims
        sizes = self._batches[dims]
        return Bucket(dims, next((b for b in sizes if b >= batch), sizes[-1]))

    def plan(self, batch: int, dims: tuple | None = None) -> list[tuple[Bucket, int]]:
        """(bucket, rows) per module run for a batch at the lengths `dims`:
        the smallest bucket that holds it (padded), or pieces of the largest
        bucket and a last one."""
        pieces, start = [], 0
        dims = self.buckets[-1].dims if dims is None else dims
        top = self._batches[dims][-1]
        while start < batch:
            n = min(batch - start, top)
            pieces.append((self.bucket_for(n, dims), n))
            start += n
        return pieces

    def lengths_of(self, arrays) -> tuple:
        """A request's lengths along the package's dimensions."""
        return lengths(arrays, self._names, self.dims) if self.dims else ()

    def exact_bucket(self, arrays) -> Bucket | None:
        """The bucket whose shapes `arrays` have exactly (None: none has)."""
        b = Bucket(self.lengths_of(arrays), int(arrays[0].shape[0]))
        return b if b in self._vms else None

    def check_inputs(self, *args, **kwargs) -> list[np.ndarray]:
        """Inputs (positional in manifest order, or by name) -> arrays, checked."""
        names = [i["name"] for i in self.inputs]
        if args and kwargs:
            raise ShapeError("pass inputs either by position or by name, not both")
        if len(args) == 1 and isinstance(args[0], dict):
            kwargs, args = dict(args[0]), ()
        if args:
            if len(args) != len(names):
                raise ShapeError("wrong number of inputs", len(args), f"{len(names)} ({', '.join(names)})")
            kwargs = dict(zip(names, args))
        unknown = sorted(set(kwargs) - set(names))
        missing = [n for n in names if n not in kwargs]
        if unknown:
            raise ShapeError(f"unknown input name(s) {', '.join(unknown)}", None, ", ".join(names))
        if missing:
            raise ShapeError(f"missing input(s) {', '.join(missing)}", None, ", ".join(names))
        arrays, batch = [], None
        for spec in self.inputs:
            a = kwargs[spec["name"]]
            if hasattr(a, "detach"):
                a = a.detach().cpu().numpy()
            elif not hasattr(a, "read_into") or "range" in spec:  # an input read at staging (a shared-memory
                a = np.asarray(a)  # tensor) stays as it is, unless its values are to be checked
            if str(a.dtype) != spec["dtype"]:
                raise ShapeError(f"input '{spec['name']}' has the wrong dtype", str(a.dtype), spec["dtype"])
            want = self._accepted_shape(spec)
            if a.ndim != len(want) + 1 or any(w != h and not (isinstance(w, str) and h >= 1)
                                              for w, h in zip(want, a.shape[1:])):
                raise ShapeError(f"input '{spec['name']}' has the wrong shape", list(a.shape), ["batch", *want])
            if a.shape[0] < 1:
                raise ShapeError(f"input '{spec['name']}' has an empty batch", list(a.shape))
            if batch is not None and a.shape[0] != batch:
                raise ShapeError("inputs disagree on the batch size", a.shape[0], batch)
            batch = a.shape[0]
            if "range" in spec:
                check_range(spec, a)
            arrays.append(np.ascontiguousarray(a) if isinstance(a, np.ndarray) else a)
        if self.dims:
            fit(self.lengths_of(arrays), self.dims)  # one line when a request is longer than the largest bucket
        return arrays

    def _accepted_shape(self, spec: dict) -> list:
        """An input's row shape, with the name of the dimension at each axis
        that varies ("seq")."""
        shape = list(spec["shape"])
        for d in self.dims:
            if spec["name"] in d.inputs:
                shape[d.axis - 1] = d.name
        return shape

    def _staged(self, bucket: Bucket | int) -> list:
        """The bucket's device input tensors (allocated on first use, zeroed)."""
        from .tvm_compat import tensor

        bucket = as_bucket(bucket)
        staged = self._staged_inputs.get(bucket)
        if staged is None:
            staged = self._staged_inputs[bucket] = [
                tensor(np.zeros((bucket.batch, *shape), s["dtype"]), self.device)
                for s, (shape, _) in zip(self.inputs, self.row_specs(bucket.dims))]
            self._clean_from[bucket] = 0
        return staged

    def run_bucket(self, bucket: Bucket | int, arrays: list[np.ndarray]) -> list[np.ndarray]:
        """Run one bucket on arrays of exactly its shapes."""
        bucket = as_bucket(bucket)
        # Checked here too: TVM's copies into the staged tensors would silently cast another dtype.
        arrays = self.check_inputs(*arrays)
        have = Bucket(self.lengths_of(arrays), int(arrays[0].shape[0]))
        if have != bucket:
            raise ShapeError(f"run_bucket({bucket}) needs inputs of its shapes", have.label, bucket.label)
        out = self.collect(self.launch(self.stage([arrays])))
        return [out[o["name"]] for o in self.outputs]

    def run_parts(self, parts: list[list[np.ndarray]]) -> dict[str, np.ndarray]:
        """Run several requests' inputs as one batch: each part (one request's
        arrays, in manifest order, checked as `check_inputs` checks them) is
        copied into its rows of the bucket's host staging buffer, and the
        outputs hold the batch's rows in part order. A batch larger than the
        largest bucket runs in pieces (see `plan`). One part that cannot be
        read fails the call (the serving batcher, which calls `stage`,
        `launch` and `collect` itself, fails only that part's request)."""
        return self._run_checked([self.check_inputs(*p) for p in parts])

    # -- the three steps of a run, for callers that overlap them ------------
    #
    # stage(parts)   host only: each part's rows into a host buffer of the
    #                bucket (page-locked on a GPU); no device call, so the
    #                next batch is staged while the last one runs;
    # launch(batch)  queues, without waiting: the rows to the bucket's device
    #                inputs, zeros over rows a larger earlier batch left,
    #                the module, and its outputs back to host buffers;
    # collect(batch) waits for the device and returns the outputs (numpy,
    #                the batch's rows in part order).
    # One batch is launched at a time: launch holds the Predictor until
    # collect (or release) of that batch, from any thread.

    def stage(self, parts: list[list]) -> Batch:
        """Copy checked parts (numpy arrays, or inputs with `read_into`, e.g.
        a shared-memory tensor) into a free host buffer of the batch's
        bucket. A part that fails to read is recorded in `errors` (by its
        index; its rows are zeroed) instead of failing the others."""
        part_rows = [_rows(p[0]) for p in parts]
        rows = sum(part_rows)
        part_lens = [self.lengths_of(p) for p in parts]
        dims = fit(longest(part_lens, self.dims), self.dims) if self.dims else ()
        plan = self.plan(rows, dims)
        if len(plan) > 1:  # rows past the largest bucket: run piece by piece at launch
            return Batch(plan[-1][0], rows, None, part_rows, {}, pieces=parts, part_lens=part_lens)
        bucket = plan[0][0]
        starts = np.cumsum([0, *part_rows[:-1]]).tolist()  # each part's first row in the batch
        slot = self._take_slot(bucket)
        try:
            copies = [(k, self._region(view[at : at + n], i, part_lens[k], dims), src)  # (part, destination, source)
                      for k, (part, at, n) in enumerate(zip(parts, starts, part_rows))
                      for i, (view, src) in enumerate(zip(slot.views, part))]
            failed = self._copy_all(copies)  # every copy has ended: none still writes the buffer
            bug = next((e for _, e in failed if not isinstance(e, DeployError)), None)
            if bug is not None:
                raise bug
            errors = {}
            for k, e in failed:  # an input that could not be read: its request fails, the others run
                errors.setdefault(k, e)
            for k in errors:  # its rows: zeros, not half of its input
                for view in slot.views:
                    view[starts[k] : starts[k] + part_rows[k]] = 0
        except BaseException:
            slot.busy = False
            raise
        return Batch(bucket, rows, slot, part_rows, errors, part_lens=part_lens)

    def _region(self, rows: np.ndarray, i: int, have: tuple, want: tuple) -> np.ndarray:
        """Where a part's input i goes in its rows of the buffer: the rows
        themselves, or (a request shorter than the bucket) the part of them
        at its lengths, the rest filled with the padding value first."""
        if have == want:
            return rows
        name = self._names[i]
        index = [slice(None)] * rows.ndim
        for (_, h), (_, w), d in zip(have, want, self.dims):
            if name in d.inputs and h < w:
                rows[(slice(None),) * d.axis + (slice(h, None),)] = pad_value(d, name)
                index[d.axis] = slice(0, h)
        return rows[tuple(index)]

    def split(self, batch: Batch, out: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        """A collected batch's outputs per part: its rows, cut back to its
        lengths along the package's dimensions."""
        parts, begin = [], 0
        lens = batch.part_lens or [()] * len(batch.part_rows)
        for n, have in zip(batch.part_rows, lens):
            parts.append({k: cut(v[begin : begin + n], k, have, self.dims) for k, v in out.items()})
            begin += n
        return parts

    def _copy_all(self, copies: list[tuple]) -> list[tuple[int, Exception]]:
        """Do the staging copies; those of a large batch are spread over a few
        threads (numpy's copy and `pread` drop the GIL; one thread copied
        at ~3 GB/s on an H200 host, a 19 MB batch in ~6 ms), a large array
        in slices of rows. Returns (part index, error) of the copies that
        failed, once every copy has ended."""
        total = sum(dst.nbytes for _, dst, _ in copies)
        if total < PARALLEL_STAGE_BYTES or self._stage_threads < 2:
            return [r for r in map(_copy_one, copies) if r is not None]
        pieces = []
        for k, dst, src in copies:
            n = _rows(dst)
            if isinstance(src, np.ndarray) and dst.nbytes > STAGE_SLICE_BYTES and n > 1:
                step = max(1, int(n * STAGE_SLICE_BYTES // dst.nbytes))
                pieces += [(k, dst[i : i + step], src[i : i + step]) for i in range(0, n, step)]
            else:
                pieces.append((k, dst, src))
        with self._slots_lock:
            if self._stage_pool is None:
                import concurrent.futures

                self._stage_pool = concurrent.futures.ThreadPoolExecutor(self._stage_threads, "stage")
        return [r for r in self._stage_pool.map(_copy_one, pieces) if r is not None]

    def launch(self, batch: Batch) -> Batch:
        self._lock.acquire()
        batch.locked = True
        try:
            self._launch_locked(batch)
        except BaseException:
            self.release(batch)
            raise
        return batch

    def collect(self, batch: Batch) -> dict[str, np.ndarray]:
        try:
            return self._collect_locked(batch)
        finally:
            self.release(batch)

    def release(self, batch: Batch) -> None:
        """Give back what a batch holds (its host buffer; the Predictor, if
        launched). `collect` does this; a caller that staged or launched a
        batch and then gives up on it calls this."""
        batch.outs = None
        if batch.slot is not None:
            batch.slot.busy = False
        if batch.locked:
            batch.locked = False
            self._lock.release()

    def _launch_locked(self, batch: Batch) -> None:
        if batch.pieces is not None:
            batch.result = self._run_pieces(batch.pieces)
            return
        bucket, n, slot = batch.bucket, batch.rows, batch.slot
        dims = bucket.dims
        staged = self._staged(bucket)
        # Host tensor to device tensor: queued on the device's stream, not
        # waited for (a copy from numpy would wait for the whole device).
        for i, (dst, src) in enumerate(zip(staged, slot.host)):
            if n == bucket.batch:
                dst.copyfrom(src)
            else:
                self._rows_of(("dev", bucket), dst, i, 0, n, dims).copyfrom(self._rows_of(slot.key, src, i, 0, n, dims))
        clean = self._clean_from[bucket]
        if clean > n:  # rows a larger earlier batch left: zeros, not its data
            zeros = self._host_zeros(dims)
            for i, dst in enumerate(staged):
                self._rows_of(("dev", bucket), dst, i, n, clean - n, dims).copyfrom(
                    self._rows_of(("zeros", dims), zeros[i], i, 0, clean - n, dims))
        self._clean_from[bucket] = n
        out = self._vms[bucket]["main"](*staged)
        outs = _output_list(out)
        if slot.out_host is None:
            slot.out_host = [self._host_tensor(tuple(o.shape), str(o.dtype)) for o in outs]
            slot.out_views = [np.from_dlpack(h) for h in slot.out_host]
        for o, h in zip(outs, slot.out_host):
            o.copyto(h)  # queued after the module on the same stream
        batch.outs = outs

    def _collect_locked(self, batch: Batch) -> dict[str, np.ndarray]:
        if batch.result is not None:
            return batch.result
        if batch.outs is None:
            raise RuntimeError("collect() of a batch that was not launched (or was released)")
        self.device.sync()
        n = batch.rows
        return {spec["name"]: v[:n].copy() for spec, v in zip(self.outputs, batch.slot.out_views)}

    def _take_slot(self, bucket: Bucket) -> _Slot:
        """A host buffer of the bucket that no staged or launched batch holds
        (a second one is made when a batch is staged while one runs)."""
        with self._slots_lock:
            slots = self._slots.setdefault(bucket, [])
            for slot in slots:
                if not slot.busy:
                    slot.busy = True
                    return slot
            host = [self._host_tensor((bucket.batch, *shape), spec["dtype"])
                    for spec, (shape, _) in zip(self.inputs, self.row_specs(bucket.dims))]
            slot = _Slot(("host", bucket, len(slots)), host, [np.from_dlpack(h) for h in host], busy=True)
            slots.append(slot)
            return slot

    def _host_tensor(self, shape: tuple, dtype: str):
        from .tvm_compat import empty

        return empty(shape, dtype, self._host_dev)

    def _host_zeros(self, dims: tuple = ()) -> list:
        """Per input, host zeros of the largest bucket's rows at the lengths
        `dims` (padding rows are at most one fewer)."""
        zeros = self._zeros.get(dims)
        if zeros is None:
            zeros = self._zeros[dims] = []
            for spec, (shape, _) in zip(self.inputs, self.row_specs(dims)):
                z = self._host_tensor((self.max_batch, *shape), spec["dtype"])
                np.from_dlpack(z)[...] = 0
                zeros.append(z)
        return zeros

    def _rows_of(self, key: tuple, t, i: int, start: int, n: int, dims: tuple = ()):
        """Rows [start, start + n) of `t`, a tensor of input i's rows at the
        lengths `dims` (a view, kept: each one made is a TVM call, which
        drops the GIL)."""
        from .tvm_compat import tensor_view

        k = (*key, i, start, n)
        view = self._views.get(k)
        if view is None:
            if len(self._views) >= 4096:
                self._views.clear()
            shape, nbytes = self.row_specs(dims)[i]
            view = self._views[k] = tensor_view(t, [n, *shape], start * nbytes)
        return view

    def _run_pieces(self, parts: list[list]) -> dict[str, np.ndarray]:
        """A batch over the largest bucket, piece by piece (holding the lock)."""
        arrays = [[a if isinstance(a, np.ndarray) else np.asarray(a) for a in p] for p in parts]
        dims = ()
        if self.dims:  # every part padded to the batch's lengths, so that they join
            lens = [self.lengths_of(p) for p in arrays]
            dims = fit(longest(lens, self.dims), self.dims)
            arrays = [[pad_to(a, self._names[i], have, dims, self.dims) for i, a in enumerate(p)]
                      for p, have in zip(arrays, lens)]
        joined = [np.concatenate([p[i] for p in arrays]) for i in range(len(self.inputs))]
        pieces, start = [], 0
        for _bucket, n in self.plan(joined[0].shape[0], dims):
            batch = self.stage([[a[start : start + n] for a in joined]])
            try:
                self._launch_locked(batch)
                pieces.append(self._collect_locked(batch))
            finally:
                self.release(batch)  # its host buffer; the lock is the outer batch's
            start += n
        return {spec["name"]: np.concatenate([p[spec["name"]] for p in pieces]) for spec in self.outputs}

    def __call__(self, *args, **kwargs) -> dict[str, np.ndarray]:
        return self._run_checked([self.check_inputs(*args, **kwargs)])

    def _run_checked(self, parts: list[list]) -> dict[str, np.ndarray]:
        """The parts' outputs, rows in part order; cut back to the longest
        part's lengths along the package's dimensions (`split` cuts each
        part to its own)."""
        batch = self.stage(parts)
        if batch.errors:
            self.release(batch)
            raise next(iter(batch.errors.values()))
        out = self.collect(self.launch(batch))
        if not self.dims:
            return out
        most = longest(batch.part_lens, self.dims)
        return {k: cut(v, k, most, self.dims) for k, v in out.items()}

    def random_inputs(self, bucket: Bucket | int, seed: int = 0) -> list[np.ndarray]:
        """Seeded inputs of a bucket's shapes; a batch size alone gives that
        batch at the largest bucket's lengths."""
        if isinstance(bucket, Bucket):
            dims, batch = bucket.dims, bucket.batch
        else:
            dims, batch = self.buckets[-1].dims, int(bucket)
        return random_inputs([(shape, s["dtype"], s.get("range")) for s, (shape, _) in zip(self.inputs, self.row_specs(dims))],
                             batch, seed)

    def timer(self, bucket: Bucket | int, number: int | None = None, seed: int = 0) -> "Timer":
        """A bucket's module ready to time (warmed up, its inputs on the
        device): each call of the Timer is one repeat of TVM's time
        evaluator, which synchronizes the device around it. By default a
        repeat lasts ~0.1 s, so a slow CPU module does not take minutes."""
        import time

        from .tvm_compat import tensor

        bucket = as_bucket(bucket)
        vm = self._vms[bucket]
        args = [tensor(a, self.device) for a in self.random_inputs(bucket, seed)]
        vm["main"](*args)  # warm-up: module load, CUDA graph capture
        self.device.sync()
        t0 = time.perf_counter()
        vm["main"](*args)
        self.device.sync()
        once = time.perf_counter() - t0
        if number is None:
            number = int(min(200, max(1, 0.1 / max(once, 1e-6))))
        return Timer(vm.time_evaluator("main", self.device, number=number, repeat=1), args, number,
                     10 if once < 0.05 else 3)

    def latency(self, bucket: Bucket | int, number: int | None = None, repeat: int | None = None,
                seed: int = 0) -> dict:
        """Device-synchronized latency of one bucket: `repeat` repeats of its
        timer (10 for a module under 50 ms, else 3), their statistics."""
        return latency_in_turns([self.timer(bucket, number, seed)], repeat)[0]


@dataclass
class Timer:
    """One bucket's module, timed a repeat per call (Predictor.timer)."""

    evaluator: object
    args: list
    number: int
    repeat: int  # repeats for a latency, by default

    def __call__(self) -> float:
        """Seconds per run, the mean of `number` runs."""
        return float(self.evaluator(*self.args).mean)


def latency_in_turns(timers: list[Timer], repeat: int | None = None) -> list[dict]:
    """Each timer's latency statistics over `repeat` repeats (by default the
    most any of them asks for), the timers taking turns repeat by repeat, so
    that two modules compared see the same machine: timed one after the
    other, a 2-core VM whose speed moved by up to 2x within seconds made a
    tuned package 0.74x its untuned copy in a run's summary, equal in turns
    (results/cpu/2026-12-08/timed-in-turns/)."""
    repeat = repeat or max(t.repeat for t in timers)
    times: list[list[float]] = [[] for _ in timers]
    for _ in range(repeat):
        for t, got in zip(timers, times):
            got.append(t())
    out = []
    for t, got in zip(timers, times):
        a = np.asarray(got) * 1e3
        out.append({"median_ms": float(np.median(a)), "mean_ms": float(a.mean()), "min_ms": float(a.min()),
                    "max_ms": float(a.max()), "std_ms": float(a.std()), "number": t.number, "repeat": repeat})
    return out


def check_range(spec: dict, a: np.ndarray) -> None:
    """An integer input that indexes a table holds only the values its
    manifest entry allows (passes/onnx_indices.py: TVM's gather does not
    check them)."""
    if not a.size:
        return
    lo, hi = spec["range"]
    least, most = int(a.min()), int(a.max())
    if least < lo or most >= hi:
        raise ShapeError(f"input '{spec['name']}' has values outside the table it indexes",
                         f"values {least}..{most}", f"{lo} <= value < {hi}")


def _output_list(out) -> list:
    """A VM result (one tensor, or a tuple of them) as a list of tensors."""
    return [out] if hasattr(out, "numpy") else list(out)


def outputs_to_numpy(out) -> list[np.ndarray]:
    """A VM result (one tensor, or a tuple of them) as numpy arrays."""
    return [o.numpy() for o in _output_list(out)]


def random_inputs(specs, batch: int | None, seed: int = 0) -> list[np.ndarray]:
    """Seeded inputs for (shape, dtype) or (shape, dtype, range) specs; `batch`
    is prepended unless None. Floats are standard normal, integers uniform in
    [0, 10), or in [0, n) where an input indexes a table of n < 10 rows (its
    range, [-n, n): an input's manifest "range"; None: no table)."""
    rng = np.random.default_rng(seed)
    out = []
    for shape, dtype, *table in specs:
        shape = tuple(shape) if batch is None else (batch, *shape)
        if str(dtype).startswith(("float", "bfloat")):
            out.append(rng.standard_normal(shape).astype(dtype))
        else:
            top = 10 if not table or table[0] is None else max(1, min(10, int(table[0][1])))
            out.append(rng.integers(0, top, shape).astype(dtype))
    return out


def load(folder: str | Path, warn_unvalidated: bool = True, manifest: dict | None = None) -> Predictor:
    """Load a package folder written by the build stage (`manifest`: see Predictor)."""
    return Predictor(folder, warn_unvalidated, manifest)
