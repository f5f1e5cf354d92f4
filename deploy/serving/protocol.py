"""The Open Inference Protocol (KServe v2) over HTTP: the request's data model
and the tensor codec, JSON and the binary tensor data extension.

What is not written here: the JSON schema is checked by pydantic (the models
below mirror the protocol's `$inference_request`), and the datatype names
(FP32, FP16, ...) and their numpy types come from `tritonclient.utils`, the
standard v2 client's own tables, so the server and the clients cannot disagree.
What is: checking a request against the package's manifest, and slicing the
binary part of a body (`Inference-Header-Content-Length` bytes of JSON, then
each binary tensor in the order of the JSON's tensors, raw little-endian,
row-major), about 150 lines.

Unknown keys: the request's top level ignores keys it does not know (the
protocol is extensible, and clients add their own: KServe's sends
`model_name`, which must then name the URL's model); inside a tensor they are
refused, where a misspelled key ("paramters") would change the meaning.
`parameters` may be null anywhere.

Every problem with a request raises `RequestError` (HTTP 400) with a
"what | got | expected" message.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, StrictInt, ValidationError
from tritonclient.utils import np_to_triton_dtype, triton_to_np_dtype

from ..errors import RequestError, ShapeError
from ..runtime import check_range

HEADER_LENGTH = "Inference-Header-Content-Length"
EXTENSIONS = ["binary_tensor_data", "system_shared_memory"]


class _Tensor(BaseModel):
    # Unknown keys in a tensor are refused, as in the project's configs: a
    # misspelled "paramters" should not be ignored silently.
    model_config = ConfigDict(extra="forbid")


class RequestInput(_Tensor):
    name: str
    shape: list[StrictInt]
    datatype: str
    parameters: dict[str, Any] | None = None
    data: list[Any] | None = None  # row-major, flat or nested


class RequestOutput(_Tensor):
    name: str
    parameters: dict[str, Any] | None = None


class InferenceRequest(BaseModel):
    # The top level ignores unknown keys: the protocol's extensions and
    # other clients' fields (see the module docstring).
    model_config = ConfigDict(extra="ignore")

    id: str | None = None
    model_name: str | None = None  # KServe's client sends it; must be the URL's model
    model_version: str | None = None
    parameters: dict[str, Any] | None = None
    inputs: list[RequestInput]
    outputs: list[RequestOutput] | None = None


@dataclass
class Decoded:
    """A checked request: one array per manifest input, in manifest order."""

    arrays: list[np.ndarray]
    batch: int
    # (name, as binary, shared-memory parameters or None) in the order to answer
    outputs: list[tuple[str, bool, dict | None]]
    id: str | None
    timeout_s: float | None  # the request's own `timeout` parameter (microseconds in the protocol)


@functools.lru_cache(maxsize=64)  # a few dtypes, looked up for every tensor of every request
def datatype(dtype: str) -> str:
    """Manifest dtype ('float32') -> protocol datatype ('FP32')."""
    return np_to_triton_dtype(np.dtype(dtype))


@functools.lru_cache(maxsize=64)
def _wire_dtype(name: str) -> np.dtype:
    """Protocol datatype ('FP32') -> the little-endian numpy dtype of its bytes."""
    return np.dtype(triton_to_np_dtype(name)).newbyteorder("<")


def tensor_metadata(specs: list[dict]) -> list[dict]:
    """Manifest inputs/outputs -> `$metadata_tensor`s; -1 is the batch dimension."""
    return [{"name": s["name"], "datatype": datatype(s["dtype"]), "shape": [-1, *s["shape"]]} for s in specs]


def _first_error(e: ValidationError) -> str:
    err = e.errors(include_url=False)[0]
    where = ".".join(str(p) for p in err["loc"])
    return f"{where}: {err['msg']}" if where else err["msg"]


def parse_header(text: bytes) -> InferenceRequest:
    try:
        return InferenceRequest.model_validate_json(text)
    except ValidationError as e:
        if e.errors()[0]["type"] == "json_invalid":
            raise RequestError("malformed JSON", _first_error(e), "a JSON inference request") from None
        raise RequestError("malformed inference request", _first_error(e),
                           "a KServe v2 inference request ({inputs: [{name, shape, datatype, data}]})") from None


# Python types of the JSON values each manifest dtype kind takes: ints are
# fine for a float input, floats are not for an int input, booleans only for
# BOOL (numpy would read true as 1).
_JSON_TYPES = {"f": {int, float}, "i": {int}, "u": {int}, "b": {bool}}


def _value_types(data: list) -> set[type]:
    """The types of the leaves of nested lists (at C speed for flat ones)."""
    types = set(map(type, data))
    if list in types:
        types.discard(list)
        for x in data:
            if type(x) is list:
                types |= _value_types(x)
    return types


def _limits(dtype: np.dtype) -> tuple[float, float] | tuple[int, int]:
    if dtype.kind == "f":
        return float(np.finfo(dtype).min), float(np.finfo(dtype).max)
    return int(np.iinfo(dtype).min), int(np.iinfo(dtype).max)


def _range(dtype: np.dtype) -> str:
    low, high = _limits(dtype)
    return f"values in [{low:g}, {high:g}] for {datatype(dtype.name)}" if dtype.kind == "f" else \
        f"values in [{low}, {high}] for {datatype(dtype.name)}"


def _from_json(name: str, data: list, dtype: np.dtype, shape: list[int]) -> np.ndarray:
    types = _value_types(data)
    wrong = types - _JSON_TYPES.get(dtype.kind, set())
    if wrong:
        raise RequestError(f"input '{name}' data has values of the wrong kind",
                           ", ".join(sorted(t.__name__ for t in wrong)),
                           "true or false" if dtype.kind == "b" else f"numbers that fit {datatype(dtype.name)}")
    try:
        with np.errstate(over="raise"):
            a = np.asarray(data, dtype=dtype)
    except (OverflowError, FloatingPointError):  # an int out of range / a float beyond the dtype's max
        low, high = _limits(dtype)
        bad = next(v for v in np.asarray(data, dtype=object).ravel() if not low <= v <= high)
        got = str(bad) if len(str(bad)) <= 24 else f"{bad:.6g}"
        raise RequestError(f"input '{name}' has a value out of range", got, _range(dtype)) from None
    except (ValueError, TypeError):
        raise RequestError(f"input '{name}' data is not a rectangular array of numbers", "ragged or mixed lists",
                           f"{math.prod(shape)} numbers, flat or nested") from None
    if dtype.kind == "f" and not np.isfinite(a).all():  # NaN, Infinity or 1e400: not JSON numbers
        bad = a.ravel()[np.flatnonzero(~np.isfinite(a.ravel()))[0]]
        raise RequestError(f"input '{name}' has a value that is not a finite number", str(bad),
                           "finite numbers (binary data for NaN or infinity)")
    if a.size != math.prod(shape):
        raise RequestError(f"input '{name}' data does not match its shape", f"{a.size} values",
                           f"{math.prod(shape)} for shape {shape}")
    return a.reshape(shape)


def decode(body: bytes, header_length: str | None, inputs: list[dict], outputs: list[dict],
           model: str | None = None, version: str | None = None, regions=None) -> Decoded:
    """A request body (and its Inference-Header-Content-Length, if any) ->
    arrays checked against the manifest's inputs. `model` and `version`, the
    URL's, are what the body's `model_name`/`model_version` must say if given.
    `regions` (a `deploy.serving.shm.Regions`): the registered shared memory that
    inputs and outputs may name; None refuses them."""
    binary = memoryview(b"")
    if header_length is not None:
        try:
            n = int(header_length)
        except ValueError:
            raise RequestError(f"invalid {HEADER_LENGTH}", repr(header_length), "an integer") from None
        if not 0 < n <= len(body):
            raise RequestError(f"{HEADER_LENGTH} does not fit the body", n, f"1 to {len(body)}")
        binary = memoryview(body)[n:]
        body = body[:n]
    req = parse_header(body)
    if model is not None and req.model_name and req.model_name != model:
        raise RequestError("model_name in the body is not the URL's model", repr(req.model_name), repr(model))
    if version is not None and req.model_version and req.model_version != version:
        raise RequestError("model_version in the body is not the URL's version", repr(req.model_version),
                           repr(version))
    specs = {s["name"]: s for s in inputs}
    given: dict[str, np.ndarray] = {}
    offset = 0
    for t in req.inputs:
        spec = specs.get(t.name)
        if spec is None:
            raise RequestError("unknown input name", repr(t.name), "one of " + ", ".join(map(repr, specs)))
        if t.name in given:
            raise RequestError("input given twice", repr(t.name), "each input once")
        want = datatype(spec["dtype"])
        if t.datatype != want:
            raise RequestError(f"input '{t.name}' has the wrong datatype", t.datatype, want)
        if len(t.shape) != len(spec["shape"]) + 1 or t.shape[0] < 1 or any(
                w != h and not (w == -1 and h >= 1) for w, h in zip(spec["shape"], t.shape[1:])):  # -1: any length
            raise RequestError(f"input '{t.name}' has the wrong shape", t.shape, ["N >= 1", *spec["shape"]])
        params = t.parameters or {}
        dtype = _wire_dtype(want)
        size = params.get("binary_data_size")
        if "shared_memory_region" in params:
            if regions is None:
                raise RequestError("shared-memory tensors are not supported here", t.name, "data or binary_data_size")
            if t.data is not None or size is not None:
                raise RequestError(f"input '{t.name}' has data twice", "shared memory and data or binary_data_size",
                                   "one of them")
            a = regions.input(params, t.name, t.shape, dtype)  # read when its batch is staged (or below)
        elif size is not None:
            if t.data is not None:
                raise RequestError(f"input '{t.name}' has data twice", "both 'data' and binary_data_size",
                                   "one of them")
            nbytes = math.prod(t.shape) * dtype.itemsize
            # An int, not 8.0: a float offset would fail later, as a 500.
            if not isinstance(size, int) or isinstance(size, bool) or size != nbytes:
                raise RequestError(f"input '{t.name}' binary_data_size does not match its shape and datatype",
                                   repr(size), f"the integer {nbytes}")
            if offset + size > len(binary):
                raise RequestError("the binary part of the body is shorter than the inputs' binary_data_size",
                                   f"{len(binary)} bytes", f"at least {offset + size}")
            a = np.frombuffer(binary, dtype, count=math.prod(t.shape), offset=offset).reshape(t.shape)
            offset += size
        elif t.data is not None:
            a = _from_json(t.name, t.data, dtype, t.shape)
        else:
            raise RequestError(f"input '{t.name}' has no data", None, "'data' or parameters.binary_data_size")
        if "range" in spec:  # an id outside the table it indexes (passes/onnx_indices.py): this request's 400,
            a = np.asarray(a)  # not its batch's (a shared-memory input is read here, not at staging)
            try:
                check_range(spec, a)
            except ShapeError as e:
                raise RequestError(e.what, e.got, e.expected) from None
        given[t.name] = a
    if offset != len(binary):
        raise RequestError("the binary part of the body is longer than the inputs' binary_data_size",
                           f"{len(binary)} bytes", f"{offset}")
    missing = [n for n in specs if n not in given]
    if missing:
        raise RequestError(f"missing input(s) {', '.join(map(repr, missing))}", ", ".join(map(repr, given)) or "none",
                           ", ".join(map(repr, specs)))
    batches = {a.shape[0] for a in given.values()}
    if len(batches) != 1:
        raise RequestError("inputs disagree on the batch size", sorted(batches), "one batch size")
    params = req.parameters or {}
    return Decoded(
        arrays=[given[n] for n in specs],
        batch=batches.pop(),
        outputs=_wanted_outputs(req, params, outputs, regions),
        id=req.id,
        timeout_s=_timeout(params),
    )


def _flag(params: dict, key: str, default: bool) -> bool:
    value = params.get(key, default)
    if not isinstance(value, bool):
        raise RequestError(f"parameter {key} must be true or false", repr(value), "a boolean")
    return value


def _wanted_outputs(req: InferenceRequest, params: dict, outputs: list[dict],
                    regions=None) -> list[tuple[str, bool, dict | None]]:
    # tritonclient asks for binary outputs with binary_data_output when it
    # names no outputs, and with binary_data per output when it does.
    default = _flag(params, "binary_data_output", False)
    names = [o["name"] for o in outputs]
    if not req.outputs:
        return [(n, default, None) for n in names]
    out = []
    for o in req.outputs:
        if o.name not in names:
            raise RequestError("unknown output name", repr(o.name), "one of " + ", ".join(map(repr, names)))
        p = o.parameters or {}
        shm = None
        if "shared_memory_region" in p:
            if regions is None:
                raise RequestError("shared-memory tensors are not supported here", o.name, "data or binary_data")
            regions.check_output(p, o.name)
            shm = {k: p[k] for k in ("shared_memory_region", "shared_memory_byte_size", "shared_memory_offset") if k in p}
        out.append((o.name, _flag(p, "binary_data", default), shm))
    return out


def _timeout(params: dict) -> float | None:
    value = params.get("timeout")
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise RequestError("parameter timeout must be a positive number of microseconds", repr(value))
    return value / 1e6


def encode(model: str, version: str, request_id: str | None,
           outputs: list[tuple], regions=None) -> tuple[bytes, int | None]:
    """(body, header length or None): `$inference_response`, each output
    (name, array, binary[, shared-memory parameters]) as JSON data, binary
    after the JSON when asked, or written into its shared-memory region
    (`regions`). In JSON data, NaN and infinities are null (binary outputs
    keep them)."""
    tensors, blobs = [], []
    for name, a, binary, *rest in outputs:
        shm = rest[0] if rest else None
        t: dict[str, Any] = {"name": name, "datatype": np_to_triton_dtype(a.dtype), "shape": list(a.shape)}
        if shm is not None or binary:
            raw = np.ascontiguousarray(a, a.dtype.newbyteorder("<")).tobytes()
        if shm is not None:
            regions.write(shm, name, raw)
            t["parameters"] = {**shm, "shared_memory_byte_size": len(raw)}
        elif binary:
            t["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        else:
            t["data"] = a.ravel().tolist()
            if a.dtype.kind == "f" and not np.isfinite(a).all():
                # JSON has no NaN or Infinity (json.dumps would write both,
                # which strict parsers refuse): null, as JavaScript writes them.
                t["data"] = [v if math.isfinite(v) else None for v in t["data"]]
        tensors.append(t)
    response: dict[str, Any] = {"model_name": model, "model_version": version}
    if request_id is not None:
        response["id"] = request_id
    response["outputs"] = tensors
    header = json.dumps(response, separators=(",", ":"), allow_nan=False).encode()
    if not blobs:
        return header, None
    return b"".join([header, *blobs]), len(header)
