"""The engine's configuration record; the server's is api.config.ServerConfig, which holds
one. The CLI maps onto the two 1:1; each is validated at construction.

Naming rule for errors: a Config error names the setting as its CLI flag (`--max-batch`),
embedded use included; a request error (wire protocol, SamplingParams) names the request
field as it is spelled on the wire (`max_tokens`).
"""

from __future__ import annotations

import os

import attrs

from tqserve.engine.attention.sdpa import DECODE_PATHS as TURBOQUANT_DECODE
from tqserve.engine.kv.affine import KV_BITS, KV_GROUP_SIZES
from tqserve.engine.kv.factory import parse_turboquant
from tqserve.engine.model import DEFAULT_MODEL, DTYPES, QUANTIZED_WEIGHTS


# --speculative-config's JSON keys (api/specflag.py) -> (the Config field each sets, the
# type its JSON value must have); "method" is --speculative's field too
SPECULATIVE_CONFIG: dict[str, tuple[str, type]] = {
    "method": ("speculative", str), "model": ("draft_model", str),
    "num_speculative_tokens": ("num_speculative_tokens", int),
    "max_batch": ("speculative_max_batch", int), "time_policy": ("speculative_time_policy", bool),
    "ngram": ("speculative_ngram", int)}
_CONFIG_KEY_OF = {field: key for key, (field, _) in SPECULATIVE_CONFIG.items() if key != "method"}


def flag_name(attr: attrs.Attribute) -> str:
    """The CLI flag of a field: every Config and ServerConfig error names its setting so
    (a field set through --speculative-config by its JSON key)."""
    if attr.name in _CONFIG_KEY_OF:
        return f"--speculative-config {_CONFIG_KEY_OF[attr.name]}"
    return "--" + attr.name.replace("_", "-")


def _dtype(inst: object, attr: attrs.Attribute, value: str) -> None:
    if value not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {value!r}")


def _quantized_weights(inst: object, attr: attrs.Attribute, value: str) -> None:
    if value not in QUANTIZED_WEIGHTS:
        raise ValueError(f"--quantized-weights must be one of {', '.join(QUANTIZED_WEIGHTS)}, "
                         f"got {value!r}")


def positive(inst: object, attr: attrs.Attribute, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{flag_name(attr)} must be a positive integer, got {value!r}")


def _non_negative(inst: object, attr: attrs.Attribute, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{flag_name(attr)} must be an integer >= 0, got {value!r}")


def positive_seconds(inst: object, attr: attrs.Attribute, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e6:
        raise ValueError(f"{attr.name.replace('_', '-')} must be a number of seconds > 0, "
                         f"got {value!r}")


def _chat_template(inst: object, attr: attrs.Attribute, value: str | None) -> None:
    if value is not None and not os.path.isfile(value):
        raise ValueError(f"--chat-template {value!r} is not a file")


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


def _turboquant_decode(inst: object, attr: attrs.Attribute, value: str) -> None:
    if value not in TURBOQUANT_DECODE:
        raise ValueError(f"turboquant decode must be one of {', '.join(TURBOQUANT_DECODE)}, "
                         f"got {value!r}")


def _kv_group_size(inst: object, attr: attrs.Attribute, value: int) -> None:
    if type(value) is not int or value not in KV_GROUP_SIZES:
        raise ValueError(f"--kv-group-size must be one of "
                         f"{', '.join(map(str, KV_GROUP_SIZES))}, got {value!r}")


def _ssd_flush(inst: object, attr: attrs.Attribute, value: str) -> None:
    if value not in ("sync", "async"):
        raise ValueError(f"--ssd-flush must be sync or async, got {value!r}")


def _ssd_write(inst: object, attr: attrs.Attribute, value: str) -> None:
    if value not in ("through", "back"):
        raise ValueError(f"ssd-write must be through or back, got {value!r}")


def _speculative(inst: object, attr: attrs.Attribute, value: str | None) -> None:
    if value is not None and value not in ("draft", "mtp", "lookup"):
        raise ValueError(f"--speculative must be draft, mtp or lookup (or unset), got {value!r}")


def _num_speculative(inst: object, attr: attrs.Attribute, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 16:
        raise ValueError(f"{flag_name(attr)} must be an integer in [1, 16], got {value!r}")


AUTO_CHOICES = ("auto", "on", "off")  # --warmup, --fast-decode (engine.model.auto_on_gpu)


def _auto_on_off(inst: object, attr: attrs.Attribute, value: str) -> None:
    if value not in AUTO_CHOICES:
        raise ValueError(f"{flag_name(attr)} must be one of {', '.join(AUTO_CHOICES)}, "
                         f"got {value!r}")


@attrs.frozen(kw_only=True)
class Config:
    """The engine's settings (defaults suit a laptop and the bundled model). The server's
    (address, connections, auth, the HTTP APIs' names) are api.config.ServerConfig's."""

    model: str = str(DEFAULT_MODEL)
    dtype: str = attrs.field(default="auto", validator=_dtype)
    # Quantized layers (4/8-bit checkpoints, GGUF Q4_0/Q4_1/Q8_0): keep packed, dequantize
    # at load, or auto = dequantize on the CPU backend, where that decodes faster.
    quantized_weights: str = attrs.field(default="auto", validator=_quantized_weights)
    max_batch: int = attrs.field(default=32, validator=positive)
    prefill_chunk: int = attrs.field(default=512, validator=positive)
    # Tokens one engine step processes: decoding rows one each, prefill (padding included)
    # the rest (engine.scheduler's module doc; docs/serving.md "Batched prefill" for the default).
    max_step_tokens: int = attrs.field(default=1024, validator=positive)
    max_queued_requests: int = attrs.field(default=64, validator=positive)
    max_queued_tokens: int = attrs.field(default=65536, validator=positive)
    max_tokens_cap: int = attrs.field(default=4096, validator=positive)
    default_max_tokens: int = attrs.field(default=256, validator=positive)
    stream_buffer: int = attrs.field(default=1024, validator=positive)
    # What one request may carry (docs/limits.md): checked before tokenizing.
    max_prompt_chars: int = attrs.field(default=262144, validator=positive)
    max_messages: int = attrs.field(default=256, validator=positive)
    # KV bytes every admitted row may come to hold together (engine.kv_budget); 0: from
    # the machine at start (engine.memory: half the free RAM, 80% of free GPU memory).
    kv_budget_bytes: int = attrs.field(default=0, validator=_non_negative)
    # reserve: rows are charged their whole lives at start (never preempted); preempt: what
    # they hold now, the longest preempted to the prefix cache under pressure (kv_budget)
    kv_admission: str = attrs.field(default="reserve",
                                    validator=attrs.validators.in_(("reserve", "preempt")))
    turboquant: str | None = attrs.field(default=None, validator=_turboquant)
    quantized_kv_start: int = attrs.field(default=0, validator=_non_negative)
    kv_quant: int | None = attrs.field(default=None, validator=_kv_quant)
    kv_group_size: int = attrs.field(default=64, validator=_kv_group_size)
    # TurboQuant's decode attention (engine.attention.sdpa): auto (CUDA kernels on MLX-CUDA,
    # compiled ops elsewhere), compiled, or unfused (dequantize, then the fused SDPA).
    turboquant_decode: str = attrs.field(default="auto", validator=_turboquant_decode)
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
    ssd_cache_bytes: int = attrs.field(default=16 << 30, validator=positive)
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
    # Tensor parallel over mx.distributed (engine.distributed): this process is one rank of
    # a group started by mlx.launch; rank 0 serves, the others follow its plans. With
    # cache_dir each rank keeps its own shard of every snapshot file (storage.shard).
    distributed: bool = False
    # Seconds one group operation (a step, a broadcast) may take before the rank exits 1.
    distributed_timeout: float = attrs.field(default=60.0, validator=positive_seconds)
    # Chat (docs/agents.md): a Jinja chat template file overriding the model's, used when
    # the engine renders a request's messages.
    chat_template: str | None = attrs.field(default=None, validator=_chat_template)

    def __attrs_post_init__(self) -> None:
        if self.quantized_kv_start > 0 and self.kv_quant is not None and self.turboquant is None:
            raise ValueError("--quantized-kv-start applies to TurboQuant only; --kv-quant "
                             "quantizes from the first token")
        if self.speculative == "draft" and self.draft_model is None:
            raise ValueError("--speculative draft needs a draft model: --speculative-config "
                             "'{\"model\": PATH}'")
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
