"""System shared memory for the serving process: the extension Triton adds to
the Open Inference Protocol (`system_shared_memory`), so that a client on the
same host passes tensors through POSIX shared memory instead of the HTTP
body: at hundreds of kilobytes per image, the body is what limits one
server process's throughput.

A client creates a region (`shm_open`, e.g. tritonclient.utils.shared_memory),
registers it by name (`POST /v2/systemsharedmemory/region/{name}/register`
with its key, offset and byte size), then names it in an input's or
output's parameters (`shared_memory_region`, `shared_memory_byte_size`,
`shared_memory_offset`): the server reads the input from it and writes the
output into it. An input is read from the region when its batch is staged
(`ShmInput.read_into`: one pread straight into the batch's host buffer,
in the batcher's thread), before the answer, so the client may reuse the
region once it has its answer.
"""

from __future__ import annotations

import os
import stat
import threading
from dataclasses import dataclass

import numpy as np

from ..errors import RequestError, UnavailableError

SHM_DIR = "/dev/shm"  # where Linux keeps POSIX shared memory objects


@dataclass
class _Region:
    name: str
    key: str
    offset: int
    byte_size: int
    # An open descriptor, read and written with pread/pwrite: a mapping would
    # kill the process (SIGBUS) if the client shrank the object under it.
    fd: int

    def status(self) -> dict:
        return {"name": self.name, "key": self.key, "offset": self.offset, "byte_size": self.byte_size}


def _shrank(tensor: str, got: int, nbytes: int) -> RequestError:
    return RequestError(f"region of '{tensor}' is shorter than registered (its object shrank)",
                        f"{got} bytes", f"{nbytes}")


class ShmInput:
    """An input tensor in a client's shared-memory region: shape and dtype
    like an array's; `read_into` copies it (one pread: no mapping, which a
    client shrinking its object would turn into SIGBUS) into a C-contiguous
    array of its shape and dtype, once (a pending request's input is read
    when its batch is staged); numpy reads it with np.asarray."""

    __slots__ = ("name", "_fd", "_offset", "shape", "dtype", "nbytes")

    def __init__(self, name: str, fd: int, offset: int, shape: tuple, dtype: np.dtype):
        self.name, self._fd, self._offset = name, fd, offset
        self.shape, self.dtype = shape, np.dtype(dtype)
        self.nbytes = int(np.prod(shape, dtype=np.int64)) * self.dtype.itemsize

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def read_into(self, dst: np.ndarray) -> None:
        """Read the tensor into `dst`, once: the descriptor is closed after
        (read or failed), not left to the garbage collector."""
        if self._fd < 0:
            raise RequestError(f"input '{self.name}' was already read", None, "one read per request")
        try:
            view = memoryview(dst).cast("B")
            if view.nbytes != self.nbytes:
                raise ValueError(f"read_into: {view.nbytes} bytes for {self.nbytes}")
            done = 0
            while done < self.nbytes:
                got = os.preadv(self._fd, [view[done:]], self._offset + done)
                if got == 0:
                    raise _shrank(self.name, done, self.nbytes)
                done += got
        finally:
            self.close()

    def __array__(self, dtype=None, copy=None):
        a = np.empty(self.shape, self.dtype)
        self.read_into(a)
        return a if dtype is None else a.astype(dtype, copy=False)

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)

    def __del__(self):
        self.close()


def _int(value, what: str, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise RequestError(f"invalid {what}", repr(value), f"an integer >= {minimum}")
    return value


class Regions:
    """The registered regions, by name; safe to use from several threads."""

    def __init__(self):
        self._regions: dict[str, _Region] = {}
        self._lock = threading.Lock()

    def register(self, name: str, body: dict) -> None:
        if not isinstance(body, dict):
            raise RequestError("invalid register request", type(body).__name__, '{"key": ..., "offset": ..., "byte_size": ...}')
        key = body.get("key")
        if not isinstance(key, str) or not key.strip("/") or "/" in key.strip("/") or "\x00" in key or key.strip("/") in ("..", "."):
            raise RequestError("invalid shared-memory key", repr(key), "a POSIX shared-memory name, e.g. '/input0'")
        offset = _int(body.get("offset", 0), "offset", 0)
        size = _int(body.get("byte_size"), "byte_size", 1)
        path = os.path.join(SHM_DIR, key.strip("/"))
        with self._lock:
            if name in self._regions:
                raise RequestError("shared-memory region already registered", repr(name),
                                   "a new name, or unregister it first")
            try:
                # Not through a symbolic link: a key must name a shared-memory object, not any file.
                fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
            except OSError as e:
                raise RequestError("cannot open shared-memory key", repr(key),
                                   f"an existing shared-memory object ({e.strerror})") from None
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise RequestError("shared-memory key is not a shared-memory object", repr(key), "a POSIX shared-memory name")
                if offset + size > st.st_size:
                    raise RequestError("shared-memory region larger than its object", f"offset {offset} + byte_size {size}",
                                       f"at most {st.st_size} bytes")
            except BaseException:
                os.close(fd)
                raise
            self._regions[name] = _Region(name, key, offset, size, fd)

    def unregister(self, name: str | None = None) -> None:
        """One region, or all of them (name None); unknown names are no error, as in Triton."""
        with self._lock:
            names = list(self._regions) if name is None else [name] if name in self._regions else []
            for n in names:
                os.close(self._regions.pop(n).fd)

    def status(self, name: str | None = None) -> list[dict]:
        with self._lock:
            if name is None:
                return [r.status() for r in self._regions.values()]
            if name not in self._regions:
                raise RequestError("no such shared-memory region", repr(name), "a registered region's name")
            return [self._regions[name].status()]

    def _span(self, params: dict, tensor: str, nbytes: int, exact: bool) -> tuple[_Region, int]:
        name = params.get("shared_memory_region")
        if not isinstance(name, str):
            raise RequestError(f"invalid shared_memory_region of '{tensor}'", repr(name), "a region's name")
        size = _int(params.get("shared_memory_byte_size"), f"shared_memory_byte_size of '{tensor}'", 0)
        offset = _int(params.get("shared_memory_offset", 0), f"shared_memory_offset of '{tensor}'", 0)
        region = self._regions.get(name)
        if region is None:
            raise RequestError(f"'{tensor}' names an unregistered shared-memory region", repr(name),
                               "a region registered with /v2/systemsharedmemory/region/{name}/register")
        if (size != nbytes) if exact else (size < nbytes):
            raise RequestError(f"shared_memory_byte_size of '{tensor}' does not fit its shape and datatype", size,
                               f"{'' if exact else 'at least '}{nbytes}")
        if offset + size > region.byte_size:
            raise RequestError(f"'{tensor}' goes past the end of region '{name}'", f"offset {offset} + {size} bytes",
                               f"at most {region.byte_size} bytes")
        return region, region.offset + offset

    def input(self, params: dict, tensor: str, shape: list[int], dtype: np.dtype) -> ShmInput:
        """An input left in its region until its batch is staged (no copy
        here, on the event loop). It holds its own descriptor of the object,
        so unregistering the region meanwhile does not pull it away."""
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        with self._lock:
            region, start = self._span(params, tensor, nbytes, exact=True)
            have = os.fstat(region.fd).st_size
            if start + nbytes > have:
                raise _shrank(tensor, max(have - start, 0), nbytes)
            try:
                fd = os.dup(region.fd)
            except OSError as e:  # out of descriptors: too many inputs pending
                raise UnavailableError("cannot hold another shared-memory input", e.strerror,
                                       "fewer requests in flight; retry later") from None
        return ShmInput(tensor, fd, start, tuple(shape), dtype)

    def check_output(self, params: dict, tensor: str) -> None:
        """That an output's region exists (its size is checked when written)."""
        self._span(params, tensor, 0, exact=False)

    def write(self, params: dict, tensor: str, data: bytes) -> None:
        with self._lock:
            region, start = self._span(params, tensor, len(data), exact=False)
            have = os.fstat(region.fd).st_size
            if start + len(data) > have:  # pwrite would grow the client's object
                raise RequestError(f"region of '{tensor}' is shorter than registered (its object shrank)",
                                   f"{have} bytes", f"at least {start + len(data)}")
            os.pwrite(region.fd, data, start)

    def close(self) -> None:
        self.unregister(None)
