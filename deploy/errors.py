"""User-facing errors.

Anything derived from `DeployError` is a problem with the user's input or
environment: the CLI prints it as one line ("what | got | expected") and exits
non-zero. Every other exception is a bug and keeps its traceback.
"""

from __future__ import annotations


class DeployError(Exception):
    """Base class of every error the user can fix."""

    exit_code = 2

    def __init__(self, what: str, got: object | None = None, expected: object | None = None):
        self.what, self.got, self.expected = what, got, expected
        parts = [what]
        if got is not None:
            parts.append(f"got {got}")
        if expected is not None:
            parts.append(f"expected {expected}")
        super().__init__(" | ".join(parts))


class ConfigError(DeployError):
    """A config file, key, value or command-line override is invalid."""


class InputFileError(DeployError):
    """A file the user pointed at is missing, unreadable or corrupt."""


class UnsupportedOperatorError(DeployError):
    """The ONNX graph uses operators the TVM frontend cannot import."""


class ShapeError(DeployError):
    """Input names, shapes or dtypes do not match what the model expects."""


class StaleArtifactError(DeployError):
    """An artifact on disk is incomplete, tampered with, or made for something else."""


class DatabaseMismatchError(StaleArtifactError):
    """A tuning database was made for another model, shape, precision, target or GPU."""


class ToleranceError(DeployError):
    """Compiled outputs differ from the reference beyond the configured tolerance."""


class TargetError(DeployError):
    """The requested target or device is not available here."""
