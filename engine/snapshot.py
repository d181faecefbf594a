"""KV snapshots on the runner thread: extract a row, rebuild a row by reference, planes.

A `Snapshot` is the per-layer single-row caches of one finished row, extracted from the
batch cache (fresh contiguous arrays, `extract`) and never mutated afterwards. A new row
reuses it by reference: `row_from_snapshot` builds NEW cache objects whose arrays are
slices of the snapshot's arrays cut to the reused length (copy on write: MLX's slice
assignment rebinds the data of the array object it is applied to, and every append past
the slice's end reallocates, so the snapshot's arrays are never written). No deep copy.

Supported kinds, per layer: mlx-lm KVCache ("kv"), TurboQuantKVCache ("tq"),
DelayedTurboQuantKVCache ("dplain" before conversion, "dtq" after) and AffineKVCache
("affine"), and mlx-lm's ArraysCache ("state": the recurrent state of a hybrid model's
linear-attention layers, e.g. qwen3_5's gated delta-net). Recurrent state cannot be cut
back to a shorter prefix, so a snapshot holding a "state" layer is reusable only at its
exact boundary (`minimum_reusable_offset` == offset: the prefix index then reuses it only
when a new prompt extends all of its tokens). Its planes are the state arrays ("s0", "s1"),
with no position axis. A model with only recurrent layers (no attention layer counts its
positions) and RotatingKVCache (sliding windows: the buffer overwrites positions in place,
so neither a prefix nor, through the batch's padding, the exact boundary is recoverable)
are refused: such models are served without prefix reuse (`snapshot_kinds` returns None).

Planes for the SSD tier: `to_planes` gives (name, bytes, shape, dtype) per array
("<layer>.<plane>"); bfloat16 travels as its 16-bit pattern. `from_planes` restores a
Snapshot against the layer templates of the engine's own cache factory, so a file whose
kinds or settings differ from this engine's is refused (ValueError) and served as a miss.

Files are untrusted: engine.snapshot_layout checks a file's planes against what this
model's snapshots hold before a byte of a plane is decoded.

Paired snapshots (engine.speculative.state): a snapshot of a row that speculates with a
stateful proposer (draft model, MTP head) also holds that proposer's state for the same
tokens (`paired`); its planes travel after the target's, under the proposer's prefix
("draft.0.keys", "mtp.hidden"), and `reusable_from` is the lowest length both parts can
be cut to. `header_extra` adds the pairing's header fields.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import attrs
import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, KVCache

from tqserve.engine.kv.affine import AffineKVCache
from tqserve.engine.kv.affine import PLANES as AFFINE_PLANES
from tqserve.engine.kv.delayed import DelayedTurboQuantKVCache
from tqserve.engine.kv.slot_rows import SlotRows
from tqserve.engine.kv.turboquant import PLANES as TQ_PLANES
from tqserve.engine.kv.turboquant import TurboQuantKVCache

if TYPE_CHECKING:
    from tqserve.engine.snapshot_layout import PlaneLayout

PLAIN_PLANES = ("keys", "values")
DTYPE_NAMES = {mx.float32: "float32", mx.float16: "float16", mx.bfloat16: "bfloat16",
           mx.uint8: "uint8", mx.uint16: "uint16", mx.uint32: "uint32", mx.int32: "int32",
           mx.int8: "int8"}
_MXDTYPE_NAMES = {name: dtype for dtype, name in DTYPE_NAMES.items()}
_NP_NAMES = {"bfloat16": "uint16"}


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
        return sum(_planes_nbytes(planes_of(c)) for c in self.layers) + paired

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
    if type(cache) is ArraysCache:
        return "state"
    return None


def snapshot_kinds(template: Sequence[Any]) -> tuple[str, ...] | None:
    """Kinds of a fresh cache list; None if some layer cannot be snapshotted, or if no
    layer counts positions (recurrent layers only)."""
    kinds = tuple(layer_kind(c) for c in template)
    if None in kinds or all(k == "state" for k in kinds):
        return None
    return kinds  # type: ignore[return-value]


def _exact_boundary(layers: Sequence[Any], boundary: int, offset: int) -> int:
    """The reuse bound: the offset itself when a layer holds recurrent state."""
    return offset if any(type(c) is ArraysCache for c in layers) else boundary


def _offset(layers: Sequence[Any]) -> int:
    return min(int(c.offset) for c in layers if type(c) is not ArraysCache)


def planes_of(cache: Any) -> dict[str, mx.array]:
    """One layer cache's arrays by plane name, cut to its valid positions."""
    if type(cache) is ArraysCache:
        # mlx-lm infers ArraysCache.cache as list[None] ([None] * size); models fill it
        states = cast(list[mx.array | None], cache.cache)
        return {f"s{j}": a for j, a in enumerate(states) if a is not None}
    if type(cache) is KVCache:
        if cache.keys is None:
            return {}
        return {"keys": cache.keys[..., :cache.offset, :],
                "values": cache.values[..., :cache.offset, :]}
    return cache.written()


def extract_snapshot(batch_layers: Sequence[Any], index: int) -> Snapshot | None:
    """Row `index` of the batch caches as a Snapshot; None if a layer cannot be."""
    layers = tuple(c.extract(index) for c in batch_layers)
    kinds = tuple(layer_kind(c) for c in layers)
    if None in kinds:
        return None
    mx.eval([list(planes_of(c).values()) for c in layers])
    offset = _offset(layers)
    boundary = max((c.minimum_reusable_offset for c in layers
                    if isinstance(c, DelayedTurboQuantKVCache)), default=0)
    return Snapshot(layers=layers, kinds=kinds, offset=offset,  # type: ignore[arg-type]
                    minimum_reusable_offset=_exact_boundary(layers, boundary, offset))


def snapshot_of_row(row_layers: Sequence[Any]) -> Snapshot | None:
    """A prefilling row's own caches as a Snapshot, by reference (new cache objects over
    slices of its valid positions: the row's later appends write past them or reallocate,
    so the snapshot never changes); None if a layer cannot be snapshotted."""
    kinds = tuple(k for k in map(layer_kind, row_layers) if k is not None)
    if len(kinds) != len(row_layers):
        return None
    offset = _offset(row_layers)
    boundary = max((c.minimum_reusable_offset for c in row_layers
                    if isinstance(c, DelayedTurboQuantKVCache)), default=0)
    layers = tuple(_layer_from(c, kind, _cut(planes_of(c), offset, kind),
                               getattr(c, "minimum_reusable_offset", 0))
                   for c, kind in zip(row_layers, kinds))
    mx.eval([list(planes_of(c).values()) for c in layers])
    return Snapshot(layers=layers, kinds=kinds, offset=offset,  # type: ignore[arg-type]
                    minimum_reusable_offset=_exact_boundary(layers, boundary, offset))


def _cut(planes: Mapping[str, mx.array], length: int, kind: str) -> dict[str, mx.array]:
    if kind == "state":  # no position axis; reused only whole (the exact boundary)
        return dict(planes)
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
        return TurboQuantKVCache.of(template.config, SlotRows.holding(planes))
    if kind in ("dplain", "dtq"):
        return DelayedTurboQuantKVCache.holding(template.quantized_kv_start, template.config,
                                                planes, kind == "dtq",
                                                boundary if kind == "dtq" else 0)
    if kind == "affine":
        affine = AffineKVCache(template.bits, template.group_size)
        affine.slots = SlotRows.holding(planes)
        return affine
    if kind == "state":  # the model replaces state arrays, never writes into them
        state = ArraysCache(len(template.cache))
        # mlx-lm infers the attribute as list[None] from its `[None] * size` default
        state.cache = [planes.get(f"s{j}") for j in range(len(template.cache))]  # type: ignore[misc]
        return state
    raise ValueError(f"unknown snapshot layer kind {kind!r}")


def row_from_snapshot(snapshot: Snapshot, length: int) -> list[Any]:
    """New per-layer caches holding the snapshot's first `length` positions, by reference."""
    if not snapshot.minimum_reusable_offset <= length <= snapshot.offset:
        raise ValueError(f"cannot reuse {length} positions of a snapshot of {snapshot.offset} "
                         f"with boundary {snapshot.minimum_reusable_offset}")
    out = []
    for cache, kind in zip(snapshot.layers, snapshot.kinds):
        boundary = getattr(cache, "minimum_reusable_offset", 0)
        out.append(_layer_from(cache, kind, _cut(planes_of(cache), length, kind), boundary))
    return out


def dtype_name(array: mx.array) -> str:
    """An array's dtype as the SSD format names it ("float32", "bfloat16", ...)."""
    return DTYPE_NAMES[array.dtype]


def array_plane(name: str, array: mx.array) -> tuple[str, bytes, tuple[int, ...], str]:
    """One array as an SSD plane: (name, raw bytes, shape, dtype)."""
    dtype = DTYPE_NAMES[array.dtype]
    raw = array.view(mx.uint16) if array.dtype == mx.bfloat16 else array
    return name, np.array(raw).tobytes(), tuple(array.shape), dtype


def plane_array(name: str, data: bytes, shape: Sequence[int], dtype: str) -> mx.array:
    """The array of one SSD plane; ValueError if its dtype or byte count does not fit."""
    if dtype not in _MXDTYPE_NAMES:
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
           for name, array in planes_of(cache).items()]
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
                 "dtq": TQ_PLANES, "affine": AFFINE_PLANES,
                 "state": tuple(f"s{j}" for j in range(len(getattr(fresh, "cache", ()))))}[kind]
        arrays = {}
        for name in names:
            if f"{i}.{name}" not in planes:
                raise ValueError(f"plane {i}.{name} is missing")
            data, shape, dtype = planes[f"{i}.{name}"]
            arrays[name] = plane_array(f"{i}.{name}", data, shape, dtype)
            if kind == "state":
                if not shape or shape[0] != 1:
                    raise ValueError(f"plane {i}.{name} of shape {tuple(shape)} is not one row")
            elif len(shape) != 4 or shape[0] != 1 or shape[2] != offset:
                raise ValueError(f"plane {i}.{name} of shape {tuple(shape)} for offset {offset}")
        layers.append(_layer_from(fresh, kind, arrays, boundary))
    mx.eval([list(planes_of(c).values()) for c in layers])
    return Snapshot(layers=tuple(layers), kinds=kinds, offset=offset,
                    minimum_reusable_offset=_exact_boundary(layers, boundary, offset))


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
        words = planes_of(affine).get("key_wq")
        head_dim = int(words.shape[-1]) * 32 // affine.bits if words is not None else 1
        return {"cache_kind": "affine", "k_bits": affine.bits, "v_bits": affine.bits,
                "head_dim": head_dim, "rotation_id": None}
    first = next((planes_of(c) for c in snapshot.layers if type(c) is not ArraysCache), {})
    head_dim = int(first["keys"].shape[-1]) if "keys" in first else 1
    return {"cache_kind": "kv", "k_bits": None, "v_bits": None, "head_dim": head_dim,
            "rotation_id": None}
