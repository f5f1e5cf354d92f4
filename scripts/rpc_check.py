"""Tuning through TVM's RPC tracker against tuning on the local device, in
one run on one machine (loopback): what the GPU machines check. Answers in
results/h200/2026-11-29/rpc-check-x2/ and rpc-check-x4/, and
results/h200/2026-11-30/rpc-check-x2-lanes/ (via scripts/gpu_rpc_check.sh).

  python scripts/rpc_check.py --model resnet50 --target cuda --out $OUT [--trials 256 --max-tasks 4]

Starts a tracker on 127.0.0.1 and RPC servers: one under key `one` (GPU 0)
and one per visible GPU under key `all` (CUDA_VISIBLE_DEVICES per server;
with `--target llvm`, `--servers N` CPU servers). Then, on the same tasks
(the model's heaviest `--max-tasks`), each mode from an empty database:
  local      MetaSchedule's LocalRunner on this process's GPU 0, one process
  one        one server (one GPU), one tuning process
  one-lanes  one server, one tuning process (lane) per server of `all`
  all-1lane  every server, one tuning process (only measuring is spread)
  all        every server, one lane per server (what `make tune` does)
  all-overlap  as `all`, each lane given every CPU (--rpc-lane-cpus) rather
             than a share, so that one lane can build or search while another waits
and reports trials/min of each, against `one`. After `one`, the best
schedule of each of its tasks is built once and timed `--rounds` times
alternately on the local device and through RPC: the same kernel, so the
two times should agree within noise.
Writes $OUT/rpc_check.json and $OUT/rpc_check.md after every mode (a run
cut short still reports what it measured); server logs in $OUT/logs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deploy import config, export, frontend, optimize, targets
from deploy.artifacts import REPO_ROOT
from deploy.tuning import builder as tune_builder
from deploy.tuning import database as dbs
from deploy.tuning import devices as rpc_devices
from deploy.tuning import pool as rpc_pool
from deploy.tuning import tasks as tune_tasks
from deploy.tuning import tune

log = logging.getLogger("rpc_check")


def visible_gpus() -> int:
    from deploy.tvm_compat import tvm

    n = 0
    while n < 64 and tvm.cuda(n).exist:
        n += 1
    return n


def load_config(model: str, target_kind: str, trials: int, max_tasks: int, trials_per_task: int):
    path = REPO_ROOT / "configs" / f"{model}.toml"
    cfg = config.load(path) if path.is_file() else config.from_dict({"model": {"source": model}})
    # Only the tuned bucket is optimized: the others would cost time and change nothing here.
    return config.apply_overrides(cfg, target_kind, buckets=[1], tune_buckets=[1], trials=trials, max_tasks=max_tasks,
                                  trials_per_task=trials_per_task, budget="")


def tune_mode(name, cfg, target, ex, opt, out: Path, pool=None) -> dict:
    profile = cfg.profile(target.kind)
    t0 = time.time()
    a = tune.run(profile, target, opt, cfg.model.name, ex.inputs, out / f"db-{name}", out / f"tune-{name}", None, cfg.model.seed, pool)
    s = json.loads((a.folder / "summary.json").read_text())[str(profile.tune_buckets[0])]
    split = s.get("time_split_s", {})
    return {
        "mode": name,
        "servers": None if pool is None else s.get("rpc", {}).get("servers"),
        "lanes": len(s.get("lanes", [])) or 1,
        "lane_seconds": [lane["seconds"] for lane in s.get("lanes", [])],
        "lane_cpus": s["lanes"][0]["cpus"] if s.get("lanes") else tune_builder.usable_cpus(),
        "time_split_s": split,
        "new_trials": s["new_trials"],
        "valid_fraction": s["valid_fraction"],
        "seconds": s["seconds"],
        "wall_seconds": round(time.time() - t0, 1),
        "trials_per_minute": s["trials_per_minute"],
        "measure_seconds": round(split.get("SendToRunner", 0.0) + split.get("JoinRunnerFutures", 0.0), 1),
        "build_seconds": round(split.get("SendToBuilder", 0.0), 1),
        "best_us": {t: v["best_us"] for t, v in s["tasks"].items()},
        "database": str(a.databases[profile.tune_buckets[0]]),
        "rpc": s.get("rpc"),
    }


def remeasure(db_dir: Path, key: dict, target, profile, opt, pool, rounds: int) -> dict:
    """Each task's best schedule in `db_dir`, built once, timed alternately
    with the LocalRunner and through the pool (one server)."""
    import threading

    from deploy.tvm_compat import ms

    tvm_target = target.tvm_target()
    tasks = tune_tasks.extract_tasks(opt.load_module(profile.tune_buckets[0]), tvm_target)
    out = {}
    builder = tune_builder._make_builder(tune_builder.usable_cpus(), profile.builder_timeout_s)
    local = tune_tasks._runner(target, profile)
    remote = tune_tasks._runner(target, profile, pool, 1, threading.Event())
    try:
        with dbs.open_readonly(db_dir, key) as db:
            for task in tasks:
                if db is None or not db.has_workload(task.dispatched[0]):
                    continue
                top = db.get_top_k(db.commit_workload(task.dispatched[0]), 1)
                if not top:
                    continue
                cand = top[0].as_measure_candidate()
                (built,) = builder.build([ms.builder.BuilderInput(cand.sch.mod, tvm_target)])
                if built.error_msg:
                    continue
                device = "cuda" if target.kind == "cuda" else "cpu"
                inp = ms.runner.RunnerInput(built.artifact_path, device, cand.args_info)
                times = {"local": [], "rpc": []}
                for _ in range(rounds):
                    for name, runner in (("local", local), ("rpc", remote)):
                        (res,) = [f.result() for f in runner.run([inp])]
                        if res.run_secs:
                            times[name].append(statistics.mean(float(x) for x in res.run_secs) * 1e6)
                med = {k: statistics.median(v) if v else None for k, v in times.items()}
                out[task.task_name] = {"local_us": med["local"], "rpc_us": med["rpc"], "samples": times,
                                       "ratio": med["rpc"] / med["local"] if med["local"] and med["rpc"] else None}
    finally:
        builder.close()
        remote.measurer.close()
    return out


def markdown(report: dict) -> str:
    lines = [f"# Tuning through RPC vs locally: {report['model']} on {report['device']}", "",
             (f"{report['trials']} trials per mode over the {report['max_tasks']} heaviest tasks; "
              f"{report['gpus']} GPU(s) / servers under `all`. Same database key locally and through RPC: "
              f"{report['same_database_key']}."), "",
             "| mode | servers | lanes x CPUs | trials | valid | seconds | trials/min | waiting on measuring s | building s | vs one |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    base = next((m["trials_per_minute"] for m in report["modes"] if m["mode"] == "one"), None)
    for m in report["modes"]:
        servers = "local" if m["servers"] is None else len(m["servers"])
        vf = "n/a" if m["valid_fraction"] is None else f"{m['valid_fraction']:.0%}"
        rel = f"{m['trials_per_minute'] / base:.2f}x" if base and m["trials_per_minute"] else ""
        lines.append(f"| {m['mode']} | {servers} | {m['lanes']} x {m.get('lane_cpus', '?')} | {m['new_trials']} | {vf} | {m['seconds']} | {m['trials_per_minute']} | "
                     f"{m['measure_seconds']} | {m['build_seconds']} | {rel} |")
    lines += ["", "Seconds the tuner waited on measuring (results not back yet) and building, summed over a mode's lanes (they run at the same time)."]
    if not report["same_kernels"]:
        return "\n".join(lines) + "\n"
    lines += ["", f"Same kernels (best of each task in the `one` run), {report['rounds']} alternating rounds, median us:", "",
              "| kernel | local | RPC | RPC/local |", "|---|---|---|---|"]
    def f(x):
        return "-" if x is None else f"{x:.2f}"

    for k, v in report["same_kernels"].items():
        lines.append(f"| {k} | {f(v['local_us'])} | {f(v['rpc_us'])} | {f(v['ratio'])} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--target", default="cuda", help="cuda, or llvm to try it on a CPU machine")
    ap.add_argument("--out", required=True)
    ap.add_argument("--trials", type=int, default=256, help="trials per mode (whole batches for every lane: 64 x lanes x k)")
    ap.add_argument("--trials-per-task", type=int, default=64)
    ap.add_argument("--max-tasks", type=int, default=4)
    ap.add_argument("--servers", type=int, default=0, help="servers under `all` (default: one per visible GPU; llvm: 2)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of timing the same kernels locally and through RPC (0: skip)")
    ap.add_argument("--modes", default="one,one-lanes,all", help="from local, one, one-lanes, all-1lane, all, all-overlap")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname).1s %(name)s: %(message)s", datefmt="%H:%M:%S")
    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)

    target = targets.resolve(args.target)
    n = args.servers or (visible_gpus() if target.kind == "cuda" else 2)
    cfg = load_config(args.model, target.kind, args.trials, args.max_tasks, args.trials_per_task)
    profile = cfg.profile(target.kind)
    ws = out / "ws"
    ex = export.run(cfg, ws / "export")
    opt = optimize.run(profile, target, frontend.run(profile, ex, ws / "frontend"), ws / "optimize")

    procs = []
    port = rpc_pool.free_port()
    try:
        procs.append(rpc_pool.start_tracker("127.0.0.1", port, out / "logs" / "tracker.log"))
        one = config.RPCPool("127.0.0.1", port, "one")
        pool = config.RPCPool("127.0.0.1", port, "all")
        gpu = (lambda i: str(i)) if target.kind == "cuda" else (lambda i: None)
        procs.append(rpc_pool.start_server(one, port=rpc_pool.free_port(), gpu=gpu(0), log_path=out / "logs" / "one-0.log"))
        for i in range(n):
            procs.append(rpc_pool.start_server(pool, port=rpc_pool.free_port(), gpu=gpu(i), log_path=out / "logs" / f"all-{i}.log"))
        rpc_pool.wait_for_servers(one, 1)
        rpc_pool.wait_for_servers(pool, n)
        remote_target = rpc_devices.resolve_target(args.target, one)
        same_key = remote_target.key() == target.key()
        log.info("rpc_check: target through RPC %s the local one", "is" if same_key else "DIFFERS FROM")
        report = {
            "model": cfg.model.name, "target": target.key(), "device": target.device_name or target.arch, "gpus": n,
            "cpus": tune_builder.usable_cpus(), "trials": args.trials, "max_tasks": args.max_tasks, "rounds": args.rounds,
            "same_database_key": same_key, "modes": [], "same_kernels": {}, "profile": dataclasses.asdict(profile),
        }
        pools = {
            "local": None,
            "one": dataclasses.replace(one, lanes=1),
            "one-lanes": dataclasses.replace(one, lanes=n),
            "all-1lane": dataclasses.replace(pool, lanes=1),
            "all": dataclasses.replace(pool, lanes=n),
            "all-overlap": dataclasses.replace(pool, lanes=n, lane_cpus=tune_builder.usable_cpus()),
        }
        for name in args.modes.split(","):
            p = pools[name]
            report["modes"].append(tune_mode(name, cfg, remote_target if p else target, ex, opt, out, p))
            print(json.dumps({k: v for k, v in report["modes"][-1].items() if k != "rpc"}), flush=True)
            write_report(out, report)
            if name == "one" and args.rounds > 0:
                m = report["modes"][-1]
                key = json.loads((Path(m["database"]) / "key.json").read_text())
                report["same_kernels"] = remeasure(Path(m["database"]), key, remote_target, profile, opt, one, args.rounds)
                write_report(out, report)
    finally:
        for p in procs:
            p.stop()
    print(markdown(report))
    return 0


def write_report(out: Path, report: dict) -> None:
    (out / "rpc_check.json").write_text(json.dumps(report, indent=2, default=str))
    (out / "rpc_check.md").write_text(markdown(report))


if __name__ == "__main__":
    sys.exit(main())
