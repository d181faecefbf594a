"""KV snapshots on the runner thread: extract a row, rebuild a row by reference, planes.

A `Snapshot` is the per-layer single-row caches of one finished row, extracted from the
batch cache (fresh contiguous arrays, `extract`) and never mutated afterwards. A new row
reuses it by reference: `row_from_snapshot` builds NEW cache objects whose arrays are
slices of the snapshot's arrays cut to the reused length (copy on write: MLX's slice
assignment rebinds the data of the array object it is applied to, and every append past
the slice's end reallocates, so the snapshot's arrays are never written). No deep copy.

Supported kinds, per layer: mlx-lm KVCache ("kv"), TurboQuantKVCache ("tq"),
DelayedTurboQuantKVCache ("dplain" before conversion, "dtq" after) and AffineKVCache
("affine"). RotatingKVCache (sliding windows) is refused: its buffer overwrites positions
in place, so a prefix of it is not recoverable; a model with such layers is served
without prefix reuse (`snapshot_kinds` returns None).

Planes for the SSD tier: `to_planes` gives (name, bytes, shape, dtype) per array
("<layer>.<plane>"); bfloat16 travels as its 16-bit pattern. `from_planes` restores a
Snapshot against the layer templates of the engine's own cache factory, so a file whose
kinds or settings differ from this engine's is refused (ValueError) and served as a miss.

Files are untrusted: `plane_layout` probes the model once (a one-token forward on fresh
caches) and records, per layer and per kind it can restore, every plane's shape (1, heads,
T, ...) and dtype, plus the header fields (cache kind, bits, head dim, rotation).
`PlaneLayout.check` refuses anything else — a wrong layer count, head count, head dim,
bit width (code plane width), dtype, an extra or missing plane, T != offset, an offset
that is not the token count — before a byte of a plane is decoded. It cannot tell two
layers of equal shape apart: a swapped file is the writer's doing (docs/prefix-cache.md).

Paired snapshots (engine.speculative.state): a snapshot of a row that speculates with a
stateful proposer (draft model, MTP head) also holds that proposer's state for the same
tokens (`paired`); its planes travel after the target's, under the proposer's prefix
("draft.0.keys", "mtp.hidden"), and `reusable_from` is the lowest length both parts can
be cut to. `header_extra` adds the pairing's header fields.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, make_prompt_cache

from tqserve.engine.kv.affine import AffineKVCache
from tqserve.engine.kv.affine import PLANES as AFFINE_PLANES
from tqserve.engine.kv.delayed import DelayedTurboQuantKVCache
from tqserve.engine.kv.rows import KvTensorRows
from tqserve.engine.kv.turboquant import PLANES as TQ_PLANES
from tqserve.engine.kv.turboquant import TurboQuantKVCache

PLAIN_PLANES = ("keys", "values")
_DTYPES = {mx.float32: "float32", mx.float16: "float16", mx.bfloat16: "bfloat16",
           mx.uint8: "uint8", mx.uint16: "uint16", mx.uint32: "uint32", mx.int32: "int32",
           mx.int8: "int8"}
_MX_DTYPES = {name: dtype for dtype, name in _DTYPES.items()}
_NP_NAMES = {"bfloat16": "uint16"}
_KIND_FIELDS = ("cache_kind", "k_bits", "v_bits", "head_dim", "rotation_id")


@attrs.frozen(kw_only=True)
class Snapshot:
    """One row's caches per layer (immutable by convention: nothing writes them)."""

    layers: tuple[Any, ...]
    kinds: tuple[str, ...]
    offset: int
    minimum_reusable_offset: int
    # the row's proposer state for the same tokens (engine.speculative.state.ProposerState)
    paired: Any = None

    @property
    def nbytes(self) -> int:
        paired = self.paired.nbytes if self.paired is not None else 0
        return sum(_planes_nbytes(_planes(c)) for c in self.layers) + paired

    @property
    def reusable_from(self) -> int:
        """The shortest reuse both the target's KV and the paired state can be cut to."""
        paired = self.paired.minimum if self.paired is not None else 0
        return max(self.minimum_reusable_offset, paired)


def _planes_nbytes(planes: Mapping[str, mx.array]) -> int:
    return sum(a.nbytes for a in planes.values())


def layer_kind(cache: Any) -> str | None:
    """The snapshot kind of one layer's cache; None if it cannot be snapshotted."""
    if type(cache) is KVCache:
        return "kv"
    if isinstance(cache, TurboQuantKVCache):
        return "tq"
    if isinstance(cache, DelayedTurboQuantKVCache):
        return "dtq" if cache.converted else "dplain"
    if isinstance(cache, AffineKVCache):
        return "affine"
    return None


def snapshot_kinds(template: Sequence[Any]) -> tuple[str, ...] | None:
    """Kinds of a fresh cache list; None if some layer cannot be snapshotted."""
    kinds = tuple(layer_kind(c) for c in template)
    return None if None in kinds else kinds  # type: ignore[return-value]


def _planes(cache: Any) -> dict[str, mx.array]:
    if type(cache) is KVCache:
        if cache.keys is None:
            return {}
        return {"keys": cache.keys[..., :cache.offset, :],
                "values": cache.values[..., :cache.offset, :]}
    if isinstance(cache, DelayedTurboQuantKVCache):
        return _planes(cache.inner)
    return cache.rows.valid_planes()


def extract_snapshot(batch_layers: Sequence[Any], index: int) -> Snapshot | None:
    """Row `index` of the batch caches as a Snapshot; None if a layer cannot be."""
    layers = tuple(c.extract(index) for c in batch_layers)
    kinds = tuple(layer_kind(c) for c in layers)
    if None in kinds:
        return None
    mx.eval([list(_planes(c).values()) for c in layers])
    offset = min(int(c.offset) for c in layers)
    boundary = max((c.minimum_reusable_offset for c in layers
                    if isinstance(c, DelayedTurboQuantKVCache)), default=0)
    return Snapshot(layers=layers, kinds=kinds, offset=offset,  # type: ignore[arg-type]
                    minimum_reusable_offset=boundary)


def snapshot_of_row(row_layers: Sequence[Any]) -> Snapshot | None:
    """A prefilling row's own caches as a Snapshot, by reference (new cache objects over
    slices of its valid positions: the row's later appends write past them or reallocate,
    so the snapshot never changes); None if a layer cannot be snapshotted."""
    kinds = tuple(layer_kind(c) for c in row_layers)
    if None in kinds:
        return None
    offset = min(int(c.offset) for c in row_layers)
    boundary = max((c.minimum_reusable_offset for c in row_layers
                    if isinstance(c, DelayedTurboQuantKVCache)), default=0)
    layers = tuple(_layer_from(c, kind, _cut(_planes(c), offset),
                               getattr(c, "minimum_reusable_offset", 0))
                   for c, kind in zip(row_layers, kinds))
    mx.eval([list(_planes(c).values()) for c in layers])
    return Snapshot(layers=layers, kinds=kinds, offset=offset,  # type: ignore[arg-type]
                    minimum_reusable_offset=boundary)


def _cut(planes: Mapping[str, mx.array], length: int) -> dict[str, mx.array]:
    return {name: a[:, :, :length] for name, a in planes.items()}


def _layer_from(template: Any, kind: str, planes: Mapping[str, mx.array],
                boundary: int) -> Any:
    """A NEW cache like `template` holding `planes` (already cut)."""
    if kind == "kv":
        cache = KVCache()
        if planes:
            cache.keys, cache.values = planes["keys"], planes["values"]
            cache.offset = int(cache.keys.shape[2])
        return cache
    if kind == "tq":
        return TurboQuantKVCache.of(template.config, KvTensorRows.from_planes(planes))
    if kind in ("dplain", "dtq"):
        inner = (TurboQuantKVCache.of(template.config, KvTensorRows.from_planes(planes))
                 if kind == "dtq" else _layer_from(None, "kv", planes, 0))
        return DelayedTurboQuantKVCache.of(template.quantized_kv_start, template.config, inner,
                                           boundary if kind == "dtq" else 0)
    if kind == "affine":
        affine = AffineKVCache(template.bits, template.group_size)
        affine.rows = KvTensorRows.from_planes(planes)
        return affine
    raise ValueError(f"unknown snapshot layer kind {kind!r}")


def row_from_snapshot(snapshot: Snapshot, length: int) -> list[Any]:
    """New per-layer caches holding the snapshot's first `length` positions, by reference."""
    if not snapshot.minimum_reusable_offset <= length <= snapshot.offset:
        raise ValueError(f"cannot reuse {length} positions of a snapshot of {snapshot.offset} "
                         f"with boundary {snapshot.minimum_reusable_offset}")
    out = []
    for cache, kind in zip(snapshot.layers, snapshot.kinds):
        boundary = getattr(cache, "minimum_reusable_offset", 0)
        out.append(_layer_from(cache, kind, _cut(_planes(cache), length), boundary))
    return out


def dtype_name(array: mx.array) -> str:
    """An array's dtype as the SSD format names it ("float32", "bfloat16", ...)."""
    return _DTYPES[array.dtype]


def array_plane(name: str, array: mx.array) -> tuple[str, bytes, tuple[int, ...], str]:
    """One array as an SSD plane: (name, raw bytes, shape, dtype)."""
    dtype = _DTYPES[array.dtype]
    raw = array.view(mx.uint16) if array.dtype == mx.bfloat16 else array
    return name, np.array(raw).tobytes(), tuple(array.shape), dtype


def plane_array(name: str, data: bytes, shape: Sequence[int], dtype: str) -> mx.array:
    """The array of one SSD plane; ValueError if its dtype or byte count does not fit."""
    if dtype not in _MX_DTYPES:
        raise ValueError(f"unsupported plane dtype {dtype}")
    stored = "uint16" if dtype == "bfloat16" else dtype
    if len(data) != math.prod(shape) * np.dtype(stored).itemsize:
        raise ValueError(f"plane {name} holds {len(data)} bytes for {tuple(shape)} {dtype}")
    array = mx.array(np.frombuffer(data, dtype=stored).reshape(tuple(shape)))
    return array.view(mx.bfloat16) if dtype == "bfloat16" else array


def to_planes(snapshot: Snapshot) -> list[tuple[str, bytes, tuple[int, ...], str]]:
    """Every array as (name, raw bytes, shape, dtype) for the SSD tier, the paired
    proposer state's last."""
    out = [array_plane(f"{i}.{name}", array) for i, cache in enumerate(snapshot.layers)
           for name, array in _planes(cache).items()]
    if snapshot.paired is not None:
        out += snapshot.paired.planes()
    return out


def layer_kinds_text(snapshot: Snapshot) -> str:
    """The kinds as one header string, e.g. "kv,kv" or "dtq,dtq"."""
    return ",".join(snapshot.kinds)


def header_extra(snapshot: Snapshot) -> dict[str, int | str]:
    """The header's `extra` fields of a snapshot: its layer kinds, and what its paired
    proposer state is (engine.speculative.state)."""
    extra: dict[str, int | str] = {"layer_kinds": layer_kinds_text(snapshot)}
    if snapshot.paired is not None:
        extra.update(snapshot.paired.header_fields())
    return extra


def from_planes(template: Sequence[Any], kinds_text: str, offset: int, boundary: int,
                planes: Mapping[str, tuple[bytes, Sequence[int], str]],
                layout: PlaneLayout | None = None) -> Snapshot:
    """Rebuild a Snapshot against a fresh cache list; ValueError if anything disagrees
    (checked against `layout` first, before any plane is decoded, when given)."""
    if layout is not None:
        layout.check(layer_kinds=kinds_text, offset=offset,
                     planes={name: (shape, dtype) for name, (_, shape, dtype) in planes.items()})
        for name, (data, shape, dtype) in planes.items():
            if len(data) != math.prod(shape) * np.dtype(_NP_NAMES.get(dtype, dtype)).itemsize:
                raise ValueError(f"plane {name} holds {len(data)} bytes for {tuple(shape)} "
                                 f"{dtype}")
    kinds = tuple(kinds_text.split(","))
    if len(kinds) != len(template):
        raise ValueError(f"snapshot has {len(kinds)} layers, the model {len(template)}")
    expected = snapshot_kinds(template)
    if expected is None:
        raise ValueError("this model's caches cannot be restored from snapshots")
    layers = []
    for i, (kind, fresh, want) in enumerate(zip(kinds, template, expected)):
        if kind != want and {kind, want} != {"dplain", "dtq"}:
            raise ValueError(f"layer {i}: snapshot kind {kind} != engine kind {want}")
        names = {"kv": PLAIN_PLANES, "dplain": PLAIN_PLANES, "tq": TQ_PLANES,
                 "dtq": TQ_PLANES, "affine": AFFINE_PLANES}[kind]
        arrays = {}
        for name in names:
            if f"{i}.{name}" not in planes:
                raise ValueError(f"plane {i}.{name} is missing")
            data, shape, dtype = planes[f"{i}.{name}"]
            arrays[name] = plane_array(f"{i}.{name}", data, shape, dtype)
            if len(shape) != 4 or shape[0] != 1 or shape[2] != offset:
                raise ValueError(f"plane {i}.{name} of shape {tuple(shape)} for offset {offset}")
        layers.append(_layer_from(fresh, kind, arrays, boundary))
    mx.eval([list(_planes(c).values()) for c in layers])
    return Snapshot(layers=tuple(layers), kinds=kinds, offset=offset,
                    minimum_reusable_offset=boundary)


def describe(snapshot: Snapshot) -> dict[str, Any]:
    """The header fields of the SSD format that depend on the cache kind."""
    tq = next((c for c in snapshot.layers if isinstance(c, (TurboQuantKVCache,
                                                            DelayedTurboQuantKVCache))), None)
    if tq is not None:
        config = tq.config
        return {"cache_kind": "turboquant", "k_bits": config.k_bits, "v_bits": config.v_bits,
                "head_dim": config.head_dim, "rotation_id": f"{config.rotation}:{config.seed}"}
    affine = next((c for c in snapshot.layers if isinstance(c, AffineKVCache)), None)
    if affine is not None:
        # key_wq packs head_dim values of `bits` bits into uint32 words.
        words = _planes(affine).get("key_wq")
        head_dim = int(words.shape[-1]) * 32 // affine.bits if words is not None else 1
        return {"cache_kind": "affine", "k_bits": affine.bits, "v_bits": affine.bits,
                "head_dim": head_dim, "rotation_id": None}
    first = _planes(snapshot.layers[0])
    head_dim = int(first["keys"].shape[-1]) if "keys" in first else 1
    return {"cache_kind": "kv", "k_bits": None, "v_bits": None, "head_dim": head_dim,
            "rotation_id": None}


@attrs.frozen(kw_only=True)
class PlaneLayout:
    """What a snapshot of this engine must hold (see the module doc). Plain data: `check`
    runs on any thread, no MLX."""

    # per layer: kind -> plane name -> (shape without the T axis: (1, heads, ...), dtype)
    layers: tuple[dict[str, dict[str, tuple[tuple[int, ...], str]]], ...]
    fields: dict[str, Any]

    def check(self, *, layer_kinds: str, offset: int,
              planes: Mapping[str, tuple[Sequence[int], str]],
              num_tokens: int | None = None, fields: Mapping[str, Any] | None = None) -> None:
        """ValueError naming the first thing that this engine's model cannot restore."""
        if offset < 1 or (num_tokens is not None and offset != num_tokens):
            raise ValueError(f"offset {offset} for {num_tokens} token ids")
        for name, want in self.fields.items():
            if fields is not None and fields.get(name) != want:
                raise ValueError(f"{name} {fields.get(name)!r:.40} != this engine's {want!r}")
        kinds = layer_kinds.split(",")
        if len(kinds) != len(self.layers):
            raise ValueError(f"{len(kinds)} layers, the model has {len(self.layers)}")
        expected = set()
        for i, (kind, variants) in enumerate(zip(kinds, self.layers)):
            if kind not in variants:
                raise ValueError(f"layer {i}: kind {kind!r:.20} is not one of {sorted(variants)}")
            for name, (pattern, dtype) in variants[kind].items():
                full = f"{i}.{name}"
                expected.add(full)
                if full not in planes:
                    raise ValueError(f"plane {full} is missing")
                shape, got = planes[full]
                want = (*pattern[:2], offset, *pattern[2:])
                if tuple(shape) != want or got != dtype:
                    raise ValueError(f"plane {full} is {tuple(shape)} {got}, this model needs "
                                     f"{want} {dtype}")
        unknown = sorted(set(planes) - expected)
        if unknown:
            raise ValueError(f"unexpected planes {unknown[:3]}")

    def check_header(self, header: Any,
                     planes: Mapping[str, tuple[Sequence[int], str]] | None = None) -> None:
        """`check` on a storage SnapshotHeader (duck-typed: engine never imports storage);
        `planes`: the target's planes when the header holds others too (a paired file)."""
        if planes is None:
            planes = {spec.name: (spec.shape, spec.dtype) for spec in header.planes}
        self.check(layer_kinds=str(header.extra.get("layer_kinds", "")), offset=header.offset,
                   num_tokens=len(header.token_ids),
                   fields={name: getattr(header, name) for name in _KIND_FIELDS},
                   planes=planes)


def _probe(fresh: Any, kind: str, keys: mx.array, values: mx.array) -> Any:
    """A new cache of `kind` shaped like `fresh`, holding one position."""
    if kind in ("kv", "dplain"):
        cache: Any = KVCache()
    elif kind in ("tq", "dtq"):
        cache = TurboQuantKVCache.of(fresh.config)
    else:
        cache = AffineKVCache(fresh.bits, fresh.group_size)
    cache.update_and_fetch(keys, values)
    return cache


def plane_layout(model: Any, template: Sequence[Any]) -> PlaneLayout | None:
    """Probe `model` once (one token) for the planes its snapshots hold; None if this
    cache list cannot be snapshotted. Runs on the runner thread."""
    kinds = snapshot_kinds(template)
    if kinds is None:
        return None
    plain = make_prompt_cache(model)
    model(mx.array([[0]]), cache=plain)
    layers, probes = [], []
    for i, (fresh, kind) in enumerate(zip(template, kinds)):
        written = _planes(plain[i])
        variants = {}
        for variant in ({"dplain", "dtq"} if kind in ("dplain", "dtq") else {kind}):
            probe = _probe(fresh, variant, written["keys"], written["values"])
            mx.eval(list(_planes(probe).values()))
            variants[variant] = {name: ((*a.shape[:2], *a.shape[3:]), _DTYPES[a.dtype])
                                 for name, a in _planes(probe).items()}
            if variant == kind:
                probes.append(probe if kind not in ("dplain", "dtq") else
                              DelayedTurboQuantKVCache.of(fresh.quantized_kv_start,
                                                          fresh.config, probe, 0))
        layers.append(variants)
    described = describe(Snapshot(layers=tuple(probes), kinds=kinds, offset=1,
                                  minimum_reusable_offset=0))
    return PlaneLayout(layers=tuple(layers),
                       fields={name: described[name] for name in _KIND_FIELDS})
