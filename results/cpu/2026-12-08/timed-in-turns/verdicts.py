"""How often the kernel check's verdict (tuned record faster than the default schedule?) flips between
repeated checks of the same kernels, timed one after the other (the check before 2026-12-08) and in turns.
From the repository root: PYTHONPATH=. python results/cpu/2026-12-08/timed-in-turns/verdicts.py DB_FOLDER [REPS]
Each workload's best record and its default schedule are built once, then checked REPS times (default 5)
each way, alternately; prints one line per workload (tuned/default time ratios), the count of workloads
whose verdict was not the same in every repetition, and the median spread of a workload's ratios."""
import json, statistics, sys
from pathlib import Path
from deploy import targets
from deploy.tuning import check, database as dbs
from deploy.tvm_compat import tensor

folder = Path(sys.argv[1]); reps = int(sys.argv[2]) if len(sys.argv) > 2 else 5
target = targets.resolve("llvm"); dev = target.device()
workloads, records = dbs._best_lines(folder, 1, slower_than_default=False)
flips = {"sequential": 0, "in turns": 0}; n = 0
spread = {"sequential": [], "in turns": []}  # per workload: the largest ratio over the smallest
print("| workload | sequential tuned/default each rep | in turns tuned/default each rep |\n|---|---|---|")
for ln in records:
    wi, rec = json.loads(ln)
    if dbs._mean_secs(rec) == float("inf"):
        continue
    libs = check.build_libs(workloads[wi], rec, target, check_outputs=False)
    if "default" not in libs:
        continue
    args = check._seeded_args(libs["buffers"], libs.get("index_bounds"))
    ratios = {"sequential": [], "in turns": []}
    for _ in range(reps):
        t = check._time_us(libs["tuned"], [tensor(a, dev) for a in args], dev)
        d = check._time_us(libs["default"], [tensor(a, dev) for a in args], dev)
        ratios["sequential"].append(t / d)
        t, d = check._time_us_in_turns([libs["tuned"], libs["default"]],
                                       [[tensor(a, dev) for a in args] for _ in range(2)], dev)
        ratios["in turns"].append(t / d)
    n += 1
    for k, rs in ratios.items():
        if len({r < 1 for r in rs}) > 1:
            flips[k] += 1
        spread[k].append(max(rs) / min(rs))
    shash = json.loads(workloads[wi])[0]
    print(f"| {shash[:12]} | " + " | ".join(" ".join(f"{r:.2f}" for r in ratios[k]) for k in ratios) + " |",
          flush=True)
print(f"\n{n} workloads, {reps} repetitions each way: verdict not the same every time: "
      f"sequential {flips['sequential']}, in turns {flips['in turns']}; a workload's largest ratio over its smallest, "
      f"median: sequential {statistics.median(spread['sequential']):.3f}, in turns {statistics.median(spread['in turns']):.3f}")
