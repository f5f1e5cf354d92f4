"""python results/cpu/2026-12-08/ratios.py OLD/corpus.md NEW/corpus.md: each validated model's TVM and ONNX Runtime
p50 in two llvm corpus runs and their ratio, lowest last ratio first; then each run's median ratio, models within
1.5x and models faster than ONNX Runtime."""
import sys, statistics
def load(p):
    rows=[l.split('|') for l in open(p) if l.startswith('| ') and 'validated' in l]
    return {x[1].strip(): (float(x[9]), float(x[10])) for x in rows}
a, b = load(sys.argv[1]), load(sys.argv[2])
ra = {m: t/o for m,(t,o) in a.items()}; rb = {m: t/o for m,(t,o) in b.items()}
for m in sorted(rb, key=rb.get):
    print(f"{m:18s} {a[m][0]:8.3f}/{a[m][1]:8.3f} = {ra[m]:.2f}   ->  {b[m][0]:8.3f}/{b[m][1]:8.3f} = {rb[m]:.2f}")
for r in (ra, rb):
    print("median %.2f  within1.5 %d  faster %d" % (statistics.median(r.values()), sum(v <= 1.5 for v in r.values()), sum(v < 1 for v in r.values())))
