"""tqserve's prefix-aware policy as a Ray Serve request router.

`PrefixRouter` routes the calls the front deployment (api.rayserve.front) makes to the
replica deployment. Each call carries its prompt's prefix keys (`prefix_keys`: the chained
16-token block hashes of engine.kvevents for token prompts); the policy is `tqserve
route`'s own (api.router.core.RouteTable: affinity to the replica holding the deepest
block, spilling to the least loaded when that replica has `spill_threshold` more requests
than it, least loaded without a match), so one policy serves both routers.

What a replica holds comes from its KV events: each replica's `record_routing_stats`
carries the last batches of its prefix cache's events (`kv_next`, `kv_batches`), which
Ray Serve hands every router with the replica set; the router applies the batches it has
not seen. A router that missed batches (they left the replica's window between two
reports) starts that replica's holdings afresh from the window. Between reports, the
router also remembers where it routed each prompt (RouteTable's routed-before LRU), so a
follow-up sent before the next report still finds its replica.

Load is Ray's own queue length per replica (its cache, probed where missing), the figure
Ray's power-of-two router uses. Calls without keys (a GET, an unparsable body) go to the
least loaded replica.

A call that names its replica (`pin`: a WebSocket cancel, a Responses request continuing a
stored response) goes there while that replica runs, under either router: `Pow2Router` is
Ray's power-of-two default with only that added. A pinned replica that is gone leaves the
call to the policy (the replica it reaches answers: 400 or 404 for a lost response).
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

from ray.serve._private.request_router.common import PendingRequest
from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve._private.request_router.replica_wrapper import RunningReplica
from ray.serve.request_router import RequestRouter

from tqserve.api.router.core import KvFeed, RouteTable, RoutingConfig

log = logging.getLogger("tqserve.rayserve")
ROUTER_CLASS = "tqserve.api.rayserve.routing:PrefixRouter"
POW2_ROUTER_CLASS = "tqserve.api.rayserve.routing:Pow2Router"


def front_call(pending_request: PendingRequest | None) -> Any:
    """The front's call (api.rayserve.relay) a pending request carries, or None."""
    return pending_request.args[0] if pending_request and pending_request.args else None


def pinned(candidates: Sequence[RunningReplica], call: Any) -> RunningReplica | None:
    """The candidate the front's call names (`pin`), if it is one of them."""
    pin = getattr(call, "pin", None)
    if pin is None:
        return None
    return next((r for r in candidates if r.replica_id.unique_id == pin), None)


class Pow2Router(PowerOfTwoChoicesRequestRouter):
    """Ray's power-of-two choices, but a pinned call goes to its replica (module doc)."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        if (replica := pinned(candidate_replicas, front_call(pending_request))) is not None:
            return [[replica]]
        return await super().choose_replicas(candidate_replicas, pending_request)


class PrefixRouter(RequestRouter):
    """Prefix affinity with load-aware spill over Ray Serve's replicas (module doc)."""

    def initialize_state(self, block_tokens: int = 16, spill_threshold: int = 8,
                         min_match_fraction: float = 0.5, policy: str = "prefix",
                         **_: Any) -> None:
        self._config = RoutingConfig(policy=policy, block_tokens=block_tokens,
                                     spill_threshold=spill_threshold,
                                     min_match_fraction=min_match_fraction)
        self._table: RouteTable | None = None
        self._kv = KvFeed()

    def _sync(self, replicas: Sequence[RunningReplica]) -> RouteTable:
        names = [r.replica_id.unique_id for r in replicas]
        if self._table is None:
            self._table = RouteTable(names, self._config)
        self._table.set_backends(names)
        for gone in set(self._kv.seen) - set(names):
            self._kv.forget(gone)
        for r in replicas:
            self._kv.absorb(self._table, r.replica_id.unique_id, r.routing_stats or {})
        return self._table

    async def _loads(self, replicas: Sequence[RunningReplica]) -> dict[str, int]:
        loads: dict[str, int] = {}
        missing = []
        for r in replicas:
            n = self._replica_queue_len_cache.get(r.replica_id)
            if n is None:
                missing.append(r)
            else:
                loads[r.replica_id.unique_id] = n
        if missing:
            for r, n in await self._probe_queue_lens(missing, 0):
                loads[r.replica_id.unique_id] = n if n is not None else r.max_ongoing_requests
        return loads

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        if pending_request is not None:  # Ray sleeps between tries only when told to
            pending_request.routing_context.should_backoff = True
        if not candidate_replicas:
            return []
        table = self._sync(list(self.curr_replicas.values()) or candidate_replicas)
        by_name = {r.replica_id.unique_id: r for r in candidate_replicas}
        for name, n in (await self._loads(candidate_replicas)).items():
            table.set_load(name, n)
        # the front's call (api.rayserve.relay): one may name its replica (`pin`), a
        # request carries its prompt's keys; a call without either goes by load
        call = front_call(pending_request)
        if (replica := pinned(candidate_replicas, call)) is not None:
            return [[replica]]
        keys = tuple(getattr(call, "prefix_keys", ()) or ())
        route = table.choose(keys, exclude=[n for n in table.names if n not in by_name])
        table.started(route, keys)
        table.finished(route.backend)  # the load is Ray's queue length, not a count here
        chosen = by_name[route.backend]
        rest = sorted((r for r in candidate_replicas if r is not chosen),
                      key=lambda r: table.num_in_flight(r.replica_id.unique_id))
        return [[chosen], rest] if rest else [[chosen]]

    def statistics(self) -> dict[str, Any]:
        """The policy's books (what `tqserve route`'s /v1/stats reports, per router)."""
        if self._table is None:
            return {"backends": {}, "num_kv_resyncs": self._kv.num_resyncs}
        stats = self._table.statistics()
        return {"num_keys": stats.num_keys, "num_kv_resyncs": self._kv.num_resyncs,
                "backends": {n: b.num_routed for n, b in stats.backends.items()}}
