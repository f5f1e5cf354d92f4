"""The GPU machine's shell helpers, run here with a fake nvidia-smi."""

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import cpu_halves  # noqa: E402  (scripts/ is put on the path first)


def fake_topology(root: Path, siblings_apart: int, cores: int) -> None:
    """`cores` cores of 2 SMT threads, CPU N and N + siblings_apart on one core."""
    for core in range(cores):
        for cpu in (core, core + siblings_apart):
            topo = root / f"cpu{cpu}" / "topology"
            topo.mkdir(parents=True)
            (topo / "physical_package_id").write_text("0\n")
            (topo / "core_id").write_text(f"{core}\n")


def test_cpu_halves_keep_smt_siblings_together(tmp_path):
    fake_topology(tmp_path, siblings_apart=4, cores=4)  # Linux's usual numbering: 0/4, 1/5, 2/6, 3/7
    a, b, info = cpu_halves.halves(list(range(8)), tmp_path)
    assert a == [0, 1, 4, 5] and b == [2, 3, 6, 7]  # not 0-3 / 4-7, which would share every core
    assert "core 0:0 cpus 0,4" in info
    a, b, info = cpu_halves.halves([0, 1, 2, 3], tmp_path / "missing")
    assert (a, b) == ([0, 1], [2, 3]) and "by index" in info[0]


def test_gpu_halves_runs_two_jobs_on_their_own_gpu_and_cpus(tmp_path):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: a)'\necho 'GPU 1: NVIDIA H200 (UUID: b)'\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    job = "echo gpu=$CUDA_VISIBLE_DEVICES gpus=$GPUS db=$DB_ROOT; grep Cpus_allowed_list /proc/self/status"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(tmp_path / "out")}
    r = subprocess.run(["bash", "scripts/gpu_halves.sh", job, job], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    logs = {}
    for name in ("a", "b"):
        with tarfile.open(tmp_path / "out" / f"{name}.tgz") as t:
            logs[name] = t.extractfile(f"{name}/job.log").read().decode()
    assert "gpu=0 gpus=0 db=/tmp/tuning_logs-a" in logs["a"] and "gpu=1 gpus=1 db=/tmp/tuning_logs-b" in logs["b"]
    cpus = [line.split()[-1] for name in ("a", "b") for line in logs[name].splitlines() if "Cpus_allowed_list" in line]
    assert len(cpus) == 2 and cpus[0] != cpus[1]
    assert "core 0:" in (tmp_path / "out" / "cpus.txt").read_text()  # the topology was read, not the fallback


def test_bench_and_loadtest_scripts_refuse_their_extra_flags_as_arguments(tmp_path):
    # `bash scripts/gpu_bench.sh ... BENCH_EXTRA="--runners ..."` would reach make as an unknown
    # variable and be dropped: the bench would run every default runner. Refused before anything runs.
    for script, var in (("gpu_bench.sh", "BENCH_EXTRA"), ("gpu_loadtest.sh", "LOADTEST_EXTRA"), ("gpu_chunk.sh", "EXTRA")):
        r = subprocess.run(["bash", f"scripts/{script}", "MODEL=resnet50", f"{var}=--runners tvm"], cwd=ROOT,
                           env={**os.environ, "OUT": str(tmp_path / "out")}, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, r.stderr
        assert r.stderr.count("\n") == 1 and f"{var}=--runners tvm is read from the environment" in r.stderr
        assert not (tmp_path / "out").exists()  # nothing built, nothing written


def test_make_bench_passes_runners_iters_and_rounds():
    r = subprocess.run(["make", "-n", "--no-print-directory", "bench", "MODEL=tiny_cnn", "PYTHON=python3",
                        "RUNNERS=tvm, onnxruntime", "ITERS=10", "ROUNDS=2"],
                       check=False, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    (line,) = [ln for ln in r.stdout.splitlines() if "-m deploy bench" in ln]  # under `make test` too
    assert line.endswith("--runners \"tvm, onnxruntime\" --iters 10 --rounds 2")  # quoted: a space is fine


def test_attention_script_refuses_an_unknown_pass(tmp_path):
    r = subprocess.run(["bash", "scripts/gpu_attention.sh", "fused"], cwd=ROOT,
                       env={**os.environ, "OUT": str(tmp_path / "out")}, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "unknown pass 'fused'" in r.stderr
    assert not (tmp_path / "out").exists()


def test_wgmma_script_refuses_an_unknown_pass(tmp_path):
    r = subprocess.run(["bash", "scripts/gpu_wgmma.sh", "fast"], cwd=ROOT,
                       env={**os.environ, "OUT": str(tmp_path / "out")}, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "unknown pass 'fast'" in r.stderr
    assert not (tmp_path / "out").exists()


def _fake_deploy(tmp_path, fails: str = "no-such-workdir"):
    """A python3 first on PATH that records its arguments (the log) and
    plays `deploy run` (validated, or failing where the call names
    `fails`) and `deploy bench` (a results.md); the environment to run a
    GPU script with it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    (bin_dir / "python3").write_text(f"""#!/bin/sh
echo "$*" >> {log}
case "$*" in
  *" run "*"{fails}"*) echo "build failed"; exit 1;;
  *" run "*) echo "build: bucket 32: 0 of 13 kernels tuned (schedules: wgmma-gemm 4)"; echo "validation PASSED";;
  *" bench "*) out=$(echo "$*" | sed 's/.*--out \\([^ ]*\\).*/\\1/'); mkdir -p "$out"
               echo "| tvm | 1.0 |" > "$out/results.md";;
  *" profile "*) echo "bucket 32: 1.2 ms in kernels per run";;
esac
""")
    (bin_dir / "python3").chmod(0o755)
    (tmp_path / "out").mkdir()
    return log, {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(tmp_path / "out"),
                 "WORK": str(tmp_path / "work"), "DB_ROOT": str(tmp_path / "db"), "WORKDIR": str(tmp_path / "ws")}


def test_wgmma_bench_builds_both_packages_and_benches_the_flag_beside_torch(tmp_path):
    """scripts/gpu_wgmma.sh bench with a python3 that records its arguments:
    each model built with --no-wgmma-gemm and --wgmma-gemm (untuned, validated
    runs), the flag's package benched beside torch.compile and eager, the
    other alone, the logs and results tarred; a build that fails (BERT's
    with the flag) is not benched, and the script exits 1."""
    log, env = _fake_deploy(tmp_path, fails="ws-bert-on")
    r = subprocess.run(["bash", "scripts/gpu_wgmma.sh", "bench", "vit,bert"], cwd=ROOT,
                       env={**env, "EXTRA": "--implicit-gemm --flat-gemm"}, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stderr  # (BERT's build with the flag failed)
    assert "bert on: not benched" in r.stdout and "bert on: rc=1" in r.stdout
    calls = log.read_text().splitlines()
    runs = [c for c in calls if c.startswith("-m deploy run")]
    benches = [c for c in calls if c.startswith("-m deploy bench")]
    assert len(runs) == 4 and len(benches) == 3
    assert all("--trials 0" in c and "--alternatives none" in c for c in runs)
    assert all(c.endswith("--implicit-gemm --flat-gemm") for c in runs + benches)  # (EXTRA, both ways)
    assert all("--iters 50 --rounds 3" in c and "--compile-mode default" in c for c in benches)
    for c in runs + benches:  # (off: --no-wgmma-gemm, since the kernel is CUDA fp16's default)
        on = c.split("--workdir ")[1].split()[0].endswith("-on")
        assert ("--wgmma-gemm" in c) == on and ("--no-wgmma-gemm" in c) == (not on)
    assert [c.split("--workdir ")[1].split()[0].rsplit("/", 1)[1] for c in benches] == \
        ["ws-vit-on", "ws-vit-off", "ws-bert-off"]
    assert all("--runners tvm,torch-compile,torch-eager-fp16" in c for c in benches if "--wgmma-gemm" in c)
    assert all("--runners tvm " in c for c in benches if "--wgmma-gemm" not in c)
    with tarfile.open(tmp_path / "out" / "wgmma-bench.tgz") as t:
        names = t.getnames()
    assert "bench/vit-on-bench/results.md" in names and "bench/bert-on-run.log" in names
    assert "bench/bert-on-bench/results.md" not in names


def test_wgmma_bench_builds_the_default_package_too_where_asked(tmp_path):
    """VARIANTS="off default on": a third package built with neither flag
    (the default), benched alone; "plain": one with --no-implicit-gemm; an
    unknown variant is refused in one line before anything runs."""
    log, env = _fake_deploy(tmp_path)
    env["EXTRA"] = "--implicit-gemm"
    r = subprocess.run(["bash", "scripts/gpu_wgmma.sh", "bench", "resnet50"], cwd=ROOT,
                       env={**env, "VARIANTS": "off default on"}, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    calls = log.read_text().splitlines()
    benches = [c for c in calls if c.startswith("-m deploy bench")]
    by_dir = {c.split("--workdir ")[1].split()[0].rsplit("/", 1)[1]: c for c in calls if "deploy run" in c}
    assert sorted(by_dir) == ["ws-resnet50-default", "ws-resnet50-off", "ws-resnet50-on"]
    assert "wgmma-gemm" not in by_dir["ws-resnet50-default"] and by_dir["ws-resnet50-default"].endswith(
        "--implicit-gemm")
    assert [c.split("--workdir ")[1].split()[0].rsplit("/", 1)[1] for c in benches] == \
        ["ws-resnet50-on", "ws-resnet50-off", "ws-resnet50-default"]
    log.unlink()
    # "plain": the convolutions left as convolutions (the graph the databases were tuned for), benched after on
    r = subprocess.run(["bash", "scripts/gpu_wgmma.sh", "bench", "resnet50"], cwd=ROOT,
                       env={**env, "EXTRA": "", "VARIANTS": "plain on"}, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    calls = log.read_text().splitlines()
    by_dir = {c.split("--workdir ")[1].split()[0].rsplit("/", 1)[1]: c for c in calls if "deploy run" in c}
    plain = by_dir["ws-resnet50-plain"]
    assert plain.endswith("--no-implicit-gemm") and "wgmma-gemm" not in plain
    assert [c.split("--workdir ")[1].split()[0].rsplit("/", 1)[1] for c in calls if "deploy bench" in c] == \
        ["ws-resnet50-on", "ws-resnet50-plain"]
    log.unlink()
    # PROFILE=1: each benched package's per-kernel report too, with its flags
    r = subprocess.run(["bash", "scripts/gpu_wgmma.sh", "bench", "resnet50"], cwd=ROOT,
                       env={**env, "EXTRA": "", "VARIANTS": "plain on", "PROFILE": "1"}, capture_output=True,
                       text=True, timeout=60)
    profiles = [c for c in log.read_text().splitlines() if "deploy profile" in c]
    assert r.returncode == 0 and len(profiles) == 2, r.stderr
    assert profiles[0].endswith("ws-resnet50-on --wgmma-gemm") and profiles[1].endswith("--no-implicit-gemm")
    assert "--bucket 32" in profiles[0] and "resnet50 on: bucket 32: 1.2 ms in kernels" in r.stdout
    log.unlink()
    # (with EXTRA="--implicit-gemm" plain's flag comes last, so that it wins: argparse keeps the last)
    r = subprocess.run(["bash", "scripts/gpu_wgmma.sh", "bench", "resnet50"], cwd=ROOT,
                       env={**env, "EXTRA": "--implicit-gemm", "VARIANTS": "plain"}, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and all(c.endswith("--implicit-gemm --no-implicit-gemm")
                                     for c in log.read_text().splitlines() if "deploy " in c), r.stderr
    log.unlink()
    for variants, why in [("off both", "unknown variant 'both'"), ("on on", "names a variant twice")]:
        r = subprocess.run(["bash", "scripts/gpu_wgmma.sh", "bench", "resnet50"], cwd=ROOT,
                           env={**env, "VARIANTS": variants}, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and why in r.stderr, r.stderr
        assert not log.exists()


def test_with_settings_reaches_the_processes_the_build_spawns():
    """Buckets optimized or built at once run in spawned processes, which
    run the parent's main file again as `__mp_main__` with its argv (what
    multiprocessing's spawn does, done here as it does it): a BERT A/B of
    two sequence buckets once built both variants with the rule on."""
    code = ("import runpy, sys; sys.argv = ['scripts/with_settings.py', 'simt_gemm.STAGES=2', 'run'];"
            "runpy.run_path('scripts/with_settings.py', run_name='__mp_main__');"
            "from deploy.passes import simt_gemm; print(simt_gemm.STAGES)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "2", r.stderr[-2000:]


def test_with_settings_sets_our_passes_constants_and_refuses_the_rest(tmp_path, monkeypatch):
    """scripts/with_settings.py: `module.NAME=value` under deploy.passes,
    Python literals; a name the module lacks, a module that is not there, a
    value that is not a literal, or no `=` refused; empty sets nothing."""
    import with_settings

    from deploy import config
    from deploy.passes import implicit_gemm, wgmma_gemm
    from deploy.tuning import graph

    before = (implicit_gemm.FEW_CHANNELS, wgmma_gemm.EPILOGUE, config.CONV_GEMM_BATCH)
    try:
        done = with_settings.apply("implicit_gemm.FEW_CHANNELS=0, wgmma_gemm.EPILOGUE='registers',"
                                   "config.CONV_GEMM_BATCH=1")
        assert done == [("implicit_gemm.FEW_CHANNELS", 0), ("wgmma_gemm.EPILOGUE", "registers"),
                        ("config.CONV_GEMM_BATCH", 1)]
        assert (implicit_gemm.FEW_CHANNELS, wgmma_gemm.EPILOGUE) == (0, "registers")
        # read when a database's graph is decided (tuning/graph.py): a batch-8 database without graph.json
        (tmp_path / "db" / "database_tuning_record.json").parent.mkdir()
        (tmp_path / "db" / "database_tuning_record.json").write_text("")
        assert graph.tuned_direct(tmp_path / "db", 8) is False
    finally:
        implicit_gemm.FEW_CHANNELS, wgmma_gemm.EPILOGUE, config.CONV_GEMM_BATCH = before
    assert graph.tuned_direct(tmp_path / "db", 8) is True
    assert with_settings.apply("") == []
    # deploy's own flags pass through, after the subcommand; a flag with a value or in capitals is no flag
    assert with_settings.apply("--no-implicit-gemm,implicit_gemm.FEW_CHANNELS=8") == [("implicit_gemm.FEW_CHANNELS", 8)]
    assert with_settings.flags("--no-implicit-gemm, implicit_gemm.FEW_CHANNELS=8") == ["--no-implicit-gemm"]
    for bad in ("--budget=5m", "--X"):
        with pytest.raises(ValueError):
            with_settings.apply(bad)
    seen = []
    import deploy.cli

    monkeypatch.setattr(deploy.cli, "main", lambda args: seen.append(args) or 0)
    assert with_settings.main(["--no-implicit-gemm", "run", "--model", "resnet50"]) == 0
    assert seen == [["run", "--no-implicit-gemm", "--model", "resnet50"]]
    for bad, why in [("wgmma_gemm.NOPE=1", "has no NOPE"), ("nope.X=1", "no module"),
                     ("wgmma_gemm.SMS=os.sep", "literal"),
                     ("wgmma_gemm.SMS", "not module.NAME=value"), ("SMS=1", "not module.NAME=value")]:
        with pytest.raises(ValueError, match=why):
            with_settings.apply(bad)
    r = subprocess.run([sys.executable, "scripts/with_settings.py", "wgmma_gemm.NOPE=1", "run"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "has no NOPE" in r.stderr


def test_ab_builds_each_variant_with_its_settings_then_benches_and_profiles_them(tmp_path):
    """scripts/gpu_ab.sh with a python3 that records its arguments: each
    variant built at once through with_settings.py with its settings, then
    benched and profiled one after the other, the benches tarred; a variant
    whose build fails is not benched (exit 1); bad arguments are refused in
    one line before anything runs."""
    log, env = _fake_deploy(tmp_path, fails="/nostem")
    r = subprocess.run(["bash", "scripts/gpu_ab.sh", "resnet50", "64", "new:", "reg:wgmma_gemm.EPILOGUE='registers'",
                        "nostem:implicit_gemm.FEW_CHANNELS=0"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1, r.stderr
    assert "new: | tvm | 1.0 |" in r.stdout and "reg: | tvm | 1.0 |" in r.stdout and "nostem: not benched" in r.stdout
    calls = log.read_text().splitlines()
    assert all(c.startswith("scripts/with_settings.py ") for c in calls)
    runs = [c for c in calls if " run " in c]
    assert sorted(c.split()[1] for c in runs) == ["implicit_gemm.FEW_CHANNELS=0", "run",
                                                  "wgmma_gemm.EPILOGUE='registers'"]
    assert all("--buckets 64" in c and "--trials 0" in c for c in runs)
    assert [c.split("--workdir ")[1].split()[0].rsplit("/", 1)[1] for c in calls if " bench " in c] == ["new", "reg"]
    assert len([c for c in calls if " profile " in c]) == 2
    with tarfile.open(tmp_path / "out" / "ab.tgz") as t:
        assert sorted(n for n in t.getnames() if n.endswith("results.md")) == \
            ["ab-new-bench/results.md", "ab-reg-bench/results.md"]
    for args, why in [(["resnet50", "64"], "expected MODEL BATCH"), (["resnet50", "64", "a b:x"], "is not LABEL"),
                      (["resnet50", "64", "a:", "a:x=1"], "given twice")]:
        log.unlink(missing_ok=True)
        r = subprocess.run(["bash", "scripts/gpu_ab.sh", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and why in r.stderr and not log.exists()
