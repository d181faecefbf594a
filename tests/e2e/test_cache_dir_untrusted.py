"""Hostile cache-dir files against a real engine: it starts, serves correct answers, and
quarantines what it cannot use.

Files are written by a real engine (bundled draft model, RAM budget 1: every snapshot
spills, sync flush), then forged with recomputed checksums (a keys plane reshaped to
(1, 2, T, 64), float32 planes declared int32, a 2**40-byte plane), extended to sparse
30 GiB files, replaced by links, FIFOs and directories, or deleted under a running engine.
Answers are compared with a cold engine's, token for token.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import msgpack
import trio
import zstandard

from tqserve.actors.engine import open_engine
from tqserve.engine.config import Config
from tqserve.storage import read_snapshot
from tqserve.storage.snapshot import CHECKSUM_BYTES, MAGIC, decode_header, encode_snapshot
from tqserve.storage.tier import QUARANTINE_DIR
from tqserve.storage.writer import snapshot_key
from tests.e2e.test_prefix_cache import assert_same, build_prompts, cold, run_all
from tests.e2e.test_readme_and_cli import run

NUM = 8


async def wait_for(predicate, what: str) -> None:
    """Poll a state on the event loop, a bounded number of times."""
    for _ in range(2000):
        if predicate():
            return
        await trio.sleep(0.005)
    raise AssertionError(f"timed out waiting for {what}")


async def written(loaded, directory: Path, requests) -> dict[tuple[int, ...], Path]:
    """Serve `requests` (write-through, sync); map each prompt to a file of its own: the
    snapshot of the finished row, published at its release (the engine runs a step for it)."""
    config = Config(max_batch=8, ram_cache_bytes=1, cache_dir=str(directory), ssd_flush="sync")

    def files() -> dict[tuple[int, ...], Path]:
        out = {}
        for path in directory.glob("*.tqsnap"):
            try:
                data = path.read_bytes()
            except FileNotFoundError:  # a prompt snapshot superseded (and removed) by its
                continue               # row's release snapshot between the glob and here
            tokens = decode_header(data).token_ids
            for prompt, _ in requests:
                if len(tokens) > len(prompt) and tokens[:len(prompt)] == prompt:
                    out[prompt] = path
        return out

    async with open_engine(config, loaded=loaded) as engine:
        await run_all(engine, requests, 1)
        await wait_for(lambda: len(files()) == len(requests), "a file for every prompt")
    found = files()
    assert len(found) == len(requests)
    # A close can land between a release snapshot's write and the removal of the prompt
    # snapshot it supersedes (harmless: a restart supersedes it again). The tests here
    # count files, so only the release snapshots stay.
    for path in set(directory.glob("*.tqsnap")) - set(found.values()):
        path.unlink()
    return found


def rewrite(path: Path, change) -> None:
    """Re-encode a real snapshot with `change(planes)` applied: valid checksums throughout."""
    header, planes = read_snapshot(path)
    raw = [(name, plane.data, plane.shape, plane.dtype) for name, plane in planes.items()]
    path.write_bytes(encode_snapshot(
        cache_kind=header.cache_kind, k_bits=header.k_bits, v_bits=header.v_bits,
        head_dim=header.head_dim, rotation_id=header.rotation_id,
        model_fingerprint=header.model_fingerprint, namespace=header.namespace,
        token_ids=header.token_ids, offset=header.offset,
        minimum_reusable_offset=header.minimum_reusable_offset, created_ns=header.created_ns,
        extra=header.extra, planes=change(raw)))


def reshaped_keys(planes):
    """Layer 0's keys (1, 1, T, 128) as (1, 2, T, 64): the same bytes, a wrong shape."""
    return [(n, d, (1, 2, s[2], 64) if n == "0.keys" else s, t) for n, d, s, t in planes]


def as_int32(planes):
    return [(n, d, s, "int32" if t == "float32" else t) for n, d, s, t in planes]


def huge_plane(path: Path) -> None:
    """Layer 0's keys declared as 2**40 bytes, from a frame that does not state its size."""
    data = path.read_bytes()
    length = int.from_bytes(data[8:12], "little")
    header = msgpack.unpackb(data[12:12 + length], raw=False)
    position = 12 + length + CHECKSUM_BYTES
    blob = zstandard.ZstdCompressor(write_content_size=False).compress(b"\0" * 65536)
    blobs = []
    for plane in header["planes"]:
        own = data[position:position + plane["compressed_len"]]
        position += plane["compressed_len"]
        if plane["name"] == "0.keys":
            own = blob
            plane.update(shape=[1, 1, 1 << 31, 128], raw_len=1 << 40)
        plane.update(compressed_len=len(own), checksum=hashlib.blake2b(
            own, digest_size=CHECKSUM_BYTES).digest())
        blobs.append(own)
    packed = msgpack.packb(header, use_bin_type=True)
    path.write_bytes(b"".join([MAGIC, len(packed).to_bytes(4, "little"), packed,
                               hashlib.blake2b(packed, digest_size=CHECKSUM_BYTES).digest(),
                               *blobs]))


async def test_restart_over_hostile_files_starts_and_serves_cold_answers(draft_model, tmp_path):
    requests = build_prompts(draft_model.tokenizer)[:NUM]
    want = await cold(draft_model, requests)
    directory = tmp_path / "cache"
    files = list((await written(draft_model, directory, requests)).values())
    outside = tmp_path / "outside"
    outside.mkdir()
    rewrite(files[0], reshaped_keys)
    rewrite(files[1], as_int32)
    huge_plane(files[2])
    subprocess.run(["truncate", "-s", "30G", str(files[3])], check=True)
    sparse = directory / f"{snapshot_key('x', (1, 2, 3))}.tqsnap"
    subprocess.run(["truncate", "-s", "30G", str(sparse)], check=True)
    target = outside / files[4].name
    shutil.move(files[4], target)
    os.symlink(target, files[4])
    fifo = directory / f"{snapshot_key('x', (4,))}.tqsnap"
    os.mkfifo(fifo)
    (directory / f"{snapshot_key('x', (5,))}.tqsnap").mkdir()

    config = Config(max_batch=8, ram_cache_bytes=1, cache_dir=str(directory))
    async with open_engine(config, loaded=draft_model) as engine:
        at_start = engine.statistics().prefix_cache
        got = await run_all(engine, requests, 1)
        stats = engine.statistics().prefix_cache
    assert_same(got, want)
    assert at_start.quarantined == 8 and at_start.ssd_entries == NUM - 5, at_start
    assert stats.quarantined == 8, stats
    quarantined = {p.name for p in (directory / QUARANTINE_DIR).iterdir()}
    assert quarantined == {*(f.name for f in files[:5]), sparse.name, fifo.name,
                           f"{snapshot_key('x', (5,))}.tqsnap"}
    assert target.is_file()  # the link moved, its target outside untouched
    assert stats.hits_ssd >= 1, stats  # files[5] was usable


async def test_forged_file_at_load_runs_cold_and_spares_its_batch_mate(draft_model, tmp_path):
    """Files forged after the engine indexed them: the load re-reads and re-checks the
    header and every plane; the hit runs cold, an unrelated request in the same batch is
    unaffected, and the file is quarantined. A vanished file leaves the index too."""
    requests = build_prompts(draft_model.tokenizer)[:NUM]
    want = await cold(draft_model, requests)
    directory = tmp_path / "cache"
    files = await written(draft_model, directory, requests[:4] + requests[6:])
    # write-back: new snapshots stay in RAM, so the tier holds only the files written above
    config = Config(max_batch=8, cache_dir=str(directory), ssd_write="back")
    async with open_engine(config, loaded=draft_model) as engine:
        assert engine.statistics().prefix_cache.ssd_entries == 6
        prompts = [prompt for prompt, _ in requests]
        rewrite(files[prompts[0]], reshaped_keys)
        rewrite(files[prompts[1]], as_int32)
        damaged = bytearray(files[prompts[2]].read_bytes())
        damaged[-3] ^= 0x10
        files[prompts[2]].write_bytes(bytes(damaged))
        # Each forged hit runs in one batch with an unrelated request (requests 4 and 5).
        pairs = [requests[0], requests[4], requests[1], requests[5], requests[2], requests[4]]
        got = await run_all(engine, pairs, 2)
        stats = engine.statistics().prefix_cache
        assert stats.quarantined == 3, stats
        assert stats.ssd_entries == 3 and stats.tier_entries == 3
        # The cache dir deleted while serving: the hit runs cold, and no entry stays (not
        # only the one looked up).
        shutil.rmtree(directory)
        again = await run_all(engine, [requests[3]], 1)
        stats = engine.statistics().prefix_cache
        assert stats.ssd_entries == 0 and stats.tier_entries == 0
    assert_same(got, [want[0], want[4], want[1], want[5], want[2], want[4]])
    assert all(done.finish_reason in ("stop", "length") for _, _, done in got)
    assert_same(again, [want[3]])


async def test_recovery_reads_only_headers_of_hundreds_of_files(draft_model, tmp_path):
    """300 real snapshot files: engine start reads their headers only (the tier's own
    count of bytes read), and a hit on one of them still serves the right answer."""
    requests = build_prompts(draft_model.tokenizer)[:1]
    want = await cold(draft_model, requests)
    directory = tmp_path / "cache"
    (path,) = (await written(draft_model, directory, requests)).values()
    header, planes = read_snapshot(path)
    raw = [(name, plane.data, plane.shape, plane.dtype) for name, plane in planes.items()]
    heads = 0
    for n in range(300):  # the same planes under other token ids: other keys
        tokens = (*header.token_ids[:-1], 100 + n)
        data = encode_snapshot(
            cache_kind=header.cache_kind, k_bits=header.k_bits, v_bits=header.v_bits,
            head_dim=header.head_dim, rotation_id=header.rotation_id,
            model_fingerprint=header.model_fingerprint, namespace=header.namespace,
            token_ids=tokens, offset=header.offset,
            minimum_reusable_offset=header.minimum_reusable_offset, created_ns=1,
            extra=header.extra, planes=raw)
        (directory / f"{snapshot_key(header.namespace, tokens)}.tqsnap").write_bytes(data)
    # Every file's header, the written ones included: a close can land between the release
    # snapshot's write and the removal of the prompt snapshot it supersedes (that file is
    # then dropped at recovery, after its header was read).
    for file in directory.glob("*.tqsnap"):
        heads += 12 + int.from_bytes(file.read_bytes()[8:12], "little") + CHECKSUM_BYTES
    total = sum(p.stat().st_size for p in directory.glob("*.tqsnap"))
    config = Config(max_batch=8, ram_cache_bytes=1, cache_dir=str(directory))
    async with open_engine(config, loaded=draft_model) as engine:
        read_at_start = engine.statistics().prefix_cache.bytes_read
        assert engine.statistics().prefix_cache.ssd_entries == 301
        got = await run_all(engine, requests, 1)
        stats = engine.statistics().prefix_cache
    assert read_at_start == heads and heads < total // 10, (read_at_start, heads, total)
    assert_same(got, want)
    assert stats.hits_ssd == 1 and stats.quarantined == 0, stats


def test_cli_refuses_a_shared_cache_dir(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    result = run([sys.executable, "-m", "tqserve.api.cli", "generate", "--prompt", "x",
                  "--cache-dir", str(shared)])
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "world-writable" in lines[0] and "0777" in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def test_cli_starts_over_a_huge_plane_and_a_sparse_30_gib_file(tmp_path):
    """Today's attack: every start raised MemoryError (exit 1) until the files were removed
    by hand. Now both are quarantined and `tqserve generate` runs (exit 0)."""
    from tests.unit.test_cache_dir import forged

    directory = tmp_path / "cache"
    directory.mkdir(mode=0o700)
    blob = zstandard.ZstdCompressor(write_content_size=False).compress(b"\0" * 65536)
    tokens = (7, 7)
    (directory / f"{snapshot_key('ns-test', tokens)}.tqsnap").write_bytes(forged(
        tokens, {"name": "0.keys", "shape": [1 << 38], "dtype": "float32",
                 "raw_len": 1 << 40}, blob))
    sparse = directory / f"{snapshot_key('x', (1,))}.tqsnap"
    subprocess.run(["truncate", "-s", "30G", str(sparse)], check=True)
    result = run([sys.executable, "-m", "tqserve.api.cli", "generate", "--prompt", "def f(x):",
                  "--max-tokens", "4", "--cache-dir", str(directory)])
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("def f(x):")
    assert len(list((directory / QUARANTINE_DIR).iterdir())) == 2


async def test_a_file_that_fails_to_restore_is_quarantined(draft_model, tmp_path):
    """A load failure of any kind quarantines the file and the request runs cold: here a
    tier without the header validator, so the runner's own restore (a TurboQuant runner,
    for a plain-cache file) is what refuses it. Real files, real Runner, real PrefixCache."""
    from tqserve.actors.board import Board
    from tqserve.actors.mailbox import open_mailbox
    from tqserve.actors.prefix_cache import LOADING, PrefixCache, PrefixCacheStatistics
    from tqserve.actors.spill import SPILL_MAILBOX, Spill, reply_mailbox_size, run_spill
    from tqserve.engine.kv.factory import cache_factory_for
    from tqserve.engine.runner import Runner
    from tqserve.storage import SsdTier

    requests = build_prompts(draft_model.tokenizer)[:1]
    directory = tmp_path / "cache"
    (path,) = (await written(draft_model, directory, requests)).values()
    header = decode_header(path.read_bytes())
    runner = Runner(draft_model.model, cache_factory_for(draft_model.model, "k4v4"))

    async def restore(*args):
        return runner.restore(*args)

    spill = Spill(SsdTier(directory, 1 << 30))
    spill_out, spill_in = open_mailbox(SPILL_MAILBOX, "spill")
    answers_out, answers_in = open_mailbox(reply_mailbox_size(1), "spill_replies")
    prefix = PrefixCache(namespace=header.namespace, fingerprint=header.model_fingerprint,
                         ram_budget=1 << 30, flush="sync", spill=spill_out, replies=answers_in)
    await spill.remove(prefix.recovered(await spill.recover(header.namespace,
                                                            {header.namespace})))
    assert prefix.statistics().ssd_entries == 1
    board = Board()
    async with trio.open_nursery() as actors:  # the spill actor, as open_engine runs it
        await actors.start(run_spill, spill, spill_in, answers_out, board, restore)
        assert prefix.lookup("r1", requests[0][0]) == LOADING  # an SSD hit: load it
        await prefix.start_loads()
        await prefix.wait_reply()
        assert prefix.take_ready() == [("r1", None)]  # the load failed: r1 runs cold
        spill_out.close()
    stats = PrefixCacheStatistics.of(prefix.statistics(), board.snapshot.spill)
    assert (stats.quarantined, stats.ssd_entries) == (1, 0), stats
    assert (directory / QUARANTINE_DIR / path.name).is_file() and not path.exists()
