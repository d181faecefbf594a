"""`tqserve route` under a replay of the shared Mooncake trace, 3 local replicas of the
bundled model: the reused-prompt fraction with prefix-aware routing stays within 5 points
of one server's, round-robin falls far below; a replica killed mid-replay loses no request
it had queued and not started (one it had but not yet queued ends backend_failed: the
router never resends what a backend may have died of). (Scaled small: whole prefix families, 4-token blocks.)"""

from __future__ import annotations

import json

import pytest

from tests.api.routerkit import start_replica, start_router
from tests.conftest import REPO
from tqserve.client import TokenEvent
from tqserve.tools.replay.metrics import ideal_reuse, summarize
from tqserve.tools.replay.report import summary_table
from tqserve.tools.replay.run import replay
from tqserve.tools.replay.targets import UrlTarget
from tqserve.tools.replay.traces import load_mooncake, subsample_families

MOONCAKE = REPO.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
BLOCK = 4           # tokens per Mooncake block (the trace's are 512)
FAMILIES = 0.005    # of the trace's prefix families: 84 requests, ~8k prompt tokens
CONCURRENCY = 3     # closed loop: the replicas keep up, so reuse is the routing's doing


class _Row:
    def __init__(self, line):
        self.line = line
        self.family = ":".join(map(str, json.loads(line)["hash_ids"][:2]))


@pytest.fixture(scope="module")
def requests(tmp_path_factory):
    """The trace's kept families, as `--family-fraction` keeps them (rows are filtered
    before their token blocks are built: the same requests, without building 12k)."""
    if not MOONCAKE.is_file():
        pytest.skip(f"shared trace not found at {MOONCAKE}")
    with open(MOONCAKE) as f:
        rows = subsample_families([_Row(line) for line in f if line.strip()], FAMILIES)
    path = tmp_path_factory.mktemp("trace") / "kept.jsonl"
    path.write_text("".join(r.line for r in rows))
    return load_mooncake(path, block_tokens=BLOCK, vocab_size=8192, max_output=4)


async def _reuse(url, reqs):
    async with UrlTarget(url) as target:
        before = await target.stats()
        results = await replay(target, reqs, concurrency=CONCURRENCY)
        summary = summarize(results)
        summary.update(stats_before=before, stats_after=await target.stats(), target=url)
        summary["limits"] = await target.limits()
    assert summary["completed"] == len(reqs), [r.error for r in results if r.error]
    return summary["achieved_reuse_fraction"], summary


async def test_prefix_routing_keeps_single_server_reuse(nursery, draft_model, requests):
    ideal = ideal_reuse([r.prompt_tokens for r in requests],
                        [r.arrival_s for r in requests], [None] * len(requests))
    single = await start_replica(nursery, draft_model)
    reuse = {"single": (await _reuse(single.url.replace("http", "ws") + "/v1/stream",
                                     requests))[0]}
    single.kill()
    for policy in ("prefix", "round-robin"):
        replicas = [await start_replica(nursery, draft_model) for _ in range(3)]
        router = await start_router(nursery, [r.url for r in replicas],
                                    routing={"policy": policy, "block_tokens": BLOCK})
        reuse[policy], summary = await _reuse(router.ws_url, requests)
        # a router's /v1/stats has its own line in the table; its context comes from a
        # backend's /v1/models (it reports no queue bounds)
        line = next(x for x in summary_table(summary).splitlines() if "/v1/stats" in x)
        assert line.startswith(f"router /v1/stats after - before: policy {policy}, routed ")
        assert sum(int(x.split()[-1]) for x in line.split("routed ")[1].split(", retries")[0]
                   .split(", ")) == len(requests)
        assert summary["limits"] == {"max_model_len": 32768}
        stats = await router.stats()
        routed = [sum(b["num_routed"].values()) for b in stats["backends"].values()]
        assert sum(routed) == len(requests) and min(routed) > 0  # all 3 replicas served
        router.trigger.set()
        for r in replicas:
            r.kill()
    print(f"reused fraction: ideal {ideal['ideal_reuse_infinite']:.3f}, "
          + ", ".join(f"{k} {v:.3f}" for k, v in reuse.items()))
    assert reuse["single"] > 0.4
    assert reuse["prefix"] >= reuse["single"] - 0.05
    assert reuse["round-robin"] < reuse["single"] - 0.15


class _KillAfter(UrlTarget):
    """Kills a replica once `after` requests have seen their first token."""

    def __init__(self, url, replica, after):
        super().__init__(url)
        self._replica, self._after, self._started = replica, after, 0

    async def generate(self, req, rid):
        first = True
        async for event in super().generate(req, rid):
            if first and isinstance(event, TokenEvent):
                first = False
                self._started += 1
                if self._started == self._after:
                    self._replica.kill()
            yield event


async def test_replica_killed_mid_replay_loses_no_unstarted_request(nursery, draft_model,
                                                                     requests):
    reqs = requests[:30]
    replicas = [await start_replica(nursery, draft_model) for _ in range(3)]
    router = await start_router(nursery, [r.url for r in replicas],
                                routing={"block_tokens": BLOCK}, health_interval=0.05)
    async with _KillAfter(router.ws_url, replicas[1], after=10) as target:
        results = await replay(target, reqs, concurrency=CONCURRENCY)
    failed = [r for r in results if r.error is not None]
    assert len(results) == len(reqs)
    for r in failed:  # only a request already on the dead replica: streaming (lost), or
        # sent and not yet queued there (failed: maybe a poison request, never resent)
        assert (r.error == "backend_lost" and r.output_tokens) or (
            r.error == "backend_failed" and not r.output_tokens), (r.error, r.output_tokens)
    assert len(failed) <= CONCURRENCY
    stats = await router.stats()
    assert stats["backends"][replicas[1].url]["state"] == "unhealthy"
    later = [r for r in results if r.send_s > max(x.send_s for x in failed or results[:1])]
    assert all(r.error is None for r in later)
