"""Write-through SSD tier, drain on close, publish at prefill, lookup at schedule time,
SSD loads off the step loop, promotion, write queue overflow and write errors.

Real embedded engines on the bundled draft model (float32, CPU), real files. Prompts are
token ids (the draft model's vocabulary is 8,192) so their lengths are exact.
"""

from __future__ import annotations

import errno
import threading

import attrs
import pytest
import trio
import trio.testing

import tqserve.storage.tier  # noqa: F401  (loads storage.tier)
from tqserve import storage
from tqserve.actors.engine import open_engine
from tqserve.actors.messages import Done, Error, Token
from tqserve.engine.config import Config
from tqserve.engine.request import GenerateRequest
from tqserve.engine.sampling import SamplingParams
from tqserve.storage import SsdTier

GUARD_S = 120  # a hang guard only (never a measurement): a broken engine fails, not hangs


def prompt(seed: int, n: int) -> tuple[int, ...]:
    return tuple((seed * 7919 + i * 131) % 8000 + 100 for i in range(n))


async def run(engine, tokens, max_tokens=4, on_token=None):
    """One greedy request: (generated ids, Done or Error)."""
    out, end = [], None
    request = GenerateRequest(prompt_tokens=tokens,
                              params=SamplingParams(max_tokens=max_tokens, temperature=0.0))
    async for event in engine.generate(request):
        if isinstance(event, Token):
            out.append(event.token_id)
            if on_token is not None:
                on_token(event)
        elif isinstance(event, (Done, Error)):
            end = event
    return out, end


_COLD: dict = {}


async def cold(loaded, tokens, max_tokens=4):
    key = (tokens, max_tokens)
    if key not in _COLD:
        async with open_engine(Config(prefix_cache=False), loaded=loaded) as engine:
            _COLD[key] = (await run(engine, tokens, max_tokens))[0]
    return _COLD[key]


async def test_immediate_repeat_reuses_ram_while_the_write_is_pending(draft_model, tmp_path,
                                                                     monkeypatch):
    """Write-through, async: while the snapshot's file is still being written (the write
    is held), the repeat of a long prompt reuses all but its last token from RAM; after a
    restart the same prompt is an SSD hit."""
    gate = threading.Event()
    real = storage.tier.write_snapshot_file

    def held(*args):
        gate.wait()
        return real(*args)

    monkeypatch.setattr(storage.tier, "write_snapshot_file", held)
    p = prompt(1, 300)
    config = Config(cache_dir=str(tmp_path))
    with trio.fail_after(GUARD_S):
        async with open_engine(config, loaded=draft_model) as engine:
            try:
                first, done1 = await run(engine, p)
                again, done2 = await run(engine, p)
                written = engine.statistics().prefix_cache.spills
            finally:
                gate.set()
        async with open_engine(config, loaded=draft_model) as engine:
            restarted, done3 = await run(engine, p)
    assert written == 0  # nothing was on disk yet during the repeat
    assert done1.cached_tokens == 0
    assert done2.cached_tokens_by_tier == {"ram": 299, "ssd": 0}
    assert done3.cached_tokens_by_tier == {"ram": 0, "ssd": 299}
    assert first == again == restarted == await cold(draft_model, p)


class HeldDisk:
    """The real file writer (storage.tier.write_snapshot_file), held back while `gate` is
    clear: a write queued meanwhile stays pending for as long as the test needs."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.real = storage.tier.write_snapshot_file

    def __call__(self, *args):
        self.gate.wait()
        return self.real(*args)


async def colds(loaded, prompts, max_tokens=4):
    """`cold` of many prompts, from one engine."""
    missing = [p for p in prompts if (p, max_tokens) not in _COLD]
    if missing:
        async with open_engine(Config(prefix_cache=False), loaded=loaded) as engine:
            for p in missing:
                _COLD[(p, max_tokens)] = (await run(engine, p, max_tokens))[0]
    return [_COLD[(p, max_tokens)] for p in prompts]


@pytest.mark.parametrize("write, rounds", [("through", 20), ("back", 5)])
async def test_a_repeat_reuses_an_entry_whose_write_is_pending_below_one_entry_of_ram(
        draft_model, tmp_path, monkeypatch, write, rounds):
    """Issue 19: a RAM budget below one entry and the disk writer held back, so every
    snapshot's write is still pending when the same prompt comes again right after the
    first answer: in 20 rounds (5 with write-back; a fresh engine each, over one cache
    dir) the repeat reuses all but its last token every time (from the pending write's
    bytes, or the RAM copy its spill had not taken yet), greedy tokens identical; once
    the writes land, a restart serves the first round's prompt from the SSD."""
    disk = HeldDisk()
    monkeypatch.setattr(storage.tier, "write_snapshot_file", disk)
    config = Config(cache_dir=str(tmp_path), ram_cache_bytes=1, ssd_write=write)
    prompts = [prompt(60 + n, 120) for n in range(rounds)]
    want = await colds(draft_model, prompts)
    reused, tiers = [], set()
    with trio.fail_after(GUARD_S):
        for p, cold_tokens in zip(prompts, want):
            disk.gate.clear()
            async with open_engine(config, loaded=draft_model) as engine:
                try:
                    first, _ = await run(engine, p)
                    again, done = await run(engine, p)
                    written = engine.statistics().prefix_cache.spills
                finally:
                    disk.gate.set()  # the close drains the writes
            assert written == 0  # nothing of this round was on disk during the repeat
            assert first == again == cold_tokens
            reused.append(sum(done.cached_tokens_by_tier.values()))
            tiers.update(t for t, n in done.cached_tokens_by_tier.items() if n)
        async with open_engine(config, loaded=draft_model) as engine:
            restarted, done = await run(engine, prompts[0])
    assert reused == [len(prompts[0]) - 1] * len(prompts)
    if write == "through":  # every RAM copy went at once: the write's bytes served it
        assert tiers == {"ssd"}
    assert done.cached_tokens_by_tier == {"ram": 0, "ssd": len(prompts[0]) - 1}
    assert restarted == want[0]


async def test_write_back_serves_a_spilled_entry_from_its_pending_write(draft_model, tmp_path,
                                                                       monkeypatch):
    """--ssd-write back, the writer held: once another request's steps have spilled the
    first answer's snapshot (its RAM copy gone, its file not written), the repeat reuses
    it from the pending write's bytes, counted as an SSD hit; the tokens are the cold
    ones."""
    disk = HeldDisk()
    monkeypatch.setattr(storage.tier, "write_snapshot_file", disk)
    p, other = prompt(90, 120), prompt(91, 30)
    config = Config(cache_dir=str(tmp_path), ram_cache_bytes=1, ssd_write="back")
    with trio.fail_after(GUARD_S):
        async with open_engine(config, loaded=draft_model) as engine:
            try:
                first, _ = await run(engine, p)
                await run(engine, other)  # its steps carry the spill of the first answer
                ram = engine.statistics().prefix_cache.ram_entries
                again, done = await run(engine, p)
                stats = engine.statistics().prefix_cache
            finally:
                disk.gate.set()
    assert ram == 0 and stats.spills == 0
    assert done.cached_tokens_by_tier == {"ram": 0, "ssd": len(p) - 1}
    assert first == again == await cold(draft_model, p)


async def test_clean_close_drains_and_a_restart_serves_every_prompt_from_ssd(
        draft_model, tmp_path):
    """N prompts, leave open_engine at once (writes still queued), reopen on the same
    directory: every prompt is an SSD hit of all but its last token, greedy tokens
    identical; a second run of one is a RAM hit (the SSD hit was promoted)."""
    prompts = [prompt(10 + i, 40 + 13 * i) for i in range(6)]
    config = Config(cache_dir=str(tmp_path), ssd_flush="async")
    with trio.fail_after(GUARD_S):
        async with open_engine(config, loaded=draft_model) as engine:
            first = [await run(engine, p) for p in prompts]
        async with open_engine(config, loaded=draft_model) as engine:
            second = [await run(engine, p) for p in prompts]
            promoted = await run(engine, prompts[0])
            stats = engine.statistics().prefix_cache
    for p, (tokens, _), (again, done) in zip(prompts, first, second):
        assert done.cached_tokens_by_tier == {"ram": 0, "ssd": len(p) - 1}
        assert again == tokens == await cold(draft_model, p)
    assert promoted[1].cached_tokens_by_tier == {"ram": len(prompts[0]) - 1, "ssd": 0}
    assert promoted[0] == first[0][0]
    assert stats.hits_ssd == len(prompts) and stats.spills_dropped == 0


async def test_a_decoding_row_publishes_its_prompt_for_a_concurrent_request(draft_model):
    """B shares A's long prompt and arrives while A still decodes: it reuses A's prompt."""
    a = prompt(2, 200)
    b = a[:-1] + prompt(3, 20)
    first_token = trio.Event()
    with trio.fail_after(GUARD_S):
        async with open_engine(Config(max_batch=4), loaded=draft_model) as engine:
            async with trio.open_nursery() as nursery:
                results = {}

                async def run_a():
                    results["a"] = await run(engine, a, 24,
                                             on_token=lambda _: first_token.set())
                nursery.start_soon(run_a)
                await first_token.wait()
                results["b"] = await run(engine, b)
                assert "a" not in results  # A was still decoding when B finished
    assert results["b"][1].cached_tokens_by_tier == {"ram": 199, "ssd": 0}
    assert results["b"][0] == await cold(draft_model, b)


async def test_a_request_queued_behind_its_donor_reuses_it(draft_model):
    """One row: B (A's prompt plus more) waits in the queue while A runs; its lookup
    happens when it takes the row, so it finds A's snapshot."""
    a = prompt(4, 120)
    b = a + prompt(5, 10)
    results = {}
    with trio.fail_after(GUARD_S):
        async with open_engine(Config(max_batch=1), loaded=draft_model) as engine:
            async with trio.open_nursery() as nursery:
                async def one(name, tokens):
                    results[name] = await run(engine, tokens)
                nursery.start_soon(one, "a", a)
                await trio.sleep(0)
                nursery.start_soon(one, "b", b)
    assert results["a"][1].cached_tokens == 0
    assert results["b"][1].cached_tokens >= len(a) - 1
    assert results["b"][0] == await cold(draft_model, b)


class SlowTier(SsdTier):
    """A real SsdTier whose reads wait until the test releases them."""

    reading = threading.Event()
    release = threading.Event()

    def get(self, key):
        SlowTier.reading.set()
        SlowTier.release.wait()
        return super().get(key)


async def test_slow_ssd_read_never_stalls_the_decoding_rows(draft_model, tmp_path,
                                                            monkeypatch):
    """While an SSD hit's file read is blocked, another row keeps producing tokens; the
    loading request then joins and its output equals the cold run."""
    p = prompt(6, 150)
    other = prompt(7, 30)
    config = Config(cache_dir=str(tmp_path), max_batch=4)
    with trio.fail_after(GUARD_S):
        async with open_engine(config, loaded=draft_model) as engine:
            await run(engine, p)
    SlowTier.reading.clear()
    SlowTier.release.clear()
    monkeypatch.setattr("tqserve.actors.engine.SsdTier", SlowTier)
    during = []
    results = {}
    started = trio.Event()
    with trio.fail_after(GUARD_S):
        async with open_engine(config, loaded=draft_model) as engine:
            async with trio.open_nursery() as nursery:
                def on_token(_):
                    started.set()
                    if SlowTier.reading.is_set() and not SlowTier.release.is_set():
                        during.append(1)
                        if len(during) == 5:
                            SlowTier.release.set()

                async def run_other():
                    try:
                        results["other"] = await run(engine, other, 40, on_token=on_token)
                    finally:
                        SlowTier.release.set()  # never leave the read blocked

                async def run_hit():
                    results["hit"] = await run(engine, p)
                nursery.start_soon(run_other)
                await started.wait()
                nursery.start_soon(run_hit)
    assert len(during) == 5  # five tokens of the other row while the read was blocked
    assert results["hit"][1].cached_tokens_by_tier == {"ram": 0, "ssd": 149}
    assert results["hit"][0] == await cold(draft_model, p)
    assert results["other"][0] == await cold(draft_model, other, 40)


async def test_failed_step_gives_internal_error_and_leaves_nothing_behind(draft_model,
                                                                          tmp_path):
    """An exception on one runner step (through Runner.step_hook, on the first step where
    both rows decode): the requests in that
    step get internal_error; afterwards the engine serves correctly, holds 0 rows and 0 KV
    bytes, and every snapshot the runner holds is indexed (no orphans, nothing stuck)."""
    failed = []

    def fail_once_both_decode(plan):
        if len(plan.decode) == 2 and not failed:
            failed.append(plan)
            raise RuntimeError("injected fault")

    a, b = prompt(8, 60), prompt(9, 70)
    config = Config(cache_dir=str(tmp_path), ram_cache_bytes=300_000, max_batch=4)
    with trio.fail_after(GUARD_S):
        async with open_engine(config, loaded=draft_model) as engine:
            await run(engine, prompt(10, 50))  # a snapshot already indexed
            engine.runner.step_hook = fail_once_both_decode
            results = {}
            async with trio.open_nursery() as nursery:
                async def one(name, tokens):
                    results[name] = await run(engine, tokens, 8)
                nursery.start_soon(one, "a", a)
                nursery.start_soon(one, "b", b)
            engine.runner.step_hook = None
            after = [await run(engine, p) for p in (a, b, a)]
            await engine.wait_idle()
            for _ in range(500):  # the last drop orders run on the steps after the Done
                stats = engine.statistics()
                runner = engine.runner.statistics()
                if runner.num_snapshots == stats.prefix_cache.ram_entries:
                    break
                await trio.sleep(0.01)
    for name in ("a", "b"):
        assert isinstance(results[name][1], Error), results[name]
        assert results[name][1].code == "internal_error"
        assert "injected fault" in results[name][1].message
    assert after[0][0] == await cold(draft_model, a)
    assert after[1][0] == await cold(draft_model, b)
    assert after[2][1].cached_tokens_by_tier["ram"] == len(a) - 1
    assert stats.rows_active == 0 and stats.kv_bytes == 0
    assert runner.num_rows == 0 and runner.kv_bytes == 0
    assert stats.prefix_cache.spilling_entries == 0
    assert runner.num_snapshots == stats.prefix_cache.ram_entries


async def test_a_full_write_queue_drops_writes_and_counts_them(draft_model, tmp_path,
                                                               monkeypatch):
    """The disk is stuck: past WRITE_QUEUE queued snapshots, writes drop (counted in
    spills_dropped); requests answer correctly and the RAM tier still serves."""
    gate = threading.Event()
    real = storage.tier.write_snapshot_file

    def stuck(*args):
        gate.wait()
        return real(*args)

    monkeypatch.setattr(storage.tier, "write_snapshot_file", stuck)
    prompts = [prompt(20 + i, 20) for i in range(14)]
    config = Config(cache_dir=str(tmp_path), ssd_flush="async")
    with trio.fail_after(GUARD_S):
        async with open_engine(config, loaded=draft_model) as engine:
            try:
                results = [await run(engine, p, 2) for p in prompts]
                repeat = await run(engine, prompts[0], 2)
                stats = engine.statistics().prefix_cache
            finally:
                gate.set()
    assert stats.spills_dropped > 0, stats
    assert repeat[1].cached_tokens_by_tier["ram"] == len(prompts[0]) - 1
    for p, (tokens, _) in zip(prompts, results):
        assert tokens == await cold(draft_model, p, 2)


@pytest.mark.parametrize("flush", ["sync", "async"])
async def test_write_errors_are_counted_and_requests_still_answer(draft_model, tmp_path,
                                                                  monkeypatch, flush):
    """Every write fails (a full disk): ssd_write_errors rises, nothing is indexed on the
    SSD tier, no file is left, and requests answer as cold ones (RAM hits still work)."""
    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(storage.tier, "write_snapshot_file", full)
    p = prompt(30, 80)
    config = Config(cache_dir=str(tmp_path), ssd_flush=flush)
    with trio.fail_after(GUARD_S):
        async with open_engine(config, loaded=draft_model) as engine:
            first = await run(engine, p)
            again = await run(engine, p)
        stats = engine.statistics().prefix_cache
    assert stats.ssd_write_errors >= 1 and stats.ssd_entries == 0, stats
    assert list(tmp_path.glob("*.tqsnap")) == []
    assert first[0] == again[0] == await cold(draft_model, p)
    assert again[1].cached_tokens_by_tier["ram"] == len(p) - 1


async def test_closing_during_a_step_that_queues_writes(draft_model, tmp_path):
    """The race behind a BrokenResourceError from `_send_spill`: the engine is closed
    while a step that makes a snapshot to write is on the runner thread. The writer task
    used to be cancelled with the actors and close its queue's receive end; the
    scheduler's shielded step then returned and `send_nowait` hit the closed queue. Now
    the writer outlives the actors and drains; closing is clean and nothing stays queued."""
    in_step, release = threading.Event(), threading.Event()

    def hold_the_persisting_step(plan):
        if plan.persist and not release.is_set():
            in_step.set()
            release.wait()

    async def release_once_everything_waits():
        await trio.testing.wait_all_tasks_blocked()
        release.set()

    config = Config(cache_dir=str(tmp_path), ssd_flush="async")
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as outer:
            async with open_engine(config, loaded=draft_model) as engine:
                await run(engine, prompt(40, 30))  # one snapshot written normally
                engine.runner.step_hook = hold_the_persisting_step
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(run, engine, prompt(41, 50))
                    await trio.to_thread.run_sync(in_step.wait, abandon_on_cancel=True)
                    nursery.cancel_scope.cancel()
                outer.start_soon(release_once_everything_waits)
            stats = engine.statistics().prefix_cache
    assert release.is_set()
    assert stats.writes_pending == 0 and stats.spills_dropped == 0 and stats.spills >= 1


@pytest.mark.parametrize("flush", ["sync", "async"])
async def test_write_back_writes_only_what_ram_evicts(draft_model, tmp_path, flush):
    """--ssd-write back: a snapshot reaches the disk only when the RAM budget evicts it;
    after a restart those prompts are SSD hits with the same greedy tokens."""
    prompts = [prompt(50 + i, 60) for i in range(4)]
    config = Config(cache_dir=str(tmp_path), ssd_write="back", ssd_flush=flush,
                    ram_cache_bytes=1)
    roomy = attrs.evolve(config, cache_dir=str(tmp_path / "roomy"), ram_cache_bytes=1 << 30)
    with trio.fail_after(GUARD_S):
        async with open_engine(roomy, loaded=draft_model) as engine:
            for p in prompts:
                await run(engine, p)
            kept = engine.statistics().prefix_cache
        async with open_engine(config, loaded=draft_model) as engine:
            first = [await run(engine, p) for p in prompts]
            await run(engine, prompt(99, 5))  # the steps after the last release spill it
        async with open_engine(config, loaded=draft_model) as engine:
            second = [await run(engine, p) for p in prompts]
    assert kept.spills == 0 and kept.ssd_entries == 0 and kept.ram_entries > 0
    for p, (tokens, _), (again, done) in zip(prompts, first, second):
        assert done.cached_tokens_by_tier["ssd"] == len(p) - 1
        assert again == tokens == await cold(draft_model, p)
