"""Typed, validated configuration.

A config file (TOML, one per model under `configs/`) is parsed into frozen
dataclasses. Unknown keys are rejected with the nearest valid key suggested;
values are type-checked. Defaults are defined once, here: the per-target-kind
profiles `LLVM_DEFAULTS` and `CUDA_DEFAULTS`, and the dataclass field defaults.

(Over 500 lines: every table a config has, with each key's type, default
and checks beside it; split, a key's checks would sit away from its
definition.)
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import tomllib
import types
import typing
from pathlib import Path

from .errors import ConfigError

PRECISIONS = ("fp32", "tf32", "fp16")
ACCUMULATIONS = ("fp32", "fp16")
SIZES = ("full", "small")
EXPORTERS = ("torchscript", "dynamo")
LAYOUTS = ("NCHW", "NHWC", "NCHWc")
DTYPES = ("float32", "float16", "int64", "int32", "bool")


@dataclasses.dataclass(frozen=True)
class InputSpec:
    """One model input. `shape` is the shape of ONE sample: the batch dimension
    comes from the bucket being built."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"


@dataclasses.dataclass(frozen=True)
class DimSpec:
    """A dimension besides the batch that changes from request to request (a
    sequence length): the pipeline builds one module per value in `buckets`
    (for each batch bucket), and a request is padded to the smallest bucket
    that holds it, as TensorRT's optimization profiles allow."""

    name: str  # e.g. "seq"
    inputs: tuple[str, ...]  # the inputs that carry it, all at `axis`
    buckets: tuple[int, ...]  # the lengths built, e.g. [64, 128, 256]
    axis: int = 1  # its axis in those inputs and in `outputs` (0 is the batch)
    # Outputs that carry it at `axis`: cut back to the request's length.
    outputs: tuple[str, ...] = ()
    # The input that is 1 at real positions and 0 at padding (an attention
    # mask): padded with 0, which is what makes padding exact. Other inputs
    # are padded with `pad`.
    mask: str = ""
    pad: float = 0.0


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    # A registry name (see `models/`) or the path of an ONNX file.
    source: str
    # Name used for artifact folders and tuning databases; defaults to the
    # registry name or the ONNX file's stem.
    name: str = ""
    # A PyTorch state_dict to load instead of seeded random weights.
    checkpoint: str = ""
    seed: int = 0
    # ONNX opset for export. TVM 0.27's importer is tested at 17 to 20.
    opset: int = 17
    # Required for ONNX sources; registry models declare their own.
    inputs: tuple[InputSpec, ...] = ()
    # Registry models: "full" (the real architecture), or "small" (narrower, a
    # smaller input: what the test suite runs on the 2-core CI machine).
    size: str = "full"
    # Registry models: torch's TorchScript-based exporter ("torchscript", what
    # TVM's importer is most tested with) or the torch.export-based one
    # ("dynamo", torch's default since 2.9).
    exporter: str = "torchscript"
    # Dimensions besides the batch with buckets of their own ([[model.dims]]).
    dims: tuple[DimSpec, ...] = ()


@dataclasses.dataclass(frozen=True)
class Profile:
    """Settings that depend on the target kind (`[llvm]` / `[cuda]` tables)."""

    # fp32 | tf32 (fp32, its GEMMs on TF32 tensor cores: passes/tf32.py; CUDA
    # only) | fp16 (fp16 compute, see `accumulate`)
    precision: str
    accumulate: str  # fp32 | fp16: accumulator dtype of fp16 convolutions/matmuls
    layout: str  # NCHW | NHWC | NCHWc (CPU: channels blocked in 16s): data layout for 2-D convolutions
    buckets: tuple[int, ...]  # batch sizes, one shape-specialized module each
    cuda_graph: bool
    tune_buckets: tuple[int, ...]  # which buckets to tune (others reuse nothing)
    trials: int  # total MetaSchedule trials per tuned bucket (0 = no tuning)
    trials_per_task: int
    trials_per_iter: int
    max_tasks: int  # tune only the N heaviest tasks (0 = all)
    # Evolutionary search: candidates per generation and generations per
    # batch. Its mutation step (replay + GPU-code checks of every mutant) was
    # over half of H200 tuning time at MetaSchedule's 512 x 4.
    search_population: int
    search_generations: int
    # Split-K for NHWC convolutions with few output rows and a long
    # reduction (`passes.split_k.split_k_conv2d`): the reduction is cut in this many
    # parts computed as one batched matmul, then summed. 0 = off.
    split_k: int
    budget: str  # wall-clock tuning budget, e.g. "10m"; "" = unbounded
    builder_timeout_s: float
    runner_timeout_s: float
    # exp, sigmoid, tanh, erf and softmax as vectorizable approximations
    # (passes.fast_math; relative error <= 4e-6 in fp32): on by default on the
    # CPU, where LLVM otherwise calls libm once per element.
    fast_math: bool = False
    # 1x1 NHWC convolutions and batched-row matmuls as 2-D GEMMs with their
    # epilogues (passes.flat_gemm): gives TVM's mma.sync tensor-core rule
    # candidates it cannot draw for the 4-D forms. Changes the kernels, so a
    # database tuned without it does not cover them.
    flat_gemm: bool = False
    # GEMM rows (or columns) whose count tiles badly padded to a multiple of
    # 128 inside the kernel (passes.pad_gemm; ViT's 32 x 197 tokens): lets the
    # tuner draw tiles its perfect tiling cannot. Changes those kernels.
    pad_gemm: bool = False
    # NHWC convolutions with a kernel larger than 1x1 as implicit GEMMs with
    # their epilogues (passes.implicit_gemm): the tensor-core GEMM schedules
    # take them. Changes those kernels. None (the CUDA default): on sm_90 in
    # fp16 with the wgmma kernel, NHWC, an fp32 sum, in every bucket but one
    # whose database was tuned on direct convolutions (tuning/graph.py), with
    # the 1x1 convolutions as 2-D GEMMs (`implicit_gemms`).
    implicit_gemm: bool | None = False
    # Attention (matmul, softmax, matmul and the layout operators around them)
    # as one kernel of ours (passes.attention), fp16 on CUDA. None (the CUDA
    # default): on where it applies, in fp16 (`fuses_attention`); true with
    # another precision is refused. Changes those kernels.
    fused_attention: bool | None = False
    # fp16 GEMM kernels (those passes.mma_gemm takes, with their epilogues) as
    # our Hopper kernel written in TIRx (passes.wgmma_gemm: wgmma fed by TMA,
    # warp-specialized, persistent), tried before the schedule chain and the
    # tuning records on sm_90, and not tuned; elsewhere the chain as before.
    # None (the CUDA default): on in fp16 (`uses_wgmma_gemm`), for GEMMs
    # whose A is a tensor and implicit GEMMs, whose A the kernel gathers;
    # true with another precision is refused.
    wgmma_gemm: bool | None = False

    @property
    def fuses_attention(self) -> bool:
        """Whether the optimize stage fuses attention (fused_attention, or
        by default: in fp16)."""
        return self.precision == "fp16" if self.fused_attention is None else self.fused_attention

    @property
    def uses_wgmma_gemm(self) -> bool:
        """Whether GEMMs passes.wgmma_gemm takes get its kernel on sm_90
        (wgmma_gemm, or by default: in fp16)."""
        return self.precision == "fp16" if self.wgmma_gemm is None else self.wgmma_gemm

    def implicit_gemms(self, hopper: bool, tuned_direct: bool = False) -> bool:
        """Whether a bucket has its convolutions as implicit GEMMs
        (implicit_gemm, or by default: on sm_90 (`hopper`) where the wgmma
        kernel is in use, in NHWC, summed in fp32 (the kernel's sum), unless
        the bucket's tuning database was tuned on direct convolutions
        (`tuned_direct`: tuning/graph.py); the kernel then takes them)."""
        if self.implicit_gemm is not None:
            return self.implicit_gemm
        return (hopper and self.uses_wgmma_gemm and self.layout == "NHWC" and self.accumulate == "fp32"
                and not tuned_direct)


# Databases made before convolutions became implicit GEMMs at every batch (tuning/graph.py) were tuned on
# direct ones below this many images: implicit GEMMs had been the default from 32 images, where on an H200
# ResNet-50 b64 ran 2.512 ms so (3.760 with the tuned records of the direct graph) and b1 0.489 (0.470),
# ResNet-18 b64 1.019 (1.492): results/h200/2026-12-06/gathers-row-k/; on an H100, untuned, b32 1.905
# (3.864): results/h100/2026-12-06/grouped-and-b32/. Untuned, batch 1 gains too (H100: ResNet-50 1.259 ->
# 0.819 ms, ConvNeXt-T 0.726 -> 0.631, EfficientNet-B0 even: results/h100/2026-12-06/implicit-b1/).
CONV_GEMM_BATCH = 32


@dataclasses.dataclass(frozen=True)
class Tolerance:
    rtol: float
    # Absolute tolerance relative to the largest |reference| value of the output,
    # so one setting fits outputs of any scale (random-weight logits vary widely).
    atol: float
    # ||out - ref|| / ||ref|| over the whole output.
    max_rel_l2: float


@dataclasses.dataclass(frozen=True)
class Tolerances:
    fp32: Tolerance = Tolerance(rtol=1e-4, atol=1e-4, max_rel_l2=1e-4)
    # fp16 weights/activations against an fp32 reference.
    fp16: Tolerance = Tolerance(rtol=5e-2, atol=2e-2, max_rel_l2=2e-2)
    # fp32 with its GEMMs' inputs in TF32 (10-bit mantissa, fp32's range)
    # against an fp32 reference: no fp16 rounding of activations between
    # kernels, so half fp16's L2 bound.
    tf32: Tolerance = Tolerance(rtol=5e-2, atol=1e-2, max_rel_l2=1e-2)


LLVM_DEFAULTS = Profile(
    precision="fp32",
    accumulate="fp32",
    layout="NCHWc",
    buckets=(1, 8),
    cuda_graph=False,
    tune_buckets=(1,),
    trials=8,
    trials_per_task=4,
    trials_per_iter=4,
    max_tasks=2,
    search_population=64,
    search_generations=2,
    split_k=0,
    budget="6m",
    builder_timeout_s=120.0,
    runner_timeout_s=60.0,
    fast_math=True,
)

CUDA_DEFAULTS = Profile(
    precision="fp16",
    accumulate="fp32",
    layout="NHWC",
    buckets=(1, 8, 32),
    cuda_graph=True,
    tune_buckets=(1,),
    trials=2000,
    trials_per_task=64,
    trials_per_iter=64,
    max_tasks=0,
    search_population=256,
    search_generations=3,
    split_k=0,
    budget="8m",
    builder_timeout_s=120.0,
    runner_timeout_s=60.0,
    pad_gemm=True,
    implicit_gemm=None,
    fused_attention=None,
    wgmma_gemm=None,
)


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelConfig
    llvm: Profile = LLVM_DEFAULTS
    cuda: Profile = CUDA_DEFAULTS
    tolerance: Tolerances = Tolerances()

    def profile(self, target_kind: str) -> Profile:
        return self.cuda if target_kind == "cuda" else self.llvm


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """The serving process (`deploy serve`): one set of defaults, here."""

    host: str = "127.0.0.1"  # 0.0.0.0 to listen on every interface
    port: int = 8000  # 0 picks a free port
    model_name: str = ""  # the name clients use; "" = the package's model name
    # How long the first request of a batch waits for others to join it
    # (Triton's max_queue_delay). 0 batches only what is already queued.
    max_queue_delay_ms: float = 2.0
    # Arrival to response, per request: 504 after it (408 if the body itself is that slow).
    timeout_s: float = 30.0
    # Inference requests in flight at once (reading, queued or running); more get 503.
    max_concurrency: int = 128
    max_body_mb: float = 64.0  # request body, after decompression; more gets 413
    # Request bodies held at once (being read, queued or run), in total;
    # more gets 503. Bounds the server's memory when large requests pile up.
    max_inflight_mb: float = 1024.0
    # On SIGTERM/SIGINT: stop accepting, finish what is in flight for at most this long.
    shutdown_grace_s: float = 30.0
    warmup: bool = True  # run every bucket once before reporting ready
    # Triton's system shared-memory extension (deploy.serving.shm): clients on this
    # host pass tensors through /dev/shm instead of the body. Off by default:
    # a client that may register any shared-memory object could read or
    # overwrite another program's on this host.
    shared_memory: bool = False
    # Python's GIL switch interval in the serving process (sys.setswitchinterval;
    # Python's default is 5 ms). The batcher thread drops the GIL around every
    # TVM call (copies, the run); while the HTTP thread runs Python it gets it
    # back only when that thread is made to yield, after up to this long, so a
    # batch of several requests could wait ~5 ms per call (measured on the CPU
    # machine: see README, "Dynamic batching").
    gil_switch_ms: float = 0.5


@dataclasses.dataclass(frozen=True)
class LoadtestConfig:
    """`deploy loadtest`: closed-loop clients at each concurrency level."""

    concurrency: tuple[int, ...] = (1, 4, 16, 32, 64)
    duration_s: float = 10.0  # measured window per level
    warmup_s: float = 2.0  # traffic before each window, not measured
    request_batch: int = 1  # samples per request
    # Client processes (the clients must not be the bottleneck); 0 = one per
    # 4 cores, at most 8.
    client_procs: int = 0
    raw_seconds: float = 3.0  # timing of each bucket through Predictor.run_bucket
    serve: ServeConfig = ServeConfig(port=0)


@dataclasses.dataclass(frozen=True)
class RPCPool:
    """Where tuning candidates are measured instead of this machine: every
    server registered with TVM's RPC tracker at `host:port` under `key`
    (one server per GPU)."""

    host: str
    port: int
    key: str
    # Servers one candidate is tried on when its session is lost (the server
    # died or hung) before the candidate counts as failed: 2, i.e. retried
    # once on another server; a candidate that loses its session twice likely
    # crashes servers, and is recorded as failed rather than killing more.
    attempts: int = 2
    # How long to wait for a free server, and for every server to answer the
    # device check when a run starts.
    wait_s: float = 60.0
    # Tuning processes, each over a share of the tasks and of this machine's
    # CPUs, all measuring on the pool: 0 means one per server.
    lanes: int = 0
    # CPUs each lane uses (build workers, search and cost-model threads): 0
    # means this machine's CPUs divided among the lanes; up to all of them
    # lets lanes overlap, one searching or building while another waits.
    lane_cpus: int = 0

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


# Tuning on this machine's GPU goes in this many lanes through a loopback
# pool when nothing else is asked for (no --rpc-lanes, no tracker) and the
# machine has at least LOCAL_LANES_MIN_CPUS CPUs for them to share: tuning is
# CPU-bound, and a second lane searches and builds while the first measures
# (1.85x the trials/min on one H200, results/h200/2026-11-30/rpc-check-x2-lanes/).
# `--rpc-lanes 1` tunes in one process.
LOCAL_LANES = 2
LOCAL_LANES_MIN_CPUS = 8

# Where `deploy rpc-tracker` / `rpc-server` listen unless told otherwise: TVM's
# ports, on loopback (an RPC server runs any code it is sent; see README).
RPC_HOST = "127.0.0.1"
RPC_TRACKER_PORT = 9190
RPC_SERVER_PORT = 9090


# ----------------------------------------------------------------- parsing ---


def _suggest(key: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(key, valid, n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _coerce(value, hint, where: str):
    """Check `value` against the type `hint`, converting lists to tuples."""
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a table", type(value).__name__, "a table")
        return _build(hint, value, where)
    if origin is tuple:
        args = typing.get_args(hint)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} must be a list", repr(value), "a list")
        return tuple(_coerce(v, args[0], f"{where}[{i}]") for i, v in enumerate(value))
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"unsupported config type {hint}")
        if value is None and len(args) < len(typing.get_args(hint)):  # X | None: None is "the default" (no TOML value)
            return None
        return _coerce(value, args[0], where)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is int and isinstance(value, bool) or not isinstance(value, hint):
        raise ConfigError(f"{where} has the wrong type", repr(value), hint.__name__)
    return value


def _build(cls, table: dict, where: str, base=None):
    """Build dataclass `cls` from a TOML table; fields missing from the table
    come from `base` (an instance) or the field defaults."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in table:
        if key not in fields:
            raise ConfigError(
                f"unknown key '{where}.{key}'{_suggest(key, list(fields))}",
                None,
                "one of " + ", ".join(fields),
            )
    kwargs = {}
    for name, f in fields.items():
        if name in table:
            kwargs[name] = _coerce(table[name], hints[name], f"{where}.{name}")
        elif base is not None:
            kwargs[name] = getattr(base, name)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"missing key '{where}.{name}'")
    obj = cls(**kwargs)
    _check_values(obj, where)
    if isinstance(obj, Profile) and obj.precision == "tf32":
        # convolutions reach TF32 tensor cores only as GEMMs (passes/tf32.py)
        obj = dataclasses.replace(obj, flat_gemm=True, implicit_gemm=True)
    return obj


def _check_values(obj, where: str) -> None:
    def choice(field, allowed):
        if getattr(obj, field) not in allowed:
            raise ConfigError(f"invalid {where}.{field}", repr(getattr(obj, field)), " or ".join(allowed))

    if isinstance(obj, Profile):
        if obj.precision == "tf32" and where != "cuda":
            raise ConfigError(f"invalid {where}.precision", "'tf32'", "fp32 or fp16: TF32 is a CUDA tensor-core format")
        choice("precision", PRECISIONS if where == "cuda" else tuple(p for p in PRECISIONS if p != "tf32"))
        choice("accumulate", ACCUMULATIONS)
        choice("layout", LAYOUTS)
        if not obj.buckets or any(b < 1 for b in obj.buckets) or len(set(obj.buckets)) != len(obj.buckets):
            raise ConfigError(f"invalid {where}.buckets", list(obj.buckets), "distinct positive batch sizes")
        missing = [b for b in obj.tune_buckets if b not in obj.buckets]
        if missing:
            raise ConfigError(f"{where}.tune_buckets names buckets that are not built", missing, list(obj.buckets))
        for name in ("trials", "trials_per_task", "max_tasks", "split_k"):
            if getattr(obj, name) < 0:
                raise ConfigError(f"invalid {where}.{name}", getattr(obj, name), "a non-negative integer")
        for name in ("trials_per_iter", "search_population", "search_generations"):
            if getattr(obj, name) < 1:
                raise ConfigError(f"invalid {where}.{name}", getattr(obj, name), "a positive integer")
        if obj.layout == "NCHWc" and where.split(".")[-1] == "cuda":
            raise ConfigError(f"invalid {where}.layout", "'NCHWc'", "NHWC or NCHW on CUDA (NCHWc is the CPU's layout)")
        if obj.flat_gemm and obj.layout == "NCHWc":
            raise ConfigError(f"invalid {where}.flat_gemm", "true with layout NCHWc",
                              "layout = \"NHWC\" (1x1 convolutions are rewritten in NHWC only), or flat_gemm = false")
        if obj.precision == "tf32" and obj.layout != "NHWC":
            raise ConfigError(f"invalid {where}.precision", f"'tf32' with layout {obj.layout}",
                              "layout = \"NHWC\" (convolutions reach TF32 tensor cores as GEMMs in NHWC only), or fp32")
        if obj.implicit_gemm and obj.layout != "NHWC":
            raise ConfigError(f"invalid {where}.implicit_gemm", f"true with layout {obj.layout}",
                              "layout = \"NHWC\" (convolutions become implicit GEMMs in NHWC only), or implicit_gemm = false")
        if obj.fused_attention and not where.endswith("cuda"):
            raise ConfigError(f"invalid {where}.fused_attention", "true on the CPU",
                              "fused_attention = false (the fused attention kernel is scheduled for CUDA)")
        if obj.wgmma_gemm and not where.endswith("cuda"):
            raise ConfigError(f"invalid {where}.wgmma_gemm", "true on the CPU",
                              "wgmma_gemm = false (the wgmma kernel is Hopper's)")
        if obj.wgmma_gemm and obj.precision != "fp16":
            raise ConfigError(f"invalid {where}.wgmma_gemm", f"true with precision {obj.precision}",
                              "precision fp16 (the kernel multiplies fp16 on tensor cores), or wgmma_gemm = false")
        if obj.fused_attention and obj.precision != "fp16":
            raise ConfigError(f"invalid {where}.fused_attention", f"true with precision {obj.precision}",
                              "precision fp16 (the kernel multiplies fp16 on tensor cores), or fused_attention = false")
        if obj.pad_gemm and obj.layout == "NCHWc":
            raise ConfigError(f"invalid {where}.pad_gemm", "true with layout NCHWc",
                              "pad_gemm = false (GEMM rows are padded for the CUDA tensor-core schedules)")
        if obj.split_k > 1 and obj.layout != "NHWC":
            raise ConfigError(f"{where}.split_k needs the NHWC layout", f"layout {obj.layout}", "layout = \"NHWC\", or split_k = 0 (--split-k 0)")
        if obj.search_population < obj.trials_per_iter:
            raise ConfigError(
                f"{where}.search_population is smaller than a batch", obj.search_population,
                f">= trials_per_iter ({obj.trials_per_iter}): each batch is picked from the population",
            )
        parse_duration(obj.budget, f"{where}.budget")
    elif isinstance(obj, InputSpec):
        choice("dtype", DTYPES)
        if any(d < 1 for d in obj.shape):
            raise ConfigError(f"invalid {where}.shape", list(obj.shape), "positive dimensions (batch excluded)")
    elif isinstance(obj, ModelConfig):
        choice("size", SIZES)
        choice("exporter", EXPORTERS)
        if not 13 <= obj.opset <= 20:
            raise ConfigError(f"invalid {where}.opset", obj.opset, "13 to 20 (TVM's importer is tested at 17 to 20)")
        names = [i.name for i in obj.inputs]
        if len(set(names)) != len(names):
            raise ConfigError(f"duplicate input names in {where}.inputs", names)
        check_dims(obj.dims, obj.inputs, f"{where}.dims")
    elif isinstance(obj, DimSpec):
        if not re.fullmatch(r"[A-Za-z][A-Za-z_]*", obj.name):
            raise ConfigError(f"invalid {where}.name", repr(obj.name),
                              "letters and '_', no digits (a bucket label such as 8-seq128 ends in the length)")
        if not obj.inputs:
            raise ConfigError(f"{where}.inputs is empty", None, "the inputs that carry the dimension")
        if not obj.buckets or any(b < 1 for b in obj.buckets) or len(set(obj.buckets)) != len(obj.buckets):
            raise ConfigError(f"invalid {where}.buckets", list(obj.buckets), "distinct positive lengths")
        if obj.axis < 1:
            raise ConfigError(f"invalid {where}.axis", obj.axis, "1 or more (axis 0 is the batch)")
        if obj.mask and obj.mask not in obj.inputs:
            raise ConfigError(f"{where}.mask is not one of its inputs", obj.mask, ", ".join(obj.inputs))
    elif isinstance(obj, ServeConfig):
        if not 0 <= obj.port <= 65535:
            raise ConfigError(f"invalid {where}.port", obj.port, "0 to 65535 (0: a free port)")
        if obj.model_name and not re.fullmatch(r"[A-Za-z0-9_.-]+", obj.model_name):
            raise ConfigError(f"invalid {where}.model_name", repr(obj.model_name), "letters, digits, '_', '.' or '-'")
        for name in ("max_queue_delay_ms", "shutdown_grace_s"):
            if getattr(obj, name) < 0:
                raise ConfigError(f"invalid {where}.{name}", getattr(obj, name), "a non-negative number")
        for name in ("timeout_s", "max_body_mb", "max_inflight_mb", "max_concurrency"):
            if getattr(obj, name) <= 0:
                raise ConfigError(f"invalid {where}.{name}", getattr(obj, name), "a positive number")
        if not 0.05 <= obj.gil_switch_ms <= 100:
            raise ConfigError(f"invalid {where}.gil_switch_ms", obj.gil_switch_ms, "0.05 to 100 (Python's default: 5)")
        if obj.max_inflight_mb < obj.max_body_mb:
            raise ConfigError(f"invalid {where}.max_inflight_mb (one largest body would never fit)",
                              obj.max_inflight_mb, f">= max_body_mb ({obj.max_body_mb:g})")
    elif isinstance(obj, LoadtestConfig):
        if not obj.concurrency or any(c < 1 for c in obj.concurrency):
            raise ConfigError(f"invalid {where}.concurrency", list(obj.concurrency), "positive integers")
        for name in ("duration_s", "request_batch", "raw_seconds"):
            if getattr(obj, name) <= 0:
                raise ConfigError(f"invalid {where}.{name}", getattr(obj, name), "a positive number")
        for name in ("warmup_s", "client_procs"):
            if getattr(obj, name) < 0:
                raise ConfigError(f"invalid {where}.{name}", getattr(obj, name), "a non-negative number")
    elif isinstance(obj, Tolerance):
        for name in ("rtol", "atol", "max_rel_l2"):
            if getattr(obj, name) < 0:
                raise ConfigError(f"invalid {where}.{name}", getattr(obj, name), "a non-negative number")


def check_dims(dims, inputs, where: str = "model.dims") -> None:
    """Dimensions against the model's inputs (when they are known: a
    registry model's come from the registry, checked at export)."""
    seen = set()
    for k, d in enumerate(dims):
        if d.name in seen or d.name == "batch":
            raise ConfigError(f"duplicate dimension name in {where}", d.name, "distinct names other than 'batch'")
        seen.add(d.name)
        if not inputs:
            continue
        shapes = {i.name: i.shape for i in inputs}
        for name in d.inputs:
            if name not in shapes:
                raise ConfigError(f"{where}[{k}] names an input the model does not have", name, ", ".join(shapes))
            if d.axis > len(shapes[name]):
                raise ConfigError(f"{where}[{k}].axis is past the rank of input '{name}'", d.axis,
                                  f"1 to {len(shapes[name])} (axis 0 is the batch)")
    claimed = [(n, d.axis) for d in dims for n in d.inputs]
    if len(set(claimed)) != len(claimed):
        raise ConfigError(f"two dimensions in {where} claim the same input axis", claimed)


def parse_dim_buckets(text: str, dims: tuple[DimSpec, ...], where: str = "--dim-buckets") -> tuple[DimSpec, ...]:
    """'seq=64,128' (';' between dimensions) -> the dims with those buckets."""
    out = {d.name: d for d in dims}
    for part in (p.strip() for p in text.split(";") if p.strip()):
        name, sep, values = part.partition("=")
        name = name.strip()
        if not sep or name not in out:
            raise ConfigError(f"invalid {where}", repr(part),
                              "NAME=L1,L2 for a dimension the config declares ([[model.dims]]: "
                              + (", ".join(out) or "none") + ")")
        out[name] = dataclasses.replace(out[name], buckets=parse_int_list(values, f"{where} {name}"))
        _check_values(out[name], f"{where} {name}")
    return tuple(out.values())


_DURATION = re.compile(r"^(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?$")


def parse_duration(text: str, where: str = "budget") -> float | None:
    """'90s', '10m', '1h30m', or a plain number of seconds; '' means no limit."""
    text = text.strip()
    if not text:
        return None
    try:
        return float(text)
    except ValueError:
        pass
    m = _DURATION.match(text)
    if not m or not any(m.groups()):
        raise ConfigError(f"invalid {where}", repr(text), "a duration like 90s, 10m or 1h30m")
    h, mi, s = (int(g or 0) for g in m.groups())
    return float(h * 3600 + mi * 60 + s)


def from_dict(data: dict, where: str = "config") -> Config:
    base = {f.name: f for f in dataclasses.fields(Config)}
    for key in data:
        if key not in base:
            raise ConfigError(f"unknown section '{key}' in {where}{_suggest(key, list(base))}", None, "one of " + ", ".join(base))
    if "model" not in data:
        raise ConfigError(f"missing section [model] in {where}")
    model = _build(ModelConfig, data["model"], "model")
    if not model.name:
        model = dataclasses.replace(model, name=Path(model.source).stem if model.source.endswith(".onnx") else model.source)
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", model.name):
        raise ConfigError("invalid model.name", repr(model.name), "letters, digits, '_', '.' or '-'")
    return Config(
        model=model,
        llvm=_build(Profile, data.get("llvm", {}), "llvm", base=LLVM_DEFAULTS),
        cuda=_build(Profile, data.get("cuda", {}), "cuda", base=CUDA_DEFAULTS),
        tolerance=_build(Tolerances, data.get("tolerance", {}), "tolerance", base=Tolerances()),
    )


def load(path: str | Path) -> Config:
    path = Path(path)
    if not path.is_file():
        raise ConfigError("config file not found", str(path), "an existing .toml file")
    try:
        data = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {path} is not valid TOML", str(e).splitlines()[0]) from None
    return from_dict(data, where=str(path))


def apply_overrides(cfg: Config, target_kind: str, **overrides) -> Config:
    """Command-line overrides (None = not given) of the active target profile."""
    given = {k: v for k, v in overrides.items() if v is not None}
    if not given:
        return cfg
    table = dataclasses.asdict(cfg.profile(target_kind))
    table.update(given)
    if "buckets" in given and "tune_buckets" not in given:
        # Tune the smallest bucket asked for unless told otherwise.
        table["tune_buckets"] = [b for b in table["tune_buckets"] if b in given["buckets"]] or [min(given["buckets"])]
    profile = _build(Profile, table, target_kind)
    return dataclasses.replace(cfg, **{target_kind: profile})


def serve_config(base: ServeConfig | None = None, **overrides) -> ServeConfig:
    """A ServeConfig from command-line values (None = not given)."""
    return _build(ServeConfig, {k: v for k, v in overrides.items() if v is not None}, "serve",
                  base=base or ServeConfig())


def loadtest_config(serve: ServeConfig, **overrides) -> LoadtestConfig:
    given = {k: v for k, v in overrides.items() if v is not None}
    return dataclasses.replace(_build(LoadtestConfig, given, "loadtest", base=LoadtestConfig()), serve=serve)


def parse_int_list(text: str, where: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError:
        raise ConfigError(f"invalid {where}", repr(text), "comma-separated integers, e.g. 1,8,32") from None
    if not values:
        raise ConfigError(f"invalid {where}", repr(text), "at least one integer")
    return values


def parse_address(text: str, where: str = "--tracker") -> tuple[str, int]:
    """'host:port' ('[::1]:9190' for IPv6) -> (host, port)."""
    text = (text or "").strip()
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"invalid {where}", repr(text), "HOST:PORT, e.g. 10.0.0.1:9190")
    return host, int(port)


def check_lanes(lanes: int | None, lane_cpus: int | None) -> None:
    """--rpc-lanes and --rpc-lane-cpus, with a pool or without one."""
    if lanes is not None and lanes < 0:
        raise ConfigError("invalid --rpc-lanes", lanes, "0 (one per server) or more")
    if lane_cpus is not None and lane_cpus < 0:
        raise ConfigError("invalid --rpc-lane-cpus", lane_cpus, "0 (an equal share of the CPUs) or more")


def rpc_pool(tracker: str | None, key: str | None, lanes: int | None = None,
             lane_cpus: int | None = None) -> RPCPool | None:
    """The pool named by --tracker and --rpc-key (both or neither), tuned
    from `lanes` processes (--rpc-lanes; default one per server) of
    `lane_cpus` CPUs each (--rpc-lane-cpus; default an equal share)."""
    check_lanes(lanes, lane_cpus)
    for flag, value in (("--rpc-lanes", lanes if lanes != 1 else None), ("--rpc-lane-cpus", lane_cpus)):
        if value and not (tracker or key):  # (--rpc-lanes 1 alone: one tuning process, no pool)
            raise ConfigError(f"{flag} needs --tracker and --rpc-key", value,
                              "a pool to measure on, or --rpc-lanes 2 or more: lanes on this machine's device")
    if not tracker and not key:
        return None
    if not tracker or not key:
        given, missing = ("--tracker", "--rpc-key") if tracker else ("--rpc-key", "--tracker")
        raise ConfigError(f"{given} needs {missing}", None, "--tracker HOST:PORT --rpc-key KEY (TRACKER= RPC_KEY= for make)")
    host, port = parse_address(tracker)
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", key):
        raise ConfigError("invalid --rpc-key", repr(key), "letters, digits, '_', '.' or '-'")
    return RPCPool(host, port, key, lanes=lanes or 0, lane_cpus=lane_cpus or 0)


def to_dict(obj) -> dict:
    return dataclasses.asdict(obj)
