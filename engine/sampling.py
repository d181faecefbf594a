"""Sampling for all rows of a batch at once: params, seeded noise, masks, logprobs.

One graph per step serves every row (no per-row loop over arrays, no host sync but the
one that reads the results). Sampling is Gumbel-max over the processed logits, which is
exactly categorical sampling from the filtered softmax(logits/T). The noise of a row is
a pure function of (seed, token index, vocabulary position): a counter-based hash
(`row_keys` mixes seed and index on the host; `gumbel_noise` hashes each position with
them, murmur3's 32-bit finalizer twice, 23 uniform bits per draw), computed for all rows
in one vectorized expression. So a seeded row draws the same noise, and the same tokens
from the same logits, whether it runs alone or inside any batch, on any backend (only
uint32 arithmetic and one log pair per draw). Rows without a seed get a fresh random
one. `temperature == 0` is greedy.

Processing order (as vLLM): repetition penalty (over prompt and output tokens, each seen
token once: a per-row presence mask kept on the host, stacked per step), then OpenAI's
presence and frequency penalties (over output tokens: a token's logit less
presence_penalty once it appeared, less frequency_penalty per appearance) and logit_bias
(added to the named tokens' logits), one additive (B, V) array built on the host,
the row's grammar mask (structured output: disallowed tokens get -inf), temperature,
top-k, top-p, min-p. Logprobs are always the raw model distribution's log-softmax,
before any processing -- the grammar mask included: a constrained row reports the
target model's own logprob of the token it was made to take, and its top logprobs may
name tokens the grammar forbade.
"""

from __future__ import annotations

import secrets
from typing import Any, Sequence

import attrs
import mlx.core as mx
import numpy as np

from tqserve.engine.arrays import int_list
from tqserve.engine.penalties import additive, bias_pairs, check_bias

MAX_TOP_LOGPROBS = 20
# What one request may carry in its stop lists (each is checked against every new token).
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256        # characters of one stop string
MAX_STOP_TOKEN_IDS = 64
MAX_TOKEN_ID = 2**31 - 1    # token ids travel as int32; the model's vocabulary is checked too
_NEG_INF = float("-inf")


def _in_range(lo: float, hi: float, *, lo_open: bool = False):
    def check(inst: object, attr: attrs.Attribute, value: float) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{attr.name} must be a number, got {type(value).__name__}")
        bad_lo = value <= lo if lo_open else value < lo
        if bad_lo or value > hi or value != value:
            bound = "(" if lo_open else "["
            raise ValueError(f"{attr.name} must be in {bound}{lo}, {hi}], got {value}")

    return check


def _int_range(lo: int, hi: int):
    def check(inst: object, attr: attrs.Attribute, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{attr.name} must be an integer, got {type(value).__name__}")
        if not lo <= value <= hi:
            raise ValueError(f"{attr.name} must be in [{lo}, {hi}], got {value}")

    return check


def _seed(inst: object, attr: attrs.Attribute, value: int | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:
        raise ValueError(f"seed must be an integer in [0, 2**63) or null, got {value!r}")


def _bool(inst: object, attr: attrs.Attribute, value: bool) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{attr.name} must be true or false, got {value!r}")


def _str_tuple(inst: object, attr: attrs.Attribute, value: tuple) -> None:
    if len(value) > MAX_STOP_STRINGS:
        raise ValueError(f"{attr.name} may hold at most {MAX_STOP_STRINGS} entries, "
                         f"got {len(value)}")
    if not all(isinstance(s, str) and s for s in value):
        raise ValueError(f"{attr.name} must be a list of non-empty strings")
    longest = max(map(len, value), default=0)
    if longest > MAX_STOP_CHARS:
        raise ValueError(f"{attr.name} entries may hold at most {MAX_STOP_CHARS} characters, "
                         f"got {longest}")


def _int_tuple(inst: object, attr: attrs.Attribute, value: tuple) -> None:
    if len(value) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"{attr.name} may hold at most {MAX_STOP_TOKEN_IDS} entries, "
                         f"got {len(value)}")
    if not all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in value):
        raise ValueError(f"{attr.name} must be a list of token ids in [0, {MAX_TOKEN_ID}]")


@attrs.frozen(kw_only=True)
class SamplingParams:
    """What a request asks of sampling and stopping. Validated at construction."""

    max_tokens: int = attrs.field(default=256, validator=_int_range(1, 1 << 20))
    temperature: float = attrs.field(default=1.0, validator=_in_range(0.0, 100.0))
    top_p: float = attrs.field(default=1.0, validator=_in_range(0.0, 1.0, lo_open=True))
    top_k: int = attrs.field(default=0, validator=_int_range(0, 1 << 20))
    min_p: float = attrs.field(default=0.0, validator=_in_range(0.0, 1.0))
    repetition_penalty: float = attrs.field(
        default=1.0, validator=_in_range(0.0, 10.0, lo_open=True)
    )
    seed: int | None = attrs.field(default=None, validator=_seed)
    logprobs: bool = attrs.field(default=False, validator=_bool)
    top_logprobs: int = attrs.field(default=0, validator=_int_range(0, MAX_TOP_LOGPROBS))
    stop: tuple[str, ...] = attrs.field(default=(), converter=tuple, validator=_str_tuple)
    stop_token_ids: tuple[int, ...] = attrs.field(
        default=(), converter=tuple, validator=_int_tuple
    )
    presence_penalty: float = attrs.field(default=0.0, validator=_in_range(-2.0, 2.0))
    frequency_penalty: float = attrs.field(default=0.0, validator=_in_range(-2.0, 2.0))
    logit_bias: tuple[tuple[int, float], ...] = attrs.field(default=(), converter=bias_pairs,
                                                           validator=check_bias)
    # each prompt token's logprob and this many alternatives (engine.prompt_logprobs)
    prompt_logprobs: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(_int_range(0, MAX_TOP_LOGPROBS)))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def counts_output(self) -> bool:
        """Presence or frequency penalties: the row counts its output tokens."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def adds_to_logits(self) -> bool:
        return self.counts_output or bool(self.logit_bias)


@attrs.define
class RowSampler:
    """One row's sampling state: params, its seed, how many tokens it drew, and (with a
    repetition penalty) which token ids it has seen."""

    params: SamplingParams
    seed: int
    num_sampled: int = 0
    _unseen: list[int] = attrs.Factory(list)  # ids to mark once the vocabulary is known
    _seen: np.ndarray | None = None
    counts: dict[int, int] = attrs.Factory(dict)  # output token -> times (counts_output)

    @classmethod
    def create(cls, params: SamplingParams, prompt: Sequence[int]) -> "RowSampler":
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        penalized = params.repetition_penalty != 1.0
        return cls(params=params, seed=seed, unseen=list(prompt) if penalized else [])

    @property
    def penalized(self) -> bool:
        return self.params.repetition_penalty != 1.0

    def seen(self, vocab: int) -> np.ndarray:
        """Presence mask (vocab,) bool of the prompt and output tokens so far."""
        if self._seen is None:
            self._seen = np.zeros(vocab, dtype=bool)
        if self._unseen:
            ids = np.asarray(self._unseen, dtype=np.int64)
            self._seen[ids[ids < vocab]] = True
            self._unseen = []
        return self._seen

    def record(self, token: int) -> None:
        self.num_sampled += 1
        if self.penalized:
            self._unseen.append(token)
        if self.params.counts_output:
            self.counts[token] = self.counts.get(token, 0) + 1

    def advanced(self, tokens: Sequence[int]) -> "RowSampler":
        """A copy as it would be after recording `tokens` (this sampler is unchanged): the
        sampler of a later position of a speculative verify block. Its noise is that of
        the same token index in plain decoding."""
        seen = None if self._seen is None else self._seen.copy()
        unseen = [*self._unseen, *tokens] if self.penalized else []
        counts = dict(self.counts)
        if self.params.counts_output:
            for t in tokens:
                counts[t] = counts.get(t, 0) + 1
        return RowSampler(params=self.params, seed=self.seed,
                          num_sampled=self.num_sampled + len(tokens), unseen=unseen, seen=seen,
                          counts=counts)


@attrs.frozen
class SampleOutput:
    """Host-side results of one batched sampling call."""

    tokens: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]


_GOLDEN = 0x9E3779B9
_FMIX1, _FMIX2 = 0x85EBCA6B, 0xC2B2AE35  # murmur3's fmix32 constants


def _fmix_np(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(_FMIX1)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(_FMIX2)
    return h ^ (h >> np.uint32(16))


def _fmix(h: mx.array) -> mx.array:
    h = h ^ (h >> 16)
    h = h * mx.array(_FMIX1, dtype=mx.uint32)
    h = h ^ (h >> 13)
    h = h * mx.array(_FMIX2, dtype=mx.uint32)
    return h ^ (h >> 16)


def row_keys(seeds: Sequence[int], indices: Sequence[int]) -> np.ndarray:
    """(B, 2) uint32 keys, one pair per (seed, token index): what a row's noise at that
    index is a function of."""
    seed = np.asarray(seeds, dtype=np.uint64)
    lo = (seed & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    hi = (seed >> np.uint64(32)).astype(np.uint32)
    index = np.asarray(indices, dtype=np.uint32)
    with np.errstate(over="ignore"):
        k = _fmix_np(hi ^ _fmix_np(index * np.uint32(_GOLDEN) + np.uint32(0x632BE5AB)))
        k1 = _fmix_np(lo ^ k)
        k2 = _fmix_np(k1 ^ np.uint32(0x5BD1E995))
    return np.stack([k1, k2], axis=1)


def gumbel_noise(keys: np.ndarray, vocab: int) -> mx.array:
    """(B, vocab) standard Gumbel noise; row i depends on keys[i] only."""
    k = mx.array(keys)
    position = mx.arange(vocab, dtype=mx.uint32)[None] * mx.array(_GOLDEN, dtype=mx.uint32)
    bits = _fmix(_fmix(position ^ k[:, :1]) + k[:, 1:])
    return -mx.log(-mx.log(open_uniform(bits)))


def open_uniform(bits: mx.array) -> mx.array:
    """uint32 bits -> float32 uniform in the OPEN interval (0, 1): the top 23 bits, centred
    (24 would round the largest value up to 1.0 in float32: an infinite Gumbel draw, and
    -inf + inf = NaN on a masked token)."""
    return ((bits >> 9).astype(mx.float32) + 0.5) * (2.0 ** -23)


def _penalize(logits: mx.array, rows: Sequence[RowSampler]) -> mx.array:
    """Repetition penalty for every row at once: seen tokens' logits are divided by the
    row's penalty (multiplied when negative); rows without one are unchanged."""
    vocab = logits.shape[-1]
    seen = np.zeros((len(rows), vocab), dtype=bool)
    for i, row in enumerate(rows):
        if row.penalized:
            seen[i] = row.seen(vocab)
    penalty = mx.array([r.params.repetition_penalty for r in rows], dtype=mx.float32)[:, None]
    penalized = mx.where(logits < 0, logits * penalty, logits / penalty)
    return mx.where(mx.array(seen), penalized, logits)


def _filter(scaled: mx.array, rows: Sequence[RowSampler]) -> mx.array:
    """Apply top-k, top-p and min-p masks, vectorized with per-row values."""
    vocab = scaled.shape[-1]
    top_k = [r.params.top_k for r in rows]
    top_p = [r.params.top_p for r in rows]
    min_p = [r.params.min_p for r in rows]
    if any(0 < k < vocab for k in top_k):
        kth = mx.array([min(k, vocab) if k > 0 else vocab for k in top_k]) - 1
        ordered = mx.sort(scaled, axis=-1)[:, ::-1]
        thresh = mx.take_along_axis(ordered, kth[:, None], axis=-1)
        scaled = mx.where(scaled < thresh, _NEG_INF, scaled)
    if any(p < 1.0 for p in top_p):
        order = mx.argsort(-scaled, axis=-1)
        probs = mx.softmax(mx.take_along_axis(scaled, order, axis=-1), axis=-1)
        before = mx.cumsum(probs, axis=-1) - probs
        drop_sorted = before >= mx.array(top_p)[:, None]
        inverse = mx.argsort(order, axis=-1)
        drop = mx.take_along_axis(drop_sorted, inverse, axis=-1)
        scaled = mx.where(drop, _NEG_INF, scaled)
    if any(p > 0.0 for p in min_p):
        probs = mx.softmax(scaled, axis=-1)
        floor = mx.max(probs, axis=-1, keepdims=True) * mx.array(min_p)[:, None]
        scaled = mx.where(probs < floor, _NEG_INF, scaled)
    return scaled


@attrs.frozen(eq=False)
class LazySample:
    """A batched sampling graph, not yet evaluated: `tokens` (B,) can feed the next step."""

    tokens: mx.array
    outputs: tuple[mx.array, ...]
    want_lp: bool
    top_k: int


def sample_rows(logits: mx.array, rows: Sequence[RowSampler],
                masks: np.ndarray | None = None) -> SampleOutput:
    """Sample one token per row of `logits` (B, V); evaluates and returns host data."""
    return finalize_sample(build_sample(logits, rows, masks), rows)


def apply_token_masks(logits: mx.array, masks: np.ndarray) -> mx.array:
    """Set logits of disallowed tokens to -inf. `masks` (B, W) int32: bit t % 32 of word
    t // 32 allows token t; an unconstrained row is all ones (its logits stay bit-equal)."""
    vocab = logits.shape[-1]
    words = mx.array(masks.view(np.uint32))
    bits = (words[:, :, None] >> mx.arange(32, dtype=mx.uint32)) & 1
    allowed = bits.reshape(words.shape[0], -1)
    if allowed.shape[1] < vocab:
        allowed = mx.pad(allowed, [(0, 0), (0, vocab - allowed.shape[1])])
    return mx.where(allowed[:, :vocab] == 1, logits, _NEG_INF)


def build_sample(logits: mx.array, rows: Sequence[RowSampler],
                 masks: np.ndarray | None = None) -> LazySample:
    """Build (without evaluating) the sampling graph for one step of `rows`; `masks`
    (see `apply_token_masks`) constrains rows to their grammars."""
    logits = logits.astype(mx.float32)
    want_lp = any(r.params.logprobs or r.params.top_logprobs for r in rows)
    if any(r.penalized for r in rows):
        processed = _penalize(logits, rows)
    else:
        processed = logits
    if any(r.params.adds_to_logits for r in rows):
        processed = additive(processed, rows)
    if masks is not None:
        processed = apply_token_masks(processed, masks)
    greedy_tok = mx.argmax(processed, axis=-1)
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
    tokens = greedy_tok
    if sampled:
        temps = mx.array([max(r.params.temperature, 1e-6) for r in rows])[:, None]
        scaled = _filter(processed / temps, rows)
        keys = row_keys([r.seed for r in rows], [r.num_sampled for r in rows])
        noise = gumbel_noise(keys, logits.shape[-1])
        drawn = mx.argmax(scaled + noise, axis=-1)
        is_greedy = mx.array([r.params.greedy for r in rows])
        tokens = mx.where(is_greedy, greedy_tok, drawn)
    outputs: list = [tokens]
    k = max((r.params.top_logprobs for r in rows), default=0)
    if want_lp:
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        chosen = mx.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
        outputs.append(chosen)
        if k:
            top_idx = mx.argsort(-logprobs, axis=-1)[:, :k]
            outputs += [top_idx, mx.take_along_axis(logprobs, top_idx, axis=-1)]
    return LazySample(tokens=tokens, outputs=tuple(outputs), want_lp=want_lp, top_k=k)


def finalize_sample(lazy: LazySample, rows: Sequence[RowSampler]) -> SampleOutput:
    """Evaluate a built sample, advance each row's sampler, return host data."""
    outputs: tuple[Any, ...] = lazy.outputs
    want_lp, k, tokens = lazy.want_lp, lazy.top_k, lazy.tokens
    mx.eval(*outputs)
    token_list = int_list(tokens)
    lp_list: list[float | None] = [None] * len(rows)
    top_list: list[list[tuple[int, float]] | None] = [None] * len(rows)
    if want_lp:
        chosen_list = outputs[1].tolist()
        top_ids = outputs[2].tolist() if k else None
        top_vals = outputs[3].tolist() if k else None
        for i, r in enumerate(rows):
            if r.params.logprobs or r.params.top_logprobs:
                lp_list[i] = chosen_list[i]
            if r.params.top_logprobs and top_ids is not None and top_vals is not None:
                n = r.params.top_logprobs
                top_list[i] = list(zip(top_ids[i][:n], top_vals[i][:n]))
    for r, t in zip(rows, token_list):
        r.record(t)
    return SampleOutput(tokens=token_list, logprobs=lp_list, top_logprobs=top_list)
