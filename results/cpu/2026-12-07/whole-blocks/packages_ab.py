"""PYTHONPATH=. python packages_ab.py OLD_WORK NEW_WORK model...: each model's two corpus packages
(OLD_WORK/<model>-fp32/package, built by the code before the change; NEW_WORK's after) loaded in one
process and timed in turns, 7 rounds; the median of each package's per-round p50."""
import sys, statistics
from pathlib import Path
from deploy import runtime
from deploy.bench import runners as bench
old, new = sys.argv[1], sys.argv[2]
print("| model | old ms | new ms | new/old |\n|---|---|---|---|")
for m in sys.argv[3:]:
    rs = []
    for w in (old, new):
        pkg = Path(w) / f"{m}-fp32" / "package"
        inputs = runtime.load(pkg, warn_unvalidated=False).random_inputs(1, seed=0)
        r = bench.TVMRunner("tvm", pkg); r.activate(inputs); rs.append(r)
    iters = bench.iterations_for(rs[0], 0.5, 200)
    p = [[], []]
    for _ in range(7):
        for i, r in enumerate(rs):
            p[i].append(bench.percentiles(r.time(max(1, iters // 10), iters), 1)["p50_ms"])
    a, b = statistics.median(p[0]), statistics.median(p[1])
    print(f"| {m} | {a:.3f} | {b:.3f} | {b/a:.2f} |", flush=True)
    for r in rs: r.deactivate()
