"""Paired snapshots (engine.speculative.state): the snapshots of a draft or MTP row carry its
proposer's state for the same tokens, restored with the target's KV from RAM and, after a
restart, from the SSD tier, so the restored row proposes what the cold row did: the same
tokens AND the same usage.speculative (an MTP row restored without its head's state could
not propose at its first step). Files whose paired planes are missing, corrupt or do not
fit the head are quarantined misses; state-free requests (speculative false, lookup) and
paired rows never reuse each other's snapshots (engine.namespaces).

pycoder-29m (float32, CPU) is the target, the bundled pycoder-draft-4m its draft, MTP its
own head; prompts of tens of tokens, 12 new tokens, real files (write-through, sync).
"""

from __future__ import annotations

import numpy as np
import pytest

from tqserve.actors.engine import open_engine
from tqserve.engine.config import Config
from tqserve.engine.model import DEFAULT_MODEL
from tqserve.storage.snapshot import decode_header, encode_snapshot, read_snapshot
from tests.e2e.test_prefix_cache import settle
from tests.e2e.test_prefix_corruption import _flip, _header_end
from tests.e2e.test_prefix_write_through import cold, run
from tests.e2e.test_speculative_identity import _run
from tests.e2e.test_speculative_restart import PROMPTS, serve_prompts

MAX_TOKENS = 12
SEEDS = [None, 7]  # PROMPTS[0] greedy, PROMPTS[1] seeded (temperature 1)


def _config(tmp_path, method: str) -> Config:
    extra = {"draft_model": str(DEFAULT_MODEL)} if method == "draft" else {}
    return Config(cache_dir=str(tmp_path), ssd_flush="sync", speculative=method,
                  num_speculative_tokens=3, speculative_time_policy=False, **extra)


def _files(directory, tokens=None) -> list:
    """Snapshot files in `directory` (those whose token ids start with `tokens`)."""
    return sorted(p for p in directory.glob("*.tqsnap")
                  if tokens is None or decode_header(p.read_bytes()).token_ids[:len(tokens)]
                  == tuple(tokens))


def _rewrite(path, edit) -> None:
    """Re-encode a snapshot file after `edit(planes)` changed its planes (name -> [bytes,
    shape, dtype]): a well-formed file, checksums valid, under its own name."""
    header, planes = read_snapshot(path)
    arrays = {name: [p.data, p.shape, p.dtype] for name, p in planes.items()}
    edit(arrays)
    fields = {name: getattr(header, name) for name in (
        "cache_kind", "k_bits", "v_bits", "head_dim", "rotation_id", "model_fingerprint",
        "namespace", "token_ids", "offset", "minimum_reusable_offset", "created_ns", "extra")}
    path.write_bytes(encode_snapshot(**fields, planes=[(name, *plane)
                                                       for name, plane in arrays.items()]))


def _drop_paired(planes) -> None:
    for name in [n for n in planes if not n[0].isdigit()]:
        del planes[name]


@pytest.mark.parametrize("method", ["draft", "mtp"])
async def test_paired_state_from_ram_and_ssd_speculates_like_the_cold_row(big_model, tmp_path,
                                                                        method):
    """Cold, RAM hit, and SSD hit after a restart of a greedy and a seeded request: the same
    tokens and the same (proposed, accepted, verify steps); every file holds the state."""
    config = _config(tmp_path, method)
    first = await serve_prompts(config, big_model, SEEDS, repeats=2, max_tokens=MAX_TOKENS)
    restarted = await serve_prompts(config, big_model, SEEDS, max_tokens=MAX_TOKENS)
    for (want, cold_done), (ram, ram_done), (ssd, ssd_done) in zip(first, first[2:], restarted):
        assert cold_done.cached_tokens == 0 and cold_done.speculative[0] > 0
        assert ram_done.cached_tier == "ram" and ram_done.cached_tokens > 0
        assert ssd_done.cached_tokens_by_tier == {"ram": 0, "ssd": ram_done.cached_tokens}
        assert ram == ssd == want
        assert ram_done.speculative == ssd_done.speculative == cold_done.speculative
    for path in _files(tmp_path):
        header = decode_header(path.read_bytes())
        assert str(header.extra["paired"]).startswith(f"{method}:")
        assert any(p.name.startswith(f"{method}.") for p in header.planes)


async def test_a_continuation_reuses_the_finished_rows_mtp_state(big_model, tmp_path):
    """A finished MTP row's snapshot (head KV over its true pairs plus the hidden states not
    yet fed) serves a continuation of it after a restart; its repeat (a RAM hit of the
    continuation's own prompt snapshot) proposes the same, and both answer as cold."""
    config = _config(tmp_path, "mtp")
    a = tuple(big_model.tokenizer.encode(PROMPTS[0]))
    async with open_engine(config, loaded=big_model) as engine:
        out_a, _ = await run(engine, a, MAX_TOKENS)
        await settle(engine)  # the finished row's snapshot is taken at the next step
    finished = max(decode_header(p.read_bytes()).offset for p in _files(tmp_path))
    b = a + tuple(out_a) + tuple(big_model.tokenizer.encode("\n\ndef sub(a, b):\n"))
    async with open_engine(config, loaded=big_model) as engine:
        first, ssd_done = await run(engine, b, MAX_TOKENS)
        again, ram_done = await run(engine, b, MAX_TOKENS)
    assert finished > len(a)
    assert ssd_done.cached_tokens_by_tier == {"ram": 0, "ssd": finished}
    assert ram_done.cached_tokens_by_tier == {"ram": len(b) - 1, "ssd": 0}
    assert first == again == await cold(big_model, b, MAX_TOKENS)
    assert ssd_done.speculative == ram_done.speculative and ssd_done.speculative[0] > 0


async def test_damaged_mtp_planes_are_quarantined_and_the_requests_run_cold(big_model,
                                                                           tmp_path):
    """PROMPTS[0]'s files: one without its paired planes, one whose hidden plane does not
    fit the head (valid checksums): both quarantined at the restart. PROMPTS[1]'s prompt
    file: a byte of its hidden plane flipped: quarantined when loaded. Both requests run
    cold: the cold tokens and the cold proposals (never a half-restored row)."""
    config = _config(tmp_path, "mtp")
    want = await serve_prompts(config, big_model, SEEDS, max_tokens=MAX_TOKENS)
    greedy, seeded = (tuple(big_model.tokenizer.encode(p)) for p in PROMPTS)
    prompt_file, finished_file = sorted(_files(tmp_path, greedy[:-1]),
                                        key=lambda p: decode_header(p.read_bytes()).offset)
    _rewrite(prompt_file, _drop_paired)

    def halve_hidden(planes):
        data, shape, dtype = planes["mtp.hidden"]
        planes["mtp.hidden"] = [data[:len(data) // 2], (*shape[:2], shape[2] // 2), dtype]

    _rewrite(finished_file, halve_hidden)
    (target,) = [p for p in _files(tmp_path, seeded[:-1])
                 if decode_header(p.read_bytes()).offset == len(seeded) - 1]
    data = target.read_bytes()
    header = decode_header(data)
    start = _header_end(data) + sum(s.compressed_len for s in header.planes[:-1])
    assert header.planes[-1].name == "mtp.hidden"
    target.write_bytes(_flip(data, start + header.planes[-1].compressed_len // 2, 0x10))
    got = await serve_prompts(config, big_model, SEEDS, max_tokens=MAX_TOKENS)
    for (tokens, done), (cold_tokens, cold_done) in zip(got, want):
        assert done.cached_tokens == 0
        assert tokens == cold_tokens and done.speculative == cold_done.speculative
    quarantined = sorted(p.name for p in (tmp_path / "quarantine").iterdir()
                         if p.suffix == ".tqsnap")
    assert quarantined == sorted(p.name for p in (prompt_file, finished_file, target))


async def test_a_restored_draft_proposes_from_its_files_state(big_model, tmp_path):
    """The SSD hit's draft KV is the file's own: the same file with its draft planes
    replaced by noise (valid checksums) gives the same tokens but other proposals; a file
    without its draft planes is quarantined and its request runs cold."""
    config = _config(tmp_path, "draft")
    want = await serve_prompts(config, big_model, SEEDS, max_tokens=MAX_TOKENS)
    greedy, seeded = (tuple(big_model.tokenizer.encode(p)) for p in PROMPTS)
    rng = np.random.default_rng(0)

    def noise(planes):
        for name, (_, shape, dtype) in planes.items():
            if name.startswith("draft."):
                planes[name][0] = (rng.standard_normal(shape) * 8).astype(dtype).tobytes()

    for path in _files(tmp_path, greedy[:-1]):
        _rewrite(path, noise)
    dropped = _files(tmp_path, seeded[:-1])
    for path in dropped:
        _rewrite(path, _drop_paired)
    (noised, noised_done), (cold_seeded, cold_done) = await serve_prompts(
        config, big_model, SEEDS, max_tokens=MAX_TOKENS)
    assert noised_done.cached_tier == "ssd" and noised == want[0][0]
    assert noised_done.speculative != want[0][1].speculative
    assert cold_done.cached_tokens == 0 and cold_seeded == want[1][0]
    assert cold_done.speculative == want[1][1].speculative
    assert sorted(p.name for p in (tmp_path / "quarantine").glob("*.tqsnap")) == sorted(
        p.name for p in dropped)


async def test_state_free_and_paired_requests_never_share_snapshots(draft_model, tmp_path):
    """The rule (engine.namespaces): a request with speculative false never reuses a draft
    row's paired snapshot, a lookup request reuses its state-free one, and a draft row reuses
    only paired ones, in RAM and after a restart."""
    config = _config(tmp_path, "draft")
    prompt = PROMPTS[0]
    out = {name: {"tokens": []} for name in ("draft", "plain", "lookup", "draft_hit",
                                             "plain_ssd", "draft_ssd")}
    lookup = {"method": "lookup", "num_tokens": 3}
    async with open_engine(config, loaded=draft_model) as engine:
        await _run(engine, prompt, MAX_TOKENS, out["draft"])
        await _run(engine, prompt, MAX_TOKENS, out["plain"], speculative=False)
        await _run(engine, prompt, MAX_TOKENS, out["lookup"], speculative=lookup)
        await _run(engine, prompt, MAX_TOKENS, out["draft_hit"])
    async with open_engine(config, loaded=draft_model) as engine:
        await _run(engine, prompt, MAX_TOKENS, out["plain_ssd"], speculative=False)
        await _run(engine, prompt, MAX_TOKENS, out["draft_ssd"])
    reused = {name: (o["done"].cached_tier, o["done"].cached_tokens) for name, o in out.items()}
    n = reused["lookup"][1]
    assert n > 0 and reused == {"draft": (None, 0), "plain": (None, 0), "lookup": ("ram", n),
                                "draft_hit": ("ram", n), "plain_ssd": ("ssd", n),
                                "draft_ssd": ("ssd", n)}
    assert all(o["tokens"] == out["draft"]["tokens"] for o in out.values())
    assert out["draft_hit"]["done"].speculative == out["draft"]["done"].speculative
    assert out["draft_ssd"]["done"].speculative == out["draft"]["done"].speculative
    assert out["plain"]["done"].speculative is None
    paired = [decode_header(p.read_bytes()).extra.get("paired") for p in _files(tmp_path)]
    assert None in paired and any(str(p).startswith("draft:") for p in paired if p)
