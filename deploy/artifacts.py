"""Artifacts on disk: each stage writes into a temporary folder, writes its
`manifest.json` last, then renames the folder into place. No manifest means the
stage did not finish; a file whose sha256 differs from the manifest's means the
artifact was changed after the fact."""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path

from .errors import ConfigError, StaleArtifactError

# The checkout this package runs from (configs/, tuning_logs/, results/ are in it).
REPO_ROOT = Path(__file__).resolve().parent.parent
MANIFEST = "manifest.json"
FORMAT = 1


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_atomic(path: str | Path, data: bytes | str) -> None:
    """`data` written to a hidden file beside `path`, then renamed over it:
    a reader sees the old file or the new one, never a part."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    if isinstance(data, str):
        tmp.write_text(data)
    else:
        tmp.write_bytes(data)
    os.replace(tmp, path)


def write_json_atomic(path: str | Path, data) -> None:
    write_atomic(path, json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")


@contextlib.contextmanager
def staged_dir(final: str | Path):
    """Yield an empty temporary folder beside `final`; when the block ends
    without an exception it replaces `final` in one rename, otherwise it is
    removed and `final` is left as it was."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if final.exists():
        old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(final, old)
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_manifest(folder: str | Path, stage: str, data: dict, files: list[str] | None = None) -> dict:
    """Write `manifest.json` (last) with the sha256 of every file listed."""
    from .tvm_compat import versions

    folder = Path(folder)
    if files is None:
        files = sorted(
            str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST
        )
    manifest = {
        "stage": stage,
        "format": FORMAT,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "versions": versions(),
        **data,
        "files": {f: sha256_file(folder / f) for f in files},
    }
    write_json_atomic(folder / MANIFEST, manifest)
    return manifest


def read_manifest(folder: str | Path, stage: str, verify: bool = True) -> dict:
    folder = Path(folder)
    path = folder / MANIFEST
    if not folder.is_dir():
        raise StaleArtifactError(f"no {stage} artifact", str(folder), f"a folder written by the {stage} stage (run it first)")
    if not path.is_file():
        raise StaleArtifactError(f"{stage} artifact has no manifest (the stage did not finish)", str(folder))
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise StaleArtifactError(f"{stage} manifest is corrupt", f"{path}: {e}") from None
    if manifest.get("stage") != stage:
        raise StaleArtifactError(f"{folder} holds the wrong artifact", manifest.get("stage"), stage)
    if manifest.get("format") != FORMAT:
        raise StaleArtifactError(f"{stage} manifest format is unsupported", manifest.get("format"), FORMAT)
    if verify:
        verify_files(folder, manifest)
    return manifest


def check_replaceable(folder: str | Path, stage: str) -> None:
    """A results folder about to be replaced must be one `stage` wrote (its
    manifest says so): never replace a folder of the user's by mistake."""
    folder = Path(folder)
    if not folder.exists():
        return
    try:
        read_manifest(folder, stage, verify=False)
    except (StaleArtifactError, OSError, ValueError):
        raise ConfigError(f"the results folder exists and was not written by {stage} (it would be replaced)",
                          str(folder), "a new folder (--out)") from None


def verify_files(folder: Path, manifest: dict) -> None:
    bad = []
    for rel, digest in manifest.get("files", {}).items():
        p = folder / rel
        if not p.is_file():
            bad.append(f"{rel} (missing)")
        elif sha256_file(p) != digest:
            bad.append(f"{rel} (sha256 differs)")
    if bad:
        raise StaleArtifactError(
            f"{manifest.get('stage')} artifact in {folder} does not match its manifest", ", ".join(bad)
        )
