"""The Open Inference Protocol (KServe v2) over HTTP: the request's data model
and the tensor codec, JSON and the binary tensor data extension.

What is not written here: the JSON schema is checked by pydantic (the models
below mirror the protocol's `$inference_request`), and the datatype names
(FP32, FP16, ...) and their numpy types come from `tritonclient.utils`, the
standard v2 client's own tables, so the server and the clients cannot disagree.
What is: checking a request against the package's manifest, and slicing the
binary part of a body (`Inference-Header-Content-Length` bytes of JSON, then
each binary tensor in the order of the JSON's tensors, raw little-endian,
row-major), about 100 lines.

Every problem with a request raises `RequestError` (HTTP 400) with a
"what | got | expected" message.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, StrictInt, ValidationError
from tritonclient.utils import np_to_triton_dtype, triton_to_np_dtype

from .errors import RequestError

HEADER_LENGTH = "Inference-Header-Content-Length"
EXTENSIONS = ["binary_tensor_data"]


class _Strict(BaseModel):
    # Unknown keys are refused, as in the project's configs: a misspelled
    # "paramters" should not be ignored silently.
    model_config = ConfigDict(extra="forbid")


class RequestInput(_Strict):
    name: str
    shape: list[StrictInt]
    datatype: str
    parameters: dict[str, Any] = {}
    data: list[Any] | None = None  # row-major, flat or nested


class RequestOutput(_Strict):
    name: str
    parameters: dict[str, Any] = {}


class InferenceRequest(_Strict):
    id: str | None = None
    parameters: dict[str, Any] = {}
    inputs: list[RequestInput]
    outputs: list[RequestOutput] | None = None


@dataclass
class Decoded:
    """A checked request: one array per manifest input, in manifest order."""

    arrays: list[np.ndarray]
    batch: int
    outputs: list[tuple[str, bool]]  # (name, as binary) in the order to answer
    id: str | None
    timeout_s: float | None  # the request's own `timeout` parameter (microseconds in the protocol)


def datatype(dtype: str) -> str:
    """Manifest dtype ('float32') -> protocol datatype ('FP32')."""
    return np_to_triton_dtype(np.dtype(dtype))


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


# JSON numbers numpy may turn into each manifest dtype: ints are fine for a
# float input, floats are not for an int input, only true/false for BOOL.
_JSON_KINDS = {"f": "fiu", "i": "iu", "u": "iu", "b": "b"}


def _from_json(name: str, data: list, dtype: np.dtype, shape: list[int]) -> np.ndarray:
    try:
        raw = np.asarray(data)
    except (ValueError, TypeError):
        raise RequestError(f"input '{name}' data is not a rectangular array of numbers", "ragged or mixed lists",
                           f"{math.prod(shape)} numbers, flat or nested") from None
    if raw.size and raw.dtype.kind not in _JSON_KINDS.get(dtype.kind, ""):
        raise RequestError(f"input '{name}' data has values of the wrong kind", f"{raw.dtype.kind!r} ({raw.dtype})",
                           f"numbers that fit {datatype(dtype.name)}")
    if raw.size != math.prod(shape):
        raise RequestError(f"input '{name}' data does not match its shape", f"{raw.size} values",
                           f"{math.prod(shape)} for shape {shape}")
    return raw.astype(dtype).reshape(shape)


def decode(body: bytes, header_length: str | None, inputs: list[dict], outputs: list[dict]) -> Decoded:
    """A request body (and its Inference-Header-Content-Length, if any) ->
    arrays checked against the manifest's inputs."""
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
        if len(t.shape) != len(spec["shape"]) + 1 or list(t.shape[1:]) != list(spec["shape"]) or t.shape[0] < 1:
            raise RequestError(f"input '{t.name}' has the wrong shape", t.shape, ["N >= 1", *spec["shape"]])
        if "shared_memory_region" in t.parameters:
            raise RequestError("shared-memory tensors are not supported", t.name, "data or binary_data_size")
        dtype = np.dtype(triton_to_np_dtype(want)).newbyteorder("<")
        size = t.parameters.get("binary_data_size")
        if size is not None:
            if t.data is not None:
                raise RequestError(f"input '{t.name}' has data twice", "both 'data' and binary_data_size",
                                   "one of them")
            nbytes = math.prod(t.shape) * dtype.itemsize
            if size != nbytes or isinstance(size, bool):
                raise RequestError(f"input '{t.name}' binary_data_size does not match its shape and datatype",
                                   size, nbytes)
            if offset + size > len(binary):
                raise RequestError("the binary part of the body is shorter than the inputs' binary_data_size",
                                   f"{len(binary)} bytes", f"at least {offset + size}")
            a = np.frombuffer(binary, dtype, count=math.prod(t.shape), offset=offset).reshape(t.shape)
            offset += size
        elif t.data is not None:
            a = _from_json(t.name, t.data, dtype, t.shape)
        else:
            raise RequestError(f"input '{t.name}' has no data", None, "'data' or parameters.binary_data_size")
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
    return Decoded(
        arrays=[given[n] for n in specs],
        batch=batches.pop(),
        outputs=_wanted_outputs(req, outputs),
        id=req.id,
        timeout_s=_timeout(req.parameters),
    )


def _flag(params: dict, key: str, default: bool) -> bool:
    value = params.get(key, default)
    if not isinstance(value, bool):
        raise RequestError(f"parameter {key} must be true or false", repr(value), "a boolean")
    return value


def _wanted_outputs(req: InferenceRequest, outputs: list[dict]) -> list[tuple[str, bool]]:
    # tritonclient asks for binary outputs with binary_data_output when it
    # names no outputs, and with binary_data per output when it does.
    default = _flag(req.parameters, "binary_data_output", False)
    names = [o["name"] for o in outputs]
    if not req.outputs:
        return [(n, default) for n in names]
    out = []
    for o in req.outputs:
        if o.name not in names:
            raise RequestError("unknown output name", repr(o.name), "one of " + ", ".join(map(repr, names)))
        out.append((o.name, _flag(o.parameters, "binary_data", default)))
    return out


def _timeout(params: dict) -> float | None:
    value = params.get("timeout")
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise RequestError("parameter timeout must be a positive number of microseconds", repr(value))
    return value / 1e6


def encode(model: str, version: str, request_id: str | None,
           outputs: list[tuple[str, np.ndarray, bool]]) -> tuple[bytes, int | None]:
    """(body, header length or None): `$inference_response`, each output as
    JSON data or, when asked, binary after the JSON."""
    tensors, blobs = [], []
    for name, a, binary in outputs:
        t: dict[str, Any] = {"name": name, "datatype": np_to_triton_dtype(a.dtype), "shape": list(a.shape)}
        if binary:
            raw = np.ascontiguousarray(a, a.dtype.newbyteorder("<")).tobytes()
            t["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        else:
            t["data"] = a.ravel().tolist()
        tensors.append(t)
    response: dict[str, Any] = {"model_name": model, "model_version": version}
    if request_id is not None:
        response["id"] = request_id
    response["outputs"] = tensors
    header = json.dumps(response, separators=(",", ":")).encode()
    if not blobs:
        return header, None
    return b"".join([header, *blobs]), len(header)
