"""deploy.tvm_compat: what it works around still needs working around, and
the workaround changes nothing but the time it takes."""

from __future__ import annotations

import json
import subprocess
import sys

# Registers TVM's tensor intrinsics one way or the other in a fresh process
# and prints, for each registered name, the structural hashes of its
# description and implementation.
_REGISTER = """
import json, sys, time
from deploy.tvm_compat import structural_hash
from tvm.s_tir import TensorIntrin
seen = {}
real = TensorIntrin.register
def record(name, desc, impl, override=False):
    seen[name] = [str(structural_hash(desc)), str(structural_hash(impl))]
    return real(name, desc, impl, override)
TensorIntrin.register = staticmethod(record)
t0 = time.time()
if sys.argv[1] == "ours":
    from deploy.tvm_compat import register_tensor_intrinsics
    register_tensor_intrinsics()
else:
    import tvm.s_tir.tensor_intrin
print(json.dumps({"seconds": time.time() - t0, "intrinsics": seen}))
"""


def _register(how: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _REGISTER, how], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_tensor_intrinsics_register_the_same_with_frames_from_linecache():
    """register_tensor_intrinsics() reads stack frames from linecache while
    it imports TVM's intrinsics: the same intrinsics, structurally equal,
    and our TF32 ones (passes/tf32.py) beside them."""
    from deploy.passes import tf32

    ours, plain = _register("ours"), _register("plain")
    assert len(plain["intrinsics"]) > 100
    own = {tf32.A_LDMATRIX, tf32.B_NK_LDMATRIX, tf32.B_KN_LOAD, tf32.MMA}
    assert {k: v for k, v in ours["intrinsics"].items() if k not in own} == plain["intrinsics"]
    assert own <= set(ours["intrinsics"])
    assert ours["seconds"] < plain["seconds"] / 3  # (the fast path was taken: 1.6 against 20 s on the CPU machine)


def test_tvmscript_still_inspects_the_stack_for_every_prim_func():
    """The workaround's cause: once TVMScript's prim_func no longer calls
    inspect.stack() (what made importing the intrinsics take 20-70 s), this
    fails, and register_tensor_intrinsics can import them plainly."""
    import inspect

    from tvm.tirx.script.parser import entry

    assert "inspect.stack()" in inspect.getsource(entry.prim_func)
