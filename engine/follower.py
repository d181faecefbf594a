"""A rank other than 0 of `serve --distributed`: run what rank 0 broadcasts, on this shard.

`follow` is the whole life of such a rank (engine.distributed has the design): receive an
operation, run it on this rank's `Runner`, repeat until STOP. No trio, no API.

SSD tier (`--cache-dir`): `FollowerShards` is this rank's side of it, under rank 0's
orders (actors.shard_group). A step's snapshot payloads (write-through writes, write-back
spills: the same plans make the same payloads on every rank) are staged until the next
step; rank 0's `shard_persist` names the ones to write, with the file key and the header
fields rank 0 chose, and every other payload is dropped with the next step. File work
goes to a disk object with one thread of its own (storage.shard_disk.ShardDisk, opened by
the caller's `open_disk(namespace, layout)` at rank 0's recovery order; engine never
imports storage), so this loop never waits for the disk. `shard_poll` hands rank 0 what
the disk did since the last poll, and `restore` holds a snapshot the disk read (after
checking that its header agrees with rank 0's), answering rank 0 either way; a file that
cannot be restored is quarantined here.
"""

from __future__ import annotations

import functools
import signal
import sys
from typing import Any, Callable

from tqserve.engine.distributed import PING, STOP, Sampled, Watchdog, sampled, shard_model
from tqserve.engine.plan_channel import GroupFailure, PlanChannel, decode, encode_reply
from tqserve.engine.runner import Runner
from tqserve.engine.step import SpillPayload, StepResult

_FOLLOWED = {"reset", "retain", "drop_snapshot", "plane_layout"}
_SSD_OPS = {"shard_recover", "shard_keep", "shard_persist", "shard_remove", "shard_read",
            "shard_discard", "shard_poll", "restore"}


class FollowerShards:
    """This rank's SSD-tier orders from rank 0 (see the module doc). The recovery order
    comes after rank 0's layout probe, so `plane_layout` is known here by then."""

    def __init__(self, open_disk: Callable[[str, Any], Any]) -> None:
        self._open_disk = open_disk
        self._disk: Any = None
        self._staged: dict[str, SpillPayload] = {}

    def stage(self, result: StepResult) -> None:
        """The payloads a step serialized; the previous step's are dropped."""
        self._staged = {p.key: p for p in (*result.writes, *result.spills)}

    def run(self, op: str, args: tuple[Any, ...], runner: Runner,
            channel: PlanChannel) -> None:
        """One SSD order; `shard_poll` and `restore` answer through `channel.gather`."""
        if op == "shard_recover":
            if self._disk is None:
                self._disk = self._open_disk(args[0], runner.plane_layout())
            self._disk.recover()
            return
        disk = self._disk
        if disk is None:
            raise GroupFailure(f"SSD order {op!r} before the recovery order")
        match op:
            case "shard_keep":
                disk.keep(args[0])
            case "shard_persist":
                for order, ram_key, key, fields in args[0]:
                    payload = self._staged.pop(ram_key, None)
                    if payload is None:
                        disk.fail_write(order, f"no snapshot {ram_key} staged on this rank")
                    else:
                        disk.write(order, key, {**payload.header, **fields}, payload.planes)
            case "shard_remove":
                disk.remove(args[0])
            case "shard_read":
                disk.read(*args)
            case "shard_discard":
                disk.discard(*args)
            case "shard_poll":
                channel.gather(encode_reply(tuple(disk.take_results())))
            case "restore":
                channel.gather(self._restore(disk, runner, *args).encode())

    @staticmethod
    def _restore(disk: Any, runner: Runner, key: str, ssd_key: str, order: int, kinds: str,
                 offset: int, boundary: int, state: str) -> str:
        """Hold what the disk read for `order` under `key`: "" or what failed."""
        found = disk.take_read(order)
        if found is None:
            return f"no planes of {ssd_key} were read on this rank"
        header, planes = found
        mine = (str(header.extra.get("layer_kinds", "")), header.offset,
                header.minimum_reusable_offset)
        try:
            if mine != (kinds, offset, boundary):
                raise ValueError(f"its layer kinds, offset and boundary {mine!r:.200} are not "
                                 f"rank 0's {(kinds, offset, boundary)!r:.200}")
            runner.restore(key, kinds, offset, boundary,
                           {name: (p.data, p.shape, p.dtype) for name, p in planes.items()},
                           state)
        except Exception as exc:  # a file that cannot be restored, whatever the reason
            reason = f"cannot be restored: {exc}"
            disk.quarantine(ssd_key, reason)
            return reason
        return ""

    def close(self) -> None:
        """Finish the disk's queued work (removals, the last writes)."""
        if self._disk is not None:
            self._disk.close()


def run_follower(config: Any, group: Any,
                 open_disk: Callable[[str, str, Any], Any] | None = None) -> int:
    """A non-zero rank of `serve --distributed`: load and shard the model, build the same
    runner as rank 0 (actors.engine.open_engine), then `follow`. With an SSD tier,
    `open_disk(fingerprint, namespace, layout)` opens this rank's shard of it."""
    from tqserve.engine.kv.factory import cache_factory_for
    from tqserve.engine.model import load_model
    from tqserve.engine.structured import GrammarMasks

    loaded = load_model(config.model, config.dtype, config.quantized_weights)
    shard_model(loaded.model, group)
    make_cache = cache_factory_for(loaded.model, config.turboquant, config.quantized_kv_start,
                                   config.kv_quant, config.kv_group_size,
                                   config.turboquant_decode)
    runner = Runner(loaded.model, make_cache,
                    GrammarMasks(loaded.tokenizer, loaded.vocab_size, loaded.eos_token_ids))
    shards = (FollowerShards(functools.partial(open_disk, loaded.fingerprint))
              if open_disk is not None else None)
    return follow(runner, PlanChannel(group), Watchdog(group.rank(), config.distributed_timeout),
                  shards)


def follow(runner: Runner, channel: PlanChannel, watchdog: Watchdog,
           shards: FollowerShards | None = None) -> int:
    """A non-zero rank's loop: run what rank 0 broadcasts until STOP. Returns the exit
    code: 0 on STOP, 1 (with one line on stderr) when the group failed. SIGINT is ignored
    (Ctrl-C reaches every rank: rank 0 shuts down and sends STOP); SIGTERM still ends it.
    Waiting for rank 0 is watched too (twice the timeout: rank 0's own step may take up to
    one timeout; it pings while idle)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    mine: Sampled = ()  # what this rank sampled in the previous step
    try:
        decode(channel.receive())  # rank 0's join (it may load its shard for any time)
        while True:
            with watchdog.watch("waiting for rank 0", 2 * watchdog.timeout):
                op, args = decode(channel.receive())
            if op == STOP:
                with watchdog.watch("the close"):
                    runner.close()
                    if shards is not None:
                        shards.close()
                return 0
            if op == PING:
                continue
            if op == "execute":
                plan, expected = args
                if expected != mine:
                    raise GroupFailure(f"diverged: rank 0 sampled {expected[:4]}, this rank "
                                       f"{mine[:4]} in the previous step")
                with watchdog.watch("a step"):
                    result = runner.execute(plan)
                mine = sampled(result)
                if shards is not None:
                    shards.stage(result)
                continue
            if op in _SSD_OPS:
                if shards is None:
                    raise GroupFailure(f"SSD order {op!r} from rank 0, but this rank has no "
                                       "--cache-dir")
                with watchdog.watch(op):
                    shards.run(op, args, runner, channel)
                continue
            if op not in _FOLLOWED:
                raise GroupFailure(f"unknown operation {op!r} from rank 0")
            if op == "reset":
                mine = ()
            with watchdog.watch(op):
                getattr(runner, op)(*args)
    except Exception as exc:
        print(f"tqserve: error: tensor-parallel group failed: rank {channel.rank}: "
              f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
