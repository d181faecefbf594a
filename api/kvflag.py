"""`--kv FORMAT`: the one KV-cache flag of `serve` and `generate`, parsed into Config fields.

    plain                         the model dtype (the default)
    turboquant:kXvY[,start=N]     TurboQuant, X key / Y value bits (1..8); the first N
                                  tokens of a row stay full precision (quantized_kv_start)
    affine:BITS[,group=G]         mlx-lm's affine kv_bits quantization, G elements per scale

A bad value is an argparse error (exit 2, one line naming --kv). The four flags it replaces
(--turboquant, --quantized-kv-start, --kv-quant, --kv-group-size) stay as hidden aliases:
`kv_fields` prints one deprecation line naming the --kv spelling of what they asked for.
Config itself is unchanged: --kv sets its fields turboquant, quantized_kv_start, kv_quant
and kv_group_size.
"""

from __future__ import annotations

import argparse
import re
from typing import Any, Callable

from tqserve.api.flags import argparse_type, warn_deprecated

OLD_FLAGS = ("turboquant", "quantized_kv_start", "kv_quant", "kv_group_size")  # Config fields
DEFAULT_GROUP = 64  # Config().kv_group_size
SYNTAX = "plain, turboquant:kXvY[,start=N] or affine:BITS[,group=G]"
_FORMAT = re.compile(r"(plain|turboquant|affine)(?::([^,]*))?((?:,[^,]*)*)")


def _options(text: str, allowed: tuple[str, ...]) -> dict[str, int]:
    """',start=8' -> {'start': 8}: integer options, each named in `allowed`, once."""
    out: dict[str, int] = {}
    for item in text.split(",")[1:]:
        name, eq, number = item.partition("=")
        if name not in allowed:
            raise ValueError(f"unknown option {item!r} (options here: "
                             f"{', '.join(o + '=N' for o in allowed) or 'none'})")
        if not eq or not re.fullmatch(r"\d+", number):
            raise ValueError(f"option {item!r} is not {name}=N with N an integer >= 0")
        if name in out:
            raise ValueError(f"option {name} is given twice")
        out[name] = int(number)
    return out


def parse_kv(value: str) -> dict[str, Any]:
    """A --kv value -> the four Config fields; ValueError says what is wrong."""
    from tqserve.engine.kv.affine import KV_BITS, KV_GROUP_SIZES
    from tqserve.engine.kv.factory import parse_turboquant

    match = _FORMAT.fullmatch(value.strip().lower())
    if match is None:
        raise ValueError(f"{value!r} is not {SYNTAX}")
    kind, spec, rest = match.groups()
    fields: dict[str, Any] = {"turboquant": None, "quantized_kv_start": 0, "kv_quant": None,
                              "kv_group_size": DEFAULT_GROUP}
    if kind == "plain":
        if spec is not None or rest:
            raise ValueError(f"plain takes no bits or options, got {value!r}")
        return fields
    if not spec:
        raise ValueError(f"{kind} needs its bits: {kind}:" + ("k4v4" if kind == "turboquant"
                                                              else "8"))
    if kind == "turboquant":
        parse_turboquant(spec)  # ValueError: the kXvY spec and the bit range
        start = _options(rest, ("start",)).get("start", 0)
        return fields | {"turboquant": spec, "quantized_kv_start": start}
    if not spec.isdigit() or int(spec) not in KV_BITS:
        raise ValueError(f"affine bits must be one of {', '.join(map(str, KV_BITS))}, "
                         f"got {spec!r}")
    group = _options(rest, ("group",)).get("group", DEFAULT_GROUP)
    if group not in KV_GROUP_SIZES:
        raise ValueError(f"affine group must be one of {', '.join(map(str, KV_GROUP_SIZES))}, "
                         f"got {group}")
    return fields | {"kv_quant": int(spec), "kv_group_size": group}


kv_type = argparse_type(parse_kv)  # argparse `type=` for --kv: `argument --kv: ...`, exit 2


def spelling(fields: dict[str, Any]) -> str:
    """The --kv value that asks for these Config fields (what the old flags meant)."""
    if fields["turboquant"] is not None:
        start = fields["quantized_kv_start"]
        return f"turboquant:{fields['turboquant']}" + (f",start={start}" if start else "")
    if fields["kv_quant"] is not None:
        group = fields["kv_group_size"]
        return f"affine:{fields['kv_quant']}" + (f",group={group}" if group != DEFAULT_GROUP
                                                 else "")
    return "plain"


def kv_fields(args: argparse.Namespace, warn: Callable[[str], None] | None = None
              ) -> dict[str, Any]:
    """The four Config fields from --kv, or from the old flags (one deprecation line);
    ValueError when both are given."""
    old = {name: getattr(args, name) for name in OLD_FLAGS if getattr(args, name) is not None}
    if args.kv is not None:
        if old:
            given = ", ".join("--" + n.replace("_", "-") for n in old)
            raise ValueError(f"--kv and {given} both set the KV cache: give --kv alone")
        return dict(args.kv)
    fields = {"turboquant": None, "quantized_kv_start": 0, "kv_quant": None,
              "kv_group_size": DEFAULT_GROUP} | old
    if old:
        warn_deprecated(["--" + n.replace("_", "-") for n in old], f"--kv {spelling(fields)}",
                        warn)
    return fields
