"""Tensor parallelism over mx.distributed: one runner per rank, rank 0's plans broadcast.

`tqserve serve --distributed`, started under `mlx.launch` (ring over TCP, MPI, NCCL on
CUDA, JACCL), runs one process per rank:

* every rank loads the model and shards it with mlx-lm's `model.shard(group)` (Qwen3,
  Llama...): attention heads, KV heads and the MLP columns split across ranks, an
  `all_sum` after o_proj and down_proj. The embedding and the head are not split, so
  every rank ends each forward with the same full logits;
* rank 0 runs the actors and the API as in a single process, with a `LeaderRunner`: before
  each runner operation that changes state (a step's plan, a reset, a retain, an SSD-tier
  order, the final close) it broadcasts the operation and its arguments to the other
  ranks (engine.plan_channel), then runs it;
* every other rank runs `engine.follower.follow`: receive an operation, run it on its own
  `Runner`, repeat, until rank 0 broadcasts STOP (exit 0). They never start trio or the API.

Every rank samples the same token: sampling is seeded per row and reads the same logits,
so only rank 0 reports. Each step's plan also carries the tokens rank 0 sampled in the
step before, and every rank checks its own against them: a divergence (which would leave a
rank's KV built on other tokens) ends the group instead of corrupting it silently.
Cancels, joins, retirements and prefix-cache orders ride in the plan, so each rank's KV
cache holds its own KV heads of the same rows, and each rank keeps its own shard of every
prefix snapshot under the same key (made, reused and dropped by the same plans: restored
together or not at all). TurboQuant and affine caches work unchanged on the local heads
(they quantize per KV head). Not yet: speculation (the draft / MTP head is not sharded);
`engine.config.Config` refuses it with --distributed.

SSD tier (`--cache-dir`): every rank writes its own shard of each persisted snapshot to its
own directory (storage.shard: `tp<size>-rank<rank>/`, the shard named in every header).
Rank 0's prefix cache decides everything (actors.shard_group): its orders ride the same
broadcast as the plans (`shard`: write this step's payload, read, remove, recover, keep),
the other ranks hand the file work to a disk thread (storage.shard_disk) so their step
loop never waits for the disk, and rank 0 collects what became of each order by polling
(`shard_poll`: a broadcast and a `gather`, between steps). `restore_shards` restores a
snapshot that every rank read on every rank in one operation, or on none.

Failure: any error in a distributed step is fatal to the group (`GroupFailure`): a rank
whose step failed may have left its peers inside a collective, so no rank can go on
alone. Rank 0 fails the requests in flight (error frames), shuts the server down and
exits 1 (api.server, api.cli). A dead peer usually makes the collectives raise ("[ring]
connection to a peer was lost") on the ranks still alive, but a collective issued just
after the failure can wait forever; so every group operation runs under a `Watchdog`
(`--distributed-timeout`, exit 1 with one line), rank 0 pings while idle (a broadcast of
nothing, so a dead peer is found without traffic and the followers' watchdogs, which
also watch their wait for rank 0, stay quiet). mlx.launch also ends the other ranks when
one exits non-zero (its own exit code stays 0). A bad snapshot file is not a failure of
the group: it is a miss on every rank (actors.shard_group).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterable, Iterator

import mlx.core as mx

from tqserve.engine.plan_channel import GroupFailure, PlanChannel, decode_reply, encode
from tqserve.engine.runner import Runner
from tqserve.engine.step import StepPlan, StepResult

STOP = "stop"
PING = "ping"


def init_group() -> Any:
    """The launcher's group; ValueError when this process was not started as one of >= 2."""
    group = mx.distributed.init()
    if group.size() < 2:
        raise ValueError("--distributed needs 2 or more processes started by mlx.launch "
                         "(e.g. `mlx.launch -n 2 --backend ring -- tqserve serve "
                         "--distributed ...`); this process is alone")
    return group


def check_shardable(model: Any, num_ranks: int) -> None:
    """ValueError naming what of `model` does not split over `num_ranks` ranks (heads, KV
    heads, MLP width), or a model type without mlx-lm's `shard`."""
    if not hasattr(model, "shard"):
        raise ValueError(f"model type {getattr(model, 'model_type', type(model).__name__)!r} "
                         "has no shard() in mlx-lm: it cannot run tensor parallel")
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        counts = {"attention heads": attn.n_heads, "KV heads": attn.n_kv_heads,
                  "MLP width": mlp.gate_proj.weight.shape[0]}
        for name, count in counts.items():
            if count % num_ranks:
                raise ValueError(f"layer {i}: {count} {name} do not divide by {num_ranks} "
                                 "ranks: this model cannot run tensor parallel on them")


def shard_model(model: Any, group: Any) -> None:
    """Split `model` over `group` with mlx-lm's `shard` (check_shardable first)."""
    check_shardable(model, group.size())
    model.shard(group)
    mx.eval(model.parameters())


Sampled = tuple[tuple[str, tuple[int, ...]], ...]


def sampled(result: StepResult) -> Sampled:
    """What a step sampled, per row: every rank must get the same (same logits, same seeds);
    a rank that does not would go on with KV of other tokens, so the ranks check."""
    return tuple((o.request_id, tuple(o.tokens)) for o in result.outputs)


class Watchdog:
    """Ends this process (exit 1, one line on stderr) when a group operation runs longer
    than `timeout` seconds: a collective issued after a peer died can wait forever (seen on
    the ring backend), and nothing inside MLX can be interrupted from Python."""

    def __init__(self, rank: int, timeout: float) -> None:
        self.rank, self.timeout = rank, timeout
        self._since: float | None = None
        self._what, self._limit = "", timeout
        threading.Thread(target=self._run, name="tqserve-tp-watchdog", daemon=True).start()

    @contextmanager
    def watch(self, what: str, timeout: float | None = None) -> Iterator[None]:
        self._what, self._limit = what, timeout or self.timeout
        self._since = time.monotonic()
        try:
            yield
        finally:
            self._since = None

    def _run(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout / 4))
            since = self._since
            if since is not None and time.monotonic() - since > self._limit:
                print(f"tqserve: error: tensor-parallel group failed: rank {self.rank}: "
                      f"{self._what} took over {self._limit:g} s (a peer died or hangs; "
                      "--distributed-timeout)", file=sys.stderr, flush=True)
                os._exit(1)


class ShardRestoreError(ValueError):
    """A snapshot some rank could not restore; no rank holds it. `problems`: rank -> why."""

    def __init__(self, problems: dict[int, str]) -> None:
        super().__init__("; ".join(f"rank {rank}: {why}" for rank, why in sorted(problems.items())))
        self.problems = problems


class LeaderRunner(Runner):
    """Rank 0's runner: each state-changing operation is broadcast, then run here, under
    the watchdog; `ping` is the health check the engine sends while idle."""

    def __init__(self, channel: PlanChannel, timeout: float, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.channel = channel
        self.watchdog = Watchdog(0, timeout)
        self._stopped = False
        self._last_send = time.monotonic()
        self._sampled: Sampled = ()

    def _send(self, op: str, *args: Any) -> None:
        if self._stopped:
            raise GroupFailure("the tensor-parallel group has stopped")
        try:
            self.channel.send(encode(op, args))
        except GroupFailure:
            self._stopped = True
            raise
        self._last_send = time.monotonic()

    def execute(self, plan: StepPlan) -> StepResult:
        """Broadcast the plan with the tokens rank 0 sampled in the previous step (each rank
        checks its own against them: see `sampled`), then run it."""
        with self.watchdog.watch("a step"):
            self._send("execute", plan, self._sampled)
            try:
                result = super().execute(plan)
            except GroupFailure:
                raise
            except Exception as exc:  # the peers may wait inside a collective: end the group
                self._stopped = True
                raise GroupFailure(f"rank 0 step failed: {type(exc).__name__}: {exc}") from exc
            self._sampled = sampled(result)
            return result

    def join(self) -> None:
        """The first broadcast, not watched: it waits for every rank to have loaded its
        shard, which may take any time (the watchdog then watches every later operation)."""
        self._send(PING)

    def ping(self, interval: float) -> None:
        """The health check: a broadcast of nothing when none went out for `interval` s, so
        a dead peer is found while idle and the other ranks' watchdogs stay quiet."""
        if not self._stopped and time.monotonic() - self._last_send >= interval:
            with self.watchdog.watch("a health check"):
                self._send(PING)

    def plane_layout(self) -> Any:
        if not self.snapshots.layout_known:  # the probe runs a forward: every rank runs it
            with self.watchdog.watch("the layout probe"):
                self._send("plane_layout")
                return super().plane_layout()
        return super().plane_layout()

    def reset(self) -> None:
        if not self._stopped:  # (close() resets after STOP: nothing left to tell)
            with self.watchdog.watch("a reset"):
                self._send("reset")
        self._sampled = ()
        super().reset()

    def retain(self, keys: Iterable[str]) -> set[str]:
        keys = tuple(keys)
        with self.watchdog.watch("a retain"):
            self._send("retain", keys)
        return super().retain(keys)

    def drop_snapshot(self, key: str) -> None:
        with self.watchdog.watch("a drop"):
            self._send("drop_snapshot", key)
        super().drop_snapshot(key)

    def restore(self, *args: Any, **kwargs: Any) -> int:
        raise GroupFailure("with --distributed a snapshot is restored on every rank "
                           "(restore_shards)")

    def shard(self, op: str, *args: Any) -> None:
        """Broadcast one SSD-tier order (engine.follower.FollowerShards); the other ranks
        answer nothing now: what came of it is collected by `shard_poll`."""
        with self.watchdog.watch("an SSD order"):
            self._send(op, *args)

    def shard_poll(self) -> list[list[dict[str, Any]]]:
        """The other ranks' SSD results since the last poll: one list per rank 1, 2, ..."""
        with self.watchdog.watch("an SSD poll"):
            self._send("shard_poll")
            replies = self._gather(b"")
        return [list(decode_reply(reply)) for reply in replies[1:]]

    def restore_shards(self, key: str, ssd_key: str, order: int, kinds: str, offset: int,
                       boundary: int, planes: dict[str, tuple[bytes, tuple[int, ...], str]],
                       state: str = "") -> int:
        """Hold the snapshot under `key` on every rank: rank 0's from `planes`, each other
        rank's from what its disk read for `order` (file `ssd_key`); its bytes here.
        ShardRestoreError (no rank holds it then) if any rank could not."""
        problems: dict[int, str] = {}
        num_bytes = 0
        with self.watchdog.watch("a restore"):
            self._send("restore", key, ssd_key, order, kinds, offset, boundary, state)
            try:
                num_bytes = super().restore(key, kinds, offset, boundary, planes, state)
            except Exception as exc:  # still answer the gather: every rank issues it
                problems[0] = f"{type(exc).__name__}: {exc}"
            replies = self._gather(b"")
        problems |= {rank: reply.decode("utf-8", "replace")
                     for rank, reply in enumerate(replies) if reply}
        if problems:
            self.drop_snapshot(key)
            raise ShardRestoreError(problems)
        return num_bytes

    def _gather(self, reply: bytes) -> list[bytes]:
        try:
            return self.channel.gather(reply)
        except GroupFailure:
            self._stopped = True
            raise

    def close(self) -> None:
        """Tell the other ranks to stop (they exit 0), then close as usual; a group that is
        already broken stops nothing more."""
        if not self._stopped:
            try:
                with self.watchdog.watch("the stop"):
                    self._send(STOP)
            except GroupFailure as exc:
                print(f"tqserve: distributed: {exc}", file=sys.stderr, flush=True)
            self._stopped = True
        with self.watchdog.watch("the close"):
            super().close()
