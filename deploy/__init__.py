"""PyTorch -> ONNX -> TVM Relax -> tuned, shape-specialized runtime modules.

Library entry point for serving processes:

    import deploy
    predictor = deploy.load("artifacts/resnet50/.../package")
    outputs = predictor({"input": batch})       # dict of numpy arrays
"""

from .errors import DeployError


def load(package):
    """Load a package folder; see `deploy.runtime.Predictor`."""
    from .runtime import load as _load

    return _load(package)


__all__ = ["DeployError", "load"]
