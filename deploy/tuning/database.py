"""Tuning databases: where MetaSchedule's records live, how they are keyed,
and how they are stored.

A database folder, `tuning_logs/<model>/<target>-<gpu>/<variant>/`, holds
  key.json                           what it was tuned for (model, input shapes,
                                     precision, accumulation, layout, target/GPU);
                                     a different key is refused
  database_workload.json.xz          TVM's JSONDatabase files, xz-compressed:
  database_tuning_record.json.xz     the committed form
  graph.json                         the graph it was first tuned on (tuning/graph.py)
A record is 35-47 KB of JSON (tensorized traces embed layout maps), so a
fully tuned ResNet-50 is ~70 MB as plain JSON; the records repeat each other
so much that xz keeps it to a few hundred KB (430x on a real database).

While a run tunes, the plain files `database_*.json` (git-ignored) are the
working copy, which MetaSchedule appends to when it saves a batch, and
`database_measured.jsonl` the journal (`journal`), which holds each
candidate from the moment it is measured, so a run killed outright loses
nothing already measured. `pack` folds a working copy and a journal into the
compressed files (a union: records already there are kept, new ones
appended) and removes them; it runs when a tuning run ends, and before any
open, so what a killed run left is folded in the next time. Packing needs
no TVM: it works on the JSON lines.
"""

from __future__ import annotations

import contextlib
import json
import logging
import lzma
import shutil
import tempfile
from pathlib import Path

from .. import artifacts
from ..config import InputSpec, Profile
from ..errors import DatabaseMismatchError, StaleArtifactError
from ..shapes import as_bucket, input_specs
from ..targets import TargetInfo
from . import check as kernel_check
from . import journal

log = logging.getLogger(__name__)
KEY_FILE = "key.json"
WORKLOADS = "database_workload.json"
RECORDS = "database_tuning_record.json"
PACKED = ".xz"
FAILED_SECS = 1e9  # MetaSchedule stores 1e10 s for a candidate that failed
SEEDED = "database_seeded.json"  # the working copy's records that came from the kernel store


def database_key(model: str, inputs: tuple[InputSpec, ...], bucket, profile: Profile, target: TargetInfo,
                 dims: tuple = ()) -> dict:
    """The key of one bucket's database (`bucket`: a shapes.Bucket or a
    batch size; `dims`: the model's dimensions besides the batch, whose
    lengths in the bucket replace the inputs' own)."""
    bucket = as_bucket(bucket)
    key = {
        "model": model,
        "inputs": [{"name": i.name, "shape": [bucket.batch, *i.shape], "dtype": i.dtype}
                   for i in input_specs(inputs, dims, bucket)],
        "precision": profile.precision,
        "accumulate": profile.accumulate if profile.precision == "fp16" else "fp32",
        "layout": profile.layout,
        "target": target.key(),
    }
    if bucket.dims:  # (absent for batch-only buckets: their keys are what they always were)
        key["dims"] = dict(bucket.dims)
    return key


def database_dir(root: Path, key: dict, target: TargetInfo) -> Path:
    """A readable label; `key.json` inside is what is checked."""
    acc = "-acc16" if key["accumulate"] == "fp16" and key["precision"] == "fp16" else ""
    batch = key["inputs"][0]["shape"][0]
    dims = "".join(f"-{n}{v}" for n, v in key.get("dims", {}).items())
    return Path(root) / key["model"] / target.slug / f"{key['precision']}{acc}-{key['layout'].lower()}-b{batch}{dims}"


def check_key(folder: Path, key: dict) -> None:
    path = Path(folder) / KEY_FILE
    if not path.is_file():
        return
    try:
        have = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DatabaseMismatchError(f"tuning database key is corrupt: {path}", str(e)) from None
    diffs = [k for k in sorted(set(key) | set(have)) if key.get(k) != have.get(k)]
    if diffs:
        k = diffs[0]
        raise DatabaseMismatchError(
            f"tuning database {folder} was made for another {', '.join(diffs)}", have.get(k), key.get(k)
        )


# ------------------------------------------------------------ JSON lines ---


def repair_jsonl(path: Path, only_last: bool = False) -> int:
    """Drop lines that do not parse (a write cut short by a kill) and end the
    file with a newline, so the next append starts a line of its own; returns
    the number of lines dropped. With `only_last`, only a torn final line may
    go: a bad line before it would shift the line numbers records refer to.
    The file is rewritten atomically."""
    if not path.is_file():
        return 0
    text = path.read_text()
    lines = text.splitlines()
    good = []
    for i, line in enumerate(lines):
        try:
            json.loads(line)
            good.append(line)
        except json.JSONDecodeError:
            if only_last and i != len(lines) - 1:
                raise StaleArtifactError(f"tuning database file {path} has an unreadable line {i + 1}") from None
    dropped = len(lines) - len(good)
    if dropped or (text and not text.endswith("\n")):
        artifacts.write_atomic(path, "".join(line + "\n" for line in good))
    if dropped:
        log.warning("tune: dropped %d unreadable line(s) from %s (an interrupted write)", dropped, path)
    return dropped


def _packed_lines(path: Path) -> list[str]:
    if not path.is_file():
        return []
    try:
        text = lzma.decompress(path.read_bytes()).decode()
    except (lzma.LZMAError, UnicodeDecodeError) as e:
        raise StaleArtifactError(f"tuning database file {path} is corrupt", str(e)) from None
    return [ln for ln in text.splitlines() if ln.strip()]


def _write_packed(path: Path, lines: list[str]) -> None:
    artifacts.write_atomic(path, lzma.compress("".join(ln + "\n" for ln in lines).encode(), preset=6))


def merge(base: tuple[list[str], list[str]], extra: tuple[list[str], list[str]]) -> tuple[list[str], list[str], int]:
    """Union of two databases given as (workload lines, record lines).
    A record line is `[workload index, record]`; records of `extra` are
    re-indexed onto the merged workloads and appended unless `base` already
    has the same record. Base lines keep their order and indices, so a
    reader of the base sees a prefix of the result. Returns the merged
    lines and the number of records added."""
    workloads = list(base[0])
    index = {ln: i for i, ln in enumerate(workloads)}
    seen = set()
    for ln in base[1]:
        wi, rec = json.loads(ln)
        seen.add((workloads[wi], json.dumps(rec)))
    records = list(base[1])
    added = 0
    for ln in extra[1]:
        wi, rec = json.loads(ln)
        wl = extra[0][wi]
        if (wl, json.dumps(rec)) in seen:
            continue
        if wl not in index:
            index[wl] = len(workloads)
            workloads.append(wl)
        seen.add((wl, json.dumps(rec)))
        records.append(json.dumps([index[wl], rec], separators=(",", ":")))
        added += 1
    return workloads, records, added


def lane_dir(folder: Path, lane: int) -> Path:
    """Where tuning lane `lane` of a run on `folder` keeps its database: beside
    it (hidden, git-ignored), not in the run's staging folder, so that what a
    lane measured survives its parent being killed; `pack` folds it in."""
    folder = Path(folder)
    return folder.parent / f".{folder.name}.lane-{lane}"


def lane_dirs(folder: Path) -> list[Path]:
    folder = Path(folder)
    return sorted(d for d in folder.parent.glob(f".{folder.name}.lane-*") if d.is_dir())


def lane_owner(folder: Path) -> Path | None:
    """The database a lane folder belongs to, or None for a database."""
    folder = Path(folder)
    if folder.name.startswith(".") and ".lane-" in folder.name:
        return folder.parent / folder.name[1:].rsplit(".lane-", 1)[0]
    return None


def pack(folder: Path) -> int:
    """Fold the working copy (plain JSON) and every tuning lane's database
    (`lane_dir`: its working copy, and compressed files if it has any) into
    the compressed files, in one write, then remove them; returns the number
    of records added. A lane made for another key is refused before anything
    is written. The workload file is replaced first: it only ever grows at
    its end, so the old record file stays valid against it if the second
    write never happens."""
    folder = Path(folder)
    lanes = [d for d in lane_dirs(folder) if has_records(d)]
    for lane in lanes:
        if (lane / KEY_FILE).is_file():
            key = json.loads((lane / KEY_FILE).read_text())
            check_key(folder, key)
            folder.mkdir(parents=True, exist_ok=True)
            if not (folder / KEY_FILE).is_file():
                artifacts.write_json_atomic(folder / KEY_FILE, key)
    added = 0
    if (folder / WORKLOADS).is_file() or (folder / RECORDS).is_file() or (folder / journal.MEASURED).is_file() or lanes:
        base = tuple(_packed_lines(folder / (name + PACKED)) for name in (WORKLOADS, RECORDS))
        for src in (folder, *lanes):
            repair_jsonl(src / WORKLOADS, only_last=True)
            repair_jsonl(src / RECORDS)
        workloads, records, added = merge(base, _working_lines(folder))
        for lane in lanes:
            workloads, records, n = merge((workloads, records), _all_lines(lane))
            added += n
        workloads, records, n = journal.fold(workloads, records, folder / journal.MEASURED)
        added += n
        if added:
            _write_packed(folder / (WORKLOADS + PACKED), workloads)
            _write_packed(folder / (RECORDS + PACKED), records)
    for name in (WORKLOADS, RECORDS, journal.MEASURED, SEEDED):
        (folder / name).unlink(missing_ok=True)
    for lane in lane_dirs(folder):
        if lane in lanes or not has_records(lane):
            shutil.rmtree(lane)
    return added


def _working_lines(folder: Path) -> tuple[list[str], list[str]]:
    """The working copy's workload and record lines (empty when absent),
    less the records seeded from the kernel store (`SEEDED`): another
    model's, never this database's own."""
    workloads, records = (
        [ln for ln in p.read_text().splitlines() if ln.strip()] if p.is_file() else []
        for p in (folder / WORKLOADS, folder / RECORDS)
    )
    seeded = folder / SEEDED
    if seeded.is_file():
        drop = set(json.loads(seeded.read_text()))
        records = [ln for ln in records if ln not in drop]
    return workloads, records


def has_records(folder: Path) -> bool:
    folder = Path(folder)
    return any((d / n).is_file() for d in (folder, *lane_dirs(folder))
               for n in (RECORDS, RECORDS + PACKED, journal.MEASURED))


def _all_lines(folder: Path, slower_than_default: bool = False, keep_rejected: bool = False
               ) -> tuple[list[str], list[str]]:
    """Every workload and record: the compressed files plus any working copy
    and journal, less those check.drop_rejected drops (`slower_than_default`:
    see there), unless `keep_rejected`."""
    workloads, records = tuple(_packed_lines(folder / (name + PACKED)) for name in (WORKLOADS, RECORDS))
    if (folder / RECORDS).is_file():
        try:
            workloads, records, _ = merge((workloads, records), _working_lines(folder))
        except (json.JSONDecodeError, IndexError):  # a torn line being written: count what is packed
            pass
    workloads, records, _ = journal.fold(workloads, records, folder / journal.MEASURED)
    if keep_rejected:
        return workloads, records
    return workloads, kernel_check.drop_rejected(folder, workloads, records, slower_than_default)


def _mean_secs(rec: list) -> float:
    secs = [float(x) for x in (rec[1] if len(rec) > 1 and rec[1] else [])]
    mean = sum(secs) / len(secs) if secs else float("inf")
    return mean if mean < FAILED_SECS else float("inf")


def _best_per_workload(records: list[str], top_k: int) -> list[str]:
    """The `top_k` fastest records of each workload (failed ones last), in
    their original order. MetaSchedule parses every record it is given
    (~20 ms each, with their layout maps), so a build gets only the best one
    and a tuning run only what its search seeds from."""
    by_wl: dict[int, list[tuple[float, int]]] = {}
    for i, ln in enumerate(records):
        wi, rec = json.loads(ln)
        by_wl.setdefault(wi, []).append((_mean_secs(rec), i))
    keep = sorted(i for items in by_wl.values() for _, i in sorted(items)[:top_k])
    return [records[i] for i in keep]


def _expand(folder: Path, dest: Path, top_k: int | None = None, extra: tuple[list[str], list[str]] | None = None
            ) -> list[str]:
    """Write `folder`'s records (the best `top_k` of each workload) as a
    plain JSON database into `dest`, with `extra` (workload and record
    lines, the kernel store's) added where they are not already there;
    returns the record lines that came from `extra`."""
    workloads, records = _best_lines(folder, top_k)
    return _write_plain(dest, workloads, records, extra)


def _best_lines(folder: Path, top_k: int | None, slower_than_default: bool = False) -> tuple[list[str], list[str]]:
    """`folder`'s packed workload lines and the best `top_k` records of each
    workload (all of them with None); `slower_than_default`: see
    check.drop_rejected."""
    workloads = _packed_lines(folder / (WORKLOADS + PACKED))
    records = kernel_check.drop_rejected(folder, workloads, _packed_lines(folder / (RECORDS + PACKED)),
                                         slower_than_default)
    if top_k is not None:
        records = _best_per_workload(records, top_k)
    return workloads, records


def hashes_of(lines: tuple[list[str], list[str]]) -> set[str]:
    """The workloads (structural hashes) that have a record among (workload lines, record lines)."""
    workloads, records = lines
    return {json.loads(workloads[json.loads(ln)[0]])[0] for ln in records}


def _write_plain(dest: Path, workloads: list[str], records: list[str],
                 extra: tuple[list[str], list[str]] | None) -> list[str]:
    """A plain JSON database in `dest`: the given lines, with `extra` added
    where not already there; returns the record lines that came from `extra`."""
    added: list[str] = []
    if extra is not None and extra[1]:
        n = len(records)
        workloads, records, _ = merge((workloads, records), extra)
        added = records[n:]
    (dest / WORKLOADS).write_text("".join(ln + "\n" for ln in workloads))
    (dest / RECORDS).write_text("".join(ln + "\n" for ln in records))
    return added


def _json_database(folder: Path, label: Path | None = None):
    from ..tvm_compat import ms, register_tensor_intrinsics

    # Records of tensorized schedules name TVM's tensor intrinsics, which
    # must be registered before the records are parsed (20-70 s on a small
    # machine: skipped when there is no record to parse).
    records = folder / RECORDS
    if records.is_file() and records.stat().st_size:
        register_tensor_intrinsics()

    def load():
        return ms.database.JSONDatabase(
            path_workload=str(folder / WORKLOADS), path_tuning_record=str(folder / RECORDS), allow_missing=True
        )

    try:
        return load()
    except Exception:  # one unreadable record fails TVM's whole load: leave such records out, keep the rest
        bad = drop_unreadable(folder)
        if not bad:
            raise
        log.warning("tuning database %s: %d record(s) do not replay on their kernel (%s), left out",
                    label or folder, sum(bad.values()), ", ".join(f"workload {h}: {n}" for h, n in sorted(bad.items())))
        return load()


def drop_unreadable(folder: Path) -> dict[str, int]:
    """Rewrite the plain database files at `folder` without the records
    whose trace does not replay on their workload (filed under a workload
    whose names differ from the module they were tuned on; see
    tasks.stored_module); returns {workload hash: records dropped}."""
    from ..tvm_compat import ms, register_tensor_intrinsics

    register_tensor_intrinsics()  # (tensor-core traces name TVM's intrinsics)
    path = folder / RECORDS
    workloads = [ln for ln in (folder / WORKLOADS).read_text().splitlines() if ln.strip()]
    parsed: dict[int, object] = {}
    kept, bad = [], {}
    for ln in path.read_text().splitlines():
        if not ln.strip():
            continue
        try:
            wi, rec = json.loads(ln)
            if wi not in parsed:
                parsed[wi] = ms.database.Workload.from_json(json.loads(workloads[wi]))
            ms.database.TuningRecord.from_json(rec, parsed[wi])
            kept.append(ln)
        except Exception:  # noqa: BLE001 - what does not parse is what TVM's load fails on
            try:
                h = json.loads(workloads[json.loads(ln)[0]])[0]
            except Exception:  # noqa: BLE001
                h = "?"
            bad[h] = bad.get(h, 0) + 1
    if bad:
        artifacts.write_atomic(path, "".join(ln + "\n" for ln in kept))
    return bad


# The evolutionary search seeds each generation with up to 20% of its
# population from the best records of the task (51 of 256): 64 covers it.
SEED_RECORDS = 64


def open_for_tuning(folder: Path, key: dict, seed_records: int = SEED_RECORDS, seed_from: Path | None = None,
                    store: tuple[list[str], list[str]] | None = None):
    """The database to tune into: a working copy holding every workload and
    the best `seed_records` records of each (after folding in any copy a
    killed run left), and the kernel store's records of the tasks (`store`,
    workload and record lines: other models' kernels that are the same
    task), which seed the search and the cost model and are never packed
    into this database (`SEEDED`). New records are appended to it; call
    `pack(folder)` when tuning ends, which adds them to the full compressed
    files. A tuning lane's folder (`lane_dir`) is seeded from its run's
    packed database `seed_from` instead: it holds only that working copy,
    which the run's `pack` folds in."""
    folder = Path(folder)
    check_key(folder, key)
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / KEY_FILE).is_file():
        artifacts.write_json_atomic(folder / KEY_FILE, key)
    if seed_from is None:
        pack(folder)
    seeded = _expand(Path(seed_from) if seed_from is not None else folder, folder, seed_records, store)
    if seeded:
        artifacts.write_json_atomic(folder / SEEDED, seeded)
        log.info("tune: %d record(s) of the kernel store seed %s", len(seeded), folder.name)
    return _json_database(folder)


@contextlib.contextmanager
def open_readonly(folder: Path | None, key: dict | None, store: tuple[list[str], list[str]] | None = None,
                  own_kernels: set[str] | None = None, store_kernels: set[str] | None = None):
    """Yield a JSONDatabase with the best record of each workload (what a
    build applies) of the database at `folder` (None: no database of its
    own) and the kernel store's records `store`, or None when neither has a
    record. `own_kernels` and `store_kernels`, when given, receive the
    workloads that the database, and the store less what the database's
    check left to default schedules, give a record."""
    if folder is not None:
        folder = Path(folder)
        check_key(folder, key)
        if has_records(folder):
            pack(folder)  # records a killed run left behind (working copy, journal, lanes)
    own = folder is not None and (folder / (RECORDS + PACKED)).is_file()
    if not own and not (store and store[1]):
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="tvm-deploy-db-") as tmp:
        # A kernel whose default schedule beat its tuned one keeps the default
        # (check.py): left out of the database and of the store's records alike.
        workloads, records = _best_lines(folder, 1, slower_than_default=True) if own else ([], [])
        if own_kernels is not None:
            own_kernels |= hashes_of((workloads, records))
        if own and store and store[1]:
            store = (store[0], kernel_check.drop_rejected(folder, store[0], store[1], slower_than_default=True))
        if store_kernels is not None and store:
            store_kernels |= hashes_of(store)
        _write_plain(Path(tmp), workloads, records, store)
        yield _json_database(Path(tmp), folder)


def digest(folder: Path) -> str:
    """Identifies the committed content: key and compressed files."""
    folder = Path(folder)
    names = (KEY_FILE, WORKLOADS + PACKED, RECORDS + PACKED)
    parts = [artifacts.sha256_file(folder / f) if (folder / f).is_file() else "-" for f in names]
    return artifacts.sha256_bytes("/".join(parts).encode())


def trials_done(folder: Path, task_mods: list) -> list[tuple[int, float | None]]:
    """For each task: (records in the database, best latency in seconds or
    None), over every record (compressed files and working copy), not only
    those a tuning run was given. Workloads are matched by structural hash,
    as MetaSchedule's database matches them."""
    from ..tvm_compat import ms

    workloads, records = _all_lines(Path(folder))
    shash_of = [json.loads(ln)[0] for ln in workloads]
    stats: dict[str, list] = {}
    for ln in records:
        wi, rec = json.loads(ln)
        st = stats.setdefault(shash_of[wi], [0, float("inf")])
        st[0] += 1
        st[1] = min(st[1], _mean_secs(rec))
    out = []
    for mod in task_mods:
        n, best = stats.get(ms.database.Workload(mod).as_json()[0], (0, float("inf")))
        out.append((n, None if best == float("inf") else best))
    return out


def marked(folder: Path, task_mods: list, markers: list[str]) -> list[set]:
    """For each task: which of `markers` (strings, e.g. passes/mma_gemm.py's
    configuration names) appear in any of its records: valid, failed, or
    rejected by the kernel check."""
    from ..tvm_compat import ms

    workloads, records = _all_lines(Path(folder), keep_rejected=True)
    shash_of = [json.loads(ln)[0] for ln in workloads]
    found: dict[str, set] = {}
    for ln in records:
        hits = {m for m in markers if m in ln}
        if hits:
            found.setdefault(shash_of[json.loads(ln)[0]], set()).update(hits)
    return [found.get(ms.database.Workload(mod).as_json()[0], set()) for mod in task_mods]
