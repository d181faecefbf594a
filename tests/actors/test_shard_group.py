"""Rank 0's books of the other ranks' SSD work (actors.shard_group), against a real rank 1
in one process: the real LeaderRunner, the real `follow` loop with its FollowerShards and
ShardDisk, real shard directories, the bundled model on both "ranks" (unsharded: the
protocol, not the arithmetic). Only the collective is replaced, by `Loopback`, two channel
ends with its semantics (rank 0's send returns once rank 1 waits again, so MLX runs on one
thread at a time; gather exchanges both replies); the collective itself runs over 2 real
ring ranks in tests/unit/test_distributed.py and tests/e2e/test_distributed.py.

Covered here because two real processes cannot be steered into them: a follower's write
that fails, a follower's disk too busy for a read (it reads again), a follower's file that
fails its read or disagrees with rank 0's header at restore, the recovery agreement
removing the files only one rank holds, and the prefix cache's eviction over its SSD budget
removing rank 1's file of the evicted key.
"""

from __future__ import annotations

import functools
import queue
import signal
import threading
import types
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
import pytest
import trio
from mlx_lm.models.cache import make_prompt_cache

from tqserve.actors.board import Board
from tqserve.actors.mailbox import open_mailbox
from tqserve.actors.prefix_cache import PrefixCache
from tqserve.actors.spill import (SPILL_MAILBOX, Evictions, Spill, header_validator,
                                  reply_mailbox_size, run_spill)
from tqserve.actors.runner_thread import RunnerThread
from tqserve.actors.shard_group import ShardGroup, ShardOrders
from tqserve.engine.distributed import LeaderRunner, ShardRestoreError, Watchdog
from tqserve.engine import follower as follower_module
from tqserve.engine.follower import FollowerShards, follow
from tqserve.engine.runner import Runner
from tqserve.engine.snapshot_store import spill_payload
from tqserve.engine.step import SnapshotMade, StepPlan, StepResult
from tqserve.engine.snapshot import snapshot_of_row
from tqserve.storage import SsdTier, snapshot_key
from tqserve.storage.shard import ShardId
from tqserve.storage.shard_disk import ShardDisk

NS = "ns-loopback"
GUARD_S = 120  # a hang guard only
WATCHDOG_S = 600  # the ranks' watchdogs: far beyond GUARD_S (they would end pytest)


class _Group:
    def __init__(self, rank: int) -> None:
        self._rank = rank

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return 2


class Loopback:
    """Rank 0's and rank 1's channel ends (`end(rank)`), see the module doc."""

    def __init__(self) -> None:
        self._ops: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self._turn = threading.Condition()
        self._sent = self._received = self._settled = 0  # ops; rank 1 waits after `settled`
        self._slots = [b"", b""]
        self._barrier = threading.Barrier(2)

    def end(self, rank: int) -> _End:
        return _End(self, rank)

    def send(self, payload: bytes) -> None:
        with self._turn:
            self._sent += 1
            self._ops.put(payload)
            self._turn.wait_for(lambda: self._settled >= self._sent)

    def settle(self) -> None:
        """Rank 1 waits (for an op or in a gather): rank 0 may go on."""
        with self._turn:
            self._settled = self._received
            self._turn.notify_all()

    def receive(self) -> bytes:
        self.settle()
        payload = self._ops.get()
        with self._turn:
            self._received += 1
        return payload

    def finished(self) -> None:
        with self._turn:
            self._settled = 1 << 30
            self._turn.notify_all()

    def gather(self, rank: int, reply: bytes) -> list[bytes]:
        if rank == 1:
            self.settle()
        self._slots[rank] = reply
        self._barrier.wait()
        out = list(self._slots)
        self._barrier.wait()
        return out


class _End:
    def __init__(self, loop: Loopback, rank: int) -> None:
        self.loop, self.rank, self.group = loop, rank, _Group(rank)

    def send(self, payload: bytes) -> None:
        self.loop.send(payload)

    def receive(self) -> bytes:
        return self.loop.receive()

    def gather(self, reply: bytes) -> list[bytes]:
        return self.loop.gather(self.rank, reply)


def payload_of(model: Any, tokens: tuple[int, ...], ram_key: str) -> Any:
    """A real snapshot of the model's KV over `tokens`, serialized as a step would."""
    cache = make_prompt_cache(model)
    model(mx.array([tokens]), cache=cache)
    mx.eval([c.state for c in cache])
    return spill_payload(ram_key, snapshot_of_row(cache))


def common(tokens: tuple[int, ...], fingerprint: str) -> tuple[str, dict[str, Any]]:
    return snapshot_key(NS, tokens), {"model_fingerprint": fingerprint, "namespace": NS,
                                      "token_ids": tokens, "created_ns": 1}


def files(cache: Path, rank: int) -> set[str]:
    return {p.stem for p in ShardId(2, rank).directory(cache).glob("*.tqsnap")}


async def test_rank_0_books_the_other_ranks_disk_work(draft_model: Any, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # `follow` ignores SIGINT for its process; rank 1 is a thread here (no signals there)
    monkeypatch.setattr(follower_module, "signal", types.SimpleNamespace(
        signal=lambda *args: None, SIGINT=signal.SIGINT, SIG_IGN=signal.SIG_IGN))
    model, fingerprint = draft_model.model, draft_model.fingerprint
    tokens = {name: tuple(range(100 + 7 * i, 120 + 7 * i))
              for i, name in enumerate("ABCDEFGHI")}
    payloads = {name: payload_of(model, t, f"p{name}") for name, t in tokens.items()}
    keys = {name: common(t, fingerprint)[0] for name, t in tokens.items()}
    loop = Loopback()
    leader = LeaderRunner(loop.end(0), WATCHDOG_S, model)
    rank1 = Runner(model)

    def open_disk(fp: str, namespace: str, layout: Any) -> ShardDisk:
        tier = SsdTier(ShardId(2, 1).directory(tmp_path), 1 << 30, expected_fingerprints=[fp],
                       validate_header=header_validator(namespace, layout), shard=ShardId(2, 1))
        return ShardDisk(tier, namespace, max_jobs=1)  # one read fills it

    shards = FollowerShards(functools.partial(open_disk, fingerprint))
    codes: list[int] = []

    def run_rank1() -> None:
        try:
            codes.append(follow(rank1, loop.end(1), Watchdog(1, WATCHDOG_S), shards))
        finally:
            loop.finished()

    follower = threading.Thread(target=run_rank1, daemon=True)
    follower.start()
    thread = RunnerThread()
    with trio.fail_after(GUARD_S):
        try:
            await thread.call(leader.join)
            layout = await thread.call(leader.plane_layout)
            tier = SsdTier(ShardId(2, 0).directory(tmp_path), 1 << 30,
                           expected_fingerprints=[fingerprint],
                           validate_header=header_validator(NS, layout), shard=ShardId(2, 0))
            group = ShardGroup(leader, thread, tier, 2)
            orders = ShardOrders(leader, thread)
            await group.start_recovery(NS)
            await trio.to_thread.run_sync(tier.recover)
            assert await group.agree([]) == set()

            async def write(name: str, staged: bool = True, **override: Any) -> str | None:
                """Rank 0 writes its file and orders rank 1's, as the prefix cache does."""
                key, fields = common(tokens[name], fingerprint)
                if staged:  # what the step's execute stages on rank 1 (rank 1 is waiting)
                    shards.stage(StepResult(outputs=(), kv_bytes=0, writes=(payloads[name],)))
                order = orders.order(payloads[name].key, key, {**fields, **override})
                await orders.send()
                payload = payloads[name]
                await trio.to_thread.run_sync(tier.put, key, {**payload.header, **fields},
                                              payload.planes)
                return await group.written(order, key, mine=True, keep=False)

            # acknowledged: both ranks' files durable
            assert await write("A") is None and await write("C") is None
            assert await write("D", minimum_reusable_offset=5) is None  # rank 1's differs
            assert files(tmp_path, 0) == files(tmp_path, 1) == {keys[n] for n in "ACD"}
            # a write rank 1 cannot do: abandoned, no rank keeps a file of it
            problem = await write("B", staged=False)
            assert problem == "rank 1: no snapshot pB staged on this rank", problem
            assert keys["B"] not in files(tmp_path, 0) | files(tmp_path, 1)
            assert group.num_write_errors == 1

            # rank 1's disk is full (a read holds its one slot): "busy", then read again
            await thread.call(leader.shard, "shard_read", 999, keys["C"])
            await group.fetch(keys["A"])  # busy at once: decided when rank 1 takes the order
            await thread.call(leader.shard, "shard_discard", 999)
            mine = await trio.to_thread.run_sync(tier.get, keys["A"])
            assert await group.fetched(keys["A"], mine) is mine
            header, planes = mine
            arrays = {n: (p.data, p.shape, p.dtype) for n, p in planes.items()}
            kinds = str(header.extra["layer_kinds"])
            args = (kinds, header.offset, header.minimum_reusable_offset, arrays)
            assert await group.restore(keys["A"], "sA", *args) > 0
            assert "sA" in leader.snapshots.keys() and "sA" in rank1.snapshots.keys()

            # rank 1's file fails its checksums: a miss, quarantined there, rank 0's removed
            path = ShardId(2, 1).directory(tmp_path) / f"{keys['C']}.tqsnap"
            data = bytearray(path.read_bytes())
            data[-1] ^= 0xFF
            path.write_bytes(bytes(data))
            await group.fetch(keys["C"])
            mine = await trio.to_thread.run_sync(tier.get, keys["C"])
            assert await group.fetched(keys["C"], mine) is None
            assert (path.parent / "quarantine" / path.name).is_file()
            assert keys["C"] not in files(tmp_path, 0) and group.num_quarantined == 1

            # rank 1's header disagrees with rank 0's (boundary 5, not 0): read passes, the
            # restore does not, on any rank; quarantined on rank 1, removed on rank 0
            await group.fetch(keys["D"])
            mine = await trio.to_thread.run_sync(tier.get, keys["D"])
            assert await group.fetched(keys["D"], mine) is mine
            header, planes = mine
            arrays = {n: (p.data, p.shape, p.dtype) for n, p in planes.items()}
            with pytest.raises(ShardRestoreError, match="rank 1: cannot be restored: its layer "
                                                        "kinds, offset and boundary"):
                await group.restore(keys["D"], "sD", str(header.extra["layer_kinds"]),
                                    header.offset, header.minimum_reusable_offset, arrays)
            assert "sD" not in leader.snapshots.keys() and "sD" not in rank1.snapshots.keys()
            assert keys["D"] not in files(tmp_path, 0) and group.num_quarantined == 2

            # a restart's agreement: E only on rank 0, F only on rank 1, A on both
            for rank, name in ((0, "E"), (1, "F")):
                alone = SsdTier(ShardId(2, rank).directory(tmp_path), 1 << 30,
                                shard=ShardId(2, rank))
                alone.recover()
                key, fields = common(tokens[name], fingerprint)
                alone.put(key, {**payloads[name].header, **fields}, payloads[name].planes)
            await group.start_recovery(NS)
            await trio.to_thread.run_sync(tier.recover)
            assert await group.agree([e.key for e in tier.entries()]) == {keys["A"]}
            await group.fetch(keys["A"])  # rank 1's disk works in order: keep ran before
            assert await group.fetched(keys["A"], await trio.to_thread.run_sync(
                tier.get, keys["A"])) is not None
            assert files(tmp_path, 0) == files(tmp_path, 1) == {keys["A"]}
            await group.restore(keys["A"], "sA2", *args)  # (takes rank 1's read planes)

            # the prefix cache's own path (sync flush) over a budget of two files: the
            # third write evicts the oldest on rank 0, and rank 1's file of it goes too
            evictions = Evictions()
            small = SsdTier(ShardId(2, 0).directory(tmp_path), 5 * tier.entries()[0].num_bytes
                            // 2, expected_fingerprints=[fingerprint], shard=ShardId(2, 0),
                            validate_header=header_validator(NS, layout), on_evict=evictions)
            small_group = ShardGroup(leader, thread, small, 2)
            spill = Spill(small, evictions=evictions, group=small_group)
            spill_out, spill_in = open_mailbox(SPILL_MAILBOX, "spill")
            answers_out, answers_in = open_mailbox(reply_mailbox_size(4), "spill_replies")
            prefix = PrefixCache(namespace=NS, fingerprint=fingerprint, ram_budget=1 << 30,
                                 flush="sync", spill=spill_out, replies=answers_in,
                                 orders=orders)
            await spill.remove(prefix.recovered(await spill.recover(NS, {NS})))

            async def no_loads(*args: Any) -> int:
                raise AssertionError("nothing is loaded here")

            async with trio.open_nursery() as actors:  # the spill actor, as open_engine runs it
                await actors.start(run_spill, spill, spill_in, answers_out, Board(), no_loads)
                for i, name in enumerate("GHI"):
                    # the core's prompt snapshot order for a joining row (engine.orders)
                    ram_key = f"p{i}"
                    plan = StepPlan(join=(name,), prompt_snapshot=((name, ram_key),),
                                    persist=True)
                    made = attrs.evolve(payloads[name], key=ram_key)
                    result = StepResult(outputs=(), kv_bytes=0, writes=(made,), snapshots=(
                        SnapshotMade(key=ram_key, request_id=name, offset=len(tokens[name]),
                                     minimum_reusable_offset=0, num_bytes=1),))
                    shards.stage(result)  # (what rank 1's execute of this plan staged)
                    await prefix.absorb(plan, result, lambda rid: (*tokens[rid], 1))
                spill_out.close()  # the actor drains its disk queue and ends
            await prefix.apply_replies()
            # rank 1 removes an evicted key's file after its queued work, unacknowledged;
            # a read of H queued after that removal is the barrier (its disk works in order)
            mine = await trio.to_thread.run_sync(small.get, keys["H"])
            await small_group.fetch(keys["H"])
            assert await small_group.fetched(keys["H"], mine) is mine
            header, planes = mine
            await small_group.restore(keys["H"], "sH", str(header.extra["layer_kinds"]),
                                      header.offset, header.minimum_reusable_offset,
                                      {n: (p.data, p.shape, p.dtype) for n, p in planes.items()})
            assert files(tmp_path, 0) == files(tmp_path, 1) == {keys["H"], keys["I"]}
            assert prefix.statistics().ssd_entries == 2
        finally:
            await thread.call(leader.close)
            await thread.aclose()
            await trio.to_thread.run_sync(follower.join)
    assert codes == [0]
