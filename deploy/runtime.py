"""Load a package and run it: `deploy.load(folder)` returns a Predictor that
checks input names, shapes and dtypes, picks the smallest batch bucket that
fits (padding the batch), and splits larger batches across buckets.

Each bucket's inputs live on the device in tensors allocated once: a run
copies the host rows straight into them (several requests' rows side by side,
without joining them on the host first) instead of allocating and freeing a
device tensor per input per run.

The package's manifest and the sha256 of every module are checked before any
native code is loaded."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import numpy as np

from . import artifacts
from .errors import ShapeError, StaleArtifactError, TargetError

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


class Predictor:
    def __init__(self, folder: str | Path, warn_unvalidated: bool = True, manifest: dict | None = None):
        """`manifest`: what `check_package(folder)` returned, when the caller
        checked the package already (each module is then hashed once)."""
        from .tvm_compat import VirtualMachine, load_module

        self.folder = Path(folder)
        self.manifest = manifest if manifest is not None else check_package(self.folder)
        self.device = check_device(self.manifest)
        self.inputs = self.manifest["inputs"]
        self.outputs = self.manifest["outputs"]
        self.buckets = sorted(int(b) for b in self.manifest["buckets"])
        self._vms = {}
        for b in self.buckets:
            lib = load_module(str(self.folder / self.manifest["buckets"][str(b)]["file"]))
            self._vms[b] = VirtualMachine(lib, self.device)
        self._staged_inputs: dict[int, list] = {}  # bucket -> its device input tensors
        self._zeros: list[np.ndarray] | None = None  # per input, host zeros: padding rows (largest bucket - 1)
        self._lock = threading.Lock()  # the staged tensors are shared: one run at a time
        self._views: dict[tuple[int, int, int, int], object] = {}  # (bucket, input, first row, rows) -> view
        # Per input: the shape of one row and its size in bytes (row views of the staged tensors).
        self._row = [(list(s["shape"]), int(np.prod(s["shape"], dtype=np.int64)) * np.dtype(s["dtype"]).itemsize)
                     for s in self.inputs]
        if warn_unvalidated and self.manifest.get("validation") is None:
            log.warning("package %s was not validated", self.folder)

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def bucket_for(self, batch: int) -> int:
        for b in self.buckets:
            if b >= batch:
                return b
        return self.buckets[-1]

    def plan(self, batch: int) -> list[tuple[int, int]]:
        """(bucket, rows) per module run for a batch: the smallest bucket that
        holds it (padded), or pieces of the largest bucket and a last one."""
        pieces, start = [], 0
        while start < batch:
            n = min(batch - start, self.max_batch)
            pieces.append((self.bucket_for(n), n))
            start += n
        return pieces

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
            a = a.detach().cpu().numpy() if hasattr(a, "detach") else np.asarray(a)
            if str(a.dtype) != spec["dtype"]:
                raise ShapeError(f"input '{spec['name']}' has the wrong dtype", str(a.dtype), spec["dtype"])
            want = tuple(spec["shape"])
            if a.ndim != len(want) + 1 or tuple(a.shape[1:]) != want:
                raise ShapeError(f"input '{spec['name']}' has the wrong shape", list(a.shape), ["batch", *want])
            if a.shape[0] < 1:
                raise ShapeError(f"input '{spec['name']}' has an empty batch", list(a.shape))
            if batch is not None and a.shape[0] != batch:
                raise ShapeError("inputs disagree on the batch size", a.shape[0], batch)
            batch = a.shape[0]
            arrays.append(np.ascontiguousarray(a))
        return arrays

    def _staged(self, bucket: int) -> list:
        """The bucket's device input tensors (allocated on first use, zeroed)."""
        from .tvm_compat import tensor

        staged = self._staged_inputs.get(bucket)
        if staged is None:
            staged = self._staged_inputs[bucket] = [
                tensor(np.zeros((bucket, *s["shape"]), s["dtype"]), self.device) for s in self.inputs]
        if self._zeros is None:
            self._zeros = [np.zeros((self.max_batch - 1, *s["shape"]), s["dtype"]) for s in self.inputs]
        return staged

    def run_bucket(self, bucket: int, arrays: list[np.ndarray]) -> list[np.ndarray]:
        """Run one bucket on arrays whose batch is exactly `bucket`."""
        # Checked here too: TVM's copyfrom into the staged tensors would silently cast another dtype.
        arrays = self.check_inputs(*arrays)
        if arrays[0].shape[0] != bucket:
            raise ShapeError(f"run_bucket({bucket}) needs {bucket} rows", arrays[0].shape[0], bucket)
        with self._lock:
            staged = self._staged(bucket)
            for dst, src in zip(staged, arrays):
                dst.copyfrom(src)
            return outputs_to_numpy(self._vms[bucket]["main"](*staged))

    def run_parts(self, parts: list[list[np.ndarray]]) -> dict[str, np.ndarray]:
        """Run several requests' inputs as one batch: each part (one request's
        arrays, in manifest order, checked as `check_inputs` checks them) is
        copied straight into its rows of the bucket's device inputs, the rows
        past the last part are zeroed, and the outputs hold the batch's rows
        in part order. A batch larger than the largest bucket runs in pieces
        (see `plan`)."""
        return self._run_checked([self.check_inputs(*p) for p in parts])

    def _run_checked(self, parts: list[list[np.ndarray]]) -> dict[str, np.ndarray]:
        from .tvm_compat import tensor_view

        def rows_of(bucket: int, i: int, t, start: int, n: int):
            # Views are kept: each one made is a TVM call, which drops the GIL (see ServeConfig.gil_switch_ms).
            key = (bucket, i, start, n)
            view = self._views.get(key)
            if view is None:
                if len(self._views) >= 4096:
                    self._views.clear()
                shape, nbytes = self._row[i]
                view = self._views[key] = tensor_view(t, [n, *shape], start * nbytes)
            return view

        rows = sum(int(p[0].shape[0]) for p in parts)
        pieces: list[list[np.ndarray]] = []
        k = at = 0  # the part being copied, and its first row not yet copied
        with self._lock:
            for bucket, n in self.plan(rows):
                staged = self._staged(bucket)
                filled = 0
                while filled < n:
                    part = parts[k]
                    take = min(n - filled, int(part[0].shape[0]) - at)
                    for i, (dst, src) in enumerate(zip(staged, part)):
                        seg = src[at : at + take]  # rows of a C-contiguous array: contiguous
                        (dst if take == bucket else rows_of(bucket, i, dst, filled, take)).copyfrom(seg)
                    filled, at = filled + take, at + take
                    if at == part[0].shape[0]:
                        k, at = k + 1, 0
                if n < bucket:  # padding: zeros, not what the last run left there
                    for i, (dst, z) in enumerate(zip(staged, self._zeros)):
                        rows_of(bucket, i, dst, n, bucket - n).copyfrom(z[: bucket - n])
                pieces.append([o[:n] for o in outputs_to_numpy(self._vms[bucket]["main"](*staged))])
        return {
            spec["name"]: pieces[0][i] if len(pieces) == 1 else np.concatenate([p[i] for p in pieces])
            for i, spec in enumerate(self.outputs)
        }

    def __call__(self, *args, **kwargs) -> dict[str, np.ndarray]:
        return self._run_checked([self.check_inputs(*args, **kwargs)])

    def random_inputs(self, batch: int, seed: int = 0) -> list[np.ndarray]:
        return random_inputs([(s["shape"], s["dtype"]) for s in self.inputs], batch, seed)

    def latency(self, bucket: int, number: int | None = None, repeat: int | None = None, seed: int = 0) -> dict:
        """Device-synchronized latency of one bucket (TVM's time evaluator,
        which synchronizes the device around each repeat). By default each
        repeat lasts ~0.1 s, so a slow CPU module does not take minutes."""
        import time

        from .tvm_compat import tensor

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
        if repeat is None:
            repeat = 10 if once < 0.05 else 3
        r = vm.time_evaluator("main", self.device, number=number, repeat=repeat)(*args)
        return {
            "median_ms": r.median * 1e3,
            "mean_ms": r.mean * 1e3,
            "min_ms": r.min * 1e3,
            "max_ms": r.max * 1e3,
            "std_ms": r.std * 1e3,
            "number": number,
            "repeat": repeat,
        }


def outputs_to_numpy(out) -> list[np.ndarray]:
    """A VM result (one tensor, or a tuple of them) as numpy arrays."""
    return [o.numpy() for o in ([out] if hasattr(out, "numpy") else list(out))]


def random_inputs(specs, batch: int | None, seed: int = 0) -> list[np.ndarray]:
    """Seeded inputs for (shape, dtype) pairs; `batch` is prepended unless None.
    Floats are standard normal, integers uniform in [0, 10)."""
    rng = np.random.default_rng(seed)
    out = []
    for shape, dtype in specs:
        shape = tuple(shape) if batch is None else (batch, *shape)
        if str(dtype).startswith("float"):
            out.append(rng.standard_normal(shape).astype(dtype))
        else:
            out.append(rng.integers(0, 10, shape).astype(dtype))
    return out


def load(folder: str | Path, warn_unvalidated: bool = True, manifest: dict | None = None) -> Predictor:
    """Load a package folder written by the build stage (`manifest`: see Predictor)."""
    return Predictor(folder, warn_unvalidated, manifest)
