"""Corrupt snapshot files are quarantined at restart and served as misses, correctly.

Covered: bit flips in every header byte (and every bit of the magic, length and header
checksum), random payload bytes, truncation at many lengths, trailing bytes, swapped files
and non-key names, each against SsdTier.recover() on real files written by the engine, plus
end-to-end restarts over a mix of them. A changed model fingerprint (another dtype or
another model) quarantines every file; a changed KV scheme (same model) keeps the files,
which never match (another namespace). In every case the answers equal the cold answers.
"""

from __future__ import annotations

import contextlib
import random
import struct
from pathlib import Path

import pytest

from tqserve.actors.engine import open_engine
from tqserve.engine.config import Config
from tqserve.engine.model import DEFAULT_MODEL, load_model
from tqserve.storage import SnapshotError, SsdTier
from tqserve.storage.snapshot import CHECKSUM_BYTES, MAGIC
from tests.e2e.test_prefix_cache import assert_same, build_prompts, cold, run_all, settle


async def test_corrupt_files_quarantined_answers_unchanged(draft_model, tmp_path):
    requests = build_prompts(draft_model.tokenizer)[:10]
    want = await cold(draft_model, requests)
    config = Config(max_batch=8, ram_cache_bytes=1, cache_dir=str(tmp_path))
    async with open_engine(config, loaded=draft_model) as engine:
        await run_all(engine, requests, 1)
        await settle(engine)
    files = sorted(tmp_path.glob("*.tqsnap"))
    assert len(files) >= 5
    header = bytearray(files[0].read_bytes())
    header[20] ^= 0x01
    files[0].write_bytes(bytes(header))
    payload = bytearray(files[1].read_bytes())
    payload[-5] ^= 0x80
    files[1].write_bytes(bytes(payload))
    files[2].write_bytes(files[2].read_bytes()[:-17])
    a, b = files[3].read_bytes(), files[4].read_bytes()
    files[3].write_bytes(b)
    files[4].write_bytes(a)
    async with open_engine(config, loaded=draft_model) as engine:
        again = await run_all(engine, requests, 1)
        stats = engine.statistics().prefix_cache
    assert_same(again, want)
    assert stats.quarantined == 5, stats
    assert len(list((tmp_path / "quarantine").iterdir())) == 5
    assert not list(tmp_path.glob(".tmp-*"))


# --- every header byte, random payload bytes, truncations, swaps: against SsdTier.recover() on
# --- real snapshot files written by the engine (one end-to-end restart per file is too slow)

def _header_end(data: bytes) -> int:
    """Bytes before the first plane: magic, u32 length, msgpack header, its checksum."""
    (length,) = struct.unpack_from("<I", data, len(MAGIC))
    return len(MAGIC) + 4 + length + CHECKSUM_BYTES


async def _written(loaded, directory: Path, count: int) -> list[Path]:
    """Snapshot files written by a real engine (RAM budget 1: every row spills, sync)."""
    config = Config(max_batch=8, ram_cache_bytes=1, cache_dir=str(directory))
    async with open_engine(config, loaded=loaded) as engine:
        await run_all(engine, build_prompts(loaded.tokenizer)[:count], 1)
        await settle(engine)
    return sorted(directory.glob("*.tqsnap"))


class _Probe:
    """One directory; `recover(name, blob)` stores one file there, recovers a fresh tier
    (headers only) and loads what it indexed (plane checksums): what either refuses is
    quarantined."""

    def __init__(self, directory: Path, fingerprint: str) -> None:
        self.directory = directory
        self.fingerprint = fingerprint
        directory.mkdir(mode=0o700)  # private, whatever the umask

    def recover(self, name: str, blob: bytes) -> tuple[int, int, tuple]:
        (self.directory / name).write_bytes(blob)
        tier = SsdTier(self.directory, 1 << 30, expected_fingerprints=[self.fingerprint])
        report = tier.recover()
        reasons = list(report.quarantined)
        for entry in tier.entries():
            try:
                tier.get(entry.key)
            except SnapshotError as exc:
                reasons.append((entry.path.name, exc.reason))
        for path in self.directory.rglob("*"):
            if path.is_file():
                path.unlink()
        return len(tier.entries()), len(reasons), tuple(reasons)


async def test_every_corruption_is_quarantined_by_recovery(draft_model, tmp_path):
    files = await _written(draft_model, tmp_path / "written", 6)
    assert len(files) >= 4
    probe = _Probe(tmp_path / "probe", draft_model.fingerprint)
    rng = random.Random(7)
    for path in files:  # the controls: untouched files load
        assert probe.recover(path.name, path.read_bytes())[:2] == (1, 0)
    data, name = files[0].read_bytes(), files[0].name
    header_end = _header_end(data)
    assert header_end > 200 and len(data) > header_end + 100

    # A bit flip in every byte of the header (magic, length, msgpack, checksum).
    for i in range(header_end):
        blob = bytearray(data)
        blob[i] ^= 1 << (i % 8)
        loaded, quarantined, why = probe.recover(name, bytes(blob))
        assert (loaded, quarantined) == (0, 1), (i, why)
    # And every bit of the magic, the length and the header checksum.
    for i in [*range(len(MAGIC) + 4), *range(header_end - CHECKSUM_BYTES, header_end)]:
        for bit in range(8):
            blob = bytearray(data)
            blob[i] ^= 1 << bit
            assert probe.recover(name, bytes(blob))[:2] == (0, 1), (i, bit)

    # Random payload bytes (one or several, any nonzero change), in every file.
    for path in files:
        original = path.read_bytes()
        start = _header_end(original)
        for _ in range(40):
            blob = bytearray(original)
            for _ in range(rng.choice((1, 1, 2, 5))):
                blob[rng.randrange(start, len(blob))] ^= rng.randrange(1, 256)
            assert probe.recover(path.name, bytes(blob))[:2] == (0, 1)

    # Truncation at many lengths (every 3rd byte of the header, 64 steps of the payload, the
    # last bytes), and trailing bytes appended.
    step = max(1, (len(data) - header_end) // 64)
    lengths = {*range(0, header_end + 1, 3), *range(header_end, len(data), step),
               *range(len(data) - 8, len(data))}
    for length in sorted(lengths):
        assert probe.recover(name, data[:length])[:2] == (0, 1), length
    for tail in (b"\0", b"\0" * 100, data[-50:]):
        assert probe.recover(name, data + tail)[:2] == (0, 1)

    # Swapped files: every file under every other file's name; a valid file under a non-key name.
    for a in files:
        for b in files:
            if a != b:
                loaded, quarantined, why = probe.recover(a.name, b.read_bytes())
                assert (loaded, quarantined) == (0, 1) and "name" in why[0][1], why
    assert probe.recover("not-a-key.tqsnap", data)[:2] == (0, 1)


async def test_more_corruptions_end_to_end(draft_model, tmp_path):
    """A restart over a directory holding every kind of bad file: answers equal the cold run."""
    requests = build_prompts(draft_model.tokenizer)[:12]
    want = await _cold_answers(draft_model, requests)
    files = await _written(draft_model, tmp_path, 12)
    assert len(files) >= 8
    rng = random.Random(11)
    cases = {
        "magic": lambda d: _flip(d, 0, 0x80),
        "header length": lambda d: _flip(d, len(MAGIC) + 1, 0x01),
        "header checksum": lambda d: _flip(d, _header_end(d) - 1, 0x10),
        "msgpack body": lambda d: _flip(d, _header_end(d) // 2, 0x04),
        "empty": lambda d: b"",
        "truncated at the first plane": lambda d: d[:_header_end(d)],
        "trailing bytes": lambda d: d + b"\x00" * 7,
        "random payload bytes": lambda d: _flip(d, rng.randrange(_header_end(d), len(d)), 0xFF),
    }
    for path, corrupt in zip(files, cases.values()):
        path.write_bytes(corrupt(path.read_bytes()))
    config = Config(max_batch=8, ram_cache_bytes=1, cache_dir=str(tmp_path))
    async with open_engine(config, loaded=draft_model) as engine:
        again = await run_all(engine, requests, 1)
    # Start-up checks headers only; plane checksums are checked when a file is loaded.
    # A corrupt file that no request loaded (a longer donor won) is still indexed: load
    # every remaining entry as a hit would (the same checks, a tier on the same
    # directory, after the engine), and each bad one is quarantined.
    tier = SsdTier(tmp_path, config.ssd_cache_bytes,
                   expected_fingerprints=[draft_model.fingerprint])
    tier.recover()
    for entry in tier.entries():
        with contextlib.suppress(SnapshotError):
            tier.get(entry.key)
    assert_same(again, want)
    assert len(list((tmp_path / "quarantine").iterdir())) == len(cases)
    assert not list(tmp_path.glob(".tmp-*"))


def _flip(data: bytes, index: int, mask: int) -> bytes:
    blob = bytearray(data)
    blob[index] ^= mask
    return bytes(blob)


# --- a changed model fingerprint or KV scheme, end to end

async def _cold_answers(loaded, requests, **kv):
    async with open_engine(Config(prefix_cache=False, max_batch=8, **kv), loaded=loaded) as engine:
        return await run_all(engine, requests, 1)


async def _serve_over(loaded, directory: Path, requests, **kv):
    """Serve over a foreign directory with the default RAM budget: this run's own snapshots
    stay in RAM, so any SSD hit would have come from a foreign file."""
    config = Config(max_batch=8, cache_dir=str(directory), **kv)
    async with open_engine(config, loaded=loaded) as engine:
        answers = await run_all(engine, requests, 1)
        return answers, engine.statistics().prefix_cache


@pytest.mark.parametrize("other", ["float16", "pycoder-29m"])
async def test_other_model_or_dtype_quarantines_every_file(draft_model, tmp_path, request,
                                                          other):
    """Files of the draft model in float32, served by the draft model in float16 or by
    pycoder-29m: a different fingerprint, so recovery quarantines every file (reason
    "fingerprint mismatch"), nothing is reused, and the answers are the cold answers."""
    requests = build_prompts(draft_model.tokenizer)[:10]
    files = await _written(draft_model, tmp_path, 10)
    assert files
    loaded = (load_model(DEFAULT_MODEL, "float16") if other == "float16"
              else request.getfixturevalue("big_model"))
    assert loaded.fingerprint != draft_model.fingerprint
    want = await _cold_answers(loaded, requests)
    got, stats = await _serve_over(loaded, tmp_path, requests)
    assert_same(got, want)
    assert stats.quarantined == len(files) and stats.hits_ssd == 0, stats
    assert sorted(p.name for p in (tmp_path / "quarantine").iterdir()) == \
        sorted(p.name for p in files)
    assert all(done.cached_tokens_by_tier["ssd"] == 0 for _, _, done in got)


async def test_other_kv_scheme_never_matches(draft_model, tmp_path):
    """Plain-cache files served with TurboQuant k4v4: same model fingerprint, another
    namespace. The files verify and stay (nothing quarantined) but never match: no SSD hit,
    and the answers are the cold TurboQuant answers."""
    requests = build_prompts(draft_model.tokenizer)[:10]
    files = await _written(draft_model, tmp_path, 10)
    assert files
    want = await _cold_answers(draft_model, requests, turboquant="k4v4")
    got, stats = await _serve_over(draft_model, tmp_path, requests, turboquant="k4v4")
    assert_same(got, want)
    assert stats.quarantined == 0 and stats.hits_ssd == 0, stats
    assert all(done.cached_tokens_by_tier["ssd"] == 0 for _, _, done in got)
    assert all(path.is_file() for path in files)
