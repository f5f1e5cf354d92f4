"""Shape buckets: one shape-specialized module per bucket.

A bucket is a batch size and, for a model whose config declares dimensions
besides the batch (`[[model.dims]]`, e.g. a sequence length), one length per
dimension. The buckets built are every batch bucket of the profile with
every combination of the dimensions' buckets; a request runs in the smallest
that holds it: its batch padded with zero rows, each dimension padded at the
end (the mask input with 0, the others with the dimension's `pad`), and the
outputs that carry a dimension cut back to the request's length.

A bucket's label names it in files and manifests: "8" for a batch-only
bucket (what every package had before dimensions existed), "8-seq128" with
a sequence dimension."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re

import numpy as np

from .config import DimSpec, InputSpec, Profile
from .errors import ShapeError


@functools.total_ordering
@dataclasses.dataclass(frozen=True, eq=False)
class Bucket:
    """Ordered by dimensions first, then batch: a package's buckets list each
    group of one shape with its batch sizes together, smallest first. A
    batch-only bucket equals (and hashes as) its batch size, so `pred.buckets
    == [1, 8]` and `pred.latency(8)` read as they did before dimensions."""

    dims: tuple[tuple[str, int], ...]
    batch: int

    def _key(self):
        return (self.dims, self.batch)

    def __eq__(self, other):
        if isinstance(other, Bucket):
            return self._key() == other._key()
        if isinstance(other, (int, np.integer)) and not isinstance(other, bool):
            return not self.dims and self.batch == other
        return NotImplemented

    def __hash__(self):
        return hash(self.batch) if not self.dims else hash(self._key())

    def __lt__(self, other):
        if not isinstance(other, Bucket):
            return NotImplemented
        return self._key() < other._key()

    @property
    def label(self) -> str:
        return "-".join([str(self.batch), *(f"{n}{v}" for n, v in self.dims)])

    def __str__(self) -> str:
        return self.label

def as_bucket(b: Bucket | int | str) -> Bucket:
    """A bucket from a Bucket, a batch size (a batch-only bucket) or a label."""
    if isinstance(b, Bucket):
        return b
    if isinstance(b, (int, np.integer)) and not isinstance(b, bool):
        return Bucket((), int(b))
    return parse(b)


_LABEL = re.compile(r"^(\d+)((?:-[A-Za-z][A-Za-z_]*\d+)*)$")


def parse(label: str | int) -> Bucket:
    """A bucket from its label ("8", "8-seq128")."""
    m = _LABEL.match(str(label))
    if not m:
        raise ShapeError("not a bucket label", repr(label), "BATCH or BATCH-NAMELENGTH, e.g. 8 or 8-seq128")
    dims = tuple((name, int(v)) for name, v in re.findall(r"-([A-Za-z][A-Za-z_]*)(\d+)", m.group(2)))
    return Bucket(dims, int(m.group(1)))


def all_buckets(profile: Profile, dims: tuple[DimSpec, ...]) -> list[Bucket]:
    """Every batch bucket of the profile with every combination of the
    dimensions' buckets, in order."""
    return _combine(profile.buckets, dims)


def every_bucket(buckets, dims: tuple[DimSpec, ...]) -> list[Bucket]:
    """Every combination of the batch sizes among `buckets` and the
    dimensions' lengths: what a whole package holds."""
    return _combine({b.batch for b in buckets}, dims)


def _combine(batches, dims: tuple[DimSpec, ...]) -> list[Bucket]:
    combos = itertools.product(*[[(d.name, v) for v in sorted(d.buckets)] for d in dims])
    return sorted(Bucket(tuple(c), b) for c in combos for b in batches)


def tuned_buckets(profile: Profile, dims: tuple[DimSpec, ...]) -> list[Bucket]:
    """The buckets tuned: those of the profile's tune_buckets, at every
    length of every dimension."""
    return [b for b in all_buckets(profile, dims) if b.batch in profile.tune_buckets]


def input_specs(inputs: tuple[InputSpec, ...], dims: tuple[DimSpec, ...], b: Bucket) -> tuple[InputSpec, ...]:
    """The inputs' per-sample shapes in bucket `b` (each dimension's length
    at its axis)."""
    values = dict(b.dims)
    out = []
    for spec in inputs:
        shape = list(spec.shape)
        for d in dims:
            if spec.name in d.inputs and d.name in values:
                shape[d.axis - 1] = values[d.name]
        out.append(dataclasses.replace(spec, shape=tuple(shape)))
    return tuple(out)


def shapes(inputs, dims, b: Bucket) -> dict[str, list[int]]:
    """name -> the input's whole shape in bucket `b` (the batch first)."""
    return {i.name: [b.batch, *i.shape] for i in input_specs(inputs, dims, b)}


def dims_from_manifest(entries) -> tuple[DimSpec, ...]:
    """The dimensions recorded in a manifest (`dims`, as dataclasses.asdict wrote them)."""
    return tuple(DimSpec(**{**e, "inputs": tuple(e["inputs"]), "buckets": tuple(e["buckets"]),
                            "outputs": tuple(e.get("outputs", ()))}) for e in entries or ())


def pad_value(d: DimSpec, input_name: str) -> float:
    return 0 if input_name == d.mask else d.pad


def lengths(arrays, names: list[str], dims: tuple[DimSpec, ...]) -> tuple[tuple[str, int], ...]:
    """A request's length along each dimension (its inputs must agree)."""
    out = []
    for d in dims:
        seen = {names[k]: int(a.shape[d.axis]) for k, a in enumerate(arrays) if names[k] in d.inputs}
        if len(set(seen.values())) > 1:
            raise ShapeError(f"inputs disagree on the length of dimension '{d.name}'", seen)
        out.append((d.name, next(iter(seen.values()))))
    return tuple(out)


def longest(part_lengths, dims: tuple[DimSpec, ...]) -> tuple[tuple[str, int], ...]:
    """The longest of several requests' lengths along each dimension."""
    return tuple((d.name, max(ls[k][1] for ls in part_lengths)) for k, d in enumerate(dims))


def fit(want: tuple[tuple[str, int], ...], dims: tuple[DimSpec, ...]) -> tuple[tuple[str, int], ...]:
    """The smallest bucket of each dimension that holds `want` (one line
    when one is longer than the largest)."""
    out = []
    for (name, n), d in zip(want, dims):
        fits = [v for v in sorted(d.buckets) if v >= n]
        if not fits:
            raise ShapeError(f"length {n} of dimension '{name}' is longer than its largest bucket", n,
                             f"at most {max(d.buckets)} (rebuild with a larger bucket: --dim-buckets "
                             f"{name}=...,{n})")
        out.append((name, fits[0]))
    return tuple(out)


def pad_to(a: np.ndarray, name: str, have, want, dims: tuple[DimSpec, ...]) -> np.ndarray:
    """Input `name` padded at the end of each dimension from lengths `have`
    to `want` (the array itself when nothing is padded)."""
    for (_, h), (_, w), d in zip(have, want, dims):
        if name in d.inputs and w > h:
            widths = [(0, 0)] * a.ndim
            widths[d.axis] = (0, w - h)
            a = np.pad(a, widths, constant_values=np.asarray(pad_value(d, name)).astype(a.dtype))
    return a


def cut(out: np.ndarray, name: str, have, dims: tuple[DimSpec, ...]) -> np.ndarray:
    """Output `name` cut back to a request's lengths `have` along each
    dimension that carries it."""
    index = [slice(None)] * out.ndim
    for (_, h), d in zip(have, dims):
        if name in d.outputs and d.axis < out.ndim:
            index[d.axis] = slice(0, h)
    return out[tuple(index)]
