"""The one configuration record. The CLI maps onto it 1:1; validated at construction.

Naming rule for errors: a Config error names the setting as its CLI flag (`--max-batch`),
embedded use included; a request error (wire protocol, SamplingParams) names the request
field as it is spelled on the wire (`max_tokens`).
"""

from __future__ import annotations

import os
from typing import Iterable

import attrs

from tqserve.engine.kv.affine import KV_BITS, KV_GROUP_SIZES
from tqserve.engine.kv.factory import parse_turboquant
from tqserve.engine.model import DEFAULT_MODEL, DTYPES, QUANTIZED_WEIGHTS


def _flag(attr: attrs.Attribute) -> str:
    """The CLI flag of a Config field: every Config error names its setting this way."""
    return "--" + attr.name.replace("_", "-")


def _dtype(inst: object, attr: attrs.Attribute, value: str) -> None:
    if value not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {value!r}")


def _quantized_weights(inst: object, attr: attrs.Attribute, value: str) -> None:
    if value not in QUANTIZED_WEIGHTS:
        raise ValueError(f"--quantized-weights must be one of {', '.join(QUANTIZED_WEIGHTS)}, "
                         f"got {value!r}")


def _positive(inst: object, attr: attrs.Attribute, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{_flag(attr)} must be a positive integer, got {value!r}")


def _port(inst: object, attr: attrs.Attribute, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {value!r}")


def _non_negative(inst: object, attr: attrs.Attribute, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{_flag(attr)} must be an integer >= 0, got {value!r}")


def _seconds(inst: object, attr: attrs.Attribute, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{_flag(attr)} must be a number of seconds >= 0, "
                         f"got {value!r}")


def _positive_seconds(inst: object, attr: attrs.Attribute, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e6:
        raise ValueError(f"{attr.name.replace('_', '-')} must be a number of seconds > 0, "
                         f"got {value!r}")


def _chat_template(inst: object, attr: attrs.Attribute, value: str | None) -> None:
    if value is not None and not os.path.isfile(value):
        raise ValueError(f"--chat-template {value!r} is not a file")


def _names(value: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """--served-model-name: names, comma-separated or a sequence; empty: the directory's."""
    if value == "":
        return ()
    items = value.split(",") if isinstance(value, str) else list(value)
    names = tuple(n.strip() for n in items if isinstance(n, str) and n.strip())
    if len(names) != len(items):
        raise ValueError(f"--served-model-name must be non-empty names, got {value!r}")
    return names


def _turboquant(inst: object, attr: attrs.Attribute, value: str | None) -> None:
    if value is not None:
        try:
            parse_turboquant(value)
        except ValueError as exc:
            raise ValueError(f"--turboquant: {exc}") from None


def _kv_quant(inst: object, attr: attrs.Attribute, value: int | None) -> None:
    if value is not None and (type(value) is not int or value not in KV_BITS):
        raise ValueError(f"--kv-quant must be one of {', '.join(map(str, KV_BITS))} (or unset), "
                         f"got {value!r}")


def _kv_group_size(inst: object, attr: attrs.Attribute, value: int) -> None:
    if type(value) is not int or value not in KV_GROUP_SIZES:
        raise ValueError(f"--kv-group-size must be one of "
                         f"{', '.join(map(str, KV_GROUP_SIZES))}, got {value!r}")


def _ssd_flush(inst: object, attr: attrs.Attribute, value: str) -> None:
    if value not in ("sync", "async"):
        raise ValueError(f"--ssd-flush must be sync or async, got {value!r}")


def _api_key(inst: object, attr: attrs.Attribute, value: str | None) -> None:
    if value is not None and (not isinstance(value, str) or not value.strip()
                              or not value.isprintable()):
        raise ValueError("api-key must be a non-empty printable string (or unset)")


def _origins(value: str | Iterable[object]) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [o for o in value.split(",") if o.strip()]
    return tuple(str(o).strip().rstrip("/") for o in value)


def _acceptor(inst: object, attr: attrs.Attribute, value: str) -> None:
    if value not in ("process", "off"):
        raise ValueError(f"--acceptor must be process or off, got {value!r}")


def _ssd_write(inst: object, attr: attrs.Attribute, value: str) -> None:
    if value not in ("through", "back"):
        raise ValueError(f"ssd-write must be through or back, got {value!r}")


def _speculative(inst: object, attr: attrs.Attribute, value: str | None) -> None:
    if value is not None and value not in ("draft", "mtp", "lookup"):
        raise ValueError(f"--speculative must be draft, mtp or lookup (or unset), got {value!r}")


def _num_speculative(inst: object, attr: attrs.Attribute, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 16:
        raise ValueError(f"{_flag(attr)} must be an integer in [1, 16], got {value!r}")


AUTO_CHOICES = ("auto", "on", "off")  # --warmup, --fast-decode (engine.model.auto_on_gpu)


def _auto_on_off(inst: object, attr: attrs.Attribute, value: str) -> None:
    if value not in AUTO_CHOICES:
        raise ValueError(f"{_flag(attr)} must be one of {', '.join(AUTO_CHOICES)}, "
                         f"got {value!r}")


@attrs.frozen(kw_only=True)
class Config:
    """Engine and server settings (defaults suit a laptop and the bundled model)."""

    model: str = str(DEFAULT_MODEL)
    dtype: str = attrs.field(default="auto", validator=_dtype)
    # Quantized layers (4/8-bit checkpoints, GGUF Q4_0/Q4_1/Q8_0): keep packed, dequantize
    # at load, or auto = dequantize on the CPU backend, where that decodes faster.
    quantized_weights: str = attrs.field(default="auto", validator=_quantized_weights)
    max_batch: int = attrs.field(default=32, validator=_positive)
    prefill_chunk: int = attrs.field(default=512, validator=_positive)
    # Tokens one engine step processes: decoding rows one each, prefill (padding included)
    # the rest (engine.scheduler's module doc; docs/serving.md "Batched prefill" for the default).
    max_step_tokens: int = attrs.field(default=1024, validator=_positive)
    max_queued_requests: int = attrs.field(default=64, validator=_positive)
    max_queued_tokens: int = attrs.field(default=65536, validator=_positive)
    max_tokens_cap: int = attrs.field(default=4096, validator=_positive)
    default_max_tokens: int = attrs.field(default=256, validator=_positive)
    stream_buffer: int = attrs.field(default=1024, validator=_positive)
    host: str = "127.0.0.1"
    port: int = attrs.field(default=8000, validator=_port)
    max_message_bytes: int = attrs.field(default=1 << 20, validator=_positive)
    max_streams_per_connection: int = attrs.field(default=16, validator=_positive)
    # open connections (HTTP and WebSocket) the server holds at once; a request on one
    # beyond it is an HTTP 503 (the descriptor limit is raised to fit it)
    max_connections: int = attrs.field(default=1024, validator=_positive)
    # who accepts connections (api.acceptor): "process", a small process that answers
    # overload's 429s off the event loop and hands every other connection over; "off":
    # the server's own loop (with the in-loop gate, api.overload)
    acceptor: str = attrs.field(default="process", validator=_acceptor)
    # What one request may carry (docs/limits.md): checked before tokenizing.
    max_prompt_chars: int = attrs.field(default=262144, validator=_positive)
    max_messages: int = attrs.field(default=256, validator=_positive)
    # HTTP connections (api.httpconn, docs/limits.md): seconds a connection may sit idle
    # between requests, a request's head and its body may take to arrive (then 408/close)
    http_idle_timeout: float = attrs.field(default=5.0, validator=_positive_seconds)
    http_header_timeout: float = attrs.field(default=10.0, validator=_positive_seconds)
    http_body_timeout: float = attrs.field(default=30.0, validator=_positive_seconds)
    # seconds a WebSocket message may take from its first byte to its last (then close 1008)
    ws_message_timeout: float = attrs.field(default=30.0, validator=_positive_seconds)
    # Seconds in-flight requests get to finish after SIGTERM/SIGINT before they are ended
    # with finish_reason "shutdown".
    shutdown_timeout: float = attrs.field(default=10.0, validator=_seconds)
    # KV bytes every admitted row may come to hold together (engine.kv_budget); 0: from
    # the machine at start (engine.memory: half the free RAM, 80% of free GPU memory).
    kv_budget_bytes: int = attrs.field(default=0, validator=_non_negative)
    turboquant: str | None = attrs.field(default=None, validator=_turboquant)
    quantized_kv_start: int = attrs.field(default=0, validator=_non_negative)
    kv_quant: int | None = attrs.field(default=None, validator=_kv_quant)
    kv_group_size: int = attrs.field(default=64, validator=_kv_group_size)
    # Run every decode batch bucket once at start (engine.warmup): auto = on a GPU only,
    # where first shapes compile kernels; on the CPU there is nothing to compile.
    warmup: str = attrs.field(default="auto", validator=_auto_on_off)
    # Decode fast path (engine.fastpath: fused q/k/v and gate/up weights, compiled decode
    # layers): auto = on a GPU only, where a step is host-bound; off with --distributed.
    fast_decode: str = attrs.field(default="auto", validator=_auto_on_off)
    # Prefix cache (DESIGN.md 3.3): RAM tier budget; the SSD tier only with cache_dir.
    prefix_cache: bool = True
    ram_cache_bytes: int = attrs.field(default=1 << 30, validator=_non_negative)
    cache_dir: str | None = None
    ssd_cache_bytes: int = attrs.field(default=16 << 30, validator=_positive)
    ssd_flush: str = attrs.field(default="async", validator=_ssd_flush)
    ssd_write: str = attrs.field(default="through", validator=_ssd_write)
    # Speculative decoding (engine.speculative; docs/speculative.md): the
    # server's default method (requests may choose another one that is served, or none).
    speculative: str | None = attrs.field(default=None, validator=_speculative)
    draft_model: str | None = None
    num_speculative_tokens: int = attrs.field(default=4, validator=_num_speculative)
    speculative_max_batch: int = attrs.field(default=0, validator=_non_negative)
    speculative_time_policy: bool = True  # engine.speculative.throughput
    speculative_ngram: int = attrs.field(default=3, validator=_num_speculative)
    # HTTP and WebSocket exposure (api.auth): a bearer key, browser origins for WebSockets.
    api_key: str | None = attrs.field(default=None, validator=_api_key, repr=False)
    allowed_origins: tuple[str, ...] = attrs.field(default=(), converter=_origins)
    # Tensor parallel over mx.distributed (engine.distributed): this process is one rank of
    # a group started by mlx.launch; rank 0 serves, the others follow its plans. With
    # cache_dir each rank keeps its own shard of every snapshot file (storage.shard).
    distributed: bool = False
    # Seconds one group operation (a step, a broadcast) may take before the rank exits 1.
    distributed_timeout: float = attrs.field(default=60.0, validator=_positive_seconds)

    # Chat and tools (docs/agents.md): a Jinja chat template file overriding the model's;
    # the names requests may give as `model` (the first one answers; empty: the
    # directory's name); strict_fields refuses unknown request fields instead of ignoring.
    chat_template: str | None = attrs.field(default=None, validator=_chat_template)
    served_model_name: tuple[str, ...] = attrs.field(default=(), converter=_names)
    strict_fields: bool = False

    def __attrs_post_init__(self) -> None:
        if self.quantized_kv_start > 0 and self.kv_quant is not None and self.turboquant is None:
            raise ValueError("--quantized-kv-start applies to TurboQuant only; --kv-quant "
                             "quantizes from the first token")
        if self.speculative == "draft" and self.draft_model is None:
            raise ValueError("--speculative draft needs --draft-model")
        if self.max_step_tokens < self.max_batch:
            raise ValueError(f"--max-step-tokens ({self.max_step_tokens}) must be >= "
                             f"--max-batch ({self.max_batch}): each decoding row takes one "
                             f"token of a step")
        if self.distributed and self.fast_decode == "on":
            raise ValueError("--fast-decode on is not supported with --distributed (the "
                             "shards' projections are split, not fused)")
        if self.distributed and (self.speculative is not None or self.draft_model is not None):
            raise ValueError("--speculative is not supported with --distributed yet (the "
                             "draft model and the MTP head are not sharded)")
        if self.default_max_tokens > self.max_tokens_cap:
            raise ValueError(
                f"--default-max-tokens ({self.default_max_tokens}) exceeds --max-tokens-cap "
                f"({self.max_tokens_cap})")
