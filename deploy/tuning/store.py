"""The kernel store: for each GPU, the best tuning record of every kernel any
committed database holds, shared by every model.

MetaSchedule keys a record by its workload (the structural hash of the
kernel's TIR), so a convolution tuned for one model is the same task in
another, as TensorRT's timing cache shares tactics across engines. The
store, `tuning_logs/_store/<target>/`, holds for one target (GPU model and
architecture) the fastest valid record of each workload found in the
databases made for it; `key.json` names that target, the files are a
database's (`database_*.json.xz`), and it is committed with them.

- `refresh` rebuilds it from the databases: at the end of every tuning run
  and by `python -m deploy pack-databases`. Rebuilt, not appended to, so a
  database that is removed takes its records out of the store.
- A build (`build.build_bucket`, through `lines_for`) applies, for each
  kernel, the fastest record of its own database and the store together, so
  a kernel that another model tuned is tuned here too.
- A tuning run (`database.open_for_tuning`) seeds each task's search and the
  cost model with the store's record of that task, marked as seeded so that
  it is never packed into the model's own database.
"""

from __future__ import annotations

import fcntl
import json
import logging
from pathlib import Path

from .. import artifacts
from ..targets import TargetInfo
from . import database as dbs

log = logging.getLogger(__name__)
STORE = "_store"


def folder(root: Path, target: TargetInfo) -> Path:
    return Path(root) / STORE / target.slug


def _key(target_key: dict) -> dict:
    return {"store": "best record of each workload, every database of this target", "target": target_key}


def databases(root: Path) -> list[tuple[Path, dict]]:
    """Every database under `root` (not the stores), with its key."""
    out = []
    for k in sorted(Path(root).rglob(dbs.KEY_FILE)):
        rel = k.parent.relative_to(root).parts
        if not rel or rel[0] == STORE or dbs.lane_owner(k.parent) is not None:
            continue
        try:
            out.append((k.parent, json.loads(k.read_text())))
        except json.JSONDecodeError:
            log.warning("store: %s has a corrupt key; left out", k)
    return out


def _best(groups: list[tuple[list[str], list[str]]]) -> tuple[list[str], list[str]]:
    """The fastest valid record of each workload over several databases'
    (workload lines, record lines), workloads in structural-hash order so a
    rebuilt store differs from the last only where a record changed."""
    best: dict[str, tuple[float, str, list]] = {}
    for workloads, records in groups:
        for ln in records:
            wi, rec = json.loads(ln)
            secs = dbs._mean_secs(rec)
            if secs == float("inf"):
                continue
            wl = workloads[wi]
            shash = json.loads(wl)[0]
            if shash not in best or secs < best[shash][0]:
                best[shash] = (secs, wl, rec)
    order = sorted(best)
    workloads = [best[s][1] for s in order]
    records = [json.dumps([i, best[s][2]], separators=(",", ":")) for i, s in enumerate(order)]
    return workloads, records


def refresh(root: Path, only: dict | None = None) -> dict[str, int]:
    """Rebuild the store of every target with a database under `root` (or
    only of the target whose key is `only`); returns {store folder: kernels}.
    Each database is read whole (compressed files, working copy, journal)
    and left as it is: another run may be tuning into it right now, and
    packing would take its working copy from under it."""
    groups: dict[str, list[Path]] = {}
    keys: dict[str, dict] = {}
    for db, key in databases(root):
        t = key.get("target")
        if not t or (only is not None and t != only):
            continue
        tkey = json.dumps(t, sort_keys=True)
        groups.setdefault(tkey, []).append(db)
        keys[tkey] = t
    out = {}
    for tkey, folders in groups.items():
        # the store's folder is named as each of its databases' target folder is
        dest = Path(root) / STORE / folders[0].parent.name
        dest.mkdir(parents=True, exist_ok=True)
        with open(dest / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # two runs ending at once write one after the other
            have = dest / dbs.KEY_FILE
            if have.is_file() and json.loads(have.read_text()) != _key(keys[tkey]):
                log.warning("store: %s holds another target's records; left as it is", dest)
                continue
            workloads, records = _best([dbs._all_lines(db, slower_than_default=True) for db in folders])
            artifacts.write_json_atomic(have, _key(keys[tkey]))
            dbs._write_packed(dest / (dbs.WORKLOADS + dbs.PACKED), workloads)
            dbs._write_packed(dest / (dbs.RECORDS + dbs.PACKED), records)
        out[str(dest)] = len(records)  # (the lock file stays: removed, a waiting run would lock a file no one else sees)
    return out


def lines_for(root: Path, target: TargetInfo, shashes: set[str] | None = None) -> tuple[list[str], list[str]]:
    """The store's (workload lines, record lines) for `target`, limited to
    the workloads whose structural hash is in `shashes`; empty when there is
    no store for this exact target."""
    dest = folder(root, target)
    key_file = dest / dbs.KEY_FILE
    if not key_file.is_file():
        return [], []
    if json.loads(key_file.read_text()) != _key(target.key()):
        log.info("store: %s was made for another target; not used", dest)
        return [], []
    workloads, records = dbs._all_lines(dest)
    if shashes is None:
        return workloads, records
    keep_w = [i for i, wl in enumerate(workloads) if json.loads(wl)[0] in shashes]
    index = {old: new for new, old in enumerate(keep_w)}
    out = []
    for ln in records:
        wi, rec = json.loads(ln)
        if wi in index:
            out.append(json.dumps([index[wi], rec], separators=(",", ":")))
    return [workloads[i] for i in keep_w], out


def digest(root: Path, target: TargetInfo) -> str | None:
    dest = folder(root, target)
    return dbs.digest(dest) if (dest / dbs.KEY_FILE).is_file() else None


def module_hashes(mod, tvm_target) -> set[str]:
    """The workload hashes of a Relax module's kernels, as a build queries them."""
    from ..tvm_compat import ms

    return workload_hashes(t.dispatched[0] for t in ms.relax_integration.extract_tasks(mod, tvm_target))


def workload_hashes(task_mods) -> set[str]:
    """MetaSchedule's structural hash of each task's module, as its database
    keys the task."""
    from ..tvm_compat import ms

    return {ms.database.Workload(m).as_json()[0] for m in task_mods}
