"""The flags of `serve` and `generate`, in groups, each mapping 1:1 onto a field of
engine.config.Config (the engine's) or api.config.ServerConfig (the server's); api.cli
builds them from the flags. docs/serving.md has the same groups. Flags only a server has
(network, auth, HTTP API, tensor parallel) are added for `serve` alone.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")

INT_FLAGS = {  # Config or ServerConfig field -> help; every one maps 1:1 onto its field
    "max_batch": "rows decoding together in one batched forward",
    "prefill_chunk": "prompt positions one prefill group advances per engine step (at most)",
    "max_step_tokens": "tokens one engine step processes: one per decoding row, prefill "
                       "(left padding included) the rest; >= --max-batch",
    "max_queued_requests": "admission bound: requests waiting for a row (more are refused "
                           "at once with code overloaded)",
    "max_queued_tokens": "admission bound: prompt tokens of the waiting requests",
    "max_tokens_cap": "largest max_tokens a request may ask for",
    "default_max_tokens": "max_tokens of a request that does not set it",
    "stream_buffer": "events a request's consumer may fall behind before it is cut off "
                     "(code slow_consumer)",
    "port": "TCP port to listen on (0: any free port)",
    "max_message_bytes": "largest WebSocket frame a client may send",
    "max_streams_per_connection": "concurrent requests on one WebSocket",
    "max_connections": "open connections (HTTP and WebSocket) the server holds at once (a "
                       "request beyond it is refused with HTTP 503, code too_many_connections)",
    "kv_budget_bytes": "KV bytes the admitted rows may hold together; rows beyond it wait "
                       "in the queue (0: half the free RAM at start, 80%% of free GPU memory)",
    "ram_cache_bytes": "byte budget of the prefix cache's RAM tier",
    "ssd_cache_bytes": "byte budget of the prefix cache's SSD tier (--cache-dir)",
    "max_prompt_chars": "characters of prompt text one request may carry (docs/limits.md)",
    "max_messages": "entries of a chat messages array one request may carry",
}


def add_config_flags(p: argparse.ArgumentParser, *, server: bool) -> None:
    """Every Config flag of `serve` (server=True) or `generate`, and `serve`'s ServerConfig
    flags, in help groups."""
    # engine imports MLX: imported here, so that `tqserve bench --blas` can preload a BLAS
    from tqserve.api.config import ServerConfig

    defaults = ServerConfig()
    engine = defaults.engine
    _model(p.add_argument_group("model and backend"), engine)
    _ints(p.add_argument_group("batching and memory"), defaults, server,
          ("max_batch", "prefill_chunk", "max_step_tokens", "kv_budget_bytes"))
    _ints(p.add_argument_group("admission and request limits (docs/limits.md)"), defaults,
          server, ("max_queued_requests", "max_queued_tokens", "max_tokens_cap",
                   "default_max_tokens", "stream_buffer", "max_prompt_chars", "max_messages",
                   "max_message_bytes", "max_streams_per_connection", "max_connections"))
    _kv(p.add_argument_group("KV cache (docs/kv-cache.md)"), engine, server)
    prefix = p.add_argument_group("prefix cache (docs/prefix-cache.md)")
    _prefix(prefix, engine)
    _ints(prefix, defaults, server, ("ram_cache_bytes", "ssd_cache_bytes"))
    _speculative(p.add_argument_group("speculative decoding (docs/speculative.md)"), engine)
    if server:
        network = p.add_argument_group("network, auth, lifecycle (docs/serving.md)")
        _ints(network, defaults, server, ("port",))
        _network(network, defaults)
        _http_api(p.add_argument_group("HTTP APIs (docs/agents.md)"))
        _tensor_parallel(p.add_argument_group("tensor parallel (docs/scale-out.md)"), engine)


def argparse_type(parse: Callable[[str], T]) -> Callable[[str], T]:
    """`parse` as an argparse `type=`: its ValueError becomes argparse's one line
    `argument --FLAG: <message>` (exit 2)."""
    def convert(value: str) -> T:
        try:
            return parse(value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


def warn_deprecated(flags: Sequence[str], use: str,
                    warn: Callable[[str], None] | None = None) -> None:
    """The one line a deprecated alias prints: `tqserve: FLAGS is/are deprecated: use USE`
    (to stderr unless `warn` is given)."""
    line = (f"tqserve: {', '.join(flags)} {'is' if len(flags) == 1 else 'are'} deprecated: "
            f"use {use}")
    if warn is not None:
        warn(line)
    else:
        print(line, file=sys.stderr, flush=True)


def _ints(g: Any, defaults: Any, server: bool, names: tuple[str, ...]) -> None:
    """The integer flags `names`: the engine's Config fields, and with `server` the
    ServerConfig's too (`defaults` is a ServerConfig)."""
    for name in names:
        owner = defaults.engine if hasattr(defaults.engine, name) else defaults
        if server or owner is defaults.engine:
            g.add_argument("--" + name.replace("_", "-"), type=int,
                           default=getattr(owner, name), help=INT_FLAGS[name])


def _model(g: Any, defaults: Any) -> None:
    from tqserve.engine.model import DTYPES, QUANTIZED_WEIGHTS

    g.add_argument("--model", default=defaults.model,
                   help="mlx-lm model directory, hub id or llama-family GGUF file "
                        "(default: the bundled pycoder-draft-4m)")
    g.add_argument("--blas", default="auto", metavar="{auto,none,PATH}",
                   help="Linux CPU: optimized BLAS loaded before MLX (auto: the system's "
                        "OpenBLAS if installed, else MLX's slow reference BLAS and a hint)")
    g.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="auto = float32 on MLX's CPU backend, the model's dtype on a GPU")
    g.add_argument("--quantized-weights", choices=QUANTIZED_WEIGHTS,
                   default=defaults.quantized_weights,
                   help="4/8-bit weights (quantized checkpoints, GGUF files): keep them packed "
                        "(less memory), dequantize them at load, or auto = dequantize on the "
                        "CPU backend (faster there), keep on a GPU")


def _kv(g: Any, defaults: Any, server: bool) -> None:
    from tqserve.api.kvflag import kv_type
    from tqserve.engine.kv.affine import KV_BITS, KV_GROUP_SIZES

    g.add_argument("--kv", type=kv_type, default=None, metavar="FORMAT",
                   help="KV cache format: plain; turboquant:kXvY[,start=N][,decode=PATH] (X "
                        "key and Y value bits, 1..8; rows stay full precision for their "
                        "first N tokens; PATH auto, compiled or unfused); affine:BITS"
                        "[,group=G] (bits 4 or 8, G elements per scale: 32, 64 or 128) "
                        "(default: plain)")
    g.add_argument("--kv-admission", choices=("reserve", "preempt"),
                   default=defaults.kv_admission,
                   help="reserve: a row starts only if every row's whole life (prompt + "
                        "max_tokens) fits --kv-budget-bytes, and none is ever preempted; "
                        "preempt: rows are charged what they hold now, and under pressure "
                        "the longest is preempted to the prefix cache and resumed later "
                        "(docs/kv-cache.md)")
    # the four flags --kv replaced: hidden, one deprecation line (api.kvflag)
    hidden = argparse.SUPPRESS
    g.add_argument("--turboquant", default=None, help=hidden)
    g.add_argument("--quantized-kv-start", type=int, default=None, help=hidden)
    g.add_argument("--kv-quant", type=int, choices=KV_BITS, default=None, help=hidden)
    g.add_argument("--kv-group-size", type=int, choices=KV_GROUP_SIZES, default=None,
                   help=hidden)
    g.add_argument("--warmup", choices=("auto", "on", "off"),
                   default=defaults.warmup if server else "off",
                   help="run each decode batch size (1, 2, 4, ... --max-batch) once at start, "
                        "so first requests do not pay for kernel compiles; auto: on a GPU "
                        "only" + ("" if server else " (generate runs one request: off)"))
    g.add_argument("--fast-decode", choices=("auto", "on", "off"), default=defaults.fast_decode,
                   help="decode fast path: fused q/k/v and gate/up weights and compiled decode "
                        "layers (engine.fastpath); auto: on a GPU only, off with --distributed")


def _prefix(g: Any, defaults: Any) -> None:
    g.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="never reuse KV of earlier requests")
    g.add_argument("--cache-dir", default=None,
                   help="directory of the SSD prefix-cache tier (restored at start; "
                        "default: off)")
    g.add_argument("--ssd-flush", choices=("sync", "async"), default=defaults.ssd_flush,
                   help="async: writes go through a bounded queue, a full queue drops the "
                        "write; sync: a snapshot is published once its file is durable")
    g.add_argument("--ssd-write", choices=("through", "back"), default=defaults.ssd_write,
                   help="through: every published snapshot is written to --cache-dir; "
                        "back: only snapshots evicted from the RAM tier")


def _speculative(g: Any, defaults: Any) -> None:
    from tqserve.api.specflag import spec_config_type

    g.add_argument("--speculative", choices=("draft", "mtp", "lookup"), default=None,
                   help="speculative decoding inside the batch: draft model, the target's "
                        "MTP head, or prompt lookup (default: off; requests may opt out)")
    g.add_argument("--speculative-config", type=spec_config_type, default=None, metavar="JSON",
                   help='its knobs as JSON: {"method": ..., "model": DRAFT (a draft model '
                        'lets requests ask for method draft), "num_speculative_tokens": '
                        f'{defaults.num_speculative_tokens}, "max_batch": '
                        f'{defaults.speculative_max_batch} (no row proposes while more rows '
                        'decode; 0: no limit), "time_policy": true (propose only where '
                        'measured faster), "ngram": '
                        f'{defaults.speculative_ngram} (longest prompt-lookup match)}}')
    hidden = argparse.SUPPRESS  # the flags --speculative-config replaced (api/specflag.py)
    g.add_argument("--draft-model", default=None, help=hidden)
    for flag in ("--num-speculative-tokens", "--speculative-max-batch", "--speculative-ngram"):
        g.add_argument(flag, type=int, default=None, help=hidden)
    g.add_argument("--no-speculative-time-policy", dest="speculative_time_policy",
                   action="store_const", const=False, default=None, help=hidden)


def _network(g: Any, defaults: Any) -> None:
    from tqserve.api.httpconn import add_timeout_flags

    g.add_argument("--host", default=defaults.host, help="address to listen on")
    g.add_argument("--shutdown-timeout", type=float, default=defaults.shutdown_timeout,
                   metavar="SECONDS",
                   help="on SIGTERM/SIGINT, seconds in-flight requests get to finish "
                        "before they end with finish_reason shutdown")
    g.add_argument("--api-key", default=os.environ.get("TQSERVE_API_KEY") or None,
                   help="require this key as 'Authorization: Bearer KEY' on every route "
                        "but /health and on the WebSocket upgrade (default: "
                        "$TQSERVE_API_KEY; unset = no auth)")
    g.add_argument("--allowed-origins", default="", metavar="ORIGIN,...",
                   help="browser origins allowed besides the server's own and loopback "
                        "ones, comma-separated (e.g. https://app.example.com; * = any)")
    g.add_argument("--ws-message-timeout", type=float, default=defaults.ws_message_timeout,
                   help="seconds a WebSocket message may take to arrive (then close 1008)")
    g.add_argument("--acceptor", choices=("process", "off"), default=defaults.acceptor,
                   help="who accepts connections: a small process that refuses overload "
                        "with 429 off the event loop and hands the rest over (process), or "
                        "the server's own loop (off)")
    add_timeout_flags(g, defaults)


def _http_api(g: Any) -> None:
    g.add_argument("--chat-template", default=None, metavar="FILE",
                   help="Jinja chat template used instead of the model's (docs/agents.md)")
    g.add_argument("--served-model-name", nargs="+", default=(), metavar="NAME",
                   help="names answered as `model`; others get 404 model_not_found "
                        "(default: the model directory's name, any `model` accepted)")
    g.add_argument("--strict-fields", action="store_true",
                   help="refuse unknown request fields with a 400 (default: ignored, "
                        "with a logged warning)")


def _tensor_parallel(g: Any, defaults: Any) -> None:
    g.add_argument("--distributed", action="store_true",
                   help="tensor parallel: run as one rank of a group started by mlx.launch "
                        "(rank 0 serves, the other ranks follow; docs/scale-out.md)")
    g.add_argument("--distributed-timeout", type=float, default=defaults.distributed_timeout,
                   metavar="SECONDS", help="a rank whose step or broadcast takes longer "
                   "(a peer died or hangs) ends the group")
