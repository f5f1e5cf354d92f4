"""The load test's clients: closed-loop tritonclient asyncio HTTP clients (the
standard v2 client, binary tensors), several to a client process, each
sending its next request when the last one is answered and checking every
answer against the raw Predictor's output; optionally through system shared
memory regions of their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import time

import numpy as np

from ..config import LoadtestConfig


def _close(out: np.ndarray, ref: np.ndarray, precision: str) -> bool:
    # Merged requests may run in another bucket (another compiled module)
    # than the reference did: equal up to rounding, not bit for bit.
    limit = 1e-4 if precision == "fp32" else 2e-2  # (fp16, tf32)
    out, ref = out.astype(np.float64), ref.astype(np.float64)
    if out.shape != ref.shape:
        return False
    return bool(np.linalg.norm(out - ref) <= limit * max(np.linalg.norm(ref), 1e-30))


def client_part(url: str, model: str, specs: list[dict], requests: list[list[np.ndarray]],
                 expected: list[dict], precision: str, concurrency: int, warmup_s: float, duration_s: float,
                 shared_memory: bool = False, sync=None) -> tuple[float, list]:
    """One client process: `concurrency` closed-loop clients for `warmup_s`
    + `duration_s` seconds. `sync`, with several processes: (ready, go)
    queues; the process says it is ready once its requests are built, and
    gets the common start time (time.monotonic, shared by the processes of
    one machine). With `shared_memory`, each client passes its inputs and
    outputs through system shared memory regions of its own (written before
    each request, read after it), as a client on the server's host would.
    Returns (start, [(sent, answered, status) per request])."""
    return asyncio.run(_clients(url, model, specs, requests, expected, precision, concurrency, warmup_s,
                                duration_s, sync, shared_memory))


async def _clients(url, model, specs, requests, expected, precision, concurrency, warmup_s, duration_s,
                   sync, shared_memory: bool = False) -> tuple[float, list]:
    from tritonclient.http.aio import InferenceServerClient, InferInput
    from tritonclient.utils import InferenceServerException, np_to_triton_dtype

    client = InferenceServerClient(url.removeprefix("http://"), conn_limit=concurrency)
    regions = None
    prepared = []  # binary tensors, built once (through shared memory, each request writes its region)
    for arrays in ([] if shared_memory else requests):
        tensors = []
        for spec, a in zip(specs, arrays):
            t = InferInput(spec["name"], list(a.shape), np_to_triton_dtype(a.dtype))
            t.set_data_from_numpy(a, binary_data=True)
            tensors.append(t)
        prepared.append(tensors)
    if sync is None:
        t_start = time.monotonic() + 0.1
    else:
        ready, go = sync
        ready.put(os.getpid())
        t_start = await asyncio.to_thread(go.get, True, 300)
    t_end = t_start + warmup_s + duration_s
    records = []

    async def one_client(k: int) -> None:
        i = k
        await asyncio.sleep(max(0.0, t_start - time.monotonic()))
        while time.monotonic() < t_end:
            j = i % len(requests)
            sent = time.monotonic()
            try:
                if regions is None:
                    r = await client.infer(model, prepared[j])
                else:
                    inputs, outputs = regions.request(k, specs, requests[j])
                    r = await client.infer(model, inputs, outputs=outputs)
            except InferenceServerException as e:
                answered, status = time.monotonic(), f"http {e.status()}"
            except Exception as e:  # noqa: BLE001  counted, reported
                answered, status = time.monotonic(), type(e).__name__
            else:
                answered = time.monotonic()  # before the check: it is the client's work, not the server's
                got = r.as_numpy if regions is None else functools.partial(regions.output, k)
                ok = all(_close(got(n), ref, precision) for n, ref in expected[j].items())
                status = "ok" if ok else "mismatch"
            records.append((sent, answered, status))
            i += concurrency

    try:
        if shared_memory:
            regions = _ShmClients(client, concurrency, requests[0], expected[0])
            await regions.register()
        await asyncio.gather(*(one_client(k) for k in range(concurrency)))
    finally:
        if regions is not None:
            await regions.close()
        await client.close()
    return t_start, records


class _ShmClients:
    """Each client's input and output regions in system shared memory
    (tritonclient.utils.shared_memory), registered with the server."""

    def __init__(self, client, n: int, inputs: list[np.ndarray], outputs: dict):
        import tritonclient.utils.shared_memory as shm

        self.shm, self.client = shm, client
        # Each output's place in a client's output region: (dtype, shape, offset, bytes), by name.
        self.out_layout, offset = {}, 0
        for name, a in outputs.items():
            self.out_layout[name] = (a.dtype, a.shape, offset, a.nbytes)
            offset += a.nbytes
        in_bytes, out_bytes = sum(a.nbytes for a in inputs), offset
        tag = f"lt{os.getpid()}"
        self.names = [(f"{tag}-in{k}", f"{tag}-out{k}") for k in range(n)]
        self.handles, self.registered = [], []
        self.sizes = (in_bytes, out_bytes)
        try:
            for name_in, name_out in self.names:
                h_in = shm.create_shared_memory_region(name_in, "/" + name_in, in_bytes)
                self.handles.append(h_in)
                self.handles.append(shm.create_shared_memory_region(name_out, "/" + name_out, out_bytes))
        except BaseException:
            self._destroy()
            raise

    async def register(self) -> None:
        for (name_in, name_out) in self.names:
            for name, size in ((name_in, self.sizes[0]), (name_out, self.sizes[1])):
                await self.client.register_system_shared_memory(name, "/" + name, size)
                self.registered.append(name)

    def request(self, k: int, specs: list[dict], arrays: list[np.ndarray]) -> tuple[list, list]:
        from tritonclient.http.aio import InferInput, InferRequestedOutput
        from tritonclient.utils import np_to_triton_dtype

        name_in, name_out = self.names[k]
        self.shm.set_shared_memory_region(self.handles[2 * k], arrays)
        inputs, offset = [], 0
        for spec, a in zip(specs, arrays):
            t = InferInput(spec["name"], list(a.shape), np_to_triton_dtype(a.dtype))
            inputs.append(t.set_shared_memory(name_in, a.nbytes, offset))
            offset += a.nbytes
        outputs = []
        for name, (_, _, offset, nbytes) in self.out_layout.items():
            o = InferRequestedOutput(name, binary_data=True)
            o.set_shared_memory(name_out, nbytes, offset)  # returns None, unlike InferInput's
            outputs.append(o)
        return inputs, outputs

    def output(self, k: int, name: str) -> np.ndarray:
        dtype, shape, offset, _ = self.out_layout[name]
        return self.shm.get_contents_as_numpy(self.handles[2 * k + 1], dtype, shape, offset).copy()

    async def close(self) -> None:
        try:
            for name in self.registered:
                with contextlib.suppress(Exception):  # the server may be gone; the objects still go
                    await self.client.unregister_system_shared_memory(name)
        finally:
            self._destroy()

    def _destroy(self) -> None:
        for h in self.handles:
            with contextlib.suppress(Exception):
                self.shm.destroy_shared_memory_region(h)
        self.handles = []


def client_procs(cfg: LoadtestConfig) -> int:
    if cfg.client_procs:
        return cfg.client_procs
    return max(1, min(8, (os.cpu_count() or 1) // 4))


def split_clients(concurrency: int, procs: int) -> list[int]:
    return [n for n in (concurrency // procs + (i < concurrency % procs) for i in range(procs)) if n]
