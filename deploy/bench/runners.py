"""The runners of the latency diff: every backend a user could pick, behind
one lifecycle (activate / infer / time / deactivate), as in Polygraphy, so the
comparison is one loop (`latency.run_all`). One timing method for all:
inputs staged on the device once, warm-up iterations, then a fixed number of
iterations each bracketed by device synchronization. A runner that cannot
run on this machine raises RunnerUnavailable with the reason.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import numpy as np

from .. import artifacts
from ..errors import ConfigError


class RunnerUnavailable(Exception):
    """This runner cannot run on this machine; the message says why."""


def percentiles(times_ms: list[float], batch: int) -> dict:
    a = np.asarray(times_ms, dtype=np.float64)
    p50 = float(np.percentile(a, 50))
    return {
        "p50_ms": p50,
        "p90_ms": float(np.percentile(a, 90)),
        "p99_ms": float(np.percentile(a, 99)),
        "mean_ms": float(a.mean()),
        "min_ms": float(a.min()),
        "max_ms": float(a.max()),
        "iterations": int(a.size),
        "throughput_per_s": batch / (p50 / 1e3) if p50 > 0 else None,
    }


def _timed_loop(step, sync, warmup: int, iters: int) -> list[float]:
    for _ in range(warmup):
        step()
    sync()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        step()
        sync()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def iterations_for(runner, seconds: float, most: int, least: int = 5) -> int:
    """Iterations for ~`seconds` of timing an activated runner (at least
    `least`, at most `most`), from one probe run: an untuned CPU module can
    take seconds a run, a GPU one microseconds."""
    once = min(runner.time(0, 1))
    return int(max(least, min(most, seconds / max(once / 1e3, 1e-6))))


class Runner:
    name = "runner"
    kind = ""  # "tvm", "onnxruntime", "pytorch", "tensorrt"
    precision = "fp32"  # which tolerance its outputs are checked with

    def activate(self, inputs: list[np.ndarray]) -> None:
        raise NotImplementedError

    def infer(self) -> list[np.ndarray]:
        raise NotImplementedError

    def time(self, warmup: int, iters: int) -> list[float]:
        raise NotImplementedError

    def deactivate(self) -> None:
        """Drop what activate() holds (device memory, sessions, graphs), so
        the next runner is timed on a device this one no longer occupies."""
        for name in list(vars(self)):
            if name in self._HELD:
                delattr(self, name)

    _HELD = ("pred", "vm", "args", "sess", "feed", "binding", "model", "xs", "graph", "context", "engine",
             "buffers", "stream")


def free_device_memory() -> None:
    import gc
    import sys

    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


class TVMRunner(Runner):
    kind = "tvm"

    def __init__(self, name: str, package: Path):
        self.name, self.package = name, Path(package)

    def activate(self, inputs):
        from .. import runtime
        from ..tvm_compat import tensor

        if not (self.package / artifacts.MANIFEST).is_file():
            raise RunnerUnavailable(f"no package at {self.package} (run make tune first)")
        self.pred = runtime.load(self.package, warn_unvalidated=False)
        self.precision = self.pred.manifest["precision"]
        bucket = self.pred.exact_bucket(inputs)
        if bucket is None:
            raise RunnerUnavailable(f"package has no bucket of shape {[list(a.shape) for a in inputs]} "
                                    f"(buckets {', '.join(b.label for b in self.pred.buckets)})")
        self.vm = self.pred._vms[bucket]
        self.args = [tensor(a, self.pred.device) for a in inputs]
        self.vm["main"](*self.args)  # CUDA graph capture, lazy loading

    def infer(self):
        from ..runtime import outputs_to_numpy

        return outputs_to_numpy(self.vm["main"](*self.args))

    def time(self, warmup, iters):
        return _timed_loop(lambda: self.vm["main"](*self.args), self.pred.device.sync, warmup, iters)


class ORTRunner(Runner):
    """ONNX Runtime on its CUDA execution provider where the installed build
    has one (`onnxruntime-gpu`), else on the CPU. `half`: the model converted
    to fp16 by ONNX Runtime's own converter (inputs and outputs kept fp32,
    cast inside the graph), what a user of its CUDA provider would run; only
    on the CUDA provider (fp16 on its CPU provider is not a fair baseline)."""

    kind = "onnxruntime"

    def __init__(self, onnx_path: Path, input_names: list[str], half: bool = False):
        self.onnx_path, self.input_names, self.half = Path(onnx_path), input_names, half
        self.precision = "fp16" if half else "fp32"  # its outputs checked with that tolerance

    def activate(self, inputs):
        import onnxruntime as ort

        available = ort.get_available_providers()
        if "CUDAExecutionProvider" in available and hasattr(ort, "preload_dlls"):
            # onnxruntime-gpu finds cuDNN and cuBLAS in the nvidia-* wheels PyTorch installed
            ort.preload_dlls()
        providers = [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in available]
        cuda = providers[0].startswith("CUDA")
        if self.half and not cuda:
            raise RunnerUnavailable(f"fp16 needs ONNX Runtime's CUDA execution provider (onnxruntime-gpu); "
                                    f"this onnxruntime {ort.__version__} has {', '.join(available)}")
        self.name = "onnxruntime-" + ("cuda" if cuda else "cpu") + ("-fp16" if self.half else "")
        model = str(self.onnx_path)
        if self.half:
            model = fp16_by_onnxruntime(self.onnx_path)
        self.sess = ort.InferenceSession(model, providers=providers)
        if cuda and self.sess.get_providers()[0] != "CUDAExecutionProvider":
            raise RunnerUnavailable(f"ONNX Runtime's CUDA execution provider did not load (session providers: "
                                    f"{', '.join(self.sess.get_providers())}); its log above says which library")
        self.feed = dict(zip(self.input_names, inputs))
        if cuda:
            # Keep inputs and outputs on the device, as the other runners do.
            self.binding = self.sess.io_binding()
            for name, a in self.feed.items():
                self.binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(a, "cuda", 0))
            for o in self.sess.get_outputs():
                self.binding.bind_output(o.name, "cuda")
        else:
            self.binding = None

    def infer(self):
        return self.sess.run(None, self.feed)

    def time(self, warmup, iters):
        if self.binding is not None:
            return _timed_loop(lambda: self.sess.run_with_iobinding(self.binding), self.binding.synchronize_outputs, warmup, iters)
        return _timed_loop(lambda: self.sess.run(None, self.feed), lambda: None, warmup, iters)


class TorchRunner(Runner):
    """PyTorch eager or torch.compile. fp32 is strict by default: cuDNN
    convolutions and matmuls in TF32 off while this runner runs (TVM's fp32
    is strict fp32); `tf32=True` keeps PyTorch's default on Ampere and newer,
    TF32 convolutions, whose 10-bit mantissa is checked with the fp16
    tolerance. The switches are set around every call and restored, so
    runners taking turns do not leak them into each other."""

    kind = "pytorch"

    def __init__(self, name: str, factory, half: bool = False, channels_last: bool = False, compile_mode: str | None = None,
                 tf32: bool = False):
        self.name, self.factory = name, factory
        self.half, self.channels_last, self.compile_mode, self.tf32 = half, channels_last, compile_mode, tf32
        self.precision = "fp16" if half else "tf32" if tf32 else "fp32"

    @contextlib.contextmanager
    def _switches(self):
        torch = self.torch
        was = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = self.tf32
        try:
            with torch.backends.cudnn.flags(enabled=True, benchmark=True, deterministic=False, allow_tf32=self.tf32):
                with torch.inference_mode():
                    yield
        finally:
            torch.backends.cuda.matmul.allow_tf32 = was

    def activate(self, inputs):
        import torch

        self.torch = torch
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.half and self.device.type != "cuda":
            raise RunnerUnavailable("fp16 PyTorch runs only on a CUDA device here")
        if self.tf32 and self.device.type != "cuda":
            raise RunnerUnavailable("TF32 needs a CUDA device (on the CPU it is torch-eager)")
        model = self.factory().to(self.device)
        xs = [torch.from_numpy(a).to(self.device) for a in inputs]
        if self.half:
            model = model.half()
            xs = [x.half() if x.is_floating_point() else x for x in xs]
        if self.channels_last:
            model = model.to(memory_format=torch.channels_last)
            xs = [x.contiguous(memory_format=torch.channels_last) if x.dim() == 4 else x for x in xs]
        if self.compile_mode:
            model = torch.compile(model, mode=self.compile_mode)
        self.model, self.xs = model, xs
        with self._switches():
            self.model(*self.xs)  # compile, cudnn autotune

    def _sync(self):
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()

    def infer(self):
        with self._switches():
            out = self.model(*self.xs)
        outs = out if isinstance(out, (tuple, list)) else [out]
        return [o.float().cpu().numpy() for o in outs]

    def time(self, warmup, iters):
        with self._switches():
            return _timed_loop(lambda: self.model(*self.xs), self._sync, warmup, iters)


class TensorRTRunner(Runner):
    """TensorRT's Python API on the same ONNX, timed like
    `trtexec --useCudaGraph --noDataTransfers`. TensorRT 10+ networks are
    strongly typed: an fp16 engine needs an fp16 ONNX file."""

    kind = "tensorrt"

    def __init__(self, name: str, onnx_path: Path, precision: str):
        self.name, self.onnx_path, self.precision = name, Path(onnx_path), precision

    def activate(self, inputs):
        try:
            import tensorrt as trt
        except Exception as e:  # ImportError, or a broken install
            raise RunnerUnavailable(f"tensorrt is not importable ({type(e).__name__}: {e})") from None
        import torch

        if not torch.cuda.is_available():
            raise RunnerUnavailable("TensorRT needs a CUDA device")
        logger = trt.Logger(trt.Logger.WARNING)
        builder = trt.Builder(logger)
        flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
        network = builder.create_network(flags)
        parser = trt.OnnxParser(network, logger)
        if not parser.parse(self.onnx_path.read_bytes()):
            errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            raise RunnerUnavailable(f"TensorRT could not parse {self.onnx_path}: {errors}")
        config = builder.create_builder_config()
        profile = builder.create_optimization_profile()
        for i, a in enumerate(inputs):
            name = network.get_input(i).name
            profile.set_shape(name, a.shape, a.shape, a.shape)
        config.add_optimization_profile(profile)
        blob = builder.build_serialized_network(network, config)
        if blob is None:
            raise RunnerUnavailable("TensorRT failed to build an engine")
        self.engine = trt.Runtime(logger).deserialize_cuda_engine(blob)
        self.context = self.engine.create_execution_context()
        self.torch = torch
        self.stream = torch.cuda.Stream()
        self.buffers = {}
        dtypes = {trt.float32: torch.float32, trt.float16: torch.float16, trt.int64: torch.int64, trt.int32: torch.int32}
        n_in = 0
        for i in range(self.engine.num_io_tensors):
            name = self.engine.get_tensor_name(i)
            if self.engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT:
                t = torch.from_numpy(inputs[n_in]).cuda().to(dtypes[self.engine.get_tensor_dtype(name)])
                self.context.set_input_shape(name, tuple(t.shape))
                n_in += 1
            else:
                shape = tuple(self.context.get_tensor_shape(name))
                t = torch.empty(shape, dtype=dtypes[self.engine.get_tensor_dtype(name)], device="cuda")
            self.buffers[name] = t
            self.context.set_tensor_address(name, t.data_ptr())
        self.outputs = [n for n in self.buffers if self.engine.get_tensor_mode(n) != trt.TensorIOMode.INPUT]
        with torch.cuda.stream(self.stream):
            self.context.execute_async_v3(self.stream.cuda_stream)  # warm-up before capture
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, stream=self.stream):
                self.context.execute_async_v3(self.stream.cuda_stream)
        torch.cuda.synchronize()

    def infer(self):
        self.graph.replay()
        self.torch.cuda.synchronize()
        return [self.buffers[n].float().cpu().numpy() for n in self.outputs]

    def time(self, warmup, iters):
        return _timed_loop(self.graph.replay, self.torch.cuda.synchronize, warmup, iters)


ALL_RUNNERS = ("tvm", "tvm-untuned", "onnxruntime", "onnxruntime-fp16", "torch-eager", "torch-eager-tf32", "torch-eager-fp16", "torch-compile",
               "tensorrt")


def ort_has_cuda() -> bool:
    """Whether the installed ONNX Runtime has its CUDA execution provider."""
    import onnxruntime as ort

    return "CUDAExecutionProvider" in ort.get_available_providers()


def fp16_by_onnxruntime(onnx_path: Path) -> bytes:
    """The model with fp16 weights and arithmetic, inputs and outputs fp32
    (`onnxruntime.transformers.float16`, which ships with ONNX Runtime)."""
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    return convert_float_to_float16(onnx.load(str(onnx_path)), keep_io_types=True).SerializeToString()


def fp16_onnx(factory, inputs: list[np.ndarray], opset: int, dest: Path) -> Path:
    """An fp16 ONNX of a registry model (TensorRT 10+ is strongly typed)."""
    import torch

    model = factory().half().eval()
    xs = tuple(torch.from_numpy(a).half() if a.dtype.kind == "f" else torch.from_numpy(a) for a in inputs)
    torch.onnx.export(model, xs, str(dest), opset_version=opset, dynamo=False,
                      input_names=["input"], output_names=["output"])
    return dest


def make_runners(names, *, package: Path, untuned: Path, onnx_path: Path, input_names, factory, precision: str,
                 compile_mode: str, fp16_onnx_path) -> list[Runner]:
    """`factory` builds the PyTorch model (None for an ONNX source);
    `fp16_onnx_path()` makes the fp16 ONNX TensorRT needs."""
    unknown = [n for n in names if n not in ALL_RUNNERS]
    if unknown:
        raise ConfigError(f"unknown runner(s) {', '.join(unknown)}", None, ", ".join(ALL_RUNNERS))
    out: list[Runner] = []
    for n in names:
        if n == "tvm":
            out.append(TVMRunner("tvm", package))
        elif n == "tvm-untuned":
            out.append(TVMRunner("tvm-untuned", untuned))
        elif n in ("onnxruntime", "onnxruntime-fp16"):
            r = ORTRunner(onnx_path, input_names, half=n.endswith("fp16"))
            r.name = n
            out.append(r)
        elif n.startswith("torch") and factory is None:
            out.append(_Unavailable(n, "pytorch", "no PyTorch model for an ONNX source"))
        elif n == "torch-eager":
            out.append(TorchRunner("torch-eager", factory))
        elif n == "torch-eager-tf32":
            out.append(TorchRunner("torch-eager-tf32", factory, tf32=True))
        elif n == "torch-eager-fp16":
            out.append(TorchRunner("torch-eager-fp16", factory, half=True, channels_last=True))
        elif n == "torch-compile":
            half = precision == "fp16"
            out.append(TorchRunner(f"torch-compile-{compile_mode}", factory, half=half, channels_last=half,
                                   compile_mode=compile_mode, tf32=precision == "tf32"))
        elif n == "tensorrt":
            if precision == "fp16":
                out.append(_LazyTensorRT(f"tensorrt-{precision}", fp16_onnx_path, precision))
            else:
                out.append(TensorRTRunner(f"tensorrt-{precision}", onnx_path, precision))
    return out


class _Unavailable(Runner):
    def __init__(self, name, kind, reason):
        self.name, self.kind, self.reason = name, kind, reason

    def activate(self, inputs):
        raise RunnerUnavailable(self.reason)


class _LazyTensorRT(TensorRTRunner):
    """Makes its fp16 ONNX only when TensorRT is importable."""

    def __init__(self, name, make_onnx, precision):
        super().__init__(name, Path(), precision)
        self.make_onnx = make_onnx

    def activate(self, inputs):
        try:
            import tensorrt  # noqa: F401
        except Exception as e:
            raise RunnerUnavailable(f"tensorrt is not importable ({type(e).__name__}: {e})") from None
        if self.make_onnx is None:
            raise RunnerUnavailable("an fp16 ONNX is needed for TensorRT and none can be made from an ONNX source")
        self.onnx_path = self.make_onnx(inputs)
        super().activate(inputs)
