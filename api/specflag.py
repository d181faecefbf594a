"""`--speculative-config JSON`: the knobs of speculative decoding in one flag (vLLM's
spelling), parsed into Config fields; `--speculative METHOD` stays the one switch.

    {"method": "draft" | "mtp" | "lookup",  the method, as --speculative (either names it)
     "model": PATH,                        the draft model (method draft)
     "num_speculative_tokens": N,          tokens proposed per row and step, 1..16 (4)
     "max_batch": N,                       no row proposes while more rows decode (0: no limit)
     "time_policy": true | false,          propose only in batch sizes where it measured faster
     "ngram": N}                           longest n-gram prompt lookup matches, 1..16 (3)

Keys left out keep Config's defaults. A bad value is an argparse error (exit 2, one line
naming --speculative-config): not JSON, not an object, an unknown key (named, with the
known ones), a value of the wrong type; the ranges are Config's (its message names the
key). The five flags it replaces (--draft-model, --num-speculative-tokens,
--speculative-max-batch, --no-speculative-time-policy, --speculative-ngram) stay as
hidden aliases: `spec_fields` prints one deprecation line with the --speculative-config
spelling of what they asked for.
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Callable

from tqserve.api.flags import argparse_type, warn_deprecated
from tqserve.engine.config import SPECULATIVE_CONFIG as KEYS  # key -> (Config field, type)

# the Config fields of the flags --speculative-config replaced (all but --speculative's)
OLD_FLAGS = tuple(field for key, (field, _) in KEYS.items() if key != "method")
_KEY_OF = {field: key for key, (field, _) in KEYS.items()}


def parse_spec_config(text: str) -> dict[str, Any]:
    """A --speculative-config value -> Config fields; ValueError says what is wrong."""
    try:
        obj = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"must be a JSON object, got {type(obj).__name__}")
    fields = {}
    for key, value in obj.items():
        if key not in KEYS:
            raise ValueError(f"unknown key {key!r} (keys: {', '.join(KEYS)})")
        field, kind = KEYS[key]
        if type(value) is not kind:  # bool is no int here, and an int no bool
            raise ValueError(f"{key} must be a JSON {_JSON_TYPE[kind]}, got {json.dumps(value)}")
        fields[field] = value
    return fields


_JSON_TYPE = {str: "string", int: "integer", bool: "true or false"}


spec_config_type = argparse_type(parse_spec_config)  # `argument --speculative-config: ...`


def spelling(fields: dict[str, Any]) -> str:
    """The --speculative-config value that asks for these Config fields."""
    return json.dumps({_KEY_OF[f]: v for f, v in fields.items()}, separators=(", ", ": "))


def spec_fields(args: argparse.Namespace, warn: Callable[[str], None] | None = None
                ) -> dict[str, Any]:
    """The speculation Config fields of --speculative, --speculative-config and the old
    flags (one deprecation line); ValueError when two of them disagree or the config and
    an old flag are both given."""
    config = dict(args.speculative_config or {})
    old = {name: getattr(args, name) for name in OLD_FLAGS if getattr(args, name) is not None}
    if old and args.speculative_config is not None:
        given = ", ".join(_flag(n) for n in old)
        raise ValueError(f"--speculative-config and {given} both set speculation: give "
                         f"--speculative-config alone")
    method = config.get("speculative")
    if args.speculative is not None and method is not None and method != args.speculative:
        raise ValueError(f"--speculative {args.speculative} and --speculative-config "
                         f"method {method!r} disagree")
    if old:
        warn_deprecated([_flag(n) for n in old], f"--speculative-config '{spelling(old)}'", warn)
    fields = config | old
    if args.speculative is not None:
        fields["speculative"] = args.speculative
    return fields


def _flag(field: str) -> str:
    return ("--no-speculative-time-policy" if field == "speculative_time_policy"
            else "--" + field.replace("_", "-"))

