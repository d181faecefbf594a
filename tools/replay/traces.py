"""Trace loaders: Mooncake JSONL, Azure LLM inference CSV, tqserve recordings.

Every loader returns `TraceRequest`s: arrival time, the exact prompt token ids to send,
max_tokens, sampling fields, a prefix family, and `implied_input_tokens` — what the trace
says this request's prompt is at the chosen scale (a float), so that the total actually
sent can be checked against the trace (vLLM's timed_trace defaults to 16-token blocks
while Mooncake's are 512: prompts came out 32x short and nobody noticed).

* Mooncake: `hash_ids` are 512-token blocks (MOONCAKE_BLOCK). Block id b becomes
  `block_tokens` deterministic token ids (a PRNG seeded by b, ids in [FIRST_TOKEN, vocab)
  so that EOS and pad never appear); equal ids give equal tokens, so shared prefixes stay
  shared. A request's last, usually partial, block is cut in proportion:
  round(last_len * block_tokens / 512) tokens, at least 1, taken from the front of its
  block. The implied total is input_length * block_tokens / 512.
* Azure: timestamps, ContextTokens, GeneratedTokens; the prompt is a slice (at a
  deterministic offset) of a token stream made from a text corpus — by default the Python
  sources of the installed mlx-lm, tokenized with the model's tokenizer — scaled by
  `length_scale`.
* Recordings (`storage/recording.py`): exact prompts, params and the expected output.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable, Sequence

import attrs
import numpy as np

MOONCAKE_BLOCK = 512  # tokens per hash_ids block in Mooncake's traces (FAST'25 README)
FIRST_TOKEN = 2       # the bundled tokenizer's <|endoftext|> = 0, <|pad|> = 1: never sent
BLOCK_SEED = 0x7153   # salts the per-block PRNG, so tools agree on a block's tokens


@attrs.frozen(kw_only=True)
class TraceRequest:
    index: int
    arrival_s: float
    prompt_tokens: tuple[int, ...]
    max_tokens: int
    family: str
    implied_input_tokens: float
    params: dict[str, Any] = attrs.Factory(dict)  # sampling fields beyond max_tokens
    expected_tokens: tuple[int, ...] | None = None  # recordings only
    expected_finish: str | None = None


def block_tokens_for(block_id: int, n: int, vocab_size: int) -> np.ndarray:
    """The deterministic token ids of one Mooncake block (the first n of them)."""
    rng = np.random.default_rng([BLOCK_SEED, block_id])
    return rng.integers(FIRST_TOKEN, vocab_size, size=n)


def scaled_last_block(input_length: int, num_blocks: int, block_tokens: int) -> int:
    """Tokens sent for a request's last block: its share of 512, cut in proportion."""
    last = input_length - MOONCAKE_BLOCK * (num_blocks - 1)
    return max(1, round(last * block_tokens / MOONCAKE_BLOCK))


def load_mooncake(path: str | Path, *, block_tokens: int, vocab_size: int,
                  max_output: int | None = None) -> list[TraceRequest]:
    """Mooncake JSONL (timestamp ms, input_length, output_length, hash_ids)."""
    if not 1 <= block_tokens <= MOONCAKE_BLOCK:
        raise ValueError(f"--block-tokens must be in [1, {MOONCAKE_BLOCK}], got {block_tokens}")
    cache: dict[int, np.ndarray] = {}
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                ts, n_in, n_out = int(row["timestamp"]), int(row["input_length"]), \
                    int(row["output_length"])
                ids = [int(h) for h in row["hash_ids"]]
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: not a Mooncake row: {exc}") from None
            if not ids or len(ids) != math.ceil(n_in / MOONCAKE_BLOCK):
                raise ValueError(
                    f"{path}:{lineno}: {len(ids)} hash_ids for input_length {n_in}: not "
                    f"{MOONCAKE_BLOCK}-token blocks (ceil(input_length/512) expected)")
            parts = []
            for j, h in enumerate(ids):
                if h not in cache:
                    cache[h] = block_tokens_for(h, block_tokens, vocab_size)
                n = block_tokens if j < len(ids) - 1 else \
                    scaled_last_block(n_in, len(ids), block_tokens)
                parts.append(cache[h][:n])
            tokens = tuple(int(t) for t in np.concatenate(parts))
            cap = n_out if max_output is None else min(n_out, max_output)
            out.append(TraceRequest(
                index=len(out), arrival_s=ts / 1000.0, prompt_tokens=tokens,
                max_tokens=max(1, cap), family=":".join(map(str, ids[:2])),
                implied_input_tokens=n_in * block_tokens / MOONCAKE_BLOCK))
    return out


def corpus_tokens(tokenizer: Any, paths: Iterable[Path]) -> list[int]:
    """One token stream from text files (sorted by path), separated by newlines."""
    out: list[int] = []
    for p in sorted(paths):
        out.extend(tokenizer.encode(p.read_text(encoding="utf-8", errors="replace") + "\n"))
    return out


def default_corpus_paths() -> list[Path]:
    """The Python sources of the installed mlx-lm (text the bundled models never saw)."""
    import mlx_lm

    return sorted(Path(mlx_lm.__file__).parent.rglob("*.py"))


def load_azure(path: str | Path, *, corpus: Sequence[int], length_scale: float = 1.0,
               max_output: int | None = None) -> list[TraceRequest]:
    """Azure LLM inference CSV (TIMESTAMP, ContextTokens, GeneratedTokens)."""
    if not 0 < length_scale <= 1:
        raise ValueError(f"--length-scale must be in (0, 1], got {length_scale}")
    out: list[TraceRequest] = []
    t0 = None
    with open(path, newline="", encoding="utf-8") as f:
        for lineno, row in enumerate(csv.DictReader(f), 2):
            try:
                t = datetime.fromisoformat(row["TIMESTAMP"][:26]).timestamp()
                n_in, n_out = int(row["ContextTokens"]), int(row["GeneratedTokens"])
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: not an Azure trace row: {exc}") from None
            t0 = t if t0 is None else t0
            n = max(1, round(n_in * length_scale))
            if n >= len(corpus):
                raise ValueError(f"{path}:{lineno}: prompt of {n} tokens is longer than the "
                                 f"corpus ({len(corpus)} tokens)")
            digest = hashlib.blake2b(f"azure:{len(out)}".encode(), digest_size=8).digest()
            start = int.from_bytes(digest, "little") % (len(corpus) - n)
            cap = n_out if max_output is None else min(n_out, max_output)
            out.append(TraceRequest(
                index=len(out), arrival_s=t - t0, prompt_tokens=tuple(corpus[start:start + n]),
                max_tokens=max(1, cap), family=str(len(out)),
                implied_input_tokens=n_in * length_scale))
    return out


def from_recording(records: Sequence[dict[str, Any]]) -> list[TraceRequest]:
    """Requests of a tqserve recording, with their expected outputs."""
    out = []
    for r in records:
        params = dict(r["params"])
        max_tokens = params.pop("max_tokens")
        tokens = tuple(r["prompt_tokens"])
        out.append(TraceRequest(
            index=len(out), arrival_s=float(r["arrival_s"]), prompt_tokens=tokens,
            max_tokens=max_tokens, family=str(tokens[:8]), implied_input_tokens=len(tokens),
            params=params, expected_tokens=tuple(r["output_tokens"]),
            expected_finish=r["finish_reason"]))
    return out


def subsample_families(requests: Sequence[TraceRequest], fraction: float) -> list[TraceRequest]:
    """Keep whole prefix families (a deterministic `fraction` of them), so reuse survives."""
    if not 0 < fraction <= 1:
        raise ValueError(f"--family-fraction must be in (0, 1], got {fraction}")
    keep = []
    for r in requests:
        h = int.from_bytes(hashlib.blake2b(r.family.encode(), digest_size=8).digest(), "little")
        if h % 1_000_000 < fraction * 1_000_000:
            keep.append(r)
    return keep
