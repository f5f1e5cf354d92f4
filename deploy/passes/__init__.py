"""Our own Relax and TIR passes, and every workaround of a TVM defect.

Each module's docstring names what it does and, for a workaround, the
upstream symptom it works around, the kernels it is scoped to, and the test
that fails once TVM no longer needs it.
"""
