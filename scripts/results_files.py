"""The results folder the measuring scripts here write: results.json (every
number) and results.md (the table, also printed)."""

from __future__ import annotations

from pathlib import Path


def write(out: str | Path, report: dict, lines: list[str]) -> int:
    from deploy import artifacts

    dest = Path(out)
    dest.mkdir(parents=True, exist_ok=True)
    artifacts.write_json_atomic(dest / "results.json", report)
    text = "\n".join(lines) + "\n"
    (dest / "results.md").write_text(text)
    print(text, end="")
    return 0
