"""Which machine code to generate: `auto`, `llvm`, `cuda` (the GPU here, its
architecture detected) or `cuda:sm_XY` (cross-compiled, no GPU needed)."""

from __future__ import annotations

import dataclasses
import json
import os
import re

from .errors import TargetError

# Limits every CUDA GPU since Volta satisfies; used when cross-compiling
# without a device to read them from.
_CUDA_GENERIC_LIMITS = {
    "max_threads_per_block": 1024,
    "max_shared_memory_per_block": 49152,
    "thread_warp_size": 32,
    "registers_per_block": 65536,
}


@dataclasses.dataclass(frozen=True)
class TargetInfo:
    kind: str  # "llvm" | "cuda"
    spec: str  # JSON of the tvm Target (the exact target string in manifests)
    arch: str  # "sm_90", or the LLVM CPU name
    device_name: str  # "NVIDIA H200", the CPU model ("znver4"), or "" when cross-compiling
    has_device: bool  # whether code for it can run on this machine

    def tvm_target(self):
        from .tvm_compat import Target

        spec = json.loads(self.spec)
        if self.kind == "cuda":
            return Target(spec, host={"kind": "llvm"})
        return Target(spec)

    def device(self):
        from .tvm_compat import tvm

        if not self.has_device:
            raise TargetError(f"no {self.kind} device on this machine to run on", self.kind)
        return tvm.cuda(0) if self.kind == "cuda" else tvm.cpu(0)

    @property
    def slug(self) -> str:
        """Readable folder label; the authoritative description is `key()`."""
        gpu = re.sub(r"[^a-z0-9]+", "-", self.device_name.lower()).strip("-")
        if self.kind == "cuda":
            return f"cuda-{self.arch}-{gpu or 'nodevice'}"
        return f"llvm-{self.arch}"

    def key(self) -> dict:
        """What tuning databases and packages are keyed by. A GPU's model is
        part of it; a CPU's is not, nor its core count: the level (`arch`)
        and the target string without `num-cores` (records tuned on any
        machine of the level apply to every other)."""
        if self.kind == "llvm":
            spec = {k: v for k, v in json.loads(self.spec).items() if k != "num-cores"}
            return {"kind": self.kind, "arch": self.arch, "device": "", "target": json.dumps(spec, sort_keys=True)}
        return {"kind": self.kind, "arch": self.arch, "device": self.device_name, "target": self.spec}


def _cuda_device():
    from .tvm_compat import tvm

    try:
        dev = tvm.cuda(0)
        return dev if dev.exist else None
    except Exception:  # the CUDA runtime library may be absent entirely
        return None


# The x86-64 micro-architecture levels of the psABI, each with the features
# (LLVM's names) it adds to the one below. A CPU target is generated for its
# level, not its model (`-mcpu=x86-64-v4`, not `znver4`), so that a tuning
# database and a package serve every machine of that level: this project's
# CPU machines changed from znver3 to znver4 to emeraldrapids between
# sessions, and a database keyed by the model applied to none of the others.
X86_LEVELS = (
    ("x86-64-v2", frozenset({"cx16", "popcnt", "sahf", "sse3", "sse4.1", "sse4.2", "ssse3"})),
    ("x86-64-v3", frozenset({"avx", "avx2", "bmi", "bmi2", "f16c", "fma", "lzcnt", "movbe", "xsave"})),
    ("x86-64-v4", frozenset({"avx512bw", "avx512cd", "avx512dq", "avx512f", "avx512vl"})),
)


def cpu_level(cpu: str) -> str:
    """The highest x86-64 level whose features the CPU model `cpu` (as LLVM
    names it, e.g. the host's `llvm_get_system_cpu()`) has; the model itself
    when it has none (another architecture, or a CPU LLVM does not know)."""
    from .tvm_compat import Target, target_codegen

    try:
        features = set(target_codegen.llvm_get_cpu_features(Target({"kind": "llvm", "mcpu": cpu})))
    except Exception:  # an unknown CPU name: no features to go by
        return cpu
    level = cpu
    for name, needs in X86_LEVELS:
        if not needs <= features:
            break
        level = name
    return level


def level_rank(arch: str) -> int | None:
    """1 for x86-64-v2 up to 3 for x86-64-v4; None for anything else."""
    return next((i + 1 for i, (name, _) in enumerate(X86_LEVELS) if name == arch), None)


def _llvm() -> TargetInfo:
    import psutil

    from .tvm_compat import target_codegen

    cpu = target_codegen.llvm_get_system_cpu()
    level = cpu_level(cpu)
    cores = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    spec = {"kind": "llvm", "mcpu": level, "num-cores": int(cores)}
    return TargetInfo("llvm", json.dumps(spec, sort_keys=True), level, cpu, True)


def cuda_from_device(dev, has_device: bool = True) -> TargetInfo:
    """The target of a CUDA device, local or remote (an RPC session's
    `cuda(0)`). It reads what `Target.from_device` reads (TVM's
    `backend/cuda._detect_target_from_device`), which refuses remote devices:
    one function for both, so a GPU tuned through RPC gets the target string,
    and so the database, that a run on that GPU's own host gets."""
    from .tvm_compat import Target

    target = Target({
        "kind": "cuda",
        "max_shared_memory_per_block": dev.max_shared_memory_per_block,
        "max_threads_per_block": dev.max_threads_per_block,
        "thread_warp_size": dev.warp_size,
        "arch": "sm_" + dev.compute_version.replace(".", ""),
    })
    spec = {k: v for k, v in dict(target.export()).items() if k not in ("host", "tag")}
    spec["keys"] = list(spec.get("keys", ()))
    arch = str(spec.get("arch", "sm_" + dev.compute_version.replace(".", "")))
    return TargetInfo("cuda", json.dumps(spec, sort_keys=True, default=str), arch, dev.device_name, has_device)


def cuda_for_arch(arch: str, device_name: str, has_device: bool) -> TargetInfo:
    """The target of `TARGET=cuda:sm_XY`: the generic spec with the arch as
    written (`sm_90a` stays `sm_90a`), whatever the GPU that runs it. An RPC
    pool builds it too (with its server's GPU name), so the database key is
    the one a local run on that GPU gets."""
    spec = {"kind": "cuda", "arch": arch, "keys": ["cuda", "gpu"], **_CUDA_GENERIC_LIMITS}
    return TargetInfo("cuda", json.dumps(spec, sort_keys=True), arch, device_name, has_device)


def _cuda_here(dev) -> TargetInfo:
    return cuda_from_device(dev, True)


def local_cuda_matches(arch: str, device_name: str) -> bool:
    """Whether this machine's first GPU is that architecture and model."""
    dev = _cuda_device()
    return dev is not None and dev.device_name == device_name and "sm_" + dev.compute_version.replace(".", "") == arch


def resolve(text: str) -> TargetInfo:
    text = (text or "auto").strip().lower()
    if text == "auto":
        dev = _cuda_device()
        return _cuda_here(dev) if dev is not None else _llvm()
    if text in ("llvm", "cpu"):
        return _llvm()
    if text == "cuda":
        dev = _cuda_device()
        if dev is None:
            raise TargetError(
                "TARGET=cuda but no CUDA GPU is visible here", "no device",
                "a GPU, or TARGET=cuda:sm_90 to cross-compile",
            )
        return _cuda_here(dev)
    m = re.fullmatch(r"cuda:(sm_\d+a?)", text)
    if m:
        arch = m.group(1)
        dev = _cuda_device()
        here = dev is not None and arch.rstrip("a") == "sm_" + dev.compute_version.replace(".", "")
        return cuda_for_arch(arch, dev.device_name if here else "", here)
    raise TargetError("unknown target", repr(text), "auto, llvm, cuda or cuda:sm_XY (e.g. cuda:sm_90)")
