"""Latency diff: the same inputs through every runtime a user could pick.

Every backend is a runner with one lifecycle (activate / infer / time /
deactivate), as in Polygraphy, so the comparison is one loop. One timing
method for all: inputs staged on the device once, warm-up iterations, then a
fixed number of iterations each bracketed by device synchronization, split
into rounds in which the runners take turns (`--rounds`);
p50/p90/p99/mean and throughput (samples/s at p50). Set-up (compile, engine
build, module load) is timed apart. Outputs of every runner are checked
against the fp32 reference in the same run, so a fast but wrong runner is
flagged. A runner that cannot run here is reported with its reason.
"""

from __future__ import annotations

import contextlib
import json
import logging
import platform
import time
from pathlib import Path

import numpy as np

from .. import artifacts
from ..errors import ConfigError, InputFileError

log = logging.getLogger(__name__)


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


def _free_device_memory() -> None:
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
        batch = inputs[0].shape[0]
        if batch not in self.pred.buckets:
            raise RunnerUnavailable(f"package has no bucket {batch} (buckets {self.pred.buckets})")
        self.vm = self.pred._vms[batch]
        self.args = [tensor(a, self.pred.device) for a in inputs]
        self.vm["main"](*self.args)  # CUDA graph capture, lazy loading

    def infer(self):
        from ..runtime import outputs_to_numpy

        return outputs_to_numpy(self.vm["main"](*self.args))

    def time(self, warmup, iters):
        return _timed_loop(lambda: self.vm["main"](*self.args), self.pred.device.sync, warmup, iters)


class ORTRunner(Runner):
    kind = "onnxruntime"

    def __init__(self, onnx_path: Path, input_names: list[str]):
        self.onnx_path, self.input_names = Path(onnx_path), input_names

    def activate(self, inputs):
        import onnxruntime as ort

        providers = [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in ort.get_available_providers()]
        self.name = "onnxruntime-" + ("cuda" if providers[0].startswith("CUDA") else "cpu")
        self.sess = ort.InferenceSession(str(self.onnx_path), providers=providers)
        self.feed = dict(zip(self.input_names, inputs))
        if providers[0].startswith("CUDA"):
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
        self.precision = "fp16" if half or tf32 else "fp32"

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


# ---------------------------------------------------------------- baselines ---


def parse_trtexec_times(data: list[dict]) -> list[float]:
    """`trtexec --exportTimes=FILE`: one record per inference. With
    --noDataTransfers the latency is the compute time."""
    if not isinstance(data, list) or not data or not all(isinstance(r, dict) for r in data):
        raise InputFileError("trtexec times file holds no records (a JSON list of objects)")
    key = "computeMs" if "computeMs" in data[0] else "latencyMs"
    try:
        return [float(r[key]) for r in data]
    except (KeyError, TypeError, ValueError):
        raise InputFileError("trtexec times records lack computeMs/latencyMs") from None


_SUMMARY_KEYS = {"min": "min_ms", "max": "max_ms", "mean": "mean_ms", "median": "p50_ms",
                 "percentile(90%)": "p90_ms", "percentile(95%)": "p95_ms", "percentile(99%)": "p99_ms"}


def parse_trtexec_summary(text: str) -> dict:
    """The performance summary trtexec prints: the 'GPU Compute Time' line
    (preferred, as with --noDataTransfers) or 'Latency', and 'Throughput'."""
    import re

    found: dict[str, dict] = {}
    throughput = None
    for line in text.splitlines():
        m = re.search(r"\] (Latency|GPU Compute Time): (.*)$", line) or re.search(r"^(Latency|GPU Compute Time): (.*)$", line.strip())
        if m:
            stats = {}
            for part in m.group(2).split(","):
                if "=" not in part:
                    continue
                k, v = (s.strip() for s in part.split("=", 1))
                if k in _SUMMARY_KEYS:
                    try:
                        stats[_SUMMARY_KEYS[k]] = float(v.split()[0])
                    except (ValueError, IndexError):
                        raise InputFileError("unreadable trtexec summary value", f"{k} = {v}") from None
            found[m.group(1)] = stats
        m = re.search(r"Throughput: ([0-9.]+) qps", line)
        if m:
            throughput = float(m.group(1))
    stats = found.get("GPU Compute Time") or found.get("Latency")
    if not stats or "p50_ms" not in stats:
        raise InputFileError("no trtexec performance summary (Latency / GPU Compute Time lines) found")
    stats["qps"] = throughput
    return stats


def read_baseline_meta(path: Path) -> dict:
    """The `baseline.json` of a baseline measured elsewhere."""
    path = Path(path)
    if not path.is_file():
        raise InputFileError("baseline file not found", str(path))
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise InputFileError(f"baseline {path} is not valid JSON", str(e)) from None
    if not isinstance(meta, dict):
        raise InputFileError(f"baseline {path} must be a JSON object", type(meta).__name__)
    return meta


def load_baseline(path: Path, model: str, batch: int, input_shape: list[int], precision: str) -> dict:
    """A baseline measured elsewhere: `baseline.json` naming what it measured,
    beside trtexec's --exportTimes JSON and/or its text output."""
    path = Path(path)
    meta = read_baseline_meta(path)
    want = {"model": model, "batch": batch, "input_shape": list(input_shape), "precision": precision}
    for k, v in want.items():
        if meta.get(k) != v:
            raise ConfigError(f"baseline {path} was measured for another {k}", meta.get(k), v)
    def read(name: str) -> str:
        try:
            return (path.parent / name).read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise InputFileError(f"baseline {path} names an unreadable file", f"{name}: {e}") from None

    timing = None
    if meta.get("times"):
        try:
            data = json.loads(read(meta["times"]))
        except json.JSONDecodeError as e:
            raise InputFileError(f"trtexec times file {meta['times']} is not valid JSON", str(e)) from None
        timing = percentiles(parse_trtexec_times(data), batch)
    if meta.get("summary"):
        summary = parse_trtexec_summary(read(meta["summary"]))
        if timing is None:
            timing = {**{k: v for k, v in summary.items() if k.endswith("_ms")}, "iterations": None,
                      "throughput_per_s": batch / (summary["p50_ms"] / 1e3)}
        timing["trtexec_qps"] = summary.get("qps")
    if timing is None:
        raise InputFileError(f"baseline {path} names neither a 'times' nor a 'summary' file")
    return {"name": meta.get("name", "tensorrt-baseline"), "kind": "tensorrt", "status": "ok", "source": str(path),
            "gpu": meta.get("gpu"), "timing": timing, "setup_s": None, "check": None}


# ------------------------------------------------------------------- driver ---


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment() -> dict:
    from ..tvm_compat import versions

    env = {"python": platform.python_version(), "machine": platform.machine(), "cpu": cpu_name(), **versions()}
    try:
        import torch

        env["torch"] = torch.__version__
        if torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name(0)
            env["cuda"] = torch.version.cuda
            env["cudnn"] = torch.backends.cudnn.version()
    except ImportError:
        pass
    try:
        import onnxruntime

        env["onnxruntime"] = onnxruntime.__version__
    except ImportError:
        pass
    try:
        import subprocess

        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            # One line per GPU, the same driver on each.
            env["driver"] = ", ".join(sorted(set(out.stdout.split())))
    except (OSError, subprocess.SubprocessError):
        pass
    return env


def _failure(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]


def round_sizes(iters: int, rounds: int) -> list[int]:
    """`iters` iterations over `rounds` rounds, as evenly as they go."""
    return [iters // rounds + (1 if k < iters % rounds else 0) for k in range(rounds)]


def check_rounds(rounds: int, iters: int) -> None:
    if not 1 <= rounds <= iters:
        raise ConfigError("invalid rounds (--rounds)", rounds, f"between 1 and the iterations (--iters {iters})")


def run_all(runners: list[Runner], inputs: list[np.ndarray], reference: list[np.ndarray], tolerances,
            warmup: int, iters: int, rounds: int = 1) -> list[dict]:
    """Set up, check and time every runner; `tolerances` is the config's
    Tolerances, each runner checked with the one of its own precision.

    rounds == 1: one runner after another, each set up, timed and released
    before the next (the least device memory). rounds > 1: every runner that
    set up stays loaded and the `iters` iterations are split into rounds in
    which the runners take turns, each turn after its own warm-up, so a change
    in the machine's state (clocks, another job's load) lands on every runner
    alike instead of on whichever was being timed; each runner's p50 per round
    is kept (`timing.round_p50_ms`), so such a change shows."""
    from ..validate import compare

    check_rounds(rounds, iters)
    batch = inputs[0].shape[0]
    results, loaded = [], []  # loaded: (runner, entry, samples per round)
    held: list[Runner] = []  # loaded for the rounds and not released yet

    def release(r: Runner) -> None:
        if r in held:
            held.remove(r)
        r.deactivate()
        _free_device_memory()

    def timed(entry: dict, per_round: list[list[float]]) -> None:
        entry["timing"] = percentiles([t for got in per_round for t in got], batch)
        if len(per_round) > 1:
            entry["timing"]["round_p50_ms"] = [float(np.percentile(got, 50)) for got in per_round]
        log.info("bench: %-22s p50 %.3f ms  (%s)", entry["name"], entry["timing"]["p50_ms"],
                 "outputs match" if entry["check"]["passed"] else "OUTPUTS DIFFER")

    try:
        for r in runners:
            entry = {"name": r.name, "kind": r.kind, "status": "ok", "reason": None, "setup_s": None, "timing": None, "check": None}
            keep = False
            try:
                t0 = time.perf_counter()
                r.activate(inputs)
                entry["setup_s"] = round(time.perf_counter() - t0, 2)
                entry["name"] = r.name
                outs = r.infer()
                tol = getattr(tolerances, r.precision)
                if len(outs) != len(reference):
                    entry["check"] = {"passed": False, "rel_l2": float("inf"),
                                      "error": f"{len(outs)} output(s), reference has {len(reference)}"}
                else:
                    checks = [compare(o, ref, tol) for o, ref in zip(outs, reference)]
                    entry["check"] = {"passed": all(c["passed"] for c in checks),
                                      "rel_l2": max(c.get("rel_l2", float("inf")) for c in checks)}
                if rounds == 1:
                    timed(entry, [r.time(warmup, iters)])
                else:
                    loaded.append((r, entry, []))
                    held.append(r)
                    keep = True
            except RunnerUnavailable as e:
                entry.update(status="skipped", reason=str(e))
                log.warning("bench: %s skipped: %s", r.name, e)
            except Exception as e:  # a runner that breaks is reported, the others still run
                entry.update(status="failed", reason=_failure(e))
                log.warning("bench: %s failed: %s", r.name, entry["reason"])
            finally:
                if not keep:
                    release(r)
            results.append(entry)
        if loaded:
            for k, n in enumerate(round_sizes(iters, rounds)):
                for r, entry, per_round in loaded:
                    if entry["status"] != "ok":
                        continue
                    try:
                        per_round.append(r.time(warmup, n))
                    except Exception as e:
                        entry.update(status="failed", reason=f"round {k + 1}: {_failure(e)}")
                        log.warning("bench: %s failed: %s", r.name, entry["reason"])
                        release(r)
            for r, entry, per_round in loaded:
                if entry["status"] == "ok":
                    timed(entry, per_round)
                    release(r)
    finally:  # whatever happened (an interrupt too), nothing stays loaded
        for r in list(held):
            release(r)
    return results


def markdown(report: dict) -> str:
    lines, any_rounds = [], False
    for case in report["cases"]:
        rows = case["runners"]
        ok = [r for r in rows if r["status"] == "ok"]
        trt = next((r for r in ok if r["kind"] == "tensorrt"), None)
        tvm = next((r for r in ok if r["name"] == "tvm"), None)
        lines.append(f"### batch {case['batch']}, {case['precision']}")
        lines.append("")
        by_round = any("round_p50_ms" in r["timing"] for r in ok)
        any_rounds = any_rounds or by_round
        head = "| runner | p50 ms | p90 ms | p99 ms | mean ms | samples/s | set-up s | outputs |"
        sep = "|---|---|---|---|---|---|---|---|"
        if by_round:
            head += " p50 by round (min-max ms) |"
            sep += "---|"
        if tvm:
            head += " tvm speed-up |"
            sep += "---|"
        if trt:
            head += " vs TensorRT |"
            sep += "---|"
        lines += [head, sep]
        for r in rows:
            if r["status"] != "ok":
                lines.append(f"| {r['name']} | {r['status']}: {r['reason']} |")
                continue
            t = r["timing"]
            check = "-" if r["check"] is None else ("ok" if r["check"]["passed"] else f"**differ** (rel_l2 {r['check']['rel_l2']:.1e})")
            line = (f"| {r['name']} | {t['p50_ms']:.3f} | {t.get('p90_ms', float('nan')):.3f} | {t.get('p99_ms', float('nan')):.3f} | "
                    f"{t.get('mean_ms', float('nan')):.3f} | {t['throughput_per_s']:.1f} | "
                    f"{'-' if r['setup_s'] is None else r['setup_s']} | {check} |")
            if by_round:
                rp = t.get("round_p50_ms")
                line += f" {min(rp):.3f}-{max(rp):.3f} |" if rp else " - |"
            if tvm:
                line += f" {t['p50_ms'] / tvm['timing']['p50_ms']:.2f}x |"
            if trt:
                line += f" {t['p50_ms'] / trt['timing']['p50_ms']:.2f}x |"
            lines.append(line)
        lines.append("")
    lines.append("`tvm speed-up`: this runner's p50 over TVM's (above 1: TVM is faster). "
                 "`vs TensorRT`: p50 over TensorRT's (above 1: slower than TensorRT)."
                 + (" `p50 by round`: the runners took turns in rounds; a wide range means the machine changed "
                    "under the run (clocks, other load), so read the ratios with care." if any_rounds else ""))
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = report["cases"]
    fig, axes = plt.subplots(1, len(cases), figsize=(6 * len(cases), 4), squeeze=False)
    for ax, case in zip(axes[0], cases):
        ok = [r for r in case["runners"] if r["status"] == "ok"]
        names = [r["name"] for r in ok]
        p50 = [r["timing"]["p50_ms"] for r in ok]
        p99 = [r["timing"].get("p99_ms", r["timing"]["p50_ms"]) for r in ok]
        colors = ["tab:red" if r["check"] and not r["check"]["passed"] else "tab:blue" for r in ok]
        ax.barh(names, p50, color=colors, label="p50")
        ax.errorbar(p99, names, fmt="|", color="black", label="p99")
        ax.set_xscale("log")
        ax.set_xlabel("latency (ms, log scale)")
        ax.set_title(f"{report['model']}: batch {case['batch']}, {case['precision']}")
        ax.invert_yaxis()
    axes[0][0].legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(report: dict, folder: Path) -> None:
    """Write the results folder; an existing folder is replaced only if an
    earlier bench wrote it."""
    artifacts.check_replaceable(folder, "bench")
    with artifacts.staged_dir(folder) as tmp:
        artifacts.write_json_atomic(tmp / "results.json", report)
        (tmp / "results.md").write_text(markdown(report))
        plot(report, tmp / "results.png")
        artifacts.write_manifest(tmp, "bench", {"model": report["model"]})


def case(batch: int, precision: str, runners, inputs, reference, tolerances, warmup, iters, baselines=(),
         rounds: int = 1) -> dict:
    rows = run_all(runners, inputs, reference, tolerances, warmup, iters, rounds)
    rows += list(baselines)
    return {"batch": batch, "precision": precision, "warmup": warmup, "iterations": iters, "rounds": rounds,
            "runners": rows}


ALL_RUNNERS = ("tvm", "tvm-untuned", "onnxruntime", "torch-eager", "torch-eager-tf32", "torch-eager-fp16", "torch-compile",
               "tensorrt")


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
        elif n == "onnxruntime":
            r = ORTRunner(onnx_path, input_names)
            r.name = "onnxruntime"
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
                                   compile_mode=compile_mode))
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
