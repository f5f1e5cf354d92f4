"""deploy's command line with some of our passes' module constants set
first, for A/B measurements of one change in the same code
(scripts/gpu_ab.sh): the build runs in this process, so the passes read
the values set here.

    python3 scripts/with_settings.py "wgmma_gemm.EPILOGUE='registers',implicit_gemm.FEW_CHANNELS=0" run ...

SETTINGS: comma-separated `module.NAME=value` under deploy.passes (or
`config.NAME=value`: deploy.config, the build profile's defaults, e.g.
`config.CONV_GEMM_BATCH=1`: older databases then count as tuned on
implicit GEMMs, tuning/graph.py), each value a Python literal without a
comma, or a flag of deploy's command line without a value (`--no-implicit-gemm`:
given to the subcommand); empty: the code as it is. A name
the module does not have is refused (exit 2, one line). Only what the
passes read when they run is reached: a constant another module copied
at import (`wgmma_gemm.SHARED_MEMORY` from mma_gemm's table) or a
function took as a default argument keeps its value. Processes the build
spawns (several buckets optimized or built at once) get the settings too:
spawn runs this file again in each, as `__mp_main__`."""

from __future__ import annotations

import ast
import importlib
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _is_flag(item: str) -> bool:
    return re.fullmatch(r"--[a-z0-9][a-z0-9-]*", item) is not None


def flags(settings: str) -> list[str]:
    """The command-line flags among `settings` (`--name`, no value)."""
    return [s.strip() for s in settings.split(",") if _is_flag(s.strip())]


def apply(settings: str) -> list[tuple[str, object]]:
    """Sets each `module.NAME=value` of `settings` (its flags are left to
    `flags`); returns what was set. Raises ValueError on a setting that is
    not one."""
    done = []
    for item in filter(None, (s.strip() for s in settings.split(","))):
        if _is_flag(item):
            continue
        key, eq, text = item.partition("=")
        module, dot, name = key.rpartition(".")
        if not eq or not dot:
            raise ValueError(f"{item!r} is not module.NAME=value")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            raise ValueError(f"{item!r}: {text!r} is not a Python literal") from None
        path = "deploy.config" if module == "config" else f"deploy.passes.{module}"
        try:
            m = importlib.import_module(path)
        except ImportError:
            raise ValueError(f"{item!r}: no module {path}") from None
        if not hasattr(m, name):
            raise ValueError(f"{item!r}: {path} has no {name}")
        setattr(m, name, value)
        done.append((key, value))
    return done


def main(argv: list[str]) -> int:
    if not argv:
        print("error: expected SETTINGS then deploy's arguments | e.g. \"implicit_gemm.FEW_CHANNELS=0\" run ...",
              file=sys.stderr)
        return 2
    try:
        apply(argv[0])
    except ValueError as e:
        print(f"error: {e} | settings are comma-separated module.NAME=value under deploy.passes, config.NAME=value, "
              "or --flags of deploy's command line", file=sys.stderr)
        return 2
    from deploy.cli import main as deploy

    args = argv[1:]
    return deploy([*args[:1], *flags(argv[0]), *args[1:]])  # (the flags after the subcommand)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
if __name__ == "__mp_main__" and len(sys.argv) > 1:
    # A process the build spawned (buckets optimized or built at once): multiprocessing's spawn runs the
    # parent's main file again under this name, with its argv: the same settings here too.
    apply(sys.argv[1])
