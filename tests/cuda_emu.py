"""An interpreter for the CUDA kernels TVM generates for our schedules, on the CPU.

Executes the kernel statement by statement for ALL threads of one block at once
(vectorised over threads, per-thread active masks for divergent `if`s).  Every
variable is memory: shared (one byte array per block for the static and for the
dynamic buffer), per-thread local (one byte array of shape [T, n] per declared
local), global (one byte array per tensor).  Pointers carry (space, buffer, byte
offset per thread, element type); loads/stores go through the bytes, so the
casts / aliasing of the source are honoured literally.

Checks: out-of-range accesses (shared / global / local), misaligned ones
(shared / global: an access of N bytes at an address not a multiple of N,
up to 16), reads of never-written
bytes (shared, local), cross-warp shared-memory races within a barrier interval
(RAW, WAR, WAW), cross-lane same-warp hazards (reported separately), ldmatrix
alignment, warp-collective ops under a partial mask.

Scope: the C that TVM 0.27 prints for our tensor-core kernels (the fused
attention kernel's statements, `ldmatrix`, `mma.sync` m16n8k16 and the warp
shuffles); anything else raises NotImplementedError. How a test checks the
CUDA a schedule generates without a GPU (tests/passes/test_attention.py).
One module, over 500 lines: parser, evaluator and the PTX instructions'
semantics share its value types and are read together.
"""

from __future__ import annotations

import math
import re

import numpy as np

# ----------------------------------------------------------------------------- tokens / parser
TOKRE = re.compile(
    r'"(?:[^"\\]|\\.)*"|0x[0-9a-fA-F.]+p[+-]?\d+f?|\d+\.\d*(?:e[+-]?\d+)?f?|\d+[uU]?|'
    r"[A-Za-z_]\w*|->|<<|>>|<=|>=|==|!=|&&|\|\||\+\+|[^\s\w]"
)

TYPES = {
    "half": 2,
    "float": 4,
    "int": 4,
    "unsigned": 4,
    "uint": 4,
    "uchar": 1,
    "uint4": 16,
    "ulonglong4": 32,
    "half2": 4,
    "half4": 8,
    "float2": 8,
    "float4": 16,
    "ulonglong": 8,
    "int64_t": 8,
    "int4": 16,
}
NP = {
    "half": np.float16,
    "float": np.float32,
    "int": np.int32,
    "unsigned": np.uint32,
    "uint": np.uint32,
    "uchar": np.uint8,
    "ulonglong": np.uint64,
    "int64_t": np.int64,
}
MEMBERS = {"uint4": ("unsigned", 4), "int4": ("int", 4), "ulonglong4": ("ulonglong", 8), "half2": ("half", 2),
           "half4": ("half", 2), "float2": ("float", 4), "float4": ("float", 4)}


def tokenize(src):
    src = re.sub(r"/\*.*?\*/", "", src, flags=re.S)
    src = "\n".join(line for line in src.splitlines() if not line.strip().startswith("#"))
    return TOKRE.findall(src)


class P:
    def __init__(self, toks):
        self.t, self.i = toks, 0

    def peek(self, k=0):
        return self.t[self.i + k] if self.i + k < len(self.t) else None

    def next(self):
        tok = self.t[self.i]
        self.i += 1
        return tok

    def expect(self, tok):
        got = self.next()
        assert got == tok, (tok, got, self.t[self.i - 5 : self.i + 5])

    # statements -----------------------------------------------------------------
    def block(self):
        self.expect("{")
        out = []
        while self.peek() != "}":
            out.append(self.stmt())
        self.next()
        return ("block", out)

    def stmt(self):
        tk = self.peek()
        if tk == "{":
            return self.block()
        if tk == ";":
            self.next()
            return ("nop",)
        if tk == "for":
            self.next()
            self.expect("(")
            assert self.next() in ("int", "int64_t")  # (a loop of TVM's int64 extents, e.g. a unit one)
            var = self.next()
            self.expect("=")
            lo = self.expr()
            self.expect(";")
            assert self.next() == var
            self.expect("<")
            hi = self.expr()
            self.expect(";")
            self.expect("++")
            assert self.next() == var
            self.expect(")")
            return ("for", var, lo, hi, self.stmt())
        if tk == "if":
            self.next()
            self.expect("(")
            c = self.expr()
            self.expect(")")
            a = self.stmt()
            b = None
            if self.peek() == "else":
                self.next()
                b = self.stmt()
            return ("if", c, a, b)
        if tk == "__syncthreads":
            self.next()
            self.expect("(")
            self.expect(")")
            self.expect(";")
            return ("sync",)
        if tk == "__asm__":
            self.next()
            self.expect("__volatile__")
            self.expect("(")
            s = ""
            while self.peek().startswith('"'):
                s += self.next()[1:-1]
            self.expect(":")
            outs = self.asm_operands(":")
            self.expect(":")
            ins = self.asm_operands(")")
            self.expect(")")
            self.expect(";")
            return ("asm", s.replace("\\n", "\n"), outs, ins)
        if tk in ("alignas", "__shared__", "extern", "uint4", "float", "ulonglong4", "unsigned", "uint", "half", "int",
                  "half2", "half4", "float2", "float4", "int4", "int64_t"):
            return self.decl()
        e = self.expr()
        if self.peek() == ";":  # a call for its effect: tvm_builtin_ptx_cp_async_commit_group_...();
            self.next()
            return ("expr", e)
        self.expect("=")
        r = self.expr()
        self.expect(";")
        return ("assign", e, r)

    def asm_operands(self, end: str) -> list:
        """An asm statement's operands (`"=r"(x), ...`) up to `end`: their expressions."""
        out = []
        while self.peek() != end:
            self.next()
            self.expect("(")
            out.append(self.expr())
            self.expect(")")
            if self.peek() == ",":
                self.next()
        return out

    def decl(self):
        shared = False
        while self.peek() in ("alignas", "__shared__", "extern", "__align__"):
            tk = self.next()
            if tk == "__shared__":
                shared = True
            if tk in ("alignas", "__align__"):
                self.expect("(")
                self.next()
                self.expect(")")
        ty = self.next()
        if ty == "unsigned" and self.peek() == "int":
            self.next()
        name = self.next()
        n = None
        if self.peek() == "[":
            self.next()
            n = int(self.next()) if self.peek() != "]" else -1
            self.expect("]")
        init = None
        if self.peek() == "=":
            self.next()
            init = self.expr()
        self.expect(";")
        return ("decl", shared, ty, name, n, init)

    # expressions (C precedence subset, loosest first) --------------------------------
    BIN = [("||",), ("&&",), ("&",), ("==", "!="), ("<", ">", "<=", ">="), ("<<", ">>"), ("+", "-"), ("*", "/", "%")]

    def expr(self):
        return self.level(0)

    def level(self, k):
        if k == len(self.BIN):
            return self.unary()
        e = self.level(k + 1)
        while self.peek() in self.BIN[k]:
            op = self.next()
            e = ("bin", op, e, self.level(k + 1))
        return e

    def is_cast(self):
        q = 1 if self.peek(1) == "volatile" else 0  # (a qualifier: the emulator's memory is never cached)
        if self.peek() != "(" or self.peek(1 + q) not in TYPES:
            return False
        j = 2 + q
        while self.peek(j) == "*":
            j += 1
        return self.peek(j) == ")"

    def unary(self):
        tk = self.peek()
        if tk == "-":
            self.next()
            return ("neg", self.unary())
        if tk == "*":
            self.next()
            return ("deref", self.unary())
        if tk == "&":
            self.next()
            return ("addr", self.unary())
        if self.is_cast():
            self.next()
            if self.peek() == "volatile":
                self.next()
            ty = self.next()
            ptr = 0
            while self.peek() == "*":
                self.next()
                ptr += 1
            self.expect(")")
            return ("cast", ty, ptr, self.unary())
        return self.postfix()

    def postfix(self):
        e = self.primary()
        while True:
            tk = self.peek()
            if tk == "[":
                self.next()
                i = self.expr()
                self.expect("]")
                e = ("index", e, i)
            elif tk == ".":
                self.next()
                e = ("member", e, self.next())
            elif tk == "->":
                self.next()
                e = ("member", ("deref", e), self.next())
            elif tk == "(":
                self.next()
                args = []
                while self.peek() != ")":
                    args.append(self.expr())
                    if self.peek() == ",":
                        self.next()
                self.next()
                e = ("call", e, args)
            else:
                return e

    def primary(self):
        tk = self.next()
        if tk == "(":
            e = self.expr()
            self.expect(")")
            return e
        if tk.startswith("0x") and "p" in tk:
            return ("num", float.fromhex(tk.rstrip("f")), "float")
        if re.match(r"\d+\.", tk):
            return ("num", float(tk.rstrip("f")), "float" if tk.endswith("f") else "double")
        if re.match(r"\d", tk):
            return ("num", int(tk.rstrip("uU")), "int")
        return ("id", tk)


# ----------------------------------------------------------------------------- runtime values
class Ptr:
    def __init__(self, space, buf, off, ty):
        self.space, self.buf, self.off, self.ty = space, buf, off, ty


class Ref:
    def __init__(self, space, buf, off, ty):
        self.space, self.buf, self.off, self.ty = space, buf, off, ty


class Bytes:  # a struct value (uint4, ulonglong4, ...): raw bytes [T, size]
    def __init__(self, b, ty):
        self.b, self.ty = b, ty


class Emu:
    def __init__(self, body_src, block_dim, dyn_bytes, globals_, params, log):
        self.ast = body_src
        self.bdx, self.bdy = block_dim
        self.T = self.bdx * self.bdy
        self.dyn_bytes = dyn_bytes
        self.g = globals_  # name -> bytearray-like np.uint8 array
        self.params = params  # param name -> (global buffer name, elem type)
        self.log = log
        t = np.arange(self.T)
        self.tx, self.ty = t % self.bdx, t // self.bdx
        self.lane, self.warp = t % 32, t // 32
        self.nwarp = (self.T + 31) // 32
        self.gwritten = {k: np.zeros(len(v), np.int32) for k, v in globals_.items()}

    # -------------------------------------------------------------- memory
    def buffer(self, space, name):
        if space == "shared":
            return self.sh[name]
        if space == "local":
            return self.loc[name]
        return self.g[name]

    def check_bounds(self, space, name, off, size, m, what):
        n = self.buffer(space, name).shape[-1]
        o = np.broadcast_to(off, (self.T,))[m]
        if o.size and (o.min() < 0 or o.max() + size > n):
            self.log.add(f"OUT-OF-RANGE {what} {space}:{name} off[{o.min()},{o.max()}]+{size} > {n}")
            return False
        # (a GPU faults on a misaligned address; offsets are within the buffer, whose base TVM aligns to 64 bytes)
        if space != "local" and o.size and (o % min(size, 16)).any():
            self.log.add(f"MISALIGNED {size}-byte {what} {space}:{name}")
        return True

    def load(self, ref, m):
        size = TYPES[ref.ty]
        off = np.broadcast_to(np.asarray(ref.off, np.int64), (self.T,))
        buf = self.buffer(ref.space, ref.buf)
        out = np.zeros((self.T, size), np.uint8)
        if m.any():
            if not self.check_bounds(ref.space, ref.buf, off, size, m, "load"):
                raise RuntimeError("oob load")
            idx = off[m, None] + np.arange(size)
            if ref.space == "local":
                out[m] = buf[np.nonzero(m)[0][:, None], idx]
                ini = self.loc_init[ref.buf][np.nonzero(m)[0][:, None], idx]
                if not ini.all():
                    self.log.add(f"UNINIT local read {ref.buf}")
            else:
                out[m] = buf[idx]
                if ref.space == "shared":
                    self.track(ref.buf, idx, m, write=False)
        return self.from_bytes(out, ref.ty)

    def store(self, ref, val, m):
        size = TYPES[ref.ty]
        b = self.to_bytes(val, ref.ty)
        off = np.broadcast_to(np.asarray(ref.off, np.int64), (self.T,))
        buf = self.buffer(ref.space, ref.buf)
        if not m.any():
            return
        if not self.check_bounds(ref.space, ref.buf, off, size, m, "store"):
            raise RuntimeError("oob store")
        idx = off[m, None] + np.arange(size)
        if ref.space == "local":
            rows = np.nonzero(m)[0][:, None]
            buf[rows, idx] = b[m]
            self.loc_init[ref.buf][rows, idx] = True
        else:
            flat = idx.ravel()
            if len(np.unique(flat)) != len(flat):
                self.log.add(f"same-statement overlapping store {ref.space}:{ref.buf}")
            buf[idx] = b[m]
            if ref.space == "shared":
                if self.pending[ref.buf][idx].any():
                    self.log.add(f"RACE store to shared:{ref.buf} while a cp.async to it is in flight")
                self.track(ref.buf, idx, m, write=True)
            else:
                np.add.at(self.gwritten[ref.buf], flat, 1)

    def from_bytes(self, b, ty):
        if ty in NP:
            return np.ascontiguousarray(b).view(NP[ty]).reshape(self.T)
        return Bytes(b, ty)

    def to_bytes(self, val, ty):
        size = TYPES[ty]
        if isinstance(val, Bytes):
            assert TYPES[val.ty] == size, (val.ty, ty)
            return val.b
        v = self.convert(val, ty)
        return np.ascontiguousarray(np.broadcast_to(v, (self.T,))).view(np.uint8).reshape(self.T, size)

    def convert(self, v, ty):
        d = NP[ty]
        a = np.asarray(v)
        if d == np.float16 and a.dtype in (np.float32, np.float64):
            return a.astype(np.float32).astype(np.float16)  # round-to-nearest-even
        if np.issubdtype(d, np.integer) and np.issubdtype(a.dtype, np.floating):
            raise TypeError("float->int conversion not expected")
        return a.astype(d)

    # race tracking on shared memory: per byte, writer thread / reader warps in the current barrier interval
    def new_epoch(self):
        for k in self.sh:
            self.wthr[k][:] = -1
            self.rwarps[k][:] = 0
            self.rthr[k][:] = -1

    def track(self, name, idx, m, write):
        thr = np.nonzero(m)[0][:, None]  # [n,1]
        w = thr // 32
        wt = self.wthr[name][idx]  # [n,size] last writer thread this interval
        cross = (wt >= 0) & (wt // 32 != w)
        intra = (wt >= 0) & (wt != thr) & (wt // 32 == w)
        kind = "WAW" if write else "RAW"
        if cross.any():
            j = np.argwhere(cross)[0]
            self.log.add(
                f"RACE {kind} cross-warp shared:{name} e.g. byte {idx[j[0], j[1]]} thread {thr[j[0], 0]} vs writer {wt[j[0], j[1]]} (sync #{self.nsync})"
            )
        if intra.any():
            self.log.add(f"intra-warp {kind} cross-lane shared:{name} (sync #{self.nsync})")
        if write:
            rw = self.rwarps[name][idx] & ~(np.uint64(1) << w.astype(np.uint64))
            if rw.any():
                j = np.argwhere(rw != 0)[0]
                self.log.add(
                    f"RACE WAR cross-warp shared:{name} e.g. byte {idx[j[0], j[1]]} written by thread {thr[j[0], 0]} (sync #{self.nsync})"
                )
            rt = self.rthr[name][idx]
            if ((rt >= 0) & (rt != thr) & (rt // 32 == w)).any():
                self.log.add(f"intra-warp WAR cross-lane shared:{name} (sync #{self.nsync})")
            self.wthr[name][idx] = np.broadcast_to(thr, idx.shape)
            self.init[name][idx] = True
        else:
            if self.pending[name][idx].any():
                self.log.add(f"RACE read of shared:{name} while a cp.async to it is in flight (sync #{self.nsync})")
            if not self.init[name][idx].all():
                self.log.add(f"UNINIT shared read {name} (sync #{self.nsync})")
            np.bitwise_or.at(
                self.rwarps[name], idx.ravel(), np.broadcast_to(np.uint64(1) << w.astype(np.uint64), idx.shape).ravel()
            )
            self.rthr[name][idx] = np.broadcast_to(thr, idx.shape)

    # -------------------------------------------------------------- run one block
    def run_block(self, bx, static_bytes, by=0):
        self.bx, self.by = bx, by
        self.sh = {
            "buf_shmem_ptr": np.full(static_bytes, 0xFF, np.uint8),
            "buf_dyn_shmem_ptr": np.full(self.dyn_bytes, 0xFF, np.uint8),
        }
        self.init = {k: np.zeros(len(v), bool) for k, v in self.sh.items()}
        self.wthr = {k: np.full(len(v), -1, np.int64) for k, v in self.sh.items()}
        self.rthr = {k: np.full(len(v), -1, np.int64) for k, v in self.sh.items()}
        self.rwarps = {k: np.zeros(len(v), np.uint64) for k, v in self.sh.items()}
        self.loc, self.loc_init = {}, {}
        # cp.async: bytes with a copy in flight, and each thread's copies not
        # yet committed / its committed groups, oldest first
        self.pending = {k: np.zeros(len(v), np.int32) for k, v in self.sh.items()}
        self.open = [[] for _ in range(self.T)]
        self.groups = [[] for _ in range(self.T)]
        self.scopes = [{}]
        self.nsync = 0
        self.exec(self.ast, np.ones(self.T, bool))

    def lookup(self, name):
        for s in reversed(self.scopes):
            if name in s:
                return s[name]
        raise KeyError(name)

    def exec(self, st, m):
        k = st[0]
        if k == "block":
            self.scopes.append({})
            for s in st[1]:
                self.exec(s, m)
            self.scopes.pop()
        elif k == "nop":
            pass
        elif k == "for":
            _, var, lo, hi, body = st
            lo, hi = self.ev(lo, m), self.ev(hi, m)
            assert isinstance(lo, int) and isinstance(hi, int)
            for i in range(lo, hi):
                self.scopes.append({var: ("int", i)})
                self.exec(body, m)
                self.scopes.pop()
        elif k == "if":
            c = np.broadcast_to(np.asarray(self.rv(st[1], m)).astype(bool), (self.T,))
            self.exec(st[2], m & c)
            if st[3] is not None:
                self.exec(st[3], m & ~c)
        elif k == "sync":
            assert m.all(), "__syncthreads under divergence"
            self.nsync += 1
            self.new_epoch()
        elif k == "decl":
            _, shared, ty, name, n, init = st
            if name in ("buf_shmem_ptr", "buf_dyn_shmem_ptr"):
                if n is not None and n >= 0:
                    assert n == len(self.sh[name]), (n, len(self.sh[name]))
                self.scopes[-1][name] = ("ptr", Ptr("shared", name, 0, ty))
                return
            if shared:  # a shared array of its own (a kernel whose one shared buffer was not merged)
                # (one array a block, as CUDA allocates it: declared again in a loop, TVM's cross-thread
                # reduction's staging, it is the same array, its contents and race tracking kept)
                size = TYPES[ty] * n
                if name in self.sh:
                    assert len(self.sh[name]) == size, f"__shared__ {name} declared again with another size"
                    self.scopes[-1][name] = ("ptr", Ptr("shared", name, 0, ty))
                    return
                self.sh[name] = np.full(size, 0xFF, np.uint8)
                self.init[name], self.pending[name] = np.zeros(size, bool), np.zeros(size, np.int32)
                self.wthr[name], self.rthr[name] = np.full(size, -1, np.int64), np.full(size, -1, np.int64)
                self.rwarps[name] = np.zeros(size, np.uint64)
                self.scopes[-1][name] = ("ptr", Ptr("shared", name, 0, ty))
                return
            if init is not None:
                v = self.ev(init, m)
                if isinstance(v, Ptr):  # unsigned int addr = __cvta_generic_to_shared(...)
                    assert m.all()
                    self.scopes[-1][name] = ("ptr", v)
                    return
            size = TYPES[ty] * (n if n else 1)
            key = f"{name}@{id(st)}"
            self.loc[key] = np.full((self.T, size), 0xFF, np.uint8)
            self.loc_init[key] = np.zeros((self.T, size), bool)
            self.scopes[-1][name] = ("ptr", Ptr("local", key, 0, ty)) if n else ("ref", Ref("local", key, 0, ty))
            if init is not None:  # e.g. ulonglong4 v_ = *(ulonglong4*)(...)
                assert not n
                self.store(Ref("local", key, 0, ty), self.load(v, m) if isinstance(v, Ref) else v, m)
        elif k == "assign":
            ref = self.ev(st[1], m)
            assert isinstance(ref, Ref), st[1]
            val = self.rv(st[2], m)
            self.store(ref, val, m)
        elif k == "asm":
            self.asm(st, m)
        elif k == "expr":
            assert st[1][0] == "call", st
            self.ev(st[1], m)
        else:
            raise NotImplementedError(k)

    # rvalue: loads Refs
    def rv(self, e, m):
        v = self.ev(e, m)
        if isinstance(v, Ref):
            return self.load(v, m)
        return v

    def ev(self, e, m):
        k = e[0]
        if k == "num":
            return e[1] if e[2] == "int" else (np.float32(e[1]) if e[2] == "float" else float(e[1]))
        if k == "id":
            n = e[1]
            if n == "CUDART_INF_F":
                return np.float32(np.inf)
            if n in self.params:
                gname, ty = self.params[n]
                return Ptr("global", gname, 0, ty)
            if n in ("threadIdx", "blockIdx"):
                return n
            kind, v = self.lookup(n)
            return v
        if k == "member":
            base = e[1]
            if base[0] == "id" and base[1] in ("threadIdx", "blockIdx"):
                if base[1] == "blockIdx":
                    return {"x": self.bx, "y": self.by}[e[2]]
                return {"x": self.tx, "y": self.ty}[e[2]]
            r = self.ev(base, m)
            assert isinstance(r, Ref) and r.ty in MEMBERS, (e, r)
            mt, sz = MEMBERS[r.ty]
            return Ref(r.space, r.buf, r.off + "xyzw".index(e[2]) * sz, mt)
        if k == "cast":
            _, ty, ptr, sub = e
            if ptr:
                p = self.rv(sub, m)
                assert isinstance(p, Ptr), e
                return Ptr(p.space, p.buf, p.off, ty)
            v = self.rv(sub, m)
            if ty in ("int", "int64_t"):  # (indices: held as int64 either way)
                return v if isinstance(v, int) else np.asarray(v).astype(np.int64)
            if ty == "half":
                return np.asarray(v, np.float32).astype(np.float16)
            if ty == "float":
                return np.asarray(v).astype(np.float32)
            if ty in ("uint", "unsigned"):  # (of an int: its bits mod 2^32)
                return np.asarray(np.asarray(v, np.int64) & 0xFFFFFFFF, np.uint32)
            raise NotImplementedError(ty)
        if k == "deref":
            p = self.rv(e[1], m)
            assert isinstance(p, Ptr)
            return Ref(p.space, p.buf, p.off, p.ty)
        if k == "addr":
            r = self.ev(e[1], m)
            assert isinstance(r, Ref)
            return Ptr(r.space, r.buf, r.off, r.ty)
        if k == "index":
            p = self.rv(e[1], m)
            i = self.rv(e[2], m)
            assert isinstance(p, Ptr), e
            return Ref(p.space, p.buf, p.off + self.as_int(i) * TYPES[p.ty], p.ty)
        if k == "neg":
            return -self.rv(e[1], m)
        if k == "bin" and e[1] in ("&&", "||"):  # short-circuit: the right side only where it is evaluated
            a = np.broadcast_to(np.asarray(self.rv(e[2], m)).astype(bool), (self.T,))
            b = np.broadcast_to(np.asarray(self.rv(e[3], m & (a if e[1] == "&&" else ~a))).astype(bool), (self.T,))
            return (a & b) if e[1] == "&&" else (a | b)
        if k == "bin":
            return self.binop(e[1], self.rv(e[2], m), self.rv(e[3], m))
        if k == "call":
            return self.call(e[1][1], e[2], m)
        raise NotImplementedError(e)

    @staticmethod
    def as_int(i):
        if isinstance(i, (int, np.integer)):
            return int(i)
        a = np.asarray(i)
        assert np.issubdtype(a.dtype, np.integer), a.dtype
        return a.astype(np.int64)

    def binop(self, op, a, b):
        if isinstance(a, Ptr):
            assert op == "+"
            return Ptr(a.space, a.buf, a.off + self.as_int(b) * TYPES[a.ty], a.ty)

        def isint(x):  # (bools too: a comparison's value, as C's int)
            return isinstance(x, int) or np.issubdtype(np.asarray(x).dtype, np.integer) or np.asarray(x).dtype == bool

        if isint(a) and isint(b):
            a = a if isinstance(a, int) else np.asarray(a, np.int64)
            b = b if isinstance(b, int) else np.asarray(b, np.int64)
            if op in "/%":
                assert np.all(np.asarray(a) >= 0) and np.all(np.asarray(b) > 0)
                return a // b if op == "/" else a % b
            return {
                "+": lambda: a + b,
                "-": lambda: a - b,
                "*": lambda: a * b,
                ">>": lambda: a >> b,
                "<<": lambda: a << b,
                "&": lambda: a & b,
                "<": lambda: a < b,
                "==": lambda: a == b,
                ">": lambda: a > b,
                "<=": lambda: a <= b,
                ">=": lambda: a >= b,
                "!=": lambda: a != b,
            }[op]()
        if all(not isint(x) and np.asarray(x).dtype == np.float16 for x in (a, b)) and op in "+-*/":
            # half op half (cuda_fp16's operators): in float32, then rounded to half; float32's 24 bits
            # (>= 2 x 11 + 2) make that the correctly rounded half result for + - * /, as add.f16 gives
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            with np.errstate(all="ignore"):
                return {"+": a + b, "-": a - b, "*": a * b, "/": a / b}[op].astype(np.float16)
        # floating point: C usual arithmetic conversions; float op float -> float32
        dt = (
            np.float64
            if (isinstance(a, float) and not isinstance(a, np.floating))
            or (isinstance(b, float) and not isinstance(b, np.floating))
            else np.float32
        )
        for x in (a, b):
            if not isint(x):
                assert np.asarray(x).dtype in (np.float32, np.float64), np.asarray(x).dtype
        a, b = np.asarray(a, dt), np.asarray(b, dt)
        with np.errstate(all="ignore"):
            return {
                "+": lambda: a + b,
                "-": lambda: a - b,
                "*": lambda: a * b,
                "/": lambda: a / b,
                "<": lambda: a < b,
                ">": lambda: a > b,
                "<=": lambda: a <= b,
                ">=": lambda: a >= b,
                "==": lambda: a == b,
                "!=": lambda: a != b,
            }[op]()

    def call(self, fn, args, m):
        if fn == "__cvta_generic_to_shared":
            p = self.rv(args[0], m)
            assert isinstance(p, Ptr) and p.space == "shared"
            return p
        if fn == "expf":
            x = np.asarray(self.rv(args[0], m))
            assert x.dtype == np.float32
            with np.errstate(all="ignore"):
                return np.exp(x).astype(np.float32)
        if fn == "erff":  # (CUDA's is within 2 ulp of this, the correctly rounded value)
            x = np.asarray(self.rv(args[0], m))
            assert x.dtype == np.float32
            return np.vectorize(math.erf, otypes=[np.float64])(x.astype(np.float64)).astype(np.float32)
        if fn == "hexp":  # (cuda_fp16's: within an ulp of the correctly rounded value, this)
            x = np.asarray(self.rv(args[0], m))
            assert x.dtype == np.float16
            with np.errstate(all="ignore"):
                return np.exp(x.astype(np.float64)).astype(np.float16)
        if fn == "rsqrtf":  # (CUDA's is within 2 ulp of this, the correctly rounded value)
            x = np.asarray(self.rv(args[0], m))
            assert x.dtype == np.float32
            with np.errstate(all="ignore"):
                return (1.0 / np.sqrt(x.astype(np.float64))).astype(np.float32)
        if fn in ("max", "min"):
            a, b = np.asarray(self.rv(args[0], m)), np.asarray(self.rv(args[1], m))
            if a.dtype.kind in "iu" and b.dtype.kind in "iu":  # (an index's: the integer min/max)
                return (np.maximum if fn == "max" else np.minimum)(a, b)
            assert a.dtype == b.dtype and a.dtype in (np.float32, np.float16)
            return (np.fmax if fn == "max" else np.fmin)(a, b)  # fmaxf; TVM's `half max(half, half)`: a > b ? a : b
        if fn in ("make_float2", "make_float4"):
            parts = [np.broadcast_to(np.asarray(self.rv(a, m), np.float32), (self.T,)) for a in args]
            return Bytes(np.ascontiguousarray(np.stack(parts, 1)).view(np.uint8).reshape(self.T, 4 * len(args)),
                         fn[len("make_"):])
        if fn == "make_half4":
            parts = [np.broadcast_to(np.asarray(self.rv(a, m), np.float16), (self.T,)) for a in args]
            return Bytes(np.ascontiguousarray(np.stack(parts, 1)).view(np.uint8).reshape(self.T, 8), "half4")
        if fn == "__float2half_rn":
            return np.asarray(self.rv(args[0], m), np.float32).astype(np.float16)
        if fn == "__pack_half2":
            x = np.asarray(self.rv(args[0], m), np.float16)
            y = np.asarray(self.rv(args[1], m), np.float16)
            return (y.view(np.uint16).astype(np.uint32) << 16) | x.view(np.uint16).astype(np.uint32)
        if fn in ("make_uint4", "make_int4"):  # (int4: the indices of a vector's scattered lanes)
            kind = np.uint32 if fn == "make_uint4" else np.int32
            parts = [np.broadcast_to(np.asarray(self.rv(a, m)).astype(kind), (self.T,)) for a in args]
            return Bytes(np.ascontiguousarray(np.stack(parts, 1)).view(np.uint8).reshape(self.T, 16), fn[len("make_"):])
        if fn == "__activemask":
            out = np.zeros(self.T, np.uint32)
            for w in range(self.nwarp):
                sel = self.warp == w
                bits = 0
                for lane in self.lane[sel & m]:
                    bits |= 1 << int(lane)
                out[sel] = bits
            return out
        if fn in ("__shfl_down_sync", "__shfl_sync"):
            mask = self.rv(args[0], m)
            var = np.broadcast_to(np.asarray(self.rv(args[1], m)), (self.T,))
            x = self.rv(args[2], m)
            width = self.rv(args[3], m)
            assert width == 32
            x = np.broadcast_to(np.asarray(x, np.int64), (self.T,))
            mk = np.broadcast_to(np.asarray(mask, np.uint32), (self.T,))
            if not (m.all() and (mk[m] == 0xFFFFFFFF).all()):
                self.log.add(f"{fn} with partial mask")
            base = self.warp * 32
            if fn == "__shfl_down_sync":
                src = self.lane + x
                src = np.where(src < 32, src, self.lane)  # out of range: own value
            else:
                src = x % 32  # srcLane modulo width
            return var[base + src].copy()
        found = re.fullmatch(r"ptx_cp_async_legacy_c[ag]_(\d+)_(\d+)_(\d+)", fn)
        if found:
            self.cp_async(args, m, *(int(x) for x in found.groups()))
            return None
        found = re.fullmatch(r"ptx_cp_async_legacy_pred_c[ag]_(\d+)_(\d+)_(\d+)", fn)
        if found:  # (..., predicate): `@p cp.async`, `@!p st.shared` of zeros (at once, in no group)
            size, dst_scale, _ = (int(x) for x in found.groups())
            zeros = {4: "uint", 8: "ulonglong", 16: "uint4"}.get(size)  # (`st.shared.u32` ... `.v4.u32`)
            if zeros is None:
                raise NotImplementedError(f"{fn}: the zero fill of a {size}-byte predicated copy")
            pred = np.broadcast_to(np.asarray(self.rv(args[4], m)) == 1, (self.T,))
            self.cp_async(args[:4], m & pred, *(int(x) for x in found.groups()))
            dst = self.rv(args[0], m)
            off = dst.off + self.as_int(self.rv(args[1], m)) * dst_scale
            self.store(Ref("shared", dst.buf, off, zeros), Bytes(np.zeros((self.T, size), np.uint8), zeros), m & ~pred)
            return None
        if fn == "tvm_builtin_ptx_cp_async_commit_group_async_commit_group":
            for t in np.nonzero(m)[0]:
                self.groups[t].append(self.open[t])
                self.open[t] = []
            return None
        found = re.fullmatch(r"tvm_builtin_ptx_cp_async_wait_group_async_wait_group_(\d+)", fn)
        if found:
            self.cp_async_wait(int(found.group(1)), m)
            return None
        raise NotImplementedError(fn)

    # -------------------------------------------------------------- cp.async
    def cp_async(self, args, m, size, dst_scale, src_scale):
        """`ptx_cp_async_legacy_cg_<bytes>_<dst elem>_<src elem>(dst, dst_off,
        src, src_off)` (TVM's helper: offsets in elements): the source read
        now, the destination written when a wait_group completes its group.
        From issue to completion the bytes are in flight: any read or store
        of them is a race, and so is an issue over bytes another warp read
        since the last barrier (the copy may land at once)."""
        dst, src = self.rv(args[0], m), self.rv(args[2], m)
        assert isinstance(dst, Ptr) and dst.space == "shared" and isinstance(src, Ptr) and src.space == "global"
        doff = np.broadcast_to(np.asarray(dst.off + self.as_int(self.rv(args[1], m)) * dst_scale, np.int64), (self.T,))
        soff = np.broadcast_to(np.asarray(src.off + self.as_int(self.rv(args[3], m)) * src_scale, np.int64), (self.T,))
        if not m.any():
            return
        if not (self.check_bounds("shared", dst.buf, doff, size, m, "cp.async dst")
                and self.check_bounds("global", src.buf, soff, size, m, "cp.async src")):
            raise RuntimeError("oob cp.async")
        thr = np.nonzero(m)[0]
        didx = doff[m, None] + np.arange(size)
        data = self.g[src.buf][soff[m, None] + np.arange(size)]
        warp = (thr[:, None] // 32).astype(np.uint64)
        others = self.rwarps[dst.buf][didx] & ~(np.uint64(1) << warp)
        if others.any():
            self.log.add(f"RACE WAR cp.async over shared:{dst.buf} read by another warp since the barrier (sync #{self.nsync})")
        wt = self.wthr[dst.buf][didx]
        if ((wt >= 0) & (wt // 32 != thr[:, None] // 32)).any():
            self.log.add(f"RACE WAW cp.async over shared:{dst.buf} written by another warp since the barrier (sync #{self.nsync})")
        rt = self.rthr[dst.buf][didx]
        if ((rt >= 0) & (rt != thr[:, None]) & (rt // 32 == thr[:, None] // 32)).any():
            self.log.add(f"intra-warp WAR cp.async cross-lane shared:{dst.buf} (sync #{self.nsync})")
        if self.pending[dst.buf][didx].any():
            self.log.add(f"RACE cp.async over shared:{dst.buf} with a copy to it still in flight")
        np.add.at(self.pending[dst.buf], didx.ravel(), 1)
        for j, t in enumerate(thr):
            self.open[t].append((dst.buf, didx[j], data[j]))

    def cp_async_wait(self, n, m):
        """`cp.async.wait_group n`: each thread's committed groups but its
        newest n complete, their bytes written (as that thread's stores)."""
        for t in np.nonzero(m)[0]:
            one = np.zeros(self.T, bool)
            one[t] = True
            while len(self.groups[t]) > n:
                for name, idx, data in self.groups[t].pop(0):
                    self.pending[name][idx] -= 1
                    self.sh[name][idx] = data
                    self.track(name, idx[None, :], one, write=True)

    # -------------------------------------------------------------- PTX
    def asm(self, st, m):
        _, s, outs, ins = st
        ins_ = s.strip().split("{")[0].strip()
        if not m.all():
            self.log.add(f"warp-collective {ins_} under partial mask")
        if ins_.startswith("ldmatrix.sync.aligned.m8n8"):
            nmat = int(re.search(r"\.x(\d)", ins_).group(1))
            trans = ".trans" in ins_
            assert ins_.endswith(".shared.b16") and len(outs) == nmat and len(ins) == 1
            p = self.rv(ins[0], m)
            assert isinstance(p, Ptr) and p.space == "shared"
            off = np.broadcast_to(np.asarray(p.off, np.int64), (self.T,))
            if (off % 16).any():
                self.log.add("ldmatrix row address not 16-byte aligned")
            # rows: thread i of each warp supplies row i%8 of matrix i//8 (threads >= 8*nmat unused)
            sup = self.lane < 8 * nmat
            rows = self.load(Ref(p.space, p.buf, off, "uint4"), m & sup).b.copy().view(np.float16)  # [T,8]
            regs = [np.zeros(self.T, np.uint32) for _ in range(nmat)]
            tt = np.arange(32)
            for w in range(self.nwarp):
                R = rows[w * 32 : (w + 1) * 32]  # [32 lanes, 8 halves]
                for j in range(nmat):
                    M = R[8 * j : 8 * j + 8]  # matrix j [8 rows, 8 cols]
                    if trans:
                        M = M.T
                    lo = M[tt // 4, 2 * (tt % 4)].view(np.uint16).astype(np.uint32)
                    hi = M[tt // 4, 2 * (tt % 4) + 1].view(np.uint16).astype(np.uint32)
                    regs[j][w * 32 : (w + 1) * 32] = (hi << 16) | lo
            for j in range(nmat):
                r = self.ev(outs[j], m)
                assert isinstance(r, Ref) and TYPES[r.ty] == 4
                self.store(Ref(r.space, r.buf, r.off, "unsigned"), regs[j], m)
        elif ins_ == "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32":
            assert len(outs) == 4 and len(ins) == 10

            def u32(e):
                r = self.ev(e, m)
                assert isinstance(r, Ref)
                return self.load(Ref(r.space, r.buf, r.off, "unsigned"), m)

            def f32(e):
                r = self.ev(e, m)
                assert isinstance(r, Ref)
                return self.load(Ref(r.space, r.buf, r.off, "float"), m)

            A = [u32(e) for e in ins[0:4]]
            B = [u32(e) for e in ins[4:6]]
            C = [f32(e) for e in ins[6:10]]

            def lo(u):
                return (u & 0xFFFF).astype(np.uint16).view(np.float16)

            def hi(u):
                return (u >> 16).astype(np.uint16).view(np.float16)

            D = [np.zeros(self.T, np.float32) for _ in range(4)]
            tt = np.arange(32)
            g, q = tt // 4, tt % 4
            for w in range(self.nwarp):
                sl = slice(w * 32, (w + 1) * 32)
                a = np.full((16, 16), np.nan)
                b = np.full((16, 8), np.nan)
                c = np.full((16, 8), np.nan)
                a[g, 2 * q], a[g, 2 * q + 1] = lo(A[0][sl]), hi(A[0][sl])  # a0,a1
                a[g + 8, 2 * q], a[g + 8, 2 * q + 1] = lo(A[1][sl]), hi(A[1][sl])  # a2,a3
                a[g, 2 * q + 8], a[g, 2 * q + 9] = lo(A[2][sl]), hi(A[2][sl])  # a4,a5
                a[g + 8, 2 * q + 8], a[g + 8, 2 * q + 9] = lo(A[3][sl]), hi(A[3][sl])  # a6,a7
                b[2 * q, g], b[2 * q + 1, g] = lo(B[0][sl]), hi(B[0][sl])  # b0,b1
                b[2 * q + 8, g], b[2 * q + 9, g] = lo(B[1][sl]), hi(B[1][sl])  # b2,b3
                c[g, 2 * q], c[g, 2 * q + 1] = C[0][sl], C[1][sl]
                c[g + 8, 2 * q], c[g + 8, 2 * q + 1] = C[2][sl], C[3][sl]
                assert not (np.isnan(a).any() or np.isnan(b).any() or np.isnan(c).any()) or True
                d = (a @ b + c).astype(np.float32)  # exact products, fp64 sum, one rounding to fp32
                D[0][sl], D[1][sl], D[2][sl], D[3][sl] = (
                    d[g, 2 * q],
                    d[g, 2 * q + 1],
                    d[g + 8, 2 * q],
                    d[g + 8, 2 * q + 1],
                )
            for j in range(4):
                r = self.ev(outs[j], m)
                self.store(Ref(r.space, r.buf, r.off, "float"), D[j], m)
        elif ins_ == "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32":
            self.mma_tf32(outs, ins, m)
        else:
            raise NotImplementedError(ins_)

    def mma_tf32(self, outs, ins, m):
        """m16n8k8 in TF32 (the PTX ISA's fragments: a0..a3 at rows g, g+8 and
        columns t, t+4; b0, b1 at k = t, t+4 and column g): each operand's
        low 13 mantissa bits dropped, as the tensor cores read it."""
        assert len(outs) == 4 and len(ins) == 10

        def word(e, ty):
            r = self.ev(e, m)
            assert isinstance(r, Ref)
            return self.load(Ref(r.space, r.buf, r.off, ty), m)

        def tf32(u):
            return (np.asarray(u, np.uint32) & np.uint32(0xFFFFE000)).view(np.float32).astype(np.float64)

        A = [tf32(word(e, "unsigned")) for e in ins[0:4]]
        B = [tf32(word(e, "unsigned")) for e in ins[4:6]]
        C = [word(e, "float") for e in ins[6:10]]
        D = [np.zeros(self.T, np.float32) for _ in range(4)]
        tt = np.arange(32)
        g, q = tt // 4, tt % 4
        for w in range(self.nwarp):
            sl = slice(w * 32, (w + 1) * 32)
            a, b, c = np.zeros((16, 8)), np.zeros((8, 8)), np.zeros((16, 8))
            a[g, q], a[g + 8, q], a[g, q + 4], a[g + 8, q + 4] = A[0][sl], A[1][sl], A[2][sl], A[3][sl]
            b[q, g], b[q + 4, g] = B[0][sl], B[1][sl]
            c[g, 2 * q], c[g, 2 * q + 1] = C[0][sl], C[1][sl]
            c[g + 8, 2 * q], c[g + 8, 2 * q + 1] = C[2][sl], C[3][sl]
            d = (a @ b + c).astype(np.float32)
            D[0][sl], D[1][sl], D[2][sl], D[3][sl] = d[g, 2 * q], d[g, 2 * q + 1], d[g + 8, 2 * q], d[g + 8, 2 * q + 1]
        for j in range(4):
            r = self.ev(outs[j], m)
            self.store(Ref(r.space, r.buf, r.off, "float"), D[j], m)


def parse_kernel(src: str, name: str):
    """The body of `__global__` function `name` in CUDA source `src`, parsed."""
    for found in re.finditer(re.escape(name) + r"\(", src):
        close = src.index(")", found.end())
        if src[close + 1 :].lstrip().startswith("{"):
            i = src.index("{", close)
            break
    else:
        raise ValueError(f"no definition of {name} in the source")
    depth, j = 0, i
    for j in range(i, len(src)):
        depth += {"{": 1, "}": -1}.get(src[j], 0)
        if depth == 0:
            break
    toks = tokenize(src[i : j + 1])
    p = P(toks)
    ast = p.block()
    assert p.i == len(toks)
    return ast


def run(src: str, name: str, grid, block: tuple[int, int], dyn_bytes: int, tensors: dict, params: dict):
    """Runs kernel `name` of `src` on every block of a grid (`grid`: its
    blocks along x, or (x, y) for a 2-D one): `tensors`
    maps a global buffer's name to its bytes (np.uint8, updated in place),
    `params` the kernel's pointer parameters to (buffer name, element type).
    Returns (the problems found, a set of lines; bytes written per global
    byte, by buffer)."""
    static = re.search(r"__shared__ alignas\(64\) uchar buf_shmem_ptr\[(\d+)\]", src)
    log = set()
    emu = Emu(parse_kernel(src, name), block, dyn_bytes, tensors, params, log)
    gx, gy = grid if isinstance(grid, tuple) else (grid, 1)
    for by in range(gy):
        for bx in range(gx):
            emu.run_block(bx, int(static.group(1)) if static else 0, by)
    return log, emu.gwritten
