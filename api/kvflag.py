"""`--kv FORMAT`: the one KV-cache flag of `serve` and `generate`, parsed into Config fields.

    plain                         the model dtype (the default)
    turboquant:kXvY[,start=N][,decode=PATH]
                                  TurboQuant, X key / Y value bits (1..8); the first N
                                  tokens of a row stay full precision (quantized_kv_start);
                                  PATH is the decode attention: auto (the default: CUDA
                                  kernels on MLX-CUDA, compiled ops elsewhere), compiled,
                                  or unfused (dequantize, then the fused SDPA)
    affine:BITS[,group=G]         mlx-lm's affine kv_bits quantization, G elements per scale

A bad value is an argparse error (exit 2, one line naming --kv). The four flags it replaces
(--turboquant, --quantized-kv-start, --kv-quant, --kv-group-size) stay as hidden aliases:
`kv_fields` prints one deprecation line naming the --kv spelling of what they asked for.
--kv sets the Config fields turboquant, quantized_kv_start, turboquant_decode, kv_quant
and kv_group_size (the decode path was once two environment variables).
"""

from __future__ import annotations

import argparse
import re
from typing import Any, Callable

from tqserve.api.flags import argparse_type, warn_deprecated

OLD_FLAGS = ("turboquant", "quantized_kv_start", "kv_quant", "kv_group_size")  # Config fields
DEFAULT_GROUP = 64  # Config().kv_group_size
SYNTAX = "plain, turboquant:kXvY[,start=N][,decode=PATH] or affine:BITS[,group=G]"
DEFAULTS: dict[str, Any] = {"turboquant": None, "quantized_kv_start": 0,
                            "turboquant_decode": "auto", "kv_quant": None,
                            "kv_group_size": DEFAULT_GROUP}
FIELDS = tuple(DEFAULTS)  # the Config fields --kv sets
_FORMAT = re.compile(r"(plain|turboquant|affine)(?::([^,]*))?((?:,[^,]*)*)")


def _options(text: str, allowed: dict[str, tuple[str, ...] | None]) -> dict[str, Any]:
    """',start=8,decode=compiled' -> {'start': 8, 'decode': 'compiled'}: each option named
    in `allowed` at most once; an option's value is one of its words, or (None) an
    integer >= 0."""
    out: dict[str, Any] = {}
    for item in text.split(",")[1:]:
        name, eq, value = item.partition("=")
        if name not in allowed:
            spelled = (o + "=" + ("|".join(w) if w else "N") for o, w in allowed.items())
            raise ValueError(f"unknown option {item!r} (options here: {', '.join(spelled)})")
        words = allowed[name]
        if words is not None and value not in words:
            raise ValueError(f"option {item!r}: {name} is one of {', '.join(words)}")
        if words is None and (not eq or not re.fullmatch(r"\d+", value)):
            raise ValueError(f"option {item!r} is not {name}=N with N an integer >= 0")
        if name in out:
            raise ValueError(f"option {name} is given twice")
        out[name] = value if words is not None else int(value)
    return out


def parse_kv(value: str) -> dict[str, Any]:
    """A --kv value -> the five Config fields; ValueError says what is wrong."""
    from tqserve.engine.attention.sdpa import DECODE_PATHS
    from tqserve.engine.kv.affine import KV_BITS, KV_GROUP_SIZES
    from tqserve.engine.kv.factory import parse_turboquant

    match = _FORMAT.fullmatch(value.strip().lower())
    if match is None:
        raise ValueError(f"{value!r} is not {SYNTAX}")
    kind, spec, rest = match.groups()
    fields = dict(DEFAULTS)
    if kind == "plain":
        if spec is not None or rest:
            raise ValueError(f"plain takes no bits or options, got {value!r}")
        return fields
    if not spec:
        raise ValueError(f"{kind} needs its bits: {kind}:" + ("k4v4" if kind == "turboquant"
                                                              else "8"))
    if kind == "turboquant":
        parse_turboquant(spec)  # ValueError: the kXvY spec and the bit range
        options = _options(rest, {"start": None, "decode": DECODE_PATHS})
        return fields | {"turboquant": spec, "quantized_kv_start": options.get("start", 0),
                         "turboquant_decode": options.get("decode", "auto")}
    if not spec.isdigit() or int(spec) not in KV_BITS:
        raise ValueError(f"affine bits must be one of {', '.join(map(str, KV_BITS))}, "
                         f"got {spec!r}")
    group = _options(rest, {"group": None}).get("group", DEFAULT_GROUP)
    if group not in KV_GROUP_SIZES:
        raise ValueError(f"affine group must be one of {', '.join(map(str, KV_GROUP_SIZES))}, "
                         f"got {group}")
    return fields | {"kv_quant": int(spec), "kv_group_size": group}


kv_type = argparse_type(parse_kv)  # argparse `type=` for --kv: `argument --kv: ...`, exit 2


def spelling(fields: dict[str, Any]) -> str:
    """The --kv value that asks for these Config fields (what the old flags meant)."""
    if fields["turboquant"] is not None:
        start, decode = fields["quantized_kv_start"], fields.get("turboquant_decode", "auto")
        return (f"turboquant:{fields['turboquant']}" + (f",start={start}" if start else "")
                + (f",decode={decode}" if decode != "auto" else ""))
    if fields["kv_quant"] is not None:
        group = fields["kv_group_size"]
        return f"affine:{fields['kv_quant']}" + (f",group={group}" if group != DEFAULT_GROUP
                                                 else "")
    return "plain"


def kv_fields(args: argparse.Namespace, warn: Callable[[str], None] | None = None
              ) -> dict[str, Any]:
    """The five Config fields from --kv, or from the old flags (one deprecation line);
    ValueError when both are given."""
    old = {name: getattr(args, name) for name in OLD_FLAGS if getattr(args, name) is not None}
    if args.kv is not None:
        if old:
            given = ", ".join("--" + n.replace("_", "-") for n in old)
            raise ValueError(f"--kv and {given} both set the KV cache: give --kv alone")
        return dict(args.kv)
    fields = DEFAULTS | old
    if old:
        warn_deprecated(["--" + n.replace("_", "-") for n in old], f"--kv {spelling(fields)}",
                        warn)
    return fields
