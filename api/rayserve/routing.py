"""tqserve's prefix-aware policy as a Ray Serve request router.

`PrefixRouter` routes the calls the front deployment (api.rayserve.front) makes to the
replica deployment. Each call carries its prompt's prefix keys (`prefix_keys`: the chained
16-token block hashes of engine.kvevents for token prompts) and token count; the policy is
least work (api.router.cost.LeastWork over `tqserve route`'s RouteTable): the replica
where the prompt tokens the request waits for plus those it computes itself are fewest,
so the holder of its prefix gets it unless it is further behind than its cache saves. A
request whose prefix a replica is computing right now may wait for it (reason `wait`:
the decision sleeps until the front notes a first token, api.rayserve.progress, and is
made again; at most api.router.cost.MAX_WAIT_S).

What a replica holds comes from its KV events: each replica's `record_routing_stats`
carries the last batches of its prefix cache's events (`kv_next`, `kv_batches`), which
Ray Serve hands every router with the replica set; the router applies the batches it has
not seen. A router that missed batches (they left the replica's window between two
reports) starts that replica's holdings afresh from the window. Between reports, the
router also remembers which prompts each replica has computed (RouteTable's routed-before
LRU), so a follow-up sent before the next report still finds its replica.

The work each replica has left is the router's own books (api.router.cost): a request is
booked when chosen, moved when Ray sends it (`on_request_routed`), done at its first token
(the front's note, api.rayserve.progress: /v1/stream requests) or when it ends
(`on_request_completed`). Load in requests is Ray's own queue length per replica (its
cache, probed where missing), the figure Ray's power-of-two router uses: a replica
`spill_threshold` requests busier than the least loaded is not a candidate. Calls without
keys (a GET, an unparsable body) cost nothing but the wait.

A call that names its replica (`pin`: a WebSocket cancel, a Responses request continuing a
stored response) goes there while that replica runs, under either router: `Pow2Router` is
Ray's power-of-two default with only that added. A pinned replica that is gone leaves the
call to the policy (the replica it reaches answers: 400 or 404 for a lost response).
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

from ray.serve._private.common import ReplicaID
from ray.serve._private.request_router.common import PendingRequest
from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve._private.request_router.replica_wrapper import RunningReplica
from ray.serve.request_router import RequestRouter

from tqserve.api.rayserve.progress import now, take_first_tokens, wait_for_note
from tqserve.api.router.core import KvFeed, Route, RouteTable, RoutingConfig
from tqserve.api.router.cost import LeastWork

log = logging.getLogger("tqserve.rayserve")
ROUTER_CLASS = "tqserve.api.rayserve.routing:PrefixRouter"
POW2_ROUTER_CLASS = "tqserve.api.rayserve.routing:Pow2Router"
WAIT_POLL_S = 0.1  # a waiting decision looks again after this long without a first token


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
    """Least work with prefix affinity over Ray Serve's replicas (module doc)."""

    def initialize_state(self, block_tokens: int = 16, spill_threshold: int = 8,
                         **_: Any) -> None:
        self._config = RoutingConfig(block_tokens=block_tokens,
                                     spill_threshold=spill_threshold)
        self._work: LeastWork | None = None
        self._kv = KvFeed()

    def _sync(self, replicas: Sequence[RunningReplica]) -> LeastWork:
        names = [r.replica_id.unique_id for r in replicas]
        if self._work is None:
            self._work = LeastWork(RouteTable(names, self._config))
        self._work.table.set_backends(names)
        for gone in set(self._kv.seen) - set(names):
            self._kv.forget(gone)
            self._work.forget(gone)
        for r in replicas:
            self._kv.absorb(self._work.table, r.replica_id.unique_id, r.routing_stats or {})
        return self._work

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
        # the front's call (api.rayserve.relay): one may name its replica (`pin`), a
        # request carries its prompt's keys and tokens; a call without them goes by load
        call = front_call(pending_request)
        if (replica := pinned(candidate_replicas, call)) is not None:
            return [[replica]]
        route = await self._decide(candidate_replicas, pending_request, call)
        while route.reason == "wait":  # its prefix is being computed: until a first token
            await wait_for_note(WAIT_POLL_S)
            route = await self._decide(candidate_replicas, pending_request, call)
        table = self._table()
        chosen = next(r for r in candidate_replicas if r.replica_id.unique_id == route.backend)
        rest = sorted((r for r in candidate_replicas if r is not chosen),
                      key=lambda r: table.num_in_flight(r.replica_id.unique_id))
        return [[chosen], rest] if rest else [[chosen]]

    async def _decide(self, candidate_replicas: list[RunningReplica],
                      pending_request: PendingRequest | None, call: Any) -> Route:
        """The policy's decision with what is known now: replicas, KV events, Ray's
        queue lengths, the first tokens the front noted."""
        work = self._sync(list(self.curr_replicas.values()) or candidate_replicas)
        table = work.table
        for name, n in (await self._loads(candidate_replicas)).items():
            table.set_load(name, n)
        for request_id, when in take_first_tokens():
            work.prefilled(request_id, when)
        keys = tuple(getattr(call, "prefix_keys", ()) or ())
        names = {r.replica_id.unique_id for r in candidate_replicas}
        route = work.choose(_request_id(pending_request), keys,
                            getattr(call, "num_prompt_tokens", None),
                            exclude=[n for n in table.names if n not in names], now=now())
        if route.reason != "wait":
            table.started(route, keys, owns=False)  # owned once computed (work.prefilled)
            table.finished(route.backend)  # the load is Ray's queue length, not counted here
        return route

    def _table(self) -> RouteTable:
        if self._work is None:
            raise RuntimeError("no routing table before the first decision")
        return self._work.table

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: Any) -> None:
        """Ray sent a request: book its work on that replica (it may not be the one
        chosen). Cancels and other calls without a prompt are not booked."""
        call = front_call(pending_request)
        request_id = _request_id(pending_request)
        if self._work is not None and request_id is not None and hasattr(
                call, "prefix_keys"):
            self._work.routed(request_id, replica_id.unique_id, call.prefix_keys,
                              call.num_prompt_tokens, signals=_signals(call), now=now())

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """A request ended: no work left of it, its prompt cached on that replica."""
        if self._work is not None:
            self._work.completed(internal_request_id, replica_id.unique_id)

    def statistics(self) -> dict[str, Any]:
        """The policy's books (what `tqserve route`'s /v1/stats reports, per router)."""
        if self._work is None:
            return {"backends": {}, "num_kv_resyncs": self._kv.num_resyncs}
        stats = self._work.table.statistics()
        return {"num_keys": stats.num_keys, "num_kv_resyncs": self._kv.num_resyncs,
                "num_waits": self._work.num_waits,
                "backends": {n: b.num_routed for n, b in stats.backends.items()}}


def _signals(call: Any) -> bool:
    """Whether the front reports the call's first token (api.rayserve.progress): the
    /v1/stream requests it relays frame by frame."""
    return (getattr(call, "frame", None) is not None
            and str(call.scope.get("path", "")).rstrip("/").endswith("/v1/stream"))


def _request_id(pending_request: PendingRequest | None) -> str | None:
    """Ray's id of the request (the front gives each WebSocket request its own)."""
    if pending_request is None:
        return None
    return getattr(pending_request.metadata, "internal_request_id", None) or None

