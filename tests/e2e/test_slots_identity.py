"""The decode batch in per-row slots gives the same greedy tokens as each row decoded
alone on its own single-row caches, for every cache kind with slots.

The bundled model in float32 decodes up to four rows at a time: rows join mid-run (a
single row as it is, and a prefill group prefilled in slots by the engine's own
PrefillGroups), rows retire mid-run (with `retire_order`), through the model's own
forward and mask. Every row must agree with itself decoded alone, token for token and in
logits (float rounding of the batched layout only). Then delayed TurboQuant slots under
speculation, through the engine.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest
import trio
from mlx_lm.models.cache import make_prompt_cache

from tqserve.actors.engine import open_engine
from tqserve.actors.messages import Done, Token
from tqserve.engine.config import Config
from tqserve.engine.request import GenerateRequest
from tqserve.engine.sampling import SamplingParams

from tqserve.engine.kv.factory import cache_factory_for
from tqserve.engine.kv.slots import is_slot_batch, retire_order, slot_batch
from tqserve.engine.prefill import PrefillGroups
from tqserve.engine.step import PrefillChunk
from tests.e2e.reference import PROMPTS

# (prompt index, step it joins at, tokens before it retires); rows 3 and 4 join together
# as one prefill group (unequal prompts, so the shorter one is padded and trimmed)
SCHEDULE = [(2, 0, 14), (0, 0, 6), (5, 2, 12), (6, 4, 9), (1, 4, 10), (3, 9, 6)]
KINDS = {
    "plain": dict(turboquant=None),
    "tq-k4v4": dict(turboquant="k4v4"),
    "tq-k8v3": dict(turboquant="k8v3"),
    "tq-k4v4-plain-ops": dict(turboquant="k4v4", decode="unfused"),
    "delayed-k4v4-start-12": dict(turboquant="k4v4", quantized_kv_start=12),
    "affine-8": dict(turboquant=None, kv_quant=8, kv_group_size=64),
}


CHUNK = 5  # prefill positions per forward, alone and in a group (delayed TurboQuant
#           converts at the first append past its start, so both sides chunk alike)


def _prefill(model: Any, make: Any, ids: list[int]) -> list[Any]:
    cache = make(model)
    for start in range(0, len(ids) - 1, CHUNK):
        model(mx.array(ids[start:min(start + CHUNK, len(ids) - 1)])[None], cache=cache)
    return cache


def _group(model: Any, make: Any, prompts: list[list[int]], chunk: int) -> list[Any]:
    """One prefill group of the engine's PrefillGroups, `chunk` columns per forward."""
    groups = PrefillGroups(model)
    for k in range(len(prompts)):
        groups.add(f"r{k}", 1, make(model))
    width = max(len(p) for p in prompts) - 1
    for done in range(0, width, chunk):
        columns = min(chunk, width - done)
        groups.run([PrefillChunk(request_id=f"r{k}", start=min(done, len(p) - 1),
                                 end=min(done + columns, len(p) - 1), group=1, columns=columns)
                    for k, p in enumerate(prompts)],
                   {f"r{k}": tuple(p) for k, p in enumerate(prompts)})
    taken = groups.take("r0")
    assert taken is not None and taken[0] == [f"r{k}" for k in range(len(prompts))]
    return taken[1]


def _log_softmax(out: mx.array) -> mx.array:
    return out - mx.logsumexp(out, axis=-1, keepdims=True)


def alone(loaded: Any, make: Any) -> tuple[dict[int, list[int]], dict]:
    """Each prompt of SCHEDULE decoded on its own single-row caches."""
    model = loaded.model
    tokens: dict[int, list[int]] = {}
    logits_of: dict[int, list[np.ndarray]] = {}
    for p, _, limit in SCHEDULE:
        ids = loaded.tokenizer.encode(PROMPTS[p])
        cache, last = _prefill(model, make, ids), ids[-1]
        tokens[p], logits_of[p] = [], []
        for _ in range(limit):
            out = _log_softmax(model(mx.array([[last]]), cache=cache)[:, -1, :])
            last = int(mx.argmax(out, axis=-1).item())
            tokens[p].append(last)
            logits_of[p].append(np.array(out[0]))
    return tokens, logits_of


def batched(loaded: Any, make: Any) -> tuple[dict[int, list[int]], dict]:
    """Run SCHEDULE in one slot decode batch; returns tokens and log-softmaxed logits."""
    model = loaded.model
    ids = {p: loaded.tokenizer.encode(PROMPTS[p]) for p, _, _ in SCHEDULE}
    batch: list[Any] | None = None
    rows: list[int] = []
    tokens: dict[int, list[int]] = {p: [] for p, _, _ in SCHEDULE}
    logits_of: dict[int, list[np.ndarray]] = {p: [] for p, _, _ in SCHEDULE}
    last = {p: ids[p][-1] for p in ids}
    limit = {p: n for p, _, n in SCHEDULE}
    for step in range(40):
        joining = [p for p, at, _ in SCHEDULE if at == step]
        if len(joining) > 1:
            joined = [_group(model, make, [ids[p] for p in joining], CHUNK)]
        else:
            joined = [_prefill(model, make, ids[p]) for p in joining]
        for cache in joined:
            if batch is None:
                batch = [c if is_slot_batch(c) else slot_batch(c) for c in cache]
            else:
                for mine, theirs in zip(batch, cache):
                    mine.extend(theirs)
        rows += joining
        if not rows:
            break
        assert all(is_slot_batch(c) for c in batch or ())
        out = _log_softmax(model(mx.array([last[p] for p in rows])[:, None], cache=batch)[:, -1, :])
        for p, t, lp in zip(rows, mx.argmax(out, axis=-1).tolist(), np.array(out)):
            tokens[p].append(t)
            logits_of[p].append(lp)
            last[p] = t
        gone = [i for i, p in enumerate(rows) if len(tokens[p]) >= limit[p]]
        if gone:
            keep = retire_order(len(rows), gone)
            rows = [rows[i] for i in keep]
            if not rows:
                batch = None
                continue
            for cache in batch or ():
                cache.filter(keep)
    assert batch is None and all(len(tokens[p]) == limit[p] for p in tokens)
    return tokens, logits_of


@pytest.mark.parametrize("kind", list(KINDS))
def test_slots_match_each_row_decoded_alone(draft_model, kind, monkeypatch):
    make = cache_factory_for(draft_model.model, **KINDS[kind]) or make_prompt_cache
    fresh = make(draft_model.model)
    assert all(is_slot_batch(slot_batch(c)) for c in fresh)
    assert all(getattr(c, "config", None) is None or c.config.fused_decode
               != kind.endswith("plain-ops") for c in fresh)
    lengths = {len(draft_model.tokenizer.encode(PROMPTS[p])) for p, at, _ in SCHEDULE if at == 4}
    assert len(lengths) == 2  # the group's rows are unequal: one is padded and trimmed
    want, want_logits = alone(draft_model, make)
    got, got_logits = batched(draft_model, make)
    assert got == want
    worst = max(float(np.max(np.abs(a - b))) for p in got
                for a, b in zip(got_logits[p], want_logits[p]))
    print(f"{kind}: {sum(map(len, got.values()))} tokens equal, worst logprob diff {worst:.2e}")
    # Float rounding of batched matmuls (OpenBLAS rounds a batch's rows unlike one row's)
    # stays below 1e-4 in the logprobs; an 8-bit affine key can land one quantization step
    # away from it, which measured 3.8e-3 (2026-12-04).
    assert worst < (1e-2 if kind.startswith("affine") else 1e-3)


async def _generate(engine: Any, prompt: str, speculative: bool | None) -> tuple[list[int], Any]:
    req = GenerateRequest(prompt=prompt, speculative=speculative,
                          params=SamplingParams(max_tokens=24, temperature=0.0))
    tokens, done = [], None
    async for event in engine.generate(req):
        if isinstance(event, Token):
            tokens.append(event.token_id)
        elif isinstance(event, Done):
            done = event
    return tokens, done


async def test_delayed_turboquant_slots_under_speculation(draft_model):
    """Delayed k4v4 (start 20) with lookup speculation, four rows at once: verify blocks
    cross the threshold and per-row rollback (trim_rows on the slots) must leave each row
    converting at its committed offset, so speculating rows give their plain twins'
    tokens (speculative false, same engine and cache kind)."""
    picks = [2, 6, 5, 0]
    config = Config(max_batch=4, prefill_chunk=16, speculative="lookup", turboquant="k4v4",
                    quantized_kv_start=20, num_speculative_tokens=4)
    out: dict[tuple[int, bool], tuple[list[int], Any]] = {}

    async def one(idx: int, speculative: bool) -> None:
        out[idx, speculative] = await _generate(engine, PROMPTS[idx], None if speculative
                                                else False)

    async with open_engine(config, loaded=draft_model) as engine:
        for speculative in (False, True):
            async with trio.open_nursery() as nursery:
                for idx in picks:
                    nursery.start_soon(one, idx, speculative)
        await engine.wait_idle()
        assert engine.statistics().rows_active == 0
    same = sum(out[i, False][0] == out[i, True][0] for i in picks)
    assert same >= 3, {i: (out[i, False][0], out[i, True][0]) for i in picks}
    assert all(len(out[i, True][0]) == 24 or out[i, True][1].finish_reason == "stop"
               for i in picks)
    assert sum(out[i, True][1].speculative[1] for i in picks) > 0  # tokens were accepted
