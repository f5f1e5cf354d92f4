"""The latency diff's report: the machine it ran on, the Markdown table, the
plot, and the results folder (results.json, results.md, results.png).
"""

from __future__ import annotations

import platform
from pathlib import Path

from .. import artifacts


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


def markdown(report: dict) -> str:
    lines, any_rounds = [], False
    for case in report["cases"]:
        rows = case["runners"]
        ok = [r for r in rows if r["status"] == "ok"]
        trt = next((r for r in ok if r["kind"] == "tensorrt"), None)
        tvm = next((r for r in ok if r["name"] == "tvm"), None)
        lines.append(f"### {'bucket ' + case['bucket'] if case.get('bucket') else 'batch ' + str(case['batch'])}, "
                     f"{case['precision']}")
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
        ax.set_title(f"{report['model']}: {case.get('bucket') or 'batch ' + str(case['batch'])}, {case['precision']}")
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
