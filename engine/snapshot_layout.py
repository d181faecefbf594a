"""What a snapshot of this engine's model must hold: the check of untrusted SSD files.

`plane_layout` probes the model once (a one-token forward on fresh caches) and records,
per layer and per kind it can restore, every plane's shape (1, heads, T, ...; a recurrent
"state" plane's whole shape) and dtype, plus the header fields (cache kind, bits, head dim,
rotation). `PlaneLayout.check` refuses anything else — a wrong layer count, head count,
head dim, bit width (code plane width), dtype, an extra or missing plane, T != offset, an
offset that is not the token count — before a byte of a plane is decoded. It cannot tell
two layers of equal shape apart: a swapped file is the writer's doing (docs/prefix-cache.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

from tqserve.engine.kv.affine import AffineKVCache
from tqserve.engine.kv.delayed import DelayedTurboQuantKVCache
from tqserve.engine.kv.turboquant import TurboQuantKVCache
from tqserve.engine.snapshot import DTYPE_NAMES, Snapshot, describe, planes_of, snapshot_kinds

_KIND_FIELDS = ("cache_kind", "k_bits", "v_bits", "head_dim", "rotation_id")


@attrs.frozen(kw_only=True)
class PlaneLayout:
    """What a snapshot of this engine must hold (see the module doc). Plain data: `check`
    runs on any thread, no MLX."""

    # per layer: kind -> plane name -> (shape without the T axis: (1, heads, ...), dtype);
    # a "state" layer's planes have no T axis: their whole shape
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
                want = pattern if kind == "state" else (*pattern[:2], offset, *pattern[2:])
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
        written = planes_of(plain[i])
        if kind == "state":  # the probe's own state arrays: shapes do not grow with T
            layers.append({"state": {name: (tuple(a.shape), DTYPE_NAMES[a.dtype])
                                     for name, a in written.items()}})
            probes.append(plain[i])
            continue
        variants = {}
        for variant in ({"dplain", "dtq"} if kind in ("dplain", "dtq") else {kind}):
            probe = _probe(fresh, variant, written["keys"], written["values"])
            mx.eval(list(planes_of(probe).values()))
            variants[variant] = {name: ((*a.shape[:2], *a.shape[3:]), DTYPE_NAMES[a.dtype])
                                 for name, a in planes_of(probe).items()}
            if variant == kind:
                probes.append(probe if kind not in ("dplain", "dtq") else
                              DelayedTurboQuantKVCache.holding(fresh.quantized_kv_start,
                                                               fresh.config, planes_of(probe),
                                                               kind == "dtq"))
        layers.append(variants)
    described = describe(Snapshot(layers=tuple(probes), kinds=kinds, offset=1,
                                  minimum_reusable_offset=0))
    return PlaneLayout(layers=tuple(layers),
                       fields={name: described[name] for name in _KIND_FIELDS})
