"""Latency diff: the same inputs through every runtime a user could pick.

Every backend is a runner (`runners`: one lifecycle, one timing method), so
the comparison is one loop: each runner set up, its outputs checked against
the fp32 reference of the same run (a fast but wrong runner is flagged), then
timed, the iterations split into rounds in which the runners take turns
(`--rounds`); p50/p90/p99/mean and throughput (samples/s at p50). Set-up
(compile, engine build, module load) is timed apart. A runner that cannot run
here is reported with its reason. The table and plot are `report`'s; TensorRT
baselines measured elsewhere are `trtexec`'s.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np

from ..errors import ConfigError
from .runners import Runner, RunnerUnavailable, free_device_memory, percentiles

log = logging.getLogger(__name__)


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
        free_device_memory()

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


def case(batch: int, precision: str, runners, inputs, reference, tolerances, warmup, iters, baselines=(),
         rounds: int = 1) -> dict:
    rows = run_all(runners, inputs, reference, tolerances, warmup, iters, rounds)
    rows += list(baselines)
    return {"batch": batch, "precision": precision, "warmup": warmup, "iterations": iters, "rounds": rounds,
            "runners": rows}


def cases(cfg, profile, ws, ex, names, factory, tmpdir: Path, *, baselines, warmup: int, iters: int, rounds: int,
          compile_mode: str) -> list[dict]:
    """`make bench`: one case per bucket of the profile, the named runners on
    that bucket's seeded inputs against ONNX Runtime's outputs, beside the
    baselines (files measured elsewhere) of the same batch. `factory` builds
    the PyTorch model (None for an ONNX source); `tmpdir` takes the fp16 ONNX
    files TensorRT needs."""
    from ..runtime import random_inputs
    from ..validate import References
    from . import runners as bench_runners
    from . import trtexec

    reference_for = References(cfg, ex, include_torch=False)
    out = []
    for bucket in ex.buckets(profile):
        batch = bucket.batch
        inputs = random_inputs(ex.random_specs(bucket), batch, seed=cfg.model.seed + 1000 + batch)
        reference = reference_for(inputs)["onnxruntime"]
        make16 = None
        if factory is not None:
            make16 = lambda xs, b=bucket: bench_runners.fp16_onnx(factory, xs, cfg.model.opset, tmpdir / f"fp16_b{b}.onnx")  # noqa: E731
        runners = bench_runners.make_runners(
            names, package=ws.package, untuned=ws.untuned, onnx_path=ex.onnx_path,
            input_names=[i.name for i in ex.inputs], factory=factory, precision=profile.precision,
            compile_mode=compile_mode, fp16_onnx_path=make16,
        )
        rows = [trtexec.load_baseline(Path(b), cfg.model.name, batch, list(ex.inputs[0].shape), profile.precision)
                for b in baselines if trtexec.baseline_batch(Path(b)) == batch and not bucket.dims]
        out.append(case(batch, profile.precision, runners, inputs, reference, cfg.tolerance, warmup, iters, rows,
                        rounds))
        if bucket.dims:
            out[-1]["bucket"] = bucket.label
    return out


ALTERNATIVES = ("torch-eager", "torch-compile", "onnxruntime")


def check_alternatives(names) -> None:
    unknown = [n for n in names if n not in ALTERNATIVES]
    if unknown:
        raise ConfigError(f"unknown alternative(s) {', '.join(unknown)} (--alternatives)", ", ".join(names),
                          ", ".join((*ALTERNATIVES, "none")))


ALTERNATIVE_ROUNDS = 5  # the package and its alternatives take turns this many times, per bucket


def alternatives(cfg, profile, target_kind: str, exported, buckets, names, package: Path | None = None,
                 seconds: float = 1.0) -> dict:
    """What the user could run instead, beside the package in the run's
    summary: per bucket, each named alternative's median (ms) on the same
    inputs as the package's latency, or why it could not run. torch-eager is
    fp16 and channels-last on CUDA for an fp16 package (strict fp32
    otherwise); an ONNX source has no PyTorch model, so ONNX Runtime stands
    in for it. torch.compile (default mode) runs only when named. The
    inputs are the package's latency inputs (runtime.random_inputs, seed 0).
    With `package`, its bucket and the alternatives take turns over
    ALTERNATIVE_ROUNDS rounds (the package a repeat of its timer, each
    alternative a share of its iterations), and each row also holds the
    package's median in those rounds (`package_ms`), which the summary's
    ratio uses: a machine whose speed drifts then slows both alike."""
    from .. import export
    from ..runtime import load, random_inputs
    from . import runners as bench_runners

    check_alternatives(names)
    factory = None if export.is_onnx_source(cfg.model.source) else (lambda: export.build_torch_model(cfg))
    half = target_kind == "cuda" and profile.precision == "fp16"
    # (TF32 convolutions are PyTorch's default on Ampere and newer; its matmuls
    # in TF32 too, as the package's GEMMs: torch.backends.cuda.matmul.allow_tf32)
    tf32 = profile.precision == "tf32"
    made = {}
    for n in names:
        if n.startswith("torch") and factory is None:
            n = "onnxruntime"
        if n in made:
            continue
        if n == "onnxruntime":  # fp16 beside an fp16 package where its CUDA provider is there
            r = bench_runners.ORTRunner(exported.onnx_path, [i.name for i in exported.inputs],
                                        half=half and bench_runners.ort_has_cuda())
        elif n == "torch-eager":
            r = bench_runners.TorchRunner("torch-eager-fp16" if half else "torch-eager-tf32" if tf32 else "torch-eager",
                                          factory, half=half, channels_last=half, tf32=tf32)
        else:
            r = bench_runners.TorchRunner("torch-compile", factory, half=half, channels_last=half,
                                          compile_mode="default", tf32=tf32)
        made[n] = r
    pred = load(package, warn_unvalidated=False) if package is not None else None
    out: dict[str, dict] = {}
    for b in buckets:
        row = out.setdefault(str(b), {})
        inputs = random_inputs(exported.random_specs(b), b.batch, seed=0)
        active = []  # (runner, its iterations a round, its times)
        try:
            for r in made.values():
                try:
                    r.activate(inputs)  # (ONNX Runtime names itself by its provider here)
                    n_iter = bench_runners.iterations_for(r, seconds, 100)
                    active.append((r, max(1, -(-n_iter // ALTERNATIVE_ROUNDS)), []))
                except Exception as e:  # noqa: BLE001 - an alternative that cannot run is said, never fatal
                    row[r.name] = {"error": _failure(e)}
                    r.deactivate()
            timer = pred.timer(b) if pred is not None and active else None
            package_s: list[float] = []
            for k in range(ALTERNATIVE_ROUNDS):
                if timer is not None:
                    package_s.append(timer())
                for r, per_round, times in list(active):
                    try:
                        times.extend(r.time(1 if k == 0 else 0, per_round))
                    except Exception as e:  # noqa: BLE001
                        row[r.name] = {"error": _failure(e)}
                        active.remove((r, per_round, times))
            for r, _, times in active:
                row[r.name] = {"median_ms": float(np.median(times)), "iterations": len(times)}
                if package_s:
                    row[r.name]["package_ms"] = float(np.median(package_s)) * 1e3
        finally:
            for r in made.values():
                r.deactivate()
            free_device_memory()
    return out
